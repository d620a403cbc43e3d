//! The view page (`attnscope view`, `serve`, Python's `view` and `viz.attention_heads`): a
//! [`ViewReport`] (a text's attention on a model, computed by [`crate::commands::view`]), or
//! patterns computed elsewhere, as one self-contained HTML page.

use crate::analysis::collect::Collector;
use crate::analysis::encoder::SpecialShares;
use crate::analysis::request::usage;
use crate::model::capture::{Hook, Observer};
use crate::render::html::{encode_layer, page as html_page, EncoderView, SparseLayers, ViewData};
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

/// A layer's attention as the view holds it: whole `[heads, n, n]` maps (up to [`FULL_MAX`]
/// tokens, and an encoder's), or each row's top weights streamed from the forward.
pub enum ViewMaps {
    Whole(Vec<Vec<f32>>),
    Top(SparseView),
}

/// What an encoder's page adds: which text each token belongs to, where the second begins, and
/// the \[CLS\]/\[SEP\]/punctuation shares per layer.
pub struct EncoderFacts {
    pub token_types: Vec<u32>,
    pub sentence_b_start: Option<usize>,
    pub special_shares: SpecialShares,
}

/// What the view page of a text on a model shows (made by [`crate::commands::view::view`]):
/// the maps, the value norms `‖W_Oʰ vⱼ‖` per layer (heads × keys), and the panels' reports. Not
/// serialized: the maps are the page's bulk, encoded by [`page`].
pub struct ViewReport {
    /// the model's name
    pub model_name: String,
    /// the model's facts (`ModelFacts`), as JSON
    pub model: serde_json::Value,
    /// the token texts
    pub tokens: Vec<String>,
    /// the number of layers
    pub n_layers: usize,
    /// the number of query heads
    pub n_heads: usize,
    /// the number of key/value heads
    pub n_kv_heads: usize,
    /// the attention maps the page shows
    pub maps: ViewMaps,
    /// per layer, the value norms `‖W_Oʰ vⱼ‖` (heads × keys)
    pub value_norms: Vec<Vec<f32>>,
    /// `attnscope faithfulness`'s report, for the faithfulness panel
    pub faithfulness: Option<serde_json::Value>,
    /// `attnscope ablate`'s report (every head ablated), for the ablation panel
    pub ablation: Option<serde_json::Value>,
    /// an encoder's page; `None`: a decoder's
    pub encoder: Option<EncoderFacts>,
}

/// The view page of `report`: its maps encoded (every weight up to [`FULL_MAX`] tokens, the
/// bounded encoding above), the sink profile of a decoder's, an encoder's shares and pair.
pub fn page(report: &ViewReport) -> String {
    if report.encoder.is_some() {
        return encoder::page_of(report);
    }
    let (n, layers, heads) = (report.tokens.len(), report.n_layers, report.n_heads);
    let encoded = match &report.maps {
        ViewMaps::Whole(maps) => encode_layers(maps.iter().map(Vec::as_slice), layers, heads, n),
        ViewMaps::Top(sv) => sparse_layers(sv, layers),
    };
    let data = ViewData {
        title: format!("attnscope · {} · {} tokens", report.model_name, n),
        model: report.model.clone(),
        tokens: &report.tokens,
        n_layers: layers,
        n_heads: heads,
        n_kv_heads: report.n_kv_heads,
        sink_query: encoded.sink_query,
        sink_all: encoded.sink_all,
        faithfulness: report.faithfulness.clone(),
        ablation: report.ablation.clone(),
        encoding: encoded.encoding,
        patterns: encoded.patterns,
        sparse: encoded.sparse,
        vnorms: Some(encoded_value_norms(report)),
        encoder: None,
    };
    html_page(&data)
}

/// Per layer, the report's value norms encoded for the page.
fn encoded_value_norms(report: &ViewReport) -> Vec<String> {
    report
        .value_norms
        .iter()
        .map(|v| encode_value_norms(v))
        .collect()
}

/// The view page for attention patterns computed elsewhere: `patterns` is `[layers, heads, n,
/// n]` (rows sum to 1, masked weights 0), `tokens` the n token texts. Used by the Python
/// package's `attnscope.viz.attention_heads`. Patterns with weight above the diagonal (an
/// encoder's) get the encoder's page: whole maps, the \[CLS\]/\[SEP\]/punctuation chart.
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
    html_page(&data)
}
