//! Each attribution method's scores on a decoder: what `attribute` reports for one method
//! ([`decoder_scores`]) and what `faithfulness` ranks by ([`ranked_scores`]), from the same
//! functions. A method is named in [`super::vocab::Method`] and computed here.

use super::collect::last_query_attention;
use super::occlusion::deletion_effects;
use super::vocab::{ByMethod, Method, Target};
use crate::model::backward::Metric;
use crate::model::forward::log_softmax;
use crate::model::{Error, Model, Result};

/// The most integrated-gradients steps accepted (each is a forward and a backward).
pub const MAX_STEPS: usize = 4096;

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
pub fn finite(scores: &[f32], what: &str) -> Result<()> {
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

/// A decoder's scores by one method, with the metric's value and the method's extras.
pub struct DecoderScores {
    pub scores: Vec<f32>,
    pub logprob: f32,
    pub value: f32,
    /// Integrated gradients: the completeness gap and the midpoints.
    pub gap: Option<f32>,
    pub steps: Option<usize>,
    /// AttnLRP, value zeroing, ALTI-Logit: what [`super::mixing::scores_of`] reports.
    pub conservation_error: Option<f32>,
    pub layers: Option<Vec<Vec<f32>>>,
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
    pub fn check_finite(&self, method: Method) -> Result<()> {
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

/// Runs `method` on a decoder for the resolved `metric` (integrated gradients with `steps`
/// midpoints); `progress(done, total)` reports integrated gradients' steps or occlusion's and
/// value zeroing's forwards.
pub fn decoder_scores(
    model: &Model,
    tokens: &[u32],
    method: Method,
    steps: usize,
    metric: Metric,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<DecoderScores> {
    let dm = model.dims.d_model;
    Ok(match method {
        Method::AttnLrp | Method::ValueZeroing | Method::AltiLogit => {
            let m = super::mixing::scores_of(model, tokens, method, metric, &mut *progress)?;
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
            let total = steps;
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

/// The scores `faithfulness` ranks by, for its target: one per method it ranks by.
pub struct RankedScores {
    /// Each method's score per position, in [`Method::ALL`]'s order.
    pub scores: ByMethod<Vec<f32>>,
    /// Integrated gradients' completeness gap, when they ran.
    pub ig_gap: Option<f32>,
    /// AttnLRP's conservation error.
    pub lrp_err: Option<f32>,
}

/// Every method of [`Method::ALL`] that `faithfulness` ranks by, for `log p(target_id)`:
/// gradient, gradient × input and attention × gradient from one backward (`pattern`: every
/// layer's `[n_heads, n]` last rows of the full run's patterns), integrated gradients when
/// `ig_steps` > 0, and AttnLRP, value zeroing and ALTI-Logit ([`super::mixing::rankings`]).
pub fn ranked_scores(
    model: &Model,
    tokens: &[u32],
    pattern: &[Vec<f32>],
    ig_steps: usize,
    target_id: u32,
) -> Result<RankedScores> {
    let (n, dm) = (tokens.len(), model.dims.d_model);
    let metric = Metric::LogProb(Some(target_id));
    let g = model.gradient(tokens, metric)?;
    let mut ig_gap = None;
    let mut mixing = None;
    let mut scores = ByMethod::default();
    for m in Method::ALL
        .into_iter()
        .filter(|m| m.ranked_by_faithfulness())
    {
        let s = match m {
            Method::Gradient => gradient_norms(&g.grad_input, dm),
            Method::GradXInput => grad_times_input(&g.grad_input, &g.input, dm),
            Method::AttentionXGradient => {
                attention_times_gradient(&g.grad_pattern_last, pattern, n)
            }
            Method::IntegratedGradients if ig_steps > 0 => {
                let (s, gap) = integrated(model, tokens, metric, ig_steps, &mut |_| {})?;
                ig_gap = Some(gap);
                s
            }
            Method::IntegratedGradients | Method::Occlusion => continue,
            Method::AttnLrp | Method::ValueZeroing | Method::AltiLogit => {
                if mixing.is_none() {
                    mixing = Some(super::mixing::rankings(model, tokens, target_id)?);
                }
                let (lrp, vz, alti) = mixing.as_ref().expect("just computed");
                match m {
                    Method::AttnLrp => lrp.scores.clone(),
                    Method::ValueZeroing => vz.clone(),
                    _ => alti.clone(),
                }
            }
        };
        scores.insert(m, s);
    }
    let lrp_err = mixing.map(|(lrp, _, _)| lrp.conservation_error);
    Ok(RankedScores {
        scores,
        ig_gap,
        lrp_err,
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
    fn steps_are_bounded() {
        assert!(check_steps(0).is_err());
        assert!(check_steps(MAX_STEPS + 1).is_err());
        assert!(check_steps(1).is_ok() && check_steps(32).is_ok());
    }
}
