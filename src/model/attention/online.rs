//! The online softmax's arithmetic: one row's update over a key block, the exponentials and
//! their sums, and the row maxima, each in lanes so that it vectorizes.

use super::RowState;
use crate::kernels::simd::multiversion;

/// One row's online-softmax step over a key block whose scores (scaled, masked = -inf) are in
/// `row[..len]` (the rest is masked): updates the shift, the sums, argmax, first-key score and
/// top-k, leaves `p = exp(s - m')` in `row` (masked → exactly 0) and the rescale factor in `c`.
/// `dense`: no score in `row[..len]` is masked (the causal prefix without knockout); `at`: where
/// in the row `bmax` first stands, when the argmax is tracked (nobody but the statistics needs
/// it).
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) fn online_update(
    st: &mut RowState,
    c: &mut f32,
    row: &mut [f32],
    len: usize,
    bmax: f32,
    at: Option<usize>,
    k0: usize,
    top_k: Option<usize>,
    dense: bool,
) {
    // top_k is None for rows whose top keys nobody asked for
    if k0 == 0 {
        st.s0 = row[0];
    }
    let m_new = st.m.max(bmax);
    if m_new == f32::NEG_INFINITY {
        // nothing visible yet in this row, unless the scores were NaN (which no max sees) or
        // overflowed to -inf where keys are visible: poison the sums so the layer is refused
        if (dense && len > 0) || row[..len].iter().any(|x| x.is_nan()) {
            st.t = f64::NAN;
        }
        row.iter_mut().for_each(|p| *p = 0.0);
        *c = 1.0;
        return;
    }
    *c = if st.m == f32::NEG_INFINITY {
        0.0
    } else {
        (st.m - m_new).exp()
    };
    if let Some(j) = at.filter(|_| bmax > st.m) {
        st.argmax = (k0 + j) as u32;
    }
    if let Some(kk) = top_k {
        for (j, &s_j) in row[..len].iter().enumerate() {
            if s_j > f32::NEG_INFINITY && (st.top.len() < kk || s_j > st.top[st.top.len() - 1].0) {
                let at = st
                    .top
                    .iter()
                    .position(|&(ts, _)| s_j > ts)
                    .unwrap_or(st.top.len());
                st.top.insert(at, (s_j, (k0 + j) as u32));
                st.top.truncate(kk);
            }
        }
    }
    let (l, t) = if dense && bmax > f32::NEG_INFINITY {
        exp_shift_sums_dense(&mut row[..len], m_new)
    } else {
        exp_shift_sums_masked(&mut row[..len], m_new)
    };
    row[len..].iter_mut().for_each(|p| *p = 0.0);
    st.l = st.l * *c as f64 + l;
    st.t = st.t * *c as f64 + t;
    st.m = m_new;
}

/// `x ← exp(x - m)` over a slice, returning `(Σ exp, Σ exp · x)`. With `MASKED`, `-inf` entries
/// (masked keys) become exactly 0; without, every entry must be finite (the causal prefix without
/// knockout), which saves the selects. In lanes of 16 without branches, so it vectorizes (at the
/// machine's width: [`exp_shift_sums_dense`], [`exp_shift_sums_masked`]).
#[inline(always)]
pub(crate) fn exp_shift_sums<const MASKED: bool>(xs: &mut [f32], m: f32) -> (f64, f64) {
    const L: usize = 16;
    let (mut sl, mut st) = ([0f32; L], [0f32; L]);
    let mut chunks = xs.chunks_exact_mut(L);
    for ch in &mut chunks {
        for k in 0..L {
            let s = ch[k];
            let (p, s) = if MASKED {
                // masked entries are computed on a finite stand-in and then selected away
                // (`!=`, not `>`: a NaN score stays live, so it poisons the sums and is caught)
                let live = s != f32::NEG_INFINITY;
                let p = fast_exp(if live { s - m } else { -100.0 });
                if live {
                    (p, s)
                } else {
                    (0.0, 0.0)
                }
            } else {
                (fast_exp(s - m), s)
            };
            ch[k] = p;
            sl[k] += p;
            st[k] += p * s;
        }
    }
    let (mut l, mut t) = (
        sl.iter().map(|&v| v as f64).sum::<f64>(),
        st.iter().map(|&v| v as f64).sum::<f64>(),
    );
    for x in chunks.into_remainder() {
        let s = *x;
        let p = if MASKED && s == f32::NEG_INFINITY {
            0.0
        } else {
            fast_exp(s - m)
        };
        *x = p;
        l += p as f64;
        if s != f32::NEG_INFINITY {
            t += (p * s) as f64;
        }
    }
    (l, t)
}

multiversion! {
    /// [`exp_shift_sums`] of a row without masked entries.
    pub(crate) fn exp_shift_sums_dense(xs: &mut [f32], m: f32) -> (f64, f64) {
        exp_shift_sums::<false>(xs, m)
    }
}

multiversion! {
    /// [`exp_shift_sums`] of a row with masked (`-inf`) entries.
    pub(crate) fn exp_shift_sums_masked(xs: &mut [f32], m: f32) -> (f64, f64) {
        exp_shift_sums::<true>(xs, m)
    }
}

multiversion! {
    /// Whether every value is finite (0·x is NaN exactly for NaN and ±inf; in lanes, so it
    /// vectorizes and costs next to nothing beside the layer that produced `xs`).
    pub(crate) fn all_finite(xs: &[f32]) -> bool {
        const L: usize = 16;
        let mut acc = [0f32; L];
        let mut chunks = xs.chunks_exact(L);
        for ch in &mut chunks {
            for k in 0..L {
                acc[k] += ch[k] * 0.0;
            }
        }
        acc.iter().chain(chunks.remainder()).all(|v| v.is_finite())
    }
}

multiversion! {
    /// The largest value of a slice (-inf when empty), in lanes of 16 so it vectorizes
    /// (`f32::max` does not, for its NaN rule; scores are never NaN here).
    pub(crate) fn max_of(xs: &[f32]) -> f32 {
        const L: usize = 16;
        let mut m = [f32::NEG_INFINITY; L];
        let mut chunks = xs.chunks_exact(L);
        for ch in &mut chunks {
            for k in 0..L {
                m[k] = if ch[k] > m[k] { ch[k] } else { m[k] };
            }
        }
        let mut best = chunks
            .remainder()
            .iter()
            .copied()
            .fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a });
        for v in m {
            best = if v > best { v } else { best };
        }
        best
    }
}

multiversion! {
    /// [`max_of`] and the first index holding the maximum (`None` when every value is -inf or
    /// the slice is empty), in one pass: each of 16 lanes keeps its largest value and where it
    /// first saw it, without a branch, so it compiles to vector compares and blends. The argmax
    /// of a row with statistics: a scalar scan for the maximum after `max_of` took ~1.6% of
    /// `inspect` at 2,048 tokens, a vector one ~0.7%.
    pub(crate) fn max_and_index(xs: &[f32]) -> (f32, Option<usize>) {
        const L: usize = 16;
        let mut m = [f32::NEG_INFINITY; L];
        let mut at = [u32::MAX; L];
        let mut chunks = xs.chunks_exact(L);
        let mut base = 0u32;
        for ch in &mut chunks {
            for k in 0..L {
                let up = ch[k] > m[k];
                m[k] = if up { ch[k] } else { m[k] };
                at[k] = if up { base + k as u32 } else { at[k] };
            }
            base += L as u32;
        }
        let (mut best, mut first) = (f32::NEG_INFINITY, u32::MAX);
        for k in 0..L {
            // the largest value, and among lanes that hold it the earliest place
            if m[k] > best || (m[k] == best && at[k] < first) {
                (best, first) = (m[k], at[k]);
            }
        }
        for (j, &x) in chunks.remainder().iter().enumerate() {
            if x > best {
                (best, first) = (x, base + j as u32);
            }
        }
        (best, (first != u32::MAX).then_some(first as usize))
    }
}

/// `e^x` for x ≤ 0 (the shifted scores of a softmax), as in Cephes `expf`: x = n·ln 2 + r,
/// e^r by a degree-5 polynomial, 2^n through the exponent bits. Relative error ~1e-7.
///
/// Separate multiplies and adds, not fused ones: `mul_add` (same bits at every width through the
/// C library's `fmaf` on the baseline) took the exponential loop from 1.9% to 1.3% of `inspect`'s
/// samples at 2,048 tokens, but it moved `fast`'s sink profile on the lesson's sentence from
/// 0.0095 to 0.0110 off the reference (SmolLM2: 0.0113 to 0.0174), past the 0.01 it is held to:
/// the 8-bit activations round a little differently and that error happened to come out larger.
#[inline(always)]
pub(crate) fn fast_exp(x: f32) -> f32 {
    // a plain comparison (not f32::max, whose NaN rule keeps it from vectorizing)
    let x = if x > -87.0 { x } else { -87.0 };
    // round to nearest by the 1.5·2^23 trick (vectorizes, unlike f32::round)
    const MAGIC: f32 = 12_582_912.0;
    let t = x * std::f32::consts::LOG2_E + MAGIC;
    let n = t - MAGIC;
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let r2 = r * r;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 0.166_666_65)
        * r
        + 0.5;
    let er = 1.0 + r + r2 * p;
    // 2^n from the integer n sitting in t's low mantissa bits (t = 1.5·2^23 + n), in integer
    // lanes: `n as i32` is a saturating cast that compiles to a scalar compare per value, which
    // kept this loop from vectorizing (measured: the softmax and SiLU loops ran on scalar
    // conversions). n lies in -126..=0 here, so n + 127 is a normal exponent.
    let e = t.to_bits().wrapping_sub(0x4B40_0000).wrapping_add(127) << 23;
    er * f32::from_bits(e)
}
