//! The decode step's products `y = W · x` (one new token: a matrix-vector product per
//! projection) straight from a GGUF file's blocks: each block is dequantized in registers to the
//! very values the file's dequantization gives (candle's and gguf-py's, which
//! `model/weights/quant.rs` reproduces: the same operations in the same order, one f32 rounding
//! each, never fused) and multiplied by the f32 activation, so a step reads the file's bytes (491
//! MB on the default model) instead of f32 panels (1.4 GB): a decode step reads every weight
//! once, and its limit is the memory bandwidth over those bytes.
//!
//! The sums: weight `i` of a row goes to lane `i % 16`, the 16 lanes summed at the end in a
//! fixed tree (`ops::dot16`'s order, the output head's), so every vector width (AVX-512, AVX2 +
//! FMA, the build's baseline: `crate::kernels::simd::multiversion`) gives the same bits, and
//! the output head's logits are the bits of its chunked f32 path. Against the f32 GEMM's order
//! (the prefill's products) a row differs only by the rounding of the sums. Rows are split across
//! the threads. Pure Rust on slices, no candle: hand-written AVX-512 and AVX2 bodies (`x86`)
//! for the quantized types, the compiler's vectorization of the portable bodies elsewhere. The
//! default for every decode step ([`chosen`]; `ATTNSCOPE_DECODE=panels` multiplies from the
//! packed panels instead).

use crate::kernels::simd::multiversion;

/// The block types this kernel reads (the four real models' projection and head types).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blocks {
    F32,
    F16,
    Bf16,
    /// 34 bytes: f16 `d`, 32 × i8; `w = q · d`
    Q8_0,
    /// 22 bytes: f16 `d`, u32 fifth bits, 16 bytes of nibbles; `w = (q5 − 16) · d`
    Q5_0,
    /// 20 bytes: f16 `d`, f16 `m`, 16 bytes of nibbles; `w = q · d + m`
    Q4_1,
    /// 144 bytes per 256: f16 `d`, f16 `dmin`, 12 bytes of six-bit scales and mins, 128 of
    /// nibbles; `w = (d · sc) · q − dmin · m`
    Q4K,
    /// 210 bytes per 256: 128 bytes of low nibbles, 64 of high bit pairs, 16 × i8 scales, f16
    /// `d`; `w = (d · sc) · (q6 − 32)`
    Q6K,
}

impl Blocks {
    /// `(weights, bytes)` per block.
    pub fn block(self) -> (usize, usize) {
        match self {
            Blocks::F32 => (16, 64),
            Blocks::F16 | Blocks::Bf16 => (16, 32),
            Blocks::Q8_0 => (32, 34),
            Blocks::Q5_0 => (32, 22),
            Blocks::Q4_1 => (32, 20),
            Blocks::Q4K => (256, 144),
            Blocks::Q6K => (256, 210),
        }
    }

    /// Bytes of a row of `k` weights (`k` a multiple of the block).
    pub fn row_bytes(self, k: usize) -> usize {
        let (w, b) = self.block();
        k / w * b
    }
}

/// One part of a (possibly fused) matrix: `rows` rows of `k` weights, `ty` blocks, row-major.
#[derive(Clone, Copy)]
pub struct Part<'a> {
    pub bytes: &'a [u8],
    pub ty: Blocks,
    pub rows: usize,
}

/// Rows per task of the threads.
const ROWS_PER_TASK: usize = 32;

/// `out[r] (+)= W_r · x` for the rows of the parts stacked (`out.len()` of them in all), each of
/// `x.len()` weights; with `accumulate`, added to what `out` holds (one rounding, after the row's
/// sum). Rows are split across rayon's threads.
pub fn matvec(parts: &[Part], x: &[f32], out: &mut [f32], accumulate: bool) {
    use rayon::prelude::*;
    let k = x.len();
    let total: usize = parts.iter().map(|p| p.rows).sum();
    assert_eq!(out.len(), total, "matvec: one output per row");
    let mut rest = &mut out[..];
    for p in parts {
        let (w, _) = p.ty.block();
        assert!(
            k.is_multiple_of(w) && p.bytes.len() >= p.rows * p.ty.row_bytes(k),
            "matvec: {:?} rows of {k} weights need whole blocks",
            p.ty
        );
        let (mine, tail) = rest.split_at_mut(p.rows);
        rest = tail;
        let rb = p.ty.row_bytes(k);
        mine.par_chunks_mut(ROWS_PER_TASK)
            .enumerate()
            .for_each(|(t, ys)| {
                let r0 = t * ROWS_PER_TASK;
                rows(
                    p.ty,
                    &p.bytes[r0 * rb..(r0 + ys.len()) * rb],
                    x,
                    ys,
                    accumulate,
                );
            });
    }
}

/// The rows in `bytes` (`ys.len()` of them) times `x`, serially.
pub fn rows(ty: Blocks, bytes: &[u8], x: &[f32], ys: &mut [f32], accumulate: bool) {
    let rb = ty.row_bytes(x.len());
    assert!(
        bytes.len() >= ys.len() * rb,
        "rows: {} rows of {:?} need {} bytes",
        ys.len(),
        ty,
        ys.len() * rb
    );
    #[cfg(target_arch = "x86_64")]
    {
        use crate::kernels::simd::{current, Level};
        let bytes = &bytes[..ys.len() * rb];
        let done = match current() {
            // SAFETY: `current` names only a level whose features this CPU has (AVX-512
            // F/BW/DQ/VL); the kernel reads `ys.len()` whole rows of `rb` bytes (checked
            // above) and `x.len()` weights a row.
            Level::Avx512 => unsafe { x86::rows_avx512(ty, bytes, rb, x, ys, accumulate) },
            // SAFETY: as above, AVX2 and FMA.
            Level::Avx2 => unsafe { x86::rows_avx2(ty, bytes, rb, x, ys, accumulate) },
            _ => false,
        };
        if done {
            return;
        }
    }
    let f = match ty {
        Blocks::F32 => rows_f32,
        Blocks::F16 => rows_f16,
        Blocks::Bf16 => rows_bf16,
        Blocks::Q8_0 => rows_q8_0,
        Blocks::Q5_0 => rows_q5_0,
        Blocks::Q4_1 => rows_q4_1,
        Blocks::Q4K => rows_q4k,
        Blocks::Q6K => rows_q6k,
    };
    f(bytes, rb, x, ys, accumulate);
}

/// `acc[i % 16] += w[i] · x[i]` over 32 weights.
#[inline(always)]
fn acc32(acc: &mut [f32; 16], w: &[f32; 32], x: &[f32]) {
    let x = &x[..32];
    for i in 0..16 {
        acc[i] += w[i] * x[i];
    }
    for i in 0..16 {
        acc[i] += w[16 + i] * x[16 + i];
    }
}

/// The lanes summed in `ops::dot16`'s tree.
#[inline(always)]
fn reduce(acc: &[f32; 16]) -> f32 {
    let mut half = [0f32; 8];
    for i in 0..8 {
        half[i] = acc[i] + acc[i + 8];
    }
    let q = [
        half[0] + half[4],
        half[1] + half[5],
        half[2] + half[6],
        half[3] + half[7],
    ];
    (q[0] + q[2]) + (q[1] + q[3])
}

/// A block's f16 at byte `at`, as f32 (exact).
#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Stores a row's sum.
#[inline(always)]
fn put(y: &mut f32, acc: &[f32; 16], accumulate: bool) {
    let s = reduce(acc);
    *y = if accumulate { *y + s } else { s };
}

/// Every row of `bytes` (`rb` bytes each) through `block(bytes of a block, x of its weights,
/// lanes)`, `wb` bytes and `ww` weights a block.
#[inline(always)]
fn each_row(
    (bytes, rb): (&[u8], usize),
    (wb, ww): (usize, usize),
    x: &[f32],
    ys: &mut [f32],
    accumulate: bool,
    block: impl Fn(&[u8], &[f32], &mut [f32; 16]),
) {
    for (row, y) in bytes.chunks_exact(rb).zip(ys.iter_mut()) {
        let mut acc = [0f32; 16];
        for (b, xs) in row.chunks_exact(wb).zip(x.chunks_exact(ww)) {
            block(b, xs, &mut acc);
        }
        put(y, &acc, accumulate);
    }
}

multiversion! {
    fn rows_f32(bytes: &[u8], rb: usize, x: &[f32], ys: &mut [f32], accumulate: bool) {
        each_row((bytes, rb), (64, 16), x, ys, accumulate, |b, xs, acc| {
            for i in 0..16 {
                let w = f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
                acc[i] += w * xs[i];
            }
        });
    }
}

multiversion! {
    fn rows_f16(bytes: &[u8], rb: usize, x: &[f32], ys: &mut [f32], accumulate: bool) {
        each_row((bytes, rb), (32, 16), x, ys, accumulate, |b, xs, acc| {
            for i in 0..16 {
                acc[i] += f16_at(b, 2 * i) * xs[i];
            }
        });
    }
}

multiversion! {
    fn rows_bf16(bytes: &[u8], rb: usize, x: &[f32], ys: &mut [f32], accumulate: bool) {
        each_row((bytes, rb), (32, 16), x, ys, accumulate, |b, xs, acc| {
            for i in 0..16 {
                let w = f32::from_bits((u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32) << 16);
                acc[i] += w * xs[i];
            }
        });
    }
}

multiversion! {
    fn rows_q8_0(bytes: &[u8], rb: usize, x: &[f32], ys: &mut [f32], accumulate: bool) {
        each_row((bytes, rb), (34, 32), x, ys, accumulate, |b, xs, acc| {
            let d = f16_at(b, 0);
            let mut w = [0f32; 32];
            for i in 0..32 {
                w[i] = b[2 + i] as i8 as f32 * d;
            }
            acc32(acc, &w, xs);
        });
    }
}

multiversion! {
    fn rows_q5_0(bytes: &[u8], rb: usize, x: &[f32], ys: &mut [f32], accumulate: bool) {
        each_row((bytes, rb), (22, 32), x, ys, accumulate, |b, xs, acc| {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let mut w = [0f32; 32];
            for j in 0..16 {
                let q = b[6 + j] as u32;
                let x0 = ((q & 0x0F) | (((qh >> j) << 4) & 0x10)) as i32 - 16;
                let x1 = ((q >> 4) | ((qh >> (j + 12)) & 0x10)) as i32 - 16;
                w[j] = x0 as f32 * d;
                w[16 + j] = x1 as f32 * d;
            }
            acc32(acc, &w, xs);
        });
    }
}

multiversion! {
    fn rows_q4_1(bytes: &[u8], rb: usize, x: &[f32], ys: &mut [f32], accumulate: bool) {
        each_row((bytes, rb), (20, 32), x, ys, accumulate, |b, xs, acc| {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let mut w = [0f32; 32];
            for j in 0..16 {
                let q = b[4 + j];
                w[j] = (q & 0x0F) as f32 * d + m;
                w[16 + j] = (q >> 4) as f32 * d + m;
            }
            acc32(acc, &w, xs);
        });
    }
}

/// Q4_K's six-bit scale and min of sub-block `j` (candle's `get_scale_min_k4`).
#[inline(always)]
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

multiversion! {
    fn rows_q4k(bytes: &[u8], rb: usize, x: &[f32], ys: &mut [f32], accumulate: bool) {
        each_row((bytes, rb), (144, 256), x, ys, accumulate, |b, xs, acc| {
            let (d, min) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            for s in 0..4 {
                let q = &b[16 + 32 * s..16 + 32 * s + 32];
                let (sc, m) = scale_min_k4(2 * s, scales);
                let (d1, m1) = (d * sc as f32, min * m as f32);
                let (sc, m) = scale_min_k4(2 * s + 1, scales);
                let (d2, m2) = (d * sc as f32, min * m as f32);
                let (mut lo, mut hi) = ([0f32; 32], [0f32; 32]);
                for i in 0..32 {
                    lo[i] = d1 * (q[i] & 0xF) as f32 - m1;
                    hi[i] = d2 * (q[i] >> 4) as f32 - m2;
                }
                acc32(acc, &lo, &xs[64 * s..]);
                acc32(acc, &hi, &xs[64 * s + 32..]);
            }
        });
    }
}

multiversion! {
    fn rows_q6k(bytes: &[u8], rb: usize, x: &[f32], ys: &mut [f32], accumulate: bool) {
        each_row((bytes, rb), (210, 256), x, ys, accumulate, |b, xs, acc| {
            let d = f16_at(b, 208);
            for h in 0..2 {
                let ql = &b[64 * h..64 * h + 64];
                let qh = &b[128 + 32 * h..128 + 32 * h + 32];
                let sc = &b[192 + 8 * h..192 + 8 * h + 8];
                let mut w = [[0f32; 32]; 4];
                for l in 0..32 {
                    let is = l / 16;
                    let q = [
                        ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32,
                        ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32,
                        ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32,
                        ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32,
                    ];
                    for t in 0..4 {
                        w[t][l] = d * sc[is + 2 * t] as i8 as f32 * q[t] as f32;
                    }
                }
                for (t, w) in w.iter().enumerate() {
                    acc32(acc, w, &xs[128 * h + 32 * t..]);
                }
            }
        });
    }
}

#[cfg(target_arch = "x86_64")]
mod x86;

/// Whether decode steps multiply from the file's blocks: yes by default and with
/// `ATTNSCOPE_DECODE=blocks`, no with `ATTNSCOPE_DECODE=panels`. Measured side by side on a
/// 2-core Sapphire Rapids Xeon (`bench --machine`, 500-token prompt, 32 new tokens): the default
/// model (Q5_0, Q8_0, Q4_K, Q6_K) 26.8 tokens/s from the blocks against 9.9-10.1 from the
/// panels (AMX tiles), 24.0 against 7.4 with `ATTNSCOPE_ISA=avx2` (f32 panels), 26.1 against 3.3
/// with `--memory low`; SmolLM2 (Q4_1...) 50.9 against 17.2; Gemma 3 25.5 against 14.1. A decode
/// step's product sums in `ops::dot16`'s order rather than the GEMM's: the same products, the
/// sums within f32 rounding. Every entry point has called [`check`] (through
/// `kernels::select::check`) first; a value it refuses stops here.
pub fn chosen() -> bool {
    match from_env() {
        Ok(blocks) => *blocks,
        Err(e) => panic!("{e}"),
    }
}

/// Whether `ATTNSCOPE_DECODE` names a way to decode: the command line and the model loaders
/// refuse (exit 2) with its message.
pub fn check() -> Result<(), String> {
    from_env().as_ref().map(|_| ()).map_err(Clone::clone)
}

fn from_env() -> &'static Result<bool, String> {
    use std::sync::OnceLock;
    static CHOICE: OnceLock<Result<bool, String>> = OnceLock::new();
    CHOICE.get_or_init(|| parse(std::env::var("ATTNSCOPE_DECODE").ok().as_deref()))
}

/// `ATTNSCOPE_DECODE`'s value: `blocks` or unset → true, `panels` → false, anything else an
/// error that names it and the values accepted.
fn parse(value: Option<&str>) -> Result<bool, String> {
    match value {
        None | Some("blocks") => Ok(true),
        Some("panels") => Ok(false),
        Some(other) => Err(format!(
            "ATTNSCOPE_DECODE={other} names no way to decode; use blocks (decode steps multiply \
             straight from the file's blocks, the default) or panels (from the packed panels), \
             or leave it unset"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::parse;

    /// `blocks` (or unset) and `panels` are the two ways; anything else is refused naming the
    /// value and both accepted ones.
    #[test]
    fn decode_values_are_blocks_or_panels() {
        assert_eq!(parse(None), Ok(true));
        assert_eq!(parse(Some("panels")), Ok(false));
        assert_eq!(parse(Some("blocks")), Ok(true));
        for bad in ["", "Blocks", "on", "1"] {
            let e = parse(Some(bad)).expect_err(bad);
            assert!(
                e.contains(&format!("ATTNSCOPE_DECODE={bad} names no way to decode"))
                    && e.contains("use blocks")
                    && e.contains("or panels"),
                "{e}"
            );
        }
    }
}
