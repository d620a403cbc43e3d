//! Many texts through one forward: their rows stacked through the row-wise work (norms, the
//! projections, the MLP), the attention per text with its own positions (no padding), and each
//! text's hooks handed to its own observer. For short texts a forward is bound by reading the
//! weights, so one forward over many costs about what one short forward costs (`corpus` runs its
//! texts this way). Each text's numbers are those of its own [`Model::forward`]: the kernels
//! compute every row alone, and the attention of a segment sees only its own rows.

use super::capture::{Hook, Observer};
use super::error::Result;
use super::forward::{RunOptions, Segment};
use super::Model;
use std::ops::Range;

/// Hands each segment of a forward over stacked segments to its own observer: a per-position
/// tensor (`[Σ rows, …]`) is split into each segment's rows; the attention's calls go to the
/// segment the forward says it is on ([`Observer::segment`]). Edits are not passed on (an
/// observer that edits runs in a forward of its own).
pub struct PerSegment<'a, O: Observer> {
    obs: &'a mut [O],
    /// each segment's new rows
    rows: Vec<usize>,
    /// each segment's logits rows (the last layer keeps only those when no hook wants the rest)
    logits: Vec<usize>,
    cur: usize,
}

impl<'a, O: Observer> PerSegment<'a, O> {
    /// One observer per segment; `rows` and `logits` as the segments have them.
    pub fn new(obs: &'a mut [O], rows: Vec<usize>, logits: Vec<usize>) -> Self {
        assert_eq!(obs.len(), rows.len(), "one observer per segment");
        PerSegment {
            obs,
            rows,
            logits,
            cur: 0,
        }
    }
}

impl<O: Observer> Observer for PerSegment<'_, O> {
    fn wants(&self, layer: usize, hook: Hook) -> bool {
        if hook.is_attention_map() {
            self.obs[self.cur].wants(layer, hook)
        } else {
            self.obs.iter().any(|o| o.wants(layer, hook))
        }
    }
    fn tensor(&mut self, layer: usize, hook: Hook, shape: &[usize], data: &[f32]) {
        let total: usize = self.rows.iter().sum();
        let split = if shape[0] == total {
            &self.rows
        } else {
            // the last layer's rows gathered to the logits rows
            debug_assert_eq!(shape[0], self.logits.iter().sum::<usize>());
            &self.logits
        };
        let width: usize = shape[1..].iter().product();
        let mut at = 0;
        for (o, &r) in self.obs.iter_mut().zip(split) {
            if r > 0 && o.wants(layer, hook) {
                let mut s = shape.to_vec();
                s[0] = r;
                o.tensor(layer, hook, &s, &data[at * width..(at + r) * width]);
            }
            at += r;
        }
    }
    crate::delegate_observer!(obs[cur]:
        attention_block, wants_stats, attention_stats, wants_rows, attention_rows, pattern_rows);
    fn attention_done(&mut self, layer: usize) {
        self.obs.iter_mut().for_each(|o| o.attention_done(layer))
    }
    fn layer_done(&mut self, layer: usize) {
        self.obs.iter_mut().for_each(|o| o.layer_done(layer))
    }
    fn segment(&mut self, index: usize) {
        self.cur = index;
    }
}

/// Consecutive ranges of `lens` (items' row counts) for forwards of at most `max_rows` rows and
/// `max_items` items each (an item longer than `max_rows` goes alone).
pub fn batches(lens: &[usize], max_rows: usize, max_items: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut rows) = (0, 0);
    for (i, &n) in lens.iter().enumerate() {
        if i > start && (rows + n > max_rows || i - start == max_items) {
            out.push(start..i);
            (start, rows) = (i, 0);
        }
        rows += n;
    }
    if start < lens.len() {
        out.push(start..lens.len());
    }
    out
}

impl Model {
    /// Runs every text of `texts` (token ids, each from position 0) in one forward, handing each
    /// text's hooks to its own observer in `observers`, and returns each text's last-position
    /// logits. The row-wise work (norms, projections, MLP) runs on all the texts' rows stacked;
    /// the attention runs per text with its own positions, so no padding is computed. Each
    /// text's logits and hooks are those of its own [`Model::forward`] (the kernels compute each
    /// row alone: tested bit for bit). Per-position tensors reach an observer as its text's
    /// rows; edits are not passed on. Callers split a long list into forwards of a few thousand
    /// rows ([`batches`]).
    pub fn forward_many<O: Observer>(
        &self,
        texts: &[&[u32]],
        observers: &mut [O],
    ) -> Result<Vec<Vec<f32>>> {
        if texts.len() != observers.len() {
            return Err(super::Error::Bug(format!(
                "{} texts with {} observers: you likely have a bug",
                texts.len(),
                observers.len()
            )));
        }
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let segs: Vec<Segment> = texts
            .iter()
            .map(|t| Segment {
                tokens: t,
                reuse: 0,
                knockout: Vec::new(),
                logits_at: vec![t.len().saturating_sub(1)],
            })
            .collect();
        let rows = texts.iter().map(|t| t.len()).collect();
        let mut obs = PerSegment::new(observers, rows, vec![1; texts.len()]);
        let out = self.forward_segments(None, &segs, None, &RunOptions::default(), &mut obs)?;
        Ok(out.logits)
    }
}

#[cfg(test)]
mod tests {
    use super::batches;

    #[test]
    fn batches_respect_rows_and_items() {
        assert_eq!(batches(&[3, 3, 3, 3], 6, 10), vec![0..2, 2..4]);
        assert_eq!(batches(&[3, 3, 3, 3], 100, 3), vec![0..3, 3..4]);
        // an item longer than the limit goes alone
        assert_eq!(batches(&[2, 9, 2], 5, 10), vec![0..1, 1..2, 2..3]);
        assert!(batches(&[], 5, 5).is_empty());
    }
}
