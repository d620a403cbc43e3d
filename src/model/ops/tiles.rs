//! The output head's products in register tiles, for [`super::dot_rows`]: on AVX-512 up to 4
//! rows of `h` against up to 6 vocabulary rows at once, one zmm of 16 lanes per product (24
//! accumulators, 6 vocabulary vectors and one of `h` in the 32 registers); on AVX2 3 x 2, each
//! product in two ymm (12 of the 16 registers). Each value loaded serves several products.
//!
//! Measured on one core of this Xeon (AVX-512, 120 rows by a 256-row chunk of 576 values, best
//! of 30): the portable 4 x 2 tile left to the compiler ran at 2.1 G multiply-adds/s compiled
//! for AVX-512 and 17.5 G for AVX2; these tiles at 55 G (4 x 6; 4 x 4: 50 G, 8 x 2: 46 G) and
//! 34 G (3 x 2; 2 x 2: 25 G, 4 x 2 spilling: 27 G). An add and a multiply per lane each cycle
//! bounds it: no fused multiply-add (below).
//!
//! Every product keeps [`super::dot16`]'s bits: lane `k` sums `h[c + k] · w[c + k]` over the
//! 16-value steps `c` in order, a multiply then an add (never a fused multiply-add, which rounds
//! once), then the same tree over the lanes ([`super::lanes_sum`]: 8 + 8, 4 + 4,
//! `(q0 + q2) + (q1 + q3)`), then the products of the tail of `d` beyond the last 16
//! ([`super::tail_dot`]).

use std::arch::x86_64::*;

/// Walks `out` (`out[i][v] = h_i · w_v`) in tiles of `R` rows of `h` (held in L1 while the
/// vocabulary rows of `w` stream past them) by `V` rows of `w`, the edges in smaller tiles:
/// `tile_of(r, n, h, w)` gives the `r x n` products of the rows at `h` and `w` in the corner of
/// a full tile.
fn walk<const R: usize, const V: usize>(
    h: &[f32],
    w: &[f32],
    d: usize,
    out: &mut [&mut [f32]],
    tile_of: impl Fn(usize, usize, *const f32, *const f32) -> [[f32; V]; R],
) {
    let (rows, nv) = (out.len(), w.len() / d);
    assert!(h.len() >= rows * d && out.iter().all(|o| o.len() >= nv));
    let mut i = 0;
    while i < rows {
        let r = (rows - i).min(R);
        let mut v = 0;
        while v < nv {
            let n = (nv - v).min(V);
            // rows i..i + r of h and v..v + n of w lie inside the slices (asserted above)
            let t = tile_of(r, n, h[i * d..].as_ptr(), w[v * d..].as_ptr());
            for (a, t) in t.iter().enumerate().take(r) {
                out[i + a][v..v + n].copy_from_slice(&t[..n]);
            }
            v += n;
        }
        i += r;
    }
}

/// The `$r x $n` tile of `$tile::<$r, $n>` (one of the listed shapes) in the corner of a full
/// `$R x $V` array, the unused cells 0.
macro_rules! shapes {
    ($tile:ident, $R:literal x $V:literal, ($r:expr, $n:expr, $h:expr, $w:expr, $d:expr);
     $(($a:literal, $b:literal))*) => {{
        let mut full = [[0f32; $V]; $R];
        match ($r, $n) {
            $(($a, $b) => {
                // SAFETY: the caller's: $a rows of d values at $h, $b at $w, and the features
                let t = unsafe { $tile::<$a, $b>($h, $w, $d) };
                for (f, t) in full.iter_mut().zip(&t) {
                    f[..$b].copy_from_slice(t);
                }
            })*
            (r, n) => unreachable!("a tile of {r} x {n} (at most {} x {})", $R, $V),
        }
        full
    }};
}

/// [`super::dot_rows`] on AVX-512 in tiles of 4 x 6.
///
/// # Safety
/// The CPU must have AVX-512 F, DQ and VL; `d > 0`. (Shapes are checked: `h` must hold
/// `out.len()` rows of `d` and each `out[i]` a value per row of `w`.)
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma")]
pub(super) unsafe fn dot_rows_avx512(h: &[f32], w: &[f32], d: usize, out: &mut [&mut [f32]]) {
    walk::<4, 6>(h, w, d, out, |r, n, h, w| {
        // SAFETY: walk's pointers are at r and n whole rows; the caller's CPU has AVX-512
        unsafe { tile_of_avx512(r, n, h, w, d) }
    })
}

/// [`zmm_tile`] of `r x n` (at most 4 x 6) in a full tile's array.
///
/// # Safety
/// As [`zmm_tile`] for `r` rows at `h` and `n` at `w`.
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma")]
unsafe fn tile_of_avx512(
    r: usize,
    n: usize,
    h: *const f32,
    w: *const f32,
    d: usize,
) -> [[f32; 6]; 4] {
    shapes!(zmm_tile, 4 x 6, (r, n, h, w, d);
        (4, 6) (4, 5) (4, 4) (4, 3) (4, 2) (4, 1)
        (3, 6) (3, 5) (3, 4) (3, 3) (3, 2) (3, 1)
        (2, 6) (2, 5) (2, 4) (2, 3) (2, 2) (2, 1)
        (1, 6) (1, 5) (1, 4) (1, 3) (1, 2) (1, 1))
}

/// `R x V` products of `R` rows of `h` (at `h`, `d` apart) and `V` rows of `w` (at `w`), each
/// [`super::dot16`]'s bits, a zmm per product.
///
/// # Safety
/// AVX-512 F, DQ and VL; `h` points at `R · d` readable values and `w` at `V · d`.
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma")]
#[inline]
unsafe fn zmm_tile<const R: usize, const V: usize>(
    h: *const f32,
    w: *const f32,
    d: usize,
) -> [[f32; V]; R] {
    let full = d / 16 * 16;
    let mut acc = [[_mm512_setzero_ps(); V]; R];
    let mut c = 0;
    while c < full {
        // SAFETY: c + 16 <= d, inside each row (the caller's bounds)
        let wv: [__m512; V] = std::array::from_fn(|j| unsafe { _mm512_loadu_ps(w.add(j * d + c)) });
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: as above, row r of h
            let a = unsafe { _mm512_loadu_ps(h.add(r * d + c)) };
            for (acc, &b) in acc.iter_mut().zip(&wv) {
                // dot16's `acc[k] += a[k] * b[k]`: rounded product, then rounded sum (no FMA)
                *acc = _mm512_add_ps(*acc, _mm512_mul_ps(a, b));
            }
        }
        c += 16;
    }
    let mut out = [[0f32; V]; R];
    for (r, (o, acc)) in out.iter_mut().zip(&acc).enumerate() {
        for (j, (o, &acc)) in o.iter_mut().zip(acc).enumerate() {
            // SAFETY: rows r of h and j of w hold d values each
            let tail = unsafe { tail_at(h.add(r * d), w.add(j * d), full, d) };
            let half = _mm256_add_ps(
                _mm512_castps512_ps256(acc),
                _mm512_extractf32x8_ps::<1>(acc),
            );
            *o = ymm_sum(half, tail);
        }
    }
    out
}

/// [`super::dot_rows`] on AVX2 in tiles of 3 x 2.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `d > 0`. (Shapes are checked as for [`dot_rows_avx512`].)
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dot_rows_avx2(h: &[f32], w: &[f32], d: usize, out: &mut [&mut [f32]]) {
    walk::<3, 2>(h, w, d, out, |r, n, h, w| {
        // SAFETY: walk's pointers are at r and n whole rows; the caller's CPU has AVX2
        unsafe { tile_of_avx2(r, n, h, w, d) }
    })
}

/// [`ymm_tile`] of `r x n` (at most 3 x 2) in a full tile's array.
///
/// # Safety
/// As [`ymm_tile`] for `r` rows at `h` and `n` at `w`.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_of_avx2(
    r: usize,
    n: usize,
    h: *const f32,
    w: *const f32,
    d: usize,
) -> [[f32; 2]; 3] {
    shapes!(ymm_tile, 3 x 2, (r, n, h, w, d);
        (3, 2) (3, 1) (2, 2) (2, 1) (1, 2) (1, 1))
}

/// `R x V` products as [`zmm_tile`]'s, each product's 16 lanes in two ymm (lanes 0..8 and
/// 8..16), so the same sums.
///
/// # Safety
/// AVX2 and FMA; `h` points at `R · d` readable values and `w` at `V · d`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn ymm_tile<const R: usize, const V: usize>(
    h: *const f32,
    w: *const f32,
    d: usize,
) -> [[f32; V]; R] {
    let full = d / 16 * 16;
    let mut acc = [[[_mm256_setzero_ps(); 2]; V]; R];
    let mut c = 0;
    while c < full {
        for half in 0..2 {
            let at = c + 8 * half;
            // SAFETY: at + 8 <= d, inside each row (the caller's bounds)
            let wv: [__m256; V] =
                std::array::from_fn(|j| unsafe { _mm256_loadu_ps(w.add(j * d + at)) });
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: as above, row r of h
                let a = unsafe { _mm256_loadu_ps(h.add(r * d + at)) };
                for (acc, &b) in acc.iter_mut().zip(&wv) {
                    // rounded product, then rounded sum (no FMA), as dot16
                    acc[half] = _mm256_add_ps(acc[half], _mm256_mul_ps(a, b));
                }
            }
        }
        c += 16;
    }
    let mut out = [[0f32; V]; R];
    for (r, (o, acc)) in out.iter_mut().zip(&acc).enumerate() {
        for (j, (o, acc)) in o.iter_mut().zip(acc).enumerate() {
            // SAFETY: rows r of h and j of w hold d values each
            let tail = unsafe { tail_at(h.add(r * d), w.add(j * d), full, d) };
            *o = ymm_sum(_mm256_add_ps(acc[0], acc[1]), tail);
        }
    }
    out
}

/// [`super::lanes_sum`] from its `half` (`acc[k] + acc[k + 8]`, k < 8), then `+ tail`: the
/// same additions of the same pairs in the same order, so the same bits.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn ymm_sum(half: __m256, tail: f32) -> f32 {
    // quarter[k] = half[k] + half[k + 4]
    let quarter = _mm_add_ps(
        _mm256_castps256_ps128(half),
        _mm256_extractf128_ps::<1>(half),
    );
    // [q0 + q2, q1 + q3]
    let pairs = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
    // (q0 + q2) + (q1 + q3)
    let sum = _mm_add_ss(pairs, _mm_shuffle_ps::<0b01>(pairs, pairs));
    _mm_cvtss_f32(sum) + tail
}

/// [`super::tail_dot`] of the values `full..d` of the rows at `h` and `w`.
///
/// # Safety
/// `h` and `w` point at `d` readable values each.
#[inline(always)]
unsafe fn tail_at(h: *const f32, w: *const f32, full: usize, d: usize) -> f32 {
    // SAFETY: the caller's
    let (a, b) = unsafe {
        (
            std::slice::from_raw_parts(h.add(full), d - full),
            std::slice::from_raw_parts(w.add(full), d - full),
        )
    };
    super::tail_dot(a, b)
}
