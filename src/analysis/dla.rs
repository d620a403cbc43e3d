//! Direct logit attribution: how much each head, each MLP and the embedding write, directly, into
//! the answer's logit (or a logit difference) at the last position, through the final norm's scale
//! of the actual run (TransformerLens's `cache.decompose_resid`, `stack_head_results`,
//! `apply_ln_to_stack` and `logit_attrs`). The residual stream is the embedding plus every
//! block's outputs, so the parts add up to the logit itself; the report says how closely.

use super::collect::{last_query_attention, Collector};
use super::vocab::{max_argmax, Target, TokenRef};
use crate::model::capture::{AttnCache, CaptureSpec, Hook, Queries};
use crate::model::forward::RunOptions;
use crate::model::{Error, Model, Result};
use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct HeadPart {
    pub layer: usize,
    pub head: usize,
    /// its direct contribution to the metric (logit, or logit difference)
    pub dla: f32,
    /// the head's attention for the last query: largest weight, where, and on the first token
    pub max_weight: f32,
    pub argmax: usize,
    pub sink: f32,
}

/// `dla`'s report: direct logit attribution of the answer (against a wrong answer) to each
/// layer's attention heads and MLP.
#[derive(Clone, Debug, Serialize)]
pub struct DlaReport {
    /// the model's name
    pub model: String,
    /// the input tokens
    pub tokens: Vec<TokenRef>,
    /// the position whose prediction is explained
    pub query: usize,
    /// the answer token
    pub answer: TokenRef,
    /// the wrong token, for a logit difference
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wrong: Option<TokenRef>,
    /// the metric as the model computes it: logit(answer) [− logit(wrong)]
    pub metric: f32,
    /// the parts below, added up (with the final norm's bias); the gap to `metric` is rounding
    pub sum_of_parts: f32,
    /// the embeddings' part
    pub embed: f32,
    /// each attention head's part
    pub heads: Vec<HeadPart>,
    /// W_O's bias of each layer (zeros where there is none)
    pub attn_bias: Vec<f32>,
    /// each layer's MLP's part
    pub mlp: Vec<f32>,
    /// the final norm's bias's part
    pub final_bias: f32,
    /// the final norm's scale at the last position (1/RMS, or 1/σ for LayerNorm)
    pub final_scale: f32,
}

/// The direct logit attribution of the last position's prediction of `answer` (default: the
/// model's top token), or of `answer − wrong`.
pub fn dla(
    model: &Model,
    tokens: &[u32],
    answer: &Target,
    wrong: Option<&Target>,
) -> Result<DlaReport> {
    check_linear_readout(model)?;
    let d = &model.dims;
    let n = tokens.len();
    let (cache, logits) = last_position_run(model, tokens)?;
    let (a, w) = resolve_tokens(model, &logits, answer, wrong)?;
    let rows = last_query_attention(model, tokens)?;
    let u = readout_direction(model, a, w)?;
    let last =
        |l: usize, h: Hook| -> &[f32] { &cache.get(l, h).expect("captured at every layer").data };
    let (_, bias, _) = model.final_norm();
    let proj = Projection::new(model, &u, last(d.n_layers - 1, Hook::ResidPost));
    let part = |c: &[f32]| proj.part(c);
    let embed = part(last(0, Hook::ResidPre));
    let (heads, attn_bias, mlp) = layer_parts(model, &rows, &last, &part)?;
    let final_bias = bias.map_or(0.0, |b| {
        b.iter()
            .zip(&u)
            .map(|(&b, &u)| b as f64 * u as f64)
            .sum::<f64>() as f32
    });
    let sum_of_parts = embed
        + heads.iter().map(|h| h.dla).sum::<f32>()
        + attn_bias.iter().sum::<f32>()
        + mlp.iter().sum::<f32>()
        + final_bias;
    let metric = logits[a as usize] - w.map_or(0.0, |w| logits[w as usize]);
    Ok(DlaReport {
        model: model.info.name.clone(),
        tokens: TokenRef::all(model, tokens),
        query: n - 1,
        answer: TokenRef::of(model, a),
        wrong: w.map(|w| TokenRef::of(model, w)),
        metric,
        sum_of_parts,
        embed,
        heads,
        attn_bias,
        mlp,
        final_bias,
        final_scale: proj.scale as f32,
    })
}

/// Refuses a model whose residual stream is not a plain sum of its parts read by a linear
/// unembedding (Gemma's post-norms, or soft-capped logits).
fn check_linear_readout(model: &Model) -> Result<()> {
    let d = &model.dims;
    if model.has_post_norms() || d.gemma.as_ref().is_some_and(|g| g.final_softcap.is_some()) {
        return Err(Error::NotApplicable(format!(
            "direct logit attribution needs the residual stream to be a sum of each head's and MLP's output, read by a linear unembedding; {} normalizes each block's output before adding it (Gemma's post-norms) or soft-caps the logits, so it is not: use `attnscope ablate` or `patch` for this model",
            model.info.name
        )));
    }
    Ok(())
}

/// The run that captures every layer's parts at the last position: the cache and its
/// last-position logits.
fn last_position_run(model: &Model, tokens: &[u32]) -> Result<(AttnCache, Vec<f32>)> {
    let n = tokens.len();
    let mut cache = AttnCache::new(
        &CaptureSpec {
            hooks: vec![Hook::ResidPre, Hook::Z, Hook::MlpOut, Hook::ResidPost],
            layers: None,
            heads: None,
            queries: Queries::Last,
        },
        n,
    );
    let out = model.forward(tokens, &RunOptions::last_logits(n), &mut cache)?;
    let logits = out.logits.into_iter().next().expect("one row of logits");
    Ok((cache, logits))
}

/// The answer and the wrong token, resolved on the logits and refused when they are the same.
fn resolve_tokens(
    model: &Model,
    logits: &[f32],
    answer: &Target,
    wrong: Option<&Target>,
) -> Result<(u32, Option<u32>)> {
    let a = answer.resolve_as(model, logits, "--answer")?;
    let w = wrong
        .map(|t| t.resolve_as(model, logits, "--wrong"))
        .transpose()?;
    if w == Some(a) {
        return Err(Error::OutOfRange {
            what: "--wrong".into(),
            value: a.to_string(),
            range: "a token other than --answer".into(),
        });
    }
    Ok((a, w))
}

/// The direction the final residual is read along: W_U[answer] (− W_U[wrong]).
fn readout_direction(model: &Model, a: u32, w: Option<u32>) -> Result<Vec<f32>> {
    let mut u = model.unembed_row(a)?;
    if let Some(w) = w {
        u.iter_mut()
            .zip(model.unembed_row(w)?)
            .for_each(|(x, y)| *x -= y);
    }
    Ok(u)
}

/// What a part of the final residual adds to the metric: `scale · Σ_i u_i γ_i c_i` for the
/// direction `u`, the final norm's gain γ, and its scale at the last position (LayerNorm centres
/// each part: the mean is linear).
struct Projection {
    /// the final norm's 1/RMS (or 1/σ) at the last position
    scale: f64,
    /// u ⊙ γ
    ug: Vec<f64>,
    /// whether the norm is a LayerNorm (parts are centred)
    layer_norm: bool,
}

impl Projection {
    /// The projection along `u` of the final residual `x`'s parts.
    fn new(model: &Model, u: &[f32], x: &[f32]) -> Projection {
        let (gain, bias, eps) = model.final_norm();
        let dm = model.dims.d_model;
        let layer_norm = bias.is_some();
        let xc = centred(x, layer_norm);
        let var = xc.iter().map(|v| v * v).sum::<f64>() / dm as f64;
        let scale = 1.0 / (var + eps as f64).sqrt();
        let ug: Vec<f64> = u
            .iter()
            .zip(gain)
            .map(|(&u, &g)| u as f64 * g as f64)
            .collect();
        Projection {
            scale,
            ug,
            layer_norm,
        }
    }

    /// What part `c` adds to the metric.
    fn part(&self, c: &[f32]) -> f32 {
        (self.scale
            * centred(c, self.layer_norm)
                .iter()
                .zip(&self.ug)
                .map(|(c, u)| c * u)
                .sum::<f64>()) as f32
    }
}

/// `v` in f64, less its mean when `layer_norm`.
fn centred(v: &[f32], layer_norm: bool) -> Vec<f64> {
    let m = if layer_norm {
        v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64
    } else {
        0.0
    };
    v.iter().map(|&x| x as f64 - m).collect()
}

/// Each layer's parts: every head's (from its `hook_z` at the last position, with its attention
/// row from `rows`), W_O's bias and the MLP's, each projected by `part`.
#[allow(clippy::type_complexity)]
fn layer_parts<'c>(
    model: &Model,
    rows: &Collector,
    last: &dyn Fn(usize, Hook) -> &'c [f32],
    part: &dyn Fn(&[f32]) -> f32,
) -> Result<(Vec<HeadPart>, Vec<f32>, Vec<f32>)> {
    let d = &model.dims;
    let (nh, hd, dm) = (d.n_heads, d.head_dim, d.d_model);
    let mut heads = Vec::with_capacity(d.n_layers * nh);
    let mut attn_bias = Vec::with_capacity(d.n_layers);
    let mut mlp = Vec::with_capacity(d.n_layers);
    for l in 0..d.n_layers {
        let z = last(l, Hook::Z);
        debug_assert_eq!(z.len(), nh * hd);
        let (results, b) = model.head_results(l, z, 1)?;
        for h in 0..nh {
            let row = rows.row(l, h);
            let (max_weight, argmax) = max_argmax(row);
            heads.push(HeadPart {
                layer: l,
                head: h,
                dla: part(&results[h * dm..(h + 1) * dm]),
                max_weight,
                argmax,
                sink: row[0],
            });
        }
        attn_bias.push(part(&b));
        mlp.push(part(last(l, Hook::MlpOut)));
    }
    Ok((heads, attn_bias, mlp))
}
