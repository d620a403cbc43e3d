//! A backward pass through the engine's forward (issue #39, phase 1): the gradient of a scalar of
//! the last position's logits (the target's log-probability, or a logit difference) with respect
//! to the input embeddings (the residual stream entering layer 0).
//!
//! The forward here is the engine's, op by op, on one segment (the same projections through
//! [`Linear::forward`], the same norms and activations of [`super::ops`]), with what the backward
//! needs saved per layer; the attention probabilities are recomputed per head during the
//! backward rather than stored. The weight-transposed products `dX = dY · W` use each
//! projection's matrix read back from the kernel (`I · Wᵀ`), one layer at a time.

use super::block::{MlpKind, NormKind};
use super::error::{Error, Result};
use super::ops::{gelu_tanh_of, layer_norm, rms_norm, rms_norm_in_place, rotate};
use super::weights::{Layer, Linear};
use super::Model;
use rayon::prelude::*;

/// The scalar whose gradient is taken, of the last position's logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Metric {
    /// `log p(target)`; `None`: the top next token.
    LogProb(Option<u32>),
    /// `logit(answer) − logit(wrong)`.
    LogitDiff { answer: u32, wrong: u32 },
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

/// What one layer's backward needs from its forward.
struct Saved {
    resid_pre: Vec<f32>,
    h1: Vec<f32>,
    /// q, k, v as the projection gave them (before q/k norms and RoPE), `[n, width]`
    qkv: Vec<f32>,
    /// q `[nh, n, hd]`, k and v `[nkv, n, hd]` as attention reads them
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    z: Vec<f32>,
    attn_proj: Vec<f32>,
    resid_mid: Vec<f32>,
    h2: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
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
    for ((xr, dyr), dxr) in x.chunks(d).zip(dy.chunks(d)).zip(dx.chunks_mut(d)) {
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
    }
    dx
}

/// `Wᵀ` of a projection as `[k, n]` f32, read back from its kernel (`I · Wᵀ`, the bias left out).
fn transposed(lin: &Linear) -> Vec<f32> {
    let k = lin.k;
    let mut eye = vec![0f32; k * k];
    for i in 0..k {
        eye[i * k + i] = 1.0;
    }
    lin.forward_unbiased(&eye, k)
}

/// `dX[m, k] = dY[m, n] · W` with `wt = Wᵀ: [k, n]`.
fn back_matmul(dy: &[f32], m: usize, wt: &[f32], k: usize, n: usize) -> Vec<f32> {
    let mut dx = vec![0f32; m * k];
    dx.par_chunks_mut(k).enumerate().for_each(|(r, out)| {
        let g = &dy[r * n..(r + 1) * n];
        for (i, o) in out.iter_mut().enumerate() {
            let w = &wt[i * n..(i + 1) * n];
            *o = g.iter().zip(w).map(|(a, b)| a * b).sum();
        }
    });
    dx
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
        let dims = &self.dims;
        let (nh, nkv, hd, dm, ff) = (
            dims.n_heads,
            dims.n_kv_heads,
            dims.head_dim,
            dims.d_model,
            dims.d_ff,
        );
        let eps = dims.rms_eps;
        if x0.is_empty() || !x0.len().is_multiple_of(dm) {
            return Err(Error::EmptyText);
        }
        let n = x0.len() / dm;
        if n > dims.context_len {
            return Err(Error::TooLong {
                n_tokens: n,
                limit: dims.context_len,
                model: self.info.name.clone(),
            });
        }
        let (nq, nk) = (nh * hd, nkv * hd);
        let width = nq + 2 * nk;
        let group = nh / nkv;
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
            let qkv = layer.qkv.forward(&h1, n)?;
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
                let mut out = vec![0f32; heads * n * hd];
                for h in 0..heads {
                    for r in 0..n {
                        let v = &mut out[(h * n + r) * hd..][..hd];
                        v.copy_from_slice(&normed[r * width + c0 + h * hd..][..hd]);
                        if let (true, Some((cos, sin))) = (rot, &rope) {
                            rotate(
                                &mut v[..2 * half],
                                &cos[r * half..][..half],
                                &sin[r * half..][..half],
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
            let mut z = vec![0f32; n * nq];
            for h in 0..nh {
                let g = h / group;
                for i in 0..n {
                    let p = self.probs(l, &q, &k, h, g, i, n);
                    let zi = &mut z[(i * nh + h) * hd..][..hd];
                    for (j, &pj) in p.iter().enumerate() {
                        if pj != 0.0 {
                            let vj = &v[(g * n + j) * hd..][..hd];
                            zi.iter_mut().zip(vj).for_each(|(a, b)| *a += pj * b);
                        }
                    }
                }
            }
            let attn_proj = layer.o.forward(&z, n)?;
            let attn_out = match &layer.post_norms {
                Some((pa, _)) => rms_norm(&attn_proj, pa, eps),
                None => attn_proj.clone(),
            };
            x.iter_mut().zip(&attn_out).for_each(|(a, b)| *a += b);
            let resid_mid = x.clone();
            let b2 = layer.norm_biases.as_ref().map(|b| b.1.as_slice());
            let h2 = norm_fwd(plan.norm, &x, &layer.mlp_norm, b2, eps);
            let gu = layer.gate_up.forward(&h2, n)?;
            let gw = if plan.mlp.gated() { 2 * ff } else { ff };
            let mut act = vec![0f32; n * ff];
            for (row, a) in gu.chunks(gw).zip(act.chunks_mut(ff)) {
                match plan.mlp {
                    MlpKind::GeluTanh => a
                        .iter_mut()
                        .zip(row)
                        .for_each(|(a, &g)| *a = gelu_tanh_of(g)),
                    MlpKind::GeGluTanh => {
                        for i in 0..ff {
                            a[i] = gelu_tanh_of(row[i]) * row[ff + i];
                        }
                    }
                    MlpKind::SwiGlu => super::ops::swiglu_row(&row[..ff], &row[ff..], a),
                }
            }
            let mlp_proj = layer.down.forward(&act, n)?;
            let mlp_out = match &layer.post_norms {
                Some((_, pm)) => rms_norm(&mlp_proj, pm, eps),
                None => mlp_proj.clone(),
            };
            x.iter_mut().zip(&mlp_out).for_each(|(a, b)| *a += b);
            if !x.iter().all(|v| v.is_finite()) {
                return Err(Error::NonFinite {
                    what: "the residual stream after the layer's MLP".into(),
                    layer: Some(l),
                });
            }
            saved.push(Saved {
                resid_pre,
                h1,
                qkv,
                q,
                k,
                v,
                z,
                attn_proj,
                resid_mid,
                h2,
                gu,
                act,
                mlp_proj,
            });
        }
        // ---- the last row's logits
        let last = &x[(n - 1) * dm..];
        let fb = self.weights.final_norm_bias.as_deref();
        let fkind = if fb.is_some() {
            NormKind::Layer
        } else {
            NormKind::Rms
        };
        let hf = norm_fwd(fkind, last, &self.weights.final_norm, fb, eps);
        let raw = super::ops::logits_rows(&self.weights.lm_head, hf.clone(), 1, dm)?
            .pop()
            .ok_or_else(|| bug("no logits row".into()))?;
        let cap = dims.gemma.as_ref().and_then(|g| g.final_softcap);
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
        if !backward {
            return Ok(Gradient {
                target,
                logprob,
                value,
                logits,
                input: x0.to_vec(),
                grad_input: Vec::new(),
                grad_resid_pre: Vec::new(),
                grad_pattern_last: Vec::new(),
            });
        }
        // through the final soft-cap and the head
        let mut dh = vec![0f64; dm];
        for &(v, d) in &dlogit {
            let d = match cap {
                Some(c) => {
                    let t = (raw[v as usize] / c).tanh() as f64;
                    d * (1.0 - t * t)
                }
                None => d,
            };
            let row = self.unembed_row(v)?;
            dh.iter_mut()
                .zip(&row)
                .for_each(|(a, &w)| *a += d * w as f64);
        }
        let dh: Vec<f32> = dh.iter().map(|&v| v as f32).collect();
        let mut dx = vec![0f32; n * dm];
        dx[(n - 1) * dm..].copy_from_slice(&norm_backward(
            fkind,
            last,
            &self.weights.final_norm,
            eps,
            &dh,
        ));
        // ---- the blocks, last to first
        let mut grad_resid_pre = vec![Vec::new(); dims.n_layers];
        let mut grad_pattern_last = vec![Vec::new(); dims.n_layers];
        for (l, layer) in self.weights.layers.iter().enumerate().rev() {
            let s = &saved[l];
            grad_pattern_last[l] = self.block_backward(l, layer, s, n, &mut dx)?;
            if !dx.iter().all(|v| v.is_finite()) {
                return Err(Error::NonFinite {
                    what: "the gradient of the residual stream".into(),
                    layer: Some(l),
                });
            }
            grad_resid_pre[l] = dx.clone();
        }
        Ok(Gradient {
            target,
            logprob,
            value,
            logits,
            input: x0.to_vec(),
            grad_input: dx,
            grad_resid_pre,
            grad_pattern_last,
        })
    }

    /// Integrated gradients of `log p(target)` (`None`: the top next token) for `tokens`, from
    /// the zero input with `steps` midpoints; `progress` is called after each step.
    pub fn integrated_gradients(
        &self,
        tokens: &[u32],
        target: Option<u32>,
        steps: usize,
        progress: &mut dyn FnMut(usize),
    ) -> Result<Integrated> {
        if steps == 0 {
            return Err(Error::OutOfRange {
                what: "steps".into(),
                value: "0".into(),
                range: "1..=4096".into(),
            });
        }
        let (x, _) = self.input_embeddings(tokens)?;
        let full = self.gradient_from(&x, Metric::LogProb(target))?;
        let metric = Metric::LogProb(Some(full.target));
        let dm = self.dims.d_model;
        let mut total = vec![0f64; x.len()];
        for k in 0..steps {
            let a = (k as f32 + 0.5) / steps as f32;
            let xa: Vec<f32> = x.iter().map(|v| v * a).collect();
            let g = self.gradient_from(&xa, metric)?;
            total
                .iter_mut()
                .zip(&g.grad_input)
                .for_each(|(t, g)| *t += *g as f64);
            progress(k + 1);
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
        let gap = (sum - (full.logprob as f64 - zero.logprob as f64)) as f32;
        Ok(Integrated {
            scores,
            gap,
            target: full.target,
            logprob: full.logprob,
        })
    }

    /// Query `i`'s attention probabilities over keys `0..n` in head `h` (kv group `g`) of layer
    /// `l`, from the saved (rotated) q and k.
    #[allow(clippy::too_many_arguments)]
    fn probs(
        &self,
        l: usize,
        q: &[f32],
        k: &[f32],
        h: usize,
        g: usize,
        i: usize,
        n: usize,
    ) -> Vec<f32> {
        let (s, _) = self.scores(l, q, k, h, g, i, n);
        s
    }

    /// Query `i`'s probabilities and the soft-cap's `tanh` of each score (for its derivative).
    #[allow(clippy::too_many_arguments)]
    fn scores(
        &self,
        l: usize,
        q: &[f32],
        k: &[f32],
        h: usize,
        g: usize,
        i: usize,
        n: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let plan = self.weights.layers[l].plan;
        let hd = self.dims.head_dim;
        let scale = plan.score_scale.unwrap_or(1.0 / (hd as f32).sqrt());
        let qi = &q[(h * n + i) * hd..][..hd];
        let mut s = vec![f32::NEG_INFINITY; n];
        let mut th = vec![0f32; n];
        for j in 0..=i {
            if plan.window.is_some_and(|w| j + w <= i) {
                continue;
            }
            let kj = &k[(g * n + j) * hd..][..hd];
            let raw: f32 = qi.iter().zip(kj).map(|(a, b)| a * scale * b).sum();
            s[j] = match plan.softcap {
                Some(c) => {
                    let t = (raw / c).tanh();
                    th[j] = t;
                    t * c
                }
                None => raw,
            };
        }
        let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f64;
        for v in s.iter_mut() {
            *v = if v.is_finite() {
                ((*v - max) as f64).exp() as f32
            } else {
                0.0
            };
            sum += *v as f64;
        }
        s.iter_mut().for_each(|v| *v = (*v as f64 / sum) as f32);
        (s, th)
    }

    /// One block's backward: `dx` (`∂/∂resid_post`, `[n, d_model]`) becomes `∂/∂resid_pre`.
    fn block_backward(
        &self,
        l: usize,
        layer: &Layer,
        s: &Saved,
        n: usize,
        dx: &mut [f32],
    ) -> Result<Vec<f32>> {
        let dims = &self.dims;
        let (nh, nkv, hd, dm, ff) = (
            dims.n_heads,
            dims.n_kv_heads,
            dims.head_dim,
            dims.d_model,
            dims.d_ff,
        );
        let eps = dims.rms_eps;
        let plan = layer.plan;
        let (nq, nk) = (nh * hd, nkv * hd);
        let width = nq + 2 * nk;
        let group = nh / nkv;
        // MLP: resid_post = resid_mid + post(down(act(gate_up(norm(resid_mid)))))
        let d_mlp_proj = match &layer.post_norms {
            Some((_, pm)) => norm_backward(NormKind::Rms, &s.mlp_proj, pm, eps, dx),
            None => dx.to_vec(),
        };
        let d_act = back_matmul(&d_mlp_proj, n, &transposed(&layer.down), ff, dm);
        let gw = if plan.mlp.gated() { 2 * ff } else { ff };
        let mut d_gu = vec![0f32; n * gw];
        for ((row, da), dg) in
            s.gu.chunks(gw)
                .zip(d_act.chunks(ff))
                .zip(d_gu.chunks_mut(gw))
        {
            match plan.mlp {
                MlpKind::GeluTanh => {
                    for i in 0..ff {
                        dg[i] = da[i] * gelu_tanh_grad(row[i]);
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
                    for i in 0..ff {
                        let (g, u) = (row[i], row[ff + i]);
                        let sg = sigmoid(g);
                        dg[i] = da[i] * u * sg * (1.0 + g * (1.0 - sg));
                        dg[ff + i] = da[i] * g * sg;
                    }
                }
            }
        }
        let _ = &s.act;
        let d_h2 = back_matmul(&d_gu, n, &transposed(&layer.gate_up), dm, gw);
        let d_mid = norm_backward(plan.norm, &s.resid_mid, &layer.mlp_norm, eps, &d_h2);
        dx.iter_mut().zip(&d_mid).for_each(|(a, b)| *a += b);
        // attention: resid_mid = resid_pre + post(o(attn(qkv(norm(resid_pre)))))
        let d_attn_proj = match &layer.post_norms {
            Some((pa, _)) => norm_backward(NormKind::Rms, &s.attn_proj, pa, eps, dx),
            None => dx.to_vec(),
        };
        let dz = back_matmul(&d_attn_proj, n, &transposed(&layer.o), nq, dm);
        let mut dq = vec![0f32; nh * n * hd];
        let mut dk = vec![0f32; nkv * n * hd];
        let mut dv = vec![0f32; nkv * n * hd];
        let scale = plan.score_scale.unwrap_or(1.0 / (hd as f32).sqrt());
        let mut dpat = vec![0f32; nh * n];
        for h in 0..nh {
            let g = h / group;
            // the last query row's pattern gradient, every key (masked ones too)
            let dzl = &dz[((n - 1) * nh + h) * hd..][..hd];
            for j in 0..n {
                let vj = &s.v[(g * n + j) * hd..][..hd];
                dpat[h * n + j] = dzl.iter().zip(vj).map(|(a, b)| a * b).sum();
            }
            for i in 0..n {
                let (p, th) = self.scores(l, &s.q, &s.k, h, g, i, n);
                let dzi = &dz[(i * nh + h) * hd..][..hd];
                let mut dp = vec![0f32; n];
                for j in 0..=i {
                    if p[j] == 0.0 {
                        continue;
                    }
                    let vj = &s.v[(g * n + j) * hd..][..hd];
                    dp[j] = dzi.iter().zip(vj).map(|(a, b)| a * b).sum();
                    let dvj = &mut dv[(g * n + j) * hd..][..hd];
                    dvj.iter_mut().zip(dzi).for_each(|(a, b)| *a += p[j] * b);
                }
                let pdp: f64 = (0..=i).map(|j| p[j] as f64 * dp[j] as f64).sum();
                let qi: Vec<f32> = s.q[(h * n + i) * hd..][..hd].to_vec();
                for j in 0..=i {
                    if p[j] == 0.0 {
                        continue;
                    }
                    let mut ds = (p[j] as f64 * (dp[j] as f64 - pdp)) as f32;
                    if plan.softcap.is_some() {
                        ds *= 1.0 - th[j] * th[j];
                    }
                    let ds = ds * scale;
                    let kj = &s.k[(g * n + j) * hd..][..hd];
                    let dqi = &mut dq[(h * n + i) * hd..][..hd];
                    dqi.iter_mut().zip(kj).for_each(|(a, b)| *a += ds * b);
                    let dkj = &mut dk[(g * n + j) * hd..][..hd];
                    dkj.iter_mut().zip(&qi).for_each(|(a, b)| *a += ds * b);
                }
            }
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
        let mut d_qkv = vec![0f32; n * width];
        for (c0, heads, buf, rot) in [
            (0, nh, &dq, true),
            (nq, nkv, &dk, true),
            (nq + nk, nkv, &dv, false),
        ] {
            for h in 0..heads {
                for r in 0..n {
                    let mut v = buf[(h * n + r) * hd..][..hd].to_vec();
                    if let (true, Some((cos, sin))) = (rot, &rope) {
                        rotate(
                            &mut v[..2 * half],
                            &cos[r * half..][..half],
                            &sin[r * half..][..half],
                            self.weights.rope_style,
                        );
                    }
                    d_qkv[r * width + c0 + h * hd..][..hd].copy_from_slice(&v);
                }
            }
        }
        if let Some((qn, kn)) = &layer.qk_norm {
            for (row, drow) in s.qkv.chunks(width).zip(d_qkv.chunks_mut(width)) {
                for (c0, heads, w) in [(0, nh, qn), (nq, nkv, kn)] {
                    for h in 0..heads {
                        let at = c0 + h * hd;
                        let d = norm_backward(
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
        let d_h1 = back_matmul(&d_qkv, n, &transposed(&layer.qkv), dm, width);
        let d_pre = norm_backward(plan.norm, &s.resid_pre, &layer.attn_norm, eps, &d_h1);
        dx.iter_mut().zip(&d_pre).for_each(|(a, b)| *a += b);
        let _ = (&s.h1, &s.h2, &s.z);
        Ok(dpat)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn activation_derivatives() {
        for &x in &[-3.0f32, -0.5, 0.0, 0.7, 2.5] {
            let h = 1e-3f32;
            let fd = (gelu_tanh_of(x + h) - gelu_tanh_of(x - h)) / (2.0 * h);
            assert!((fd - gelu_tanh_grad(x)).abs() < 1e-2, "gelu {x}");
        }
    }
}
