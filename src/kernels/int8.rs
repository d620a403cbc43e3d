//! The `fast` precision's matrix multiplication: weights and activations as 8-bit integers in
//! blocks of 32 along the shared dimension, each block with its own f32 scale (the Q8_0 scheme of
//! llama.cpp, applied to both sides), multiplied with AVX-512 VNNI (`vpdpbusd`: 64 byte products
//! summed into 16 lanes per instruction) where the CPU has it, with AVX2 (`vpmaddubsw` +
//! `vpmaddwd`, llama.cpp's AVX2 dot products) where it has AVX2 and FMA but not VNNI, in plain
//! code elsewhere ([`Int8Kernel`]).
//!
//! `C[i, j] = Σ_b sa[i, b] · sw[j, b] · Σ_{t<32} qa[i, 32b + t] · qw[j, 32b + t]`.
//!
//! VNNI multiplies unsigned by signed bytes, so the activations go in as `qa + 128` and each
//! weight block carries `-128 · Σ_t qw`, where its integer sums start, to take that back out.
//! AVX2's `vpmaddubsw` also multiplies unsigned by signed bytes, but sums each pair of products
//! into a saturating i16: with `qa + 128` (up to 255) against `qw` (down to −127) a pair reaches
//! 2 · 255 · 127 = 64770, past i16's 32767, so the offset cannot be used there. It takes
//! llama.cpp's sign trick instead: `|qw|` (unsigned) by `qa · sign(qw)` (signed, `vpsignb`), the
//! same products with both factors within ±127, so a pair is at most 2 · 127 · 127 = 32258 and
//! never saturates; `vpmaddwd` by ones then sums the pairs of pairs into i32. The integer sums
//! are exact on every kernel, and every kernel scales a block's sum the same way
//! (`out + (Σ · sa) · sw`, one multiply-add), so all three give the same bits. The only rounding
//! is the quantization of both sides (relative error ~1/254 per block), which moves the attention
//! weights of the default model by about 1e-2 (measured in the tests).

use super::SendPtr;
use rayon::prelude::*;

/// Values per quantization block (along k).
pub const BLOCK: usize = 32;
/// Columns per packed panel.
const NP: usize = 16;
/// `NP`, for the name of the packed-weight cache's layout.
pub const PANEL_COLUMNS: usize = NP;
/// Bytes of one panel's block: 8 groups of 4 k-values × 16 columns, 16 scales, and 16 times
/// `-128 · Σ_t qw` (where the kernel's integer sums start, which takes the activations' `+ 128`
/// back out without a subtraction per block).
const PANEL_BLOCK: usize = BLOCK * NP + NP * 4 + NP * 4;

/// Whether this CPU has the VNNI kernel (AVX-512 F, BW and VNNI).
pub fn vnni_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this CPU has the AVX2 kernel (AVX2 and FMA).
pub fn avx2_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The code that multiplies the 8-bit blocks (`kernels::select` picks it; the same bits on each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int8Kernel {
    /// AVX-512 VNNI (`vpdpbusd`)
    Vnni,
    /// AVX2 and FMA (`vpmaddubsw` with the sign trick, `vpmaddwd`)
    Avx2,
    /// plain code
    Plain,
}

/// Rounds `x / scale` to the nearest integer in −127..=127.
#[inline]
fn q8(x: f32, inv: f32) -> i8 {
    (x * inv).round().clamp(-127.0, 127.0) as i8
}

/// A weight `W: [n, k]` quantized to 8 bits per block of 32 along k, packed in panels of 16
/// columns for the kernel.
pub struct PackedQ8 {
    pub n: usize,
    pub k: usize,
    /// its own memory, or a mapped file that holds the same bytes (the packed-weight cache)
    data: super::gemm::Panels<u8>,
}

impl PackedQ8 {
    /// Quantizes and packs `W: [n, k]` (row-major). `k` must be a multiple of 32.
    pub fn from_rows(w: &[f32], n: usize, k: usize) -> PackedQ8 {
        assert!(w.len() >= n * k);
        match Self::try_from_row_source(n, k, super::rows_of(w, k, k)) {
            Ok(p) => p,
            Err(e) => match e {},
        }
    }

    /// Packs `W: [n, k]` whose rows come from `rows(r0, out)` (rows `r0..r0 + out.len() / k`,
    /// row-major), one panel's rows at a time (as [`super::gemm::PackedB::try_from_row_source`]).
    pub fn try_from_row_source<E: Send>(
        n: usize,
        k: usize,
        rows: impl Fn(usize, &mut [f32]) -> Result<(), E> + Sync,
    ) -> Result<PackedQ8, E> {
        assert!(
            k.is_multiple_of(BLOCK),
            "int8 weights need k to be a multiple of {BLOCK}, got {k}"
        );
        let blocks = k / BLOCK;
        let panels = n.div_ceil(NP);
        let mut data = super::gemm::AlignedBuf::<u8>::zeros(panels * blocks * PANEL_BLOCK);
        super::fill_panels(
            data.as_mut_slice(),
            blocks * PANEL_BLOCK,
            NP,
            (n, k),
            rows,
            |cols, w, panel| {
                for b in 0..blocks {
                    let pb = &mut panel[b * PANEL_BLOCK..(b + 1) * PANEL_BLOCK];
                    for c in 0..NP {
                        let (mut scale, mut sum) = (0f32, 0i32);
                        if c < cols {
                            let src = &w[c * k + b * BLOCK..c * k + (b + 1) * BLOCK];
                            let amax = src.iter().fold(0f32, |m, &x| m.max(x.abs()));
                            scale = amax / 127.0;
                            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
                            for (t, &x) in src.iter().enumerate() {
                                let q = q8(x, inv);
                                sum += q as i32;
                                // group t/4, column c, byte t%4
                                pb[(t / 4) * NP * 4 + c * 4 + t % 4] = q as u8;
                            }
                        }
                        pb[BLOCK * NP + c * 4..BLOCK * NP + c * 4 + 4]
                            .copy_from_slice(&scale.to_le_bytes());
                        pb[BLOCK * NP + NP * 4 + c * 4..BLOCK * NP + NP * 4 + c * 4 + 4]
                            .copy_from_slice(&(-128 * sum).to_le_bytes());
                    }
                }
            },
        )?;
        Ok(PackedQ8 {
            n,
            k,
            data: super::gemm::Panels::Owned(data),
        })
    }

    /// Bytes a `[k, n]` matrix takes packed (whole panels of 16 columns; `k` whole blocks).
    pub fn packed_len(n: usize, k: usize) -> usize {
        n.div_ceil(NP) * (k / BLOCK) * PANEL_BLOCK
    }

    /// A `[k, n]` matrix whose packed bytes (as [`PackedQ8::as_bytes`] gave them) lie at
    /// `offset` in `map`. `None` if `k` is not whole blocks, or the bytes would not fit there or
    /// do not start on a 64-byte boundary: the caller packs the matrix anew.
    pub fn from_mapped(
        map: std::sync::Arc<memmap2::Mmap>,
        offset: usize,
        n: usize,
        k: usize,
    ) -> Option<PackedQ8> {
        if k == 0 || n == 0 || !k.is_multiple_of(BLOCK) {
            return None;
        }
        let data = super::gemm::Panels::mapped(map, offset, Self::packed_len(n, k))?;
        Some(PackedQ8 { n, k, data })
    }

    /// The packed bytes (integers, scales and sums, little-endian), as a cache file stores them.
    pub fn as_bytes(&self) -> &[u8] {
        self.data.as_slice()
    }

    /// Whether the bytes are read from a mapped file rather than held in memory of their own.
    pub fn is_mapped(&self) -> bool {
        self.data.is_mapped()
    }

    pub fn bytes(&self) -> usize {
        self.data.as_slice().len()
    }

    fn panel(&self, p: usize) -> &[u8] {
        let sz = self.k / BLOCK * PANEL_BLOCK;
        &self.data.as_slice()[p * sz..(p + 1) * sz]
    }
}

/// Activations `A: [m, k]` quantized per row and block of 32 as `qa + 128` (unsigned bytes, the
/// form VNNI multiplies), in strips of `MR` rows laid out as the kernel reads them: per strip
/// and block, the 8 groups of 4 bytes of its rows side by side (`[group][row][4]`, 192 bytes),
/// then the next block; the scales per strip as `[block][row]`. So the kernel's activations of a
/// block are three consecutive cache lines instead of six rows `k` bytes apart. The rows past
/// `m` in the last strip are zero (`128`, scale 0) and are never written out.
pub struct QuantA {
    pub m: usize,
    pub k: usize,
    qa: Vec<u8>,
    scales: Vec<f32>,
}

/// Bytes of one strip's block of activations: 8 groups × MR rows × 4.
const STRIP_BLOCK: usize = BLOCK * MR;

impl QuantA {
    pub fn new(a: &[f32], m: usize, k: usize, lda: usize) -> QuantA {
        assert!(k.is_multiple_of(BLOCK));
        assert!(m == 0 || a.len() >= (m - 1) * lda + k, "A is too short");
        let blocks = k / BLOCK;
        let strips = m.div_ceil(MR);
        let mut qa = vec![128u8; strips * blocks * STRIP_BLOCK];
        let mut scales = vec![0f32; strips * blocks * MR];
        if blocks > 0 {
            qa.par_chunks_mut(blocks * STRIP_BLOCK)
                .zip(scales.par_chunks_mut(blocks * MR))
                .enumerate()
                .for_each(|(st, (q, sc))| {
                    for r in 0..MR.min(m - st * MR) {
                        let i = st * MR + r;
                        quantize_row(&a[i * lda..i * lda + k], r, q, sc);
                    }
                });
        }
        QuantA { m, k, qa, scales }
    }

    /// `qa + 128` of row `r` of strip `st`, value `t` of block `b`.
    #[inline]
    fn at(&self, st: usize, b: usize, r: usize, t: usize) -> u8 {
        let blocks = self.k / BLOCK;
        self.qa[(st * blocks + b) * STRIP_BLOCK + (t / 4) * MR * 4 + r * 4 + t % 4]
    }

    /// The scale of row `r` of strip `st` in block `b`.
    #[inline]
    fn scale(&self, st: usize, b: usize, r: usize) -> f32 {
        self.scales[(st * (self.k / BLOCK) + b) * MR + r]
    }
}

crate::kernels::simd::multiversion! {
    /// Row `r` of a strip to `qa + 128` and its blocks' scales, at the machine's vector width:
    /// the rounding (`f32::round`, half away from zero) is a library call per value in a
    /// baseline x86-64 build, which made quantizing the activations a large part of `fast`'s
    /// forward. The same values in every build.
    fn quantize_row(row: &[f32], r: usize, q: &mut [u8], s: &mut [f32]) {
        for (b, src) in row.chunks_exact(BLOCK).enumerate() {
            // in lanes of 16, by comparisons (not f32::max, whose NaN rule keeps the loop from
            // vectorizing; a NaN is skipped by both)
            let mut lanes = [0f32; 16];
            for half in src.chunks_exact(16) {
                for (m, &x) in lanes.iter_mut().zip(half) {
                    let a = x.abs();
                    *m = if a > *m { a } else { *m };
                }
            }
            // then pairwise (a chain of 16 scalar maxima was the loop's critical path)
            let mut width = 16;
            while width > 1 {
                width /= 2;
                for i in 0..width {
                    let (x, y) = (lanes[i], lanes[i + width]);
                    lanes[i] = if y > x { y } else { x };
                }
            }
            let amax = lanes[0];
            s[b * MR + r] = amax / 127.0;
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            let mut bytes = [0u8; BLOCK];
            for (d, &x) in bytes.iter_mut().zip(src) {
                // q8(x, inv) + 128 without f32::round (no vector instruction rounds half away
                // from zero: LLVM calls the library per value) nor the saturating casts (a
                // scalar comparison per value each): rounded as truncation plus the exact
                // remainder's carry, and the integer v + 128 in 1..=255 read from the low
                // bits of 2^23 + v + 128
                let y = x * inv;
                let t = y.trunc();
                let rem = y - t;
                let v = if rem >= 0.5 {
                    t + 1.0
                } else if rem <= -0.5 {
                    t - 1.0
                } else {
                    t
                };
                let v = if v > 127.0 {
                    127.0
                } else if v < -127.0 {
                    -127.0
                } else if v.is_nan() {
                    0.0
                } else {
                    v
                };
                *d = (v + (128.0 + 8_388_608.0)).to_bits() as u8;
            }
            for (g, four) in bytes.chunks_exact(4).enumerate() {
                q[b * STRIP_BLOCK + g * MR * 4 + r * 4..][..4].copy_from_slice(four);
            }
        }
    }
}

/// Rows per micro-tile of the VNNI kernel (× 32 columns: 24 accumulators).
const MR: usize = 6;

/// `C[m, n] (+)= A · Wᵀ` with both sides quantized, C row-major with row stride `ldc`.
pub fn gemm_q8(a: &QuantA, w: &PackedQ8, c: &mut [f32], ldc: usize, accumulate: bool) {
    gemm_q8_on(a, w, c, ldc, accumulate, super::select::kernels().int8())
}

/// [`gemm_q8`] on `kernel`, which the CPU must run.
fn gemm_q8_on(
    a: &QuantA,
    w: &PackedQ8,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    kernel: Int8Kernel,
) {
    let (m, n, k) = (a.m, w.n, w.k);
    assert_eq!(a.k, k, "int8 GEMM: A has k = {}, W has k = {k}", a.k);
    if m == 0 || n == 0 {
        return;
    }
    assert!(c.len() >= (m - 1) * ldc + n, "C is too short");
    // tasks: pairs of panels (32 columns) × row blocks of up to 16 strips (96 rows)
    let col_tasks = n.div_ceil(2 * NP);
    let strips = m.div_ceil(MR);
    let task_strips = strips.min(16);
    let row_tasks = strips.div_ceil(task_strips);
    let cp = SendPtr(c.as_mut_ptr());
    let blocks = k / BLOCK;
    (0..col_tasks * row_tasks).into_par_iter().for_each(|t| {
        let (jt, it) = (t % col_tasks, t / col_tasks);
        let (s0, s1) = (it * task_strips, ((it + 1) * task_strips).min(strips));
        let p0 = 2 * jt;
        let two = p0 + 1 < n.div_ceil(NP);
        // f32 sums of this task's strips × 32 columns, carried across chunks of blocks: a chunk
        // of both panels (8 blocks, 10 KiB) stays in L1 while every strip passes over it
        let mut sums = vec![0f32; (s1 - s0) * MR * 2 * NP];
        let mut b0 = 0;
        while b0 < blocks {
            let b1 = (b0 + CHUNK).min(blocks);
            for (st, out) in (s0..s1).zip(sums.chunks_mut(MR * 2 * NP)) {
                tile(a, w, (st, p0, two), b0..b1, out, kernel);
            }
            b0 = b1;
        }
        let cols = (2 * NP).min(n - p0 * NP);
        let rows = (s1 * MR).min(m) - s0 * MR;
        for (rr, row) in sums.chunks(2 * NP).take(rows).enumerate() {
            // SAFETY: this task owns rows of strips s0..s1 × columns 32·jt..32·jt+32 of C.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(cp.get().add((s0 * MR + rr) * ldc + p0 * NP), cols)
            };
            for (d, &v) in dst.iter_mut().zip(row) {
                *d = if accumulate { *d + v } else { v };
            }
        }
    });
}

/// The MR rows of strip `st` × panels `p0` and `p0 + 1` (when `two`) over the blocks `bs`, added
/// to the sums in `out` (`[MR, 32]`), on `kernel`.
fn tile(
    a: &QuantA,
    w: &PackedQ8,
    (st, p0, two): (usize, usize, bool),
    bs: std::ops::Range<usize>,
    out: &mut [f32],
    kernel: Int8Kernel,
) {
    #[cfg(target_arch = "x86_64")]
    if kernel != Int8Kernel::Plain {
        // a single last panel is read twice: its second copy's sums are never written out
        let pb0 = w.panel(p0).as_ptr();
        let pb1 = w.panel(if two { p0 + 1 } else { p0 }).as_ptr();
        // SAFETY: the selection gave this kernel only where the CPU has its features; the panels
        // hold every block; the strip is in A; out holds MR rows of 32. (A last strip of fewer
        // rows too: its padding rows are zero, and each row's sums round the same way wherever it
        // sits, so the logits rows computed alone equal those of the whole sequence bit for bit.)
        unsafe {
            match kernel {
                Int8Kernel::Vnni => x86::tile_vnni(a, st, pb0, pb1, bs, out),
                _ => x86::tile_avx2(a, st, pb0, pb1, bs, out),
            }
        }
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = kernel;
    tile_scalar(a, w, st, p0, two, bs, out);
}

/// Blocks of k per chunk (see [`gemm_q8`]).
const CHUNK: usize = 8;

/// The plain kernel (CPUs without VNNI): the same integer sums and scalings, rounded as the VNNI
/// kernel rounds them (`out + (Σ · sa) · sw` in one multiply-add), for the MR rows of strip `st`
/// (padding rows give zeros) and 2 panels (32 columns).
fn tile_scalar(
    a: &QuantA,
    w: &PackedQ8,
    st: usize,
    p0: usize,
    two: bool,
    bs: std::ops::Range<usize>,
    out: &mut [f32],
) {
    for (pi, p) in [p0, p0 + 1].into_iter().enumerate() {
        if pi == 1 && !two {
            break;
        }
        let panel = w.panel(p);
        for b in bs.clone() {
            let pb = &panel[b * PANEL_BLOCK..(b + 1) * PANEL_BLOCK];
            for rr in 0..MR {
                let sa = a.scale(st, b, rr);
                for c in 0..NP {
                    let mut acc = 0i32;
                    for t in 0..BLOCK {
                        let x = a.at(st, b, rr, t);
                        acc += (x as i32 - 128) * pb[(t / 4) * NP * 4 + c * 4 + t % 4] as i8 as i32;
                    }
                    let sw = f32::from_le_bytes(
                        pb[BLOCK * NP + c * 4..][..4].try_into().expect("4 bytes"),
                    );
                    let o = &mut out[rr * 2 * NP + pi * NP + c];
                    *o = (acc as f32 * sa).mul_add(sw, *o);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// `acc + Σ₄ x(u8) · w(i8)` per 32-bit lane (`vpdpbusd`), as inline assembly: with the
    /// `_mm512_dpbusd_epi32` intrinsic this function took LLVM over 15 minutes to compile (Rust
    /// 1.95), with the instruction itself 26 s for the whole crate. Its own `target_feature`
    /// (not `inline(always)`): a `zmm_reg` operand needs AVX-512 enabled where the function is
    /// compiled, and a build for baseline x86-64 (or an AVX2-only machine's `native`) has it
    /// nowhere else; inlined into [`tile_vnni`], which has the same features.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn dpbusd(acc: __m512i, x: __m512i, w: __m512i) -> __m512i {
        // SAFETY: reached only through the CPU-feature dispatch (`simd::current`, `Isa::detect`), so
        // the CPU has this function's features; the pointers and lengths are the caller's, valid for
        // what the doc comment names.
        unsafe {
            let mut out = acc;
            std::arch::asm!("vpdpbusd {a}, {x}, {w}", a = inout(zmm_reg) out, x = in(zmm_reg) x, w = in(zmm_reg) w, options(pure, nomem, nostack));
            out
        }
    }

    /// `f + x · s` in f32 lanes, into `f`'s own register (`vfmadd231ps`): written with the
    /// intrinsic, LLVM put each block's sums in other registers and moved all twelve back at the
    /// end of every block.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn fma_into(f: &mut __m512, x: __m512, s: __m512) {
        // SAFETY: reached only through the CPU-feature dispatch (`simd::current`, `Isa::detect`), so
        // the CPU has this function's features; the pointers and lengths are the caller's, valid for
        // what the doc comment names.
        unsafe {
            std::arch::asm!("vfmadd231ps {f}, {x}, {s}", f = inout(zmm_reg) *f, x = in(zmm_reg) x, s = in(zmm_reg) s, options(pure, nomem, nostack));
        }
    }

    /// [`tile_vnni`] with AVX2 and FMA, 8 columns at a time (16 registers: 6 rows' integer sums,
    /// the weights, their magnitudes, the activations, ones): per group of 4 k-values, `|qw|` by
    /// `qa · sign(qw)` summed in pairs (`vpmaddubsw`, at most 32258: no saturation, see the
    /// module's note), the pairs summed into i32 (`vpmaddwd` by ones); each block's sums scaled
    /// as VNNI scales them (`out + (Σ · sa) · sw`, one multiply-add), so the same bits.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile_avx2(
        a: &QuantA,
        st: usize,
        pb0: *const u8,
        pb1: *const u8,
        bs: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        // SAFETY: reached only through the CPU-feature dispatch (`select::kernels`), so the CPU
        // has this function's features; the pointers and lengths are the caller's, valid for
        // what the doc comment names.
        unsafe {
            assert!(out.len() >= MR * 2 * NP && (st + 1) * MR <= a.m.div_ceil(MR) * MR);
            let blocks = a.k / BLOCK;
            let qa = a.qa.as_ptr().add(st * blocks * STRIP_BLOCK);
            let sc = a.scales.as_ptr().add(st * blocks * MR);
            let ones = _mm256_set1_epi16(1);
            let flip = _mm256_set1_epi8(-128);
            // a block's activations back from `qa + 128` to signed, once for the 4 eighths: a
            // per-row flip in a general register, moved and broadcast from there (two shuffle
            // port uops), made the kernel no faster than the f32 one
            let mut xs = [0u8; STRIP_BLOCK];
            for b in bs {
                for (i, chunk) in xs.chunks_exact_mut(32).enumerate() {
                    let v = _mm256_loadu_si256(qa.add(b * STRIP_BLOCK + i * 32) as *const __m256i);
                    _mm256_storeu_si256(
                        chunk.as_mut_ptr() as *mut __m256i,
                        _mm256_xor_si256(v, flip),
                    );
                }
                let xa = xs.as_ptr();
                // the 4 eighths of the tile's 32 columns: panel q / 2, its columns 8 · (q % 2)..
                for q in 0..4 {
                    let (pb, col) = (if q < 2 { pb0 } else { pb1 }, (q % 2) * 8);
                    let wb = pb.add(b * PANEL_BLOCK);
                    let mut acc = [_mm256_setzero_si256(); MR];
                    for g in 0..BLOCK / 4 {
                        let v = _mm256_loadu_si256(wb.add(g * NP * 4 + col * 4) as *const __m256i);
                        let mag = _mm256_abs_epi8(v);
                        for r in 0..MR {
                            // 4 signed activation bytes of row r in every lane
                            let x4 =
                                std::ptr::read_unaligned(xa.add(g * MR * 4 + r * 4) as *const i32);
                            let x = _mm256_set1_epi32(x4);
                            let pairs = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(x, v));
                            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, ones));
                        }
                    }
                    let sw = _mm256_loadu_ps(wb.add(BLOCK * NP + col * 4) as *const f32);
                    for r in 0..MR {
                        let sa = _mm256_set1_ps(*sc.add(b * MR + r));
                        let o = out.as_mut_ptr().add(r * 2 * NP + q * 8);
                        let f = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r]), sa);
                        _mm256_storeu_ps(o, _mm256_fmadd_ps(f, sw, _mm256_loadu_ps(o)));
                    }
                }
            }
        }
    }

    /// The MR rows of strip `st` × 2 panels (32 columns) over the blocks `bs`, added to the
    /// sums in `out` (`[MR, 32]`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn tile_vnni(
        a: &QuantA,
        st: usize,
        pb0: *const u8,
        pb1: *const u8,
        bs: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        // SAFETY: reached only through the CPU-feature dispatch (`simd::current`, `Isa::detect`), so
        // the CPU has this function's features; the pointers and lengths are the caller's, valid for
        // what the doc comment names.
        unsafe {
            assert!(out.len() >= MR * 2 * NP && (st + 1) * MR <= a.m.div_ceil(MR) * MR);
            let blocks = a.k / BLOCK;
            let qa = a.qa.as_ptr().add(st * blocks * STRIP_BLOCK);
            let sc = a.scales.as_ptr().add(st * blocks * MR);
            let mut f: [__m512; 2 * MR] = [_mm512_setzero_ps(); 2 * MR];
            for r in 0..MR {
                f[2 * r] = _mm512_loadu_ps(out.as_ptr().add(r * 2 * NP));
                f[2 * r + 1] = _mm512_loadu_ps(out.as_ptr().add(r * 2 * NP + NP));
            }
            for b in bs {
                let w0 = pb0.add(b * PANEL_BLOCK);
                let w1 = pb1.add(b * PANEL_BLOCK);
                // the sums start at -128 · Σ qw of their column, so they end as Σ qa · qw
                let c0 = _mm512_loadu_si512(w0.add(BLOCK * NP + NP * 4) as *const __m512i);
                let c1 = _mm512_loadu_si512(w1.add(BLOCK * NP + NP * 4) as *const __m512i);
                let mut acc: [__m512i; 2 * MR] = [_mm512_setzero_si512(); 2 * MR];
                for r in 0..MR {
                    acc[2 * r] = c0;
                    acc[2 * r + 1] = c1;
                }
                let xa = qa.add(b * STRIP_BLOCK);
                for g in 0..BLOCK / 4 {
                    let v0 = _mm512_loadu_si512(w0.add(g * NP * 4) as *const __m512i);
                    let v1 = _mm512_loadu_si512(w1.add(g * NP * 4) as *const __m512i);
                    for r in 0..MR {
                        // 4 activation bytes (already + 128) of row r in every lane
                        let x = _mm512_set1_epi32(std::ptr::read_unaligned(
                            xa.add(g * MR * 4 + r * 4) as *const i32,
                        ));
                        acc[2 * r] = dpbusd(acc[2 * r], x, v0);
                        acc[2 * r + 1] = dpbusd(acc[2 * r + 1], x, v1);
                    }
                }
                let s0 = _mm512_loadu_ps(w0.add(BLOCK * NP) as *const f32);
                let s1 = _mm512_loadu_ps(w1.add(BLOCK * NP) as *const f32);
                for r in 0..MR {
                    let sa = _mm512_set1_ps(*sc.add(b * MR + r));
                    let f0 = _mm512_cvtepi32_ps(acc[2 * r]);
                    let f1 = _mm512_cvtepi32_ps(acc[2 * r + 1]);
                    fma_into(&mut f[2 * r], _mm512_mul_ps(f0, sa), s0);
                    fma_into(&mut f[2 * r + 1], _mm512_mul_ps(f1, sa), s1);
                }
            }
            for r in 0..MR {
                _mm512_storeu_ps(out.as_mut_ptr().add(r * 2 * NP), f[2 * r]);
                _mm512_storeu_ps(out.as_mut_ptr().add(r * 2 * NP + NP), f[2 * r + 1]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The quantized product against the f64 product of the same quantized values (exact up to
    /// f32 rounding of the scales), and against the f32 product within the quantization error.
    #[test]
    fn int8_product_matches_its_definition_and_the_float_product() {
        let mut rng = crate::reference::Rng::new(21);
        for (m, k, n) in [
            (1, 32, 1),
            (7, 64, 19),
            (13, 96, 48),
            (6, 32, 32),
            (30, 256, 70),
        ] {
            let a = rng.normals(m * k, 1.0);
            let w = rng.normals(n * k, 0.1);
            let qa = QuantA::new(&a, m, k, k);
            let pw = PackedQ8::from_rows(&w, n, k);
            let mut c = vec![0f32; m * n];
            gemm_q8(&qa, &pw, &mut c, n, false);
            for i in 0..m {
                for j in 0..n {
                    // the definition, on the quantized values
                    let mut want = 0f64;
                    let mut exact = 0f64;
                    for b in 0..k / BLOCK {
                        let ra = &a[i * k + b * BLOCK..][..BLOCK];
                        let rw = &w[j * k + b * BLOCK..][..BLOCK];
                        let sa = ra.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
                        let sw = rw.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
                        let dot: i64 = ra
                            .iter()
                            .zip(rw)
                            .map(|(&x, &y)| (q8(x, 1.0 / sa) as i64) * (q8(y, 1.0 / sw) as i64))
                            .sum();
                        want += dot as f64 * sa as f64 * sw as f64;
                        exact += ra
                            .iter()
                            .zip(rw)
                            .map(|(&x, &y)| x as f64 * y as f64)
                            .sum::<f64>();
                    }
                    let got = c[i * n + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "m={m} k={k} n={n} ({i},{j}): {got} vs {want}"
                    );
                    // quantization error: each side is rounded to 1/254 of its block's range, about
                    // 1% of a product's typical size here (σ); allow 5 σ
                    let typical = (k as f64).sqrt() * 0.1;
                    assert!(
                        (got - exact).abs() < 0.05 * typical,
                        "({i},{j}): {got} vs float {exact}"
                    );
                }
            }
            // accumulate adds
            let mut c2 = vec![1.0f32; m * n];
            gemm_q8(&qa, &pw, &mut c2, n, true);
            assert!(c2
                .iter()
                .zip(&c)
                .all(|(x, y)| (x - 1.0 - y).abs() < 1e-4 * (1.0 + y.abs())));
        }
    }

    /// A row's numbers do not depend on the rows beside it (the logits rows of the last layer
    /// run alone): the last row alone, in a strip of padding, gives the bits it gets among the
    /// others, on every kernel this CPU has; and VNNI and AVX2 give the plain kernel's bits (the
    /// same exact integer sums, each block's scaled in one multiply-add). Every row count from 1
    /// to 2 strips and more (several row tasks), one panel or several, and weights and
    /// activations at ±127 in every byte (the AVX2 pairs' largest sums: 2 · 127 · 127).
    #[test]
    fn rows_are_independent_and_every_kernel_gives_the_plain_kernels_bits() {
        let mut kernels = vec![Int8Kernel::Plain];
        for (has, kernel, name) in [
            (avx2_supported(), Int8Kernel::Avx2, "AVX2 and FMA"),
            (vnni_supported(), Int8Kernel::Vnni, "AVX-512 VNNI"),
        ] {
            if has {
                kernels.push(kernel);
            } else {
                eprintln!("NOTE: this CPU has no {name}: its int8 kernel is not tested");
            }
        }
        let bits = |r: &[f32]| r.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut rng = crate::reference::Rng::new(5);
        let small = (1..=2 * MR + 1)
            .flat_map(|m| [(64, 16), (96, 48), (32, 70), (512, 20)].map(|(k, n)| (m, k, n)));
        for (case, (m, k, n)) in small.chain([(200, 64, 16), (203, 64, 100)]).enumerate() {
            let (mut a, mut w) = (rng.normals(m * k, 1.0), rng.normals(n * k, 0.1));
            if case % 3 == 0 {
                // every block's bytes at ±127: signs alternating or not, both sides
                let sign = |i: usize, p: usize| if (i / p).is_multiple_of(2) { 1.0 } else { -1.0 };
                a.iter_mut()
                    .enumerate()
                    .for_each(|(i, x)| *x = sign(i, 1 + case % 2));
                w.iter_mut()
                    .enumerate()
                    .for_each(|(i, x)| *x = 0.5 * sign(i, 2));
            }
            let qa = QuantA::new(&a, m, k, k);
            let pw = PackedQ8::from_rows(&w, n, k);
            let last = QuantA::new(&a[(m - 1) * k..], 1, k, k);
            let mut plain = vec![0f32; m * n];
            gemm_q8_on(&qa, &pw, &mut plain, n, false, Int8Kernel::Plain);
            for &kernel in &kernels {
                let mut c = vec![0f32; m * n];
                gemm_q8_on(&qa, &pw, &mut c, n, false, kernel);
                for (i, (p, v)) in plain.chunks(n).zip(c.chunks(n)).enumerate() {
                    assert_eq!(bits(p), bits(v), "m={m} k={k} n={n} {kernel:?}: row {i}");
                }
                let mut alone = vec![0f32; n];
                gemm_q8_on(&last, &pw, &mut alone, n, false, kernel);
                assert_eq!(
                    bits(&alone),
                    bits(&c[(m - 1) * n..]),
                    "m={m} k={k} n={n}: the last row alone ({kernel:?})"
                );
            }
        }
    }

    #[test]
    fn zero_blocks_stay_zero() {
        let (m, k, n) = (6, 64, 32);
        let a = vec![0f32; m * k];
        let w = vec![0.5f32; n * k];
        let mut c = vec![7f32; m * n];
        gemm_q8(
            &QuantA::new(&a, m, k, k),
            &PackedQ8::from_rows(&w, n, k),
            &mut c,
            n,
            false,
        );
        assert!(c.iter().all(|&x| x == 0.0));
    }

    /// The packed bytes written to a file and mapped back (as the packed-weight cache does) give
    /// the same products bit for bit; a mapping that is too short, off a 64-byte boundary or of a
    /// depth that is not whole blocks is refused.
    #[test]
    fn mapped_blocks_give_the_same_products() {
        use std::io::Write;
        let mut rng = crate::reference::Rng::new(5);
        let (m, k, n) = (13, 96, 40);
        let a = rng.normals(m * k, 1.0);
        let w = rng.normals(n * k, 0.1);
        let owned = PackedQ8::from_rows(&w, n, k);
        assert!(!owned.is_mapped());
        assert_eq!(owned.as_bytes().len(), PackedQ8::packed_len(n, k));
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[0u8; 4096]).unwrap();
        f.write_all(owned.as_bytes()).unwrap();
        // SAFETY: a private temporary file nobody else writes
        let map = std::sync::Arc::new(unsafe { memmap2::Mmap::map(&f) }.unwrap());
        let mapped = PackedQ8::from_mapped(map.clone(), 4096, n, k).unwrap();
        assert!(mapped.is_mapped());
        let qa = QuantA::new(&a, m, k, k);
        let (mut c1, mut c2) = (vec![0f32; m * n], vec![1f32; m * n]);
        gemm_q8(&qa, &owned, &mut c1, n, false);
        gemm_q8(&qa, &mapped, &mut c2, n, false);
        assert!(c1.iter().zip(&c2).all(|(x, y)| x.to_bits() == y.to_bits()));
        assert!(
            PackedQ8::from_mapped(map.clone(), 4096 + 64, n, k).is_none(),
            "too short"
        );
        assert!(
            PackedQ8::from_mapped(map.clone(), 32, n, k).is_none(),
            "off a boundary"
        );
        assert!(
            PackedQ8::from_mapped(map, 4096, n, k - 1).is_none(),
            "not whole blocks"
        );
    }
}
