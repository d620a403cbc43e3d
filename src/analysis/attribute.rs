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

use super::faithfulness::{deletion_effects, Target};
use super::intervene::{last_query_attention, TokenRef};
use crate::model::backward::Metric;
use crate::model::forward::log_softmax;
use crate::model::{Error, Model, Result};
use serde::Serialize;

/// The most integrated-gradients steps accepted (each is a forward and a backward).
pub const MAX_STEPS: usize = 4096;

/// An attribution method.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// `‖∂f/∂x_i‖₂`.
    Gradient,
    /// `∂f/∂x_i · x_i`.
    GradXInput,
    /// Integrated gradients from the zero embedding, midpoint rule.
    IntegratedGradients,
    /// `Σ_l mean_h (∂f/∂A ⊙ A)⁺` on the last query's row (Chefer et al. 2021).
    AttentionXGradient,
    /// `f(text) − f(text without token i)`.
    Occlusion,
    /// AttnLRP's relevance of the target's logit (Achtibat et al. 2024).
    #[serde(rename = "attnlrp")]
    AttnLrp,
    /// Value zeroing's mixing into the last position, rolled out (Mohebbi et al. 2023).
    ValueZeroing,
    /// ALTI-Logit's decomposition of the target's logit (Ferrando et al. 2023).
    AltiLogit,
}

impl Method {
    /// Every method, in the order the help lists them.
    pub const ALL: [Method; 8] = [
        Method::Gradient,
        Method::GradXInput,
        Method::IntegratedGradients,
        Method::AttentionXGradient,
        Method::AttnLrp,
        Method::ValueZeroing,
        Method::AltiLogit,
        Method::Occlusion,
    ];

    /// The name on the command line and in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Method::Gradient => "gradient",
            Method::GradXInput => "grad-x-input",
            Method::IntegratedGradients => "integrated-gradients",
            Method::AttentionXGradient => "attention-x-gradient",
            Method::Occlusion => "occlusion",
            Method::AttnLrp => "attnlrp",
            Method::ValueZeroing => "value-zeroing",
            Method::AltiLogit => "alti-logit",
        }
    }
}

impl std::str::FromStr for Method {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Method::ALL
            .into_iter()
            .find(|m| m.name() == s || m.name().replace('-', "_") == s)
            .ok_or_else(|| {
                format!(
                    "unknown attribution method `{s}`; the methods are {}",
                    Method::ALL.map(Method::name).join(", ")
                )
            })
    }
}

/// What to attribute and how.
#[derive(Clone, Debug)]
pub struct AttributeOptions {
    pub method: Method,
    /// The token whose log-probability is explained (the answer of a logit difference).
    pub target: Target,
    /// Explain `logit(target) − logit(wrong)` instead of `log p(target)`.
    pub wrong: Option<Target>,
    /// Integrated gradients' midpoints (1..=[`MAX_STEPS`]); ignored by the other methods.
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
    pub model: String,
    pub precision: String,
    pub method: Method,
    /// The explained token (the answer of a logit difference); none on an encoder, which
    /// explains a vector (`encoder_target`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<TokenRef>,
    /// An encoder's target vector: `embedding` or `cls` (scores are `1 − cos`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encoder_target: Option<super::enc_target::EncoderTarget>,
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

/// How each method's score is formed (the report's `definition`).
pub fn definition(m: Method) -> &'static str {
    match m {
        Method::Gradient => "‖∂f/∂x_i‖₂ over the embedding width",
        Method::GradXInput => "Σ_d ∂f/∂x_{i,d} · x_{i,d}",
        Method::IntegratedGradients => {
            "Σ_d x_{i,d} · mean_k ∂f/∂x_{i,d}((k+½)/steps · x), from the zero embedding"
        }
        Method::AttentionXGradient => {
            "Σ_layers mean_heads max(0, ∂f/∂A · A) on the last query's row of each pattern A"
        }
        Method::Occlusion => "f(text) − f(text without token i)",
        Method::AttnLrp => {
            "Σ_d x_{i,d} · g_{i,d}, g the backward of f = the target's logit under AttnLRP's rules"
        }
        Method::ValueZeroing => {
            "the last row of the rollout of C[l]_{i,j} = cosine distance of i's layer output when j's values are zeroed, rows normalized (no target)"
        }
        Method::AltiLogit => {
            "Σ_l Δlogit^l_j (layer l's attention from source j onto the target's logit) carried to the input by ALTI's rollout"
        }
    }
}

/// `‖∂f/∂x_i‖₂` per row of a `[n, d_model]` gradient.
pub fn gradient_norms(grad: &[f32], d_model: usize) -> Vec<f32> {
    grad.chunks(d_model)
        .map(|r| r.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt() as f32)
        .collect()
}

/// `Σ_d ∂f/∂x_{i,d} · x_{i,d}` per row.
pub fn grad_times_input(grad: &[f32], input: &[f32], d_model: usize) -> Vec<f32> {
    grad.chunks(d_model)
        .zip(input.chunks(d_model))
        .map(|(g, x)| {
            g.iter()
                .zip(x)
                .map(|(&g, &x)| g as f64 * x as f64)
                .sum::<f64>() as f32
        })
        .collect()
}

/// Attention × gradient (Chefer et al. 2021) on the last query: `grad[l]` and `pattern[l]` are
/// layer l's `[n_heads, n]` last rows of `∂f/∂A` and `A`; per key
/// `Σ_l mean_h max(0, grad · A)`.
pub fn attention_times_gradient(grad: &[Vec<f32>], pattern: &[Vec<f32>], n: usize) -> Vec<f32> {
    let mut out = vec![0f64; n];
    for (g, p) in grad.iter().zip(pattern) {
        let heads = g.len() / n;
        for h in 0..heads {
            for j in 0..n {
                let v = g[h * n + j] as f64 * p[h * n + j] as f64;
                out[j] += v.max(0.0) / heads as f64;
            }
        }
    }
    out.into_iter().map(|v| v as f32).collect()
}

/// The metric `opts` asks for, its target resolved (the model's top token for `next`).
pub fn resolve_metric(
    model: &Model,
    tokens: &[u32],
    target: &Target,
    wrong: Option<&Target>,
) -> Result<Metric> {
    let logits = if matches!(target, Target::Next) || matches!(wrong, Some(Target::Next)) {
        model.next_token_logits(tokens)?
    } else {
        Vec::new()
    };
    let a = target.resolve(model, &logits)?;
    match wrong {
        None => Ok(Metric::LogProb(Some(a))),
        Some(w) => {
            let w = w.resolve_as(model, &logits, "--wrong")?;
            if w == a {
                return Err(Error::OutOfRange {
                    what: "--wrong".into(),
                    value: w.to_string(),
                    range: "a token other than the target".into(),
                });
            }
            Ok(Metric::LogitDiff {
                answer: a,
                wrong: w,
            })
        }
    }
}

/// Refuses a non-finite score, naming the method and the position.
fn finite(scores: &[f32], what: &str) -> Result<()> {
    match scores.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(Error::NonFinite {
            what: format!("the {what} score of position {i}"),
            layer: None,
        }),
        None => Ok(()),
    }
}

/// Integrated gradients of any metric from the zero input with `steps` midpoints:
/// (scores, completeness gap), from [`Model::integrated_gradients`].
pub fn integrated(
    model: &Model,
    tokens: &[u32],
    metric: Metric,
    steps: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<(Vec<f32>, f32)> {
    check_steps(steps)?;
    let ig = model.integrated_gradients(tokens, metric, steps, progress)?;
    Ok((ig.scores, ig.gap))
}

/// Refuses a number of integrated-gradients steps outside 1..=[`MAX_STEPS`].
pub fn check_steps(steps: usize) -> Result<()> {
    if steps == 0 || steps > MAX_STEPS {
        return Err(Error::OutOfRange {
            what: "--steps".into(),
            value: steps.to_string(),
            range: format!("1..={MAX_STEPS} (each step is a forward and a backward)"),
        });
    }
    Ok(())
}

/// The last query's pattern rows of every layer, `[L][n_heads, n]`.
pub fn last_rows(model: &Model, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
    let d = &model.dims;
    let rows = last_query_attention(model, tokens)?;
    Ok((0..d.n_layers)
        .map(|l| {
            (0..d.n_heads)
                .flat_map(|h| rows.row(l, h).to_vec())
                .collect()
        })
        .collect())
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
    let s = decoder_scores(model, tokens, opts, metric, progress)?;
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
        definition: definition(opts.method),
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

/// A decoder's scores by one method, with the metric's value and the method's extras.
struct DecoderScores {
    scores: Vec<f32>,
    logprob: f32,
    value: f32,
    /// Integrated gradients: the completeness gap and the midpoints.
    gap: Option<f32>,
    steps: Option<usize>,
    /// AttnLRP, value zeroing, ALTI-Logit: what [`super::mixing::scores_of`] reports.
    conservation_error: Option<f32>,
    layers: Option<Vec<Vec<f32>>>,
}

impl DecoderScores {
    /// Scores from one gradient-based method (no extras).
    fn plain(scores: Vec<f32>, logprob: f32, value: f32) -> Self {
        DecoderScores {
            scores,
            logprob,
            value,
            gap: None,
            steps: None,
            conservation_error: None,
            layers: None,
        }
    }

    /// Refuses a non-finite score or completeness gap.
    fn check_finite(&self, method: Method) -> Result<()> {
        finite(&self.scores, method.name())?;
        if let Some(g) = self.gap {
            if !g.is_finite() {
                return Err(Error::NonFinite {
                    what: "the integrated gradients' completeness gap".into(),
                    layer: None,
                });
            }
        }
        Ok(())
    }
}

/// Runs `opts.method` on a decoder for the resolved `metric`.
fn decoder_scores(
    model: &Model,
    tokens: &[u32],
    opts: &AttributeOptions,
    metric: Metric,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<DecoderScores> {
    let dm = model.dims.d_model;
    Ok(match opts.method {
        Method::AttnLrp | Method::ValueZeroing | Method::AltiLogit => {
            let m = super::mixing::scores_of(model, tokens, opts.method, metric, &mut *progress)?;
            DecoderScores {
                conservation_error: m.conservation_error,
                layers: m.layers,
                ..DecoderScores::plain(m.scores, m.logprob, m.value)
            }
        }
        Method::Occlusion => {
            let answer = match metric {
                Metric::LogProb(t) => t.expect("resolved"),
                Metric::LogitDiff { answer, .. } => answer,
            };
            let (value, deltas) = deletion_effects(model, tokens, metric, &mut *progress)?;
            let logits = model.next_token_logits(tokens)?;
            DecoderScores::plain(deltas, log_softmax(&logits)[answer as usize], value)
        }
        Method::IntegratedGradients => {
            let g = model.gradient(tokens, metric)?;
            let total = opts.steps;
            let (s, gp) = integrated(model, tokens, metric, total, &mut |k| progress(k, total))?;
            DecoderScores {
                gap: Some(gp),
                steps: Some(total),
                ..DecoderScores::plain(s, g.logprob, g.value)
            }
        }
        m => {
            let g = model.gradient(tokens, metric)?;
            let s = match m {
                Method::Gradient => gradient_norms(&g.grad_input, dm),
                Method::GradXInput => grad_times_input(&g.grad_input, &g.input, dm),
                _ => {
                    let pattern = last_rows(model, tokens)?;
                    attention_times_gradient(&g.grad_pattern_last, &pattern, tokens.len())
                }
            };
            DecoderScores::plain(s, g.logprob, g.value)
        }
    })
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

/// [`attribute`] on an encoder: occlusion by deletion of the sentence embedding or the [CLS]
/// vector (`1 − cos` to the text's); the other methods are refused, saying why.
fn attribute_encoder(
    model: &Model,
    tokens: &[u32],
    opts: &AttributeOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<AttributeReport> {
    use super::enc_target::{occlusion_cosines, EncoderTarget};
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norms_and_products_by_hand() {
        // two tokens, width 2: ‖(3, 4)‖ = 5, ‖(0, 1)‖ = 1; (3, 4)·(1, 2) = 11, (0, 1)·(5, -2) = -2
        let g = [3.0, 4.0, 0.0, 1.0];
        let x = [1.0, 2.0, 5.0, -2.0];
        assert_eq!(gradient_norms(&g, 2), vec![5.0, 1.0]);
        assert_eq!(grad_times_input(&g, &x, 2), vec![11.0, -2.0]);
    }

    #[test]
    fn attention_times_gradient_by_hand() {
        // one layer, two heads, three keys: products (0.5·0.2, −1·0.3, 2·0.5) and (1·0.6, 1·0.4, 0)
        // → clipped (0.1, 0, 1) and (0.6, 0.4, 0) → mean over heads (0.35, 0.2, 0.5)
        let g = vec![vec![0.5, -1.0, 2.0, 1.0, 1.0, 0.0]];
        let p = vec![vec![0.2, 0.3, 0.5, 0.6, 0.4, 0.0]];
        let s = attention_times_gradient(&g, &p, 3);
        let want = [0.35, 0.2, 0.5];
        for (a, b) in s.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{s:?}");
        }
        let g2 = vec![g[0].clone(), vec![0.0, 0.0, 1.0, 0.0, 0.0, -1.0]];
        let p2 = vec![p[0].clone(), vec![0.0, 0.0, 1.0, 0.0, 0.0, 1.0]];
        let s = attention_times_gradient(&g2, &p2, 3);
        // layer 2: head 0 gives 1 on key 2, head 1 gives −1 → clipped 0; mean 0.5; summed: 1.0
        assert!(
            (s[2] - 1.0).abs() < 1e-6 && (s[0] - 0.35).abs() < 1e-6,
            "{s:?}"
        );
    }

    #[test]
    fn methods_parse_by_name() {
        for m in Method::ALL {
            assert_eq!(m.name().parse::<Method>().unwrap(), m);
        }
        assert_eq!(
            "grad_x_input".parse::<Method>().unwrap(),
            Method::GradXInput
        );
        let e = "saliency".parse::<Method>().unwrap_err();
        assert!(
            e.contains("unknown") && e.contains("integrated-gradients"),
            "{e}"
        );
    }

    #[test]
    fn steps_are_bounded() {
        assert!(check_steps(0).is_err());
        assert!(check_steps(MAX_STEPS + 1).is_err());
        assert!(check_steps(1).is_ok() && check_steps(32).is_ok());
    }
}
