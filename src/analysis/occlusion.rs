//! Occlusion: a text's variants (tokens deleted, replaced, or a key knocked out) run from the
//! full run's keys and values, many to a forward, each variant's metric memoized
//! ([`Occlusions`]); [`deletion_effects`], leave-one-out by deletion, which `attribute
//! --method occlusion` reports and `faithfulness` measures rankings against.

use crate::model::backward::Metric;
use crate::model::capture::Observer;
use crate::model::forward::{log_softmax, KvPrefix, RunOptions, Segment};
use crate::model::{Model, Result};
use std::collections::HashMap;

/// `tokens` without the positions in `drop`.
pub fn without_positions(tokens: &[u32], drop: &[usize]) -> Vec<u32> {
    (0..tokens.len())
        .filter(|i| !drop.contains(i))
        .map(|i| tokens[i])
        .collect()
}

/// The two variants of a comprehensiveness/sufficiency metric: the text without the `top`
/// positions, and only them (without_first: the first token is not ranked, so it stays in both).
pub fn without_and_only(
    tokens: &[u32],
    top: &[usize],
    without_first: bool,
) -> (Vec<u32>, Vec<u32>) {
    let only = (0..tokens.len())
        .filter(|i| top.contains(i) || (without_first && *i == 0))
        .map(|i| tokens[i])
        .collect();
    (without_positions(tokens, top), only)
}

/// New positions per batch of [`Occlusions::prefetch`]: about what a 2,048-token forward holds.
const BATCH_ROWS: usize = 2048;
/// Variants per batch: each brings a logits row of the whole vocabulary (0.6 MB for Qwen2.5),
/// held twice for a moment, and a long text has many short variants.
const BATCH_VARIANTS: usize = 64;

/// The value of a resolved `metric` (its target given) on one row of logits.
pub fn metric_value(metric: Metric, logits: &[f32]) -> f32 {
    match metric {
        Metric::LogProb(t) => {
            let lp = log_softmax(logits);
            lp[t.unwrap_or_else(|| super::vocab::max_argmax(logits).1 as u32) as usize]
        }
        Metric::LogitDiff { answer, wrong } => logits[answer as usize] - logits[wrong as usize],
    }
}

/// Occlusion by deletion: `metric(text) − metric(text without token i)` for every position
/// (positive: the token raised the metric), with `metric(text)`. The deletions reuse the full
/// run's keys and values before each deleted position and run many to a forward, as
/// `faithfulness` does. `metric` must name its target; a text of one token has nothing to
/// delete (an error).
pub fn deletion_effects(
    model: &Model,
    tokens: &[u32],
    metric: Metric,
    mut tick: impl FnMut(usize, usize),
) -> Result<(f32, Vec<f32>)> {
    let n = tokens.len();
    if n < 2 {
        return Err(crate::model::Error::OutOfRange {
            what: "text".into(),
            value: format!("{n} token(s)"),
            range: "at least 2 tokens (occlusion deletes one and predicts from the rest)".into(),
        });
    }
    let (logits, kv) = full_run(model, tokens, &mut crate::model::capture::NoCapture)?;
    let base = metric_value(metric, &logits);
    let mut runner = Occlusions::new(model, tokens, &kv, metric);
    let wanted: Vec<(Vec<u32>, Option<usize>)> = (0..n)
        .map(|j| (without_positions(tokens, &[j]), None))
        .collect();
    runner.prefetch(&wanted, &mut tick)?;
    let deltas = wanted
        .iter()
        .map(|(v, _)| runner.logprob(v, None).map(|f| base - f))
        .collect::<Result<Vec<f32>>>()?;
    Ok((base, deltas))
}

/// The full run of `tokens` into `obs`, that every occlusion starts from: the last position's
/// logits, and every layer's keys and values (the prefix the occlusions reuse).
pub fn full_run(
    model: &Model,
    tokens: &[u32],
    obs: &mut dyn Observer,
) -> Result<(Vec<f32>, KvPrefix)> {
    let full = model.forward(
        tokens,
        &RunOptions {
            logits_at: vec![tokens.len() - 1],
            keep_kv: true,
            ..Default::default()
        },
        obs,
    )?;
    let kv = full.kv.expect("keep_kv was set");
    let logits = full
        .logits
        .into_iter()
        .next()
        .expect("one row of logits was asked for");
    Ok((logits, kv))
}

/// Forward passes for token variants, memoized, reusing the longest valid KV prefix.
pub struct Occlusions<'a> {
    pub model: &'a Model,
    pub tokens: &'a [u32],
    kv: &'a KvPrefix,
    metric: Metric,
    memo: HashMap<(Vec<u32>, Option<usize>), f32>,
    /// forward passes run so far, the full run included
    pub passes: usize,
}

impl<'a> Occlusions<'a> {
    /// A runner of `tokens`' variants from the full run's keys and values `kv`, measuring
    /// `metric`; the full run counts as the first pass.
    pub fn new(model: &'a Model, tokens: &'a [u32], kv: &'a KvPrefix, metric: Metric) -> Self {
        Occlusions {
            model,
            tokens,
            kv,
            metric,
            memo: HashMap::new(),
            passes: 1,
        }
    }

    /// Positions of the full run's prefix that `variant` (with `knockout`) can reuse: those
    /// before its first change and before the knocked-out key, and at least one new position.
    fn reuse(&self, variant: &[u32], knockout: Option<usize>) -> usize {
        let mut c = variant
            .iter()
            .zip(self.tokens)
            .take_while(|(a, b)| a == b)
            .count();
        if let Some(j) = knockout {
            c = c.min(j);
        }
        c.min(variant.len() - 1)
    }

    /// Runs every variant in `wanted` not yet known, many per forward ([`Model::forward_batch`]:
    /// short variants cost about what reading the weights once does, so a batch of them costs
    /// about one), and reports `tick(done, total)` in variants, counting the full run.
    pub fn prefetch(
        &mut self,
        wanted: &[(Vec<u32>, Option<usize>)],
        tick: &mut impl FnMut(usize, usize),
    ) -> Result<()> {
        let mut todo: Vec<&(Vec<u32>, Option<usize>)> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for w in wanted {
            if !self.memo.contains_key(w) && seen.insert(w) {
                todo.push(w);
            }
        }
        let (first, total) = (self.passes, self.passes + todo.len());
        tick(first, total);
        let mut rest = todo.as_slice();
        while !rest.is_empty() {
            // whole variants up to BATCH_ROWS new positions (at least one variant)
            let (mut take, mut rows) = (0, 0);
            for (v, ko) in rest {
                let new = v.len() - self.reuse(v, *ko);
                if take > 0 && (rows + new > BATCH_ROWS || take == BATCH_VARIANTS) {
                    break;
                }
                take += 1;
                rows += new;
            }
            let (batch, later) = rest.split_at(take);
            let segments: Vec<Segment> = batch
                .iter()
                .map(|(v, ko)| {
                    let c = self.reuse(v, *ko);
                    Segment {
                        tokens: &v[c..],
                        reuse: c,
                        knockout: ko.iter().copied().collect(),
                        logits_at: vec![v.len() - 1],
                    }
                })
                .collect();
            let logits = self.model.forward_batch(Some(self.kv), &segments)?;
            for (&key, rows) in batch.iter().zip(logits) {
                self.memo
                    .insert(key.clone(), metric_value(self.metric, &rows[0]));
            }
            self.passes += batch.len();
            tick(self.passes, total);
            rest = later;
        }
        Ok(())
    }

    /// The metric (log p(target), or a logit difference) after `variant` (with key `knockout`
    /// hidden, if any): from the memo that
    /// [`Occlusions::prefetch`] fills, running it there first if it is not known yet.
    pub fn logprob(&mut self, variant: &[u32], knockout: Option<usize>) -> Result<f32> {
        let key = (variant.to_vec(), knockout);
        if !self.memo.contains_key(&key) {
            self.prefetch(std::slice::from_ref(&key), &mut |_, _| {})?;
        }
        Ok(self.memo[&key])
    }
}
