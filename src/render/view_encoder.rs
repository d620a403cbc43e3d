//! `view` on an encoder (BERT): every token attends to every other, so each layer's maps are
//! stored whole (no mask triangle), the text view shades both directions, and the chart shows
//! the [CLS]/[SEP]/punctuation shares per layer instead of a sink profile. An encoder predicts no
//! next token, so the page has no prediction panel, and the panels that measure a next token's
//! log-probability (ablation, faithfulness) are refused. A sentence pair's page carries
//! `sentence_b_start`, for the head view's "A→B / B→A / A→A / B→B" selector (BertViz's).

use super::{page_of_patterns, value_norms_of, EncodedLayers, ViewOptions};
use crate::analysis::encoder::{shares_of_patterns, shares_of_texts};
use crate::analysis::request::usage;
use crate::analysis::vocab::ModelFacts;
use crate::model::capture::{AttnCache, CaptureSpec, Hook};
use crate::model::forward::RunOptions;
use crate::model::Model;
use crate::render::html::{encode_layer_full, page, EncoderView, ViewData};

/// The longest text an encoder's view takes: its maps are stored whole (8 bits a weight above
/// 256 tokens), so 512 tokens, BERT's positions, make a page of ~25 MB for MiniLM.
pub const MAX_ENCODER_VIEW_TOKENS: usize = 512;

/// The view page of an encoder's `tokens` (types in `opts.token_types`), and the token count.
pub(super) fn page_of(
    model: &Model,
    tokens: &[u32],
    opts: &ViewOptions,
) -> anyhow::Result<(String, usize)> {
    check_encoder_view(model, tokens.len(), opts)?;
    let (n, d) = (tokens.len(), &model.dims);
    let types = pair_types(opts, n);
    let cache = capture_patterns_and_values(model, tokens, opts)?;
    let maps: Vec<&[f32]> = (0..d.n_layers)
        .map(|l| cache.pattern(l).expect("every layer was captured").data)
        .collect();
    let special_shares = shares_of_patterns(model, tokens, maps.iter().copied());
    let encoded = encode_whole(maps.iter().copied(), d.n_layers, d.n_heads, n);
    let values: Vec<Option<Vec<f32>>> = (0..d.n_layers)
        .map(|l| cache.get(l, Hook::V).map(|c| c.data.to_vec()))
        .collect();
    let vnorms = value_norms_of(model, &values, n);
    let texts = model.token_texts(tokens);
    let sentence_b_start = types.iter().position(|&t| t == 1);
    let data = ViewData {
        title: format!(
            "attnscope · {} · {} tokens{}",
            model.info.name,
            n,
            if sentence_b_start.is_some() {
                " · a sentence pair"
            } else {
                ""
            }
        ),
        model: serde_json::to_value(ModelFacts::of(model))?,
        tokens: &texts,
        n_layers: d.n_layers,
        n_heads: d.n_heads,
        n_kv_heads: d.n_kv_heads,
        sink_query: encoded.sink_query,
        sink_all: encoded.sink_all,
        faithfulness: None,
        ablation: None,
        encoding: encoded.encoding,
        patterns: encoded.patterns,
        sparse: encoded.sparse,
        vnorms: Some(vnorms),
        encoder: Some(EncoderView {
            kind: "encoder",
            token_types: types,
            sentence_b_start,
            pair: None,
            special_shares,
        }),
    };
    Ok((page(&data), n))
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

/// One forward of the encoder on `tokens` (of `opts.token_types`), keeping every layer's
/// patterns and values.
fn capture_patterns_and_values(
    model: &Model,
    tokens: &[u32],
    opts: &ViewOptions,
) -> anyhow::Result<AttnCache> {
    let spec = CaptureSpec {
        hooks: vec![Hook::Pattern, Hook::V],
        ..CaptureSpec::patterns()
    };
    let mut cache = AttnCache::new(&spec, tokens.len());
    let run = RunOptions {
        token_types: opts.token_types.clone(),
        ..Default::default()
    };
    model.forward(tokens, &run, &mut cache)?;
    Ok(cache)
}

/// Every layer's `[heads, n, n]` map stored whole for the page (an encoder's page has no sink
/// profile).
fn encode_whole<'a>(
    maps: impl Iterator<Item = &'a [f32]>,
    layers: usize,
    heads: usize,
    n: usize,
) -> EncodedLayers {
    let (mut encoding, mut patterns) = ("u16", Vec::with_capacity(layers));
    for p in maps {
        let (e, b64) = encode_layer_full(p, heads, n);
        encoding = e;
        patterns.push(b64);
    }
    EncodedLayers {
        encoding,
        patterns,
        sparse: None,
        sink_query: Vec::new(),
        sink_all: Vec::new(),
    }
}

/// The encoder's page for bidirectional patterns `[layers, heads, n, n]` computed elsewhere
/// (checked by [`super::pattern_page_pair`]): no values, so no norm-based shading; [CLS] and
/// [SEP] known by their texts; with `pair` (the second text's first position, the selection
/// shown first) the pair selector.
pub(super) fn pattern_page_of(
    patterns: &[f32],
    [layers, heads, n, _]: [usize; 4],
    tokens: &[String],
    title: &str,
    pair: Option<(usize, &'static str)>,
) -> anyhow::Result<String> {
    if n > MAX_ENCODER_VIEW_TOKENS {
        return Err(usage(format!(
            "{n} tokens of bidirectional attention; an encoder's view takes at most {MAX_ENCODER_VIEW_TOKENS}"
        )));
    }
    let maps = patterns.chunks(heads * n * n);
    let special_shares = shares_of_texts(tokens, heads, maps.clone());
    let encoded = encode_whole(maps, layers, heads, n);
    let encoder = EncoderView {
        kind: "encoder",
        token_types: (0..n)
            .map(|i| u32::from(pair.is_some_and(|(b, _)| i >= b)))
            .collect(),
        sentence_b_start: pair.map(|(b, _)| b),
        pair: pair.map(|(_, s)| s),
        special_shares,
    };
    Ok(page_of_patterns(
        title,
        tokens,
        [layers, heads],
        encoded,
        Some(encoder),
    ))
}
