//! One block's backward: the MLP, the attention (per head, [`super::head`]), RoPE and the q/k
//! norms, with the weight-transposed products `dX = dY · W` on the engine's GEMM.

use super::layout::{for_each_head_row, gather, last_rows, scatter, Rope, Shape};
use super::profile::Profile;
use super::rowwise::{gelu_ratio, gelu_tanh_grad, norm_back, norm_hook_grads, sigmoid};
use super::taps::BlockTap;
use super::{Rules, Saved};
use crate::kernels::gemm::{self, PackedB};
use crate::model::block::{MlpKind, NormKind};
use crate::model::error::Result;
use crate::model::ops::gelu_tanh_of;
use crate::model::weights::{Layer, Linear};
use crate::model::Model;
use rayon::prelude::*;
use std::borrow::Cow;

/// One layer's projections packed for `dX = dY · W` ([`crate::model::weights::Linear::transposed`]).
/// `None` where `--memory low` holds the matrix as the file's blocks: the product reads them
/// ([`crate::model::weights::Linear::backward_from_blocks`]).
pub struct LayerT {
    pub(super) qkv: Option<PackedB>,
    pub(super) o: Option<PackedB>,
    pub(super) gate_up: Option<PackedB>,
    pub(super) down: Option<PackedB>,
}

/// `dX[m, k] = dY[m, n] · W` on the engine's GEMM, `w` packed by [`crate::model::weights::Linear::transposed`].
/// The result goes into `dx`, a buffer kept from layer to layer ([`Scratch`]): resized, never
/// zeroed (the product writes every value).
fn back_matmul<'a>(
    dy: &[f32],
    m: usize,
    (lin, w): (&Linear, &Option<PackedB>),
    dx: &'a mut Vec<f32>,
) -> Result<&'a [f32]> {
    dx.resize(m * lin.k, 0.0);
    match w {
        Some(w) => gemm::gemm(dy, w.k, m, w, dx, w.n, false),
        None => {
            if !lin.backward_from_blocks(dy, m, dx) {
                return Err(super::bug(
                    "a projection with no transpose for the backward".into(),
                ));
            }
        }
    }
    Ok(dx)
}

/// One layer's backward: the layer `l` (its weights, transposes and what its forward saved)
/// of `batch` sequences of `n` tokens, `shape` `(n, batch)`, by `rules`.
#[derive(Clone, Copy)]
pub(super) struct BlockStep<'a> {
    pub(super) l: usize,
    pub(super) layer: &'a Layer,
    pub(super) t: &'a LayerT,
    pub(super) s: &'a Saved,
    pub(super) shape: (usize, usize),
    pub(super) rules: Rules,
}

/// The backward's largest buffers, kept from one layer's backward to the next (of one length
/// and batch: their sizes do not change), so that each is zeroed once per backward, not once
/// per layer (`memset` took 4% of a backward at 512 tokens).
#[derive(Default)]
pub(super) struct Scratch {
    d_act: Vec<f32>,
    d_gu: Vec<f32>,
    d_h2: Vec<f32>,
    dz: Vec<f32>,
    d_qkv: Vec<f32>,
    d_h1: Vec<f32>,
    /// `∂/∂` the MLP's input (its norm's), the MLP branch's share of `∂/∂resid_mid`
    d_mid: Vec<f32>,
    /// the per-step timer (`ATTNSCOPE_PROFILE_BACKWARD=1`)
    pub(super) prof: super::profile::Profile,
}

impl Model {
    /// One block's backward for `batch` sequences of `n` tokens (`step`): `dx` (`∂/∂resid_post`,
    /// `[batch·n, d_model]`) becomes `∂/∂resid_pre`; `tap` (if any, one sequence) keeps the
    /// gradients inside the block. Returns the last query row's pattern gradients,
    /// `[batch, n_heads, n]`.
    pub(super) fn block_backward(
        &self,
        step: BlockStep<'_>,
        dx: &mut [f32],
        mut tap: Option<&mut BlockTap>,
        scratch: &mut Scratch,
    ) -> Result<Vec<f32>> {
        let BlockStep {
            l,
            layer,
            t,
            s,
            shape: (n, batch),
            rules,
        } = step;
        let rows = batch * n;
        scratch.prof.lap("bwd residual copies");
        let kept = if s.last_only() {
            last_rows(n, batch)
        } else {
            Vec::new()
        };
        self.mlp_backward_kept(&step, &kept, dx, scratch)?;
        if let Some(t) = tap.as_deref_mut() {
            t.resid_mid = dx.to_vec();
            if t.branches {
                t.mlp_in = scratch.d_mid.clone();
            }
            if t.inner {
                let eps = self.dims.rms_eps;
                let norm = layer.plan.norm;
                t.ln2 = norm_hook_grads(norm, &s.resid_mid, &layer.mlp_norm, eps, &scratch.d_h2);
                t.mlp = (scratch.d_act.clone(), scratch.d_gu.clone());
            }
        }
        // attention: resid_mid = resid_pre + post(o(attn(qkv(norm(resid_pre)))))
        let dz = self.o_backward(&step, &kept, dx, &mut scratch.dz, &mut scratch.prof)?;
        if let Some(t) = tap.as_deref_mut() {
            t.z = dz.to_vec();
        }
        let (dq, dk, dv, dpat) =
            self.heads_backward(l, s, &dz, (n, batch), rules, &mut scratch.prof);
        if let Some(t) = tap.as_deref_mut() {
            t.rot = Some((dq.clone(), dk.clone(), dv.clone()));
        }
        self.qkv_backward(&step, (dq, dk, dv), &mut scratch.d_qkv, tap.as_deref_mut());
        if let Some(t) = tap.as_deref_mut().filter(|t| t.branches) {
            t.qkv_proj = scratch.d_qkv.clone();
        }
        scratch.prof.lap("bwd gather, RoPE, q/k norms");
        let d_h1 = back_matmul(
            &scratch.d_qkv,
            rows,
            (&layer.qkv, &t.qkv),
            &mut scratch.d_h1,
        )?;
        scratch.prof.lap("bwd q|k|v");
        let eps = self.dims.rms_eps;
        if let Some(t) = tap.filter(|t| t.inner) {
            t.ln1 = norm_hook_grads(layer.plan.norm, &s.resid_pre, &layer.attn_norm, eps, d_h1);
        }
        let d_pre = norm_back(
            rules,
            layer.plan.norm,
            &s.resid_pre,
            &layer.attn_norm,
            eps,
            d_h1,
        );
        dx.iter_mut().zip(&d_pre).for_each(|(a, b)| *a += b);
        scratch.prof.lap("bwd norms");
        Ok(dpat)
    }

    /// The MLP's backward on the rows it ran on: every row, or (the last layer with no tap)
    /// only the `kept` ones, gathered from `dx` and written back.
    fn mlp_backward_kept(
        &self,
        step: &BlockStep<'_>,
        kept: &[usize],
        dx: &mut [f32],
        scratch: &mut Scratch,
    ) -> Result<()> {
        let (n, batch) = step.shape;
        let dm = self.dims.d_model;
        if step.s.last_only() {
            let mut dxc = gather(dx, dm, kept);
            self.mlp_backward(step, batch, &mut dxc, scratch)?;
            scatter(&dxc, dm, kept, dx);
            Ok(())
        } else {
            self.mlp_backward(step, batch * n, dx, scratch)
        }
    }

    /// The o projection's backward (through Gemma's post-attention norm) from `dx`
    /// (`∂/∂resid_mid`): `∂/∂z`, `[batch·n, nh·hd]`, in `dz_buf` (zero, in the last layer with
    /// no tap, but at the `kept` rows: no gradient reaches the other rows' attention output).
    fn o_backward<'a>(
        &self,
        step: &BlockStep<'_>,
        kept: &[usize],
        dx: &[f32],
        dz_buf: &'a mut Vec<f32>,
        prof: &mut Profile,
    ) -> Result<Cow<'a, [f32]>> {
        let BlockStep {
            layer, t, s, rules, ..
        } = *step;
        let dims = &self.dims;
        let (n, batch) = step.shape;
        let dy = if s.last_only() {
            gather(dx, dims.d_model, kept)
        } else {
            dx.to_vec()
        };
        let d_attn_proj = match &layer.post_norms {
            Some((pa, _)) => norm_back(rules, NormKind::Rms, &s.attn_proj, pa, dims.rms_eps, &dy),
            None => dy,
        };
        prof.lap("bwd norms");
        let m = d_attn_proj.len() / dims.d_model;
        let dz = back_matmul(&d_attn_proj, m, (&layer.o, &t.o), dz_buf)?;
        let dz = if s.last_only() {
            let mut all = vec![0f32; batch * n * dims.n_heads * dims.head_dim];
            scatter(dz, dims.n_heads * dims.head_dim, kept, &mut all);
            Cow::Owned(all)
        } else {
            Cow::Borrowed(dz)
        };
        prof.lap("bwd o");
        Ok(dz)
    }

    /// `(dq, dk, dv)` (as attention reads q, k, v) back into the q|k|v rows `d_qkv`
    /// (`[batch·n, width]`, every value written): AttnLRP's uniform rule on the bilinear
    /// products, RoPE by the opposite angles, and (after `tap` keeps them) the q/k norms.
    fn qkv_backward(
        &self,
        step: &BlockStep<'_>,
        (mut dq, mut dk, mut dv): (Vec<f32>, Vec<f32>, Vec<f32>),
        d_qkv: &mut Vec<f32>,
        tap: Option<&mut BlockTap>,
    ) {
        let dims = &self.dims;
        let (nh, nkv, eps) = (dims.n_heads, dims.n_kv_heads, dims.rms_eps);
        let shape = Shape::of(self, step.shape);
        let Shape {
            hd, nq, nk, width, ..
        } = shape;
        if step.rules == Rules::AttnLrp {
            // the uniform rule on Q·Kᵀ and on P·V: the scores' share halves at q and k, and
            // the probabilities' half of P·V halves again there; v keeps half of P·V
            dq.iter_mut().chain(dk.iter_mut()).for_each(|v| *v *= 0.25);
            dv.iter_mut().for_each(|v| *v *= 0.5);
        }
        // back through RoPE (rotate by the opposite angles), the q/k norms, into [n, width]
        let rope = Rope::of(self, step.layer, shape.n).map(Rope::inverse);
        // every value is written below (q, k and v of each row)
        d_qkv.resize(shape.rows * width, 0.0);
        for (c0, heads, buf, rope) in [
            (0, nh, &dq, rope.as_ref()),
            (nq, nkv, &dk, rope.as_ref()),
            (nq + nk, nkv, &dv, None),
        ] {
            for_each_head_row(shape, c0, heads, |at, head_at, pos| {
                let v = &mut d_qkv[at..][..hd];
                v.copy_from_slice(&buf[head_at..][..hd]);
                if let Some(rope) = rope {
                    rope.rotate(v, pos);
                }
            });
        }
        if let Some(t) = tap {
            t.qkv = d_qkv.to_vec();
        }
        if let Some((qn, kn)) = &step.layer.qk_norm {
            for (row, drow) in step.s.qkv.chunks(width).zip(d_qkv.chunks_mut(width)) {
                for (c0, heads, w) in [(0, nh, qn), (nq, nkv, kn)] {
                    for h in 0..heads {
                        let at = c0 + h * hd;
                        let d = norm_back(
                            step.rules,
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
    }

    /// The MLP's backward on `m` rows: `dx` (`∂/∂resid_post`, `[m, d_model]`) becomes
    /// `∂/∂resid_mid`, the MLP's rows of `s` being those `m`.
    fn mlp_backward(
        &self,
        step: &BlockStep<'_>,
        rows: usize,
        dx: &mut [f32],
        scratch: &mut Scratch,
    ) -> Result<()> {
        let BlockStep {
            layer, t, s, rules, ..
        } = *step;
        let lrp = rules == Rules::AttnLrp;
        let (ff, eps, plan) = (self.dims.d_ff, self.dims.rms_eps, layer.plan);
        // MLP: resid_post = resid_mid + post(down(act(gate_up(norm(resid_mid)))))
        let d_mlp_proj = match &layer.post_norms {
            Some((_, pm)) => norm_back(rules, NormKind::Rms, &s.mlp_proj, pm, eps, dx),
            None => dx.to_vec(),
        };
        scratch.prof.lap("bwd norms");
        let d_act = back_matmul(
            &d_mlp_proj,
            rows,
            (&layer.down, &t.down),
            &mut scratch.d_act,
        )?;
        scratch.prof.lap("bwd down");
        let gw = if plan.mlp.gated() { 2 * ff } else { ff };
        // every value is written below (both halves of a gated row)
        let d_gu = &mut scratch.d_gu;
        d_gu.resize(rows * gw, 0.0);
        activation_backward(plan.mlp, lrp, &s.gu, d_act, d_gu, ff);
        scratch.prof.lap("bwd activation");
        let d_h2 = back_matmul(d_gu, rows, (&layer.gate_up, &t.gate_up), &mut scratch.d_h2)?;
        scratch.prof.lap("bwd gate|up");
        scratch.d_mid = norm_back(rules, plan.norm, &s.resid_mid, &layer.mlp_norm, eps, d_h2);
        dx.iter_mut().zip(&scratch.d_mid).for_each(|(a, b)| *a += b);
        Ok(())
    }

    /// The attention's backward, every head of every sequence in parallel, from `dz`
    /// (`∂/∂z`, `[batch·n, nh·hd]`): `(dq, dk, dv)` as [`Model::heads_batch`] lays q, k, v out
    /// (a kv head's sums over its query heads), and the last query row's pattern gradients
    /// `[batch, nh, n]`.
    fn heads_backward(
        &self,
        l: usize,
        s: &Saved,
        dz: &[f32],
        (n, batch): (usize, usize),
        rules: Rules,
        prof: &mut super::profile::Profile,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let (nh, nkv, hd) = (self.dims.n_heads, self.dims.n_kv_heads, self.dims.head_dim);
        let (group, rows) = (nh / nkv, batch * n);
        let (heads, packed) = self.heads_batch(l, &s.q, &s.k, &s.v, n, batch, rules);
        prof.lap("bwd attention packing");
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
        prof.lap("bwd attention heads");
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
        (dq, dk, dv, dpat)
    }
}

/// The backward of the MLP's activation (the identity and uniform rules for AttnLRP): from
/// `d_act` (`[rows, ff]`) and the saved gate|up rows `gu`, `d_gu` (`[rows, gw]`, every value
/// written).
fn activation_backward(
    kind: MlpKind,
    lrp: bool,
    gu: &[f32],
    d_act: &[f32],
    d_gu: &mut [f32],
    ff: usize,
) {
    let gw = if kind.gated() { 2 * ff } else { ff };
    let gu_rows = gu
        .par_chunks(gw)
        .zip(d_act.par_chunks(ff))
        .zip(d_gu.par_chunks_mut(gw));
    gu_rows.for_each(|((row, da), dg)| match kind {
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
                let cdf =
                    0.5 * (1.0 + crate::model::ops::erf64(x * std::f64::consts::FRAC_1_SQRT_2));
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
            crate::model::ops::swiglu_backward_row(&row[..ff], &row[ff..], da, dgate, dup);
        }
    });
}
