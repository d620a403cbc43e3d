//! The forward that keeps what the backward needs, and the backward through every block, of
//! several sequences of one length at once (one sequence is a batch of one).

use super::block::Scratch;
use super::layout::{for_each_head_row, gather, last_rows, scatter, Rope, Shape};
use super::profile::Profile;
use super::rowwise::{norm_back, norm_fwd};
use super::taps::{BlockTap, Tap};
use super::{bug, Batch, Gradient, Metric, Rules, Saved, Seed};
use crate::model::block::{MlpKind, NormKind};
use crate::model::error::{Error, Result};
use crate::model::ops::{gelu_tanh_of, rms_norm, rms_norm_in_place};
use crate::model::weights::Layer;
use crate::model::Model;
use rayon::prelude::*;

/// The final norm's input rows the metric reads: each sequence's last row, `[batch, d_model]`,
/// and the norm's kind.
pub(super) struct LastRows {
    kind: NormKind,
    rows: Vec<f32>,
}

/// What the backward through every block gives besides the seeds: `∂/∂input` of the stacked
/// rows, and (for a batch of one) every layer's `∂/∂resid_pre` and last query row's pattern
/// gradients.
struct BlockGradients {
    grad_input: Vec<f32>,
    grad_resid_pre: Vec<Vec<f32>>,
    grad_pattern: Vec<Vec<f32>>,
}

/// A layer's q|k|v projection `[rows, width]` and its q `[nh, rows, hd]`, k and v
/// `[nkv, rows, hd]` as attention reads them.
type AttentionInputs = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

impl Model {
    /// The forward (and with `backward`, the backward) of `x.batch` sequences of equal length
    /// at once, one [`Gradient`] each (their `grad_resid_pre` and `grad_pattern_last` only
    /// for a batch of one): the row-wise work (norms, projections, activations) runs on the
    /// stacked `batch·n` rows, the attention per sequence and head. Each sequence gets the
    /// numbers its own run gives (the products of a row do not depend on the other rows). The
    /// batched forward and backward integrated gradients run their steps on; `tap` needs a batch
    /// of one.
    pub(super) fn run_batch(
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
        let n = self.sequence_length(x, tap.is_some())?;
        let Batch { x0, batch } = x;
        // ---- forward, saving what the backward needs
        let mut scratch = Scratch::default();
        scratch.prof.lap("(setup)");
        let (x, saved) =
            self.save_forward(x0, (n, batch), tap.as_deref_mut(), &mut scratch.prof)?;
        let (last, mut seeds) =
            self.seeds_at_last_rows(&x, (n, batch), metric, rules, &mut scratch.prof)?;
        if !backward {
            return Ok(gradients(seeds, x0, (n, batch), self.dims.n_heads, None));
        }
        let mut dx = self.final_backward(&seeds, &last, (n, batch), rules)?;
        scratch.prof.lap("bwd unembedding");
        if let Some(loss) = tap.as_deref().and_then(|t| t.loss.as_deref()) {
            (seeds[0].value, dx) = self.loss_seed(&x, loss, last.kind)?;
        }
        if let Some(d) = tap.as_deref().and_then(|t| t.dlogits.as_deref()) {
            // the scalar is the caller's, its value not known here (0)
            (seeds[0].value, dx) = (0.0, self.dlogits_seed(&x, d, last.kind)?);
        }
        if let Some(t) = tap.as_deref_mut() {
            t.final_gradient(self, &dx)?;
        }
        let back = self.blocks_backward(&saved, (n, batch), dx, rules, tap, &mut scratch)?;
        scratch.prof.lap("bwd residual copies");
        scratch.prof.report(n * batch);
        Ok(gradients(
            seeds,
            x0,
            (n, batch),
            self.dims.n_heads,
            Some(back),
        ))
    }

    /// The length `n` of each of `x.batch` stacked sequences, checked: a whole number of rows
    /// per sequence, within the context, and a tap only on a batch of one.
    fn sequence_length(&self, x: Batch<'_>, tapped: bool) -> Result<usize> {
        let Batch { x0, batch } = x;
        let dims = &self.dims;
        let dm = dims.d_model;
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
        if batch > 1 && tapped {
            return Err(bug(
                "hook gradients are kept for one sequence at a time".into()
            ));
        }
        let n = x0.len() / dm / batch;
        if n > dims.context_len {
            return Err(Error::TooLong {
                n_tokens: n,
                limit: dims.context_len,
                model: self.info.name.clone(),
            });
        }
        Ok(n)
    }

    /// Each sequence's last row of the residual stream `x` through the final norm and the
    /// head: those rows (what the final norm's backward reads) and each sequence's [`Seed`].
    pub(super) fn seeds_at_last_rows(
        &self,
        x: &[f32],
        (n, batch): (usize, usize),
        metric: Metric,
        rules: Rules,
        prof: &mut Profile,
    ) -> Result<(LastRows, Vec<Seed>)> {
        let dims = &self.dims;
        let dm = dims.d_model;
        let fb = self.weights.final_norm_bias.as_deref();
        let kind = if fb.is_some() {
            NormKind::Layer
        } else {
            NormKind::Rms
        };
        let rows: Vec<f32> = (0..batch)
            .flat_map(|b| x[(b * n + n - 1) * dm..][..dm].iter().copied())
            .collect();
        let hf = norm_fwd(kind, &rows, &self.weights.final_norm, fb, dims.rms_eps);
        let raws = crate::model::ops::logits_rows(&self.weights.lm_head, hf, batch, dm)?;
        if raws.len() != batch {
            return Err(bug("a logits row per sequence".into()));
        }
        let cap = dims.gemma.as_ref().and_then(|g| g.final_softcap);
        prof.lap("fwd final norm, logits");
        let mut seeds = Vec::with_capacity(batch);
        for raw in raws {
            seeds.push(self.seed(raw, cap, metric, rules == Rules::AttnLrp)?);
        }
        prof.lap("seed");
        Ok((LastRows { kind, rows }, seeds))
    }

    /// The seeds back through the final soft-cap, the head and the final norm: `∂/∂` the last
    /// residual stream, `[batch·n, d_model]` (zero but at each sequence's last row).
    fn final_backward(
        &self,
        seeds: &[Seed],
        last: &LastRows,
        (n, batch): (usize, usize),
        rules: Rules,
    ) -> Result<Vec<f32>> {
        let dm = self.dims.d_model;
        let dh = self.unembed_back(seeds)?;
        let mut dx = vec![0f32; n * batch * dm];
        for b in 0..batch {
            dx[(b * n + n - 1) * dm..][..dm].copy_from_slice(&norm_back(
                rules,
                last.kind,
                &last.rows[b * dm..(b + 1) * dm],
                &self.weights.final_norm,
                self.dims.rms_eps,
                &dh[b * dm..(b + 1) * dm],
            ));
        }
        Ok(dx)
    }

    /// `dx` (`∂/∂` the last residual stream) back through the blocks, last to first, each
    /// checked finite and handed to `tap`'s layers.
    fn blocks_backward(
        &self,
        saved: &[Saved],
        (n, batch): (usize, usize),
        mut dx: Vec<f32>,
        rules: Rules,
        mut tap: Option<&mut Tap>,
        scratch: &mut Scratch,
    ) -> Result<BlockGradients> {
        let transposes = self.transposes();
        scratch.prof.lap("bwd final norm, transposes");
        let n_layers = self.dims.n_layers;
        let mut grad_resid_pre = vec![Vec::new(); n_layers];
        let mut grad_pattern = vec![Vec::new(); n_layers];
        for (l, layer) in self.weights.layers.iter().enumerate().rev() {
            let s = &saved[l];
            let mut bt = tap.as_deref().filter(|t| t.wants(l)).map(|t| BlockTap {
                resid_post: dx.clone(),
                branches: t.wants_branches(),
                inner: t.wants_inner(l),
                ..BlockTap::default()
            });
            let step = super::block::BlockStep {
                l,
                layer,
                t: &transposes[l],
                s,
                shape: (n, batch),
                rules,
            };
            grad_pattern[l] = self.block_backward(step, &mut dx, bt.as_mut(), scratch)?;
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
                t.backward_layer(self, l, s, n, bt, &dx)?;
            }
        }
        Ok(BlockGradients {
            grad_input: dx,
            grad_resid_pre,
            grad_pattern,
        })
    }

    /// The forward of `batch` stacked sequences of `n` rows from `x0`, keeping each layer's
    /// [`Saved`] (and handing `tap` the activations it keeps): the last residual stream (in the
    /// last layer, with no tap, only each sequence's last row is brought up to date) and what
    /// was saved.
    fn save_forward(
        &self,
        x0: &[f32],
        (n, batch): (usize, usize),
        mut tap: Option<&mut Tap>,
        prof: &mut Profile,
    ) -> Result<(Vec<f32>, Vec<Saved>)> {
        let dims = &self.dims;
        let dm = dims.d_model;
        let shape = Shape::of(self, (n, batch));
        let mut x = x0.to_vec();
        if let Some(t) = tap.as_deref_mut() {
            t.forward_input(self, x0)?;
        }
        let mut saved: Vec<Saved> = Vec::with_capacity(dims.n_layers);
        for (l, layer) in self.weights.layers.iter().enumerate() {
            let resid_pre = x.clone();
            let (qkv, q, k, v) = self.attention_inputs(layer, &x, shape, prof)?;
            let z = self.attention_forward(l, &q, &k, &v, n, batch);
            prof.lap("fwd attention");
            // the last layer: only each sequence's last row reaches the metric (but a tap's
            // hooks and the loss want every row): the o projection and the MLP run on those
            let last_only = l + 1 == dims.n_layers && tap.is_none();
            let (kept, m) = if last_only {
                (last_rows(n, batch), batch)
            } else {
                (Vec::new(), shape.rows)
            };
            let z = if last_only {
                gather(&z, shape.nq, &kept)
            } else {
                z
            };
            let mut x_all = std::mem::take(&mut x);
            let mut xs = if last_only {
                gather(&x_all, dm, &kept)
            } else {
                std::mem::take(&mut x_all)
            };
            let (attn_proj, attn_out) = self.o_forward(layer, &z, m, prof)?;
            if let Some(t) = tap.as_deref_mut() {
                t.forward_attn(&resid_pre, &z, &attn_out);
            }
            xs.iter_mut().zip(&attn_out).for_each(|(a, b)| *a += b);
            let resid_mid = xs.clone();
            let (gu, mlp_proj, mlp_out) = self.mlp_forward(layer, &xs, m, prof)?;
            if let Some(t) = tap.as_deref_mut() {
                t.forward_mlp(&mlp_out);
                t.forward_nodes(self, l, (&z, &attn_proj), &mlp_out)?;
            }
            xs.iter_mut().zip(&mlp_out).for_each(|(a, b)| *a += b);
            if !xs.iter().all(|v| v.is_finite()) {
                return Err(Error::NonFinite {
                    what: "the residual stream after the layer's MLP".into(),
                    layer: Some(l),
                });
            }
            x = if last_only {
                scatter(&xs, dm, &kept, &mut x_all);
                x_all
            } else {
                xs
            };
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
            prof.lap("fwd norms");
        }
        Ok((x, saved))
    }

    /// The attention's inputs from the residual stream `x`: the norm, the q|k|v projection
    /// (`[rows, width]`, saved), then the q/k norms and RoPE on q and k, split into q
    /// `[nh, rows, hd]`, k and v `[nkv, rows, hd]` as attention reads them.
    fn attention_inputs(
        &self,
        layer: &Layer,
        x: &[f32],
        shape: Shape,
        prof: &mut Profile,
    ) -> Result<AttentionInputs> {
        let b1 = layer.norm_biases.as_ref().map(|b| b.0.as_slice());
        let h1 = norm_fwd(layer.plan.norm, x, &layer.attn_norm, b1, self.dims.rms_eps);
        prof.lap("fwd norms");
        let qkv = layer.qkv.forward(&h1, shape.rows)?;
        prof.lap("fwd q|k|v");
        let (q, k, v) = self.split_qkv(layer, &qkv, shape);
        prof.lap("fwd q/k norms, RoPE, split");
        Ok((qkv, q, k, v))
    }

    /// The q|k|v projection's rows `qkv` (`[rows, width]`) as attention reads them: the q/k
    /// norms and RoPE on q and k, split into q `[nh, rows, hd]`, k and v `[nkv, rows, hd]`.
    pub(super) fn split_qkv(
        &self,
        layer: &Layer,
        qkv: &[f32],
        shape: Shape,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let dims = &self.dims;
        let (nh, nkv, eps) = (dims.n_heads, dims.n_kv_heads, dims.rms_eps);
        let Shape {
            hd, nq, nk, width, ..
        } = shape;
        let mut normed = qkv.to_vec();
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
        let rope = Rope::of(self, layer, shape.n);
        let split = |c0: usize, heads: usize, rope: Option<&Rope>| -> Vec<f32> {
            let mut out = vec![0f32; heads * shape.rows * hd];
            for_each_head_row(shape, c0, heads, |at, head_at, pos| {
                let v = &mut out[head_at..][..hd];
                v.copy_from_slice(&normed[at..][..hd]);
                if let Some(rope) = rope {
                    rope.rotate(v, pos);
                }
            });
            out
        };
        let q = split(0, nh, rope.as_ref());
        let k = split(nq, nkv, rope.as_ref());
        let v = split(nq + nk, nkv, None);
        (q, k, v)
    }

    /// The o projection of the attention's output `z` on `m` rows: its product (saved) and,
    /// after Gemma's post-attention norm, what the residual stream gains.
    pub(super) fn o_forward(
        &self,
        layer: &Layer,
        z: &[f32],
        m: usize,
        prof: &mut Profile,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let attn_proj = layer.o.forward(z, m)?;
        prof.lap("fwd o");
        let post = layer.post_norms.as_ref().map(|(pa, _)| pa.as_slice());
        let attn_out = post_norm(&attn_proj, post, self.dims.rms_eps);
        Ok((attn_proj, attn_out))
    }

    /// The MLP on `m` rows of the residual stream `xs`: the gate|up product and the down
    /// product (both saved) and, after Gemma's post-MLP norm, what the residual stream gains.
    pub(super) fn mlp_forward(
        &self,
        layer: &Layer,
        xs: &[f32],
        m: usize,
        prof: &mut Profile,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let (ff, eps, plan) = (self.dims.d_ff, self.dims.rms_eps, layer.plan);
        let b2 = layer.norm_biases.as_ref().map(|b| b.1.as_slice());
        let h2 = norm_fwd(plan.norm, xs, &layer.mlp_norm, b2, eps);
        prof.lap("fwd norms");
        let gu = layer.gate_up.forward(&h2, m)?;
        prof.lap("fwd gate|up");
        let gw = if plan.mlp.gated() { 2 * ff } else { ff };
        let act = activation(plan.mlp, &gu, gw, ff);
        prof.lap("fwd activation");
        let mlp_proj = layer.down.forward(&act, m)?;
        prof.lap("fwd down");
        let post = layer.post_norms.as_ref().map(|(_, pm)| pm.as_slice());
        let mlp_out = post_norm(&mlp_proj, post, eps);
        Ok((gu, mlp_proj, mlp_out))
    }
}

/// Gemma's norm after a sublayer (`w`), else the sublayer's output as it is.
fn post_norm(proj: &[f32], w: Option<&[f32]>, eps: f32) -> Vec<f32> {
    match w {
        Some(w) => rms_norm(proj, w, eps),
        None => proj.to_vec(),
    }
}

/// One [`Gradient`] per sequence: its seed's numbers and its rows of the input `x0`; with the
/// backward's `back`, its rows of `∂/∂input` and (for a batch of one) the gradients inside.
fn gradients(
    seeds: Vec<Seed>,
    x0: &[f32],
    (n, batch): (usize, usize),
    nh: usize,
    mut back: Option<BlockGradients>,
) -> Vec<Gradient> {
    let span = x0.len() / batch;
    let per = nh * n;
    seeds
        .into_iter()
        .enumerate()
        .map(|(b, sd)| {
            let rows = b * span..(b + 1) * span;
            let (grad_input, grad_resid_pre, grad_pattern_last) = match back.as_mut() {
                None => (Vec::new(), Vec::new(), Vec::new()),
                Some(g) if batch > 1 => {
                    (g.grad_input[rows.clone()].to_vec(), Vec::new(), Vec::new())
                }
                Some(g) => (
                    g.grad_input[rows.clone()].to_vec(),
                    std::mem::take(&mut g.grad_resid_pre),
                    g.grad_pattern
                        .iter()
                        .map(|p| p[b * per..(b + 1) * per].to_vec())
                        .collect(),
                ),
            };
            Gradient {
                target: sd.target,
                logprob: sd.logprob,
                value: sd.value,
                logits: sd.logits,
                input: x0[rows].to_vec(),
                grad_input,
                grad_resid_pre,
                grad_pattern_last,
            }
        })
        .collect()
}

/// The MLP's activation of each row of `gu` (`gw` values: gate, then up where gated): `[rows, ff]`.
fn activation(kind: MlpKind, gu: &[f32], gw: usize, ff: usize) -> Vec<f32> {
    let mut act = vec![0f32; gu.len() / gw * ff];
    let act_rows = gu.par_chunks(gw).zip(act.par_chunks_mut(ff));
    act_rows.for_each(|(row, a)| match kind {
        MlpKind::GeluTanh => a
            .iter_mut()
            .zip(row)
            .for_each(|(a, &g)| *a = gelu_tanh_of(g)),
        MlpKind::GeluErf => a
            .iter_mut()
            .zip(row)
            .for_each(|(a, &g)| *a = crate::model::ops::gelu_erf_of(g)),
        MlpKind::GeGluTanh => {
            for i in 0..ff {
                a[i] = gelu_tanh_of(row[i]) * row[ff + i];
            }
        }
        MlpKind::SwiGlu => crate::model::ops::swiglu_row(&row[..ff], &row[ff..], a),
    });
    act
}
