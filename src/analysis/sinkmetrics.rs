//! Two published measures beside attnscope's sink profile:
//! - Gu et al. 2024 ("When Attention Sink Emerges in Language Models", ICLR 2025): the share of
//!   heads whose first-token score α₁ — its attention averaged over every query that can see it,
//!   the first token's own row included — exceeds ε (0.3), averaged over layers, on 64-token
//!   prompts ([`gu_alpha`]; the run is `sinks`'s `gu_sink_metric`);
//! - Sun et al. 2024 ("Massive Activations in Large Language Models"): residual-stream values
//!   whose magnitude is above 100 and about 1,000 times the median magnitude, with the tokens and
//!   dimensions they sit on ([`Massive`], per layer from `hook_resid_post`).

use crate::model::capture::{Hook, Observer};
use serde::Serialize;

/// Gu et al.'s α₁ of one head from attnscope's (the mean over queries 1..n-1): the first token's
/// own row (weight 1) counts too, so α = (1 + (n-1)·α₁) / n.
pub fn gu_alpha(alpha_from_1: f64, n: usize) -> f64 {
    if n == 0 {
        return 0.0;
    }
    (1.0 + (n as f64 - 1.0) * alpha_from_1) / n as f64
}

/// One large residual value.
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct Activation {
    pub pos: usize,
    pub dim: usize,
    pub value: f32,
}

/// Sun et al.'s massive activations in one layer's output (`hook_resid_post`).
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct LayerMassive {
    pub layer: usize,
    pub median_abs: f32,
    pub max_abs: f32,
    /// max over median
    pub ratio: f32,
    /// values with |x| > 100 and |x| ≥ 1,000 × the median
    pub massive: usize,
    /// the largest few, by magnitude
    pub top: Vec<Activation>,
}

/// An observer (or a part of one) that takes `hook_resid_post` of every layer and keeps only
/// its statistics: one layer's `[n, d_model]` at a time.
#[derive(Clone, Debug, Default)]
pub struct Massive {
    pub layers: Vec<LayerMassive>,
    pub top: usize,
}

impl Massive {
    pub fn new(top: usize) -> Self {
        Massive {
            layers: Vec::new(),
            top,
        }
    }

    /// The statistics of one layer's `[n, d_model]` residual.
    pub fn add(&mut self, layer: usize, d_model: usize, data: &[f32]) {
        if data.is_empty() || d_model == 0 {
            return;
        }
        let mut mags: Vec<f32> = data.iter().map(|x| x.abs()).collect();
        let mid = mags.len() / 2;
        let median_abs = *mags.select_nth_unstable_by(mid, f32::total_cmp).1;
        let cut = (1000.0 * median_abs).max(100.0);
        let mut top: Vec<Activation> = Vec::new();
        let mut massive = 0;
        let mut max_abs = 0f32;
        for (i, &v) in data.iter().enumerate() {
            let a = v.abs();
            max_abs = max_abs.max(a);
            massive += (a > cut) as usize;
            if top.len() < self.top || a > top.last().map_or(0.0, |t| t.value.abs()) {
                top.push(Activation {
                    pos: i / d_model,
                    dim: i % d_model,
                    value: v,
                });
                top.sort_by(|x, y| y.value.abs().total_cmp(&x.value.abs()));
                top.truncate(self.top);
            }
        }
        self.layers.push(LayerMassive {
            layer,
            median_abs,
            max_abs,
            ratio: if median_abs > 0.0 {
                max_abs / median_abs
            } else {
                f32::INFINITY
            },
            massive,
            top,
        });
    }
}

impl Observer for Massive {
    fn wants(&self, _: usize, hook: Hook) -> bool {
        hook == Hook::ResidPost
    }
    fn tensor(&mut self, layer: usize, _: Hook, shape: &[usize], data: &[f32]) {
        self.add(layer, shape[1], data)
    }
    fn attention_block(&mut self, _: usize, _: Hook, _: usize, _: [usize; 3], _: &[f32]) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gu_alpha_counts_the_first_rows_own_weight() {
        // n = 4: rows 1..3 put 0.5 on the first token; row 0 puts 1 on it
        assert!((gu_alpha(0.5, 4) - (1.0 + 1.5) / 4.0).abs() < 1e-12);
        assert_eq!(gu_alpha(0.0, 1), 1.0);
    }

    #[test]
    fn massive_values_are_found_with_their_place() {
        let dm = 8;
        let mut x: Vec<f32> = (0..5 * dm)
            .map(|i| 0.01 * ((i % 7) as f32 - 3.0) + 0.05)
            .collect();
        x[2 * dm + 5] = -2500.0;
        x[4 * dm + 1] = 300.0;
        let mut m = Massive::new(2);
        m.add(3, dm, &x);
        let l = &m.layers[0];
        assert_eq!((l.layer, l.massive), (3, 2));
        assert_eq!(
            (l.top[0].pos, l.top[0].dim, l.top[0].value),
            (2, 5, -2500.0)
        );
        assert_eq!((l.top[1].pos, l.top[1].dim), (4, 1));
        assert_eq!(l.max_abs, 2500.0);
        assert!(l.ratio > 1000.0);
        // nothing above 100: no massive values whatever the ratio
        let mut m = Massive::new(1);
        m.add(0, dm, &[0.001; 16]);
        assert_eq!(m.layers[0].massive, 0);
    }
}
