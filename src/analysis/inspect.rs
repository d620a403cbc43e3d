//! The report of `attnscope inspect`, built from a [`Collector`] and the next-token logits.
//! Pure data; `render::report` turns it into text, serde into JSON.

use super::collect::Collector;
use super::{entropy, max_argmax, next_token_top_k, profile_marks, top_k, ProfileMarks};
use crate::model::{Model, ModelDims};
use crate::reference::kv_head;
use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct ModelFacts {
    pub name: String,
    pub description: Option<String>,
    pub arch: String,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub group_size: usize,
    pub gqa: String,
    pub head_dim: usize,
    pub d_model: usize,
    pub precision: String,
}

impl ModelFacts {
    pub fn of(m: &Model) -> Self {
        let d: &ModelDims = &m.dims;
        ModelFacts {
            name: m.info.name.clone(),
            description: m.info.description.clone(),
            arch: d.arch.name().into(),
            n_layers: d.n_layers,
            n_heads: d.n_heads,
            n_kv_heads: d.n_kv_heads,
            group_size: d.group_size(),
            gqa: d.gqa_sentence(),
            head_dim: d.head_dim,
            d_model: d.d_model,
            precision: m.info.precision.name().into(),
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct TokenInfo {
    pub pos: usize,
    pub id: u32,
    pub text: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct TopEntry {
    pub pos: usize,
    pub token: String,
    pub weight: f32,
}

#[derive(Clone, Debug, Serialize)]
pub struct HeadRow {
    pub head: usize,
    pub kv_head: usize,
    pub top: Vec<TopEntry>,
    pub max_weight: f32,
    pub argmax: usize,
    pub entropy: f32,
    /// max weight ≥ the concentration threshold (0.9)
    pub concentrated: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct LayerRow {
    pub layer: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top: Option<Vec<TopEntry>>,
    pub sink_query: f32,
    pub sink_all_queries: f32,
}

#[derive(Clone, Debug, Serialize)]
pub struct NextToken {
    pub id: u32,
    pub token: String,
    pub prob: f32,
    pub logit: f32,
}

#[derive(Clone, Debug, Serialize)]
pub struct SinkSummary {
    pub query: ProfileMarks,
    pub all_queries: ProfileMarks,
}

#[derive(Clone, Debug, Serialize)]
pub struct InspectReport {
    pub model: ModelFacts,
    pub tokens: Vec<TokenInfo>,
    pub query: usize,
    pub layer: usize,
    pub heads: Vec<HeadRow>,
    pub layers: Vec<LayerRow>,
    pub sink: SinkSummary,
    pub next_token: Vec<NextToken>,
    pub caution: String,
}

/// What to report on.
#[derive(Clone, Debug)]
pub struct InspectPlan {
    pub query: usize,
    pub layer: usize,
    pub heads: Vec<usize>,
    pub top_heads: usize,
    pub layers: Vec<usize>,
    pub top_layers: usize,
    pub concentrated_at: f32,
}

pub fn build(
    model: &Model,
    tokens: &[u32],
    c: &Collector,
    logits: &[f32],
    plan: &InspectPlan,
) -> InspectReport {
    let texts = model.token_texts(tokens);
    let entry = |r: super::Ranked| TopEntry {
        pos: r.pos,
        token: texts[r.pos].clone(),
        weight: r.weight,
    };
    let q = plan.query;
    let group = model.dims.group_size();
    let heads = plan
        .heads
        .iter()
        .map(|&h| {
            // keys after the query are masked (0); rank only the keys it can see
            let row = &c.row(plan.layer, h)[..=q];
            let (max_weight, argmax) = max_argmax(row);
            HeadRow {
                head: h,
                kv_head: kv_head(h, group),
                top: top_k(row, plan.top_heads).into_iter().map(entry).collect(),
                max_weight,
                argmax,
                entropy: entropy(row),
                concentrated: max_weight >= plan.concentrated_at,
            }
        })
        .collect();
    let layers: Vec<LayerRow> = (0..c.n_layers())
        .map(|l| LayerRow {
            layer: l,
            top: plan.layers.contains(&l).then(|| {
                top_k(&c.head_mean(l)[..=q], plan.top_layers)
                    .into_iter()
                    .map(entry)
                    .collect()
            }),
            sink_query: c.sink_query(l),
            sink_all_queries: c.sink_all_queries(l),
        })
        .collect();
    let sq: Vec<f32> = layers.iter().map(|l| l.sink_query).collect();
    let sa: Vec<f32> = layers.iter().map(|l| l.sink_all_queries).collect();
    let sink = SinkSummary {
        query: profile_marks(&sq),
        all_queries: profile_marks(&sa),
    };
    let next_token = next_token_top_k(logits, 5)
        .into_iter()
        .map(|t| NextToken {
            id: t.id,
            token: model.tokenizer.token_text(t.id),
            prob: t.prob,
            logit: t.logit,
        })
        .collect::<Vec<_>>();
    let caution = caution(&texts, &sink, &layers, q);
    InspectReport {
        model: ModelFacts::of(model),
        tokens: tokens
            .iter()
            .zip(&texts)
            .enumerate()
            .map(|(pos, (&id, t))| TokenInfo {
                pos,
                id,
                text: t.clone(),
            })
            .collect(),
        query: q,
        layer: plan.layer,
        heads,
        layers,
        sink,
        next_token,
        caution,
    }
}

/// One sentence of caution, written from this run's numbers.
fn caution(texts: &[String], sink: &SinkSummary, layers: &[LayerRow], q: usize) -> String {
    let m = &sink.all_queries;
    let first = texts.first().map(String::as_str).unwrap_or("");
    if texts.len() < 2 {
        return "With a single token every weight is 1 on that token; attention weights say nothing here.".into();
    }
    let over_half = layers.iter().filter(|l| l.sink_all_queries > 0.5).count();
    format!(
        "The first token \"{first}\" receives {:.1}% of the head-averaged attention at layer {} (over all queries; {:.1}% for query {q}), and more than half of it in {over_half} of {} layers, although it is just the first piece of the text: attention weight is not importance.",
        m.peak * 100.0,
        m.peak_layer,
        layers[m.peak_layer].sink_query * 100.0,
        layers.len()
    )
}
