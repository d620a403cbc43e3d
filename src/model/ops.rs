//! The forward's row-wise operations: RoPE tables and rotation, splitting and merging heads,
//! RMSNorm and LayerNorm, the MLP activations (SwiGLU, GeGLU, GELU), and the output head's logits.
//! Plain f32 buffers; the layer loop is in `forward`.

use super::attention::fast_exp;
use super::config::RopeStyle;
use super::error::{Error, Result};
use super::weights::{Head, Mapped};
use crate::kernels::simd::multiversion;
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod tiles;

/// cos/sin tables `[n, inv.len()]` for positions `0..n` from the inverse frequencies `inv`.
pub fn rope_tables_of(inv: &[f32], n: usize) -> (Vec<f32>, Vec<f32>) {
    let half = inv.len();
    let mut cos = Vec::with_capacity(n * half);
    let mut sin = Vec::with_capacity(n * half);
    for t in 0..n {
        for &f in inv {
            let angle = (t as f32 * f) as f64;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

/// Rotates one head vector in place by the angles of one position (`cos`, `sin`: `[d/2]`).
/// `Neox` pairs dimension `i` with `i + d/2` (Hugging Face's `rotate_half`); `Interleaved` pairs
/// `2i` with `2i + 1` (llama.cpp's row order of llama GGUF files).
#[inline]
pub(crate) fn rotate(x: &mut [f32], cos: &[f32], sin: &[f32], style: RopeStyle) {
    let half = x.len() / 2;
    match style {
        RopeStyle::Neox => {
            let (a, b) = x.split_at_mut(half);
            for i in 0..half {
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * cos[i] - x2 * sin[i];
                b[i] = x1 * sin[i] + x2 * cos[i];
            }
        }
        RopeStyle::Interleaved => {
            for i in 0..half {
                let (x1, x2) = (x[2 * i], x[2 * i + 1]);
                x[2 * i] = x1 * cos[i] - x2 * sin[i];
                x[2 * i + 1] = x1 * sin[i] + x2 * cos[i];
            }
        }
    }
}

/// Columns `c0..c0 + heads·d` of each row of `src: [m, width]`, as `[heads, m, d]`, each head
/// vector rotated for its position when `rope` is given (`(cos, sin, style)`, tables from row 0).
pub(crate) fn split_heads(
    src: &[f32],
    m: usize,
    width: usize,
    c0: usize,
    heads: usize,
    d: usize,
    rope: Option<(&[f32], &[f32], RopeStyle)>,
) -> Vec<f32> {
    let mut out = vec![0f32; heads * m * d];
    split_heads_into(src, m, width, c0, heads, d, rope, &mut out);
    out
}

/// [`split_heads`] into `out` (`heads · m · d` floats, every one overwritten).
#[allow(clippy::too_many_arguments)]
pub(crate) fn split_heads_into(
    src: &[f32],
    m: usize,
    width: usize,
    c0: usize,
    heads: usize,
    d: usize,
    rope: Option<(&[f32], &[f32], RopeStyle)>,
    out: &mut [f32],
) {
    out[..heads * m * d]
        .par_chunks_mut(m * d)
        .enumerate()
        .for_each(|(h, dst)| {
            for (r, v) in dst.chunks_mut(d).enumerate() {
                v.copy_from_slice(&src[r * width + c0 + h * d..][..d]);
                if let Some((cos, sin, style)) = rope {
                    // the tables' width is half the rotated dimensions: the first 2·half of each head
                    // rotate (all of them unless the rotary factor is partial), the rest pass through
                    let half = cos.len() / m.max(1);
                    rotate(
                        &mut v[..2 * half],
                        &cos[r * half..][..half],
                        &sin[r * half..][..half],
                        style,
                    );
                }
            }
        });
}

/// `[heads, m, d]` → `[m, heads, d]` (the hook layout).
pub(crate) fn merge_heads(x: &[f32], heads: usize, m: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for h in 0..heads {
        for r in 0..m {
            out[(r * heads + h) * d..][..d].copy_from_slice(&x[(h * m + r) * d..][..d]);
        }
    }
    out
}

/// RMSNorm of each `[width]` row [Zhang & Sennrich 2019]: `x / sqrt(mean(x²) + eps) · w`, the
/// mean accumulated in f64.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    rms_norm_into(x, w, eps, &mut out);
    out
}

/// [`rms_norm`] into `out[..x.len()]`.
pub(crate) fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let width = w.len();
    let out = &mut out[..x.len()];
    let norm_rows = |(src, dst): (&[f32], &mut [f32])| {
        dst.copy_from_slice(src);
        rms_norm_in_place(dst, w, eps);
    };
    if x.len() >= 1 << 16 {
        x.par_chunks(width)
            .zip(out.par_chunks_mut(width))
            .for_each(norm_rows);
    } else {
        x.chunks(width)
            .zip(out.chunks_mut(width))
            .for_each(norm_rows);
    }
}

/// RMSNorm of one vector in place, as [`rms_norm`] computes each row.
pub(crate) fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let ms = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / ((ms as f32) + eps).sqrt();
    x.iter_mut().zip(w).for_each(|(v, &g)| *v = *v * inv * g);
}

/// A norm's two parts, as [`rms_norm_in_place`] and [`layer_norm_into`] compute them: each
/// row's scale (`sqrt(mean(x²) + eps)`; LayerNorm: `sqrt(var + eps)`, `[m]`) and the rows it
/// divides (LayerNorm: centered), `[m, width]`. `row · (1 / scale) · w (+ b)` is the norm.
pub(crate) fn norm_parts(
    kind: super::block::NormKind,
    x: &[f32],
    width: usize,
    eps: f32,
) -> (Vec<f32>, Vec<f32>) {
    let mut scale = Vec::with_capacity(x.len() / width);
    let mut rows = x.to_vec();
    for row in rows.chunks_mut(width) {
        match kind {
            super::block::NormKind::Rms => {
                let ms = row.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / width as f64;
                scale.push(((ms as f32) + eps).sqrt());
            }
            super::block::NormKind::Layer => {
                let mean = row.iter().map(|&v| v as f64).sum::<f64>() / width as f64;
                let var =
                    row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / width as f64;
                scale.push(((var as f32) + eps).sqrt());
                let mean = mean as f32;
                row.iter_mut().for_each(|v| *v -= mean);
            }
        }
    }
    (scale, rows)
}

/// LayerNorm of each `[width]` row [Ba et al. 2016]: `(x − mean) / sqrt(var + eps) · w + b`,
/// mean and variance accumulated in f64 (GPT-2).
pub fn layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    layer_norm_into(x, w, b, eps, &mut out);
    out
}

/// [`layer_norm`] into `out[..x.len()]`.
pub(crate) fn layer_norm_into(x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
    let width = w.len();
    out[..x.len()]
        .par_chunks_mut(width)
        .zip(x.par_chunks(width))
        .for_each(|(dst, src)| {
            let mean = src.iter().map(|&v| v as f64).sum::<f64>() / width as f64;
            let var = src.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / width as f64;
            let inv = 1.0 / ((var as f32) + eps).sqrt();
            let mean = mean as f32;
            for (((d, &v), &g), &bb) in dst.iter_mut().zip(src).zip(w).zip(b) {
                *d = (v - mean) * inv * g + bb;
            }
        });
}

/// GeLU in its tanh form, `½x(1 + tanh(√(2/π)(x + 0.044715x³)))` (GPT-2's `gelu_new`,
/// transformers' `gelu_pytorch_tanh`).
#[inline]
pub(crate) fn gelu_tanh_of(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // √(2/π)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
}

/// erf(z) in f64: its Maclaurin series up to |z| = 4 (the terms' largest is ~1e5 there, so
/// ~1e-11 is lost to cancellation), beyond it ±(1 − erfc(|z|)) with erfc's asymptotic series
/// (four terms: relative error < 1e-4 of erfc(4) = 1.5e-8), so the GeLU of a large negative
/// input keeps its tiny value.
pub(crate) fn erf64(z: f64) -> f64 {
    if z.abs() > 4.0 {
        let a = z.abs();
        let a2 = a * a;
        let series = 1.0 - 1.0 / (2.0 * a2) + 3.0 / (4.0 * a2 * a2) - 15.0 / (8.0 * a2 * a2 * a2);
        let erfc = (-a2).exp() / (a * std::f64::consts::PI.sqrt()) * series;
        return z.signum() * (1.0 - erfc);
    }
    // erf z = 2/√π Σ (−1)ⁿ z^(2n+1) / (n! (2n+1))
    let (z2, mut term, mut sum) = (z * z, z, z);
    for n in 1..200 {
        term *= -z2 / n as f64;
        let add = term / (2 * n + 1) as f64;
        sum += add;
        if add.abs() < 1e-17 * sum.abs().max(1e-300) {
            break;
        }
    }
    sum * std::f64::consts::FRAC_2_SQRT_PI
}

/// erfc(z) for z ≥ 0 in f64 by the Chebyshev fit of Numerical Recipes (`erfcc`, §6.2):
/// relative error below 1.1e-7 everywhere (checked against Python's `math.erfc` on a grid of
/// 0..12 in steps of 1e-4), one exponential ([`exp64`]) and ten multiply-adds instead of a
/// series.
#[inline(always)]
fn erfc_nonneg(z: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    t * exp64(-z * z + poly)
}

/// e^a in f64 for a ≤ 709, within 2e-16 relative of the true value (below f64's rounding of
/// libm's `exp` to a few ulps; tested against it), written without branches or calls so that a
/// loop of it vectorizes: libm's scalar `exp` in [`gelu_erf`] took a third of `embed`'s time
/// (a profile of all-MiniLM-L6-v2 on 1,000 sentences). Below -708 it returns e^-708 (~3e-308),
/// which every caller here multiplies down to an f32 0. `a = n·ln2 + r` with n the nearest
/// integer to a/ln2 (the 1.5·2^52 trick, as [`fast_exp`] does in f32) and ln2 split in two
/// (fdlibm's `ln2_hi`/`ln2_lo`, so `n·ln2_hi` is exact), |r| ≤ ln2/2; e^r by its Taylor series to
/// r^12 (the next term is below 1.7e-16), 2^n from n's bits.
#[inline(always)]
pub(crate) fn exp64(a: f64) -> f64 {
    // a plain comparison (not f64::max, whose NaN rule keeps it from vectorizing)
    let a = if a > -708.0 { a } else { -708.0 };
    const MAGIC: f64 = 6_755_399_441_055_744.0;
    const LN2_HI: f64 = 0.693_147_180_369_123_8;
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    let t = a * std::f64::consts::LOG2_E + MAGIC;
    let n = t - MAGIC;
    let r = (a - n * LN2_HI) - n * LN2_LO;
    // Σ r^k / k! for k ≤ 12, by Horner
    const INV_FACT: [f64; 13] = [
        1.0,
        1.0,
        1.0 / 2.0,
        1.0 / 6.0,
        1.0 / 24.0,
        1.0 / 120.0,
        1.0 / 720.0,
        1.0 / 5_040.0,
        1.0 / 40_320.0,
        1.0 / 362_880.0,
        1.0 / 3_628_800.0,
        1.0 / 39_916_800.0,
        1.0 / 479_001_600.0,
    ];
    let mut p = INV_FACT[12];
    for &c in INV_FACT[..12].iter().rev() {
        p = p * r + c;
    }
    // 2^n from the integer n in t's low mantissa bits (t = 1.5·2^52 + n), in integer lanes;
    // n lies in -1022..=1023 here, so n + 1023 is a normal exponent
    let e = t.to_bits().wrapping_sub(MAGIC.to_bits()).wrapping_add(1023) << 52;
    p * f64::from_bits(e)
}

/// The erf GeLU, `½x(1 + erf(x/√2))` = `½x·erfc(−x/√2)` (BERT's `gelu`; torch's default),
/// in f64 through [`erfc_nonneg`] (a Chebyshev fit of erfc): computed to 1.1e-7 relative (about
/// one f32 ulp) at every x, the tiny values of large negative inputs included. Without branches
/// (a select), so a loop of it vectorizes ([`gelu_erf`]); the same bits at every width.
#[inline(always)]
pub(crate) fn gelu_erf_of(x: f32) -> f32 {
    let x = x as f64;
    let z = x * std::f64::consts::FRAC_1_SQRT_2;
    let e = erfc_nonneg(z.abs());
    let cdf2 = if z <= 0.0 { e } else { 2.0 - e };
    (0.5 * x * cdf2) as f32
}

multiversion! {
    /// [`gelu_erf_of`] of each element of `x` into `out`, at the machine's vector width.
    pub(crate) fn gelu_erf_lanes(x: &[f32], out: &mut [f32]) {
        for (d, &g) in out.iter_mut().zip(x) {
            *d = gelu_erf_of(g);
        }
    }
}

/// [`gelu_erf_of`] of every element (BERT's MLP).
pub(crate) fn gelu_erf(x: &[f32], out: &mut [f32]) {
    out.par_chunks_mut(4096)
        .zip(x.par_chunks(4096))
        .for_each(|(d, s)| gelu_erf_lanes(s, d));
}

/// [`gelu_tanh_of`] of every element (GPT-2's MLP).
pub(crate) fn gelu_tanh(x: &[f32], out: &mut [f32]) {
    out.par_chunks_mut(4096)
        .zip(x.par_chunks(4096))
        .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, &g)| *d = gelu_tanh_of(g)));
}

/// GeLU(gate) · up over rows of `gu: [rows, 2·ff]` (Gemma's MLP), GeLU in its tanh form as
/// transformers' `gelu_pytorch_tanh`: `½x(1 + tanh(√(2/π)(x + 0.044715x³)))`.
pub(crate) fn geglu_tanh(gu: &[f32], ff: usize, out: &mut [f32]) {
    out.par_chunks_mut(ff)
        .zip(gu.par_chunks(2 * ff))
        .for_each(|(d, s)| {
            let (g, u) = s.split_at(ff);
            for ((d, &g), &u) in d.iter_mut().zip(g).zip(u) {
                *d = gelu_tanh_of(g) * u;
            }
        });
}

/// SiLU(gate) · up over rows of `gu: [rows, 2·ff]` (gate then up) into `out: [rows, ff]`.
/// SiLU(x) = x · σ(x) [Elfwing et al. 2018]; σ from `e^-|x|` so the exponential never overflows.
pub(crate) fn swiglu(gu: &[f32], ff: usize, out: &mut [f32]) {
    let act = |(src, dst): (&[f32], &mut [f32])| {
        let (g, u) = src.split_at(ff);
        swiglu_row(g, u, dst);
    };
    if out.len() >= 1 << 15 {
        gu.par_chunks(2 * ff)
            .zip(out.par_chunks_mut(ff))
            .for_each(act);
    } else {
        gu.chunks(2 * ff).zip(out.chunks_mut(ff)).for_each(act);
    }
}

multiversion! {
    /// `out = SiLU(g) · u`, element by element (one row of [`swiglu`]).
    pub(crate) fn swiglu_row(g: &[f32], u: &[f32], out: &mut [f32]) {
        for ((d, &g), &u) in out.iter_mut().zip(g).zip(u) {
            let e = fast_exp(-g.abs());
            let sig = if g >= 0.0 {
                1.0 / (1.0 + e)
            } else {
                e / (1.0 + e)
            };
            *d = g * sig * u;
        }
    }
}

multiversion! {
    /// The backward of [`swiglu_row`]: from `da = ∂/∂out`, `dg = da · u · σ(g)(1 + g(1 − σ(g)))`
    /// and `du = da · SiLU(g)` (σ as the forward computes it).
    pub(crate) fn swiglu_backward_row(g: &[f32], u: &[f32], da: &[f32], dg: &mut [f32], du: &mut [f32]) {
        let rows = g.iter().zip(u).zip(da).zip(dg.iter_mut().zip(du.iter_mut()));
        for (((&g, &u), &da), (dg, du)) in rows {
            let e = fast_exp(-g.abs());
            let sig = if g >= 0.0 {
                1.0 / (1.0 + e)
            } else {
                e / (1.0 + e)
            };
            *dg = da * u * sig * (1.0 + g * (1.0 - sig));
            *du = da * g * sig;
        }
    }
}

/// `dst ← src` with stores that bypass the cache where the CPU has AVX-512 (a finished
/// pattern row, which nothing here reads again: no line of it is fetched before being
/// overwritten, none evicts the working set); a plain copy elsewhere. Call [`stream_fence`]
/// before another thread reads `dst`.
pub(crate) fn stream_store(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "stream_store: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512 is available; the lengths are equal
        unsafe { stream_store_avx512(dst, src) };
        return;
    }
    dst.copy_from_slice(src);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn stream_store_avx512(dst: &mut [f32], src: &[f32]) {
    // SAFETY: reached only through the CPU-feature dispatch (`simd::current`, `Isa::detect`), so
    // the CPU has this function's features; the pointers and lengths are the caller's, valid for
    // what the doc comment names.
    unsafe {
        use std::arch::x86_64::*;
        let n = dst.len();
        let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
        // up to the first 64-byte boundary of dst (< 16 values) and the tail by masked stores (not
        // calls of memcpy), the whole lines between streamed
        let masked = |at: usize, len: usize| {
            let m = ((1u32 << len) - 1) as __mmask16;
            _mm512_mask_storeu_ps(d.add(at), m, _mm512_maskz_loadu_ps(m, s.add(at)));
        };
        let head = d.align_offset(64);
        if head >= 16 {
            // not on a 4-byte boundary (no &mut [f32] is): plainly
            dst.copy_from_slice(src);
            return;
        }
        let head = head.min(n);
        masked(0, head);
        let mut i = head;
        while i + 16 <= n {
            _mm512_stream_ps(d.add(i), _mm512_loadu_ps(s.add(i)));
            i += 16;
        }
        masked(i, n - i);
    }
}

/// Orders [`stream_store`]'s stores before the thread's later ones.
pub(crate) fn stream_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no operands; SSE is part of x86_64
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

multiversion! {
    /// `xs ← xs · f` (the softmax's normalization and rescale).
    pub(crate) fn scale_by(xs: &mut [f32], f: f32) {
        xs.iter_mut().for_each(|x| *x *= f);
    }
}
/// The logits `h · Wᵀ` of `rows` normalized rows `h: [rows, d]`. An f32 head (a float file's,
/// or the file's blocks dequantized a chunk of vocabulary rows at a time: the same values) is
/// read in chunks on every core (`dense_logits`): candle's matmul of `h` by the transposed
/// `[vocab, d]` head took ~35% of `faithfulness`'s time (one row per forward). `fast`'s
/// quantized head goes through candle.
pub fn logits_rows(head: &Head, h: Vec<f32>, rows: usize, d: usize) -> Result<Vec<Vec<f32>>> {
    logits_rows_as(head, h, rows, d, false)
}

/// [`logits_rows`], with `from_blocks` (a decode step's forward,
/// [`super::forward::RunOptions::decode_step`], unless `ATTNSCOPE_DECODE=panels`) one row of a
/// quantized file's head multiplied straight from its blocks.
pub fn logits_rows_as(
    head: &Head,
    h: Vec<f32>,
    rows: usize,
    d: usize,
    from_blocks: bool,
) -> Result<Vec<Vec<f32>>> {
    match head {
        Head::Rows(m) if d > 0 && m.cols() == d => {
            let vocab = m.dims.iter().product::<usize>() / d;
            // one row (a decode step): straight from the blocks, the same bits (dot16's order)
            let blocks = rows == 1 && from_blocks;
            if let (true, Some(dec)) = (blocks, super::weights::matvec::Decoder::of_mapped(m)) {
                let mut out = vec![0f32; vocab];
                dec.matvec(&h, &mut out, false);
                return Ok(vec![out]);
            }
            dense_logits(&h, rows, d, vocab, HeadRows::Blocks(m))
        }
        Head::Dense(w) => {
            let w = w.to_dtype(DType::F32)?.contiguous()?;
            let w = w.flatten_all()?;
            let (storage, layout) = w.storage_and_layout();
            let candle_core::Storage::Cpu(cpu) = &*storage else {
                unreachable!("attnscope runs on the CPU")
            };
            let (start, end) = layout.contiguous_offsets().expect("made contiguous above");
            let w = &cpu.as_slice::<f32>()?[start..end];
            if d == 0 || w.len() % d != 0 {
                return Err(Error::HeadShape(format!(
                    "an output matrix of {} values is not rows of {d}",
                    w.len()
                )));
            }
            dense_logits(&h, rows, d, w.len() / d, HeadRows::Slice(w))
        }
        Head::Rows(m) => Err(Error::HeadShape(format!(
            "an output matrix of shape {:?} for rows of {d}",
            m.dims
        ))),
        Head::Quant(q) => {
            let h = Tensor::from_vec(h, (rows, d), &Device::Cpu)?;
            Ok(candle_core::Module::forward(q, &h)?
                .to_dtype(DType::F32)?
                .to_vec2()?)
        }
    }
}

/// Vocabulary rows of f32 output heads per task of [`dense_logits`].
const LOGIT_CHUNK: usize = 256;

/// Where [`dense_logits`] reads the output head's rows: f32 values, or a file's blocks.
enum HeadRows<'a> {
    Slice(&'a [f32]),
    Blocks(&'a Mapped),
}

impl HeadRows<'_> {
    /// Vocabulary rows `v0..v0 + n`, `d` values each (dequantized into `buf` if need be).
    fn rows<'s>(
        &'s self,
        v0: usize,
        n: usize,
        d: usize,
        buf: &'s mut Vec<f32>,
    ) -> Result<&'s [f32]> {
        match self {
            HeadRows::Slice(w) => Ok(&w[v0 * d..(v0 + n) * d]),
            HeadRows::Blocks(m) => {
                buf.resize(n * d, 0.0);
                m.rows_to_f32(v0, &mut buf[..n * d])?;
                Ok(&buf[..n * d])
            }
        }
    }
}

/// The logits of `rows` rows `h` (`[rows, d]`) against a `vocab`-row head: chunks of
/// vocabulary rows on every core, each writing its stretch of every output row in place; a
/// quantized head is dequantized a chunk at a time into the worker's own buffer.
fn dense_logits(
    h: &[f32],
    rows: usize,
    d: usize,
    vocab: usize,
    src: HeadRows,
) -> Result<Vec<Vec<f32>>> {
    // each row allocated zeroed (`vec![row; rows]` would copy the first row into every other)
    let mut out: Vec<Vec<f32>> = (0..rows).map(|_| vec![0f32; vocab]).collect();
    let mut chunks: Vec<Vec<&mut [f32]>> = (0..vocab.div_ceil(LOGIT_CHUNK))
        .map(|_| Vec::with_capacity(rows))
        .collect();
    for row in out.iter_mut() {
        for (c, stretch) in row.chunks_mut(LOGIT_CHUNK).enumerate() {
            chunks[c].push(stretch);
        }
    }
    chunks
        .into_par_iter()
        .enumerate()
        .try_for_each_init(Vec::new, |buf, (c, mut dst)| {
            let v0 = c * LOGIT_CHUNK;
            let n = LOGIT_CHUNK.min(vocab - v0);
            let w = src.rows(v0, n, d, buf)?;
            dot_rows(h, w, d, &mut dst);
            Ok::<_, Error>(())
        })?;
    Ok(out)
}

/// `x · y` over 16 lanes, the lanes then summed in a fixed order (the same bits at every vector
/// width: no lane sees another's values before the end).
#[inline(always)]
pub fn dot16(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (xs, ys) = (x.chunks_exact(16), y.chunks_exact(16));
    let tail = tail_dot(xs.remainder(), ys.remainder());
    for (a, b) in xs.zip(ys) {
        for k in 0..16 {
            acc[k] += a[k] * b[k];
        }
    }
    lanes_sum(&acc, tail)
}

/// The products of [`dot16`]'s tail (the values of `d` beyond its last 16), summed in order.
#[inline(always)]
fn tail_dot(x: &[f32], y: &[f32]) -> f32 {
    x.iter().zip(y).map(|(a, b)| a * b).sum()
}

/// [`dot16`]'s fixed tree over its 16 lanes, then the tail's products.
#[inline(always)]
fn lanes_sum(acc: &[f32; 16], tail: f32) -> f32 {
    let mut half = [0f32; 8];
    for k in 0..8 {
        half[k] = acc[k] + acc[k + 8];
    }
    let quarter = [
        half[0] + half[4],
        half[1] + half[5],
        half[2] + half[6],
        half[3] + half[7],
    ];
    (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]) + tail
}

/// `out[i][v] = h_i · w_v` for the rows `w_v` of `w` (`d` values each) and the rows `h_i` of
/// `h: [out.len(), d]`, each [`dot16`]'s bits whatever the number of rows and the tile: on
/// AVX-512 and AVX2 in register tiles (`ops/tiles.rs`: 4 x 6 and 3 x 2), elsewhere in
/// `dot_rows_lanes`'s 4 x 2.
pub fn dot_rows(h: &[f32], w: &[f32], d: usize, out: &mut [&mut [f32]]) {
    #[cfg(target_arch = "x86_64")]
    if d > 0 {
        use crate::kernels::simd::{current, Level};
        match current() {
            // SAFETY: `current` names AVX-512 only where the CPU has it (F, BW, DQ, VL); the
            // kernel checks the shapes
            Level::Avx512 => return unsafe { tiles::dot_rows_avx512(h, w, d, out) },
            // SAFETY: as above, AVX2 and FMA
            Level::Avx2 => return unsafe { tiles::dot_rows_avx2(h, w, d, out) },
            Level::Base => {}
        }
    }
    dot_rows_lanes(h, w, d, out)
}

/// [`dot_rows`] in safe code at the build's baseline width: 4 rows of `h` against 2 of `w` at a
/// time ([`dot16_4x2`]), so each 16 values loaded serve several products (one row at a time,
/// two loads per multiply-add held `corpus`'s logits of 64 texts a forward to ~22% of its time:
/// a profile of the 224 built-in texts on the default model).
fn dot_rows_lanes(h: &[f32], w: &[f32], d: usize, out: &mut [&mut [f32]]) {
    let (rows, nv) = (out.len(), w.len() / d.max(1));
    let quads = rows / 4 * 4;
    let mut v = 0;
    while v + 2 <= nv {
        let (w0, w1) = (&w[v * d..(v + 1) * d], &w[(v + 1) * d..(v + 2) * d]);
        for i in (0..quads).step_by(4) {
            let r = dot16_4x2(&h[i * d..(i + 4) * d], w0, w1, d);
            for (a, r) in r.iter().enumerate() {
                out[i + a][v] = r[0];
                out[i + a][v + 1] = r[1];
            }
        }
        for (i, row) in out.iter_mut().enumerate().skip(quads) {
            row[v] = dot16(&h[i * d..(i + 1) * d], w0);
            row[v + 1] = dot16(&h[i * d..(i + 1) * d], w1);
        }
        v += 2;
    }
    if v < nv {
        for (i, row) in out.iter_mut().enumerate() {
            row[v] = dot16(&h[i * d..(i + 1) * d], &w[v * d..(v + 1) * d]);
        }
    }
}

/// [`dot16`] of each of the 4 rows of `h` (`[4, d]`) with `w0` and with `w1`, the same bits:
/// each product's 16 lanes are summed in the same order and reduced by [`lanes_sum`].
#[inline(always)]
fn dot16_4x2(h: &[f32], w0: &[f32], w1: &[f32], d: usize) -> [[f32; 2]; 4] {
    let mut acc = [[[0f32; 16]; 2]; 4];
    let full = d / 16 * 16;
    for c in (0..full).step_by(16) {
        let (b0, b1) = (&w0[c..c + 16], &w1[c..c + 16]);
        for (r, acc) in acc.iter_mut().enumerate() {
            let a = &h[r * d + c..r * d + c + 16];
            for k in 0..16 {
                acc[0][k] += a[k] * b0[k];
                acc[1][k] += a[k] * b1[k];
            }
        }
    }
    let mut out = [[0f32; 2]; 4];
    for (r, o) in out.iter_mut().enumerate() {
        let a = &h[r * d..(r + 1) * d];
        for (j, w) in [w0, w1].into_iter().enumerate() {
            o[j] = lanes_sum(&acc[r][j], tail_dot(&a[full..], &w[full..]));
        }
    }
    out
}
