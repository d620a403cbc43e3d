//! Gradients at the hook points (issue #39, item 6: TransformerLens's `run_with_cache(...,
//! incl_bwd=True)`), and the forward's activations beside them (attribution patching, item 4).
//!
//! The backward of [`super`] already passes through every hook point; a [`Tap`] keeps what it
//! is asked for as it passes, at the layers asked for: the residual stream (`hook_resid_pre`,
//! `hook_resid_mid`, `hook_resid_post`), the blocks' outputs (`hook_attn_out`, `hook_mlp_out`),
//! each head's `hook_z`, `hook_q`/`hook_k`/`hook_v` and the rotated `hook_rot_q`/`hook_rot_k`,
//! and, only for the layers that ask (they are `[heads, n, n]`), the attention maps
//! (`hook_pattern`, `hook_attn_scores`), recomputed from the saved q, k, v a block of queries at a
//! time as the backward does. The scalar is a [`Metric`] of the last position, or TransformerLens's
//! loss (the mean next-token cross-entropy over the text).

use super::readers::{BranchSink, LayerHeads};
use super::{Head, Metric, Model, NormKind, Packed4, Rules, Saved, QB};
use crate::model::capture::{hook_name, Hook};
use crate::model::error::{Error, Result};
use crate::model::tl_weights::interleaved_to_half_split;
use rayon::prelude::*;

/// The scalar a [`Model::hook_gradients`] backward starts from.
#[derive(Clone, Debug, PartialEq)]
pub enum GradMetric {
    /// A metric of the last position's logits (log-probability, logit difference).
    Metric(Metric),
    /// TransformerLens's loss: the mean over positions `0..n-1` of `−log p(token[i+1])`.
    Loss,
    /// Any scalar of the logits, given as its gradient with respect to them, `[n, vocab]` (the
    /// logits as the forward returns them: centred where `center_unembed` centres them): what a
    /// torch metric's backward hands to the model's logits (the Python package's backward hooks).
    Logits(Vec<f32>),
}

/// The hook points whose gradients [`Model::hook_gradients`] gives, per layer, in
/// TransformerLens's order.
pub const GRAD_HOOKS: [Hook; 20] = [
    Hook::ResidPre,
    Hook::Ln1Scale,
    Hook::Ln1Normalized,
    Hook::Q,
    Hook::K,
    Hook::V,
    Hook::RotQ,
    Hook::RotK,
    Hook::AttnScores,
    Hook::Pattern,
    Hook::Z,
    Hook::AttnOut,
    Hook::ResidMid,
    Hook::Ln2Scale,
    Hook::Ln2Normalized,
    Hook::MlpPre,
    Hook::MlpPreLinear,
    Hook::MlpPost,
    Hook::MlpOut,
    Hook::ResidPost,
];

/// The hooks of [`GRAD_HOOKS`] inside the norms and the MLP ([`BlockTap::inner`]).
const INNER_HOOKS: [Hook; 7] = [
    Hook::Ln1Scale,
    Hook::Ln1Normalized,
    Hook::Ln2Scale,
    Hook::Ln2Normalized,
    Hook::MlpPre,
    Hook::MlpPreLinear,
    Hook::MlpPost,
];

/// What [`Model::hook_gradients`] returns.
#[derive(Clone, Debug)]
pub struct HookGradients {
    /// The target token (the answer for a logit difference; for the loss, the last position's
    /// top token).
    pub target: u32,
    /// The scalar's value (the log-probability, the logit difference, or the loss).
    pub value: f32,
    /// `(TransformerLens name + "_grad", shape without the batch axis, values)`, in the order of
    /// the forward (`hook_embed_grad` first).
    pub grads: Vec<(String, Vec<usize>, Vec<f32>)>,
}

/// One run's activations at the hook points attribution patching reads, per layer, and (for
/// [`Model::activation_gradients`]) the metric's gradients at the same points.
#[derive(Clone, Debug)]
pub struct ActivationGradients {
    /// The last position's logits.
    pub logits: Vec<f32>,
    /// The metric's value (0 when no backward ran).
    pub value: f32,
    /// Per layer `(resid_pre, z, attn_out, mlp_out)`: `[n, d_model]`, z `[n, heads·head_dim]`.
    pub acts: Vec<LayerActs>,
    /// The gradients at the same points, in the same layout (empty when no backward ran).
    pub grads: Vec<LayerActs>,
}

/// What the backward keeps inside one block ([`Model::block_backward`]).
#[derive(Default)]
pub(super) struct BlockTap {
    /// `∂/∂resid_post` (= `∂/∂mlp_out`), `[n, d_model]`.
    pub resid_post: Vec<f32>,
    /// `∂/∂resid_mid` (= `∂/∂attn_out`), `[n, d_model]`.
    pub resid_mid: Vec<f32>,
    /// `∂/∂z`, `[n, heads·head_dim]`.
    pub z: Vec<f32>,
    /// `∂/∂` the rotated q, k and v as attention reads them: `[heads, n, head_dim]`, k and v
    /// `[kv_heads, n, head_dim]`.
    pub rot: Option<(Vec<f32>, Vec<f32>, Vec<f32>)>,
    /// `∂/∂` q|k|v before RoPE (after the q/k norms), `[n, width]` in the file's order.
    pub qkv: Vec<f32>,
    /// For a circuit's readers (`branches`): `∂/∂` q|k|v at the projection's output
    /// (before the q/k norms), `[n, width]`, and `∂/∂` the MLP's input, `[n, d_model]`.
    pub qkv_proj: Vec<f32>,
    pub mlp_in: Vec<f32>,
    /// Whether the two above are kept.
    pub branches: bool,
    /// Whether the norms' and the MLP's hook points below are kept.
    pub inner: bool,
    /// `(∂/∂ln1.hook_scale [n], ∂/∂ln1.hook_normalized [n, d_model])`, when `inner`.
    pub ln1: (Vec<f32>, Vec<f32>),
    /// The same at `ln2`, when `inner`.
    pub ln2: (Vec<f32>, Vec<f32>),
    /// `(∂/∂mlp.hook_post [n, d_ff], ∂/∂` the gate|up projections `[n, 2·d_ff]` (a gated MLP:
    /// `hook_pre` then `hook_pre_linear`) or `∂/∂mlp.hook_pre [n, d_ff]`), when `inner`.
    pub mlp: (Vec<f32>, Vec<f32>),
}

/// One layer's forward activations: `(resid_pre, z, attn_out, mlp_out)`, `[n, ·]` each.
pub type LayerActs = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

/// One layer's gradients as the backward kept them: the block's, `∂/∂resid_pre`, and the maps'
/// `(∂/∂pattern, ∂/∂attn_scores)` `[heads, n, n]` where asked.
pub(super) type LayerKept = (BlockTap, Vec<f32>, Option<(Vec<f32>, Vec<f32>)>);

/// What a tapped forward and backward keeps ([`Model::run_tapped`]).
#[derive(Default)]
pub(crate) struct Tap<'s> {
    /// Per layer: keep the block's gradients.
    pub grads_at: Vec<bool>,
    /// Per layer: also the attention maps' gradients (`[heads, n, n]` each).
    pub maps_at: Vec<bool>,
    /// Per layer: also the norms' and the MLP's hook points' gradients ([`BlockTap::inner`]).
    pub inner_at: Vec<bool>,
    /// Keep the forward's activations ([`LayerActs`]) at every layer.
    pub acts: bool,
    /// Seed the backward from the loss over these tokens instead of the metric.
    pub loss: Option<Vec<u32>>,
    /// Seed the backward from this gradient of the logits (`[n, vocab]`) instead of the metric.
    pub dlogits: Option<Vec<f32>>,
    /// The forward's activations, per layer (when `acts`).
    pub fwd: Vec<LayerActs>,
    /// Per layer, what the backward kept: `(block, ∂/∂resid_pre, maps)`, maps `(∂/∂pattern,
    /// ∂/∂attn_scores)` `[heads, n, n]` where asked.
    pub layers: Vec<Option<LayerKept>>,
    /// A circuit's sink: the upstream nodes' outputs in the forward, the gradients at the
    /// readers in the backward (`branches`); the layers' gradients are then handed to
    /// it, not kept.
    pub branches: Option<&'s mut dyn BranchSink>,
}

impl Tap<'_> {
    /// Whether layer `l`'s gradients are kept.
    pub fn wants(&self, l: usize) -> bool {
        self.grads_at.get(l).copied().unwrap_or(false)
    }

    /// Whether layer `l`'s norms' and MLP's hook points' gradients are kept.
    pub fn wants_inner(&self, l: usize) -> bool {
        self.inner_at.get(l).copied().unwrap_or(false)
    }

    /// The forward at a layer's attention output.
    pub(super) fn forward_attn(&mut self, resid_pre: &[f32], z: &[f32], attn_out: &[f32]) {
        if self.acts {
            self.fwd.push((
                resid_pre.to_vec(),
                z.to_vec(),
                attn_out.to_vec(),
                Vec::new(),
            ));
        }
    }

    /// The forward at a layer's MLP output.
    pub(super) fn forward_mlp(&mut self, mlp_out: &[f32]) {
        if let Some(last) = self.fwd.last_mut().filter(|_| self.acts) {
            last.3 = mlp_out.to_vec();
        }
    }

    /// The forward's input to layer 0, for a circuit's sink.
    pub(super) fn forward_input(&mut self, model: &Model, x0: &[f32]) -> Result<()> {
        match self.branches.as_deref_mut() {
            Some(sink) if sink.wants_nodes() => {
                sink.input(&x0[sink.rows_from() * model.dims.d_model..])
            }
            _ => Ok(()),
        }
    }

    /// Layer `l`'s heads' outputs (from `z` and the o projection's rows) and its MLP's, for a
    /// circuit's sink.
    pub(super) fn forward_nodes(
        &mut self,
        model: &Model,
        l: usize,
        (z, attn_proj): (&[f32], &[f32]),
        mlp_out: &[f32],
    ) -> Result<()> {
        match self.branches.as_deref_mut() {
            Some(sink) if sink.wants_nodes() => {
                let (from, dm) = (sink.rows_from(), model.dims.d_model);
                let zw = model.dims.n_heads * model.dims.head_dim;
                let heads = LayerHeads {
                    model,
                    layer: l,
                    z: &z[from * zw..],
                    attn_proj: &attn_proj[from * dm..],
                };
                sink.heads(l, &heads)?;
                sink.mlp(l, &mlp_out[from * dm..])
            }
            _ => Ok(()),
        }
    }

    /// The gradient at the final norm's input, for a circuit's sink.
    pub(super) fn final_gradient(&mut self, model: &Model, dx: &[f32]) -> Result<()> {
        match self.branches.as_deref_mut() {
            Some(sink) => sink.logits_gradient(&dx[sink.rows_from() * model.dims.d_model..]),
            None => Ok(()),
        }
    }

    /// Whether the backward keeps what a circuit's readers need.
    pub(super) fn wants_branches(&self) -> bool {
        self.branches.is_some()
    }

    /// Layer `l`'s backward is done: `dx` is `∂/∂resid_pre`.
    pub(super) fn backward_layer(
        &mut self,
        model: &Model,
        l: usize,
        s: &Saved,
        n: usize,
        bt: BlockTap,
        dx: &[f32],
    ) -> Result<()> {
        if let Some(sink) = self.branches.as_deref_mut() {
            let from = sink.rows_from();
            return sink.layer_gradients(l, &model.reader_gradients(l, s, (n, from), &bt)?);
        }
        if self.layers.len() <= l {
            self.layers.resize_with(l + 1, || None);
        }
        let maps = self
            .maps_at
            .get(l)
            .copied()
            .unwrap_or(false)
            .then(|| model.map_grads(l, s, &bt.z, n));
        self.layers[l] = Some((bt, dx.to_vec(), maps));
        Ok(())
    }
}

/// The hook points a [`Model::hook_gradients`] call asks for.
struct ChosenHooks {
    /// Per layer, the hooks of [`GRAD_HOOKS`] asked for.
    layers: Vec<Vec<Hook>>,
    /// The embeddings' hooks asked for (their gradient is the input's).
    globals: Vec<Hook>,
}

impl ChosenHooks {
    /// The tap that keeps what the chosen hooks need: a layer's gradients where any hook of it
    /// is asked for, its attention maps' where the pattern or the scores are.
    fn tap(&self) -> Tap<'static> {
        Tap {
            grads_at: self.layers.iter().map(|c| !c.is_empty()).collect(),
            maps_at: self
                .layers
                .iter()
                .map(|c| {
                    c.iter()
                        .any(|h| matches!(h, Hook::Pattern | Hook::AttnScores))
                })
                .collect(),
            inner_at: self
                .layers
                .iter()
                .map(|c| c.iter().any(|&h| INNER_HOOKS.contains(&h)))
                .collect(),
            ..Tap::default()
        }
    }
}

/// `[heads, n, hd]` to `[n, heads, hd]`.
fn heads_to_rows(x: &[f32], heads: usize, n: usize, hd: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for h in 0..heads {
        for r in 0..n {
            out[(r * heads + h) * hd..][..hd].copy_from_slice(&x[(h * n + r) * hd..][..hd]);
        }
    }
    out
}

/// The summed loss over the rows of raw logits `raw` (`[rows][vocab]`, row `i` predicting
/// `tokens[i+1]`) and `d loss / d raw logits`, `[rows, vocab]`, of the mean loss (through the
/// final soft-cap `cap`).
fn loss_logit_grads(
    raw: &[Vec<f32>],
    vocab: usize,
    tokens: &[u32],
    cap: Option<f32>,
) -> Result<(f64, Vec<f32>)> {
    let rows = raw.len();
    let mut d = vec![0f32; rows * vocab];
    let mut loss = 0f64;
    for (i, r) in raw.iter().enumerate() {
        let lg = super::soft_capped_logits(r, cap)?;
        let lsm = crate::model::forward::log_softmax(&lg);
        let next = tokens[i + 1] as usize;
        loss -= lsm[next] as f64;
        let drow = &mut d[i * vocab..(i + 1) * vocab];
        for (v, (o, &lp)) in drow.iter_mut().zip(&lsm).enumerate() {
            let p = (lp as f64).exp() - if v == next { 1.0 } else { 0.0 };
            let p = match cap {
                Some(c) => p * super::softcap_slope(r[v], c),
                None => p,
            };
            *o = (p / rows as f64) as f32;
        }
    }
    Ok((loss, d))
}

impl Model {
    /// The attention maps' gradients of layer `l` from `∂/∂z` (`[n, heads·hd]`):
    /// `(∂/∂pattern, ∂/∂attn_scores)`, `[heads, n, n]` each. `∂/∂pattern[h, i, j] = dzᵢ · vⱼ`
    /// for every key (masked ones too, as autograd gives it); `∂/∂scores = P ⊙ (dP − Σ P·dP)`,
    /// 0 at masked keys (the scores as the softmax sees them: scaled, soft-capped).
    fn map_grads(&self, l: usize, s: &Saved, dz: &[f32], n: usize) -> (Vec<f32>, Vec<f32>) {
        let (nh, nkv, hd) = (self.dims.n_heads, self.dims.n_kv_heads, self.dims.head_dim);
        let group = nh / nkv;
        let (heads, packed): (Vec<Head>, Vec<Packed4>) =
            self.heads_batch(l, &s.q, &s.k, &s.v, n, 1, Rules::Gradient);
        let per_head: Vec<(Vec<f32>, Vec<f32>)> = heads
            .par_iter()
            .enumerate()
            .map(|(h, head)| {
                let v = head.v;
                let mut dp = vec![0f32; n * n];
                for i in 0..n {
                    let dzi = &dz[(i * nh + h) * hd..][..hd];
                    for (j, vj) in v.chunks(hd).enumerate() {
                        dp[i * n + j] = dzi.iter().zip(vj).map(|(a, b)| a * b).sum();
                    }
                }
                let mut ds = vec![0f32; n * n];
                let (mut p, mut th) = (Vec::new(), Vec::new());
                for i0 in (0..n).step_by(QB) {
                    let i1 = (i0 + QB).min(n);
                    head.probs_block(&packed[h / group], i0, i1, &mut p, &mut th);
                    for (r, prow) in p.chunks(i1).enumerate() {
                        let i = i0 + r;
                        let dprow = &dp[i * n..i * n + i1];
                        let pdp: f64 = prow
                            .iter()
                            .zip(dprow)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum();
                        for j in 0..i1 {
                            ds[i * n + j] = prow[j] * (dprow[j] - pdp as f32);
                        }
                    }
                }
                (dp, ds)
            })
            .collect();
        let mut dpat = Vec::with_capacity(nh * n * n);
        let mut dscores = Vec::with_capacity(nh * n * n);
        for (dp, ds) in per_head {
            dpat.extend(dp);
            dscores.extend(ds);
        }
        (dpat, dscores)
    }

    /// The loss's value and its gradient with respect to the final residual stream `x`
    /// (`[n, d_model]`), through the final norm of kind `fkind` and the output head: row `i < n−1`
    /// gets `(softmax(logitsᵢ) − onehot(tokens[i+1])) / (n−1)`.
    pub(super) fn loss_seed(
        &self,
        x: &[f32],
        tokens: &[u32],
        fkind: NormKind,
    ) -> Result<(f32, Vec<f32>)> {
        let (dm, eps) = (self.dims.d_model, self.dims.rms_eps);
        let n = x.len() / dm;
        if n < 2 || tokens.len() != n {
            return Err(Error::OutOfRange {
                what: "the text's token count for the loss".into(),
                value: n.to_string(),
                range: "2 or more (the loss predicts each next token)".into(),
            });
        }
        let rows = n - 1;
        let fb = self.weights.final_norm_bias.as_deref();
        let h = super::norm_fwd(fkind, &x[..rows * dm], &self.weights.final_norm, fb, eps);
        let raw = crate::model::ops::logits_rows(&self.weights.lm_head, h, rows, dm)?;
        let cap = self.dims.gemma.as_ref().and_then(|g| g.final_softcap);
        let vocab = raw.first().map_or(0, |r| r.len());
        let (loss, d) = loss_logit_grads(&raw, vocab, tokens, cap)?;
        let dx = self.final_norm_back(x, &d, rows, fkind)?;
        Ok(((loss / rows as f64) as f32, dx))
    }

    /// The gradient with respect to the final residual stream `x` (`[n, d_model]`) of a scalar
    /// whose gradient with respect to every position's logits is `d` (`[n, vocab]`, the logits as
    /// the forward returns them): back through `center_unembed`'s centring (its row mean
    /// removed), the final soft-cap, the output head and the final norm of kind `fkind`.
    pub(super) fn dlogits_seed(&self, x: &[f32], d: &[f32], fkind: NormKind) -> Result<Vec<f32>> {
        let (dm, vocab) = (self.dims.d_model, self.dims.vocab_size);
        let n = x.len() / dm;
        if d.len() != n * vocab {
            return Err(Error::OutOfRange {
                what: "values of the logits' gradient".into(),
                value: d.len().to_string(),
                range: format!("{n} positions × {vocab} logits = {}", n * vocab),
            });
        }
        let mut d = d.to_vec();
        if self.centres_logits() {
            // the centred logits are (I − 11ᵀ/V)·raw: its transpose centres the gradient
            crate::model::processing::centre_rows(&mut d, vocab);
        }
        if let Some(cap) = self.dims.gemma.as_ref().and_then(|g| g.final_softcap) {
            let fb = self.weights.final_norm_bias.as_deref();
            let eps = self.dims.rms_eps;
            let h = super::norm_fwd(fkind, x, &self.weights.final_norm, fb, eps);
            let raw = crate::model::ops::logits_rows(&self.weights.lm_head, h, n, dm)?;
            for (drow, r) in d.chunks_mut(vocab).zip(&raw) {
                drow.iter_mut()
                    .zip(r)
                    .for_each(|(g, &z)| *g = (*g as f64 * super::softcap_slope(z, cap)) as f32);
            }
        }
        self.final_norm_back(x, &d, n, fkind)
    }

    /// `∂/∂x` (`[n, d_model]`, zero past `rows`) from `d`, the gradient at the raw logits of the
    /// first `rows` rows of `x` (`[rows, vocab]`): through the output head and the final norm.
    fn final_norm_back(
        &self,
        x: &[f32],
        d: &[f32],
        rows: usize,
        fkind: NormKind,
    ) -> Result<Vec<f32>> {
        let (dm, eps) = (self.dims.d_model, self.dims.rms_eps);
        let vocab = d.len() / rows.max(1);
        let dh = self.unembed_rows_back(d, rows, vocab)?;
        let mut dx = vec![0f32; x.len()];
        dx[..rows * dm].copy_from_slice(&super::norm_backward(
            fkind,
            &x[..rows * dm],
            &self.weights.final_norm,
            eps,
            &dh,
        ));
        Ok(dx)
    }

    /// `d · W_U` for `rows` rows of `d loss / d raw logits` (`[rows, vocab]`): the loss's
    /// gradient at the final norm's output, `[rows, d_model]`, a chunk of vocabulary rows per
    /// task.
    fn unembed_rows_back(&self, d: &[f32], rows: usize, vocab: usize) -> Result<Vec<f32>> {
        let dm = self.dims.d_model;
        let w = self.unembed_matrix()?;
        const CHUNK: usize = 2048;
        Ok((0..vocab.div_ceil(CHUNK))
            .into_par_iter()
            .map(|c| {
                let (v0, v1) = (c * CHUNK, ((c + 1) * CHUNK).min(vocab));
                let mut acc = vec![0f32; rows * dm];
                for i in 0..rows {
                    let a = &mut acc[i * dm..(i + 1) * dm];
                    for v in v0..v1 {
                        let g = d[i * vocab + v];
                        if g != 0.0 {
                            a.iter_mut()
                                .zip(&w[v * dm..(v + 1) * dm])
                                .for_each(|(a, &w)| *a += g * w);
                        }
                    }
                }
                acc
            })
            .reduce(
                || vec![0f32; rows * dm],
                |mut a, b| {
                    a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                    a
                },
            ))
    }

    /// The forward's activations at `hook_resid_pre`, `attn.hook_z`, `hook_attn_out` and
    /// `hook_mlp_out` of every layer, and with `backward` the gradients of `metric` there (one
    /// forward, one backward): what attribution patching needs of each run.
    pub fn activation_gradients(
        &self,
        tokens: &[u32],
        metric: Metric,
        backward: bool,
    ) -> Result<ActivationGradients> {
        let nl = self.dims.n_layers;
        let mut tap = Tap {
            grads_at: vec![backward; nl],
            maps_at: vec![false; nl],
            acts: true,
            ..Tap::default()
        };
        let (x0, _) = self.input_embeddings(tokens)?;
        let g = self.run_tapped(&x0, metric, backward, Rules::Gradient, Some(&mut tap))?;
        let grads = if backward {
            tap.layers
                .into_iter()
                .map(|t| {
                    let (bt, pre, _) =
                        t.ok_or_else(|| super::bug("a layer's gradients were not kept".into()))?;
                    Ok((pre, bt.z, bt.resid_mid, bt.resid_post))
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        Ok(ActivationGradients {
            logits: g.logits,
            value: if backward { g.value } else { 0.0 },
            acts: tap.fwd,
            grads,
        })
    }

    /// The gradient of `metric` with respect to the hook points `wants` selects (full
    /// TransformerLens names without `_grad`, e.g. `blocks.3.hook_resid_pre`), from one forward
    /// and one backward. Names outside [`GRAD_HOOKS`] (and `hook_embed`, GPT-2's
    /// `hook_pos_embed`) have no gradient here and are not offered to `wants`. The attention
    /// maps' gradients cost `heads · n²` floats per selected layer.
    pub fn hook_gradients(
        &self,
        tokens: &[u32],
        metric: GradMetric,
        wants: &dyn Fn(&str) -> bool,
    ) -> Result<HookGradients> {
        let chosen = self.chosen_hooks(wants);
        let mut tap = chosen.tap();
        let m = match metric {
            GradMetric::Metric(m) => m,
            GradMetric::Loss => {
                tap.loss = Some(tokens.to_vec());
                Metric::LogProb(None)
            }
            GradMetric::Logits(d) => {
                tap.dlogits = Some(d);
                Metric::LogProb(None)
            }
        };
        let (x0, _) = self.input_embeddings(tokens)?;
        let g = self.run_tapped(&x0, m, true, Rules::Gradient, Some(&mut tap))?;
        let n = tokens.len();
        let mut grads = Vec::new();
        for h in chosen.globals {
            grads.push((
                format!("{}_grad", hook_name(0, h)),
                vec![n, self.dims.d_model],
                g.grad_input.clone(),
            ));
        }
        for (l, hooks) in chosen.layers.iter().enumerate() {
            let Some(Some(kept)) = tap.layers.get(l) else {
                continue;
            };
            for &hk in hooks {
                let Some((shape, data)) = self.kept_gradient(kept, hk, n)? else {
                    continue;
                };
                if let Some(bad) = data.iter().position(|v| !v.is_finite()) {
                    return Err(Error::NonFinite {
                        what: format!("the gradient at {} (element {bad})", hook_name(l, hk)),
                        layer: Some(l),
                    });
                }
                grads.push((format!("{}_grad", hook_name(l, hk)), shape, data));
            }
        }
        Ok(HookGradients {
            target: g.target,
            value: g.value,
            grads,
        })
    }

    /// The hook points `wants` selects: per layer those of [`GRAD_HOOKS`], in its order, and the
    /// embeddings' (`hook_embed`, and `hook_pos_embed` where the model has one).
    fn chosen_hooks(&self, wants: &dyn Fn(&str) -> bool) -> ChosenHooks {
        let layers = (0..self.dims.n_layers)
            .map(|l| {
                GRAD_HOOKS
                    .iter()
                    .copied()
                    .filter(|&hk| wants(&hook_name(l, hk)))
                    .collect()
            })
            .collect();
        let globals = [Hook::Embed, Hook::PosEmbed]
            .into_iter()
            .filter(|&h| h == Hook::Embed || self.weights.pos_embed.is_some())
            .filter(|&h| wants(&hook_name(0, h)))
            .collect();
        ChosenHooks { layers, globals }
    }

    /// One hook point's gradient from what the backward kept of its layer, `(shape, values)` in
    /// TransformerLens's layout (q and k in its half-split order); `None` for a hook without one.
    fn kept_gradient(
        &self,
        (bt, pre, maps): &LayerKept,
        hk: Hook,
        n: usize,
    ) -> Result<Option<(Vec<usize>, Vec<f32>)>> {
        let (nh, nkv, hd, dm) = (
            self.dims.n_heads,
            self.dims.n_kv_heads,
            self.dims.head_dim,
            self.dims.d_model,
        );
        let (nq, nk) = (nh * hd, nkv * hd);
        let width = nq + 2 * nk;
        let cols = |c0: usize, w: usize| -> Vec<f32> {
            bt.qkv
                .chunks(width)
                .flat_map(|r| r[c0..c0 + w].iter().copied())
                .collect()
        };
        if INNER_HOOKS.contains(&hk) {
            return Ok(self.inner_gradient(bt, hk, n));
        }
        let (shape, mut data) = match hk {
            Hook::ResidPre => (vec![n, dm], pre.clone()),
            Hook::ResidMid | Hook::AttnOut => (vec![n, dm], bt.resid_mid.clone()),
            Hook::ResidPost | Hook::MlpOut => (vec![n, dm], bt.resid_post.clone()),
            Hook::Z => (vec![n, nh, hd], bt.z.clone()),
            Hook::Q => (vec![n, nh, hd], cols(0, nq)),
            Hook::K => (vec![n, nkv, hd], cols(nq, nk)),
            Hook::V => (vec![n, nkv, hd], cols(nq + nk, nk)),
            Hook::RotQ | Hook::RotK => {
                let (dq, dk, _) = bt
                    .rot
                    .as_ref()
                    .ok_or_else(|| super::bug("the backward kept no q/k gradients".into()))?;
                match hk {
                    Hook::RotQ => (vec![n, nh, hd], heads_to_rows(dq, nh, n, hd)),
                    _ => (vec![n, nkv, hd], heads_to_rows(dk, nkv, n, hd)),
                }
            }
            Hook::Pattern | Hook::AttnScores => {
                let (dp, ds) = maps
                    .as_ref()
                    .ok_or_else(|| super::bug("the backward kept no attention maps".into()))?;
                let d = if hk == Hook::Pattern { dp } else { ds };
                (vec![nh, n, n], d.clone())
            }
            _ => return Ok(None),
        };
        if self.qk_interleaved() && matches!(hk, Hook::Q | Hook::K | Hook::RotQ | Hook::RotK) {
            interleaved_to_half_split(&mut data, hd, 1);
        }
        Ok(Some((shape, data)))
    }

    /// A norm's or the MLP's hook point's gradient ([`INNER_HOOKS`]) from what the backward kept,
    /// `(shape, values)`; `None` for `hook_pre_linear` of an MLP with no gate.
    fn inner_gradient(&self, bt: &BlockTap, hk: Hook, n: usize) -> Option<(Vec<usize>, Vec<f32>)> {
        let (dm, ff) = (self.dims.d_model, self.dims.d_ff);
        let (post, pre) = &bt.mlp;
        let gated = pre.len() == n * 2 * ff;
        let half = |c0: usize| -> Vec<f32> {
            pre.chunks(2 * ff)
                .flat_map(|r| r[c0..c0 + ff].iter().copied())
                .collect()
        };
        Some(match hk {
            Hook::Ln1Scale => (vec![n, 1], bt.ln1.0.clone()),
            Hook::Ln1Normalized => (vec![n, dm], bt.ln1.1.clone()),
            Hook::Ln2Scale => (vec![n, 1], bt.ln2.0.clone()),
            Hook::Ln2Normalized => (vec![n, dm], bt.ln2.1.clone()),
            Hook::MlpPost => (vec![n, ff], post.clone()),
            Hook::MlpPre if gated => (vec![n, ff], half(0)),
            Hook::MlpPre => (vec![n, ff], pre.clone()),
            Hook::MlpPreLinear if gated => (vec![n, ff], half(ff)),
            _ => return None,
        })
    }
}
