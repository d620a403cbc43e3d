//! [`StreamStats`]: per-layer, per-head attention statistics of a long text, gathered from the
//! streaming attention (online softmax over key blocks) without any attention weights being
//! stored: memory is `O(layers · heads)` plus one query block.

use crate::model::attention::{AttnStats, StatsRequest};
use crate::model::capture::{Hook, Observer};
use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct HeadStats {
    pub head: usize,
    /// α₁: mean weight on the first token over queries 1..n-1.
    pub first_token: f64,
    pub mean_entropy: f64,
    pub mean_max_weight: f64,
    /// Fraction of queries with max weight ≥ 0.9.
    pub concentrated: f64,
    /// The last query's top keys (position, weight).
    pub last_top: Vec<(u32, f32)>,
}

#[derive(Clone, Debug, Serialize)]
pub struct LayerStats {
    pub layer: usize,
    /// Head mean of α₁ (the sink share over all queries).
    pub sink_all_queries: f64,
    /// Head mean of the last query's first-token weight.
    pub sink_last_query: f64,
    pub heads: Vec<HeadStats>,
}

pub struct StreamStats {
    n: usize,
    n_heads: usize,
    top_k: usize,
    sums: Vec<Vec<[f64; 4]>>, // per layer, head: Σ first (q ≥ 1), Σ entropy, Σ max, # ≥ 0.9
    last_first: Vec<Vec<f32>>,
    last_top: Vec<Vec<Vec<(u32, f32)>>>,
    on_layer: Box<dyn FnMut(usize) + Send>,
    /// Sun et al.'s massive activations of every layer's output, when asked for
    pub massive: Option<super::sinkmetrics::Massive>,
}

impl StreamStats {
    pub fn new(
        n_layers: usize,
        n_heads: usize,
        n: usize,
        top_k: usize,
        on_layer: Box<dyn FnMut(usize) + Send>,
    ) -> Self {
        StreamStats {
            n,
            n_heads,
            top_k: top_k.max(1),
            sums: vec![vec![[0.0; 4]; n_heads]; n_layers],
            last_first: vec![vec![0.0; n_heads]; n_layers],
            last_top: vec![vec![Vec::new(); n_heads]; n_layers],
            on_layer,
            massive: None,
        }
    }

    /// Also keep the massive activations of every layer's output (its `top` largest each).
    pub fn with_massive(mut self, top: usize) -> Self {
        self.massive = Some(super::sinkmetrics::Massive::new(top));
        self
    }

    pub fn layers(&self) -> Vec<LayerStats> {
        let nq1 = (self.n.max(2) - 1) as f64;
        let n = self.n as f64;
        (0..self.sums.len())
            .map(|l| {
                let heads: Vec<HeadStats> = (0..self.n_heads)
                    .map(|h| {
                        let [f, e, m, c] = self.sums[l][h];
                        HeadStats {
                            head: h,
                            first_token: if self.n < 2 { 1.0 } else { f / nq1 },
                            mean_entropy: e / n,
                            mean_max_weight: m / n,
                            concentrated: c / n,
                            last_top: self.last_top[l][h].clone(),
                        }
                    })
                    .collect();
                let hn = self.n_heads as f64;
                LayerStats {
                    layer: l,
                    sink_all_queries: heads.iter().map(|h| h.first_token).sum::<f64>() / hn,
                    sink_last_query: self.last_first[l].iter().map(|&x| x as f64).sum::<f64>() / hn,
                    heads,
                }
            })
            .collect()
    }
}

impl Observer for StreamStats {
    fn wants(&self, _: usize, hook: Hook) -> bool {
        hook == Hook::ResidPost && self.massive.is_some()
    }
    fn tensor(&mut self, layer: usize, hook: Hook, shape: &[usize], data: &[f32]) {
        if let Some(m) = self.massive.as_mut() {
            m.tensor(layer, hook, shape, data)
        }
    }
    fn attention_block(&mut self, _: usize, _: Hook, _: usize, _: [usize; 3], _: &[f32]) {}
    fn wants_stats(&self, layer: usize) -> Option<StatsRequest> {
        (layer < self.sums.len()).then_some(StatsRequest {
            top_k: self.top_k,
            top_k_from: self.n - 1,
        })
    }
    fn attention_stats(&mut self, layer: usize, q_start: usize, s: &AttnStats) {
        for h in 0..s.n_heads {
            for r in 0..s.rows {
                let x = h * s.rows + r;
                let q = q_start + r;
                let acc = &mut self.sums[layer][h];
                if q >= 1 {
                    acc[0] += s.first_key[x] as f64;
                }
                acc[1] += s.entropy[x] as f64;
                acc[2] += s.max_weight[x] as f64;
                acc[3] += (s.max_weight[x] >= 0.9) as u8 as f64;
                if q + 1 == self.n {
                    self.last_first[layer][h] = s.first_key[x];
                    self.last_top[layer][h] = s.top[x * s.top_k..][..s.top_k]
                        .iter()
                        .copied()
                        .filter(|t| t.0 != u32::MAX)
                        .collect();
                }
            }
        }
    }
    fn layer_done(&mut self, layer: usize) {
        (self.on_layer)(layer);
    }
}
