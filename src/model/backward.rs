//! A backward pass through the engine's forward (issue #39, phase 1): the gradient of a scalar of
//! the last position's logits (the target's log-probability, or a logit difference) with respect
//! to the input embeddings (the residual stream entering layer 0).
//!
//! The forward here is the engine's, op by op, on one segment (the same projections through
//! `Linear::forward`, the same norms and activations of [`super::ops`]), with what the backward
//! needs saved per layer; the attention probabilities are recomputed per head during the
//! backward rather than stored. The weight-transposed products `dX = dY · W` use each
//! projection's matrix read back from the kernel (`I · Wᵀ`), one layer at a time.

use super::block::NormKind;
use super::error::{Error, Result};
use super::Model;
use rayon::prelude::*;

mod batch;
mod block;
mod branches;
mod edited;
mod head;
mod layout;
mod profile;
mod readers;
mod rowwise;
mod taps;
pub use block::LayerT;
pub use edited::{EditedForward, Prefix, ReaderEdit};
use head::{Head, Packed4, QB};
pub use readers::{BranchSink, LayerHeads, Reader, ReaderGrads};
use rowwise::norm_fwd;
pub use rowwise::{norm_backward, norm_identity};
use taps::Tap;
pub use taps::{ActivationGradients, GradMetric, HookGradients, LayerActs, GRAD_HOOKS};

/// The scalar whose gradient is taken, of the last position's logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Metric {
    /// `log p(target)`; `None`: the top next token.
    LogProb(Option<u32>),
    /// `logit(answer) − logit(wrong)`.
    LogitDiff { answer: u32, wrong: u32 },
}

/// How the backward propagates: the true gradient, or AttnLRP's rules in the gradient × input
/// form (`lrp`): the identity rule on norms (their scale held constant) and element-wise
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

impl Saved {
    /// The last layer with no tap: `attn_proj`, `resid_mid`, `gu` and `mlp_proj` hold each
    /// sequence's last row only (the only rows the metric reads), fewer rows than `resid_pre`
    /// (with one token per sequence they are every row: nothing was left out).
    fn last_only(&self) -> bool {
        self.resid_mid.len() < self.resid_pre.len()
    }
}

fn bug(msg: String) -> Error {
    Error::Bug(msg)
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

    /// One sequence's logits from the head's `raw` row (soft-capped by `cap`), the metric's
    /// target, value and `d metric / d raw logit` as (token, weight) pairs.
    fn seed(&self, raw: Vec<f32>, cap: Option<f32>, metric: Metric, lrp: bool) -> Result<Seed> {
        let logits = soft_capped_logits(&raw, cap)?;
        let lsm = super::forward::log_softmax(&logits);
        let target = metric_target(metric, &logits)?;
        let logprob = lsm[target as usize];
        let (value, mut dlogit) = metric_logit_grads(metric, target, &logits, &lsm, lrp);
        through_final_softcap(&mut dlogit, &raw, &logits, cap, lrp);
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
}

/// A row of raw logits through the final soft-cap `cap` (if any), refused when not finite.
fn soft_capped_logits(raw: &[f32], cap: Option<f32>) -> Result<Vec<f32>> {
    let logits: Vec<f32> = match cap {
        Some(c) => raw.iter().map(|&u| (u / c).tanh() * c).collect(),
        None => raw.to_vec(),
    };
    if !logits.iter().all(|v| v.is_finite()) {
        return Err(Error::NonFinite {
            what: "the logits".into(),
            layer: None,
        });
    }
    Ok(logits)
}

/// The soft-cap's derivative at the raw logit `raw`: `1 − tanh²(raw / c)`.
#[inline]
fn softcap_slope(raw: f32, c: f32) -> f64 {
    let t = (raw / c).tanh() as f64;
    1.0 - t * t
}

/// The metric's target token (the top token when it names none), with every token it names
/// checked against the vocabulary.
fn metric_target(metric: Metric, logits: &[f32]) -> Result<u32> {
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
    Ok(target)
}

/// The metric's value and `d metric / d (capped) logit` as (token, weight) pairs, from the
/// logits and their log-softmax `lsm`. Under AttnLRP (`lrp`) a log-probability is explained
/// from the target's logit.
fn metric_logit_grads(
    metric: Metric,
    target: u32,
    logits: &[f32],
    lsm: &[f32],
    lrp: bool,
) -> (f32, Vec<(u32, f64)>) {
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
            lsm[target as usize]
        }
        Metric::LogitDiff { answer, wrong } => {
            dlogit.push((answer, 1.0));
            dlogit.push((wrong, -1.0));
            logits[answer as usize] - logits[wrong as usize]
        }
    };
    (value, dlogit)
}

/// `dlogit` (on the capped logits) carried through the final soft-cap to the raw logits: by the
/// soft-cap's derivative, or under AttnLRP (`lrp`) by the identity rule (what the capped logit
/// holds passes to the raw one).
fn through_final_softcap(
    dlogit: &mut [(u32, f64)],
    raw: &[f32],
    logits: &[f32],
    cap: Option<f32>,
    lrp: bool,
) {
    for (v, d) in dlogit.iter_mut() {
        *d = match cap {
            Some(_) if lrp => {
                let r = raw[*v as usize] as f64;
                if r == 0.0 {
                    *d
                } else {
                    *d * logits[*v as usize] as f64 / r
                }
            }
            Some(c) => *d * softcap_slope(raw[*v as usize], c),
            None => *d,
        };
    }
}
