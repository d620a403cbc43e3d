//! Rows whose scores can be large, rescored in f64 and shifted by their exact maximum before
//! they are rounded to f32.

use super::visible_in;

/// Scaled scores whose magnitude passes this are computed in f64 and shifted by their row's
/// exact maximum before they become f32 ([`rescore_row`]). The f32 dot product of 128-wide
/// heads is off by ~1.5e-7 of the score's size and the f32 score itself by half an ulp, and a
/// softmax passes an error δ in the scores on as up to δ/4 in the weights: Qwen2.5-1.5B's first
/// layer has scores near 12,000, where f32 alone left weights 5.5e-4 from a float64 forward of
/// the same weights (transformers' eager f32: 3.3e-4). Below 256 the same sources stay under
/// ~1e-5 in the weights.
pub(crate) const EXACT_SCORES_ABOVE: f32 = 256.0;

/// `Σ a_i·b_i` in f64: every product of two f32 is exact in f64, so the only rounding left is
/// f64's own (~1e-16 relative); eight lanes so that it vectorizes.
#[inline]
pub(crate) fn dot_f64(a: &[f32], b: &[f32]) -> f64 {
    const L: usize = 8;
    let mut acc = [0f64; L];
    let (ca, cb) = (a.chunks_exact(L), b.chunks_exact(L));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..L {
            acc[l] += x[l] as f64 * y[l] as f64;
        }
    }
    let tail: f64 = ra.iter().zip(rb).map(|(&x, &y)| x as f64 * y as f64).sum();
    acc.iter().sum::<f64>() + tail
}

/// A whole visible row of a layer whose scores can be large: when the f32 scores of query `i`
/// pass [`EXACT_SCORES_ABOVE`], they are computed again from the unscaled query `q` and the
/// keys `k` (`[k_len, d]`, the row's KV set) in f64 (`q·k·scale`, soft-capped in f64), the
/// visible ones are shifted by their exact maximum and only then rounded to f32, so the softmax
/// that follows sees the differences `s - max` to f32's precision at their own (small) size
/// rather than at the score's. `raw` (the scores hook's row, if anyone wants it) gets the scores
/// themselves, rounded once. The shift leaves the softmax, the statistics (entropy, weights,
/// top-k) and the argmax as they are, in exact arithmetic.
#[allow(clippy::too_many_arguments)]
pub(super) fn rescore_row(
    row: &mut [f32],
    raw: Option<&mut [f32]>,
    q: &[f32],
    k: &[f32],
    scale: f64,
    softcap: Option<f32>,
    i: usize,
    knockout: &[bool],
    window: Option<usize>,
    causal: bool,
) {
    let visible = |i, j, knockout, window| visible_in(causal, i, j, knockout, window);
    let d = q.len();
    let big = row
        .iter()
        .enumerate()
        .any(|(j, s)| s.abs() > EXACT_SCORES_ABOVE && visible(i, j, knockout, window));
    if !big {
        return;
    }
    EXACT_ROW.with(|cell| {
        let mut exact = cell.borrow_mut();
        exact.clear();
        // the visible scores in f64; an invisible key keeps −∞ (no visible score is: q and k
        // are finite, and a soft-cap is bounded)
        exact.extend((0..row.len()).map(|j| {
            if !visible(i, j, knockout, window) {
                return f64::NEG_INFINITY;
            }
            let s = dot_f64(q, &k[j * d..(j + 1) * d]) * scale;
            match softcap {
                Some(cap) => (s / cap as f64).tanh() * cap as f64,
                None => s,
            }
        }));
        let m = exact.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let live = || exact.iter().filter(|s| **s != f64::NEG_INFINITY);
        if !m.is_finite() || live().any(|s| s.abs() > f32::MAX as f64) {
            // a NaN, or a score past f32's range (its hook could not hold it): leave the f32
            // row as it is, whose non-finite sums the caller refuses with the layer named
            return;
        }
        for (r, &s) in row.iter_mut().zip(exact.iter()) {
            if s != f64::NEG_INFINITY {
                *r = (s - m) as f32;
            }
        }
        if let Some(raw) = raw {
            for (r, &s) in raw.iter_mut().zip(exact.iter()) {
                if s != f64::NEG_INFINITY {
                    *r = s as f32;
                }
            }
        }
    });
}

thread_local! {
    /// [`rescore_row`]'s f64 scores, kept per thread so a rescored row allocates nothing.
    static EXACT_ROW: std::cell::RefCell<Vec<f64>> = const { std::cell::RefCell::new(Vec::new()) };
}
