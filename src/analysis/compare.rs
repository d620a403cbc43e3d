//! Two runs side by side: two texts on one model, one text on two models (same tokenizer), or
//! one model at two precisions. Per layer the sink profiles and their difference; per head the
//! Jensen–Shannon divergence of the query's attention rows; the heads that changed most.
//!
//! Each side runs a streamed forward ([`Collector`]): memory is `O(layers · heads · n)`.

use super::collect::Collector;
use super::request::{check_index, usage};
use super::vocab::{mean_rows, next_token_top_k, top_k, Ranked};
use crate::model::attention::AttnStats;
use crate::model::capture::Observer;
use crate::model::forward::{KvPrefix, RunOptions};
use crate::model::tokenize::visible;
use crate::model::{Model, Result};
use anyhow::Context;
use serde::Serialize;

/// One side of a comparison: what ran, and the rows it produced.
#[derive(Clone, Debug, Serialize)]
pub struct Side {
    /// What distinguishes this side (the text, the model or the precision).
    pub label: String,
    pub model: String,
    pub precision: String,
    pub token_ids: Vec<u32>,
    pub tokens: Vec<String>,
    pub query: usize,
    /// Per layer, the sink share of the query (weight on the first token, mean over heads).
    pub sink_query: Vec<f32>,
    /// Per layer, the sink share over all queries 1..n-1.
    pub sink_all: Vec<f32>,
    /// `[layer][head]`: the query's attention row over keys `0..=query` (every key on an
    /// encoder, whose queries see both sides).
    #[serde(skip)]
    pub rows: Vec<Vec<Vec<f32>>>,
    /// The five most likely next tokens after the query (none on an encoder).
    pub next_token: Vec<(String, f32)>,
}

/// Runs `model` on `tokens` and keeps what a comparison needs.
pub fn run_side(
    model: &Model,
    tokens: &[u32],
    query: usize,
    label: impl Into<String>,
) -> Result<Side> {
    run_side_sharing(model, tokens, query, label, Share::None).map(|(side, _)| side)
}

/// What one side of two texts on one decoder shares with the other: nothing, the first `p`
/// positions to keep for it (its keys and values, and the per-query statistics of those
/// positions), or those of the other side to start from.
enum Share<'a> {
    None,
    Keep(usize),
    From(&'a Prefix),
}

/// The first positions of a side's run, for the other side that starts with the same tokens:
/// their keys and values, and the statistics of their query rows as the attention handed them
/// (layer, first query, block), cut at the prefix's end.
struct Prefix {
    kv: KvPrefix,
    stats: Vec<(usize, usize, AttnStats)>,
}

/// Hands everything to a [`Collector`] and keeps the statistics of the query rows before `upto`.
struct Keeping<'a> {
    inner: &'a mut Collector,
    upto: usize,
    stats: Vec<(usize, usize, AttnStats)>,
}

impl Observer for Keeping<'_> {
    crate::delegate_observer!(inner: wants, tensor, wants_stats, wants_rows, attention_rows, attention_block);
    fn attention_stats(&mut self, layer: usize, q_start: usize, s: &AttnStats) {
        if q_start < self.upto {
            self.stats
                .push((layer, q_start, first_rows(s, self.upto - q_start)));
        }
        self.inner.attention_stats(layer, q_start, s);
    }
}

/// The statistics of the first `keep` query rows of a block.
fn first_rows(s: &AttnStats, keep: usize) -> AttnStats {
    if keep >= s.rows {
        return s.clone();
    }
    let cut = |v: &[f32]| -> Vec<f32> {
        (0..s.n_heads)
            .flat_map(|h| v[h * s.rows..h * s.rows + keep].iter().copied())
            .collect()
    };
    let k = s.top_k;
    AttnStats {
        n_heads: s.n_heads,
        rows: keep,
        top_k: k,
        first_key: cut(&s.first_key),
        max_weight: cut(&s.max_weight),
        argmax: (0..s.n_heads)
            .flat_map(|h| s.argmax[h * s.rows..h * s.rows + keep].iter().copied())
            .collect(),
        entropy: cut(&s.entropy),
        top: (0..s.n_heads)
            .flat_map(|h| {
                s.top[h * s.rows * k..(h * s.rows + keep) * k]
                    .iter()
                    .copied()
            })
            .collect(),
    }
}

/// [`run_side`], keeping the first positions for the other side (`Share::Keep`) or starting
/// after the other side's (`Share::From`: the statistics of those query rows handed to this
/// side's collector first, in the order a whole run hands them, so its sums are the whole
/// run's, bit for bit).
fn run_side_sharing(
    model: &Model,
    tokens: &[u32],
    query: usize,
    label: impl Into<String>,
    share: Share<'_>,
) -> Result<(Side, Option<Prefix>)> {
    let (n, d) = (tokens.len(), &model.dims);
    let mut c = Collector::new(d.n_layers, d.n_heads, n, query);
    let encoder = model.is_encoder();
    let opts = RunOptions {
        logits_at: if encoder { vec![] } else { vec![query] },
        keep_kv: matches!(share, Share::Keep(_)),
        ..Default::default()
    };
    let (out, kept) = match share {
        Share::None => (model.forward(tokens, &opts, &mut c)?, None),
        Share::Keep(p) => {
            let mut k = Keeping {
                inner: &mut c,
                upto: p,
                stats: Vec::new(),
            };
            let mut out = model.forward(tokens, &opts, &mut k)?;
            let stats = k.stats;
            let kv = out.kv.take().expect("keep_kv was set").truncate(p)?;
            (out, Some(Prefix { kv, stats }))
        }
        Share::From(prefix) => {
            for (layer, q_start, s) in &prefix.stats {
                c.attention_stats(*layer, *q_start, s);
            }
            let out =
                model.forward_from(Some(&prefix.kv), &tokens[prefix.kv.len..], &opts, &mut c)?;
            (out, None)
        }
    };
    let keys = if encoder { n } else { query + 1 };
    let rows = (0..d.n_layers)
        .map(|l| {
            (0..d.n_heads)
                .map(|h| c.row(l, h)[..keys].to_vec())
                .collect()
        })
        .collect();
    let side = Side {
        label: label.into(),
        model: model.info.name.clone(),
        precision: model.info.precision.name().into(),
        token_ids: tokens.to_vec(),
        tokens: model.token_texts(tokens),
        query,
        sink_query: (0..d.n_layers).map(|l| c.sink_query(l)).collect(),
        sink_all: (0..d.n_layers).map(|l| c.sink_all_queries(l)).collect(),
        rows,
        next_token: match out.logits.first() {
            Some(l) if !encoder => next_token_top_k(l, 5)
                .into_iter()
                .map(|t| (model.tokenizer.token_text(t.id), t.prob))
                .collect(),
            _ => Vec::new(),
        },
    };
    Ok((side, kept))
}

/// How many first tokens two texts on one decoder share that side B can start after: at
/// least one, fewer than B's length, and not past B's query (whose row B's own run gives).
/// `None` where B runs whole.
pub fn shared_prefix(model: &Model, a: &[u32], b: &[u32], query_b: usize) -> Option<usize> {
    let p = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    (!model.is_encoder() && p >= 1 && p < b.len() && query_b >= p).then_some(p)
}

/// What a comparison sets side by side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Two texts on one model.
    Texts,
    /// One text on two models that share a tokenizer (and their layers × heads).
    Models,
    /// One text on one model loaded at two precisions.
    Precisions,
}

impl Mode {
    /// `texts`, `models` or `precisions` (the report's `mode`).
    pub fn name(self) -> &'static str {
        match self {
            Mode::Texts => "texts",
            Mode::Models => "models",
            Mode::Precisions => "precisions",
        }
    }
}

/// One side to run: a model, named as the caller knows it (in messages), its text, and the
/// label that says what differs ([`text_label`] for two texts).
pub struct SideInput<'a> {
    pub model: &'a Model,
    pub name: &'a str,
    pub text: &'a str,
    pub label: String,
}

/// `text "…"`: a text's label, cut at 60 characters.
pub fn text_label(text: &str) -> String {
    let t: String = text.chars().take(60).collect();
    let t = if t.len() < text.len() {
        format!("{t}…")
    } else {
        t
    };
    format!("text \"{t}\"")
}

/// How two sides are compared: the query position (default the last token of each side), how
/// many of the most changed heads to list, and whether a BOS token goes first although the
/// models' metadata does not ask for one.
#[derive(Clone, Debug)]
pub struct CompareOptions {
    pub query: Option<usize>,
    pub top: usize,
    pub bos: bool,
}

impl Default for CompareOptions {
    /// The last token, the 10 most changed heads, the models' own BOS.
    fn default() -> Self {
        CompareOptions {
            query: None,
            top: 10,
            bos: false,
        }
    }
}

impl CompareOptions {
    /// Refuses what no model could run: `top` 0.
    pub fn check(&self) -> anyhow::Result<()> {
        if self.top == 0 {
            return Err(usage("--top must be at least 1"));
        }
        Ok(())
    }
}

/// `attnscope compare`: both sides tokenized, checked (two models must split the text the same
/// way and have the same layers × heads; the query must be in range on both sides), run, and
/// compared; two texts on an encoder get the cosine similarity of their sentence embeddings.
pub fn compare_runs(
    mode: Mode,
    sides: [SideInput<'_>; 2],
    opts: &CompareOptions,
) -> anyhow::Result<CompareReport> {
    opts.check()?;
    let [sa, sb] = &sides;
    let (ma, mb) = (sa.model, sb.model);
    let tokens = [ma.encode(sa.text, opts.bos)?, mb.encode(sb.text, opts.bos)?];
    if mode == Mode::Models && tokens[0] != tokens[1] {
        let at = tokens[0]
            .iter()
            .zip(&tokens[1])
            .take_while(|(x, y)| x == y)
            .count();
        let piece = |m: &Model, t: &[u32]| {
            t.get(at)
                .map(|&id| format!("{id} {:?}", m.tokenizer.token_text(id)))
                .unwrap_or_else(|| "(end)".into())
        };
        return Err(usage(format!(
            "the two models' tokenizers split the text differently ({}: {} tokens, {}: {} tokens; first difference at position {at}: {} vs {}): compare needs the same tokens on both sides; use two models that share a tokenizer",
            sa.name,
            tokens[0].len(),
            sb.name,
            tokens[1].len(),
            piece(ma, &tokens[0]),
            piece(mb, &tokens[1])
        )));
    }
    if mode == Mode::Models {
        let (da, db) = (&ma.dims, &mb.dims);
        if (da.n_layers, da.n_heads) != (db.n_layers, db.n_heads) {
            return Err(usage(format!(
                "the two models have different shapes ({}: {} layers × {} heads; {}: {} layers × {} heads): compare matches layers and heads one to one, so they must agree",
                sa.name, da.n_layers, da.n_heads, sb.name, db.n_layers, db.n_heads
            )));
        }
    }
    let queries: Vec<usize> = tokens
        .iter()
        .map(|t| match opts.query {
            Some(q) => check_index(q, t.len(), "query position"),
            None => Ok(t.len() - 1),
        })
        .collect::<anyhow::Result<_>>()?;
    // two texts that start alike: B runs from the first token that differs, on A's keys and
    // values (the same numbers: a causal model's first positions ignore what follows them)
    let shared = match mode {
        Mode::Texts => shared_prefix(ma, &tokens[0], &tokens[1], queries[1]),
        _ => None,
    };
    let (a, prefix) = run_side_sharing(
        ma,
        &tokens[0],
        queries[0],
        sa.label.clone(),
        shared.map_or(Share::None, Share::Keep),
    )
    .context("running side A")?;
    let (b, _) = run_side_sharing(
        mb,
        &tokens[1],
        queries[1],
        sb.label.clone(),
        prefix.as_ref().map_or(Share::None, Share::From),
    )
    .context("running side B")?;
    let mut report = compare(mode.name(), a, b, opts.top);
    if mode == Mode::Texts && ma.is_encoder() {
        use super::enc_target::{cosine, EncoderTarget};
        let e = EncoderTarget::Embedding;
        report.embedding_cosine = Some(cosine(
            &e.vector(ma, &tokens[0])?,
            &e.vector(mb, &tokens[1])?,
        ));
    }
    Ok(report)
}

/// Jensen–Shannon divergence in bits (0 = the same distribution, 1 = disjoint supports) of two
/// attention rows, aligned by key position; a shorter row is zero beyond its end. Accumulated in
/// f64; each row is renormalized to sum 1 first.
pub fn js_divergence(p: &[f32], q: &[f32]) -> f64 {
    let n = p.len().max(q.len());
    let at = |r: &[f32], i: usize| r.get(i).map_or(0.0, |&x| x.max(0.0) as f64);
    let (sp, sq): (f64, f64) = (
        (0..n).map(|i| at(p, i)).sum(),
        (0..n).map(|i| at(q, i)).sum(),
    );
    if sp <= 0.0 || sq <= 0.0 {
        return f64::NAN;
    }
    let mut js = 0.0;
    for i in 0..n {
        let (a, b) = (at(p, i) / sp, at(q, i) / sq);
        let m = 0.5 * (a + b);
        if a > 0.0 {
            js += 0.5 * a * (a / m).log2();
        }
        if b > 0.0 {
            js += 0.5 * b * (b / m).log2();
        }
    }
    js.clamp(0.0, 1.0)
}

/// A key in one side's top list.
#[derive(Clone, Debug, Serialize)]
pub struct Key {
    pub pos: usize,
    pub token: String,
    pub weight: f32,
}

#[derive(Clone, Debug, Serialize)]
pub struct HeadChange {
    pub layer: usize,
    pub head: usize,
    pub js: f64,
    pub top_a: Vec<Key>,
    pub top_b: Vec<Key>,
}

#[derive(Clone, Debug, Serialize)]
pub struct LayerDiff {
    pub layer: usize,
    pub sink_all_a: f32,
    pub sink_all_b: f32,
    /// B − A
    pub sink_all_diff: f32,
    pub sink_query_a: f32,
    pub sink_query_b: f32,
    pub sink_query_diff: f32,
    /// mean over heads of the JS divergence of the query's rows
    pub mean_js: f64,
    /// JS divergence of the head-averaged rows
    pub head_mean_js: f64,
}

/// `compare`'s report: two runs' attention (two texts or two models) side by side, per layer and
/// head, with their distances.
#[derive(Clone, Debug, Serialize)]
pub struct CompareReport {
    /// "texts", "models" or "precisions"
    pub mode: String,
    /// the first side: its model, text and tokens
    pub a: Side,
    /// the second side
    pub b: Side,
    /// Whether both sides ran the same token ids (rows then line up token by token).
    pub same_tokens: bool,
    /// per layer, how the two sides' attention differs
    pub layers: Vec<LayerDiff>,
    /// `[layer][head]`: JS divergence (bits) of the query's rows
    pub js: Vec<Vec<f64>>,
    /// The heads with the largest JS divergence, largest first.
    pub top_changed: Vec<HeadChange>,
    /// the comparison in one sentence
    pub summary: String,
    /// Two texts on an encoder: the cosine similarity of their sentence embeddings (mean-pooled,
    /// as sentence-transformers computes them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub embedding_cosine: Option<f64>,
}

fn keys(side: &Side, row: &[f32], k: usize) -> Vec<Key> {
    top_k(row, k)
        .into_iter()
        .map(|Ranked { pos, weight }| Key {
            pos,
            token: side.tokens[pos].clone(),
            weight,
        })
        .collect()
}

/// Compares two sides with the same layers and heads (the caller checks; this asserts).
pub fn compare(mode: &str, a: Side, b: Side, top: usize) -> CompareReport {
    assert_eq!(a.rows.len(), b.rows.len(), "same number of layers");
    let n_layers = a.rows.len();
    let js: Vec<Vec<f64>> = (0..n_layers)
        .map(|l| {
            a.rows[l]
                .iter()
                .zip(&b.rows[l])
                .map(|(ra, rb)| js_divergence(ra, rb))
                .collect()
        })
        .collect();
    let layers: Vec<LayerDiff> = (0..n_layers)
        .map(|l| {
            let ma = mean_rows(a.rows[l].iter().map(Vec::as_slice));
            let mb = mean_rows(b.rows[l].iter().map(Vec::as_slice));
            LayerDiff {
                layer: l,
                sink_all_a: a.sink_all[l],
                sink_all_b: b.sink_all[l],
                sink_all_diff: b.sink_all[l] - a.sink_all[l],
                sink_query_a: a.sink_query[l],
                sink_query_b: b.sink_query[l],
                sink_query_diff: b.sink_query[l] - a.sink_query[l],
                mean_js: js[l].iter().sum::<f64>() / js[l].len().max(1) as f64,
                head_mean_js: js_divergence(&ma, &mb),
            }
        })
        .collect();
    let mut ranked: Vec<(usize, usize, f64)> = js
        .iter()
        .enumerate()
        .flat_map(|(l, hs)| hs.iter().enumerate().map(move |(h, &v)| (l, h, v)))
        .collect();
    ranked.sort_by(|x, y| y.2.total_cmp(&x.2).then(x.0.cmp(&y.0)).then(x.1.cmp(&y.1)));
    let top_changed = ranked
        .into_iter()
        .take(top)
        .map(|(l, h, v)| HeadChange {
            layer: l,
            head: h,
            js: v,
            top_a: keys(&a, &a.rows[l][h], 3),
            top_b: keys(&b, &b.rows[l][h], 3),
        })
        .collect::<Vec<_>>();
    let same_tokens = a.token_ids == b.token_ids;
    let summary = summarize(&a, &b, &layers, &top_changed);
    CompareReport {
        mode: mode.into(),
        a,
        b,
        same_tokens,
        layers,
        js,
        top_changed,
        summary,
        embedding_cosine: None,
    }
}

fn summarize(a: &Side, b: &Side, layers: &[LayerDiff], top: &[HeadChange]) -> String {
    let biggest = layers
        .iter()
        .max_by(|x, y| x.sink_all_diff.abs().total_cmp(&y.sink_all_diff.abs()))
        .expect("at least one layer");
    let mean_js = layers.iter().map(|l| l.mean_js).sum::<f64>() / layers.len().max(1) as f64;
    let mut s = format!(
        "The sink profiles differ most at layer {} ({:.1}% for A, {:.1}% for B, {:+.1} points over all queries). Mean JS divergence of the query's rows over every head: {:.4} bits (0 = identical, 1 = disjoint).",
        biggest.layer,
        biggest.sink_all_a * 100.0,
        biggest.sink_all_b * 100.0,
        biggest.sink_all_diff * 100.0,
        mean_js
    );
    if let Some(h) = top.first() {
        s += &format!(
            " The head that changed most is {}.{} ({:.3} bits): A looks at {}, B at {}.",
            h.layer,
            h.head,
            h.js,
            h.top_a
                .first()
                .map(|k| format!("{} \"{}\" ({:.2})", k.pos, visible(&k.token), k.weight))
                .unwrap_or_default(),
            h.top_b
                .first()
                .map(|k| format!("{} \"{}\" ({:.2})", k.pos, visible(&k.token), k.weight))
                .unwrap_or_default()
        );
    }
    if let (Some(x), Some(y)) = (a.next_token.first(), b.next_token.first()) {
        s += &format!(
            " Next token: A \"{}\" ({:.3}), B \"{}\" ({:.3}).",
            visible(&x.0),
            x.1,
            visible(&y.0),
            y.1
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn js_divergence_known_values() {
        assert_eq!(js_divergence(&[0.5, 0.5], &[0.5, 0.5]), 0.0);
        // disjoint supports: 1 bit
        assert!((js_divergence(&[1.0, 0.0], &[0.0, 1.0]) - 1.0).abs() < 1e-12);
        // a shorter row is zero beyond its end
        assert!((js_divergence(&[1.0], &[0.0, 1.0]) - 1.0).abs() < 1e-12);
        // P = (1, 0), Q = (1/2, 1/2): M = (3/4, 1/4);
        // JS = ½·log2(4/3) + ½·(½·log2(2/3) + ½·log2(2)) = ½·log2(4/3) + ¼·log2(4/3)
        let want = 0.75 * (4.0f64 / 3.0).log2();
        assert!((js_divergence(&[1.0, 0.0], &[0.5, 0.5]) - want).abs() < 1e-12);
        // symmetric
        let (p, q) = ([0.2, 0.3, 0.5], [0.6, 0.1, 0.3]);
        assert!((js_divergence(&p, &q) - js_divergence(&q, &p)).abs() < 1e-15);
        assert!(js_divergence(&[0.0, 0.0], &[1.0]).is_nan());
    }

    fn side(rows: Vec<Vec<Vec<f32>>>, sink: Vec<f32>) -> Side {
        let n = rows[0][0].len();
        Side {
            label: "x".into(),
            model: "m".into(),
            precision: "exact".into(),
            token_ids: (0..n as u32).collect(),
            tokens: (0..n).map(|i| format!("t{i}")).collect(),
            query: n - 1,
            sink_query: sink.clone(),
            sink_all: sink,
            rows,
            next_token: vec![("a".into(), 0.5)],
        }
    }

    #[test]
    fn the_changed_head_ranks_first() {
        let same = vec![0.5, 0.25, 0.25];
        let a = side(
            vec![
                vec![same.clone(), same.clone()],
                vec![same.clone(), same.clone()],
            ],
            vec![0.5, 0.5],
        );
        let b = side(
            vec![
                vec![same.clone(), same.clone()],
                vec![same.clone(), vec![0.0, 0.0, 1.0]],
            ],
            vec![0.5, 0.25],
        );
        let r = compare("texts", a, b, 2);
        assert_eq!(r.js[0], vec![0.0, 0.0]);
        assert_eq!((r.top_changed[0].layer, r.top_changed[0].head), (1, 1));
        assert_eq!(r.top_changed[0].top_b[0].pos, 2);
        assert!((r.layers[1].sink_all_diff + 0.25).abs() < 1e-7);
        assert!(r.layers[1].mean_js > 0.0 && r.layers[0].mean_js == 0.0);
        assert!(r.same_tokens);
    }
}
