//! `view` on an encoder (BERT): every token attends to every other, so each layer's maps are
//! stored whole (no mask triangle), the text view shades both directions, and the chart shows
//! the \[CLS\]/\[SEP\]/punctuation shares per layer instead of a sink profile. An encoder predicts no
//! next token, so the page has no prediction panel, and the panels that measure a next token's
//! log-probability (ablation, faithfulness) are refused ([`crate::commands::view`]). A sentence pair's page carries
//! `sentence_b_start`, for the head view's "A→B / B→A / A→A / B→B" selector (BertViz's).

use super::{encoded_value_norms, page_of_patterns, EncodedLayers, ViewMaps, ViewReport};
use crate::analysis::encoder::shares_of_texts;
use crate::analysis::request::usage;
use crate::render::html::{encode_layer_full, page, EncoderView, ViewData};

/// The longest text an encoder's view takes: its maps are stored whole (8 bits a weight above
/// 256 tokens), so 512 tokens, BERT's positions, make a page of ~25 MB for MiniLM.
pub const MAX_ENCODER_VIEW_TOKENS: usize = 512;

/// The view page of an encoder's report ([`crate::commands::view::view`] on an encoder).
pub(super) fn page_of(report: &ViewReport) -> String {
    let facts = report.encoder.as_ref().expect("an encoder's report");
    let (n, layers, heads) = (report.tokens.len(), report.n_layers, report.n_heads);
    let ViewMaps::Whole(maps) = &report.maps else {
        unreachable!("an encoder's maps are whole")
    };
    let encoded = encode_whole(maps.iter().map(Vec::as_slice), layers, heads, n);
    let pair = facts.sentence_b_start.is_some();
    let data = ViewData {
        title: format!(
            "attnscope · {} · {} tokens{}",
            report.model_name,
            n,
            if pair { " · a sentence pair" } else { "" }
        ),
        model: report.model.clone(),
        tokens: &report.tokens,
        n_layers: layers,
        n_heads: heads,
        n_kv_heads: report.n_kv_heads,
        sink_query: encoded.sink_query,
        sink_all: encoded.sink_all,
        faithfulness: None,
        ablation: None,
        encoding: encoded.encoding,
        patterns: encoded.patterns,
        sparse: encoded.sparse,
        vnorms: Some(encoded_value_norms(report)),
        encoder: Some(EncoderView {
            kind: "encoder",
            token_types: facts.token_types.clone(),
            sentence_b_start: facts.sentence_b_start,
            pair: None,
            special_shares: facts.special_shares.clone(),
        }),
    };
    page(&data)
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
/// (checked by [`super::pattern_page_pair`]): no values, so no norm-based shading; \[CLS\] and
/// \[SEP\] known by their texts; with `pair` (the second text's first position, the selection
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
