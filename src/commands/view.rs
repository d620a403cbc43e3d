//! `attnscope view` (and `serve`, Python's `view`): a text's attention on a model, with the
//! panels asked for, as a [`ViewReport`] that [`crate::render::view::page`] turns into the page.
//! The forward, the value norms, the faithfulness and ablation panels and an encoder's
//! \[CLS\]/\[SEP\]/punctuation shares are computed here; `render/` only encodes and formats them.

use crate::analysis::encoder::shares_of_patterns;
use crate::analysis::faithfulness::{run as run_faith, FaithSettings};
pub use crate::analysis::intervene::AblateMethod;
use crate::analysis::intervene::{ablate, AblateOptions, AblateReport};
use crate::analysis::norms::{all_value_norms, Values};
use crate::analysis::request::usage;
use crate::analysis::vocab::{ModelFacts, Target};
use crate::model::capture::{AttnCache, CaptureSpec, Hook};
use crate::model::forward::RunOptions;
use crate::model::Model;
use crate::render::progress::{on_bar, progress_bar};
use crate::render::sparse::{SparseView, FULL_MAX};
use crate::render::view::{
    EncoderFacts, ViewMaps, ViewReport, MAX_ENCODER_VIEW_TOKENS, MAX_VIEW_TOKENS,
};

/// `zero` or `mean`: how `view --ablate` (and the Python `view(ablate=...)`) removes a head.
pub fn ablate_method(s: &str) -> anyhow::Result<AblateMethod> {
    match s {
        "zero" => Ok(AblateMethod::Zero),
        "mean" => Ok(AblateMethod::Mean),
        _ => Err(usage(format!(
            "unknown ablation method {s:?}: valid values are `zero` (the head's output set to 0) and `mean` (set to its mean over the text's positions)"
        ))),
    }
}

/// What a view page shows beside the attention.
#[derive(Clone, Debug, Default)]
pub struct ViewOptions {
    /// the faithfulness (occlusion) panel
    pub faithfulness: bool,
    /// the ablation panel: every head ablated this way (see [`ablate`])
    pub ablate: Option<AblateMethod>,
    /// the token the ablation and faithfulness panels measure (None: the model's top next token)
    pub target: Option<Target>,
    /// a progress bar for the ablations on standard error, where it is a terminal (the CLI)
    pub progress: bool,
    /// an encoder's token types (a sentence pair's 0/1, as [`crate::model::Model::encode_pair`]
    /// gives them); `None`: all 0, one text
    pub token_types: Option<Vec<u32>>,
    /// a pair's segments where they differ from its types (RoBERTa, DistilBERT: no types, but
    /// two texts; [`crate::model::Model::encode_pair_segments`]), for the page's B marks and
    /// its A→B selector; `None`: the types
    pub segments: Option<Vec<u32>>,
}

/// The view page for `text` on `model` (also served by `attnscope serve`), and the token count.
pub fn view_html(
    model: &Model,
    text: &str,
    bos: bool,
    faithfulness: bool,
) -> anyhow::Result<(String, usize)> {
    view_html_with(
        model,
        text,
        bos,
        &ViewOptions {
            faithfulness,
            ..ViewOptions::default()
        },
    )
}

/// The view page with the panels `opts` asks for, and the token count.
pub fn view_html_with(
    model: &Model,
    text: &str,
    bos: bool,
    opts: &ViewOptions,
) -> anyhow::Result<(String, usize)> {
    view_html_tokens(model, &model.encode(text, bos)?, opts)
}

/// The view page of `tokens` (a text already encoded, or a chat prompt through the model's
/// template) with the panels `opts` asks for, and the token count: [`view`], then
/// [`crate::render::view::page`].
pub fn view_html_tokens(
    model: &Model,
    tokens: &[u32],
    opts: &ViewOptions,
) -> anyhow::Result<(String, usize)> {
    let report = view(model, tokens, opts)?;
    Ok((crate::render::view::page(&report), tokens.len()))
}

/// What the view page of `tokens` shows, with the panels `opts` asks for: one forward keeping
/// every layer's patterns and values (above [`FULL_MAX`] tokens, each row's top weights), the
/// value norms, and the panels' reports.
pub fn view(model: &Model, tokens: &[u32], opts: &ViewOptions) -> anyhow::Result<ViewReport> {
    if model.is_encoder() {
        return encoder_view(model, tokens, opts);
    }
    check_view(model, tokens.len(), opts)?;
    let target = opts.target.clone().unwrap_or(Target::Next);
    let (maps, value_norms) = capture_layers(model, tokens)?;
    let (faithfulness, ablation) = panels(model, tokens, opts, target)?;
    report(
        model,
        tokens,
        maps,
        value_norms,
        (faithfulness, ablation),
        None,
    )
}

/// The report's common part: the model, its tokens' texts and shape, with `maps`, the value
/// norms, the panels and an encoder's facts.
fn report(
    model: &Model,
    tokens: &[u32],
    maps: ViewMaps,
    value_norms: Vec<Vec<f32>>,
    (faithfulness, ablation): (Option<serde_json::Value>, Option<serde_json::Value>),
    encoder: Option<EncoderFacts>,
) -> anyhow::Result<ViewReport> {
    let d = &model.dims;
    Ok(ViewReport {
        model_name: model.info.name.clone(),
        model: serde_json::to_value(ModelFacts::of(model))?,
        tokens: model.token_texts(tokens),
        n_layers: d.n_layers,
        n_heads: d.n_heads,
        n_kv_heads: d.n_kv_heads,
        maps,
        value_norms,
        faithfulness,
        ablation,
        encoder,
    })
}

/// Refuses what the view cannot show for `n` tokens: `--target` without a panel that measures
/// it, a text longer than [`MAX_VIEW_TOKENS`], the panels above [`FULL_MAX`] tokens.
fn check_view(model: &Model, n: usize, opts: &ViewOptions) -> anyhow::Result<()> {
    let d = &model.dims;
    let faithfulness = opts.faithfulness;
    if opts.target.is_some() && !faithfulness && opts.ablate.is_none() {
        return Err(usage(
            "--target names the token the ablation (--ablate) and faithfulness (--faithfulness) panels measure; ask for one of them",
        ));
    }
    if n > MAX_VIEW_TOKENS {
        return Err(usage(format!("the text is {n} tokens; the view takes at most {MAX_VIEW_TOKENS} (use `attnscope sinks` for longer texts: it streams any length up to the context)")));
    }
    if faithfulness && n > FULL_MAX {
        return Err(usage(format!("--faithfulness occludes every token (3 forwards each); the view runs it on texts of at most {FULL_MAX} tokens, and this one is {n} (run `attnscope faithfulness` on a shorter text)")));
    }
    if opts.ablate.is_some() && n > FULL_MAX {
        return Err(usage(format!("--ablate removes every head in turn ({} runs over the text); the view runs it on texts of at most {FULL_MAX} tokens, and this one is {n} (run `attnscope ablate` on a longer text)", d.n_layers * d.n_heads)));
    }
    Ok(())
}

/// Per layer, the value norms `‖W_Oʰ vⱼ‖` of every head and key.
fn value_norms_of(model: &Model, values: &[Option<Vec<f32>>], n: usize) -> Vec<Vec<f32>> {
    let d = &model.dims;
    values
        .iter()
        .enumerate()
        .map(|(l, v)| {
            let v = v.as_deref().expect("the values of every layer were kept");
            let vals = Values::pos_major(v, n, d.n_kv_heads, d.head_dim);
            all_value_norms(model, l, &vals)
        })
        .collect()
}

/// Every layer's weights and the value norms: whole maps up to [`FULL_MAX`] tokens, streamed
/// into the bounded encoding above (with a progress bar).
fn capture_layers(model: &Model, tokens: &[u32]) -> anyhow::Result<(ViewMaps, Vec<Vec<f32>>)> {
    let (n, d) = (tokens.len(), &model.dims);
    if n <= FULL_MAX {
        let (maps, values) = patterns_and_values(model, tokens, None)?;
        return Ok((ViewMaps::Whole(maps), value_norms_of(model, &values, n)));
    }
    let mut sv = SparseView::new(d.n_layers, d.n_heads, n, true);
    let bar = progress_bar("view: {msg} [{bar:30}] layer {pos}/{len} ({elapsed}, {eta} left)");
    bar.set_length(d.n_layers as u64);
    bar.set_message(format!("{n} tokens"));
    let b2 = bar.clone();
    sv.on_layer = Some(Box::new(move |l| b2.set_position(l as u64 + 1)));
    model.forward(tokens, &RunOptions::last_logits(n), &mut sv)?;
    bar.finish_and_clear();
    let vn = value_norms_of(model, &sv.values, n);
    Ok((ViewMaps::Top(sv), vn))
}

/// One forward on `tokens` (an encoder's `token_types`) keeping every layer's whole patterns
/// (`[heads, n, n]` each) and values.
#[allow(clippy::type_complexity)]
fn patterns_and_values(
    model: &Model,
    tokens: &[u32],
    token_types: Option<Vec<u32>>,
) -> anyhow::Result<(Vec<Vec<f32>>, Vec<Option<Vec<f32>>>)> {
    let (n, layers) = (tokens.len(), model.dims.n_layers);
    let spec = CaptureSpec {
        hooks: vec![Hook::Pattern, Hook::V],
        ..CaptureSpec::patterns()
    };
    let mut cache = AttnCache::new(&spec, n);
    let run = if model.is_encoder() {
        RunOptions {
            token_types,
            ..Default::default()
        }
    } else {
        RunOptions::last_logits(n)
    };
    model.forward(tokens, &run, &mut cache)?;
    let maps = (0..layers)
        .map(|l| {
            cache
                .take(l, Hook::Pattern)
                .expect("every layer was captured")
                .data
        })
        .collect();
    let values = (0..layers)
        .map(|l| cache.take(l, Hook::V).map(|c| c.data))
        .collect();
    Ok((maps, values))
}

/// `attnscope ablate`'s report, with its progress bar when `bar` (and standard error is a terminal).
fn ablate_with_bar(
    bar: bool,
    model: &Model,
    tokens: &[u32],
    opts: &AblateOptions,
) -> anyhow::Result<AblateReport> {
    let bar = if bar {
        progress_bar("view: ablations [{bar:30}] {pos}/{len} ({eta})")
    } else {
        indicatif::ProgressBar::hidden()
    };
    let report = ablate(model, tokens, opts, on_bar(&bar))?;
    bar.finish_and_clear();
    Ok(report)
}

/// The faithfulness panel's report and the ablation panel's, where `opts` asks for them, both
/// measuring `target`.
fn panels(
    model: &Model,
    tokens: &[u32],
    opts: &ViewOptions,
    target: Target,
) -> anyhow::Result<(Option<serde_json::Value>, Option<serde_json::Value>)> {
    let faithfulness = if opts.faithfulness {
        Some(serde_json::to_value(run_faith(
            model,
            tokens,
            &FaithSettings {
                target: target.clone(),
                replacement: " ".into(),
                seed: 7,
                gradients: true,
                ig_steps: 32,
            },
            |_, _| {},
        )?)?)
    } else {
        None
    };
    // the same report `attnscope ablate --json` prints, with its defaults; through its text, so
    // the page holds the same digits (each f32 as its shortest decimal, not widened to f64)
    let ablation = match opts.ablate {
        Some(method) => Some(serde_json::from_str(&serde_json::to_string(
            &ablate_with_bar(
                opts.progress,
                model,
                tokens,
                &AblateOptions {
                    method,
                    target,
                    positions: None,
                    mlp: false,
                    batch_rows: 1024,
                },
            )?,
        )?)?),
        None => None,
    };
    Ok((faithfulness, ablation))
}

/// The view of an encoder's `tokens` (types in `opts.token_types`): every map whole, the
/// value norms, the \[CLS\]/\[SEP\]/punctuation shares and which text each token belongs to.
fn encoder_view(model: &Model, tokens: &[u32], opts: &ViewOptions) -> anyhow::Result<ViewReport> {
    check_encoder_view(model, tokens.len(), opts)?;
    let n = tokens.len();
    let token_types = pair_types(opts, n);
    let (maps, values) = patterns_and_values(model, tokens, opts.token_types.clone())?;
    let special_shares = shares_of_patterns(model, tokens, maps.iter().map(Vec::as_slice));
    let value_norms = value_norms_of(model, &values, n);
    let encoder = EncoderFacts {
        sentence_b_start: token_types.iter().position(|&t| t == 1),
        token_types,
        special_shares,
    };
    let maps = ViewMaps::Whole(maps);
    report(
        model,
        tokens,
        maps,
        value_norms,
        (None, None),
        Some(encoder),
    )
}

/// Refuses what an encoder's view cannot show for `n` tokens: the panels that measure a next
/// token, a text longer than [`MAX_ENCODER_VIEW_TOKENS`], types or segments not one per token.
fn check_encoder_view(model: &Model, n: usize, opts: &ViewOptions) -> anyhow::Result<()> {
    if opts.faithfulness || opts.ablate.is_some() || opts.target.is_some() {
        return Err(usage(format!(
            "--faithfulness, --ablate and --target measure the log-probability of a next token; {} is an encoder (bidirectional attention, no next-token prediction), so its view shows the attention alone",
            model.info.name
        )));
    }
    if n > MAX_ENCODER_VIEW_TOKENS {
        return Err(usage(format!(
            "the text is {n} tokens; an encoder's view stores every weight and takes at most {MAX_ENCODER_VIEW_TOKENS}"
        )));
    }
    for (what, t) in [
        ("token types", &opts.token_types),
        ("segments", &opts.segments),
    ] {
        if let Some(t) = t.as_ref().filter(|t| t.len() != n) {
            return Err(usage(format!(
                "{} {what} for {n} tokens (one per token)",
                t.len()
            )));
        }
    }
    Ok(())
}

/// Which text each of the `n` tokens belongs to: the pair's segments, else its types, else all
/// the first.
fn pair_types(opts: &ViewOptions, n: usize) -> Vec<u32> {
    opts.segments
        .clone()
        .or_else(|| opts.token_types.clone())
        .unwrap_or_else(|| vec![0; n])
}
