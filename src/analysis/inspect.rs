//! The report of `attnscope inspect`, built from a [`Collector`] and the next-token logits, and
//! [`inspect`], which resolves a [`Request`] (the CLI's flags, Python's arguments) against the
//! model and the text and runs it.
//! The report is pure data; `render::report` turns it into text, serde into JSON.

use super::collect::Collector;
use super::encoder::EncoderReport;
use super::norms::{mixed_norms, shares, value_norms, Values};
use super::request::{check_index, parse_index_list, usage};
use super::vocab::{entropy, max_argmax, next_token_top_k, profile_marks, top_k};
use super::vocab::{ModelFacts, ProfileMarks, Ranked, TokenInfo, TopEntry};
use crate::model::forward::RunOptions;
use crate::model::{Model, ModelDims};
use crate::reference::kv_head;
use serde::Serialize;
use std::time::Instant;

/// A key ranked by norm-based attention (what it moves into the query's residual stream).
#[derive(Clone, Debug, Serialize)]
pub struct NormEntry {
    pub pos: usize,
    pub token: String,
    /// `α·‖f(x)‖` for one head; `‖Σₕ αʰ·fₕ(x)‖` for a whole layer
    pub norm: f32,
    /// `norm` over the sum of the row's norms
    pub share: f32,
    /// the attention weight (head-averaged for a layer), for comparison
    pub weight: f32,
}

/// The first token under both readings: the weight it gets and what it moves.
#[derive(Clone, Debug, Serialize)]
pub struct FirstKeyNorm {
    pub weight: f32,
    /// `‖f(x₀)‖ = ‖W_Oʰ v₀‖` (heads only): the size of the first token's value through the head
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value_norm: Option<f32>,
    pub norm: f32,
    pub norm_share: f32,
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
    /// keys ranked by `α·‖f(x)‖` (norm-based attention)
    pub norm_top: Vec<NormEntry>,
    /// `α·‖W_Oʰ vⱼ‖` for keys `0..=query`
    pub norms: Vec<f32>,
    /// `‖W_Oʰ vⱼ‖` for keys `0..=query`
    pub value_norms: Vec<f32>,
    pub first_key: FirstKeyNorm,
}

#[derive(Clone, Debug, Serialize)]
pub struct LayerRow {
    pub layer: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top: Option<Vec<TopEntry>>,
    /// keys ranked by `‖Σₕ αʰ·fₕ(x)‖` (norm-based attention of the whole layer)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub norm_top: Option<Vec<NormEntry>>,
    /// `‖Σₕ αʰ·fₕ(xⱼ)‖` for keys `0..=query`
    #[serde(skip_serializing_if = "Option::is_none")]
    pub norms: Option<Vec<f32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_key: Option<FirstKeyNorm>,
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

/// `inspect`'s report on a decoder: the per-head and head-averaged top keys, entropy, sinks and
/// the next-token prediction.
#[derive(Clone, Debug, Serialize)]
pub struct InspectReport {
    /// the model's facts
    pub model: ModelFacts,
    /// the input tokens
    pub tokens: Vec<TokenInfo>,
    /// the query position
    pub query: usize,
    /// the layer of the per-head table
    pub layer: usize,
    /// the per-head table: each head's top keys at `layer`
    pub heads: Vec<HeadRow>,
    /// the head-averaged table: the layers' top keys
    pub layers: Vec<LayerRow>,
    /// the weight on the first token (the attention sink)
    pub sink: SinkSummary,
    /// the model's most likely next tokens
    pub next_token: Vec<NextToken>,
    /// what attention weights do not say, in one sentence
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

impl InspectPlan {
    /// The observer a forward must fill for [`build`]: the query's rows, the sink sums, and the
    /// value vectors of the layers whose norm-based attention is reported.
    pub fn collector(&self, dims: &ModelDims, n: usize) -> Collector {
        let mut layers = self.layers.clone();
        layers.push(self.layer);
        Collector::new(dims.n_layers, dims.n_heads, n, self.query).keep_values(&layers)
    }
}

/// The report from a forward that filled [`InspectPlan::collector`].
pub fn build(
    model: &Model,
    tokens: &[u32],
    c: &Collector,
    logits: &[f32],
    plan: &InspectPlan,
) -> InspectReport {
    let texts = model.token_texts(tokens);
    let parts = Parts {
        model,
        c,
        plan,
        texts: &texts,
    };
    let heads = parts.head_rows();
    let layers = parts.layer_rows();
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
    let q = plan.query;
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

/// What [`build`]'s tables are made from: the collected rows and values, the plan and the
/// tokens' texts.
struct Parts<'a> {
    model: &'a Model,
    c: &'a Collector,
    plan: &'a InspectPlan,
    texts: &'a [String],
}

impl Parts<'_> {
    /// A ranked key as a table entry, with its text.
    fn entry(&self, r: Ranked) -> TopEntry {
        TopEntry {
            pos: r.pos,
            token: self.texts[r.pos].clone(),
            weight: r.weight,
        }
    }

    /// Layer `l`'s kept values.
    fn values(&self, l: usize) -> Values<'_> {
        let d = &self.model.dims;
        let v = self.c.values[l]
            .as_deref()
            .expect("inspect keeps the values of its layers");
        Values::pos_major(v, self.c.n, d.n_kv_heads, d.head_dim)
    }

    /// The top `k` keys by norm, with their shares of the total and their attention weights.
    fn norm_entries(&self, norms: &[f32], weights: &[f32], k: usize) -> Vec<NormEntry> {
        let sh = shares(norms);
        top_k(norms, k)
            .into_iter()
            .map(|r| NormEntry {
                pos: r.pos,
                token: self.texts[r.pos].clone(),
                norm: r.weight,
                share: sh[r.pos],
                weight: weights[r.pos],
            })
            .collect()
    }

    /// Each asked head of the plan's layer: its top keys for the query, max, entropy, and the
    /// norm-based view (weight × value norm).
    fn head_rows(&self) -> Vec<HeadRow> {
        let (plan, c, q) = (self.plan, self.c, self.plan.query);
        let group = self.model.dims.group_size();
        let vnorms = value_norms(
            self.model,
            plan.layer,
            &self.values(plan.layer),
            &plan.heads,
            q + 1,
        );
        plan.heads
            .iter()
            .zip(vnorms)
            .map(|(&h, value_norms)| {
                // keys after the query are masked (0); rank only the keys it can see
                let row = &c.row(plan.layer, h)[..=q];
                let (max_weight, argmax) = max_argmax(row);
                let norms: Vec<f32> = row.iter().zip(&value_norms).map(|(a, f)| a * f).collect();
                let sh = shares(&norms);
                HeadRow {
                    norm_top: self.norm_entries(&norms, row, plan.top_heads),
                    first_key: FirstKeyNorm {
                        weight: row[0],
                        value_norm: Some(value_norms[0]),
                        norm: norms[0],
                        norm_share: sh[0],
                    },
                    norms,
                    value_norms,
                    head: h,
                    kv_head: kv_head(h, group),
                    top: top_k(row, plan.top_heads)
                        .into_iter()
                        .map(|r| self.entry(r))
                        .collect(),
                    max_weight,
                    argmax,
                    entropy: entropy(row),
                    concentrated: max_weight >= plan.concentrated_at,
                }
            })
            .collect()
    }

    /// Every layer's sink shares; for the plan's layers, the head-averaged top keys and the
    /// norm-based ones.
    fn layer_rows(&self) -> Vec<LayerRow> {
        let (plan, c, q) = (self.plan, self.c, self.plan.query);
        let d = &self.model.dims;
        (0..c.n_layers())
            .map(|l| {
                let chosen = plan.layers.contains(&l);
                let mean = c.head_mean(l);
                let norms = chosen.then(|| {
                    let alphas: Vec<&[f32]> = (0..d.n_heads).map(|h| c.row(l, h)).collect();
                    mixed_norms(self.model, l, &self.values(l), &alphas, q + 1)
                });
                LayerRow {
                    layer: l,
                    top: chosen.then(|| {
                        top_k(&mean[..=q], plan.top_layers)
                            .into_iter()
                            .map(|r| self.entry(r))
                            .collect()
                    }),
                    norm_top: norms
                        .as_ref()
                        .map(|nr| self.norm_entries(nr, &mean, plan.top_layers)),
                    first_key: norms.as_ref().map(|nr| FirstKeyNorm {
                        weight: mean[0],
                        value_norm: None,
                        norm: nr[0],
                        norm_share: shares(nr)[0],
                    }),
                    norms,
                    sink_query: c.sink_query(l),
                    sink_all_queries: c.sink_all_queries(l),
                }
            })
            .collect()
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

/// What `inspect` reports on: the CLI's flags, Python's `model.inspect` arguments.
#[derive(Clone, Debug)]
pub struct Request {
    /// the query position (default: the last token; an encoder's \[CLS\])
    pub query: Option<usize>,
    /// the layer of the per-head table (default: the last)
    pub layer: Option<usize>,
    /// the heads of the per-head table: `0-3`, `1,5`, `all`
    pub heads: String,
    /// the layers of the head-averaged table (default: first, middle, last)
    pub layers: Option<String>,
    /// top keys listed (default: 3 per head, 4 head-averaged)
    pub top: Option<usize>,
    /// the max weight from which a head counts as concentrated
    pub concentrated: f32,
}

impl Default for Request {
    fn default() -> Self {
        Request {
            query: None,
            layer: None,
            heads: "0-3".into(),
            layers: None,
            top: None,
            concentrated: 0.9,
        }
    }
}

/// An `inspect` report with the forward's timings.
pub enum Inspected {
    /// a decoder's tables and next-token prediction
    Decoder {
        report: InspectReport,
        forward_s: f64,
        attention_s: f64,
    },
    /// an encoder's \[CLS\]/\[SEP\]/punctuation shares and rows
    Encoder {
        report: EncoderReport,
        forward_s: f64,
    },
}

impl Inspected {
    /// `inspect --json`: the report with `timings` (the load's too, when given).
    pub fn json(&self, load_s: Option<f64>) -> serde_json::Result<serde_json::Value> {
        let (mut v, mut t) = match self {
            Inspected::Decoder {
                report,
                forward_s,
                attention_s,
            } => (
                serde_json::to_value(report)?,
                serde_json::json!({"forward_s": forward_s, "attention_s": attention_s}),
            ),
            Inspected::Encoder { report, forward_s } => (
                serde_json::to_value(report)?,
                serde_json::json!({ "forward_s": forward_s }),
            ),
        };
        if let Some(l) = load_s {
            t["load_s"] = l.into();
        }
        v["timings"] = t;
        Ok(v)
    }
}

/// The heads of the per-head table: `0-3` means every head on a model with fewer than 4.
fn head_list(spec: &str, n_heads: usize) -> anyhow::Result<Vec<usize>> {
    if spec == "0-3" && n_heads < 4 {
        Ok((0..n_heads).collect())
    } else {
        parse_index_list(spec, n_heads, "head")
    }
}

/// The `inspect` report of `tokens` (`types`: a pair's token types, for an encoder; `segments`:
/// its segments where they differ from the types, as on RoBERTa, else `None`).
pub fn inspect(
    model: &Model,
    tokens: &[u32],
    types: Option<&[u32]>,
    segments: Option<&[u32]>,
    r: &Request,
) -> anyhow::Result<Inspected> {
    let (n, d) = (tokens.len(), &model.dims);
    let default_query = if model.is_encoder() { 0 } else { n - 1 };
    let query = check_index(r.query.unwrap_or(default_query), n, "query position")?;
    let layer = check_index(r.layer.unwrap_or(d.n_layers - 1), d.n_layers, "layer")?;
    let heads = head_list(&r.heads, d.n_heads)?;
    if r.top == Some(0) || r.top.is_some_and(|k| k > n) {
        return Err(usage(format!(
            "--top {} is out of range: valid values are 1..={n} (the number of tokens)",
            r.top.unwrap_or(0)
        )));
    }
    if model.is_encoder() {
        let t0 = Instant::now();
        let mut report = crate::analysis::encoder::inspect(
            model,
            tokens,
            types,
            query,
            layer,
            &heads,
            r.top.unwrap_or(3).min(n),
        )?;
        if let Some(s) = segments {
            if s.len() != n {
                return Err(usage(format!("{} segments for {n} tokens", s.len())));
            }
            report.segments = s.to_vec();
        }
        return Ok(Inspected::Encoder {
            report,
            forward_s: t0.elapsed().as_secs_f64(),
        });
    }
    let layers = match &r.layers {
        Some(s) => parse_index_list(s, d.n_layers, "layer")?,
        None => {
            let mut v = vec![0, d.n_layers / 2, d.n_layers - 1];
            v.dedup();
            v
        }
    };
    if !(0.0..=1.0).contains(&r.concentrated) {
        return Err(usage(format!(
            "--concentrated {} is out of range: use a weight in 0..=1",
            r.concentrated
        )));
    }
    let plan = InspectPlan {
        query,
        layer,
        heads,
        top_heads: r.top.unwrap_or(3),
        layers,
        top_layers: r.top.unwrap_or(4),
        concentrated_at: r.concentrated,
    };
    let mut collector = plan.collector(d, n);
    let t0 = Instant::now();
    let out = model.forward(
        tokens,
        &RunOptions {
            logits_at: vec![query],
            ..Default::default()
        },
        &mut collector,
    )?;
    let forward_s = t0.elapsed().as_secs_f64();
    Ok(Inspected::Decoder {
        report: build(model, tokens, &collector, &out.logits[0], &plan),
        forward_s,
        attention_s: out.timings.attention.as_secs_f64(),
    })
}
