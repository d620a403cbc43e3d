//! Per-token attribution of the last position's prediction (issue #39): how much each input token
//! contributes to a scalar `f` of the last position's logits (`log p(target)`, or a logit
//! difference), by five methods.
//!
//! - `gradient`: `‖∂f/∂x_i‖₂` over the embedding width [Simonyan et al. 2014, arXiv:1312.6034].
//! - `grad-x-input`: `Σ_d ∂f/∂x_{i,d} · x_{i,d}` [Shrikumar et al. 2016, arXiv:1605.01713].
//! - `integrated-gradients`: `Σ_d x_{i,d} · mean_k ∂f/∂x_{i,d}(α_k x)`, `α_k = (k + ½)/steps`,
//!   from the zero embedding [Sundararajan et al. 2017, arXiv:1703.01365]; the completeness gap
//!   `Σ_i score_i − (f(x) − f(0))` says how far the midpoint sum is from the integral.
//! - `attention-x-gradient`: per layer and head, `(∂f/∂A ⊙ A)` on the last query's row of the
//!   pattern `A`, its negative part clipped, averaged over heads and summed over layers:
//!   `score_j = Σ_l mean_h max(0, ∂f/∂A^{l,h}_{q,j} · A^{l,h}_{q,j})` [Chefer et al. 2021,
//!   arXiv:2103.15679]: their `Ā = E_h[(∇A ⊙ A)⁺]` of every layer, on the last query's row, added
//!   up across layers (the first-order term of their rollout, without its identity).
//! - `occlusion`: `f(text) − f(text without token i)` (deletion, as `faithfulness`'s
//!   leave-one-out) [Zeiler & Fergus 2014, arXiv:1311.2901].
//! - `attnlrp`: AttnLRP's relevance of the target's logit [Achtibat et al. 2024,
//!   arXiv:2402.05602], a modified backward ([`crate::model::lrp`]); its conservation error
//!   `Σ_i R_i − logit` is printed.
//! - `value-zeroing`: how much zeroing token i's values changes the last position's output,
//!   rolled out across layers [Mohebbi et al. 2023, arXiv:2301.12971]; target-independent.
//! - `alti-logit`: the target's logit decomposed through each layer's token-to-token
//!   contributions [Ferrando et al. 2023, arXiv:2305.12535] ([`super::mixing`]).
//!
//! The input `x` is what enters layer 0 (the token embeddings, times Gemma's scale, plus GPT-2's
//! positions). Every score here comes from one forward and backward of the engine
//! ([`Model::gradient`]), or from forwards alone (occlusion).

use super::enc_target::{occlusion_cosines, EncoderTarget};
use super::scores::{check_steps, decoder_scores, finite, resolve_metric};
use super::vocab::{Method, Target, TokenRef};
use crate::model::backward::Metric;
use crate::model::{Error, Model, Result};
use serde::Serialize;

/// What to attribute and how.
#[derive(Clone, Debug)]
pub struct AttributeOptions {
    /// the attribution method
    pub method: Method,
    /// The token whose log-probability is explained (the answer of a logit difference).
    pub target: Target,
    /// Explain `logit(target) − logit(wrong)` instead of `log p(target)`.
    pub wrong: Option<Target>,
    /// Integrated gradients' midpoints (1..=[`super::scores::MAX_STEPS`]); ignored by the other methods.
    pub steps: usize,
}

/// One input token's score.
#[derive(Clone, Debug, Serialize)]
pub struct TokenScore {
    pub pos: usize,
    pub id: u32,
    pub text: String,
    pub score: f32,
}

/// An attribution: a score per input token, with the explained metric.
#[derive(Clone, Debug, Serialize)]
pub struct AttributeReport {
    /// the model's name
    pub model: String,
    /// the precision it ran at (`exact` or `fast`)
    pub precision: String,
    /// the attribution method
    pub method: Method,
    /// The explained token (the answer of a logit difference); none on an encoder, which
    /// explains a vector (`encoder_target`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<TokenRef>,
    /// An encoder's target vector: `embedding` or `cls` (scores are `1 − cos`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encoder_target: Option<EncoderTarget>,
    /// the wrong token of a logit difference, when one is explained
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wrong: Option<TokenRef>,
    /// `log p(target | text)` at the last position (none on an encoder).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprob: Option<f32>,
    /// What is explained: `logprob`, `logit` (AttnLRP, ALTI-Logit), `logit_diff`, `none`
    /// (value zeroing, which measures mixing into the last position, for no target), or
    /// `cosine` (an encoder: the cosine similarity of a variant's vector to the text's; `value`
    /// is then 1, the text's own).
    pub metric: &'static str,
    /// Its value on the text.
    pub value: f32,
    /// each input token's score
    pub tokens: Vec<TokenScore>,
    /// Integrated gradients: `Σ scores − (f(x) − f(0))`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completeness_gap: Option<f32>,
    /// Integrated gradients: the midpoints.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<usize>,
    /// AttnLRP: `Σ scores − f` (what the rules did not carry to the input).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conservation_error: Option<f32>,
    /// Value zeroing: each layer's mixing into the last position (the last row of its `C`);
    /// ALTI-Logit: each layer's logit updates carried back to the input tokens. `[L][n]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layers: Option<Vec<Vec<f32>>>,
    /// How the scores are formed, in words.
    pub definition: &'static str,
}

/// Attributes the last position's prediction to each token of `tokens` by `opts.method`.
/// `progress(done, total)` reports integrated gradients' steps or occlusion's forwards.
pub fn attribute(
    model: &Model,
    tokens: &[u32],
    opts: &AttributeOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<AttributeReport> {
    check_request(tokens, opts)?;
    if model.is_encoder() {
        return attribute_encoder(model, tokens, opts, progress);
    }
    let metric = resolve_metric(model, tokens, &opts.target, opts.wrong.as_ref())?;
    let (answer, wrong) = match metric {
        Metric::LogProb(t) => (t.expect("resolved"), None),
        Metric::LogitDiff { answer, wrong } => (answer, Some(wrong)),
    };
    let s = decoder_scores(model, tokens, opts.method, opts.steps, metric, progress)?;
    s.check_finite(opts.method)?;
    Ok(AttributeReport {
        model: model.info.name.clone(),
        precision: model.info.precision.name().into(),
        method: opts.method,
        target: Some(TokenRef::of(model, answer)),
        encoder_target: None,
        wrong: wrong.map(|w| TokenRef::of(model, w)),
        logprob: Some(s.logprob),
        metric: metric_name(opts.method, wrong.is_some()),
        value: s.value,
        tokens: token_scores(model, tokens, s.scores),
        completeness_gap: s.gap,
        steps: s.steps,
        conservation_error: s.conservation_error,
        layers: s.layers,
        definition: opts.method.definition(),
    })
}

/// Refuses an empty text, and integrated gradients' steps out of range.
fn check_request(tokens: &[u32], opts: &AttributeOptions) -> Result<()> {
    if tokens.is_empty() {
        return Err(Error::OutOfRange {
            what: "text".into(),
            value: "0 tokens".into(),
            range: "at least one token".into(),
        });
    }
    if opts.method == Method::IntegratedGradients {
        check_steps(opts.steps)?;
    }
    Ok(())
}

/// The report's `metric`: what a decoder's method explains.
fn metric_name(method: Method, has_wrong: bool) -> &'static str {
    match (method, has_wrong) {
        (Method::ValueZeroing, _) => "none",
        (_, true) => "logit_diff",
        (Method::AttnLrp | Method::AltiLogit, false) => "logit",
        _ => "logprob",
    }
}

/// Each token of `tokens` with its score.
fn token_scores(model: &Model, tokens: &[u32], scores: Vec<f32>) -> Vec<TokenScore> {
    tokens
        .iter()
        .zip(scores)
        .enumerate()
        .map(|(pos, (&id, score))| TokenScore {
            pos,
            id,
            text: model.tokenizer.token_text(id),
            score,
        })
        .collect()
}

/// [`attribute`] on an encoder: occlusion by deletion of the sentence embedding or the \[CLS\]
/// vector (`1 − cos` to the text's); the other methods are refused, saying why.
fn attribute_encoder(
    model: &Model,
    tokens: &[u32],
    opts: &AttributeOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<AttributeReport> {
    let why = match opts.method {
        Method::Occlusion => None,
        Method::ValueZeroing => Some(
            "value zeroing reads how the context mixes into the last position, which predicts the next token in a decoder",
        ),
        Method::AttnLrp | Method::AltiLogit => {
            Some("it explains a next-token logit, which an encoder does not have")
        }
        _ => Some("attnscope's backward is decoder-only (it differentiates a next-token log-probability)"),
    };
    if let Some(why) = why {
        return Err(Error::NotApplicable(format!(
            "--method {} is not available on an encoder ({}): {why}; use --method occlusion, which needs forwards only (--target embedding or cls)",
            opts.method.name(),
            model.info.name
        )));
    }
    if opts.wrong.is_some() {
        return Err(Error::NotApplicable(format!(
            "--wrong asks for a logit difference of two next tokens; {} is an encoder (its targets are `embedding` and `cls`)",
            model.info.name
        )));
    }
    let target = EncoderTarget::of(model, &opts.target)?;
    let cos = occlusion_cosines(model, tokens, target, progress)?;
    let scores: Vec<f32> = cos.iter().map(|&c| (1.0 - c) as f32).collect();
    finite(&scores, opts.method.name())?;
    Ok(AttributeReport {
        model: model.info.name.clone(),
        precision: model.info.precision.name().into(),
        method: opts.method,
        target: None,
        encoder_target: Some(target),
        wrong: None,
        logprob: None,
        metric: "cosine",
        value: 1.0,
        tokens: token_scores(model, tokens, scores),
        completeness_gap: None,
        steps: None,
        conservation_error: None,
        layers: None,
        definition: match target {
            EncoderTarget::Embedding => {
                "1 − cos(embedding of the text without token i, embedding of the text); embedding: the last hidden states mean-pooled (as sentence-transformers)"
            }
            EncoderTarget::Cls => {
                "1 − cos([CLS] vector of the text without token i, [CLS] vector of the text); the [CLS] vector: the first token's last hidden state"
            }
        },
    })
}
