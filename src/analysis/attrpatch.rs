//! Attribution patching (Nanda 2023; Syed et al. 2023, issue #39 item 4): the first-order
//! estimate of activation patching, `(clean − corrupt) · ∂metric/∂activation` at the corrupted
//! run, for every layer × position of `hook_resid_pre`, `hook_attn_out` and `hook_mlp_out` and
//! every layer × head of `attn.hook_z`, from two forwards (clean, corrupt) and one backward (the
//! corrupted run's). The metric is the logit difference answer − wrong at the last position, as
//! [`super::intervene::patch`] scores the exact patching it approximates.

use super::vocab::{spearman, PatchCell, PatchHook};
use crate::model::backward::{LayerActs, Metric};
use crate::model::{Error, Model, Result};
use serde::Serialize;

/// One estimate: the change of the logit difference if the activation were taken from the
/// clean run.
#[derive(Clone, Debug, Serialize)]
pub struct ApproxCell {
    pub layer: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pos: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head: Option<usize>,
    /// `(clean − corrupt) · ∂(logit diff)/∂activation`, summed over the cell's values
    pub estimate: f32,
    /// `estimate / (clean − corrupt logit difference)`: the share of the difference the
    /// estimate says the patch restores (comparable with the exact patching's `recovered`)
    pub recovered: f32,
}

/// The estimates of one hook point.
#[derive(Clone, Debug, Serialize)]
pub struct ApproxKind {
    /// `hook_resid_pre`, `hook_attn_out`, `hook_mlp_out` or `attn.hook_z`
    pub hook: String,
    /// layer-major: per layer every position (per head for z)
    pub results: Vec<ApproxCell>,
}

/// Attribution patching of a clean/corrupted pair.
#[derive(Clone, Debug, Serialize)]
pub struct ApproxReport {
    pub clean_logit_diff: f32,
    pub corrupt_logit_diff: f32,
    /// resid_pre, attn_out, mlp_out, z
    pub kinds: Vec<ApproxKind>,
    pub forward_passes: usize,
    pub backward_passes: usize,
}

/// How the estimates agree with the exact patching of the same hook.
#[derive(Clone, Debug, Serialize)]
pub struct Agreement {
    pub hook: String,
    /// cells compared
    pub n: usize,
    /// Pearson's r of the estimated and the exact `recovered`
    pub pearson: Option<f64>,
    /// Spearman's ρ of the same
    pub spearman: Option<f64>,
    /// the largest |estimate − exact| of `recovered`
    pub max_abs_error: f32,
}

/// The hook names of [`ApproxReport::kinds`], in order.
pub const APPROX_HOOKS: [&str; 4] = [
    "hook_resid_pre",
    "hook_attn_out",
    "hook_mlp_out",
    "attn.hook_z",
];

impl ApproxReport {
    /// The estimates of the hook `patch` would patch (`None` for the pattern: not estimated).
    pub fn kind(&self, hook: PatchHook) -> Option<&ApproxKind> {
        let name = match hook {
            PatchHook::ResidPre => APPROX_HOOKS[0],
            PatchHook::AttnOut => APPROX_HOOKS[1],
            PatchHook::MlpOut => APPROX_HOOKS[2],
            PatchHook::Z => APPROX_HOOKS[3],
            PatchHook::Pattern => return None,
        };
        self.kinds.iter().find(|k| k.hook == name)
    }
}

/// Attribution patching of `clean` and `corrupt` (the same number of tokens), for the logit
/// difference `answer − wrong` at the last position.
pub fn attribution_patch(
    model: &Model,
    clean: &[u32],
    corrupt: &[u32],
    answer: u32,
    wrong: u32,
) -> Result<ApproxReport> {
    check_pair(clean, corrupt)?;
    let metric = Metric::LogitDiff { answer, wrong };
    let c = model.activation_gradients(clean, metric, false)?;
    let x = model.activation_gradients(corrupt, metric, true)?;
    let diff = |lg: &[f32]| lg[answer as usize] - lg[wrong as usize];
    let (clean_diff, corrupt_diff) = (diff(&c.logits), diff(&x.logits));
    let est = Estimator {
        n: clean.len(),
        nh: model.dims.n_heads,
        hd: model.dims.head_dim,
        span: clean_diff - corrupt_diff,
    };
    let mut kinds = Vec::with_capacity(4);
    for (k, name) in APPROX_HOOKS.iter().enumerate() {
        let mut results = Vec::new();
        for (l, ((ca, xa), g)) in c.acts.iter().zip(&x.acts).zip(&x.grads).enumerate() {
            let (ca, xa, g) = (hook_values(ca, k), hook_values(xa, k), hook_values(g, k));
            if k == 3 {
                est.head_cells(l, ca, xa, g, &mut results);
            } else {
                est.position_cells(l, ca, xa, g, &mut results);
            }
        }
        kinds.push(ApproxKind {
            hook: name.to_string(),
            results,
        });
    }
    Ok(ApproxReport {
        clean_logit_diff: clean_diff,
        corrupt_logit_diff: corrupt_diff,
        kinds,
        forward_passes: 2,
        backward_passes: 1,
    })
}

/// Refuses a corrupted text of another token count than the clean one, or an empty pair.
fn check_pair(clean: &[u32], corrupt: &[u32]) -> Result<()> {
    let n = clean.len();
    if corrupt.len() != n || n == 0 {
        return Err(Error::OutOfRange {
            what: "the corrupted text's token count".into(),
            value: corrupt.len().to_string(),
            range: format!("{n} (the clean text's): attribution patching pairs positions"),
        });
    }
    Ok(())
}

/// The values of [`APPROX_HOOKS`]`[k]` in one layer's `(resid_pre, z, attn_out, mlp_out)`.
fn hook_values(t: &LayerActs, k: usize) -> &[f32] {
    match k {
        0 => &t.0,
        1 => &t.2,
        2 => &t.3,
        _ => &t.1,
    }
}

/// `Σ (a − b) · g`, in f64.
fn diff_dot(a: &[f32], b: &[f32], g: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .zip(g)
        .map(|((a, b), g)| (*a as f64 - *b as f64) * *g as f64)
        .sum::<f64>() as f32
}

/// The estimates of one layer's hook from the clean (`ca`) and corrupted (`xa`) activations and
/// the corrupted run's gradient `g`, each `[n, width]`.
struct Estimator {
    n: usize,
    nh: usize,
    hd: usize,
    /// clean − corrupt logit difference
    span: f32,
}

impl Estimator {
    fn cell(&self, layer: usize, pos: Option<usize>, head: Option<usize>, e: f32) -> ApproxCell {
        ApproxCell {
            layer,
            pos,
            head,
            estimate: e,
            recovered: e / self.span,
        }
    }

    /// One cell per head of `hook_z` (`[n, heads·head_dim]`), summed over the positions.
    fn head_cells(&self, l: usize, ca: &[f32], xa: &[f32], g: &[f32], out: &mut Vec<ApproxCell>) {
        let (nh, hd) = (self.nh, self.hd);
        for h in 0..nh {
            let mut e = 0f32;
            for p in 0..self.n {
                let at = (p * nh + h) * hd..(p * nh + h + 1) * hd;
                e += diff_dot(&ca[at.clone()], &xa[at.clone()], &g[at]);
            }
            out.push(self.cell(l, None, Some(h), e));
        }
    }

    /// One cell per position of a residual-width hook.
    fn position_cells(
        &self,
        l: usize,
        ca: &[f32],
        xa: &[f32],
        g: &[f32],
        out: &mut Vec<ApproxCell>,
    ) {
        let w = ca.len() / self.n;
        for p in 0..self.n {
            let at = p * w..(p + 1) * w;
            let e = diff_dot(&ca[at.clone()], &xa[at.clone()], &g[at]);
            out.push(self.cell(l, Some(p), None, e));
        }
    }
}

fn pearson(a: &[f64], b: &[f64]) -> Option<f64> {
    let n = a.len() as f64;
    if a.len() < 2 {
        return None;
    }
    let (ma, mb) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
    let cov: f64 = a.iter().zip(b).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let va: f64 = a.iter().map(|x| (x - ma).powi(2)).sum();
    let vb: f64 = b.iter().map(|y| (y - mb).powi(2)).sum();
    (va > 0.0 && vb > 0.0).then(|| cov / (va * vb).sqrt())
}

/// How `approx` agrees with the exact patching `exact` of the same hook (cells matched by
/// layer and position or head).
pub fn agreement(exact: &[PatchCell], approx: &ApproxKind) -> Agreement {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let mut worst = 0f32;
    for e in exact {
        let m = approx
            .results
            .iter()
            .find(|c| c.layer == e.layer && c.pos == e.pos && c.head == e.head);
        if let Some(m) = m.filter(|m| m.recovered.is_finite() && e.recovered.is_finite()) {
            a.push(m.recovered as f64);
            b.push(e.recovered as f64);
            worst = worst.max((m.recovered - e.recovered).abs());
        }
    }
    Agreement {
        hook: approx.hook.clone(),
        n: a.len(),
        pearson: pearson(&a, &b),
        spearman: spearman(&a, &b),
        max_abs_error: worst,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pearson_by_hand() {
        // a perfect line, its reverse, and a constant side
        let a = [1.0, 2.0, 3.0, 4.0];
        assert!((pearson(&a, &[2.0, 4.0, 6.0, 8.0]).unwrap() - 1.0).abs() < 1e-12);
        assert!((pearson(&a, &[4.0, 3.0, 2.0, 1.0]).unwrap() + 1.0).abs() < 1e-12);
        assert!(pearson(&a, &[1.0; 4]).is_none());
        // by hand: a = (1, 2, 3), b = (1, 3, 2): cov 1, var 2 and 2 → 0.5
        assert!((pearson(&[1.0, 2.0, 3.0], &[1.0, 3.0, 2.0]).unwrap() - 0.5).abs() < 1e-12);
    }
}
