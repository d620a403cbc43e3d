//! The row-wise backward: the norms (RMSNorm, LayerNorm) and their AttnLRP identity rule, and the
//! activations' derivatives.

use super::Rules;
use crate::model::block::NormKind;
use crate::model::ops::{gelu_tanh_of, layer_norm, rms_norm};
use rayon::prelude::*;

/// A norm of each `[w.len()]` row of `x` (LayerNorm's bias 0 where it has none).
pub(super) fn norm_fwd(
    kind: NormKind,
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    eps: f32,
) -> Vec<f32> {
    match (kind, b) {
        (NormKind::Layer, Some(b)) => layer_norm(x, w, b, eps),
        (NormKind::Layer, None) => layer_norm(x, w, &vec![0f32; w.len()], eps),
        (NormKind::Rms, _) => rms_norm(x, w, eps),
    }
}

/// `f(x row, g row, dx row)` on each `[w.len()]` row of `x`, in parallel, with `g = dy ⊙ w` in
/// f64: a norm's backward (its rows independent), `dx` as `f` writes it.
fn norm_rows(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    f: impl Fn(&[f32], &[f64], &mut [f32]) + Sync,
) -> Vec<f32> {
    let d = w.len();
    let mut dx = vec![0f32; x.len()];
    let rows = x
        .par_chunks(d)
        .zip(dy.par_chunks(d))
        .zip(dx.par_chunks_mut(d));
    rows.for_each(|((xr, dyr), dxr)| {
        let g: Vec<f64> = dyr
            .iter()
            .zip(w)
            .map(|(&a, &b)| a as f64 * b as f64)
            .collect();
        f(xr, &g, dxr)
    });
    dx
}

/// A row's norm scale `1/√(var + ε)` (the mean square for RMSNorm) and its mean (0 for RMSNorm,
/// which does not subtract it), as the forward computes them.
fn row_scale(kind: NormKind, xr: &[f32], eps: f32) -> (f64, f64) {
    let d = xr.len() as f64;
    match kind {
        NormKind::Rms => {
            let ms = xr.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / d;
            (1.0 / ((ms as f32 + eps) as f64).sqrt(), 0.0)
        }
        NormKind::Layer => {
            let mean = xr.iter().map(|&v| v as f64).sum::<f64>() / d;
            let var = xr.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / d;
            (1.0 / ((var as f32 + eps) as f64).sqrt(), mean)
        }
    }
}

/// The backward of a norm of each `[w.len()]` row of `x`: `dx` from `dy`.
pub fn norm_backward(kind: NormKind, x: &[f32], w: &[f32], eps: f32, dy: &[f32]) -> Vec<f32> {
    let d = w.len() as f64;
    norm_rows(x, w, dy, |xr, g, dxr| {
        let (inv, mean) = row_scale(kind, xr, eps);
        match kind {
            NormKind::Rms => {
                let gx = g.iter().zip(xr).map(|(g, &x)| g * x as f64).sum::<f64>() / d;
                for ((o, &gi), &xi) in dxr.iter_mut().zip(g).zip(xr) {
                    *o = (inv * gi - inv * inv * inv * xi as f64 * gx) as f32;
                }
            }
            NormKind::Layer => {
                let xh: Vec<f64> = xr.iter().map(|&v| (v as f64 - mean) * inv).collect();
                let mg = g.iter().sum::<f64>() / d;
                let mgx = g.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / d;
                for ((o, &gi), &xi) in dxr.iter_mut().zip(g).zip(&xh) {
                    *o = (inv * (gi - mg - xi * mgx)) as f32;
                }
            }
        }
    })
}

/// The gradients at TransformerLens's two hook points inside a norm, from `dy` (`∂/∂` the
/// norm's output) of each `[w.len()]` row of `x`: `(∂/∂hook_scale [rows], ∂/∂hook_normalized
/// [rows, d])`. The forward computes `normalized = x̂ / scale` (`x̂ = x`, or `x − mean` for
/// LayerNorm; `scale = √(mean x̂² + ε)`), then `normalized ⊙ w (+ b)`: so `∂/∂normalized = dy ⊙ w`
/// and `∂/∂scale = −Σ ∂/∂normalized · normalized / scale` (the scale as a hook point's output,
/// read only by the division).
pub fn norm_hook_grads(
    kind: NormKind,
    x: &[f32],
    w: &[f32],
    eps: f32,
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let d = w.len();
    let mut dn = vec![0f32; x.len()];
    let ds = x
        .par_chunks(d)
        .zip(dy.par_chunks(d))
        .zip(dn.par_chunks_mut(d))
        .map(|((xr, dyr), dnr)| {
            let (inv, mean) = row_scale(kind, xr, eps);
            let mut acc = 0f64;
            for ((o, (&g, &wi)), &xi) in dnr.iter_mut().zip(dyr.iter().zip(w)).zip(xr) {
                let gn = g as f64 * wi as f64;
                *o = gn as f32;
                acc += gn * (xi as f64 - mean) * inv;
            }
            (-acc * inv) as f32
        })
        .collect();
    (ds, dn)
}

/// A norm's backward under `rules`: the true one ([`norm_backward`]), or AttnLRP's identity
/// rule ([`norm_identity`]).
pub(super) fn norm_back(
    rules: Rules,
    kind: NormKind,
    x: &[f32],
    w: &[f32],
    eps: f32,
    dy: &[f32],
) -> Vec<f32> {
    match rules {
        Rules::Gradient => norm_backward(kind, x, w, eps, dy),
        Rules::AttnLrp => norm_identity(kind, x, w, eps, dy),
    }
}

/// AttnLRP's identity rule on a norm of each `[w.len()]` row of `x`, as a gradient: the norm
/// with its scale `1/√(var + ε)` held constant (the mean's subtraction of a LayerNorm stays, a
/// linear map), so `dx = (dy ⊙ w)/σ` (RMSNorm) or `(g − mean g)/σ` with `g = dy ⊙ w`.
pub fn norm_identity(kind: NormKind, x: &[f32], w: &[f32], eps: f32, dy: &[f32]) -> Vec<f32> {
    let d = w.len() as f64;
    norm_rows(x, w, dy, |xr, g, dxr| {
        let (inv, _) = row_scale(kind, xr, eps);
        let mg = match kind {
            NormKind::Rms => 0.0,
            NormKind::Layer => g.iter().sum::<f64>() / d,
        };
        for (o, &gi) in dxr.iter_mut().zip(g) {
            *o = (inv * (gi - mg)) as f32;
        }
    })
}

/// `gelu_tanh(x)/x` (AttnLRP's identity rule on the activation), `½` at 0 (its limit).
pub(super) fn gelu_ratio(x: f32) -> f32 {
    if x == 0.0 {
        0.5
    } else {
        gelu_tanh_of(x) / x
    }
}

/// The logistic function, in f64.
pub(super) fn sigmoid(x: f32) -> f32 {
    let x = x as f64;
    (1.0 / (1.0 + (-x).exp())) as f32
}

/// d gelu_tanh(x) / dx.
pub(super) fn gelu_tanh_grad(x: f32) -> f32 {
    const C: f32 = 0.797_884_6;
    let u = C * (x + 0.044_715 * x * x * x);
    let t = u.tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * C * (1.0 + 3.0 * 0.044_715 * x * x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_backward_matches_finite_differences() {
        let d = 8;
        let x: Vec<f32> = (0..2 * d)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.3)
            .collect();
        let w: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 * 0.1).collect();
        let b = vec![0.1f32; d];
        let dy: Vec<f32> = (0..2 * d)
            .map(|i| ((i * 3 % 5) as f32 - 2.0) * 0.7)
            .collect();
        for kind in [NormKind::Rms, NormKind::Layer] {
            let f = |x: &[f32]| -> f64 {
                norm_fwd(kind, x, &w, Some(&b), 1e-6)
                    .iter()
                    .zip(&dy)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum()
            };
            let g = norm_backward(kind, &x, &w, 1e-6, &dy);
            for i in 0..x.len() {
                let h = 1e-2;
                let (mut a, mut c) = (x.clone(), x.clone());
                a[i] += h;
                c[i] -= h;
                let fd = (f(&a) - f(&c)) / (2.0 * h as f64);
                assert!(
                    (fd - g[i] as f64).abs() < 2e-3,
                    "{kind:?} {i}: {fd} vs {}",
                    g[i]
                );
            }
        }
    }

    #[test]
    fn norm_hook_gradients_match_finite_differences_in_the_scale() {
        // the output as a function of the hook's scale s (x̂ held): y = (x̂ / s) ⊙ w + b
        let d = 6;
        let x: Vec<f32> = (0..2 * d)
            .map(|i| ((i * 5 % 7) as f32 - 3.0) * 0.4)
            .collect();
        let w: Vec<f32> = (0..d).map(|i| 0.6 + i as f32 * 0.15).collect();
        let dy: Vec<f32> = (0..2 * d)
            .map(|i| ((i * 3 % 4) as f32 - 1.5) * 0.9)
            .collect();
        for kind in [NormKind::Rms, NormKind::Layer] {
            let (ds, dn) = norm_hook_grads(kind, &x, &w, 1e-6, &dy);
            assert_eq!((ds.len(), dn.len()), (2, 2 * d));
            for r in 0..2 {
                let xr = &x[r * d..(r + 1) * d];
                let (inv, mean) = row_scale(kind, xr, 1e-6);
                let f = |s: f64| -> f64 {
                    (0..d)
                        .map(|i| (xr[i] as f64 - mean) / s * w[i] as f64 * dy[r * d + i] as f64)
                        .sum()
                };
                let (s, h) = (1.0 / inv, 1e-4);
                let fd = (f(s + h) - f(s - h)) / (2.0 * h);
                assert!(
                    (fd - ds[r] as f64).abs() < 1e-4,
                    "{kind:?} row {r}: {fd} vs {}",
                    ds[r]
                );
                for i in 0..d {
                    assert_eq!(dn[r * d + i], dy[r * d + i] * w[i]);
                }
            }
        }
    }

    #[test]
    fn attnlrp_identity_rules_by_hand() {
        // RMSNorm of (3, 4), w = (1, 2), ε = 0: scale 1/√12.5 held; dy = (1, 1) → (1, 2)/√12.5
        let inv = 1.0 / 12.5f32.sqrt();
        let dx = norm_identity(NormKind::Rms, &[3.0, 4.0], &[1.0, 2.0], 0.0, &[1.0, 1.0]);
        assert!(
            (dx[0] - inv).abs() < 1e-6 && (dx[1] - 2.0 * inv).abs() < 1e-6,
            "{dx:?}"
        );
        // LayerNorm of (1, 3): mean 2, σ 1; w = 1, dy = (2, 0) → g − mean g = (1, −1)
        let dx = norm_identity(NormKind::Layer, &[1.0, 3.0], &[1.0, 1.0], 0.0, &[2.0, 0.0]);
        assert!(
            (dx[0] - 1.0).abs() < 1e-6 && (dx[1] + 1.0).abs() < 1e-6,
            "{dx:?}"
        );
        // with the scale held, relevance in = relevance out: Σ x·dx = Σ y·dy (RMS, no ε)
        let (x, w, dy) = (
            [0.5f32, -1.5, 2.0],
            [0.7f32, 1.1, -0.4],
            [0.3f32, -0.8, 1.9],
        );
        let y = rms_norm(&x, &w, 0.0);
        let dx = norm_identity(NormKind::Rms, &x, &w, 0.0, &dy);
        let r_in: f32 = x.iter().zip(&dx).map(|(a, b)| a * b).sum();
        let r_out: f32 = y.iter().zip(&dy).map(|(a, b)| a * b).sum();
        assert!((r_in - r_out).abs() < 1e-5, "{r_in} vs {r_out}");
        // gelu(x)/x, ½ at 0
        assert_eq!(gelu_ratio(0.0), 0.5);
        for x in [-2.0f32, -1e-3, 0.4, 3.0] {
            assert!((gelu_ratio(x) * x - gelu_tanh_of(x)).abs() < 1e-6);
        }
    }

    #[test]
    fn activation_derivatives() {
        for &x in &[-3.0f32, -0.5, 0.0, 0.7, 2.5] {
            let h = 1e-3f32;
            let fd = (gelu_tanh_of(x + h) - gelu_tanh_of(x - h)) / (2.0 * h);
            assert!((fd - gelu_tanh_grad(x)).abs() < 1e-2, "gelu {x}");
        }
    }
}
