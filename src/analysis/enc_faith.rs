//! `faithfulness` on an encoder: the forward-only explanations (attention of the last layer and
//! of every layer, rollout, norm-based attention) ranked against deletion, where a token's true
//! importance is `1 − cos(v(text without it), v(text))` for the sentence embedding or the \[CLS\]
//! vector ([`EncoderTarget`]). For `cls` the explanations read the \[CLS\] query's rows; for
//! `embedding`, which pools every position, the mean of every query's row.

use super::enc_target::{cosine, EncoderTarget};
use super::norms::{mixed_norms, shares, Values};
use super::vocab::{best_of, kendall_tau_b, mean_rows, permutation_p, rollout, spearman};
use super::vocab::{top_positions, AtK, Best, MetricRow};
use crate::model::capture::{AttnCache, CaptureSpec, Hook, Queries};
use crate::model::forward::RunOptions;
use crate::model::{Error, Model, Result};
use crate::reference::Rng;
use serde::Serialize;
use std::collections::HashMap;

/// One token's explanations and its deletion effect.
#[derive(Clone, Debug, Serialize)]
pub struct EncTokenRow {
    pub pos: usize,
    pub id: u32,
    pub text: String,
    /// The last layer's head-averaged attention from the target's queries.
    pub attention_last: f32,
    /// The same, averaged over layers.
    pub attention_mean: f32,
    /// Attention rollout (Abnar & Zuidema 2020, residual as 0.5 · I) from the target's queries.
    pub rollout: f32,
    /// Norm-based attention of the last layer, `‖Σₕ αʰ·W_Oʰ vⱼ‖` (Kobayashi et al. 2020).
    pub norm_last: f32,
    /// Norm-based attention, each layer's row as shares of its total, averaged over layers.
    pub norm_mean: f32,
    /// `1 − cos(v(text without the token), v(text))`.
    pub deletion: f32,
}

/// An encoder's faithfulness report.
#[derive(Clone, Debug, Serialize)]
pub struct EncFaithReport {
    pub model: String,
    pub precision: String,
    pub encoder_target: EncoderTarget,
    pub tokens: Vec<EncTokenRow>,
    /// Each ranking against `deletion` (truth `deletion`); comprehensiveness at k is
    /// `1 − cos(v(text without the top k), v(text))`, sufficiency `1 − cos(v(only the top k),
    /// v(text))` (lower is more sufficient).
    pub metrics: Vec<MetricRow>,
    pub forward_passes: usize,
    pub most_faithful: Option<Best>,
    pub conclusion: String,
}

/// Runs the encoder's faithfulness report for `target`; `tick(done, total)` after each forward.
pub fn run(
    model: &Model,
    tokens: &[u32],
    target: EncoderTarget,
    seed: u64,
    tick: &mut dyn FnMut(usize, usize),
) -> Result<EncFaithReport> {
    let n = tokens.len();
    if n < 2 {
        return Err(Error::OutOfRange {
            what: "text".into(),
            value: format!("{n} token(s)"),
            range: "at least 2 tokens (deletion keeps the rest)".into(),
        });
    }
    let ex = explanations(model, tokens, target)?;
    let rankings = ex.rankings(n, seed);
    let memo = vectors(model, tokens, target, &rankings, tick)?;
    let base = memo[tokens].clone();
    let effect = |w: &[u32]| (1.0 - cosine(&memo[w], &base)) as f32;
    let deletion = deletion_effects(tokens, &effect)?;
    let imp: Vec<f64> = deletion.iter().map(|&x| x as f64).collect();
    let metrics: Vec<MetricRow> = rankings
        .iter()
        .map(|(name, scores)| metric_row(name, scores, &imp, &effect, tokens))
        .collect();
    let most_faithful = most_faithful(&metrics);
    let text = |j: usize| model.tokenizer.token_text(tokens[j]);
    let top = argmax(&imp).unwrap_or(0);
    let conclusion = conclude(
        target,
        &text(top),
        top,
        deletion[top],
        most_faithful.as_ref(),
    );
    Ok(EncFaithReport {
        model: model.info.name.clone(),
        precision: model.info.precision.name().into(),
        encoder_target: target,
        tokens: (0..n)
            .map(|j| ex.row(j, tokens[j], text(j), deletion[j]))
            .collect(),
        metrics,
        forward_passes: 1 + memo.len(),
        most_faithful,
        conclusion,
    })
}

/// Each position's deletion effect, `effect` of the text without it; an error where one is not
/// finite.
fn deletion_effects(tokens: &[u32], effect: &dyn Fn(&[u32]) -> f32) -> Result<Vec<f32>> {
    let deletion: Vec<f32> = (0..tokens.len())
        .map(|j| effect(&keep(tokens, |i| i != j)))
        .collect();
    if let Some(i) = deletion.iter().position(|x| !x.is_finite()) {
        return Err(Error::NonFinite {
            what: format!("the deletion effect of position {i}"),
            layer: None,
        });
    }
    Ok(deletion)
}

/// The forward-only explanation with the highest Spearman ρ against deletion (not the random
/// ranking).
fn most_faithful(metrics: &[MetricRow]) -> Option<Best> {
    best_of(metrics.iter().filter(|m| m.ranking != "random"))
}

/// The report's conclusion: the token whose deletion (`effect`, 1 − cos) changes the target's
/// vector most, `text` at position `top`, and the explanation that tracks deletion best.
fn conclude(
    target: EncoderTarget,
    text: &str,
    top: usize,
    effect: f32,
    most_faithful: Option<&Best>,
) -> String {
    let mut conclusion = format!(
        "Deleting {:?} (position {top}) changes the {} most: 1 − cos = {:.4}.",
        text,
        match target {
            EncoderTarget::Embedding => "sentence embedding",
            EncoderTarget::Cls => "[CLS] vector",
        },
        effect
    );
    if let Some(b) = most_faithful {
        conclusion += &format!(
            " Of the forward-only explanations, {} tracks deletion best (Spearman ρ = {:+.2}).",
            b.ranking, b.spearman
        );
    }
    conclusion
}

/// The k of comprehensiveness and sufficiency at k.
const TOP_KS: [usize; 3] = [1, 3, 5];

/// The tokens at the positions `f` keeps.
fn keep(tokens: &[u32], f: impl Fn(usize) -> bool) -> Vec<u32> {
    (0..tokens.len())
        .filter(|&i| f(i))
        .map(|i| tokens[i])
        .collect()
}

/// The position of the largest value (ties to the earliest); None when empty.
fn argmax(v: &[f64]) -> Option<usize> {
    v.iter()
        .enumerate()
        .max_by(|x, y| x.1.total_cmp(y.1).then(y.0.cmp(&x.0)))
        .map(|x| x.0)
}

/// The forward-only explanations of an encoder's `target`, from one forward's patterns and values.
struct Explanations {
    attention_last: Vec<f32>,
    attention_mean: Vec<f32>,
    rollout: Vec<f32>,
    norm_last: Vec<f32>,
    norm_mean: Vec<f32>,
}

impl Explanations {
    /// Every ranking the metrics compare, by name: the explanations and a seeded random one of
    /// `n` positions.
    fn rankings(&self, n: usize, seed: u64) -> Vec<(&'static str, Vec<f32>)> {
        let mut rng = Rng::new(seed);
        vec![
            ("attention_last", self.attention_last.clone()),
            ("attention_mean", self.attention_mean.clone()),
            ("rollout", self.rollout.clone()),
            ("norm_last", self.norm_last.clone()),
            ("norm_mean", self.norm_mean.clone()),
            ("random", (0..n).map(|_| rng.uniform() as f32).collect()),
        ]
    }

    /// Position `pos`'s row: token `id` (`text`), its explanations and its `deletion` effect.
    fn row(&self, pos: usize, id: u32, text: String, deletion: f32) -> EncTokenRow {
        EncTokenRow {
            pos,
            id,
            text,
            attention_last: self.attention_last[pos],
            attention_mean: self.attention_mean[pos],
            rollout: self.rollout[pos],
            norm_last: self.norm_last[pos],
            norm_mean: self.norm_mean[pos],
            deletion,
        }
    }
}

/// The explanations read from the target's queries: \[CLS\]'s, or the mean of every position's
/// (the embedding pools them all).
fn explanations(model: &Model, tokens: &[u32], target: EncoderTarget) -> Result<Explanations> {
    let (n, d) = (tokens.len(), &model.dims);
    let spec = CaptureSpec {
        hooks: vec![Hook::Pattern, Hook::V],
        layers: None,
        heads: None,
        queries: Queries::All,
    };
    let mut cache = AttnCache::new(&spec, n);
    model.forward(tokens, &RunOptions::default(), &mut cache)?;
    // the queries the target reads: [CLS]'s, or every position's (mean pooling)
    let queries: Vec<usize> = match target {
        EncoderTarget::Cls => vec![0],
        EncoderTarget::Embedding => (0..n).collect(),
    };
    let head_means: Vec<Vec<f32>> = (0..d.n_layers)
        .map(|l| {
            let p = cache.pattern(l).expect("all layers captured");
            mean_rows((0..d.n_heads).map(|h| &p.data[h * n * n..][..n * n]))
        })
        .collect();
    let over_queries = |row: &dyn Fn(usize) -> Vec<f32>| -> Vec<f32> {
        let rows: Vec<Vec<f32>> = queries.iter().map(|&q| row(q)).collect();
        mean_rows(rows.iter().map(Vec::as_slice))
    };
    let layer_rows: Vec<Vec<f32>> = head_means
        .iter()
        .map(|hm| over_queries(&|q| hm[q * n..][..n].to_vec()))
        .collect();
    let norm_rows: Vec<Vec<f32>> = (0..d.n_layers)
        .map(|l| {
            let p = cache.pattern(l).expect("all layers captured");
            let v = cache.get(l, Hook::V).expect("values captured");
            let v = Values::pos_major(&v.data, n, d.n_kv_heads, d.head_dim);
            over_queries(&|q| {
                let alphas: Vec<&[f32]> = (0..d.n_heads).map(|h| p.row(h, q)).collect();
                mixed_norms(model, l, &v, &alphas, n)
            })
        })
        .collect();
    let norm_shares: Vec<Vec<f32>> = norm_rows.iter().map(|r| shares(r)).collect();
    Ok(Explanations {
        attention_last: layer_rows[d.n_layers - 1].clone(),
        attention_mean: mean_rows(layer_rows.iter().map(Vec::as_slice)),
        rollout: over_queries(&|q| rollout(&head_means, n, q)),
        norm_last: norm_rows[d.n_layers - 1].clone(),
        norm_mean: mean_rows(norm_shares.iter().map(Vec::as_slice)),
    })
}

/// The target's vector of every variant the report reads, each distinct one computed once: the
/// text, each position deleted, and each ranking's top k deleted and kept alone.
fn vectors(
    model: &Model,
    tokens: &[u32],
    target: EncoderTarget,
    rankings: &[(&str, Vec<f32>)],
    tick: &mut dyn FnMut(usize, usize),
) -> Result<HashMap<Vec<u32>, Vec<f32>>> {
    let n = tokens.len();
    let candidates: Vec<usize> = (0..n).collect();
    let mut wanted: Vec<Vec<u32>> = vec![tokens.to_vec()];
    wanted.extend((0..n).map(|j| keep(tokens, |i| i != j)));
    for (_, scores) in rankings {
        for &k in TOP_KS.iter().filter(|&&k| k < n) {
            let top = top_positions(scores, &candidates, k);
            wanted.push(keep(tokens, |i| !top.contains(&i)));
            wanted.push(keep(tokens, |i| top.contains(&i)));
        }
    }
    let mut memo: HashMap<Vec<u32>, Vec<f32>> = HashMap::new();
    let distinct: Vec<Vec<u32>> = {
        let mut seen = std::collections::HashSet::new();
        wanted
            .into_iter()
            .filter(|w| seen.insert(w.clone()))
            .collect()
    };
    let total = distinct.len();
    for (i, w) in distinct.into_iter().enumerate() {
        let v = target.vector(model, &w)?;
        memo.insert(w, v);
        tick(i + 1, total);
    }
    Ok(memo)
}

/// One ranking against deletion (`imp`): ρ, τ-b and their permutation p-values, top-1
/// agreement, comprehensiveness and sufficiency at k by `effect` (1 − cos to the text's vector).
fn metric_row(
    name: &str,
    scores: &[f32],
    imp: &[f64],
    effect: &dyn Fn(&[u32]) -> f32,
    tokens: &[u32],
) -> MetricRow {
    let n = tokens.len();
    let candidates: Vec<usize> = (0..n).collect();
    let (mut comp, mut suff) = (AtK::default(), AtK::default());
    for &k in &TOP_KS {
        let (c, s) = if k < n {
            let top = top_positions(scores, &candidates, k);
            (
                Some(effect(&keep(tokens, |i| !top.contains(&i)))),
                Some(effect(&keep(tokens, |i| top.contains(&i)))),
            )
        } else {
            (None, None)
        };
        match k {
            1 => (comp.k1, suff.k1) = (c, s),
            3 => (comp.k3, suff.k3) = (c, s),
            _ => (comp.k5, suff.k5) = (c, s),
        }
    }
    let sc: Vec<f64> = scores.iter().map(|&x| x as f64).collect();
    MetricRow {
        ranking: name.to_string(),
        truth: "deletion".into(),
        n,
        spearman: spearman(&sc, imp),
        spearman_p: permutation_p(&sc, imp, spearman),
        kendall: kendall_tau_b(&sc, imp),
        kendall_p: permutation_p(&sc, imp, kendall_tau_b),
        top1: Some(argmax(&sc) == argmax(imp)),
        comprehensiveness: comp,
        sufficiency: suff,
        without_first: false,
    }
}
