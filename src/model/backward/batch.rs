//! The forward that keeps what the backward needs, and the backward through every block, of
//! several sequences of one length at once (one sequence is a batch of one).

use super::block::Scratch;
use super::profile::Profile;
use super::rowwise::{norm_back, norm_fwd};
use super::taps::{BlockTap, Tap};
use super::{bug, Batch, Gradient, Metric, Rules, Saved};
use crate::model::block::{MlpKind, NormKind};
use crate::model::error::{Error, Result};
use crate::model::ops::{gelu_tanh_of, rms_norm, rms_norm_in_place, rotate};
use crate::model::Model;
use rayon::prelude::*;

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
        let Batch { x0, batch } = x;
        let lrp = rules == Rules::AttnLrp;
        let dims = &self.dims;
        let (nh, dm, eps) = (dims.n_heads, dims.d_model, dims.rms_eps);
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
        // ---- forward, saving what the backward needs
        let mut scratch = Scratch::default();
        scratch.prof.lap("(setup)");
        let (x, saved) =
            self.save_forward(x0, (n, batch), tap.as_deref_mut(), &mut scratch.prof)?;
        let prof = &mut scratch.prof;
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
        let raws = crate::model::ops::logits_rows(&self.weights.lm_head, hf, batch, dm)?;
        if raws.len() != batch {
            return Err(bug("a logits row per sequence".into()));
        }
        let cap = dims.gemma.as_ref().and_then(|g| g.final_softcap);
        prof.lap("fwd final norm, logits");
        let mut seeds = Vec::with_capacity(batch);
        for raw in raws {
            seeds.push(self.seed(raw, cap, metric, lrp)?);
        }
        prof.lap("seed");
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
        scratch.prof.lap("bwd unembedding");
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
        scratch.prof.lap("bwd final norm, transposes");
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
                &mut scratch,
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
        scratch.prof.lap("bwd residual copies");
        scratch.prof.report(rows);
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
        let (nh, nkv, hd, dm, ff) = (
            dims.n_heads,
            dims.n_kv_heads,
            dims.head_dim,
            dims.d_model,
            dims.d_ff,
        );
        let eps = dims.rms_eps;
        let rows = n * batch;
        let (nq, nk) = (nh * hd, nkv * hd);
        let width = nq + 2 * nk;
        let half = dims.rotary_dim / 2;
        let style = self.weights.rope_style;
        let tables = |base: f32| {
            let mut inv = dims.rope_scaling.inv_freq(dims.rotary_dim, base);
            if let Some(f) = &self.weights.rope_freqs {
                inv.iter_mut().zip(f).for_each(|(x, f)| *x /= f);
            }
            crate::model::ops::rope_tables_of(&inv, n)
        };
        let mut x = x0.to_vec();
        let mut saved: Vec<Saved> = Vec::with_capacity(dims.n_layers);
        for (l, layer) in self.weights.layers.iter().enumerate() {
            let plan = layer.plan;
            let resid_pre = x.clone();
            let b1 = layer.norm_biases.as_ref().map(|b| b.0.as_slice());
            let h1 = norm_fwd(plan.norm, &x, &layer.attn_norm, b1, eps);
            prof.lap("fwd norms");
            let qkv = layer.qkv.forward(&h1, rows)?;
            prof.lap("fwd q|k|v");
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
            prof.lap("fwd q/k norms, RoPE, split");
            let z = self.attention_forward(l, &q, &k, &v, n, batch);
            prof.lap("fwd attention");
            // the last layer: only each sequence's last row reaches the metric (but a tap's
            // hooks and the loss want every row): the o projection and the MLP run on those
            let last_only = l + 1 == dims.n_layers && tap.is_none();
            let (kept, m) = if last_only {
                (last_rows(n, batch), batch)
            } else {
                (Vec::new(), rows)
            };
            let z = if last_only { gather(&z, nq, &kept) } else { z };
            let mut x_all = std::mem::take(&mut x);
            let mut xs = if last_only {
                gather(&x_all, dm, &kept)
            } else {
                std::mem::take(&mut x_all)
            };
            let attn_proj = layer.o.forward(&z, m)?;
            prof.lap("fwd o");
            let attn_out = match &layer.post_norms {
                Some((pa, _)) => rms_norm(&attn_proj, pa, eps),
                None => attn_proj.clone(),
            };
            if let Some(t) = tap.as_deref_mut() {
                t.forward_attn(&resid_pre, &z, &attn_out);
            }
            xs.iter_mut().zip(&attn_out).for_each(|(a, b)| *a += b);
            let resid_mid = xs.clone();
            let b2 = layer.norm_biases.as_ref().map(|b| b.1.as_slice());
            let h2 = norm_fwd(plan.norm, &xs, &layer.mlp_norm, b2, eps);
            prof.lap("fwd norms");
            let gu = layer.gate_up.forward(&h2, m)?;
            prof.lap("fwd gate|up");
            let gw = if plan.mlp.gated() { 2 * ff } else { ff };
            let act = activation(plan.mlp, &gu, gw, ff);
            prof.lap("fwd activation");
            let mlp_proj = layer.down.forward(&act, m)?;
            prof.lap("fwd down");
            let mlp_out = match &layer.post_norms {
                Some((_, pm)) => rms_norm(&mlp_proj, pm, eps),
                None => mlp_proj.clone(),
            };
            if let Some(t) = tap.as_deref_mut() {
                t.forward_mlp(&mlp_out);
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
                last_only,
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
}

/// Each sequence's last row among `batch` sequences of `n` rows, stacked.
pub(super) fn last_rows(n: usize, batch: usize) -> Vec<usize> {
    (0..batch).map(|b| b * n + n - 1).collect()
}

/// Rows `rows` of `a` (rows of `width` values), in that order.
pub(super) fn gather(a: &[f32], width: usize, rows: &[usize]) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * width);
    for &r in rows {
        out.extend_from_slice(&a[r * width..(r + 1) * width]);
    }
    out
}

/// `a`'s rows (of `width` values) written to rows `rows` of `into`.
pub(super) fn scatter(a: &[f32], width: usize, rows: &[usize], into: &mut [f32]) {
    for (src, &r) in a.chunks_exact(width).zip(rows) {
        into[r * width..(r + 1) * width].copy_from_slice(src);
    }
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
