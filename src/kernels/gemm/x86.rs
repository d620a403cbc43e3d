//! The x86 micro-kernels of [`super`]: AVX-512 (12 × 32) and AVX2 + FMA (6 × 16), and the
//! 16 × 16 transpose.

use std::arch::x86_64::*;

// The AVX-512 micro-kernel is written out in assembly: as Rust intrinsics, the same source
// compiled to a clean loop in one build and, after an edit elsewhere in the crate, to one
// that hoisted the four unrolled steps' broadcasts to the loop's top and spilled 66 of them
// to the stack (the forward with every projection on this kernel went from 8-9 s to 14 s at
// 2,048 tokens). Here the registers are fixed: C's 12 × 32 tile in zmm0-23 (row r in
// zmm2r, zmm2r+1), B's two vectors of a step in zmm24-25, A's broadcasts rotating through
// zmm26-31. Each accumulator gets the same fused multiply-adds in the same order as before
// (k ascending), so the bits are unchanged.

/// One row of a step: broadcast A's value (at the address pieces) into `zmm$t`, then two
/// fused multiply-adds into the row's accumulators.
macro_rules! row {
    ($t:literal, $c0:literal, $c1:literal, $($addr:literal),+) => {
        concat!(
            "vbroadcastss zmm", $t, ", dword ptr [", $($addr),+, "]\n",
            "vfmadd231ps zmm", $c0, ", zmm24, zmm", $t, "\n",
            "vfmadd231ps zmm", $c1, ", zmm25, zmm", $t, "\n",
        )
    };
}

/// Step `$u` of an iteration: B's 32 values (and a prefetch, [`b_step`]), then the 12
/// rows, A read in place: rows 0-2 at `a0`, `a0 + l`, `a0 + 2l`, rows 3-5 from `a3`, and
/// so on.
macro_rules! step_direct {
    ($u:literal) => {
        concat!(
            b_step!($u),
            row!(26, 0, 1, "{a0} + 4*", $u),
            row!(27, 2, 3, "{a0} + {l} + 4*", $u),
            row!(28, 4, 5, "{a0} + {l}*2 + 4*", $u),
            row!(29, 6, 7, "{a3} + 4*", $u),
            row!(30, 8, 9, "{a3} + {l} + 4*", $u),
            row!(31, 10, 11, "{a3} + {l}*2 + 4*", $u),
            row!(26, 12, 13, "{a6} + 4*", $u),
            row!(27, 14, 15, "{a6} + {l} + 4*", $u),
            row!(28, 16, 17, "{a6} + {l}*2 + 4*", $u),
            row!(29, 18, 19, "{a9} + 4*", $u),
            row!(30, 20, 21, "{a9} + {l} + 4*", $u),
            row!(31, 22, 23, "{a9} + {l}*2 + 4*", $u),
        )
    };
}

/// Step `$u` with A packed: the step's 12 values side by side at `a0 + 48u`.
macro_rules! step_packed {
    ($u:literal) => {
        concat!(
            b_step!($u),
            row!(26, 0, 1, "{a0} + 48*", $u),
            row!(27, 2, 3, "{a0} + 48*", $u, " + 4"),
            row!(28, 4, 5, "{a0} + 48*", $u, " + 8"),
            row!(29, 6, 7, "{a0} + 48*", $u, " + 12"),
            row!(30, 8, 9, "{a0} + 48*", $u, " + 16"),
            row!(31, 10, 11, "{a0} + 48*", $u, " + 20"),
            row!(26, 12, 13, "{a0} + 48*", $u, " + 24"),
            row!(27, 14, 15, "{a0} + 48*", $u, " + 28"),
            row!(28, 16, 17, "{a0} + 48*", $u, " + 32"),
            row!(29, 18, 19, "{a0} + 48*", $u, " + 36"),
            row!(30, 20, 21, "{a0} + 48*", $u, " + 40"),
            row!(31, 22, 23, "{a0} + 48*", $u, " + 44"),
        )
    };
}

/// B's two vectors of step `$u` into zmm24-25, and a prefetch of the lines 16 steps on
/// (B's panel is 1,024 deep, 128 KiB, more than L1; measured on the default model at 2,048
/// tokens, paired runs: the forward 0.02-0.15 s faster (1.4% on average) than with the
/// hardware prefetcher alone; a prefetch past the panel's end never faults).
macro_rules! b_step {
    ($u:literal) => {
        concat!(
            "prefetcht0 [{b} + 128*",
            $u,
            " + 2048]\n",
            "prefetcht0 [{b} + 128*",
            $u,
            " + 2112]\n",
            "vmovups zmm24, [{b} + 128*",
            $u,
            "]\n",
            "vmovups zmm25, [{b} + 128*",
            $u,
            " + 64]\n",
        )
    };
}

/// The loop over depth around `$step` (four steps an iteration, then one at a time; the
/// loop's own work once per four steps measured 5-9% faster than once per step), `$adv4` /
/// `$adv1` moving A on and B moving `$b4` / `$b1` bytes, then C: `C (+)= acc`, row by row
/// from `c` at `ldc` bytes. `$zero` clears the accumulators, `$c` gives C's rows (`add`,
/// `store`). Shared by both widths.
macro_rules! kernel_loop {
    ($step:ident, $adv4:literal, $adv1:literal, $b4:literal, $b1:literal, $zero:ident, $c:ident) => {
        concat!(
            $zero!(),
            "test {n4}, {n4}\n",
            "jz 3f\n",
            "2:\n",
            $step!(0),
            $step!(1),
            $step!(2),
            $step!(3),
            $adv4,
            "add {b}, ",
            $b4,
            "\n",
            "dec {n4}\n",
            "jnz 2b\n",
            "3:\n",
            "test {rem}, {rem}\n",
            "jz 5f\n",
            "4:\n",
            $step!(0),
            $adv1,
            "add {b}, ",
            $b1,
            "\n",
            "dec {rem}\n",
            "jnz 4b\n",
            "5:\n",
            "test {acc}, {acc}\n",
            "jz 6f\n",
            "mov {b}, {c}\n",
            $c!(add),
            "6:\n",
            "mov {b}, {c}\n",
            $c!(store),
            // the upper halves clean again for the caller's SSE code (as the compiler
            // does for a function using AVX; without it the first SSE instruction after
            // each call stalled: 4% of a forward's samples)
            "vzeroupper\n",
        )
    };
}

/// One row of C, at `{b}`, then `{b}` on to the next: `add`, the accumulators `$w$c0`,
/// `$w$c1` plus C's row (the sum `acc + c`, as the intrinsics' `add(acc, c)`); `store`,
/// them into it. `$half`: bytes in one register.
macro_rules! c_row {
    (add, $w:literal, $half:literal, $c0:literal, $c1:literal) => {
        concat!(
            "vaddps ",
            $w,
            $c0,
            ", ",
            $w,
            $c0,
            ", [{b}]\n",
            "vaddps ",
            $w,
            $c1,
            ", ",
            $w,
            $c1,
            ", [{b} + ",
            $half,
            "]\n",
            "add {b}, {ldc}\n",
        )
    };
    (store, $w:literal, $half:literal, $c0:literal, $c1:literal) => {
        concat!(
            "vmovups [{b}], ",
            $w,
            $c0,
            "\n",
            "vmovups [{b} + ",
            $half,
            "], ",
            $w,
            $c1,
            "\n",
            "add {b}, {ldc}\n",
        )
    };
}

/// `$op` (`add`, `store`) on the 12 rows of the AVX-512 tile.
macro_rules! c_512 {
    ($op:ident) => {
        concat!(
            c_row!($op, "zmm", "64", 0, 1),
            c_row!($op, "zmm", "64", 2, 3),
            c_row!($op, "zmm", "64", 4, 5),
            c_row!($op, "zmm", "64", 6, 7),
            c_row!($op, "zmm", "64", 8, 9),
            c_row!($op, "zmm", "64", 10, 11),
            c_row!($op, "zmm", "64", 12, 13),
            c_row!($op, "zmm", "64", 14, 15),
            c_row!($op, "zmm", "64", 16, 17),
            c_row!($op, "zmm", "64", 18, 19),
            c_row!($op, "zmm", "64", 20, 21),
            c_row!($op, "zmm", "64", 22, 23),
        )
    };
}

/// `$op` (`add`, `store`) on the 6 rows of the AVX2 tile.
macro_rules! c_256 {
    ($op:ident) => {
        concat!(
            c_row!($op, "ymm", "32", 0, 1),
            c_row!($op, "ymm", "32", 2, 3),
            c_row!($op, "ymm", "32", 4, 5),
            c_row!($op, "ymm", "32", 6, 7),
            c_row!($op, "ymm", "32", 8, 9),
            c_row!($op, "ymm", "32", 10, 11),
        )
    };
}

/// `$op $w$r, $w$r, $w$r` for each register `r`: zeros.
macro_rules! zero {
    ($op:literal, $w:literal, $($r:literal),+) => {
        concat!($($op, " ", $w, $r, ", ", $w, $r, ", ", $w, $r, "\n"),+)
    };
}

macro_rules! zero_512 {
    () => {
        zero!(
            "vpxord", "zmm", 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19,
            20, 21, 22, 23
        )
    };
}

macro_rules! zero_256 {
    () => {
        zero!("vxorps", "ymm", 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)
    };
}

/// Runs a micro-kernel's assembly: A's operands as given (they differ between A in place and
/// packed), then B, the depth (four steps an iteration, then the rest), C, its row stride in
/// bytes and whether to add to it, with every vector register of the kernel's width clobbered.
macro_rules! run_kernel {
    ($template:expr, ($b:expr, $kc:expr, $c:expr, $ldc:expr, $acc:expr), $regs:ident, $($a:tt)*) => {
        run_kernel!(@regs $regs, $template, $($a)*
            b = inout(reg) $b => _,
            n4 = inout(reg) $kc / 4 => _,
            rem = inout(reg) $kc % 4 => _,
            c = in(reg) $c,
            ldc = in(reg) $ldc * 4,
            acc = in(reg) $acc as usize,
        )
    };
    (@regs zmm, $template:expr, $($ops:tt)*) => {
        std::arch::asm!(
            $template,
            $($ops)*
            out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
            out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
            out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
            out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
            out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _,
            out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _,
            out("zmm24") _, out("zmm25") _, out("zmm26") _, out("zmm27") _,
            out("zmm28") _, out("zmm29") _, out("zmm30") _, out("zmm31") _,
            options(nostack),
        )
    };
    (@regs ymm, $template:expr, $($ops:tt)*) => {
        std::arch::asm!(
            $template,
            $($ops)*
            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
            out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
            out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
            out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
            options(nostack),
        )
    };
}

/// `C[12, 32] (+)= A[12, kc] · B[kc, 32]`: B packed (32 values a step), A packed (12 a
/// step) or, `DIRECT`, read in place (row `r` at `a + r·lda`).
#[target_feature(enable = "avx512f")]
pub unsafe fn kernel_avx512<const DIRECT: bool>(
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    // SAFETY: reached only through the CPU-feature dispatch (`simd::current`, `Isa::detect`), so
    // the CPU has this function's features; the pointers and lengths are the caller's, valid for
    // what the doc comment names.
    unsafe {
        const MR: usize = 12;
        // C's tile is read (or written) after the loop: start bringing it in now
        for r in 0..MR {
            _mm_prefetch::<_MM_HINT_T0>(c.add(r * ldc) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(c.add(r * ldc + 16) as *const i8);
        }
        if DIRECT {
            run_kernel!(
                kernel_loop!(
                    step_direct,
                    "add {a0}, 16\nadd {a3}, 16\nadd {a6}, 16\nadd {a9}, 16\n",
                    "add {a0}, 4\nadd {a3}, 4\nadd {a6}, 4\nadd {a9}, 4\n",
                    "512",
                    "128",
                    zero_512,
                    c_512
                ),
                (b, kc, c, ldc, accumulate),
                zmm,
                a0 = inout(reg) a => _,
                a3 = inout(reg) a.wrapping_add(3 * lda) => _,
                a6 = inout(reg) a.wrapping_add(6 * lda) => _,
                a9 = inout(reg) a.wrapping_add(9 * lda) => _,
                l = in(reg) lda * 4,
            );
        } else {
            run_kernel!(
                kernel_loop!(
                    step_packed,
                    "add {a0}, 192\n",
                    "add {a0}, 48\n",
                    "512",
                    "128",
                    zero_512,
                    c_512
                ),
                (b, kc, c, ldc, accumulate),
                zmm,
                a0 = inout(reg) a => _,
            );
        }
    }
}

// The AVX2 micro-kernel, in assembly for the same reason (its 6 × 16 tile, B's two vectors
// and a broadcast take all 16 ymm registers, so a compiler's choice to hoist loads would spill
// here too): C in ymm0-11 (row r in ymm2r, ymm2r+1), B in ymm12-13, A's broadcasts in
// ymm14-15. The same fused multiply-adds in the same order as the intrinsics it replaces.

macro_rules! row8 {
    ($t:literal, $c0:literal, $c1:literal, $($addr:literal),+) => {
        concat!(
            "vbroadcastss ymm", $t, ", dword ptr [", $($addr),+, "]\n",
            "vfmadd231ps ymm", $c0, ", ymm12, ymm", $t, "\n",
            "vfmadd231ps ymm", $c1, ", ymm13, ymm", $t, "\n",
        )
    };
}

macro_rules! b8_step {
    ($u:literal) => {
        concat!(
            "vmovups ymm12, [{b} + 64*",
            $u,
            "]\n",
            "vmovups ymm13, [{b} + 64*",
            $u,
            " + 32]\n",
        )
    };
}

macro_rules! step8_direct {
    ($u:literal) => {
        concat!(
            b8_step!($u),
            row8!(14, 0, 1, "{a0} + 4*", $u),
            row8!(15, 2, 3, "{a0} + {l} + 4*", $u),
            row8!(14, 4, 5, "{a0} + {l}*2 + 4*", $u),
            row8!(15, 6, 7, "{a3} + 4*", $u),
            row8!(14, 8, 9, "{a3} + {l} + 4*", $u),
            row8!(15, 10, 11, "{a3} + {l}*2 + 4*", $u),
        )
    };
}

macro_rules! step8_packed {
    ($u:literal) => {
        concat!(
            b8_step!($u),
            row8!(14, 0, 1, "{a0} + 24*", $u),
            row8!(15, 2, 3, "{a0} + 24*", $u, " + 4"),
            row8!(14, 4, 5, "{a0} + 24*", $u, " + 8"),
            row8!(15, 6, 7, "{a0} + 24*", $u, " + 12"),
            row8!(14, 8, 9, "{a0} + 24*", $u, " + 16"),
            row8!(15, 10, 11, "{a0} + 24*", $u, " + 20"),
        )
    };
}

/// `C[6, 16] (+)= A[6, kc] · B[kc, 16]`, as [`kernel_avx512`].
#[target_feature(enable = "avx2,fma")]
pub unsafe fn kernel_avx2<const DIRECT: bool>(
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    // SAFETY: reached only through the CPU-feature dispatch (`simd::current`, `Isa::detect`), so
    // the CPU has this function's features; the pointers and lengths are the caller's, valid for
    // what the doc comment names.
    unsafe {
        const MR: usize = 6;
        for r in 0..MR {
            _mm_prefetch::<_MM_HINT_T0>(c.add(r * ldc) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(c.add(r * ldc + 8) as *const i8);
        }
        if DIRECT {
            run_kernel!(
                kernel_loop!(
                    step8_direct,
                    "add {a0}, 16\nadd {a3}, 16\n",
                    "add {a0}, 4\nadd {a3}, 4\n",
                    "256",
                    "64",
                    zero_256,
                    c_256
                ),
                (b, kc, c, ldc, accumulate),
                ymm,
                a0 = inout(reg) a => _,
                a3 = inout(reg) a.wrapping_add(3 * lda) => _,
                l = in(reg) lda * 4,
            );
        } else {
            run_kernel!(
                kernel_loop!(
                    step8_packed,
                    "add {a0}, 96\n",
                    "add {a0}, 24\n",
                    "256",
                    "64",
                    zero_256,
                    c_256
                ),
                (b, kc, c, ldc, accumulate),
                ymm,
                a0 = inout(reg) a => _,
            );
        }
    }
}

/// Transposes the 16×16 block at `src` (row stride `lds`) into `dst` (row stride `ldd`):
/// `dst[j·ldd + i] = src[i·lds + j]`, by three rounds of in-register shuffles.
#[target_feature(enable = "avx512f")]
pub unsafe fn transpose16x16(src: *const f32, lds: usize, dst: *mut f32, ldd: usize) {
    // SAFETY: reached only through the CPU-feature dispatch (`simd::current`, `Isa::detect`), so
    // the CPU has this function's features; the pointers and lengths are the caller's, valid for
    // what the doc comment names.
    unsafe {
        let mut r = [_mm512_setzero_ps(); 16];
        for (i, ri) in r.iter_mut().enumerate() {
            *ri = _mm512_loadu_ps(src.add(i * lds));
        }
        // pairs of rows interleaved, then pairs of pairs (as doubles): each 128-bit lane L of
        // u[4g + c] holds element 4L + c of rows 4g..4g + 4
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        let pd = |x: __m512| _mm512_castps_pd(x);
        let mut u = [_mm512_setzero_ps(); 16];
        for g in 0..4 {
            let b = 4 * g;
            u[b] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[b]), pd(t[b + 2])));
            u[b + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[b]), pd(t[b + 2])));
            u[b + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[b + 1]), pd(t[b + 3])));
            u[b + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[b + 1]), pd(t[b + 3])));
        }
        // then the 128-bit lanes: groups (0, 1) and (2, 3), then those halves
        for h in 0..2 {
            let b = 8 * h;
            for c in 0..4 {
                t[b + c] = _mm512_shuffle_f32x4::<0x88>(u[b + c], u[b + 4 + c]);
                t[b + 4 + c] = _mm512_shuffle_f32x4::<0xdd>(u[b + c], u[b + 4 + c]);
            }
        }
        for c in 0..8 {
            r[c] = _mm512_shuffle_f32x4::<0x88>(t[c], t[8 + c]);
            r[8 + c] = _mm512_shuffle_f32x4::<0xdd>(t[c], t[8 + c]);
        }
        for (j, rj) in r.iter().enumerate() {
            _mm512_storeu_ps(dst.add(j * ldd), *rj);
        }
    }
}
