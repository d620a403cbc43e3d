//! What a circuit (issue #58) needs of the forward and the backward: the graph's upstream nodes'
//! outputs as a run computes them, and the metric's gradient at each downstream input, as if every
//! reader of the residual stream had its own copy of it.
//!
//! Upstream nodes: `input` (the input to layer 0), each head (its `z` through its columns of
//! `W_O`: TransformerLens's `hook_result`, times a post-norm's scale of the run where the model has
//! one) and each MLP (`hook_mlp_out`). Readers (downstream inputs): each query head's q, each
//! key/value head's k and v (a GQA group shares them), each MLP, and the logits. The gradient at a
//! reader is the gradient at its slice of the projection's output carried back through that slice
//! of the projection and through the layer's input norm at the run's own scale (Hanna et al.'s
//! EAP-IG graph; `circuits_ref.py` computes the same with torch): the q/k/v readers' gradients
//! add up to the attention branch's, the MLP reader's is the MLP branch's.

use super::layout::Shape;
use super::readers::{BranchSink, ReaderGrads};
use super::rowwise::norm_back;
use super::taps::{BlockTap, Tap};
use super::{Metric, Rules, Saved};
use crate::kernels::gemm;
use crate::kernels::simd::multiversion;
use crate::model::block::NormKind;
use crate::model::error::Result;
use crate::model::Model;
use rayon::prelude::*;

impl Model {
    /// One forward of the input `x0` (`[n, d_model]`, as [`Model::input_embeddings`] gives it)
    /// handing `sink` the upstream nodes' outputs (if it wants them), and with `backward` the
    /// backward of `metric` handing it the gradients at every reader. The run's metric, target
    /// and logits come back as a [`super::Gradient`] (its input gradients too).
    pub fn branch_run(
        &self,
        x0: &[f32],
        metric: Metric,
        backward: bool,
        sink: &mut dyn BranchSink,
    ) -> Result<super::Gradient> {
        let nl = self.dims.n_layers;
        let mut tap = Tap {
            grads_at: vec![backward; nl],
            maps_at: vec![false; nl],
            branches: Some(sink),
            ..Tap::default()
        };
        self.run_tapped(x0, metric, backward, Rules::Gradient, Some(&mut tap))
    }

    /// Layer `l`'s heads' outputs from its attention output `z` (`[rows, n_heads·head_dim]`):
    /// head h's columns of `z` times its columns of `W_O` (no bias), and where the layer has a
    /// post-attention norm, times that norm's weights and its scale at each row of the run
    /// (`attn_proj`, the o projection's rows, gives the scale), so the heads add up to what the
    /// block adds to the residual stream (less the projection's bias). `[n_heads][rows, d]`.
    pub(crate) fn head_outputs(&self, l: usize, z: &[f32], attn_proj: &[f32]) -> Vec<f32> {
        let (nh, hd, dm) = (self.dims.n_heads, self.dims.head_dim, self.dims.d_model);
        let layer = &self.weights.layers[l];
        let rows = z.len() / (nh * hd);
        let mut out = vec![0f32; nh * rows * dm];
        out.par_chunks_mut(rows * dm)
            .enumerate()
            .for_each(|(h, dst)| {
                let zh: Vec<f32> = z
                    .chunks(nh * hd)
                    .flat_map(|r| r[h * hd..(h + 1) * hd].iter().copied())
                    .collect();
                let cols = h * hd..(h + 1) * hd;
                let part = layer
                    .o
                    .forward_unbiased_cols(&zh, rows, cols.clone())
                    .unwrap_or_else(|| {
                        // a packing without column slices: zeros outside the head's columns
                        let mut wide = vec![0f32; rows * nh * hd];
                        for (w, zr) in wide.chunks_mut(nh * hd).zip(zh.chunks(hd)) {
                            w[cols.clone()].copy_from_slice(zr);
                        }
                        layer.o.forward_unbiased(&wide, rows)
                    });
                dst.copy_from_slice(&part);
            });
        if let Some((pa, _)) = &layer.post_norms {
            let scales = post_norm_scales(attn_proj, dm, self.dims.rms_eps);
            out.par_chunks_mut(dm).enumerate().for_each(|(i, row)| {
                let s = scales[i % rows];
                row.iter_mut().zip(pa).for_each(|(v, &w)| *v = *v * s * w);
            });
        }
        out
    }

    /// The gradients at layer `l`'s readers from what its backward kept (`bt`: `∂/∂` q|k|v at
    /// the projection's output and `∂/∂` the MLP's input) and its forward saved (`s`).
    pub(super) fn reader_gradients(
        &self,
        l: usize,
        s: &Saved,
        (n, from): (usize, usize),
        bt: &BlockTap,
    ) -> Result<ReaderGrads> {
        let (nh, nkv, dm) = (self.dims.n_heads, self.dims.n_kv_heads, self.dims.d_model);
        let rows = n - from;
        let shape = Shape::of(self, (rows, 1));
        let Shape {
            hd, nq, nk, width, ..
        } = shape;
        let layer = &self.weights.layers[l];
        let d_qkv = &bt.qkv_proj[from * width..];
        let per = |c0: usize, heads: usize| -> Result<Vec<f32>> {
            let mut out = vec![0f32; heads * rows * dm];
            for (h, dst) in out.chunks_mut(rows * dm).enumerate() {
                let cols = c0 + h * hd..c0 + (h + 1) * hd;
                self.qkv_slice_back(l, d_qkv, shape, cols, dst)?;
            }
            // through the layer's input norm, at the run's own scale
            let (x, w, eps) = (
                &s.resid_pre[from * dm..],
                &layer.attn_norm,
                self.dims.rms_eps,
            );
            match layer.plan.norm {
                NormKind::Rms => rms_backward_many(x, w, eps, &mut out),
                kind => {
                    for dy in out.chunks_mut(n * dm) {
                        let g = norm_back(Rules::Gradient, kind, x, w, eps, dy);
                        dy.copy_from_slice(&g);
                    }
                }
            }
            Ok(out)
        };
        Ok(ReaderGrads {
            q: per(0, nh)?,
            k: per(nq, nkv)?,
            v: per(nq + nk, nkv)?,
            mlp: bt.mlp_in[from * dm..].to_vec(),
        })
    }

    /// `∂/∂h1` (the attention norm's output) from the columns `cols` of `d_qkv` (`∂/∂` q|k|v at
    /// the projection's output, `[n, width]`) alone: `d_qkv[:, cols] · W[cols, :]`, `[n, d]`.
    fn qkv_slice_back(
        &self,
        l: usize,
        d_qkv: &[f32],
        shape: Shape,
        cols: std::ops::Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        let (rows, width, dm) = (shape.rows, shape.width, self.dims.d_model);
        match &self.transposes()[l].qkv {
            Some(w) => {
                let a = &d_qkv[cols.start..];
                gemm::gemm_sub(a, width, rows, w, cols, 0..dm, out, dm, false, true);
            }
            None => {
                // `--memory low`: the product from the file's blocks, zeros outside the slice
                let mut dy = vec![0f32; rows * width];
                for (d, s) in dy.chunks_mut(width).zip(d_qkv.chunks(width)) {
                    d[cols.clone()].copy_from_slice(&s[cols.clone()]);
                }
                if !self.weights.layers[l]
                    .qkv
                    .backward_from_blocks(&dy, rows, out)
                {
                    return Err(super::bug(
                        "a projection with no transpose for the backward".into(),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The RMSNorm backward of each `[n, d]` block of `dys` (in place) at the rows `x`, with
/// weights `w`: [`super::norm_backward`]'s arithmetic (f64 per row; its sum in 8 lanes, so
/// the last bits may differ), the rows' scales computed once for every block.
fn rms_backward_many(x: &[f32], w: &[f32], eps: f32, dys: &mut [f32]) {
    let d = w.len();
    let inv: Vec<f64> = x
        .chunks(d)
        .map(|r| {
            let ms = r.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / d as f64;
            1.0 / ((ms as f32 + eps) as f64).sqrt()
        })
        .collect();
    let rows = x.len() / d;
    dys.par_chunks_mut(d).enumerate().for_each(|(i, dy)| {
        rms_back_row(dy, w, &x[(i % rows) * d..][..d], inv[i % rows]);
    });
}

multiversion! {
    /// One row of [`rms_backward_many`]: `dy` (in place) through RMSNorm at the row `x` whose
    /// scale is `inv`, in f64; `Σ dy·w·x` summed in 8 lanes (then added in order), so it
    /// vectorizes.
    fn rms_back_row(dy: &mut [f32], w: &[f32], x: &[f32], inv: f64) {
        let d = w.len();
        let mut lanes = [0f64; 8];
        let whole = d / 8 * 8;
        for ((g, w), x) in dy[..whole]
            .chunks_exact(8)
            .zip(w.chunks_exact(8))
            .zip(x.chunks_exact(8))
        {
            for j in 0..8 {
                lanes[j] += g[j] as f64 * w[j] as f64 * x[j] as f64;
            }
        }
        let mut gx: f64 = lanes.iter().sum();
        for j in whole..d {
            gx += dy[j] as f64 * w[j] as f64 * x[j] as f64;
        }
        let c = inv * inv * inv * (gx / d as f64);
        for ((o, &w), &x) in dy.iter_mut().zip(w).zip(x) {
            *o = (inv * (*o as f64 * w as f64) - c * x as f64) as f32;
        }
    }
}

/// Each row's RMSNorm scale `1/√(mean(x²) + ε)` of `x` (`[rows, width]`), as the forward's
/// post-norm computes it.
pub(crate) fn post_norm_scales(x: &[f32], width: usize, eps: f32) -> Vec<f32> {
    x.chunks(width)
        .map(|r| {
            let ms = r.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / width as f64;
            1.0 / ((ms as f32) + eps).sqrt()
        })
        .collect()
}
