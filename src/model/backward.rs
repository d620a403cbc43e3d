//! A backward pass through the engine's forward (issue #39, phase 1): the gradient of a scalar of
//! the last position's logits (the target's log-probability, or a logit difference) with respect
//! to the input embeddings (the residual stream entering layer 0).
//!
//! The forward here is the engine's, op by op, on one segment (the same projections through
//! [`Linear::forward`], the same norms and activations of [`super::ops`]), with what the backward
//! needs saved per layer; the attention probabilities are recomputed per head during the
//! backward rather than stored. The weight-transposed products `dX = dY · W` use each
//! projection's matrix read back from the kernel (`I · Wᵀ`), one layer at a time.

use super::attention::{dot_f64, EXACT_SCORES_ABOVE};
use super::block::{MlpKind, NormKind};
use super::error::{Error, Result};
use super::ops::{gelu_tanh_of, layer_norm, rms_norm, rms_norm_in_place, rotate};
use super::weights::Layer;
use super::Model;
use crate::kernels::gemm::{self, Isa, PackedB};
use rayon::prelude::*;

mod taps;
pub use taps::{ActivationGradients, GradMetric, HookGradients, LayerActs, GRAD_HOOKS};
use taps::{BlockTap, Tap};

/// The scalar whose gradient is taken, of the last position's logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Metric {
    /// `log p(target)`; `None`: the top next token.
    LogProb(Option<u32>),
    /// `logit(answer) − logit(wrong)`.
    LogitDiff { answer: u32, wrong: u32 },
}

/// How the backward propagates: the true gradient, or AttnLRP's rules in the gradient × input
/// form ([`super::lrp`]): the identity rule on norms (their scale held constant) and element-wise
/// nonlinearities (activations, soft-caps), the uniform rule on the bilinear products (the gated
/// MLP's product, `Q·Kᵀ` and `P·V`), the true gradient elsewhere (softmax, linear maps, sums).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Rules {
    Gradient,
    AttnLrp,
}

/// A forward and backward's result.
#[derive(Clone, Debug)]
pub struct Gradient {
    /// The target token (the answer for a logit difference).
    pub target: u32,
    /// `log p(target | text)` at the last position.
    pub logprob: f32,
    /// The metric's value.
    pub value: f32,
    /// The last position's logits (as the engine's forward computes them).
    pub logits: Vec<f32>,
    /// The input to layer 0 (`hook_resid_pre` of layer 0: embeddings, times Gemma's scale, plus
    /// GPT-2's positions), `[n, d_model]`.
    pub input: Vec<f32>,
    /// `∂metric/∂input`, `[n, d_model]`.
    pub grad_input: Vec<f32>,
    /// `∂metric/∂resid_pre` of every layer, `[L][n, d_model]`.
    pub grad_resid_pre: Vec<Vec<f32>>,
    /// `∂metric/∂pattern` of the last query row, every layer and head (masked keys included, as
    /// autograd gives it), `[L][n_heads, n]`.
    pub grad_pattern_last: Vec<Vec<f32>>,
}

/// Integrated gradients [Sundararajan et al. 2017] from the zero input, midpoint rule.
#[derive(Clone, Debug)]
pub struct Integrated {
    /// Per token, `Σ_width x · mean_k ∂f/∂x(α_k x)`.
    pub scores: Vec<f32>,
    /// `Σ scores − (f(x) − f(0))`.
    pub gap: f32,
    pub target: u32,
    pub logprob: f32,
}

/// Integrated gradients' steps: at most this many.
pub const MAX_IG_STEPS: usize = 4096;

/// The activations integrated gradients' batched steps may keep for the backward at once.
pub const IG_BATCH_BYTES: usize = 1 << 30;

/// `batch` sequences of `n` tokens each, stacked: `x0` is `[batch·n, d_model]`.
#[derive(Clone, Copy)]
struct Batch<'a> {
    x0: &'a [f32],
    batch: usize,
}

/// One sequence's metric at its logits: what the backward starts from.
struct Seed {
    target: u32,
    logprob: f32,
    value: f32,
    logits: Vec<f32>,
    /// `d metric / d raw logit` (before the final soft-cap), as (token, weight) pairs
    dlogit: Vec<(u32, f64)>,
}

/// What one layer's backward needs from its forward.
struct Saved {
    resid_pre: Vec<f32>,
    /// q, k, v as the projection gave them (before q/k norms and RoPE), `[n, width]`
    qkv: Vec<f32>,
    /// q `[nh, n, hd]`, k and v `[nkv, n, hd]` as attention reads them
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn_proj: Vec<f32>,
    resid_mid: Vec<f32>,
    gu: Vec<f32>,
    mlp_proj: Vec<f32>,
}

fn bug(msg: String) -> Error {
    Error::Candle(candle_core::Error::Msg(msg))
}

fn norm_fwd(kind: NormKind, x: &[f32], w: &[f32], b: Option<&[f32]>, eps: f32) -> Vec<f32> {
    match (kind, b) {
        (NormKind::Layer, Some(b)) => layer_norm(x, w, b, eps),
        (NormKind::Layer, None) => layer_norm(x, w, &vec![0f32; w.len()], eps),
        (NormKind::Rms, _) => rms_norm(x, w, eps),
    }
}

/// The backward of a norm of each `[w.len()]` row of `x`: `dx` from `dy`.
pub fn norm_backward(kind: NormKind, x: &[f32], w: &[f32], eps: f32, dy: &[f32]) -> Vec<f32> {
    let d = w.len();
    let mut dx = vec![0f32; x.len()];
    let rows = x
        .par_chunks(d)
        .zip(dy.par_chunks(d))
        .zip(dx.par_chunks_mut(d));
    rows.for_each(|((xr, dyr), dxr)| {
        let g: Vec<f64> = dyr
            .iter()
            .zip(w)
            .map(|(&a, &b)| a as f64 * b as f64)
            .collect();
        match kind {
            NormKind::Rms => {
                let ms = xr.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / d as f64;
                let inv = 1.0 / ((ms as f32 + eps) as f64).sqrt();
                let gx = g.iter().zip(xr).map(|(g, &x)| g * x as f64).sum::<f64>() / d as f64;
                for ((o, &gi), &xi) in dxr.iter_mut().zip(&g).zip(xr) {
                    *o = (inv * gi - inv * inv * inv * xi as f64 * gx) as f32;
                }
            }
            NormKind::Layer => {
                let mean = xr.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
                let var = xr.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / d as f64;
                let inv = 1.0 / ((var as f32 + eps) as f64).sqrt();
                let xh: Vec<f64> = xr.iter().map(|&v| (v as f64 - mean) * inv).collect();
                let mg = g.iter().sum::<f64>() / d as f64;
                let mgx = g.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / d as f64;
                for ((o, &gi), &xi) in dxr.iter_mut().zip(&g).zip(&xh) {
                    *o = (inv * (gi - mg - xi * mgx)) as f32;
                }
            }
        }
    });
    dx
}

/// A norm's backward under `rules`: the true one ([`norm_backward`]), or AttnLRP's identity
/// rule ([`norm_identity`]).
fn norm_back(rules: Rules, kind: NormKind, x: &[f32], w: &[f32], eps: f32, dy: &[f32]) -> Vec<f32> {
    match rules {
        Rules::Gradient => norm_backward(kind, x, w, eps, dy),
        Rules::AttnLrp => norm_identity(kind, x, w, eps, dy),
    }
}

/// AttnLRP's identity rule on a norm of each `[w.len()]` row of `x`, as a gradient: the norm
/// with its scale `1/√(var + ε)` held constant (the mean's subtraction of a LayerNorm stays, a
/// linear map), so `dx = (dy ⊙ w)/σ` (RMSNorm) or `(g − mean g)/σ` with `g = dy ⊙ w`.
pub fn norm_identity(kind: NormKind, x: &[f32], w: &[f32], eps: f32, dy: &[f32]) -> Vec<f32> {
    let d = w.len();
    let mut dx = vec![0f32; x.len()];
    let rows = x
        .par_chunks(d)
        .zip(dy.par_chunks(d))
        .zip(dx.par_chunks_mut(d));
    rows.for_each(|((xr, dyr), dxr)| {
        let g: Vec<f64> = dyr
            .iter()
            .zip(w)
            .map(|(&a, &b)| a as f64 * b as f64)
            .collect();
        let (inv, mg) = match kind {
            NormKind::Rms => {
                let ms = xr.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / d as f64;
                (1.0 / ((ms as f32 + eps) as f64).sqrt(), 0.0)
            }
            NormKind::Layer => {
                let mean = xr.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
                let var = xr.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / d as f64;
                (
                    1.0 / ((var as f32 + eps) as f64).sqrt(),
                    g.iter().sum::<f64>() / d as f64,
                )
            }
        };
        for (o, &gi) in dxr.iter_mut().zip(&g) {
            *o = (inv * (gi - mg)) as f32;
        }
    });
    dx
}

/// `gelu_tanh(x)/x` (AttnLRP's identity rule on the activation), `½` at 0 (its limit).
fn gelu_ratio(x: f32) -> f32 {
    if x == 0.0 {
        0.5
    } else {
        gelu_tanh_of(x) / x
    }
}

/// One layer's projections packed for `dX = dY · W` ([`super::weights::Linear::transposed`]).
pub struct LayerT {
    qkv: PackedB,
    o: PackedB,
    gate_up: PackedB,
    down: PackedB,
}

/// `dX[m, k] = dY[m, n] · W` on the engine's GEMM, `w` packed by [`super::weights::Linear::transposed`].
fn back_matmul(dy: &[f32], m: usize, w: &PackedB) -> Vec<f32> {
    let mut dx = vec![0f32; m * w.n];
    gemm::gemm(dy, w.k, m, w, &mut dx, w.n, false);
    dx
}

/// Query rows per block of the attention's forward and backward.
const QB: usize = 64;

/// One head's attention inputs, `[n, hd]` each, with its layer's score rules.
struct Head<'a> {
    q: &'a [f32],
    v: &'a [f32],
    n: usize,
    hd: usize,
    scale: f32,
    softcap: Option<f32>,
    window: Option<usize>,
    /// AttnLRP: the soft-cap by the identity rule (`cap(s)/s` instead of its derivative)
    lrp: bool,
    /// The head's keys (`[n, hd]`) when its layer's scores can be large: a row whose scores pass
    /// [`EXACT_SCORES_ABOVE`] is then computed again in f64 and shifted by its exact maximum
    /// before it is rounded, as the forward does ([`super::attention`]'s `rescore_row`), so the
    /// backward differentiates the pattern the forward produced.
    precise_k: Option<&'a [f32]>,
}

/// A kv head's keys and values packed both ways (`Q·Kᵀ`, `dS·K`, `dZ·Vᵀ`, `P·V`).
struct Packed4 {
    k_rows: PackedB,
    k_cols: PackedB,
    v_rows: PackedB,
    v_cols: PackedB,
}

impl Packed4 {
    fn new(k: &[f32], v: &[f32], n: usize, hd: usize) -> Packed4 {
        let isa = Isa::detect();
        Packed4 {
            k_rows: PackedB::from_rows(k, n, hd, hd, isa),
            k_cols: PackedB::from_cols(k, n, hd, hd, isa),
            v_rows: PackedB::from_rows(v, n, hd, hd, isa),
            v_cols: PackedB::from_cols(v, n, hd, hd, isa),
        }
    }
}

/// `[rows, cols]` transposed to `[cols, rows]`.
fn transpose(a: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = a[r * cols + c];
        }
    }
    t
}

impl Head<'_> {
    /// Query rows `i0..i1`'s probabilities over keys `0..i1` into `p` (`[rows, i1]`), with the
    /// soft-cap's factor of each score in `th`: its derivative `1 − tanh²`, or for AttnLRP's
    /// identity rule `cap(s)/s`.
    fn probs_block(&self, kp: &Packed4, i0: usize, i1: usize, p: &mut Vec<f32>, th: &mut Vec<f32>) {
        let (hd, rows, ld) = (self.hd, i1 - i0, i1);
        p.clear();
        p.resize(rows * ld, 0.0);
        th.clear();
        th.resize(rows * ld, 0.0);
        gemm::gemm_sub(
            &self.q[i0 * hd..],
            hd,
            rows,
            &kp.k_rows,
            0..hd,
            0..ld,
            p,
            ld,
            false,
            false,
        );
        for (r, (row, trow)) in p.chunks_mut(ld).zip(th.chunks_mut(ld)).enumerate() {
            let i = i0 + r;
            let lo = self.window.map_or(0, |w| (i + 1).saturating_sub(w));
            row[i + 1..].iter_mut().for_each(|s| *s = 0.0);
            row[..lo].iter_mut().for_each(|s| *s = 0.0);
            let live = &mut row[lo..=i];
            let scale = self.scale;
            live.iter_mut().for_each(|s| *s *= scale);
            if let Some(k) = self.precise_k {
                if live.iter().any(|s| s.abs() > EXACT_SCORES_ABOVE) {
                    self.rescore(k, i, lo, live, &mut trow[lo..=i]);
                    let (sum, _) = super::attention::exp_shift_sums_masked(live, 0.0);
                    let inv = (1.0 / sum) as f32;
                    live.iter_mut().for_each(|s| *s *= inv);
                    continue;
                }
            }
            if let Some(c) = self.softcap {
                for (s, t) in live.iter_mut().zip(&mut trow[lo..=i]) {
                    let tanh = (*s / c).tanh();
                    let capped = tanh * c;
                    *t = match (self.lrp, *s == 0.0) {
                        (false, _) => 1.0 - tanh * tanh,
                        (true, false) => capped / *s,
                        (true, true) => 1.0,
                    };
                    *s = capped;
                }
            }
            let max = live.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let (sum, _) = super::attention::exp_shift_sums_masked(live, max);
            let inv = (1.0 / sum) as f32;
            live.iter_mut().for_each(|s| *s *= inv);
        }
    }

    /// Query `i`'s visible scores `live` (keys `lo..=i`) computed again in f64 from the keys `k`
    /// (scaled, soft-capped in f64, the soft-cap's factor into `t`), shifted by their exact
    /// maximum and only then rounded to f32: the shift the softmax that follows needs is 0.
    fn rescore(&self, k: &[f32], i: usize, lo: usize, live: &mut [f32], t: &mut [f32]) {
        let hd = self.hd;
        let qi = &self.q[i * hd..(i + 1) * hd];
        let scale = self.scale as f64;
        let exact: Vec<(f64, f64)> = (lo..=i)
            .map(|j| {
                let s = dot_f64(qi, &k[j * hd..(j + 1) * hd]) * scale;
                match self.softcap {
                    Some(c) => {
                        let c = c as f64;
                        let tanh = (s / c).tanh();
                        let factor = match (self.lrp, s == 0.0) {
                            (false, _) => 1.0 - tanh * tanh,
                            (true, false) => tanh * c / s,
                            (true, true) => 1.0,
                        };
                        (tanh * c, factor)
                    }
                    None => (s, 1.0),
                }
            })
            .collect();
        let m = exact.iter().map(|e| e.0).fold(f64::NEG_INFINITY, f64::max);
        for ((o, f), (s, factor)) in live.iter_mut().zip(t).zip(exact) {
            *o = (s - m) as f32;
            *f = factor as f32;
        }
    }

    /// The head's output `z`, `[n, hd]`.
    fn forward(&self, kp: &Packed4) -> Vec<f32> {
        let (n, hd) = (self.n, self.hd);
        let mut z = vec![0f32; n * hd];
        let (mut p, mut th) = (Vec::new(), Vec::new());
        for i0 in (0..n).step_by(QB) {
            let i1 = (i0 + QB).min(n);
            self.probs_block(kp, i0, i1, &mut p, &mut th);
            gemm::gemm_sub(
                &p,
                i1,
                i1 - i0,
                &kp.v_cols,
                0..i1,
                0..hd,
                &mut z[i0 * hd..],
                hd,
                false,
                false,
            );
        }
        z
    }

    /// The head's backward from `dz` (`[n, hd]`): `(dq, dk, dv)`, `[n, hd]` each, and the last
    /// query row's pattern gradient `[n]`. The probabilities are recomputed a block of query
    /// rows at a time; no `[n, n]` matrix is held.
    fn backward(&self, kp: &Packed4, dz: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let (n, hd) = (self.n, self.hd);
        let isa = Isa::detect();
        let dzl = &dz[(n - 1) * hd..];
        let dpat: Vec<f32> = self
            .v
            .chunks(hd)
            .map(|vj| dzl.iter().zip(vj).map(|(a, b)| a * b).sum())
            .collect();
        let mut dq = vec![0f32; n * hd];
        let mut dk = vec![0f32; n * hd];
        let mut dv = vec![0f32; n * hd];
        let (mut p, mut th, mut dp) = (Vec::new(), Vec::new(), Vec::new());
        for i0 in (0..n).step_by(QB) {
            let i1 = (i0 + QB).min(n);
            let (rows, ld) = (i1 - i0, i1);
            self.probs_block(kp, i0, i1, &mut p, &mut th);
            dp.clear();
            dp.resize(rows * ld, 0.0);
            let dzb = &dz[i0 * hd..i1 * hd];
            gemm::gemm_sub(
                dzb,
                hd,
                rows,
                &kp.v_rows,
                0..hd,
                0..ld,
                &mut dp,
                ld,
                false,
                false,
            );
            // dV[0..i1] += Pᵀ · dZ
            let pt = transpose(&p, rows, ld);
            let dzp = PackedB::from_cols(dzb, rows, hd, hd, isa);
            gemm::gemm_sub(
                &pt,
                rows,
                ld,
                &dzp,
                0..rows,
                0..hd,
                &mut dv,
                hd,
                true,
                false,
            );
            // dS = P ⊙ (dP − Σ P·dP), through the soft-cap and the scale
            for ((prow, dprow), trow) in p.chunks(ld).zip(dp.chunks_mut(ld)).zip(th.chunks(ld)) {
                let pdp: f64 = prow
                    .iter()
                    .zip(dprow.iter())
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum();
                let pdp = pdp as f32;
                let scale = self.scale;
                match self.softcap {
                    Some(_) => {
                        for ((d, &pj), &t) in dprow.iter_mut().zip(prow).zip(trow) {
                            *d = pj * (*d - pdp) * t * scale;
                        }
                    }
                    None => {
                        for (d, &pj) in dprow.iter_mut().zip(prow) {
                            *d = pj * (*d - pdp) * scale;
                        }
                    }
                }
            }
            gemm::gemm_sub(
                &dp,
                ld,
                rows,
                &kp.k_cols,
                0..ld,
                0..hd,
                &mut dq[i0 * hd..],
                hd,
                false,
                false,
            );
            let dst = transpose(&dp, rows, ld);
            let qp = PackedB::from_cols(&self.q[i0 * hd..i1 * hd], rows, hd, hd, isa);
            gemm::gemm_sub(
                &dst,
                rows,
                ld,
                &qp,
                0..rows,
                0..hd,
                &mut dk,
                hd,
                true,
                false,
            );
        }
        (dq, dk, dv, dpat)
    }
}

fn sigmoid(x: f32) -> f32 {
    let x = x as f64;
    (1.0 / (1.0 + (-x).exp())) as f32
}

/// d gelu_tanh(x) / dx.
fn gelu_tanh_grad(x: f32) -> f32 {
    const C: f32 = 0.797_884_6;
    let u = C * (x + 0.044_715 * x * x * x);
    let t = u.tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * C * (1.0 + 3.0 * 0.044_715 * x * x)
}

impl Model {
    /// The input to layer 0 for `tokens` (embeddings times Gemma's scale, plus GPT-2's
    /// positions), `[n, d_model]`, and the embeddings' scale (1 but for Gemma).
    pub fn input_embeddings(&self, tokens: &[u32]) -> Result<(Vec<f32>, f32)> {
        let dm = self.dims.d_model;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.dims.vocab_size) {
            return Err(Error::OutOfRange {
                what: "token id".into(),
                value: bad.to_string(),
                range: format!("0..{}", self.dims.vocab_size),
            });
        }
        let mut x: Vec<f32> = self
            .weights
            .embed
            .lookup(tokens)?
            .flatten_all()?
            .to_vec1()?;
        let scale = self.dims.gemma.as_ref().map_or(1.0, |g| g.embed_scale);
        x.iter_mut().for_each(|v| *v *= scale);
        if let Some(pe) = &self.weights.pos_embed {
            for (p, row) in x.chunks_mut(dm).enumerate() {
                row.iter_mut()
                    .zip(&pe[p * dm..(p + 1) * dm])
                    .for_each(|(v, e)| *v += e);
            }
        }
        Ok((x, scale))
    }

    /// The gradient of `metric` at the last position of `tokens` with respect to the input.
    pub fn gradient(&self, tokens: &[u32], metric: Metric) -> Result<Gradient> {
        let (x0, _) = self.input_embeddings(tokens)?;
        self.gradient_from(&x0, metric)
    }

    /// [`Model::gradient`] from a given input to layer 0 (`[n, d_model]`: integrated gradients
    /// scale it).
    pub fn gradient_from(&self, x0: &[f32], metric: Metric) -> Result<Gradient> {
        self.run_from(x0, metric, true)
    }

    /// [`Model::gradient_from`], or with `backward` false the forward alone (the gradients
    /// left empty).
    fn run_from(&self, x0: &[f32], metric: Metric, backward: bool) -> Result<Gradient> {
        self.run_rules(x0, metric, backward, Rules::Gradient)
    }

    /// [`Model::run_from`] with the backward's `rules`. Under [`Rules::AttnLrp`] the explained
    /// scalar is the target's logit (or the logit difference), not its log-probability: LRP
    /// starts from the logit (`value` then holds it).
    pub(super) fn run_rules(
        &self,
        x0: &[f32],
        metric: Metric,
        backward: bool,
        rules: Rules,
    ) -> Result<Gradient> {
        self.run_tapped(x0, metric, backward, rules, None)
    }

    /// [`Model::run_rules`], with `tap` (if any) keeping the forward's activations and the
    /// gradients at the hook points it asks for, and seeding the backward from the loss when
    /// it says so ([`taps`]).
    fn run_tapped(
        &self,
        x0: &[f32],
        metric: Metric,
        backward: bool,
        rules: Rules,
        tap: Option<&mut Tap>,
    ) -> Result<Gradient> {
        self.run_batch(Batch { x0, batch: 1 }, metric, backward, rules, tap)?
            .pop()
            .ok_or_else(|| bug("no gradient of the one sequence".into()))
    }

    /// The forward (and with `backward`, the backward) of `x.batch` sequences of equal length
    /// at once, one [`Gradient`] each (their `grad_resid_pre` and `grad_pattern_last` only
    /// for a batch of one): the row-wise work (norms, projections, activations) runs on the
    /// stacked `batch·n` rows, the attention per sequence and head. Each sequence gets the
    /// numbers its own run gives (the products of a row do not depend on the other rows). The
    /// batched forward and backward integrated gradients run their steps on; `tap` needs a batch
    /// of one.
    fn run_batch(
        &self,
        x: Batch<'_>,
        metric: Metric,
        backward: bool,
        rules: Rules,
        mut tap: Option<&mut Tap>,
    ) -> Result<Vec<Gradient>> {
        // its blocks are pre-LN and causal, its metrics next-token ones
        self.require_decoder("gradients of a next-token metric")?;
        crate::kernels::keep_freed_buffers();
        let Batch { x0, batch } = x;
        let lrp = rules == Rules::AttnLrp;
        let dims = &self.dims;
        let (nh, nkv, hd, dm, ff) = (
            dims.n_heads,
            dims.n_kv_heads,
            dims.head_dim,
            dims.d_model,
            dims.d_ff,
        );
        let eps = dims.rms_eps;
        if x0.is_empty() {
            return Err(Error::EmptyText);
        }
        if batch == 0 || !x0.len().is_multiple_of(dm * batch) {
            return Err(Error::OutOfRange {
                what: "values of the stacked inputs".into(),
                value: x0.len().to_string(),
                range: format!("a multiple of batch × d_model = {batch} × {dm}"),
            });
        }
        if batch > 1 && tap.is_some() {
            return Err(bug(
                "hook gradients are kept for one sequence at a time".into()
            ));
        }
        let rows = x0.len() / dm;
        let n = rows / batch;
        if n > dims.context_len {
            return Err(Error::TooLong {
                n_tokens: n,
                limit: dims.context_len,
                model: self.info.name.clone(),
            });
        }
        let (nq, nk) = (nh * hd, nkv * hd);
        let width = nq + 2 * nk;
        let half = dims.rotary_dim / 2;
        let style = self.weights.rope_style;
        let tables = |base: f32| {
            let mut inv = dims.rope_scaling.inv_freq(dims.rotary_dim, base);
            if let Some(f) = &self.weights.rope_freqs {
                inv.iter_mut().zip(f).for_each(|(x, f)| *x /= f);
            }
            super::ops::rope_tables_of(&inv, n)
        };
        // ---- forward, saving what the backward needs
        let mut x = x0.to_vec();
        let mut saved: Vec<Saved> = Vec::with_capacity(dims.n_layers);
        for (l, layer) in self.weights.layers.iter().enumerate() {
            let plan = layer.plan;
            let resid_pre = x.clone();
            let b1 = layer.norm_biases.as_ref().map(|b| b.0.as_slice());
            let h1 = norm_fwd(plan.norm, &x, &layer.attn_norm, b1, eps);
            let qkv = layer.qkv.forward(&h1, rows)?;
            let mut normed = qkv.clone();
            if let Some((qn, kn)) = &layer.qk_norm {
                for row in normed.chunks_mut(width) {
                    let (q, rest) = row.split_at_mut(nq);
                    for head in q.chunks_mut(hd) {
                        rms_norm_in_place(head, qn, eps);
                    }
                    for head in rest[..nk].chunks_mut(hd) {
                        rms_norm_in_place(head, kn, eps);
                    }
                }
            }
            let rope = plan.rope_base().map(&tables);
            let split = |c0: usize, heads: usize, rot: bool| -> Vec<f32> {
                let mut out = vec![0f32; heads * rows * hd];
                for h in 0..heads {
                    for r in 0..rows {
                        let v = &mut out[(h * rows + r) * hd..][..hd];
                        v.copy_from_slice(&normed[r * width + c0 + h * hd..][..hd]);
                        let pos = r % n;
                        if let (true, Some((cos, sin))) = (rot, &rope) {
                            rotate(
                                &mut v[..2 * half],
                                &cos[pos * half..][..half],
                                &sin[pos * half..][..half],
                                style,
                            );
                        }
                    }
                }
                out
            };
            let q = split(0, nh, true);
            let k = split(nq, nkv, true);
            let v = split(nq + nk, nkv, false);
            let z = self.attention_forward(l, &q, &k, &v, n, batch);
            let attn_proj = layer.o.forward(&z, rows)?;
            let attn_out = match &layer.post_norms {
                Some((pa, _)) => rms_norm(&attn_proj, pa, eps),
                None => attn_proj.clone(),
            };
            if let Some(t) = tap.as_deref_mut() {
                t.forward_attn(&resid_pre, &z, &attn_out);
            }
            x.iter_mut().zip(&attn_out).for_each(|(a, b)| *a += b);
            let resid_mid = x.clone();
            let b2 = layer.norm_biases.as_ref().map(|b| b.1.as_slice());
            let h2 = norm_fwd(plan.norm, &x, &layer.mlp_norm, b2, eps);
            let gu = layer.gate_up.forward(&h2, rows)?;
            let gw = if plan.mlp.gated() { 2 * ff } else { ff };
            let mut act = vec![0f32; rows * ff];
            let act_rows = gu.par_chunks(gw).zip(act.par_chunks_mut(ff));
            act_rows.for_each(|(row, a)| match plan.mlp {
                MlpKind::GeluTanh => a
                    .iter_mut()
                    .zip(row)
                    .for_each(|(a, &g)| *a = gelu_tanh_of(g)),
                MlpKind::GeluErf => a
                    .iter_mut()
                    .zip(row)
                    .for_each(|(a, &g)| *a = super::ops::gelu_erf_of(g)),
                MlpKind::GeGluTanh => {
                    for i in 0..ff {
                        a[i] = gelu_tanh_of(row[i]) * row[ff + i];
                    }
                }
                MlpKind::SwiGlu => super::ops::swiglu_row(&row[..ff], &row[ff..], a),
            });
            let mlp_proj = layer.down.forward(&act, rows)?;
            let mlp_out = match &layer.post_norms {
                Some((_, pm)) => rms_norm(&mlp_proj, pm, eps),
                None => mlp_proj.clone(),
            };
            if let Some(t) = tap.as_deref_mut() {
                t.forward_mlp(&mlp_out);
            }
            x.iter_mut().zip(&mlp_out).for_each(|(a, b)| *a += b);
            if !x.iter().all(|v| v.is_finite()) {
                return Err(Error::NonFinite {
                    what: "the residual stream after the layer's MLP".into(),
                    layer: Some(l),
                });
            }
            saved.push(Saved {
                resid_pre,
                qkv,
                q,
                k,
                v,
                attn_proj,
                resid_mid,
                gu,
                mlp_proj,
            });
        }
        // ---- each sequence's last row's logits
        let fb = self.weights.final_norm_bias.as_deref();
        let fkind = if fb.is_some() {
            NormKind::Layer
        } else {
            NormKind::Rms
        };
        let lasts: Vec<f32> = (0..batch)
            .flat_map(|b| x[(b * n + n - 1) * dm..][..dm].iter().copied())
            .collect();
        let hf = norm_fwd(fkind, &lasts, &self.weights.final_norm, fb, eps);
        let raws = super::ops::logits_rows(&self.weights.lm_head, hf, batch, dm)?;
        if raws.len() != batch {
            return Err(bug("a logits row per sequence".into()));
        }
        let cap = dims.gemma.as_ref().and_then(|g| g.final_softcap);
        let mut seeds = Vec::with_capacity(batch);
        for raw in raws {
            seeds.push(self.seed(raw, cap, metric, lrp)?);
        }
        let input = |b: usize| x0[b * n * dm..(b + 1) * n * dm].to_vec();
        if !backward {
            return Ok(seeds
                .into_iter()
                .enumerate()
                .map(|(b, sd)| Gradient {
                    target: sd.target,
                    logprob: sd.logprob,
                    value: sd.value,
                    logits: sd.logits,
                    input: input(b),
                    grad_input: Vec::new(),
                    grad_resid_pre: Vec::new(),
                    grad_pattern_last: Vec::new(),
                })
                .collect());
        }
        // through the final soft-cap, the head and the final norm
        let dh = self.unembed_back(&seeds)?;
        let mut dx = vec![0f32; rows * dm];
        for b in 0..batch {
            dx[(b * n + n - 1) * dm..][..dm].copy_from_slice(&norm_back(
                rules,
                fkind,
                &lasts[b * dm..(b + 1) * dm],
                &self.weights.final_norm,
                eps,
                &dh[b * dm..(b + 1) * dm],
            ));
        }
        if let Some(loss) = tap.as_deref().and_then(|t| t.loss.as_deref()) {
            (seeds[0].value, dx) = self.loss_seed(&x, loss, fkind)?;
        }
        // ---- the blocks, last to first
        let transposes = self.transposes();
        let mut grad_resid_pre = vec![Vec::new(); dims.n_layers];
        let mut grad_pattern = vec![Vec::new(); dims.n_layers];
        for (l, layer) in self.weights.layers.iter().enumerate().rev() {
            let s = &saved[l];
            let mut bt = tap.as_deref().filter(|t| t.wants(l)).map(|_| BlockTap {
                resid_post: dx.clone(),
                ..BlockTap::default()
            });
            let shape = (n, batch);
            grad_pattern[l] = self.block_backward(
                l,
                layer,
                &transposes[l],
                s,
                shape,
                &mut dx,
                rules,
                bt.as_mut(),
            )?;
            if !dx.iter().all(|v| v.is_finite()) {
                return Err(Error::NonFinite {
                    what: "the gradient of the residual stream".into(),
                    layer: Some(l),
                });
            }
            if batch == 1 {
                grad_resid_pre[l] = dx.clone();
            }
            if let (Some(t), Some(bt)) = (tap.as_deref_mut(), bt) {
                t.backward_layer(self, l, s, n, bt, &dx);
            }
        }
        let per = nh * n;
        Ok(seeds
            .into_iter()
            .enumerate()
            .map(|(b, sd)| Gradient {
                target: sd.target,
                logprob: sd.logprob,
                value: sd.value,
                logits: sd.logits,
                input: input(b),
                grad_input: dx[b * n * dm..(b + 1) * n * dm].to_vec(),
                grad_resid_pre: if batch == 1 {
                    std::mem::take(&mut grad_resid_pre)
                } else {
                    Vec::new()
                },
                grad_pattern_last: if batch == 1 {
                    grad_pattern
                        .iter()
                        .map(|g| g[b * per..(b + 1) * per].to_vec())
                        .collect()
                } else {
                    Vec::new()
                },
            })
            .collect())
    }

    /// One sequence's logits from the head's `raw` row (soft-capped by `cap`), the metric's
    /// target, value and `d metric / d raw logit` as (token, weight) pairs.
    fn seed(&self, raw: Vec<f32>, cap: Option<f32>, metric: Metric, lrp: bool) -> Result<Seed> {
        let logits: Vec<f32> = match cap {
            Some(c) => raw.iter().map(|&u| (u / c).tanh() * c).collect(),
            None => raw.clone(),
        };
        if !logits.iter().all(|v| v.is_finite()) {
            return Err(Error::NonFinite {
                what: "the logits".into(),
                layer: None,
            });
        }
        let lsm = super::forward::log_softmax(&logits);
        let argmax = logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            )
            .0 as u32;
        let target = match metric {
            Metric::LogProb(t) => t.unwrap_or(argmax),
            Metric::LogitDiff { answer, .. } => answer,
        };
        for t in [
            Some(target),
            match metric {
                Metric::LogitDiff { wrong, .. } => Some(wrong),
                _ => None,
            },
        ]
        .into_iter()
        .flatten()
        {
            if t as usize >= logits.len() {
                return Err(Error::OutOfRange {
                    what: "target token id".into(),
                    value: t.to_string(),
                    range: format!("0..{}", logits.len()),
                });
            }
        }
        let logprob = lsm[target as usize];
        // d metric / d logits, as (token, weight) pairs
        let mut dlogit: Vec<(u32, f64)> = Vec::new();
        let value = match metric {
            Metric::LogProb(_) if lrp => {
                dlogit.push((target, 1.0));
                logits[target as usize]
            }
            Metric::LogProb(_) => {
                for (v, &lp) in lsm.iter().enumerate() {
                    let p = (lp as f64).exp();
                    let d = if v as u32 == target { 1.0 - p } else { -p };
                    if d.abs() > 1e-12 {
                        dlogit.push((v as u32, d));
                    }
                }
                logprob
            }
            Metric::LogitDiff { answer, wrong } => {
                dlogit.push((answer, 1.0));
                dlogit.push((wrong, -1.0));
                logits[answer as usize] - logits[wrong as usize]
            }
        };
        // through the final soft-cap to the raw logits
        for (v, d) in dlogit.iter_mut() {
            *d = match cap {
                // the identity rule: what the capped logit holds passes to the raw one
                Some(_) if lrp => {
                    let r = raw[*v as usize] as f64;
                    if r == 0.0 {
                        *d
                    } else {
                        *d * logits[*v as usize] as f64 / r
                    }
                }
                Some(c) => {
                    let t = (raw[*v as usize] / c).tanh() as f64;
                    *d * (1.0 - t * t)
                }
                None => *d,
            };
        }
        Ok(Seed {
            target,
            logprob,
            value,
            logits,
            dlogit,
        })
    }

    /// `Σ_v d_v · W_U[v]` for each seed's (token, weight) pairs, `[seeds, d_model]`: a quantized
    /// head is read once for every seed, a chunk of vocabulary rows per task (each seed's sum
    /// in f64, in the order of the vocabulary within a chunk).
    fn unembed_back(&self, seeds: &[Seed]) -> Result<Vec<f32>> {
        let dm = self.dims.d_model;
        let vocab = self.dims.vocab_size;
        let mut out = vec![0f64; seeds.len() * dm];
        let dense = seeds.iter().all(|s| s.dlogit.len() * 4 > vocab);
        match &self.weights.lm_head {
            super::weights::Head::Rows(m) if dense => {
                // every seed's weights as a dense vector over the vocabulary
                let mut w = vec![0f64; seeds.len() * vocab];
                for (b, sd) in seeds.iter().enumerate() {
                    for &(v, d) in &sd.dlogit {
                        w[b * vocab + v as usize] += d;
                    }
                }
                const CHUNK: usize = 512;
                let parts: Vec<Result<Vec<f64>>> = (0..vocab.div_ceil(CHUNK))
                    .into_par_iter()
                    .map(|c| {
                        let (v0, v1) = (c * CHUNK, ((c + 1) * CHUNK).min(vocab));
                        let mut rows = vec![0f32; (v1 - v0) * dm];
                        m.rows_to_f32(v0, &mut rows)?;
                        let mut acc = vec![0f64; seeds.len() * dm];
                        for (b, a) in acc.chunks_mut(dm).enumerate() {
                            for (v, row) in (v0..v1).zip(rows.chunks(dm)) {
                                let d = w[b * vocab + v];
                                if d != 0.0 {
                                    a.iter_mut().zip(row).for_each(|(a, &r)| *a += d * r as f64);
                                }
                            }
                        }
                        Ok(acc)
                    })
                    .collect();
                for part in parts {
                    out.iter_mut().zip(part?).for_each(|(o, p)| *o += p);
                }
            }
            _ => {
                for (b, sd) in seeds.iter().enumerate() {
                    let acc = &mut out[b * dm..(b + 1) * dm];
                    for &(v, d) in &sd.dlogit {
                        let row = self.unembed_row(v)?;
                        acc.iter_mut()
                            .zip(&row)
                            .for_each(|(a, &w)| *a += d * w as f64);
                    }
                }
            }
        }
        Ok(out.iter().map(|&v| v as f32).collect())
    }

    /// Integrated gradients of `metric` (`log p(target)`, `None`: the top next token, or a
    /// logit difference) for `tokens`, from the zero input with `steps` midpoints; `progress` is
    /// called after each step. The one implementation: `attribute`, `faithfulness` and Python
    /// all come here. The steps run several at a time through one batched forward and backward
    /// ([`Model::gradient_batch`]), as many as keep the saved activations within
    /// [`IG_BATCH_BYTES`].
    pub fn integrated_gradients(
        &self,
        tokens: &[u32],
        metric: Metric,
        steps: usize,
        progress: &mut dyn FnMut(usize),
    ) -> Result<Integrated> {
        let per_step = self.saved_bytes_per_row() * tokens.len().max(1);
        let batch = (IG_BATCH_BYTES / per_step.max(1)).clamp(1, 64);
        self.integrated_gradients_batched(tokens, metric, steps, batch, progress)
    }

    /// [`Model::integrated_gradients`] with at most `batch` steps per forward and backward (1:
    /// one step at a time).
    pub fn integrated_gradients_batched(
        &self,
        tokens: &[u32],
        metric: Metric,
        steps: usize,
        batch: usize,
        progress: &mut dyn FnMut(usize),
    ) -> Result<Integrated> {
        if steps == 0 || steps > MAX_IG_STEPS {
            return Err(Error::OutOfRange {
                what: "steps".into(),
                value: steps.to_string(),
                range: format!("1..={MAX_IG_STEPS}"),
            });
        }
        let (x, _) = self.input_embeddings(tokens)?;
        let full = self.gradient_from(&x, metric)?;
        // the top next token is fixed at the full input: every step scores the same token
        let metric = match metric {
            Metric::LogProb(_) => Metric::LogProb(Some(full.target)),
            m => m,
        };
        let dm = self.dims.d_model;
        let mut total = vec![0f64; x.len()];
        let batch = batch.clamp(1, steps);
        let mut done = 0;
        while done < steps {
            let take = batch.min(steps - done);
            let mut xs = Vec::with_capacity(take * x.len());
            for k in done..done + take {
                let a = (k as f32 + 0.5) / steps as f32;
                xs.extend(x.iter().map(|v| v * a));
            }
            for g in self.gradient_batch(&xs, take, metric)? {
                total
                    .iter_mut()
                    .zip(&g.grad_input)
                    .for_each(|(t, g)| *t += *g as f64);
                done += 1;
                progress(done);
            }
        }
        let zero = self.run_from(&vec![0f32; x.len()], metric, false)?;
        let scores: Vec<f32> = total
            .chunks(dm)
            .zip(x.chunks(dm))
            .map(|(t, xr)| {
                (t.iter().zip(xr).map(|(t, x)| t * *x as f64).sum::<f64>() / steps as f64) as f32
            })
            .collect();
        let sum: f64 = scores.iter().map(|&v| v as f64).sum();
        let gap = (sum - (full.value as f64 - zero.value as f64)) as f32;
        Ok(Integrated {
            scores,
            gap,
            target: full.target,
            logprob: full.logprob,
        })
    }

    /// The gradients of `metric` for `batch` inputs to layer 0 of one length, stacked in `x0`
    /// (`[batch·n, d_model]`), through one batched forward and backward: the same numbers as
    /// [`Model::gradient_from`] on each (to float rounding), with `grad_resid_pre` and
    /// `grad_pattern_last` left empty for a batch of more than one. The row-wise work runs on
    /// all `batch·n` rows at once (each weight matrix read once for the batch), the attention
    /// per sequence and head.
    pub fn gradient_batch(
        &self,
        x0: &[f32],
        batch: usize,
        metric: Metric,
    ) -> Result<Vec<Gradient>> {
        self.run_batch(Batch { x0, batch }, metric, true, Rules::Gradient, None)
    }

    /// Bytes the forward saves for the backward per row (token) of a batch, over every layer.
    fn saved_bytes_per_row(&self) -> usize {
        let d = &self.dims;
        let width = (d.n_heads + 2 * d.n_kv_heads) * d.head_dim;
        // resid_pre, attn_proj, resid_mid, mlp_proj; qkv and q|k|v; gate|up
        let floats = 4 * d.d_model + 2 * width + 2 * d.d_ff;
        floats * 4 * d.n_layers
    }

    /// One layer's heads, `(heads, packed kv heads)`, from the saved q `[nh, n, hd]`, k and v
    /// `[nkv, n, hd]`.
    fn heads<'a>(
        &self,
        l: usize,
        q: &'a [f32],
        k: &'a [f32],
        v: &'a [f32],
        n: usize,
        rules: Rules,
    ) -> (Vec<Head<'a>>, Vec<Packed4>) {
        self.heads_batch(l, q, k, v, n, 1, rules)
    }

    /// [`Model::heads`] of `batch` sequences of `n` tokens each: q `[nh, batch·n, hd]`, k and v
    /// `[nkv, batch·n, hd]` (sequence `b` of head `h` at rows `b·n..(b+1)·n` of the head), the
    /// heads in the order `b·nh + h`, the packed kv heads `b·nkv + g`. Each sequence decides on
    /// its own whether its scores can be large (as its forward alone would).
    #[allow(clippy::too_many_arguments)]
    fn heads_batch<'a>(
        &self,
        l: usize,
        q: &'a [f32],
        k: &'a [f32],
        v: &'a [f32],
        n: usize,
        batch: usize,
        rules: Rules,
    ) -> (Vec<Head<'a>>, Vec<Packed4>) {
        let (nh, nkv, hd) = (self.dims.n_heads, self.dims.n_kv_heads, self.dims.head_dim);
        let rows = batch * n;
        let plan = self.weights.layers[l].plan;
        let group = nh / nkv;
        // the forward's test for a layer whose scores can be large: max‖q‖·max‖k‖·scale
        let scale = plan.score_scale.unwrap_or(1.0 / (hd as f32).sqrt());
        let max_sq = |xs: &[f32], heads: usize, b: usize| {
            (0..heads)
                .flat_map(|h| xs[(h * rows + b * n) * hd..][..n * hd].chunks_exact(hd))
                .map(|r| r.iter().map(|&x| x as f64 * x as f64).sum::<f64>())
                .fold(0f64, f64::max)
        };
        let precise: Vec<bool> = (0..batch)
            .map(|b| {
                (max_sq(q, nh, b) * max_sq(k, nkv, b)).sqrt() * scale as f64
                    > EXACT_SCORES_ABOVE as f64
            })
            .collect();
        let at = |h: usize, b: usize| (h * rows + b * n) * hd..(h * rows + (b + 1) * n) * hd;
        let packed: Vec<Packed4> = (0..batch * nkv)
            .into_par_iter()
            .map(|bg| {
                let (b, g) = (bg / nkv, bg % nkv);
                Packed4::new(&k[at(g, b)], &v[at(g, b)], n, hd)
            })
            .collect();
        let heads = (0..batch * nh)
            .map(|bh| {
                let (b, h) = (bh / nh, bh % nh);
                let g = h / group;
                Head {
                    q: &q[at(h, b)],
                    v: &v[at(g, b)],
                    n,
                    hd,
                    scale,
                    softcap: plan.softcap,
                    window: plan.window,
                    lrp: rules == Rules::AttnLrp,
                    precise_k: precise[b].then(|| &k[at(g, b)]),
                }
            })
            .collect();
        (heads, packed)
    }

    /// One layer's attention output `z`, `[batch·n, nh·hd]`, every head of every sequence in
    /// parallel (q, k, v as [`Model::heads_batch`] takes them).
    #[allow(clippy::too_many_arguments)]
    fn attention_forward(
        &self,
        l: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n: usize,
        batch: usize,
    ) -> Vec<f32> {
        let (nh, nkv, hd) = (self.dims.n_heads, self.dims.n_kv_heads, self.dims.head_dim);
        let group = nh / nkv;
        let (heads, packed) = self.heads_batch(l, q, k, v, n, batch, Rules::Gradient);
        let zs: Vec<Vec<f32>> = heads
            .par_iter()
            .enumerate()
            .map(|(bh, head)| head.forward(&packed[bh / nh * nkv + bh % nh / group]))
            .collect();
        let mut z = vec![0f32; batch * n * nh * hd];
        for (bh, zh) in zs.iter().enumerate() {
            let (b, h) = (bh / nh, bh % nh);
            for (i, row) in zh.chunks(hd).enumerate() {
                z[((b * n + i) * nh + h) * hd..][..hd].copy_from_slice(row);
            }
        }
        z
    }

    /// The projections packed for the backward, made on the first call.
    fn transposes(&self) -> &[LayerT] {
        self.transposed.get_or_init(|| {
            self.weights
                .layers
                .iter()
                .map(|layer| LayerT {
                    qkv: layer.qkv.transposed(),
                    o: layer.o.transposed(),
                    gate_up: layer.gate_up.transposed(),
                    down: layer.down.transposed(),
                })
                .collect()
        })
    }

    /// One block's backward for `batch` sequences of `n` tokens: `dx` (`∂/∂resid_post`,
    /// `[batch·n, d_model]`) becomes `∂/∂resid_pre`; `tap` (if any, one sequence) keeps the
    /// gradients inside the block. Returns the last query row's pattern gradients,
    /// `[batch, n_heads, n]`.
    #[allow(clippy::too_many_arguments)]
    fn block_backward(
        &self,
        l: usize,
        layer: &Layer,
        t: &LayerT,
        s: &Saved,
        (n, batch): (usize, usize),
        dx: &mut [f32],
        rules: Rules,
        mut tap: Option<&mut BlockTap>,
    ) -> Result<Vec<f32>> {
        let lrp = rules == Rules::AttnLrp;
        let dims = &self.dims;
        let (nh, nkv, hd, ff) = (dims.n_heads, dims.n_kv_heads, dims.head_dim, dims.d_ff);
        let eps = dims.rms_eps;
        let plan = layer.plan;
        let (nq, nk) = (nh * hd, nkv * hd);
        let width = nq + 2 * nk;
        let group = nh / nkv;
        let rows = batch * n;
        // MLP: resid_post = resid_mid + post(down(act(gate_up(norm(resid_mid)))))
        let d_mlp_proj = match &layer.post_norms {
            Some((_, pm)) => norm_back(rules, NormKind::Rms, &s.mlp_proj, pm, eps, dx),
            None => dx.to_vec(),
        };
        let d_act = back_matmul(&d_mlp_proj, rows, &t.down);
        let gw = if plan.mlp.gated() { 2 * ff } else { ff };
        let mut d_gu = vec![0f32; rows * gw];
        let gu_rows =
            s.gu.par_chunks(gw)
                .zip(d_act.par_chunks(ff))
                .zip(d_gu.par_chunks_mut(gw));
        gu_rows.for_each(|((row, da), dg)| match plan.mlp {
            // AttnLRP: the identity rule on the activation (its output over its input), the
            // uniform rule on the gate's product (half to each factor)
            MlpKind::GeluTanh if lrp => {
                for i in 0..ff {
                    dg[i] = da[i] * gelu_ratio(row[i]);
                }
            }
            MlpKind::GeGluTanh if lrp => {
                for i in 0..ff {
                    let (g, u) = (row[i], row[ff + i]);
                    dg[i] = 0.5 * da[i] * u * gelu_ratio(g);
                    dg[ff + i] = 0.5 * da[i] * gelu_tanh_of(g);
                }
            }
            MlpKind::SwiGlu if lrp => {
                for i in 0..ff {
                    let (g, u) = (row[i], row[ff + i]);
                    let sg = sigmoid(g);
                    // silu(g)/g = sigmoid(g)
                    dg[i] = 0.5 * da[i] * u * sg;
                    dg[ff + i] = 0.5 * da[i] * g * sg;
                }
            }
            MlpKind::GeluTanh => {
                for i in 0..ff {
                    dg[i] = da[i] * gelu_tanh_grad(row[i]);
                }
            }
            MlpKind::GeluErf => {
                // d/dx ½x(1 + erf(x/√2)) = Φ(x) + x·φ(x)
                for i in 0..ff {
                    let x = row[i] as f64;
                    let cdf = 0.5 * (1.0 + super::ops::erf64(x * std::f64::consts::FRAC_1_SQRT_2));
                    let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
                    dg[i] = da[i] * (cdf + x * pdf) as f32;
                }
            }
            MlpKind::GeGluTanh => {
                for i in 0..ff {
                    let (g, u) = (row[i], row[ff + i]);
                    dg[i] = da[i] * u * gelu_tanh_grad(g);
                    dg[ff + i] = da[i] * gelu_tanh_of(g);
                }
            }
            MlpKind::SwiGlu => {
                let (dgate, dup) = dg.split_at_mut(ff);
                super::ops::swiglu_backward_row(&row[..ff], &row[ff..], da, dgate, dup);
            }
        });
        let d_h2 = back_matmul(&d_gu, rows, &t.gate_up);
        let d_mid = norm_back(rules, plan.norm, &s.resid_mid, &layer.mlp_norm, eps, &d_h2);
        dx.iter_mut().zip(&d_mid).for_each(|(a, b)| *a += b);
        if let Some(t) = tap.as_deref_mut() {
            t.resid_mid = dx.to_vec();
        }
        // attention: resid_mid = resid_pre + post(o(attn(qkv(norm(resid_pre)))))
        let d_attn_proj = match &layer.post_norms {
            Some((pa, _)) => norm_back(rules, NormKind::Rms, &s.attn_proj, pa, eps, dx),
            None => dx.to_vec(),
        };
        let dz = back_matmul(&d_attn_proj, rows, &t.o);
        if let Some(t) = tap.as_deref_mut() {
            t.z = dz.clone();
        }
        let (heads, packed) = self.heads_batch(l, &s.q, &s.k, &s.v, n, batch, rules);
        let per_head: Vec<_> = heads
            .par_iter()
            .enumerate()
            .map(|(bh, head)| {
                let (b, h) = (bh / nh, bh % nh);
                let dzh: Vec<f32> = (b * n..(b + 1) * n)
                    .flat_map(|i| dz[(i * nh + h) * hd..][..hd].iter().copied())
                    .collect();
                head.backward(&packed[b * nkv + h / group], &dzh)
            })
            .collect();
        let mut dq = vec![0f32; nh * rows * hd];
        let mut dk = vec![0f32; nkv * rows * hd];
        let mut dv = vec![0f32; nkv * rows * hd];
        let mut dpat = vec![0f32; batch * nh * n];
        for (bh, (dqh, dkh, dvh, dph)) in per_head.into_iter().enumerate() {
            let (b, h) = (bh / nh, bh % nh);
            let g = h / group;
            let at = |h: usize| (h * rows + b * n) * hd..(h * rows + (b + 1) * n) * hd;
            dq[at(h)].copy_from_slice(&dqh);
            dk[at(g)].iter_mut().zip(&dkh).for_each(|(a, b)| *a += b);
            dv[at(g)].iter_mut().zip(&dvh).for_each(|(a, b)| *a += b);
            dpat[bh * n..(bh + 1) * n].copy_from_slice(&dph);
        }
        if let Some(t) = tap.as_deref_mut() {
            t.rot = Some((dq.clone(), dk.clone(), dv.clone()));
        }
        if lrp {
            // the uniform rule on Q·Kᵀ and on P·V: the scores' share halves at q and k, and
            // the probabilities' half of P·V halves again there; v keeps half of P·V
            dq.iter_mut().chain(dk.iter_mut()).for_each(|v| *v *= 0.25);
            dv.iter_mut().for_each(|v| *v *= 0.5);
        }
        // back through RoPE (rotate by the opposite angles), the q/k norms, into [n, width]
        let half = dims.rotary_dim / 2;
        let rope = plan.rope_base().map(|base| {
            let mut inv = dims.rope_scaling.inv_freq(dims.rotary_dim, base);
            if let Some(f) = &self.weights.rope_freqs {
                inv.iter_mut().zip(f).for_each(|(x, f)| *x /= f);
            }
            let (c, s) = super::ops::rope_tables_of(&inv, n);
            (c, s.iter().map(|v| -v).collect::<Vec<f32>>())
        });
        let mut d_qkv = vec![0f32; rows * width];
        for (c0, heads, buf, rot) in [
            (0, nh, &dq, true),
            (nq, nkv, &dk, true),
            (nq + nk, nkv, &dv, false),
        ] {
            for h in 0..heads {
                for r in 0..rows {
                    let mut v = buf[(h * rows + r) * hd..][..hd].to_vec();
                    let pos = r % n;
                    if let (true, Some((cos, sin))) = (rot, &rope) {
                        rotate(
                            &mut v[..2 * half],
                            &cos[pos * half..][..half],
                            &sin[pos * half..][..half],
                            self.weights.rope_style,
                        );
                    }
                    d_qkv[r * width + c0 + h * hd..][..hd].copy_from_slice(&v);
                }
            }
        }
        if let Some(t) = tap {
            t.qkv = d_qkv.clone();
        }
        if let Some((qn, kn)) = &layer.qk_norm {
            for (row, drow) in s.qkv.chunks(width).zip(d_qkv.chunks_mut(width)) {
                for (c0, heads, w) in [(0, nh, qn), (nq, nkv, kn)] {
                    for h in 0..heads {
                        let at = c0 + h * hd;
                        let d = norm_back(
                            rules,
                            NormKind::Rms,
                            &row[at..at + hd],
                            w,
                            eps,
                            &drow[at..at + hd],
                        );
                        drow[at..at + hd].copy_from_slice(&d);
                    }
                }
            }
        }
        let d_h1 = back_matmul(&d_qkv, rows, &t.qkv);
        let d_pre = norm_back(rules, plan.norm, &s.resid_pre, &layer.attn_norm, eps, &d_h1);
        dx.iter_mut().zip(&d_pre).for_each(|(a, b)| *a += b);
        Ok(dpat)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The backward recomputes the pattern it differentiates; where scores are large (as in
    /// Qwen2.5's first layers) it must be the forward's rescored pattern, not f32's.
    #[test]
    fn large_scores_recomputed_as_the_forward_rescores_them() {
        let (n, d) = (40usize, 128usize);
        let mut rng = crate::reference::Rng::new(5);
        // every key and query near one large direction: scores ≈ 4,000, spread of a few units
        let u: Vec<f32> = rng.normals(d, 1.0);
        let big = |rng: &mut crate::reference::Rng, c: f32| -> Vec<f32> {
            let noise = rng.normals(n * d, 0.4);
            (0..n * d).map(|i| c * u[i % d] + noise[i]).collect()
        };
        let q = big(&mut rng, 8.0);
        let k = big(&mut rng, 40.0);
        let v = rng.normals(n * d, 1.0);
        let scale = 1.0 / (d as f32).sqrt();
        for window in [None, Some(9)] {
            let mut worst = [0f64; 2];
            for (c, precise) in [false, true].into_iter().enumerate() {
                let head = Head {
                    q: &q,
                    v: &v,
                    n,
                    hd: d,
                    scale,
                    softcap: None,
                    window,
                    lrp: false,
                    precise_k: precise.then_some(&k[..]),
                };
                let z = head.forward(&Packed4::new(&k, &v, n, d));
                let mut largest = 0f64;
                for i in 0..n {
                    let lo = window.map_or(0, |w| (i + 1).saturating_sub(w));
                    let s: Vec<f64> = (lo..=i)
                        .map(|j| dot_f64(&q[i * d..][..d], &k[j * d..][..d]) * scale as f64)
                        .collect();
                    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    largest = largest.max(m.abs());
                    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                    let l: f64 = e.iter().sum();
                    for ch in 0..d {
                        let want: f64 =
                            (lo..=i).map(|j| e[j - lo] / l * v[j * d + ch] as f64).sum();
                        worst[c] = worst[c].max((z[i * d + ch] as f64 - want).abs());
                    }
                }
                assert!(largest > 1000.0, "scores not large: {largest}");
            }
            assert!(
                worst[1] < 2e-6,
                "window {window:?}: rescored output {:.2e} from float64",
                worst[1]
            );
            // the check can fail: f32 scores of this size are visibly off
            assert!(
                worst[0] > 4.0 * worst[1],
                "window {window:?}: f32 {:.2e}, rescored {:.2e}",
                worst[0],
                worst[1]
            );
        }
    }

    #[test]
    fn norm_backward_matches_finite_differences() {
        let d = 8;
        let x: Vec<f32> = (0..2 * d)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.3)
            .collect();
        let w: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 * 0.1).collect();
        let b = vec![0.1f32; d];
        let dy: Vec<f32> = (0..2 * d)
            .map(|i| ((i * 3 % 5) as f32 - 2.0) * 0.7)
            .collect();
        for kind in [NormKind::Rms, NormKind::Layer] {
            let f = |x: &[f32]| -> f64 {
                norm_fwd(kind, x, &w, Some(&b), 1e-6)
                    .iter()
                    .zip(&dy)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum()
            };
            let g = norm_backward(kind, &x, &w, 1e-6, &dy);
            for i in 0..x.len() {
                let h = 1e-2;
                let (mut a, mut c) = (x.clone(), x.clone());
                a[i] += h;
                c[i] -= h;
                let fd = (f(&a) - f(&c)) / (2.0 * h as f64);
                assert!(
                    (fd - g[i] as f64).abs() < 2e-3,
                    "{kind:?} {i}: {fd} vs {}",
                    g[i]
                );
            }
        }
    }

    #[test]
    fn attnlrp_identity_rules_by_hand() {
        // RMSNorm of (3, 4), w = (1, 2), ε = 0: scale 1/√12.5 held; dy = (1, 1) → (1, 2)/√12.5
        let inv = 1.0 / 12.5f32.sqrt();
        let dx = norm_identity(NormKind::Rms, &[3.0, 4.0], &[1.0, 2.0], 0.0, &[1.0, 1.0]);
        assert!(
            (dx[0] - inv).abs() < 1e-6 && (dx[1] - 2.0 * inv).abs() < 1e-6,
            "{dx:?}"
        );
        // LayerNorm of (1, 3): mean 2, σ 1; w = 1, dy = (2, 0) → g − mean g = (1, −1)
        let dx = norm_identity(NormKind::Layer, &[1.0, 3.0], &[1.0, 1.0], 0.0, &[2.0, 0.0]);
        assert!(
            (dx[0] - 1.0).abs() < 1e-6 && (dx[1] + 1.0).abs() < 1e-6,
            "{dx:?}"
        );
        // with the scale held, relevance in = relevance out: Σ x·dx = Σ y·dy (RMS, no ε)
        let (x, w, dy) = (
            [0.5f32, -1.5, 2.0],
            [0.7f32, 1.1, -0.4],
            [0.3f32, -0.8, 1.9],
        );
        let y = rms_norm(&x, &w, 0.0);
        let dx = norm_identity(NormKind::Rms, &x, &w, 0.0, &dy);
        let r_in: f32 = x.iter().zip(&dx).map(|(a, b)| a * b).sum();
        let r_out: f32 = y.iter().zip(&dy).map(|(a, b)| a * b).sum();
        assert!((r_in - r_out).abs() < 1e-5, "{r_in} vs {r_out}");
        // gelu(x)/x, ½ at 0
        assert_eq!(gelu_ratio(0.0), 0.5);
        for x in [-2.0f32, -1e-3, 0.4, 3.0] {
            assert!((gelu_ratio(x) * x - gelu_tanh_of(x)).abs() < 1e-6);
        }
    }

    #[test]
    fn activation_derivatives() {
        for &x in &[-3.0f32, -0.5, 0.0, 0.7, 2.5] {
            let h = 1e-3f32;
            let fd = (gelu_tanh_of(x + h) - gelu_tanh_of(x - h)) / (2.0 * h);
            assert!((fd - gelu_tanh_grad(x)).abs() < 1e-2, "gelu {x}");
        }
    }
}
