//! The quantized block types' rows (Q8_0, Q5_0, Q4_1, Q4_K, Q6_K) with the dequantization
//! written in vector instructions, AVX-512 and AVX2, giving the bits of the portable bodies in
//! `qmatvec.rs`: each weight's integer (Q5_0's less 16 and Q6_K's less 32 subtracted in bytes,
//! the same integer) widened exactly to f32, the same multiplies, subtractions and additions
//! of f32 values (each rounded once, never fused), then `acc[lane] += w · x` in the same order
//! (`every_block_type_gives_the_dequantized_products_at_every_width`). The bytes are worked on
//! 16 at a time in 128-bit registers (SSSE3, which both levels include), Q5_0's 32 at a time in
//! 256-bit ones; the blocks' f16 scales are read from a table ([`F16s`]); two rows go side by
//! side, so that two chains of additions overlap, with the loads asked for 8 KiB ahead.
//!
//! Why by hand: the portable bodies compiled for AVX-512 ran the default model's decode step
//! at 5.0 tokens/s (the blocks' closures and the f16 conversions stayed calls); these at 15.0,
//! and 26.8 with the table, Q5_0's wider unpacking, the farther prefetch and the step's other
//! changes (a 2-core Sapphire Rapids, `bench --machine`; docs/benchmarks.md has each change's
//! share, `cargo bench --bench qmatvec` each type's rate).
//!
//! Safety, once for the module: every function here is reached only from [`rows_avx512`] or
//! [`rows_avx2`], whose callers have checked that the CPU has the level's features, and reads
//! whole blocks of rows whose lengths `rows` has checked (a row of `rb` bytes holds `rb / wb`
//! blocks of `wb` bytes, and `x` holds `ww` weights for each); hence unsafe operations inside
//! these unsafe functions without a block each.

#![allow(unsafe_op_in_unsafe_fn)]
// the rows go in index loops over several arrays at once (closures would not be inlined for
// certain, and the intrinsics inside them would then be calls)
#![allow(clippy::needless_range_loop)]

use super::{reduce, scale_min_k4, Blocks};
use std::arch::x86_64::*;

/// 16 f32 lanes: one zmm, or two ymm.
trait Lanes: Copy {
    unsafe fn zero() -> Self;
    unsafe fn splat(v: f32) -> Self;
    unsafe fn load(p: *const f32) -> Self;
    /// 16 bytes as unsigned integers, to f32 (exact)
    unsafe fn from_u8(b: __m128i) -> Self;
    /// 16 bytes as signed integers, to f32 (exact)
    unsafe fn from_i8(b: __m128i) -> Self;
    unsafe fn add(self, o: Self) -> Self;
    unsafe fn sub(self, o: Self) -> Self;
    unsafe fn mul(self, o: Self) -> Self;
    unsafe fn store(self, out: &mut [f32; 16]);
}

#[derive(Clone, Copy)]
struct Z(__m512);

impl Lanes for Z {
    #[inline(always)]
    unsafe fn zero() -> Self {
        Z(_mm512_setzero_ps())
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        Z(_mm512_set1_ps(v))
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Z(_mm512_loadu_ps(p))
    }
    #[inline(always)]
    unsafe fn from_u8(b: __m128i) -> Self {
        Z(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)))
    }
    #[inline(always)]
    unsafe fn from_i8(b: __m128i) -> Self {
        Z(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)))
    }
    #[inline(always)]
    unsafe fn add(self, o: Self) -> Self {
        Z(_mm512_add_ps(self.0, o.0))
    }
    #[inline(always)]
    unsafe fn sub(self, o: Self) -> Self {
        Z(_mm512_sub_ps(self.0, o.0))
    }
    #[inline(always)]
    unsafe fn mul(self, o: Self) -> Self {
        Z(_mm512_mul_ps(self.0, o.0))
    }
    #[inline(always)]
    unsafe fn store(self, out: &mut [f32; 16]) {
        _mm512_storeu_ps(out.as_mut_ptr(), self.0)
    }
}

#[derive(Clone, Copy)]
struct Y(__m256, __m256);

impl Lanes for Y {
    #[inline(always)]
    unsafe fn zero() -> Self {
        Y(_mm256_setzero_ps(), _mm256_setzero_ps())
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        Y(_mm256_set1_ps(v), _mm256_set1_ps(v))
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Y(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
    }
    #[inline(always)]
    unsafe fn from_u8(b: __m128i) -> Self {
        Y(
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(b))),
        )
    }
    #[inline(always)]
    unsafe fn from_i8(b: __m128i) -> Self {
        Y(
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(b))),
        )
    }
    #[inline(always)]
    unsafe fn add(self, o: Self) -> Self {
        Y(_mm256_add_ps(self.0, o.0), _mm256_add_ps(self.1, o.1))
    }
    #[inline(always)]
    unsafe fn sub(self, o: Self) -> Self {
        Y(_mm256_sub_ps(self.0, o.0), _mm256_sub_ps(self.1, o.1))
    }
    #[inline(always)]
    unsafe fn mul(self, o: Self) -> Self {
        Y(_mm256_mul_ps(self.0, o.0), _mm256_mul_ps(self.1, o.1))
    }
    #[inline(always)]
    unsafe fn store(self, out: &mut [f32; 16]) {
        _mm256_storeu_ps(out.as_mut_ptr(), self.0);
        _mm256_storeu_ps(out.as_mut_ptr().add(8), self.1)
    }
}

/// 16 bytes at `p`.
#[inline(always)]
unsafe fn bytes16(p: *const u8) -> __m128i {
    _mm_loadu_si128(p as *const __m128i)
}

/// The low (`high` false) or high nibbles of 16 bytes, each as a byte 0..=15.
#[inline(always)]
unsafe fn nibbles(q: __m128i, high: bool) -> __m128i {
    let q = if high { _mm_srli_epi16::<4>(q) } else { q };
    _mm_and_si128(q, _mm_set1_epi8(0x0F))
}

/// `acc[r] += w[r] · x` for each row `r`: the multiply, then the add.
#[inline(always)]
unsafe fn step<V: Lanes, const R: usize>(acc: &mut [V; R], w: [V; R], x: *const f32) {
    let x = V::load(x);
    for r in 0..R {
        acc[r] = acc[r].add(w[r].mul(x));
    }
}

/// How far ahead of each row's block the loads are asked for, into the L2 cache (bytes; a
/// prefetch past the end of the mapping is a hint, never a fault). Measured on a 2-core
/// Sapphire Rapids (`cargo bench --bench qmatvec -- from_memory`: 512 MiB of rows, both
/// cores): 512 bytes ahead gave Q5_0 10.2 GiB/s and Q8_0 12.8; 4 KiB 12.2 and 16.9; 8 KiB 12.5
/// and 16.4, the plateau (16 KiB no better); the default model's decode went from 20.1-20.4
/// tokens/s to 23.2-24.5.
const PREFETCH: usize = 8192;

/// Stores a row's sum (its lanes in `ops::dot16`'s tree).
#[inline(always)]
unsafe fn finish<V: Lanes>(acc: V, y: &mut f32, accumulate: bool) {
    let mut lanes = [0f32; 16];
    acc.store(&mut lanes);
    let s = reduce(&lanes);
    *y = if accumulate { *y + s } else { s };
}

/// Each row of kind `K` (`rb` bytes) times `x`, summed over its blocks. Rows go `R` at a
/// time, interleaved 16 weights at a time: each row keeps its own lanes and order of sums
/// (the same bits), and the `R` chains of additions run side by side instead of each
/// waiting on the last add's latency; `x` is loaded once for the `R` rows.
#[inline(always)]
unsafe fn each_row<K: Kind, V: Lanes, const R: usize>(
    bytes: &[u8],
    rb: usize,
    x: &[f32],
    ys: &mut [f32],
    accumulate: bool,
) {
    let (wb, ww) = (K::WB, K::WW);
    let blocks = rb / wb;
    let t = F16s::get();
    debug_assert!(blocks * ww <= x.len());
    let mut rows = bytes.chunks_exact(rb * R);
    let mut outs = ys.chunks_exact_mut(R);
    for (group, ys) in (&mut rows).zip(&mut outs) {
        let mut acc = [V::zero(); R];
        for i in 0..blocks {
            let b: [*const u8; R] = std::array::from_fn(|r| group.as_ptr().add(r * rb + i * wb));
            for p in b {
                _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(PREFETCH) as *const i8);
            }
            K::block(t, &b, x.as_ptr().add(i * ww), &mut acc);
        }
        for (acc, y) in acc.into_iter().zip(ys.iter_mut()) {
            finish(acc, y, accumulate);
        }
    }
    for (row, y) in rows.remainder().chunks_exact(rb).zip(outs.into_remainder()) {
        let mut acc = [V::zero(); 1];
        for i in 0..blocks {
            K::block(
                t,
                &[row.as_ptr().add(i * wb)],
                x.as_ptr().add(i * ww),
                &mut acc,
            );
        }
        finish(acc[0], y, accumulate);
    }
}

/// A block type's dequantization and products: `WB` bytes and `WW` weights a block.
/// (Loops, not closures, over the rows: a closure is not inlined for certain, and the
/// intrinsics inside one would then be calls.)
trait Kind {
    const WB: usize;
    const WW: usize;
    /// `acc[r]` plus the block at `b[r]` times the block's weights at `x`, for each row `r`.
    unsafe fn block<V: Lanes, const R: usize>(
        t: F16s,
        b: &[*const u8; R],
        x: *const f32,
        acc: &mut [V; R],
    );
}

/// Every f16's f32 value, by its bits (256 KiB, built once): a block's scale is then a load
/// and a broadcast from memory, which take no vector ALU port, where F16C's conversion took
/// three (a move, the conversion, the broadcast) of the two that AVX-512 code has. Exact: the
/// `half` crate's conversion, which is F16C's.
#[derive(Clone, Copy)]
struct F16s(&'static [f32; 1 << 16]);

impl F16s {
    fn get() -> F16s {
        use std::sync::OnceLock;
        static TABLE: OnceLock<Box<[f32; 1 << 16]>> = OnceLock::new();
        F16s(TABLE.get_or_init(|| {
            let all: Vec<f32> = (0..=u16::MAX)
                .map(|h| half::f16::from_bits(h).to_f32())
                .collect();
            all.into_boxed_slice()
                .try_into()
                .expect("one value for each of the 2^16 bit patterns")
        }))
    }

    /// The block's f16 at byte `at`, as f32 (a u16 indexes the table: no bound to check).
    #[inline(always)]
    unsafe fn of(self, b: *const u8, at: usize) -> f32 {
        self.0[(b.add(at) as *const u16).read_unaligned() as usize]
    }
}

struct Q8_0;

impl Kind for Q8_0 {
    const WB: usize = 34;
    const WW: usize = 32;
    #[inline(always)]
    unsafe fn block<V: Lanes, const R: usize>(
        t: F16s,
        b: &[*const u8; R],
        xs: *const f32,
        acc: &mut [V; R],
    ) {
        let mut d = [V::zero(); R];
        for r in 0..R {
            d[r] = V::splat(t.of(b[r], 0));
        }
        for g in 0..2 {
            let mut w = [V::zero(); R];
            for r in 0..R {
                w[r] = V::from_i8(bytes16(b[r].add(2 + 16 * g))).mul(d[r]);
            }
            step(acc, w, xs.add(16 * g));
        }
    }
}

struct Q5_0;

impl Kind for Q5_0 {
    const WB: usize = 22;
    const WW: usize = 32;
    #[inline(always)]
    unsafe fn block<V: Lanes, const R: usize>(
        t: F16s,
        b: &[*const u8; R],
        xs: *const f32,
        acc: &mut [V; R],
    ) {
        // byte j of the 32 takes bit j of qh: each 128-bit half shuffles the same 4 bytes
        let spread = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, //
            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
        );
        let bit = _mm256_set1_epi64x(i64::from_le_bytes([1, 2, 4, 8, 16, 32, 64, 128]));
        let mut w = [[V::zero(); R]; 2];
        for r in 0..R {
            let qs = bytes16(b[r].add(6));
            // the 32 weights' nibbles in 32 bytes: the low nibbles, then the high ones
            let q = _mm256_and_si256(
                _mm256_set_m128i(_mm_srli_epi16::<4>(qs), qs),
                _mm256_set1_epi8(0x0F),
            );
            let qh = _mm256_set1_epi32((b[r].add(2) as *const i32).read_unaligned());
            let set =
                _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, spread), bit), bit);
            // q5 − 16 in bytes (−16..=15), the same integer as the f32 sum's: the nibble where
            // the fifth bit is set, the nibble − 16 (= nibble | 0xF0) where it is not
            let q = _mm256_or_si256(q, _mm256_andnot_si256(set, _mm256_set1_epi8(-16)));
            let d = V::splat(t.of(b[r], 0));
            w[0][r] = V::from_i8(_mm256_castsi256_si128(q)).mul(d);
            w[1][r] = V::from_i8(_mm256_extracti128_si256::<1>(q)).mul(d);
        }
        step(acc, w[0], xs);
        step(acc, w[1], xs.add(16));
    }
}

struct Q4_1;

impl Kind for Q4_1 {
    const WB: usize = 20;
    const WW: usize = 32;
    #[inline(always)]
    unsafe fn block<V: Lanes, const R: usize>(
        t: F16s,
        b: &[*const u8; R],
        xs: *const f32,
        acc: &mut [V; R],
    ) {
        for half in 0..2 {
            let mut w = [V::zero(); R];
            for r in 0..R {
                let q = nibbles(bytes16(b[r].add(4)), half == 1);
                let (d, m) = (V::splat(t.of(b[r], 0)), V::splat(t.of(b[r], 2)));
                w[r] = V::from_u8(q).mul(d).add(m);
            }
            step(acc, w, xs.add(16 * half));
        }
    }
}

struct Q4K;

impl Kind for Q4K {
    const WB: usize = 144;
    const WW: usize = 256;
    #[inline(always)]
    unsafe fn block<V: Lanes, const R: usize>(
        t: F16s,
        b: &[*const u8; R],
        xs: *const f32,
        acc: &mut [V; R],
    ) {
        // each sub-block's scale times d and min times dmin, each rounded once
        let mut dm = [[[0f32; 8]; 2]; R];
        for r in 0..R {
            let (d, min) = (t.of(b[r], 0), t.of(b[r], 2));
            let scales = std::slice::from_raw_parts(b[r].add(4), 12);
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, scales);
                dm[r][0][j] = d * sc as f32;
                dm[r][1][j] = min * m as f32;
            }
        }
        // sub-block j: the low (even j) or high (odd j) nibbles of bytes 32·(j/2)..+32
        for j in 0..8 {
            for g in 0..2 {
                let mut w = [V::zero(); R];
                for r in 0..R {
                    let q = nibbles(bytes16(b[r].add(16 + 32 * (j / 2) + 16 * g)), j % 2 == 1);
                    let q = V::from_u8(q);
                    w[r] = V::splat(dm[r][0][j]).mul(q).sub(V::splat(dm[r][1][j]));
                }
                step(acc, w, xs.add(32 * j + 16 * g));
            }
        }
    }
}

struct Q6K;

impl Kind for Q6K {
    const WB: usize = 210;
    const WW: usize = 256;
    #[inline(always)]
    unsafe fn block<V: Lanes, const R: usize>(
        f16s: F16s,
        b: &[*const u8; R],
        xs: *const f32,
        acc: &mut [V; R],
    ) {
        let (two, thirty_two) = (_mm_set1_epi8(3), _mm_set1_epi8(32));
        for h in 0..2 {
            for t in 0..4 {
                for g in 0..2 {
                    let mut w = [V::zero(); R];
                    for r in 0..R {
                        let (ql, qh) = (b[r].add(64 * h), b[r].add(128 + 32 * h));
                        let low = nibbles(bytes16(ql.add(16 * g + 32 * (t & 1))), t >= 2);
                        let hb = bytes16(qh.add(16 * g));
                        let high = match t {
                            0 => hb,
                            1 => _mm_srli_epi16::<2>(hb),
                            2 => _mm_srli_epi16::<4>(hb),
                            _ => _mm_srli_epi16::<6>(hb),
                        };
                        let q = _mm_or_si128(low, _mm_slli_epi16::<4>(_mm_and_si128(high, two)));
                        let sc = *b[r].add(192 + 8 * h + g + 2 * t) as i8;
                        // q − 32 in bytes (−32..=31), widened exactly
                        let q = V::from_i8(_mm_sub_epi8(q, thirty_two));
                        w[r] = V::splat(f16s.of(b[r], 208) * sc as f32).mul(q);
                    }
                    step(acc, w, xs.add(128 * h + 32 * t + 16 * g));
                }
            }
        }
    }
}

/// The rows of `ty` at `V`'s width: true, or false (nothing done) for a type the portable body
/// keeps (F32, F16, BF16: plain loads, which the compiler vectorizes).
#[inline(always)]
unsafe fn rows_at<V: Lanes>(
    ty: Blocks,
    bytes: &[u8],
    rb: usize,
    x: &[f32],
    ys: &mut [f32],
    a: bool,
) -> bool {
    match ty {
        Blocks::Q8_0 => each_row::<Q8_0, V, 2>(bytes, rb, x, ys, a),
        Blocks::Q5_0 => each_row::<Q5_0, V, 2>(bytes, rb, x, ys, a),
        Blocks::Q4_1 => each_row::<Q4_1, V, 2>(bytes, rb, x, ys, a),
        Blocks::Q4K => each_row::<Q4K, V, 2>(bytes, rb, x, ys, a),
        Blocks::Q6K => each_row::<Q6K, V, 2>(bytes, rb, x, ys, a),
        Blocks::F32 | Blocks::F16 | Blocks::Bf16 => return false,
    }
    true
}

/// [`rows_at`] with AVX-512.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
pub(super) unsafe fn rows_avx512(
    ty: Blocks,
    bytes: &[u8],
    rb: usize,
    x: &[f32],
    ys: &mut [f32],
    a: bool,
) -> bool {
    rows_at::<Z>(ty, bytes, rb, x, ys, a)
}

/// [`rows_at`] with AVX2.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn rows_avx2(
    ty: Blocks,
    bytes: &[u8],
    rb: usize,
    x: &[f32],
    ys: &mut [f32],
    a: bool,
) -> bool {
    rows_at::<Y>(ty, bytes, rb, x, ys, a)
}
