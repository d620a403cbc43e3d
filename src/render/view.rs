//! The view page (`attnscope view`, `serve`, Python's `view` and `viz.attention_heads`): a text's
//! attention on a model, or patterns computed elsewhere, as one self-contained HTML page.

use crate::analysis::collect::Collector;
use crate::analysis::faithfulness::{run as run_faith, FaithOptions};
pub use crate::analysis::intervene::AblateMethod;
use crate::analysis::intervene::{ablate, AblateOptions};
use crate::analysis::norms::{all_value_norms, Values};
use crate::analysis::request::usage;
use crate::analysis::vocab::ModelFacts;
use crate::analysis::vocab::Target;
use crate::model::capture::{AttnCache, CaptureSpec, Hook, Observer};
use crate::model::forward::RunOptions;
use crate::render::html::{encode_layer, page, EncoderView, SparseLayers, ViewData};
use crate::render::sparse::{encode_value_norms, SparseView, FULL_MAX, TOP_HEAD, TOP_MEAN};

#[path = "view_encoder.rs"]
mod encoder;
pub use encoder::MAX_ENCODER_VIEW_TOKENS;

/// The longest text a view takes: above [`FULL_MAX`] tokens it stores each row's top weights
/// (see [`crate::render::sparse`]), so the page stays bounded.
pub const MAX_VIEW_TOKENS: usize = 4096;

/// Every layer of a view: its weights encoded for the page, and the sink profile.
struct EncodedLayers {
    encoding: &'static str,
    patterns: Vec<String>,
    sparse: Option<SparseLayers>,
    sink_query: Vec<f32>,
    sink_all: Vec<f32>,
}

/// Encodes each layer's `[heads, n, n]` map: every weight up to [`FULL_MAX`] tokens, the bounded
/// encoding above. The sink numbers come from the same analysis as `inspect`, fed the maps.
fn encode_layers<'a>(
    maps: impl Iterator<Item = &'a [f32]>,
    layers: usize,
    heads: usize,
    n: usize,
) -> EncodedLayers {
    if n > FULL_MAX {
        let mut sv = SparseView::new(layers, heads, n, false);
        for (l, p) in maps.enumerate() {
            sv.attention_block(l, Hook::Pattern, 0, [heads, n, n], p);
        }
        return sparse_layers(&sv, layers);
    }
    let mut c = Collector::new(layers, heads, n, n - 1);
    let (mut encoding, mut patterns) = ("u16", Vec::with_capacity(layers));
    for (l, p) in maps.enumerate() {
        c.attention_block(l, Hook::Pattern, 0, [heads, n, n], p);
        let (enc, b64) = encode_layer(p, heads, n);
        encoding = enc;
        patterns.push(b64);
    }
    EncodedLayers {
        encoding,
        patterns,
        sparse: None,
        sink_query: (0..layers).map(|l| c.sink_query(l)).collect(),
        sink_all: (0..layers).map(|l| c.sink_all_queries(l)).collect(),
    }
}

fn sparse_layers(sv: &SparseView, layers: usize) -> EncodedLayers {
    use rayon::prelude::*;
    EncodedLayers {
        encoding: "topk",
        patterns: Vec::new(),
        sparse: Some(SparseLayers {
            k_head: TOP_HEAD,
            k_mean: TOP_MEAN,
            layers: (0..layers)
                .into_par_iter()
                .map(|l| sv.encode_layer(l))
                .collect(),
        }),
        sink_query: sv.sink_query(),
        sink_all: sv.sink_all(),
    }
}

/// Per layer, the value norms of every head and key, encoded for the page.
fn value_norms_of(
    model: &crate::model::Model,
    values: &[Option<Vec<f32>>],
    n: usize,
) -> Vec<String> {
    let d = &model.dims;
    values
        .iter()
        .enumerate()
        .map(|(l, v)| {
            let v = v.as_deref().expect("the values of every layer were kept");
            let vals = Values::pos_major(v, n, d.n_kv_heads, d.head_dim);
            encode_value_norms(&all_value_norms(model, l, &vals))
        })
        .collect()
}

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

/// `attnscope ablate`'s report, with its progress bar when `bar` (and standard error is a terminal).
fn ablate_with_bar(
    bar: bool,
    model: &crate::model::Model,
    tokens: &[u32],
    opts: &AblateOptions,
) -> anyhow::Result<crate::analysis::intervene::AblateReport> {
    let bar = if bar {
        super::progress::progress_bar("view: ablations [{bar:30}] {pos}/{len} ({eta})")
    } else {
        indicatif::ProgressBar::hidden()
    };
    let report = ablate(model, tokens, opts, super::progress::on_bar(&bar))?;
    bar.finish_and_clear();
    Ok(report)
}

/// The view page for `text` on `model` (also served by `attnscope serve`), and the token count.
pub fn view_html(
    model: &crate::model::Model,
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
    model: &crate::model::Model,
    text: &str,
    bos: bool,
    opts: &ViewOptions,
) -> anyhow::Result<(String, usize)> {
    view_html_tokens(model, &model.encode(text, bos)?, opts)
}

/// The view page of `tokens` (a text already encoded, or a chat prompt through the model's
/// template) with the panels `opts` asks for, and the token count.
pub fn view_html_tokens(
    model: &crate::model::Model,
    tokens: &[u32],
    opts: &ViewOptions,
) -> anyhow::Result<(String, usize)> {
    if model.is_encoder() {
        return encoder::page_of(model, tokens, opts);
    }
    check_view(model, tokens.len(), opts)?;
    let tokens = tokens.to_vec();
    let (n, d) = (tokens.len(), &model.dims);
    let target = opts.target.clone().unwrap_or(Target::Next);
    let (layers, vnorms) = capture_layers(model, &tokens)?;
    let (faithfulness, ablation) = panels(model, &tokens, opts, target)?;
    let texts = model.token_texts(&tokens);
    let data = ViewData {
        title: format!("attnscope · {} · {} tokens", model.info.name, n),
        model: serde_json::to_value(ModelFacts::of(model))?,
        tokens: &texts,
        n_layers: d.n_layers,
        n_heads: d.n_heads,
        n_kv_heads: d.n_kv_heads,
        sink_query: layers.sink_query,
        sink_all: layers.sink_all,
        faithfulness,
        ablation,
        encoding: layers.encoding,
        patterns: layers.patterns,
        sparse: layers.sparse,
        vnorms: Some(vnorms),
        encoder: None,
    };
    Ok((page(&data), n))
}

/// Refuses what the view cannot show for `n` tokens: `--target` without a panel that measures
/// it, a text longer than [`MAX_VIEW_TOKENS`], the panels above [`FULL_MAX`] tokens.
fn check_view(model: &crate::model::Model, n: usize, opts: &ViewOptions) -> anyhow::Result<()> {
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

/// Every layer's weights encoded for the page, and the value norms: whole maps up to
/// [`FULL_MAX`] tokens, streamed into the bounded encoding above (with a progress bar).
fn capture_layers(
    model: &crate::model::Model,
    tokens: &[u32],
) -> anyhow::Result<(EncodedLayers, Vec<String>)> {
    let (n, d) = (tokens.len(), &model.dims);
    Ok(if n > FULL_MAX {
        let mut sv = SparseView::new(d.n_layers, d.n_heads, n, true);
        let bar = super::progress::progress_bar(
            "view: {msg} [{bar:30}] layer {pos}/{len} ({elapsed}, {eta} left)",
        );
        bar.set_length(d.n_layers as u64);
        bar.set_message(format!("{n} tokens"));
        let b2 = bar.clone();
        sv.on_layer = Some(Box::new(move |l| b2.set_position(l as u64 + 1)));
        model.forward(tokens, &RunOptions::last_logits(n), &mut sv)?;
        bar.finish_and_clear();
        let vn = value_norms_of(model, &sv.values, n);
        (sparse_layers(&sv, d.n_layers), vn)
    } else {
        let spec = CaptureSpec {
            hooks: vec![Hook::Pattern, Hook::V],
            ..CaptureSpec::patterns()
        };
        let mut cache = AttnCache::new(&spec, n);
        model.forward(tokens, &RunOptions::last_logits(n), &mut cache)?;
        let layers = encode_layers(
            (0..d.n_layers).map(|l| cache.pattern(l).expect("every layer was captured").data),
            d.n_layers,
            d.n_heads,
            n,
        );
        let values: Vec<Option<Vec<f32>>> = (0..d.n_layers)
            .map(|l| cache.get(l, Hook::V).map(|c| c.data.to_vec()))
            .collect();
        (layers, value_norms_of(model, &values, n))
    })
}

/// The faithfulness panel's report and the ablation panel's, where `opts` asks for them, both
/// measuring `target`.
fn panels(
    model: &crate::model::Model,
    tokens: &[u32],
    opts: &ViewOptions,
    target: Target,
) -> anyhow::Result<(Option<serde_json::Value>, Option<serde_json::Value>)> {
    let faithfulness = if opts.faithfulness {
        Some(serde_json::to_value(run_faith(
            model,
            tokens,
            &FaithOptions {
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

/// The view page for attention patterns computed elsewhere: `patterns` is `[layers, heads, n,
/// n]` (rows sum to 1, masked weights 0), `tokens` the n token texts. Used by the Python
/// package's `attnscope.viz.attention_heads`. Patterns with weight above the diagonal (an
/// encoder's) get the encoder's page: whole maps, the [CLS]/[SEP]/punctuation chart.
pub fn pattern_page(
    patterns: &[f32],
    shape: [usize; 4],
    tokens: &[String],
    title: &str,
) -> anyhow::Result<String> {
    pattern_page_pair(patterns, shape, tokens, title, None, "all")
}

/// The head view's selections of a sentence pair, by the name Python's
/// `viz.attention_heads(pair=...)` takes (`"a->b"`: A's queries, B's keys), and the page's own
/// (its selector's value).
pub const PAIR_SELECTIONS: [(&str, &str); 5] = [
    ("all", "all"),
    ("a->b", "AB"),
    ("b->a", "BA"),
    ("a->a", "AA"),
    ("b->b", "BB"),
];

/// The page's value for a pair selection named `a->b` (any case; `A→B` and `AB` too).
pub fn pair_selection(name: &str) -> anyhow::Result<&'static str> {
    let key = name
        .trim()
        .to_ascii_lowercase()
        .replace('→', "->")
        .replace(' ', "");
    PAIR_SELECTIONS
        .iter()
        .find(|(k, v)| *k == key || v.to_ascii_lowercase() == key)
        .map(|(_, v)| *v)
        .ok_or_else(|| {
            usage(format!(
                "pair={name:?} is not a selection: use one of {}",
                PAIR_SELECTIONS
                    .iter()
                    .map(|(k, _)| format!("{k:?}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
}

/// [`pattern_page`] for a sentence pair: `sentence_b_start` (BertViz's) is the first position of
/// the second text, which turns on the head view's selector (all, A→B, B→A, A→A, B→B), shown
/// first at `pair` ([`pair_selection`]'s names). Bidirectional patterns only (a pair is an
/// encoder's input); `pair` other than `all` needs `sentence_b_start`.
pub fn pattern_page_pair(
    patterns: &[f32],
    shape: [usize; 4],
    tokens: &[String],
    title: &str,
    sentence_b_start: Option<usize>,
    pair: &str,
) -> anyhow::Result<String> {
    let selection = pair_selection(pair)?;
    if selection != "all" && sentence_b_start.is_none() {
        return Err(usage(format!(
            "pair={pair:?} selects one sentence of a pair: give sentence_b_start, the first position of the second text"
        )));
    }
    let [layers, heads, n, n2] = shape;
    if n != n2
        || layers == 0
        || heads == 0
        || n == 0
        || patterns.len() != layers * heads * n * n
        || tokens.len() != n
    {
        return Err(usage(format!(
            "attention of shape {shape:?} ({} values) with {} tokens: expected [layers, heads, n, n] with n tokens",
            patterns.len(),
            tokens.len()
        )));
    }
    if n > MAX_VIEW_TOKENS {
        return Err(usage(format!(
            "{n} tokens; the view takes at most {MAX_VIEW_TOKENS}"
        )));
    }
    if let Some(bad) = patterns
        .iter()
        .find(|w| !w.is_finite() || **w < -1e-6 || **w > 1.0 + 1e-6)
    {
        return Err(usage(format!("attention weight {bad} is not in [0, 1]")));
    }
    // weight above the diagonal: an encoder's (bidirectional) maps, drawn whole
    let bidirectional = patterns
        .chunks(n * n)
        .any(|m| (0..n).any(|i| m[i * n + i + 1..(i + 1) * n].iter().any(|&w| w > 1e-6)));
    if let Some(b) = sentence_b_start {
        if !bidirectional {
            return Err(usage(
                "sentence_b_start marks a sentence pair, an encoder's input; these patterns have no weight above the diagonal (a decoder's, causal)",
            ));
        }
        if b == 0 || b >= n {
            return Err(usage(format!(
                "sentence_b_start={b} is out of range: both texts need a token (1..={})",
                n - 1
            )));
        }
    }
    if bidirectional {
        return encoder::pattern_page_of(
            patterns,
            shape,
            tokens,
            title,
            sentence_b_start.map(|b| (b, selection)),
        );
    }
    let encoded = encode_layers(patterns.chunks(heads * n * n), layers, heads, n);
    Ok(page_of_patterns(
        title,
        tokens,
        [layers, heads],
        encoded,
        None,
    ))
}

/// The page of `[layers, heads, n, n]` patterns computed elsewhere ([`pattern_page_pair`]),
/// `encoded`: named by `title` alone, every head its own key/value head, no panels and no
/// values; `encoder` for bidirectional patterns.
fn page_of_patterns(
    title: &str,
    tokens: &[String],
    [layers, heads]: [usize; 2],
    encoded: EncodedLayers,
    encoder: Option<EncoderView>,
) -> String {
    let data = ViewData {
        title: title.to_string(),
        model: serde_json::json!({"name": title, "n_layers": layers, "n_heads": heads}),
        tokens,
        n_layers: layers,
        n_heads: heads,
        n_kv_heads: heads,
        sink_query: encoded.sink_query,
        sink_all: encoded.sink_all,
        faithfulness: None,
        ablation: None,
        encoding: encoded.encoding,
        patterns: encoded.patterns,
        sparse: encoded.sparse,
        vnorms: None,
        encoder,
    };
    page(&data)
}
