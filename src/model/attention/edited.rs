//! The path of an observer that edits `hook_attn_scores` or `hook_pattern`: the whole maps
//! kept, edited, softmaxed again where the scores were edited, and multiplied by the values.

use super::online::all_finite;
use super::{attention_into, AttnDims, AttnStats, StatsRequest};
use crate::model::capture::{Hook, Observer};
use crate::model::error::{Error, Result};
use rayon::prelude::*;

/// Collects one segment's whole attention maps at one layer (for [`attention_edited`]) and hands
/// everything else to the observer it wraps.
pub(crate) struct MapTap<'a> {
    inner: &'a mut dyn Observer,
    layer: usize,
    /// absolute position of query row 0, query rows, keys, heads
    offset: usize,
    rows: usize,
    k_len: usize,
    /// `[heads, rows, k_len]`: masked scores -inf, masked weights 0
    scores: Vec<f32>,
    pattern: Vec<f32>,
}

impl Observer for MapTap<'_> {
    fn wants(&self, layer: usize, hook: Hook) -> bool {
        (layer == self.layer && hook.is_attention_map()) || self.inner.wants(layer, hook)
    }
    fn tensor(&mut self, layer: usize, hook: Hook, shape: &[usize], data: &[f32]) {
        self.inner.tensor(layer, hook, shape, data)
    }
    fn attention_block(
        &mut self,
        layer: usize,
        hook: Hook,
        q_start: usize,
        shape: [usize; 3],
        data: &[f32],
    ) {
        if layer != self.layer {
            return self
                .inner
                .attention_block(layer, hook, q_start, shape, data);
        }
        let [heads, rows, kw] = shape;
        let dest = if hook == Hook::AttnScores {
            &mut self.scores
        } else {
            &mut self.pattern
        };
        let r0 = q_start - self.offset;
        for h in 0..heads {
            for r in 0..rows {
                dest[(h * self.rows + r0 + r) * self.k_len..][..kw]
                    .copy_from_slice(&data[(h * rows + r) * kw..][..kw]);
            }
        }
    }
    fn wants_stats(&self, layer: usize) -> Option<StatsRequest> {
        self.inner.wants_stats(layer)
    }
    fn attention_stats(&mut self, layer: usize, q_start: usize, stats: &AttnStats) {
        self.inner.attention_stats(layer, q_start, stats)
    }
    fn wants_rows(&self, layer: usize) -> Vec<usize> {
        self.inner.wants_rows(layer)
    }
    fn attention_rows(&mut self, layer: usize, q: usize, n_heads: usize, rows: &[f32]) {
        self.inner.attention_rows(layer, q, n_heads, rows)
    }
}

/// [`attention_into`] for an observer that edits `hook_attn_scores` or `hook_pattern`: the
/// kernel computes the segment's whole maps; an edit of the scores is followed by the softmax
/// of the edited scores (a key left at -inf stays masked), an edit of the pattern is taken as
/// it is, and `z` is then the edited pattern times the values. Each map is handed to the observer
/// whole (`[heads, q_len, k_len]`, one block).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_edited(
    layer: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    knockout: &[bool],
    block_bytes: usize,
    obs: &mut dyn Observer,
    z: &mut [f32],
) -> Result<()> {
    let (nh, rows, k_len) = (dims.n_heads, dims.q_len, dims.k_len);
    let offset = k_len - rows;
    // the fast kernel with whole rows (one key block) into `z`, its maps kept whole by a
    // [`MapTap`] (what the observer wants besides is handed on); masked keys -inf and 0
    let mut tap = MapTap {
        inner: obs,
        layer,
        offset,
        rows,
        k_len,
        scores: vec![f32::NEG_INFINITY; nh * rows * k_len],
        pattern: vec![0f32; nh * rows * k_len],
    };
    attention_into(
        layer,
        q,
        k,
        v,
        dims,
        knockout,
        block_bytes,
        k_len,
        &mut tap,
        z,
    )?;
    let MapTap {
        inner: obs,
        mut scores,
        mut pattern,
        ..
    } = tap;
    let shape = [nh, rows, k_len];
    // a hook that only reads leaves the kernel's z as it is (the same bits as without it)
    let before = pattern.clone();
    if obs.edits(layer, Hook::AttnScores) {
        edit_scores(obs, layer, &shape, &mut scores, &mut pattern)?;
    }
    if obs.wants(layer, Hook::AttnScores) {
        obs.attention_block(layer, Hook::AttnScores, offset, shape, &scores);
    }
    if obs.edits(layer, Hook::Pattern) {
        edit_pattern(obs, layer, &shape, &mut pattern)?;
    }
    if obs.wants(layer, Hook::Pattern) {
        obs.attention_block(layer, Hook::Pattern, offset, shape, &pattern);
    }
    if pattern != before {
        pattern_times_values(&pattern, v, dims, z);
    }
    Ok(())
}

/// `hook_attn_scores` handed to the editing observer, then every edited row softmaxed again
/// into `pattern` (f64 sums); a NaN or +inf, or a row with every key masked, is refused.
fn edit_scores(
    obs: &mut dyn Observer,
    layer: usize,
    shape: &[usize; 3],
    scores: &mut [f32],
    pattern: &mut [f32],
) -> Result<()> {
    let k_len = shape[2];
    let name = || crate::model::capture::hook_name(layer, Hook::AttnScores);
    obs.edit(layer, Hook::AttnScores, shape, scores)
        .map_err(|msg| Error::Hook { name: name(), msg })?;
    if scores.iter().any(|s| s.is_nan() || *s == f32::INFINITY) {
        return Err(Error::Hook {
            name: name(),
            msg: "left a NaN or +infinity in the scores (-infinity masks a key); refused".into(),
        });
    }
    for (row, out) in scores.chunks(k_len).zip(pattern.chunks_mut(k_len)) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            return Err(Error::Hook {
                name: name(),
                msg: "masked every key of a query row (all -infinity): its softmax is undefined"
                    .into(),
            });
        }
        let sum: f64 = row.iter().map(|&s| ((s - max) as f64).exp()).sum();
        for (o, &s) in out.iter_mut().zip(row) {
            *o = (((s - max) as f64).exp() / sum) as f32;
        }
    }
    Ok(())
}

/// `hook_pattern` handed to the editing observer; a non-finite weight is refused (the pattern
/// then weighs the values as it is, unnormalized or not).
fn edit_pattern(
    obs: &mut dyn Observer,
    layer: usize,
    shape: &[usize; 3],
    pattern: &mut [f32],
) -> Result<()> {
    let name = || crate::model::capture::hook_name(layer, Hook::Pattern);
    obs.edit(layer, Hook::Pattern, shape, pattern)
        .map_err(|msg| Error::Hook { name: name(), msg })?;
    if !all_finite(pattern) {
        return Err(Error::Hook {
            name: name(),
            msg: "left a non-finite value (NaN or infinity) in the pattern; refused".into(),
        });
    }
    Ok(())
}

/// `z = pattern · V` (`z`: `[q_len, n_heads, head_dim]`), each query head on its KV set, for
/// an edited pattern.
fn pattern_times_values(pattern: &[f32], v: &[f32], dims: AttnDims, z: &mut [f32]) {
    let (nh, rows, k_len, d) = (dims.n_heads, dims.q_len, dims.k_len, dims.head_dim);
    let group = nh / dims.n_kv_heads;
    z.par_chunks_mut(nh * d).enumerate().for_each(|(r, zr)| {
        for h in 0..nh {
            let g = h / group;
            let out = &mut zr[h * d..(h + 1) * d];
            out.fill(0.0);
            let p = &pattern[(h * rows + r) * k_len..][..k_len];
            for (j, &w) in p.iter().enumerate() {
                if w != 0.0 {
                    let vj = &v[(g * k_len + j) * d..][..d];
                    out.iter_mut().zip(vj).for_each(|(o, &x)| *o += w * x);
                }
            }
        }
    });
}
