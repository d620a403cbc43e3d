//! The bounded encoding of a long view. Up to [`FULL_MAX`] tokens the page embeds every weight;
//! above, a layer's `[heads, n, n]` map is stored per query row as its [`TOP_HEAD`] largest
//! weights (position and weight, the weight rounded to 1/65535) plus the weight on the first
//! token, and per query row the head average's [`TOP_MEAN`] largest weights plus its first-token
//! weight. Nothing else of the row is kept: the page shows the rest of the row's mass
//! (1 − what is stored) spread evenly over the row's other keys, and says so.
//!
//! At 4,096 tokens a 24-layer, 14-head model is 24 × 14 × 4,096 rows: 26 bytes per head row
//! and 66 per head-averaged row, gzip-compressed per layer (the browser inflates one layer when
//! it is shown, with its built-in `DecompressionStream`), then base64.
//!
//! [`SparseView`] is an [`Observer`]: fed block by block while the attention streams, it never
//! holds an `n × n` map.

use crate::model::capture::{Hook, Observer};
use rayon::prelude::*;
use std::io::Write;

/// Up to this many tokens the page embeds every weight (head view, model view, large map).
pub const FULL_MAX: usize = 256;
/// Top weights kept per head row above [`FULL_MAX`].
pub const TOP_HEAD: usize = 6;
/// Top weights kept per head-averaged row.
pub const TOP_MEAN: usize = 16;
/// Marks an unused slot (a row with fewer visible keys than slots).
const PAD: u16 = u16::MAX;

fn q16(w: f32) -> u16 {
    (w.clamp(0.0, 1.0) * 65535.0).round() as u16
}

/// The `k` largest entries of `row` as (position, weight), largest first, ties to the lower
/// position, padded with `(PAD, 0)`.
pub fn top_slots(row: &[f32], k: usize, out: &mut [(u16, u16)]) {
    let mut best: Vec<(f32, usize)> = Vec::with_capacity(k + 1);
    for (j, &w) in row.iter().enumerate() {
        if best.len() == k && w <= best[k - 1].0 {
            continue;
        }
        let at = best.partition_point(|&(b, _)| b >= w);
        best.insert(at, (w, j));
        best.truncate(k);
    }
    for (t, slot) in out.iter_mut().enumerate().take(k) {
        *slot = best.get(t).map_or((PAD, 0), |&(w, j)| (j as u16, q16(w)));
    }
}

/// Collects the bounded view of every layer while the attention streams.
pub struct SparseView {
    n: usize,
    n_heads: usize,
    /// per layer: `[heads, n, TOP_HEAD]` slots
    head: Vec<Vec<(u16, u16)>>,
    /// per layer: `[heads, n]` first-token weights
    head_sink: Vec<Vec<f32>>,
    /// per layer: `[n, TOP_MEAN]` slots of the head average
    mean: Vec<Vec<(u16, u16)>>,
    mean_sink: Vec<Vec<f32>>,
    /// per layer: `hook_v`, when asked for
    pub values: Vec<Option<Vec<f32>>>,
    keep_values: bool,
    /// Called with each finished layer (a progress bar).
    pub on_layer: Option<Box<dyn FnMut(usize) + Send + Sync>>,
}

impl SparseView {
    pub fn new(n_layers: usize, n_heads: usize, n: usize, keep_values: bool) -> Self {
        assert!(
            n < PAD as usize,
            "the bounded view indexes keys with 16 bits"
        );
        SparseView {
            n,
            n_heads,
            head: vec![vec![(PAD, 0); n_heads * n * TOP_HEAD]; n_layers],
            head_sink: vec![vec![0.0; n_heads * n]; n_layers],
            mean: vec![vec![(PAD, 0); n * TOP_MEAN]; n_layers],
            mean_sink: vec![vec![0.0; n]; n_layers],
            values: vec![None; n_layers],
            keep_values,
            on_layer: None,
        }
    }

    /// Per layer, the sink share of the last query (mean over heads).
    pub fn sink_query(&self) -> Vec<f32> {
        self.mean_sink.iter().map(|s| s[self.n - 1]).collect()
    }

    /// Per layer, the sink share over queries 1..n-1 (mean over heads); 1 for one token.
    pub fn sink_all(&self) -> Vec<f32> {
        self.mean_sink
            .iter()
            .map(|s| {
                if self.n < 2 {
                    1.0
                } else {
                    (s[1..].iter().map(|&x| x as f64).sum::<f64>() / (self.n - 1) as f64) as f32
                }
            })
            .collect()
    }

    /// Layer `l` as the page stores it: gzip of the slots, then base64. Layout (little-endian
    /// u16, each part one run, so like numbers sit together and compress): the head rows'
    /// distances back from the query (`i − pos`, `0xFFFF` for an unused slot), their weights
    /// (·65535), their first-token weights; then the same three for the head-averaged rows.
    pub fn encode_layer(&self, l: usize) -> String {
        let n = self.n;
        let mut raw = Vec::with_capacity(
            2 * (self.head[l].len() * 2 + self.mean[l].len() * 2 + (self.n_heads + 1) * n),
        );
        let mut part = |slots: &[(u16, u16)], sinks: &[f32], k: usize| {
            for (r, chunk) in slots.chunks(k).enumerate() {
                let i = r % n;
                for &(pos, _) in chunk {
                    // the distance back from the query compresses better than the position
                    let d = if pos == PAD {
                        PAD
                    } else {
                        (i - pos as usize) as u16
                    };
                    raw.extend_from_slice(&d.to_le_bytes());
                }
            }
            for &(_, w) in slots {
                raw.extend_from_slice(&w.to_le_bytes());
            }
            for &s in sinks {
                raw.extend_from_slice(&q16(s).to_le_bytes());
            }
        };
        part(&self.head[l], &self.head_sink[l], TOP_HEAD);
        part(&self.mean[l], &self.mean_sink[l], TOP_MEAN);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(6));
        gz.write_all(&raw).expect("writing to memory");
        super::html::base64(&gz.finish().expect("writing to memory"))
    }
}

impl Observer for SparseView {
    fn wants(&self, layer: usize, hook: Hook) -> bool {
        layer < self.head.len() && (hook == Hook::Pattern || (hook == Hook::V && self.keep_values))
    }
    fn tensor(&mut self, layer: usize, hook: Hook, _: &[usize], data: &[f32]) {
        if hook == Hook::V {
            self.values[layer] = Some(data.to_vec());
        }
    }
    fn layer_done(&mut self, layer: usize) {
        if let Some(f) = self.on_layer.as_mut() {
            f(layer);
        }
    }
    fn attention_block(
        &mut self,
        layer: usize,
        hook: Hook,
        q_start: usize,
        shape: [usize; 3],
        data: &[f32],
    ) {
        if hook != Hook::Pattern || layer >= self.head.len() {
            return;
        }
        let [heads, rows, kw] = shape;
        let n = self.n;
        let heads = heads.min(self.n_heads);
        let rows = rows.min(n.saturating_sub(q_start));
        // per head: its rows' slots and sinks (heads in parallel)
        let head_slots = &mut self.head[layer];
        let head_sink = &mut self.head_sink[layer];
        head_slots
            .par_chunks_mut(n * TOP_HEAD)
            .zip(head_sink.par_chunks_mut(n))
            .take(heads)
            .enumerate()
            .for_each(|(h, (slots, sinks))| {
                for x in 0..rows {
                    let i = q_start + x;
                    let row = &data[(h * shape[1] + x) * kw..][..(i + 1).min(kw)];
                    top_slots(row, TOP_HEAD, &mut slots[i * TOP_HEAD..(i + 1) * TOP_HEAD]);
                    sinks[i] = row[0];
                }
            });
        // the head average of each row
        let mean_slots = &mut self.mean[layer];
        let mean_sink = &mut self.mean_sink[layer];
        mean_slots
            .par_chunks_mut(TOP_MEAN)
            .zip(mean_sink.par_iter_mut())
            .skip(q_start)
            .take(rows)
            .enumerate()
            .for_each(|(x, (slots, sink))| {
                let i = q_start + x;
                let width = (i + 1).min(kw);
                let mut acc = vec![0f32; width];
                for h in 0..heads {
                    let row = &data[(h * shape[1] + x) * kw..][..width];
                    acc.iter_mut().zip(row).for_each(|(a, &w)| *a += w);
                }
                let inv = 1.0 / heads as f32;
                acc.iter_mut().for_each(|a| *a *= inv);
                top_slots(&acc, TOP_MEAN, slots);
                *sink = acc[0];
            });
    }
}

/// Value norms `‖W_Oʰ vⱼ‖` of one layer as the page stores them: f32 scale (the largest), then
/// `[heads, n]` u16 fractions of it, base64.
pub fn encode_value_norms(norms: &[f32]) -> String {
    let max = norms.iter().copied().fold(0.0f32, f32::max);
    let mut raw = Vec::with_capacity(4 + 2 * norms.len());
    raw.extend_from_slice(&max.to_le_bytes());
    for &x in norms {
        let v = if max > 0.0 { x / max } else { 0.0 };
        raw.extend_from_slice(&q16(v).to_le_bytes());
    }
    super::html::base64(&raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_slots_rank_and_pad() {
        let mut out = [(0u16, 0u16); 4];
        top_slots(&[0.1, 0.4, 0.1, 0.4], 4, &mut out);
        assert_eq!(
            out,
            [(1, q16(0.4)), (3, q16(0.4)), (0, q16(0.1)), (2, q16(0.1))]
        );
        top_slots(&[0.3, 0.7], 4, &mut out);
        assert_eq!(out, [(1, q16(0.7)), (0, q16(0.3)), (PAD, 0), (PAD, 0)]);
        let mut two = [(0u16, 0u16); 2];
        top_slots(&[0.2, 0.5, 0.05, 0.25], 2, &mut two);
        assert_eq!(two, [(1, q16(0.5)), (3, q16(0.25))]);
    }

    #[test]
    fn blocks_fill_the_same_slots_as_one_block() {
        // 2 heads, 5 tokens, causal rows
        let (h, n) = (2, 5);
        let mut map = vec![0f32; h * n * n];
        for hh in 0..h {
            for i in 0..n {
                let raw: Vec<f32> = (0..=i)
                    .map(|j| 1.0 + ((hh * 7 + i * 3 + j * 5) % 4) as f32)
                    .collect();
                let s: f32 = raw.iter().sum();
                for j in 0..=i {
                    map[(hh * n + i) * n + j] = raw[j] / s;
                }
            }
        }
        let mut whole = SparseView::new(1, h, n, false);
        whole.attention_block(0, Hook::Pattern, 0, [h, n, n], &map);
        let mut parts = SparseView::new(1, h, n, false);
        for (q0, rows) in [(0, 2), (2, 3)] {
            let kw = q0 + rows;
            let mut block = Vec::new();
            for hh in 0..h {
                for x in 0..rows {
                    block.extend_from_slice(&map[(hh * n + q0 + x) * n..][..kw]);
                }
            }
            parts.attention_block(0, Hook::Pattern, q0, [h, rows, kw], &block);
        }
        assert_eq!(whole.head, parts.head);
        assert_eq!(whole.mean, parts.mean);
        assert_eq!(whole.encode_layer(0), parts.encode_layer(0));
        // the head average's sink is the mean of the heads' sinks
        for i in 0..n {
            let want = (map[i * n] + map[(n + i) * n]) / 2.0;
            assert!((whole.mean_sink[0][i] - want).abs() < 1e-7);
        }
        assert!((whole.sink_query()[0] - whole.mean_sink[0][n - 1]).abs() < 1e-9);
    }
}
