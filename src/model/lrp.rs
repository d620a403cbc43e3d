//! AttnLRP [Achtibat et al. 2024, arXiv:2402.05602]: layer-wise relevance propagation through
//! the attention, run as a modified backward in the gradient × input form (the form the
//! authors' package LXT uses, after Arras et al. 2025, arXiv:2502.15886).
//!
//! The relevance starts at the explained logit (`R = logit(target)`, or the logit difference)
//! and flows back through the engine's own backward ([`super::backward`]) with each operation's
//! rule written as the gradient it implies (relevance = input × modified gradient):
//!
//! - linear maps, residual sums, RoPE and the scores' scale: the ε-rule (ε → 0), which is the
//!   true gradient;
//! - softmax: the paper's Proposition 3.1, `R_in = x ⊙ (R_out − s Σ R_out)`, which is the
//!   true gradient times the scores;
//! - `Q·Kᵀ` and `P·V` (bilinear): the uniform rule, half to each factor: `q` and `k` get a
//!   quarter of their gradient (a half through `Q·Kᵀ`, the probabilities' half of `P·V` before
//!   it), `v` a half;
//! - the gated MLP's product `act(gate) ⊙ up`: the uniform rule, half to each factor;
//! - element-wise nonlinearities (SiLU, GeLU, soft-caps): the identity rule, `f(x)/x` as the
//!   derivative;
//! - RMSNorm and LayerNorm (before the blocks, after them for Gemma, on q/k, the final norm): the
//!   identity rule on the normalization, their scale `1/√(var + ε)` held constant.
//!
//! Per input token the relevance is `Σ_d x_{i,d} · g_{i,d}` over the embedding width. What the
//! biases, the softmax's shift and the norms' ε absorb is missing from the sum: the
//! conservation error `Σ_i R_i − f` says how much.

use super::backward::{Metric, Rules};
use super::error::{Error, Result};
use super::Model;

/// AttnLRP's relevance of each input token for one logit (or logit difference).
#[derive(Clone, Debug)]
pub struct Relevance {
    /// The explained token (the answer of a logit difference).
    pub target: u32,
    /// `log p(target | text)` at the last position.
    pub logprob: f32,
    /// The explained scalar: `logit(target)`, or `logit(answer) − logit(wrong)`.
    pub value: f32,
    /// Per input token, `Σ_d x_{i,d} · g_{i,d}` (`g`: the gradient under AttnLRP's rules).
    pub scores: Vec<f32>,
    /// `Σ_i scores_i − value`: the relevance that did not reach the input.
    pub conservation_error: f32,
}

impl Model {
    /// AttnLRP's relevance of each token of `tokens` for the last position's `metric`:
    /// [`Metric::LogProb`] explains the target's logit (`None`: the top next token),
    /// [`Metric::LogitDiff`] the logit difference.
    pub fn attnlrp(&self, tokens: &[u32], metric: Metric) -> Result<Relevance> {
        let (x0, _) = self.input_embeddings(tokens)?;
        let g = self.run_rules(&x0, metric, true, Rules::AttnLrp)?;
        let dm = self.dims.d_model;
        let scores: Vec<f32> = g
            .grad_input
            .chunks(dm)
            .zip(x0.chunks(dm))
            .map(|(g, x)| {
                g.iter()
                    .zip(x)
                    .map(|(&g, &x)| g as f64 * x as f64)
                    .sum::<f64>() as f32
            })
            .collect();
        if let Some(i) = scores.iter().position(|v| !v.is_finite()) {
            return Err(Error::NonFinite {
                what: format!("the AttnLRP relevance of position {i}"),
                layer: None,
            });
        }
        let sum: f64 = scores.iter().map(|&v| v as f64).sum();
        Ok(Relevance {
            target: g.target,
            logprob: g.logprob,
            value: g.value,
            conservation_error: (sum - g.value as f64) as f32,
            scores,
        })
    }
}
