//! [`Collector`]: an observer that keeps, per layer, only what attnscope's reports need:
//! every head's row for one query, the first-token column summed over queries, and per-head
//! mean max weight and entropy over queries. Memory is `O(layers · heads · n)`, not `O(n²)`.
//!
//! In a forward it asks for no pattern: the attention streams, hands it per-(head, query)
//! statistics and recomputes the one query's rows, so `inspect` costs a plain forward. Fed
//! whole patterns ([`Observer::attention_block`], as `view` does), it gives the same numbers.

use super::vocab::{entropy, max_argmax, mean_rows};
use crate::model::attention::{AttnStats, StatsRequest};
use crate::model::capture::{Hook, Observer};
use crate::model::forward::RunOptions;
use crate::model::{Model, Result};

#[derive(Clone, Debug)]
pub struct Collector {
    pub n: usize,
    pub n_heads: usize,
    /// The query position whose rows are kept.
    pub query: usize,
    /// Per layer: `[n_heads, n]`, the query's row of each head.
    pub query_rows: Vec<Vec<f32>>,
    /// Per layer, per head: Σ over queries 1..n of the weight on key 0.
    sink_sums: Vec<Vec<f64>>,
    /// Per layer, per head: Σ over all queries of the row's max weight / entropy.
    max_sums: Vec<Vec<f64>>,
    ent_sums: Vec<Vec<f64>>,
    /// Per layer, `hook_v` (`[n, n_kv_heads, head_dim]`) where [`Collector::keep_values`] asked.
    pub values: Vec<Option<Vec<f32>>>,
    keep_values: Vec<bool>,
    /// Sun et al.'s massive activations of every layer's output, when asked for
    pub massive: Option<super::sinkmetrics::Massive>,
}

impl Collector {
    pub fn new(n_layers: usize, n_heads: usize, n: usize, query: usize) -> Self {
        Collector {
            n,
            n_heads,
            query,
            query_rows: vec![Vec::new(); n_layers],
            sink_sums: vec![vec![0.0; n_heads]; n_layers],
            max_sums: vec![vec![0.0; n_heads]; n_layers],
            ent_sums: vec![vec![0.0; n_heads]; n_layers],
            values: vec![None; n_layers],
            keep_values: vec![false; n_layers],
            massive: None,
        }
    }

    /// Also keep the massive activations of every layer's output (its `top` largest each).
    pub fn with_massive(mut self, top: usize) -> Self {
        self.massive = Some(super::sinkmetrics::Massive::new(top));
        self
    }

    /// Also keep the value vectors of `layers` (for norm-based attention): `O(n)` per layer.
    pub fn keep_values(mut self, layers: &[usize]) -> Self {
        for &l in layers {
            if l < self.keep_values.len() {
                self.keep_values[l] = true;
            }
        }
        self
    }

    pub fn n_layers(&self) -> usize {
        self.query_rows.len()
    }

    /// The query's row for `head` at `layer`.
    pub fn row(&self, layer: usize, head: usize) -> &[f32] {
        &self.query_rows[layer][head * self.n..][..self.n]
    }

    /// Head-averaged attention of the query at `layer`.
    pub fn head_mean(&self, layer: usize) -> Vec<f32> {
        mean_rows((0..self.n_heads).map(|h| self.row(layer, h)))
    }

    /// Sink share for the query: its weight on the first token, averaged over heads.
    pub fn sink_query(&self, layer: usize) -> f32 {
        (0..self.n_heads)
            .map(|h| self.row(layer, h)[0] as f64)
            .sum::<f64>() as f32
            / self.n_heads as f32
    }

    /// Sink share over all queries 1..n-1 (query 0 can only attend to itself), averaged over heads.
    /// For a one-token text it is 1 by definition.
    pub fn sink_all_queries(&self, layer: usize) -> f32 {
        if self.n < 2 {
            return 1.0;
        }
        (self.sink_sums[layer].iter().sum::<f64>() / (self.n_heads * (self.n - 1)) as f64) as f32
    }

    /// Per head, the mean over all queries of the row's max weight.
    pub fn mean_max_weight(&self, layer: usize) -> Vec<f32> {
        self.max_sums[layer]
            .iter()
            .map(|s| (s / self.n as f64) as f32)
            .collect()
    }

    /// Per head, the mean over all queries of the row's entropy (nats).
    pub fn mean_entropy(&self, layer: usize) -> Vec<f32> {
        self.ent_sums[layer]
            .iter()
            .map(|s| (s / self.n as f64) as f32)
            .collect()
    }

    /// Per head, the mean over queries 1..n-1 of the weight on the first token (α₁ of Gu et al.).
    /// For a one-token text it is 1 by definition, as [`Collector::sink_all_queries`] (their head
    /// mean) and `sinks`' α₁ are.
    pub fn head_sink(&self, layer: usize) -> Vec<f32> {
        if self.n < 2 {
            return vec![1.0; self.n_heads];
        }
        let d = (self.n - 1) as f64;
        self.sink_sums[layer]
            .iter()
            .map(|s| (s / d) as f32)
            .collect()
    }
}

impl Observer for Collector {
    fn wants(&self, layer: usize, hook: Hook) -> bool {
        hook == Hook::V && self.keep_values.get(layer).copied().unwrap_or(false)
            || hook == Hook::ResidPost && self.massive.is_some()
    }
    fn tensor(&mut self, layer: usize, hook: Hook, shape: &[usize], data: &[f32]) {
        if hook == Hook::V {
            self.values[layer] = Some(data.to_vec());
        } else if let Some(m) = self.massive.as_mut() {
            m.tensor(layer, hook, shape, data)
        }
    }
    fn wants_stats(&self, layer: usize) -> Option<StatsRequest> {
        (layer < self.query_rows.len()).then_some(StatsRequest {
            top_k: 0,
            top_k_from: usize::MAX,
        })
    }
    fn attention_stats(&mut self, layer: usize, q_start: usize, s: &AttnStats) {
        for h in 0..s.n_heads {
            for r in 0..s.rows {
                let x = h * s.rows + r;
                if q_start + r >= 1 {
                    self.sink_sums[layer][h] += s.first_key[x] as f64;
                }
                self.max_sums[layer][h] += s.max_weight[x] as f64;
                self.ent_sums[layer][h] += s.entropy[x] as f64;
            }
        }
    }
    fn wants_rows(&self, layer: usize) -> Vec<usize> {
        if layer < self.query_rows.len() {
            vec![self.query]
        } else {
            Vec::new()
        }
    }
    fn attention_rows(&mut self, layer: usize, q: usize, n_heads: usize, rows: &[f32]) {
        if q == self.query {
            let k_len = rows.len() / n_heads.max(1);
            let mut kept = vec![0f32; n_heads * self.n];
            for h in 0..n_heads {
                let w = k_len.min(self.n);
                kept[h * self.n..h * self.n + w].copy_from_slice(&rows[h * k_len..h * k_len + w]);
            }
            self.query_rows[layer] = kept;
        }
    }
    fn attention_block(
        &mut self,
        layer: usize,
        _: Hook,
        q_start: usize,
        shape: [usize; 3],
        data: &[f32],
    ) {
        let [n_heads, rows, kw] = shape;
        if self.query_rows[layer].is_empty() {
            self.query_rows[layer] = vec![0.0; n_heads * self.n];
        }
        for h in 0..n_heads {
            for r in 0..rows {
                let q = q_start + r;
                let row = &data[(h * rows + r) * kw..][..kw];
                if q >= 1 {
                    self.sink_sums[layer][h] += row[0] as f64;
                }
                let (m, _) = max_argmax(row);
                self.max_sums[layer][h] += m as f64;
                self.ent_sums[layer][h] += entropy(row) as f64;
                if q == self.query {
                    self.query_rows[layer][h * self.n..][..kw].copy_from_slice(row);
                }
            }
        }
    }
}

/// The attention of the last query, every layer and head, from a forward that holds no n × n.
pub fn last_query_attention(model: &Model, tokens: &[u32]) -> Result<Collector> {
    let d = &model.dims;
    let n = tokens.len();
    let mut rows = Collector::new(d.n_layers, d.n_heads, n, n - 1);
    model.forward(tokens, &RunOptions::default(), &mut rows)?;
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collector_sink_shares_by_hand() {
        // 1 layer, 2 heads, 3 tokens, one block with all rows
        let mut c = Collector::new(1, 2, 3, 2);
        #[rustfmt::skip]
        let data = [
            1.0, 0.0, 0.0,   0.5, 0.5, 0.0,   0.2, 0.3, 0.5,  // head 0
            1.0, 0.0, 0.0,   0.9, 0.1, 0.0,   0.6, 0.2, 0.2,  // head 1
        ];
        c.attention_block(0, Hook::Pattern, 0, [2, 3, 3], &data);
        assert!((c.sink_query(0) - 0.4).abs() < 1e-6); // (0.2 + 0.6) / 2
        assert!((c.sink_all_queries(0) - 0.55).abs() < 1e-6); // (0.5 + 0.2 + 0.9 + 0.6) / 4
        assert_eq!(c.row(0, 1), &[0.6, 0.2, 0.2]);
        assert_eq!(c.head_mean(0), vec![0.4, 0.25, 0.35]);
        assert!((c.mean_max_weight(0)[0] - (1.0 + 0.5 + 0.5) / 3.0).abs() < 1e-6);
    }

    #[test]
    fn a_one_token_text_is_all_sink() {
        let mut c = Collector::new(1, 2, 1, 0);
        c.attention_block(0, Hook::Pattern, 0, [2, 1, 1], &[1.0, 1.0]);
        assert_eq!(c.sink_all_queries(0), 1.0);
        assert_eq!(c.head_sink(0), vec![1.0, 1.0]);
    }
}
