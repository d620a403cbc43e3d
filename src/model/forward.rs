//! The forward pass: embeddings → blocks → final norm → logits, on plain f32 buffers, with
//! every hook point handed to an [`Observer`]. The projections run on the packed GEMM of
//! [`crate::kernels::gemm`] (q|k|v and gate|up fused); [`attention`] is the crate's one fast
//! attention, explicit (`QKᵀ·scale → mask → softmax in f32 → ·V`) so the weights can be
//! captured, fused per head and query block with an online softmax, so a long sequence never
//! needs a whole `[heads, n, n]` at once. It is tested against [`crate::reference`] on tiny
//! models and against Hugging Face transformers on the real ones.

use super::capture::{Hook, Observer};
use super::config::RopeStyle;
use super::error::{Error, Result};
use super::weights::{Head, Mapped};
use super::Model;
use crate::kernels::gemm::{self, Isa, PackedB};
use crate::kernels::simd::multiversion;
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;
use std::time::{Duration, Instant};

/// Options of one forward.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Positions whose next-token logits to compute (the output projection is ~1/3 of the work
    /// of a small model, so only what is asked is computed). Usually the last position.
    pub logits_at: Vec<usize>,
    /// Key positions hidden from every other query in every layer and head (attention
    /// knockout); a token still sees itself, so no row is empty.
    pub knockout: Vec<usize>,
    /// Upper bound for one `[heads, rows, keys]` score block of whole rows (patterns asked
    /// for), in bytes; streamed blocks take a quarter of it. 8 MiB keeps a block in the
    /// last-level cache: measured here, 64 MiB blocks made attention 2.2x slower at 1,024
    /// tokens (3.43 s against 1.58 s), 4 MiB was no better than 8.
    pub block_bytes: usize,
    /// Return every layer's keys and values (after RoPE) so later runs can reuse a prefix.
    pub keep_kv: bool,
    /// Keys per block of the streaming softmax (when no pattern is captured).
    pub key_block: usize,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            logits_at: Vec::new(),
            knockout: Vec::new(),
            block_bytes: 8 << 20,
            keep_kv: false,
            key_block: 1024,
        }
    }
}

/// One variant in [`Model::forward_batch`]: `tokens` as positions `reuse..reuse + m`, after the
/// first `reuse` positions of the shared prefix; `knockout` and `logits_at` are absolute positions
/// among the new ones.
#[derive(Clone, Debug)]
pub struct Segment<'a> {
    pub tokens: &'a [u32],
    pub reuse: usize,
    pub knockout: Vec<usize>,
    pub logits_at: Vec<usize>,
}

/// Where a forward starts when it does not start at the embeddings: `layer`'s input residual
/// stream (`hook_resid_pre`), `[Σ segment lengths, d_model]` (the segments' new positions, stacked).
/// An intervention at layer `l` leaves every earlier layer as it was, so an edited run resumes
/// from the clean run's residual at `l` and computes only the layers from `l` on.
#[derive(Clone, Debug)]
pub struct Resume {
    pub layer: usize,
    pub resid: Vec<f32>,
}

/// Hands the activation at `hook` to the observer: the live buffer to an editing observer (what
/// it writes flows on; a non-finite value is refused), a read-only view to one that watches.
fn hand(
    obs: &mut dyn Observer,
    layer: usize,
    hook: Hook,
    shape: &[usize],
    data: &mut [f32],
) -> Result<()> {
    if obs.edits(layer, hook) {
        let name = || super::capture::hook_name(layer, hook);
        obs.edit(layer, hook, shape, data)
            .map_err(|msg| Error::Hook { name: name(), msg })?;
        if !all_finite(data) {
            return Err(Error::Hook {
                name: name(),
                msg: "left a non-finite value (NaN or infinity) in the activation; refused".into(),
            });
        }
    }
    if obs.wants(layer, hook) {
        // a watching observer sees what flows on, edited or not
        obs.tensor(layer, hook, shape, data);
    }
    Ok(())
}

/// Collects one segment's whole attention maps at one layer (for [`attention_edited`]) and hands
/// everything else to the observer it wraps.
struct MapTap<'a> {
    inner: &'a mut dyn Observer,
    layer: usize,
    /// absolute position of query row 0, query rows, keys, heads
    offset: usize,
    rows: usize,
    k_len: usize,
    /// `[heads, rows, k_len]`: masked scores -inf, masked weights 0
    scores: Vec<f32>,
    pattern: Vec<f32>,
}

impl Observer for MapTap<'_> {
    fn wants(&self, layer: usize, hook: Hook) -> bool {
        (layer == self.layer && hook.is_attention_map()) || self.inner.wants(layer, hook)
    }
    fn tensor(&mut self, layer: usize, hook: Hook, shape: &[usize], data: &[f32]) {
        self.inner.tensor(layer, hook, shape, data)
    }
    fn attention_block(
        &mut self,
        layer: usize,
        hook: Hook,
        q_start: usize,
        shape: [usize; 3],
        data: &[f32],
    ) {
        if layer != self.layer {
            return self
                .inner
                .attention_block(layer, hook, q_start, shape, data);
        }
        let [heads, rows, kw] = shape;
        let dest = if hook == Hook::AttnScores {
            &mut self.scores
        } else {
            &mut self.pattern
        };
        let r0 = q_start - self.offset;
        for h in 0..heads {
            for r in 0..rows {
                dest[(h * self.rows + r0 + r) * self.k_len..][..kw]
                    .copy_from_slice(&data[(h * rows + r) * kw..][..kw]);
            }
        }
    }
    fn wants_stats(&self, layer: usize) -> Option<StatsRequest> {
        self.inner.wants_stats(layer)
    }
    fn attention_stats(&mut self, layer: usize, q_start: usize, stats: &AttnStats) {
        self.inner.attention_stats(layer, q_start, stats)
    }
    fn wants_rows(&self, layer: usize) -> Vec<usize> {
        self.inner.wants_rows(layer)
    }
    fn attention_rows(&mut self, layer: usize, q: usize, n_heads: usize, rows: &[f32]) {
        self.inner.attention_rows(layer, q, n_heads, rows)
    }
}

/// [`attention_into`] for an observer that edits `hook_attn_scores` or `hook_pattern`: the
/// kernel computes the segment's whole maps; an edit of the scores is followed by the softmax
/// of the edited scores (a key left at -inf stays masked), an edit of the pattern is taken as
/// it is, and `z` is then the edited pattern times the values. Each map is handed to the observer
/// whole (`[heads, q_len, k_len]`, one block).
#[allow(clippy::too_many_arguments)]
fn attention_edited(
    layer: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    knockout: &[bool],
    block_bytes: usize,
    obs: &mut dyn Observer,
    z: &mut [f32],
) -> Result<()> {
    let (nh, rows, k_len, d) = (dims.n_heads, dims.q_len, dims.k_len, dims.head_dim);
    let offset = k_len - rows;
    let mut tap = MapTap {
        inner: obs,
        layer,
        offset,
        rows,
        k_len,
        scores: vec![f32::NEG_INFINITY; nh * rows * k_len],
        pattern: vec![0f32; nh * rows * k_len],
    };
    attention_into(
        layer,
        q,
        k,
        v,
        dims,
        knockout,
        block_bytes,
        k_len,
        &mut tap,
        z,
    )?;
    let (mut scores, mut pattern) = (tap.scores, tap.pattern);
    let shape = [nh, rows, k_len];
    // a hook that only reads leaves the kernel's z as it is (the same bits as without it)
    let before = pattern.clone();
    let name = |hook| super::capture::hook_name(layer, hook);
    if obs.edits(layer, Hook::AttnScores) {
        obs.edit(layer, Hook::AttnScores, &shape, &mut scores)
            .map_err(|msg| Error::Hook {
                name: name(Hook::AttnScores),
                msg,
            })?;
        if scores.iter().any(|s| s.is_nan() || *s == f32::INFINITY) {
            return Err(Error::Hook {
                name: name(Hook::AttnScores),
                msg: "left a NaN or +infinity in the scores (-infinity masks a key); refused"
                    .into(),
            });
        }
        for (row, out) in scores.chunks(k_len).zip(pattern.chunks_mut(k_len)) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if max == f32::NEG_INFINITY {
                return Err(Error::Hook {
                    name: name(Hook::AttnScores),
                    msg:
                        "masked every key of a query row (all -infinity): its softmax is undefined"
                            .into(),
                });
            }
            let sum: f64 = row.iter().map(|&s| ((s - max) as f64).exp()).sum();
            for (o, &s) in out.iter_mut().zip(row) {
                *o = (((s - max) as f64).exp() / sum) as f32;
            }
        }
    }
    if obs.wants(layer, Hook::AttnScores) {
        obs.attention_block(layer, Hook::AttnScores, offset, shape, &scores);
    }
    if obs.edits(layer, Hook::Pattern) {
        obs.edit(layer, Hook::Pattern, &shape, &mut pattern)
            .map_err(|msg| Error::Hook {
                name: name(Hook::Pattern),
                msg,
            })?;
        if !all_finite(&pattern) {
            return Err(Error::Hook {
                name: name(Hook::Pattern),
                msg: "left a non-finite value (NaN or infinity) in the pattern; refused".into(),
            });
        }
    }
    if obs.wants(layer, Hook::Pattern) {
        obs.attention_block(layer, Hook::Pattern, offset, shape, &pattern);
    }
    if pattern == before {
        return Ok(());
    }
    // z = pattern · V, each query head on its KV set
    let group = nh / dims.n_kv_heads;
    z.par_chunks_mut(nh * d).enumerate().for_each(|(r, zr)| {
        for h in 0..nh {
            let g = h / group;
            let out = &mut zr[h * d..(h + 1) * d];
            out.fill(0.0);
            let p = &pattern[(h * rows + r) * k_len..][..k_len];
            for (j, &w) in p.iter().enumerate() {
                if w != 0.0 {
                    let vj = &v[(g * k_len + j) * d..][..d];
                    out.iter_mut().zip(vj).for_each(|(o, &x)| *o += w * x);
                }
            }
        }
    });
    Ok(())
}

/// Whether the observer wants or edits `hook` at `layer`.
fn touches(obs: &dyn Observer, layer: usize, hook: Hook) -> bool {
    obs.wants(layer, hook) || obs.edits(layer, hook)
}

/// Keys and values (after RoPE) of the first `len` positions of a sequence, per layer
/// (`[n_kv_heads, len, head_dim]` each). Running the rest of a sequence on top of it gives the
/// same numbers as running the whole sequence, since a causal model's first positions do not
/// depend on what comes after them.
#[derive(Clone)]
pub struct KvPrefix {
    pub len: usize,
    n_kv: usize,
    head_dim: usize,
    layers: Vec<(Vec<f32>, Vec<f32>)>,
}

impl KvPrefix {
    /// Layer `l`'s value vectors, `[n_kv_heads, len, head_dim]`.
    pub fn values(&self, l: usize) -> &[f32] {
        &self.layers[l].1
    }

    /// The first `len` positions of this prefix.
    pub fn truncate(&self, len: usize) -> Result<KvPrefix> {
        let len = len.min(self.len);
        let (nkv, hd, old) = (self.n_kv, self.head_dim, self.len);
        let cut = |x: &Vec<f32>| -> Vec<f32> {
            (0..nkv)
                .flat_map(|g| x[g * old * hd..(g * old + len) * hd].iter().copied())
                .collect()
        };
        let layers = self.layers.iter().map(|(k, v)| (cut(k), cut(v))).collect();
        Ok(KvPrefix {
            len,
            n_kv: nkv,
            head_dim: hd,
            layers,
        })
    }
}

impl RunOptions {
    pub fn last_logits(n: usize) -> Self {
        RunOptions {
            logits_at: vec![n.saturating_sub(1)],
            ..Default::default()
        }
    }
}

/// Where the time went.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timings {
    /// scores, mask, softmax, weighted sum (all layers)
    pub attention: Duration,
    /// the projections q|k|v, o, gate|up, down (all layers)
    pub projections: Duration,
    pub total: Duration,
}

pub struct ForwardOut {
    /// One row of `vocab_size` logits per entry of `RunOptions::logits_at`.
    pub logits: Vec<Vec<f32>>,
    pub timings: Timings,
    /// Every layer's keys and values, when `RunOptions::keep_kv` was set.
    pub kv: Option<KvPrefix>,
}

/// The rows of one block of the MLP: the forward runs gate|up, the activation and down over blocks
/// of this many positions (whole 192-row strips), so the `[rows, 2·d_ff]` intermediate stays near
/// 32 MiB whatever the length (576 rows for the default model's d_ff of 4,864).
pub fn mlp_block_rows(ff: usize) -> usize {
    ((32usize << 20) / (ff * 4 * 3)).div_ceil(192).max(1) * 192
}

/// cos/sin tables `[n, head_dim/2]` for positions `0..n`, computed as transformers does
/// (`inv_freq = 1 / base^(2i/d)` and `pos · inv_freq` in f32), so the rotation angles agree.
pub fn rope_tables(head_dim: usize, base: f32, n: usize) -> (Vec<f32>, Vec<f32>) {
    rope_tables_of(
        &super::config::RopeScaling::Default.inv_freq(head_dim, base),
        n,
    )
}

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
fn rotate(x: &mut [f32], cos: &[f32], sin: &[f32], style: RopeStyle) {
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
fn split_heads(
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
fn split_heads_into(
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
fn merge_heads(x: &[f32], heads: usize, m: usize, d: usize) -> Vec<f32> {
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
fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
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
fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let ms = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / ((ms as f32) + eps).sqrt();
    x.iter_mut().zip(w).for_each(|(v, &g)| *v = *v * inv * g);
}

/// LayerNorm of each `[width]` row [Ba et al. 2016]: `(x − mean) / sqrt(var + eps) · w + b`,
/// mean and variance accumulated in f64 (GPT-2).
pub fn layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    layer_norm_into(x, w, b, eps, &mut out);
    out
}

/// [`layer_norm`] into `out[..x.len()]`.
fn layer_norm_into(x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
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
fn gelu_tanh_of(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // √(2/π)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
}

/// [`gelu_tanh_of`] of every element (GPT-2's MLP).
fn gelu_tanh(x: &[f32], out: &mut [f32]) {
    out.par_chunks_mut(4096)
        .zip(x.par_chunks(4096))
        .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, &g)| *d = gelu_tanh_of(g)));
}

/// GeLU(gate) · up over rows of `gu: [rows, 2·ff]` (Gemma's MLP), GeLU in its tanh form as
/// transformers' `gelu_pytorch_tanh`: `½x(1 + tanh(√(2/π)(x + 0.044715x³)))`.
fn geglu_tanh(gu: &[f32], ff: usize, out: &mut [f32]) {
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
fn swiglu(gu: &[f32], ff: usize, out: &mut [f32]) {
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
    fn swiglu_row(g: &[f32], u: &[f32], out: &mut [f32]) {
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

/// `dst ← src` with stores that bypass the cache where the CPU has AVX-512 (a finished
/// pattern row, which nothing here reads again: no line of it is fetched before being
/// overwritten, none evicts the working set); a plain copy elsewhere. Call [`stream_fence`]
/// before another thread reads `dst`.
fn stream_store(dst: &mut [f32], src: &[f32]) {
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
unsafe fn stream_store_avx512(dst: &mut [f32], src: &[f32]) {
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

/// Orders [`stream_store`]'s stores before the thread's later ones.
fn stream_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no operands; SSE is part of x86_64
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

multiversion! {
    /// `xs ← xs · f` (the softmax's normalization and rescale).
    fn scale_by(xs: &mut [f32], f: f32) {
        xs.iter_mut().for_each(|x| *x *= f);
    }
}
/// The logits `h · Wᵀ` of `rows` normalized rows `h: [rows, d]`. An f32 head (a float file's,
/// or the file's blocks dequantized a chunk of vocabulary rows at a time: the same values) is
/// read in chunks on every core: candle's matmul of `h` by the transposed `[vocab, d]` head took
/// ~35% of `faithfulness`'s time (one row per forward). `fast`'s quantized head goes through
/// candle.
fn logits_rows(head: &Head, h: Vec<f32>, rows: usize, d: usize) -> Result<Vec<Vec<f32>>> {
    // chunks of vocabulary rows on every core, each writing its stretch of every output row in
    // place; a quantized head is dequantized a chunk at a time into the worker's own buffer
    const CHUNK: usize = 256;
    enum Src<'a> {
        Slice(&'a [f32]),
        Blocks(&'a Mapped),
    }
    impl Src<'_> {
        /// Vocabulary rows `v0..v0 + n`, `d` values each (dequantized into `buf` if need be).
        fn rows<'s>(
            &'s self,
            v0: usize,
            n: usize,
            d: usize,
            buf: &'s mut Vec<f32>,
        ) -> Result<&'s [f32]> {
            match self {
                Src::Slice(w) => Ok(&w[v0 * d..(v0 + n) * d]),
                Src::Blocks(m) => {
                    buf.resize(n * d, 0.0);
                    m.rows_to_f32(v0, &mut buf[..n * d])?;
                    Ok(&buf[..n * d])
                }
            }
        }
    }
    let dense = |vocab: usize, src: Src| -> Result<Vec<Vec<f32>>> {
        let mut out = vec![vec![0f32; vocab]; rows];
        let mut chunks: Vec<Vec<&mut [f32]>> = (0..vocab.div_ceil(CHUNK))
            .map(|_| Vec::with_capacity(rows))
            .collect();
        for row in out.iter_mut() {
            for (c, stretch) in row.chunks_mut(CHUNK).enumerate() {
                chunks[c].push(stretch);
            }
        }
        chunks
            .into_par_iter()
            .enumerate()
            .try_for_each_init(Vec::new, |buf, (c, mut dst)| {
                let v0 = c * CHUNK;
                let n = CHUNK.min(vocab - v0);
                let w = src.rows(v0, n, d, buf)?;
                dot_rows(&h, w, d, &mut dst);
                Ok::<_, Error>(())
            })?;
        Ok(out)
    };
    match head {
        Head::Rows(m) if d > 0 && m.cols() == d => {
            let vocab = m.dims.iter().product::<usize>() / d;
            dense(vocab, Src::Blocks(m))
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
                return Err(Error::Candle(candle_core::Error::Msg(format!(
                    "an output matrix of {} values is not rows of {d}",
                    w.len()
                ))));
            }
            dense(w.len() / d, Src::Slice(w))
        }
        Head::Rows(m) => Err(Error::Candle(candle_core::Error::Msg(format!(
            "an output matrix of shape {:?} for rows of {d}",
            m.dims
        )))),
        Head::Quant(q) => {
            let h = Tensor::from_vec(h, (rows, d), &Device::Cpu)?;
            Ok(candle_core::Module::forward(q, &h)?
                .to_dtype(DType::F32)?
                .to_vec2()?)
        }
    }
}

/// `x · y` over 16 lanes, the lanes then summed in a fixed order (the same bits at every vector
/// width: no lane sees another's values before the end).
#[inline(always)]
fn dot16(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (xs, ys) = (x.chunks_exact(16), y.chunks_exact(16));
    let tail: f32 = xs
        .remainder()
        .iter()
        .zip(ys.remainder())
        .map(|(a, b)| a * b)
        .sum();
    for (a, b) in xs.zip(ys) {
        for k in 0..16 {
            acc[k] += a[k] * b[k];
        }
    }
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

multiversion! {
    /// `out[i][v] = h_i · w_v` for the rows `w_v` of `w` (`d` values each) and the rows `h_i`
    /// of `h: [out.len(), d]`.
    fn dot_rows(h: &[f32], w: &[f32], d: usize, out: &mut [&mut [f32]]) {
        for (v, wv) in w.chunks_exact(d).enumerate() {
            for (i, row) in out.iter_mut().enumerate() {
                row[v] = dot16(&h[i * d..(i + 1) * d], wv);
            }
        }
    }
}

/// Whether key `j` is visible to the query at absolute position `i` (causal mask, sliding
/// window and knockout; a token always sees itself).
#[inline]
fn visible(i: usize, j: usize, knockout: &[bool], window: Option<usize>) -> bool {
    j <= i
        && window.is_none_or(|w| j + w > i)
        && (j == i || !knockout.get(j).copied().unwrap_or(false))
}

/// The running state of one (head, query) row of the online softmax.
#[derive(Clone)]
struct RowState {
    /// largest visible score so far (the softmax shift), -inf before any
    m: f32,
    /// Σ exp(s - m) over visible keys so far
    l: f64,
    /// Σ exp(s - m) · s, for the entropy
    t: f64,
    argmax: u32,
    /// score of the first key (-inf when hidden)
    s0: f32,
    /// the `top_k` best (score, key) so far, best first
    top: Vec<(f32, u32)>,
}

impl RowState {
    fn new() -> Self {
        RowState {
            m: f32::NEG_INFINITY,
            l: 0.0,
            t: 0.0,
            argmax: 0,
            s0: f32::NEG_INFINITY,
            top: Vec::new(),
        }
    }
}

/// A buffer borrowed from a thread-local slot for the length of a call, and put back when
/// dropped (on every return path, errors included), so the next call finds its pages mapped.
struct Reused {
    buf: Vec<f32>,
    slot: &'static std::thread::LocalKey<std::cell::RefCell<Vec<f32>>>,
}

impl Reused {
    /// The slot's buffer, grown to at least `len` floats and never shrunk (so a smaller request
    /// costs nothing); its contents are whatever the last user left.
    fn take(
        slot: &'static std::thread::LocalKey<std::cell::RefCell<Vec<f32>>>,
        len: usize,
    ) -> Self {
        let mut buf = slot.with(|c| std::mem::take(&mut *c.borrow_mut()));
        if buf.len() < len {
            buf.resize(len, 0.0);
        }
        Reused { buf, slot }
    }
}

impl std::ops::Deref for Reused {
    type Target = Vec<f32>;
    fn deref(&self) -> &Vec<f32> {
        &self.buf
    }
}

impl std::ops::DerefMut for Reused {
    fn deref_mut(&mut self) -> &mut Vec<f32> {
        &mut self.buf
    }
}

impl Drop for Reused {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        self.slot.with(|c| *c.borrow_mut() = buf);
    }
}

/// Frees the calling thread's kept attention buffers (the next call allocates them afresh).
fn release_attention_buffers() {
    for slot in [&Q_SCALED, &SCRATCH, &RAW_SCRATCH] {
        slot.with(|c| *c.borrow_mut() = Vec::new());
    }
}

thread_local! {
    /// The scaled queries of [`attention_into`], kept between calls on the calling thread.
    static Q_SCALED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// Score buffers of [`attention`], kept between calls on the calling thread.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    static RAW_SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Shapes of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// query rows (the last `q_len` of the `k_len` positions)
    pub q_len: usize,
    pub k_len: usize,
    /// Sliding window: query i sees keys `i - window < j ≤ i` (None = every earlier key).
    pub window: Option<usize>,
    /// Scores are `q·k · scale` (None: `1/√head_dim`; Gemma: `query_pre_attn_scalar^-½`).
    pub scale: Option<f32>,
    /// Scores become `cap · tanh(s / cap)` before the mask (Gemma 2's soft-capping).
    pub softcap: Option<f32>,
}

/// Causal grouped-query attention, fused per (head, block of query rows): `S = (Q/√d) Kᵀ` on
/// the packed GEMM, then mask and an online softmax [Milakov & Gimelshein 2018,
/// arXiv:1805.02867; Dao et al. 2022, FlashAttention] over blocks of keys, then `P V` on the
/// packed GEMM, accumulated with the running rescale. `q: [n_heads, q_len, d]` holds the last
/// `q_len` of the `k_len` positions of `k, v: [n_kv_heads, k_len, d]` (after RoPE; the first
/// `k_len - q_len` come from a reused prefix). Returns `z: [q_len, n_heads, d]`.
///
/// Keys past a query block's last row are masked for every row of it and are never computed.
/// When the observer wants `hook_pattern` or `hook_attn_scores`, each key block spans the
/// whole visible row, which makes the online softmax the ordinary one, and the normalized
/// weights are handed out from the buffer they were computed in. Otherwise keys stream in
/// blocks of `key_block`, and no `[n, n]` (not even `[rows, n]`) is ever held; per-row
/// statistics (first-key weight, entropy, max weight, argmax, top-k) come from the same
/// accumulators in both cases.
///
/// Query heads `g·group..(g+1)·group` share K/V set `g` ([`crate::reference::kv_head`]); each
/// set is packed once per call and read by its heads, never copied per head.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    layer: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    knockout: &[bool],
    block_bytes: usize,
    key_block: usize,
    obs: &mut dyn Observer,
) -> Result<Vec<f32>> {
    let mut z = vec![0f32; dims.q_len * dims.n_heads * dims.head_dim];
    attention_into(
        layer,
        q,
        k,
        v,
        dims,
        knockout,
        block_bytes,
        key_block,
        obs,
        &mut z,
    )?;
    Ok(z)
}

/// [`attention`] into `z` (`[q_len, n_heads, head_dim]` floats, every one overwritten): the
/// forward passes the same buffer for every layer instead of zeroing a fresh one each time.
#[allow(clippy::too_many_arguments)]
pub fn attention_into(
    layer: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    knockout: &[bool],
    block_bytes: usize,
    key_block: usize,
    obs: &mut dyn Observer,
    z: &mut [f32],
) -> Result<()> {
    let AttnDims {
        n_heads,
        n_kv_heads: n_kv,
        head_dim: d,
        q_len: n,
        k_len,
        window,
        scale,
        softcap,
    } = dims;
    if k_len < n
        || n_kv == 0
        || n_heads % n_kv != 0
        || q.len() != n_heads * n * d
        || k.len() != n_kv * k_len * d
        || v.len() != k.len()
    {
        return Err(Error::Candle(candle_core::Error::Msg(format!(
            "attention shapes {dims:?} with q {} k {} v {} values: you likely have a bug",
            q.len(),
            k.len(),
            v.len()
        ))));
    }
    let z = &mut z[..n * n_heads * d];
    if n == 0 {
        return Ok(());
    }
    let isa = Isa::detect();
    let group = n_heads / n_kv;
    let scale = scale.unwrap_or(1.0 / (d as f32).sqrt());
    // the queries scaled once, so the scores come out of the GEMM already divided by √d
    // in a buffer kept on this thread (a fresh one per layer costs its pages every time)
    let mut q_scaled = Reused::take(&Q_SCALED, q.len());
    let q_scaled = &mut q_scaled[..q.len()];
    if q.len() >= 1 << 16 {
        q_scaled
            .par_iter_mut()
            .zip(q.par_iter())
            .for_each(|(y, &x)| *y = x * scale);
    } else {
        q_scaled
            .iter_mut()
            .zip(q)
            .for_each(|(y, &x)| *y = x * scale);
    }
    let q = &*q_scaled;

    let (want_s, want_p) = (
        obs.wants(layer, Hook::AttnScores),
        obs.wants(layer, Hook::Pattern),
    );
    let materialize = want_s || want_p;
    let request = obs.wants_stats(layer);
    // argmax is only looked for when someone takes the statistics
    let stats = request.is_some();
    let want_rows: Vec<usize> = obs
        .wants_rows(layer)
        .into_iter()
        .filter(|&i| i < k_len && i + n >= k_len)
        .collect();
    let offset = k_len - n; // absolute position of query row 0
                            // each KV set packed once: K as the right side of Q·Kᵀ, V as the right side of P·V
    let packed: Vec<(PackedB, PackedB)> = (0..n_kv)
        .into_par_iter()
        .map(|g| {
            let kg = &k[g * k_len * d..(g + 1) * k_len * d];
            let vg = &v[g * k_len * d..(g + 1) * k_len * d];
            (
                PackedB::from_rows(kg, k_len, d, d, isa),
                PackedB::from_cols(vg, k_len, d, d, isa),
            )
        })
        .collect();
    let kb_size = if materialize { k_len } else { key_block.max(1) };
    // rows per block so that one [n_heads, rows, key block] f32 block stays under block_bytes,
    // a quarter of it when streaming: measured on the default model, streamed attention at
    // 2,048 tokens took 0.90 s with 2 MiB blocks against 1.00-1.02 s with 8 MiB (512 tokens:
    // 0.10 s against 0.115 s), while whole rows kept 8 MiB (2.34-2.45 s against 2.73-2.80 s)
    let budget = if materialize {
        block_bytes
    } else {
        block_bytes / 4
    };
    let rows_per_block = (budget / (n_heads * kb_size.min(k_len) * 4).max(1)).clamp(1, n);
    // whole strips of the GEMM's micro-tile, so no block ends in a mostly empty strip
    let mr = isa.mr();
    let rows_per_block = if rows_per_block > mr && rows_per_block < n {
        rows_per_block / mr * mr
    } else {
        rows_per_block
    };
    let any_knockout = knockout.iter().any(|&b| b);
    let mut q0 = 0;
    while q0 < n {
        let rows = rows_per_block.min(n - q0);
        // keys after the block's last query are masked for every row
        let kw = offset + q0 + rows;
        // width of one key block's score buffer
        let kbw = kb_size.min(kw);
        // a streamed block's rows get a little slack: at 1,024 keys they were 4 KiB apart, so
        // the 12 rows of one tile fell in one set of the 8-way L1 (the scores' tile stores and
        // P·V's reads of them missed it, row after row)
        let slack = if materialize { 0 } else { ROW_SLACK };
        // floats between rows of a head's block, at most
        let ldw = kbw + slack;
        // the score buffers are reused from block to block and layer to layer: a fresh one of
        // each size would be page-faulted in anew (measured: ~2.5 M faults, ~4 s at 2,048 tokens)
        let mut scratch = Reused::take(&SCRATCH, n_heads * rows * ldw);
        let mut raw_scratch =
            Reused::take(&RAW_SCRATCH, if want_s { n_heads * rows * kbw } else { 0 });
        let scores = &mut scratch[..n_heads * rows * ldw];
        let raw_scores = if want_s {
            &mut raw_scratch[..n_heads * rows * kbw]
        } else {
            &mut raw_scratch[..0]
        };
        let mut state = vec![RowState::new(); n_heads * rows];
        let mut zb = vec![0f32; n_heads * rows * d];
        // the whole rows wanted from this block: (query row in the block, absolute position)
        let wanted: Vec<(usize, usize)> = want_rows
            .iter()
            .filter(|&&i| i >= offset + q0 && i < offset + q0 + rows)
            .map(|&i| (i - offset - q0, i))
            .collect();
        // one chunk per head (of at least one float, so the zip below has a chunk for every head)
        let row_chunk = (wanted.len() * k_len).max(1);
        let mut row_out = vec![0f32; n_heads * row_chunk];
        // the caller's own rows for the pattern, where it offers them: the block's scores,
        // softmax and P·V then run in place there (a whole row per query: one key block)
        let (mut dests, zeroed): (Vec<Option<&mut [f32]>>, bool) = match want_p
            .then(|| obs.pattern_rows(layer, offset + q0, rows, n_heads, k_len))
            .flatten()
        {
            Some(d)
                if materialize
                    && d.heads.len() == n_heads
                    && d.heads.iter().all(|x| x.len() == rows * k_len) =>
            {
                (d.heads.into_iter().map(Some).collect(), d.zeroed)
            }
            _ => ((0..n_heads).map(|_| None).collect(), false),
        };
        let direct = dests[0].is_some();
        let head_task = |h: usize,
                         s_h: &mut [f32],
                         raw_h: &mut [f32],
                         st_h: &mut [RowState],
                         z_h: &mut [f32],
                         rows_h: &mut [f32],
                         mut dest: Option<&mut [f32]>| {
            let (kp, vp) = &packed[h / group];
            let a = &q[(h * n + q0) * d..(h * n + q0 + rows) * d];
            let mut corr = vec![0f32; rows];
            // a sliding window hides every key before the block's first query's window: those
            // key blocks are never computed, so a windowed layer costs O(n · window)
            let mut k0 = match window {
                Some(w) if !materialize => (offset + q0 + 1).saturating_sub(w) / kb_size * kb_size,
                _ => 0,
            };
            while k0 < kw {
                let kn = kb_size.min(kw - k0);
                let single = k0 == 0 && kn == kw;
                // rows of kn scores in the scratch block (in L2: the caller's rows are written
                // once, finished, at the end; computed in place there, with rows 4·k_len bytes
                // apart, the GEMM's tile stores missed the cache)
                // (streamed: a stride of whole 2 KiB steps gets the slack)
                let ld = if slack > 0 && kn % 512 == 0 {
                    kn + slack
                } else {
                    kn
                };
                let s = &mut s_h[..rows * ld];
                // raw scores q·k of this block: [rows, kn]
                gemm::gemm_sub(a, d, rows, kp, 0..d, k0..k0 + kn, s, ld, false, false);
                if let Some(cap) = softcap {
                    for row in s.chunks_mut(ld) {
                        row[..kn]
                            .iter_mut()
                            .for_each(|x| *x = (*x / cap).tanh() * cap);
                    }
                }
                if !raw_h.is_empty() {
                    for (x, (src, dst)) in s.chunks(ld).zip(raw_h.chunks_mut(kn)).enumerate() {
                        let i = offset + q0 + x;
                        for (j, (&sc, out)) in src[..kn].iter().zip(dst.iter_mut()).enumerate() {
                            *out = if visible(i, k0 + j, knockout, window) {
                                sc
                            } else {
                                f32::NEG_INFINITY
                            };
                        }
                    }
                }
                // a row's maximum, and where it first stands when the statistics want the argmax
                let peak = |xs: &[f32]| {
                    if stats {
                        max_and_index(xs)
                    } else {
                        (max_of(xs), None)
                    }
                };
                // online softmax update, one query row at a time: mask, new shift
                // m' = max(m, block max), rescale the sums by exp(m - m'), and leave
                // p = exp(s - m') in the buffer for the weighted sum of values
                for (x, (row, (st, c))) in s
                    .chunks_mut(ld)
                    .zip(st_h.iter_mut().zip(corr.iter_mut()))
                    .enumerate()
                {
                    let row = &mut row[..kn];
                    let i = offset + q0 + x;
                    let top_k = request
                        .filter(|r| r.top_k > 0 && i >= r.top_k_from)
                        .map(|r| r.top_k);
                    if !any_knockout && window.is_none() {
                        // the keys of this block the query may see are a prefix of it
                        let n_vis = (i + 1).saturating_sub(k0).min(kn);
                        let (bmax, at) = peak(&row[..n_vis]);
                        online_update(st, c, row, n_vis, bmax, at, k0, top_k, true);
                    } else {
                        for (j, sc) in row.iter_mut().enumerate() {
                            if !visible(i, k0 + j, knockout, window) {
                                *sc = f32::NEG_INFINITY;
                            }
                        }
                        let (bmax, at) = peak(row);
                        online_update(st, c, row, kn, bmax, at, k0, top_k, false);
                    }
                    if single {
                        // one block holds every visible key: normalize in place, p is the pattern
                        let inv = if st.l > 0.0 { (1.0 / st.l) as f32 } else { 0.0 };
                        scale_by(row, inv);
                    }
                }
                if k0 > 0 {
                    for (zr, &c) in z_h.chunks_mut(d).zip(&corr) {
                        scale_by(zr, c);
                    }
                }
                gemm::gemm_sub(s, ld, rows, vp, k0..k0 + kn, 0..d, z_h, d, k0 > 0, false);
                if single {
                    // the pattern is in the buffer: hand out the wanted rows from it
                    for (w, &(x, _)) in wanted.iter().enumerate() {
                        rows_h[w * k_len..w * k_len + kw].copy_from_slice(&s[x * ld..x * ld + kn]);
                    }
                    if let Some(out) = dest.as_deref_mut() {
                        // into the caller's rows, past the cache (nothing reads them here
                        // again); the keys past the block are masked: zero (already, in fresh
                        // or recycled memory that says so)
                        for (src, dst) in s.chunks(ld).zip(out.chunks_mut(k_len)) {
                            stream_store(&mut dst[..kn], &src[..kn]);
                            if !zeroed {
                                dst[kn..].fill(0.0);
                            }
                        }
                        stream_fence();
                    }
                    return;
                }
                debug_assert!(dest.is_none(), "the caller's rows take one key block");
                k0 += kn;
            }
            for (zr, st) in z_h.chunks_mut(d).zip(st_h.iter()) {
                let inv = if st.l > 0.0 { (1.0 / st.l) as f32 } else { 0.0 };
                scale_by(zr, inv);
            }
            // streamed: recompute the wanted rows' scores and normalize them with the row's
            // final shift and sum, p = e^(s - m) / l (one row of work per wanted query)
            for (w, &(x, i)) in wanted.iter().enumerate() {
                let st = &st_h[x];
                let out = &mut rows_h[w * k_len..(w + 1) * k_len];
                let a_row = &q[(h * n + q0 + x) * d..(h * n + q0 + x + 1) * d];
                gemm::gemm_sub(
                    a_row,
                    d,
                    1,
                    kp,
                    0..d,
                    0..i + 1,
                    &mut out[..i + 1],
                    i + 1,
                    false,
                    false,
                );
                if let Some(cap) = softcap {
                    out[..i + 1]
                        .iter_mut()
                        .for_each(|x| *x = (*x / cap).tanh() * cap);
                }
                for (j, p) in out[..i + 1].iter_mut().enumerate() {
                    *p = if visible(i, j, knockout, window) && st.l > 0.0 {
                        (fast_exp(*p - st.m) as f64 / st.l) as f32
                    } else {
                        0.0
                    };
                }
            }
        };
        let raw_chunk = if want_s { rows * kbw } else { 0 };
        let tasks = scores
            .par_chunks_mut(rows * ldw)
            .zip(state.par_chunks_mut(rows))
            .zip(zb.par_chunks_mut(rows * d))
            .zip(row_out.par_chunks_mut(row_chunk))
            .zip(dests.par_iter_mut())
            .enumerate();
        if want_s {
            tasks.zip(raw_scores.par_chunks_mut(raw_chunk)).for_each(
                |((h, ((((s_h, st_h), z_h), rows_h), dest)), raw_h)| {
                    head_task(h, s_h, raw_h, st_h, z_h, rows_h, dest.as_deref_mut())
                },
            );
        } else {
            tasks.for_each(|(h, ((((s_h, st_h), z_h), rows_h), dest))| {
                head_task(h, s_h, &mut [], st_h, z_h, rows_h, dest.as_deref_mut())
            });
        }
        drop(dests);
        // a NaN or infinite score (corrupt weights, an overflow) poisons Σ p·s: refuse the layer
        // rather than hand out rows in which it silently became weight 0
        if state
            .iter()
            .any(|st| !(st.t.is_finite() && st.l.is_finite() && st.m < f32::INFINITY))
        {
            return Err(Error::NonFinite {
                what: "the attention scores".into(),
                layer: Some(layer),
            });
        }
        for (w, &(_, i)) in wanted.iter().enumerate() {
            let mut all = vec![0f32; n_heads * k_len];
            for h in 0..n_heads {
                all[h * k_len..(h + 1) * k_len]
                    .copy_from_slice(&row_out[h * row_chunk + w * k_len..][..k_len]);
            }
            obs.attention_rows(layer, i, n_heads, &all);
        }
        if want_s {
            obs.attention_block(
                layer,
                Hook::AttnScores,
                offset + q0,
                [n_heads, rows, kw],
                raw_scores,
            );
        }
        if want_p && !direct {
            obs.attention_block(
                layer,
                Hook::Pattern,
                offset + q0,
                [n_heads, rows, kw],
                scores,
            );
        }
        if let Some(r) = request {
            let stats = AttnStats::from_states(&state, n_heads, rows, r.top_k);
            obs.attention_stats(layer, offset + q0, &stats);
        }
        for h in 0..n_heads {
            for x in 0..rows {
                z[((q0 + x) * n_heads + h) * d..][..d]
                    .copy_from_slice(&zb[(h * rows + x) * d..][..d]);
            }
        }
        q0 += rows;
    }
    Ok(())
}

/// One row's online-softmax step over a key block whose scores (scaled, masked = -inf) are in
/// `row[..len]` (the rest is masked): updates the shift, the sums, argmax, first-key score and
/// top-k, leaves `p = exp(s - m')` in `row` (masked → exactly 0) and the rescale factor in `c`.
/// `dense`: no score in `row[..len]` is masked (the causal prefix without knockout); `at`: where
/// in the row `bmax` first stands, when the argmax is tracked (nobody but the statistics needs
/// it).
#[inline]
#[allow(clippy::too_many_arguments)]
fn online_update(
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
fn exp_shift_sums<const MASKED: bool>(xs: &mut [f32], m: f32) -> (f64, f64) {
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
    fn exp_shift_sums_dense(xs: &mut [f32], m: f32) -> (f64, f64) {
        exp_shift_sums::<false>(xs, m)
    }
}

multiversion! {
    /// [`exp_shift_sums`] of a row with masked (`-inf`) entries.
    fn exp_shift_sums_masked(xs: &mut [f32], m: f32) -> (f64, f64) {
        exp_shift_sums::<true>(xs, m)
    }
}

multiversion! {
    /// Whether every value is finite (0·x is NaN exactly for NaN and ±inf; in lanes, so it
    /// vectorizes and costs next to nothing beside the layer that produced `xs`).
    fn all_finite(xs: &[f32]) -> bool {
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
    fn max_of(xs: &[f32]) -> f32 {
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

/// Floats of slack between the rows of a streamed score block whose rows would otherwise lie a
/// multiple of 2 KiB apart (64 bytes: one cache line).
const ROW_SLACK: usize = 16;

multiversion! {
    /// [`max_of`] and the first index holding the maximum (`None` when every value is -inf or
    /// the slice is empty), in one pass: each of 16 lanes keeps its largest value and where it
    /// first saw it, without a branch, so it compiles to vector compares and blends. The argmax
    /// of a row with statistics: a scalar scan for the maximum after `max_of` took ~1.6% of
    /// `inspect` at 2,048 tokens, a vector one ~0.7%.
    fn max_and_index(xs: &[f32]) -> (f32, Option<usize>) {
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
fn fast_exp(x: f32) -> f32 {
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

/// What an observer asks of the streaming statistics.
#[derive(Clone, Copy, Debug)]
pub struct StatsRequest {
    /// How many top keys to keep per (head, query).
    pub top_k: usize,
    /// Top keys only for query positions ≥ this (the rest get padding): keeping a top list
    /// costs a comparison per key, so ask only for the rows you need.
    pub top_k_from: usize,
}

/// Per-(head, query) statistics of a block of query rows, from the online softmax.
/// Every vector is `[n_heads, rows]` row-major; `top` is `[n_heads, rows, top_k]`.
#[derive(Clone, Debug)]
pub struct AttnStats {
    pub n_heads: usize,
    pub rows: usize,
    pub top_k: usize,
    /// weight on the first key (position 0)
    pub first_key: Vec<f32>,
    pub max_weight: Vec<f32>,
    pub argmax: Vec<u32>,
    /// entropy of the row, nats
    pub entropy: Vec<f32>,
    /// (key, weight), best first; rows with fewer visible keys are padded with (u32::MAX, 0)
    pub top: Vec<(u32, f32)>,
}

impl AttnStats {
    fn from_states(states: &[RowState], n_heads: usize, rows: usize, top_k: usize) -> Self {
        let mut s = AttnStats {
            n_heads,
            rows,
            top_k,
            first_key: Vec::new(),
            max_weight: Vec::new(),
            argmax: Vec::new(),
            entropy: Vec::new(),
            top: Vec::new(),
        };
        for st in states {
            let (l, m) = (st.l, st.m as f64);
            let w = |score: f32| {
                if score == f32::NEG_INFINITY || l <= 0.0 {
                    0.0
                } else {
                    ((score as f64 - m).exp() / l) as f32
                }
            };
            s.first_key.push(w(st.s0));
            s.max_weight
                .push(if l > 0.0 { (1.0 / l) as f32 } else { 0.0 });
            s.argmax.push(st.argmax);
            // H = -Σ p ln p with p = e^(s-m)/l: H = m + ln l - (Σ e^(s-m) s)/l
            s.entropy.push(if l > 0.0 {
                (m + l.ln() - st.t / l).max(0.0) as f32
            } else {
                0.0
            });
            for i in 0..top_k {
                s.top.push(
                    st.top
                        .get(i)
                        .map(|&(sc, j)| (j, w(sc)))
                        .unwrap_or((u32::MAX, 0.0)),
                );
            }
        }
        s
    }
}

impl Model {
    /// Runs the model over `tokens`, handing every hook point the observer wants to it.
    pub fn forward(
        &self,
        tokens: &[u32],
        opts: &RunOptions,
        obs: &mut dyn Observer,
    ) -> Result<ForwardOut> {
        self.forward_from(None, tokens, opts, obs)
    }

    /// Runs `tokens` as positions `P..P+m` after a reused `prefix` of `P` positions (or from 0).
    /// Positions in `opts` are absolute; logits and knockouts must lie in the new positions.
    /// Per-position hooks then cover the new positions, attention blocks carry absolute rows.
    pub fn forward_from(
        &self,
        prefix: Option<&KvPrefix>,
        tokens: &[u32],
        opts: &RunOptions,
        obs: &mut dyn Observer,
    ) -> Result<ForwardOut> {
        let seg = Segment {
            tokens,
            reuse: prefix.map_or(0, |p| p.len),
            knockout: opts.knockout.clone(),
            logits_at: opts.logits_at.clone(),
        };
        self.forward_segments(prefix, std::slice::from_ref(&seg), None, opts, obs)
    }

    /// Runs several variants of a sequence in one pass, each as positions `c..c+m` after the
    /// first `c` positions of a shared `prefix` (its own `reuse`), with its own knockouts, and
    /// returns each one's logits rows. Every projection reads its weights once for all of them:
    /// for short variants (`faithfulness`'s occlusions) a forward is bound by reading the
    /// weights, so one pass over many costs about what one costs. Each variant's numbers are
    /// those of its own [`Model::forward_from`] (the kernels compute each row alone).
    pub fn forward_batch(
        &self,
        prefix: Option<&KvPrefix>,
        segments: &[Segment],
    ) -> Result<Vec<Vec<Vec<f32>>>> {
        let out = self.forward_segments(
            prefix,
            segments,
            None,
            &RunOptions::default(),
            &mut super::capture::NoCapture,
        )?;
        let mut rows = out.logits.into_iter();
        Ok(segments
            .iter()
            .map(|s| rows.by_ref().take(s.logits_at.len()).collect())
            .collect())
    }

    /// The forward over stacked segments (one for [`Model::forward_from`]): row-wise work
    /// (norms, projections, MLP) runs on all their rows at once, the attention per segment.
    /// Hooks see the stacked rows (an editing observer that batches variants edits each one's
    /// rows). With `resume`, the forward starts at `resume.layer` from the residual it gives
    /// (the layers before it are not run; their keys and values come from `prefix` where a
    /// segment reuses positions).
    pub fn forward_segments(
        &self,
        prefix: Option<&KvPrefix>,
        segs: &[Segment],
        resume: Option<Resume>,
        opts: &RunOptions,
        obs: &mut dyn Observer,
    ) -> Result<ForwardOut> {
        let start = Instant::now();
        let dims = &self.dims;
        let (nh, nkv, hd, dm, ff) = (
            dims.n_heads,
            dims.n_kv_heads,
            dims.head_dim,
            dims.d_model,
            dims.d_ff,
        );
        if prefix
            .is_some_and(|p| p.layers.len() != dims.n_layers || p.n_kv != nkv || p.head_dim != hd)
        {
            return Err(Error::Candle(candle_core::Error::Msg(
                "the KV prefix belongs to another model: you likely have a bug".into(),
            )));
        }
        let full = prefix.map_or(0, |p| p.len);
        let first_layer = resume.as_ref().map_or(0, |r| r.layer);
        if segs.is_empty() || (opts.keep_kv && (segs.len() > 1 || first_layer > 0)) {
            return Err(Error::Candle(candle_core::Error::Msg(format!(
                "a forward of {} segments (keep_kv {}, from layer {first_layer}): you likely have a bug",
                segs.len(),
                opts.keep_kv
            ))));
        }
        // each segment's first row in the stacked rows
        let mut row0 = Vec::with_capacity(segs.len());
        let mut m = 0;
        for seg in segs {
            let (p0, ms) = (seg.reuse, seg.tokens.len());
            let n = p0 + ms;
            if ms == 0 {
                return Err(Error::EmptyText);
            }
            if p0 > full {
                return Err(Error::Candle(candle_core::Error::Msg(format!(
                    "a segment reuses {p0} positions of a {full}-position prefix: you likely have a bug"
                ))));
            }
            if n > dims.context_len {
                return Err(Error::TooLong {
                    n_tokens: n,
                    limit: dims.context_len,
                    model: self.info.name.clone(),
                });
            }
            if let Some(&bad) = seg.tokens.iter().find(|&&t| t as usize >= dims.vocab_size) {
                return Err(Error::OutOfRange {
                    what: "token id".into(),
                    value: bad.to_string(),
                    range: format!("0..{}", dims.vocab_size),
                });
            }
            for &p in seg.logits_at.iter().chain(&seg.knockout) {
                if p < p0 || p >= n {
                    return Err(Error::OutOfRange {
                        what: "position".into(),
                        value: p.to_string(),
                        range: format!("{p0}..={}", n - 1),
                    });
                }
            }
            row0.push(m);
            m += ms;
        }
        let n_max = segs
            .iter()
            .map(|s| s.reuse + s.tokens.len())
            .max()
            .unwrap_or(0);
        let knocks: Vec<Vec<bool>> = segs
            .iter()
            .map(|seg| {
                let mut knock = vec![false; seg.reuse + seg.tokens.len()];
                for &p in &seg.knockout {
                    knock[p] = true;
                }
                knock
            })
            .collect();
        let tables = |base: f32| {
            let mut inv = dims.rope_scaling.inv_freq(dims.rotary_dim, base);
            if let Some(f) = &self.weights.rope_freqs {
                // llama.cpp: theta_i = pos · base^(-2i/d) / freq_factors[i]
                inv.iter_mut().zip(f).for_each(|(x, f)| *x /= f);
            }
            rope_tables_of(&inv, n_max)
        };
        let half = dims.rotary_dim / 2;
        let main_tables = tables(dims.rope_base);
        // Gemma 3's sliding layers have their own base
        let local_tables = dims
            .gemma
            .as_ref()
            .filter(|g| g.rope_base_sliding != dims.rope_base)
            .map(|g| tables(g.rope_base_sliding));
        let style = self.weights.rope_style;
        // the stacked rows whose logits are asked for, in order
        let mut logit_rows: Vec<usize> = segs
            .iter()
            .zip(&row0)
            .flat_map(|(seg, &r0)| seg.logits_at.iter().map(move |&p| r0 + p - seg.reuse))
            .collect();
        let mut x: Vec<f32> = match resume {
            Some(r) => {
                if r.layer >= dims.n_layers || r.resid.len() != m * dm {
                    return Err(Error::Candle(candle_core::Error::Msg(format!(
                        "resuming at layer {} of {} with {} residual values for {m} rows of {dm}: you likely have a bug",
                        r.layer,
                        dims.n_layers,
                        r.resid.len()
                    ))));
                }
                r.resid
            }
            None => self.embed_rows(segs, &row0)?,
        };
        let (mut attn_time, mut proj_time) = (Duration::ZERO, Duration::ZERO);
        let mut kept = Vec::with_capacity(if opts.keep_kv { dims.n_layers } else { 0 });
        let (nq, nk) = (nh * hd, nkv * hd);
        let width = nq + 2 * nk;
        // the MLP runs over blocks of positions so its [positions, 2·d_ff] intermediate stays small
        let mlp_rows = mlp_block_rows(ff).min(m);
        let mut gu = vec![0f32; mlp_rows * 2 * ff];
        let mut act = vec![0f32; mlp_rows * ff];
        // the layer's other big buffers, allocated once and reused by every layer (fresh ones
        // were zeroed anew for every layer: memset took 4% of a 2,048-token run)
        let mut normed = vec![0f32; m * dm];
        let mut qkv = vec![0f32; m * width];
        let mut qh = vec![0f32; nh * m * hd];
        let mut z = vec![0f32; m * nh * hd];
        let norm_into = |x: &[f32], w: &[f32], b: Option<&Vec<f32>>, out: &mut [f32]| match b {
            Some(b) => layer_norm_into(x, w, b, dims.rms_eps, out),
            None => rms_norm_into(x, w, dims.rms_eps, out),
        };
        for (l, layer) in self.weights.layers.iter().enumerate().skip(first_layer) {
            let (cos, sin) = match &local_tables {
                Some(t) if dims.rope_base_of(l) != dims.rope_base => (&t.0, &t.1),
                _ => (&main_tables.0, &main_tables.1),
            };
            hand(obs, l, Hook::ResidPre, &[m, dm], &mut x)?;
            let bias = layer.norm_biases.as_ref().map(|b| &b.0);
            norm_into(&x, &layer.attn_norm, bias, &mut normed);
            let t = Instant::now();
            layer.qkv.forward_into(&normed, m, &mut qkv, false)?; // [m, q | k | v]
            proj_time += t.elapsed();
            if let Some((qn, kn)) = &layer.qk_norm {
                // Qwen3: RMSNorm over each head's query and key, before RoPE
                qkv.par_chunks_mut(width).for_each(|row| {
                    let (q, rest) = row.split_at_mut(nq);
                    for head in q.chunks_mut(hd) {
                        rms_norm_in_place(head, qn, dims.rms_eps);
                    }
                    for head in rest[..nk].chunks_mut(hd) {
                        rms_norm_in_place(head, kn, dims.rms_eps);
                    }
                });
            }
            for (hook, c0, w, heads) in [
                (Hook::Q, 0, nq, nh),
                (Hook::K, nq, nk, nkv),
                (Hook::V, nq + nk, nk, nkv),
            ] {
                if touches(obs, l, hook) {
                    let mut part: Vec<f32> = qkv
                        .chunks(width)
                        .flat_map(|r| r[c0..c0 + w].iter().copied())
                        .collect();
                    hand(obs, l, hook, &[m, heads, hd], &mut part)?;
                    if obs.edits(l, hook) {
                        for (row, new) in qkv.chunks_mut(width).zip(part.chunks(w)) {
                            row[c0..c0 + w].copy_from_slice(new);
                        }
                    }
                }
            }
            let t0 = Instant::now();
            for (si, (seg, &r0)) in segs.iter().zip(&row0).enumerate() {
                let (p0, ms) = (seg.reuse, seg.tokens.len());
                let n = p0 + ms;
                let rows = &qkv[r0 * width..(r0 + ms) * width];
                // the tables of this segment's positions, exactly (split_heads reads their width
                // from their length); GPT-2 has learned positions and no rotation
                let (cos, sin) = (&cos[p0 * half..n * half], &sin[p0 * half..n * half]);
                let rope = (dims.arch != super::config::Arch::Gpt2).then_some((cos, sin, style));
                let qh = &mut qh[..nh * ms * hd];
                split_heads_into(rows, ms, width, 0, nh, hd, rope, qh); // [nh, ms, hd]
                let mut kh = split_heads(rows, ms, width, nq, nkv, hd, rope);
                let vh = split_heads(rows, ms, width, nq + nk, nkv, hd, None);
                for (hook, heads, buf) in [
                    (Hook::RotQ, nh, &mut qh[..]),
                    (Hook::RotK, nkv, &mut kh[..]),
                ] {
                    if touches(obs, l, hook) {
                        let mut merged = merge_heads(buf, heads, ms, hd);
                        hand(obs, l, hook, &[ms, heads, hd], &mut merged)?;
                        if obs.edits(l, hook) {
                            // back to [heads, ms, hd]
                            for (r, row) in merged.chunks(heads * hd).enumerate() {
                                for (h, v) in row.chunks(hd).enumerate() {
                                    buf[(h * ms + r) * hd..][..hd].copy_from_slice(v);
                                }
                            }
                        }
                    }
                }
                let (kf, vf) = match prefix {
                    Some(p) if p0 > 0 => {
                        // the segment's first p0 positions of each KV set, then its own
                        let cat = |old: &[f32], new: &[f32]| -> Vec<f32> {
                            (0..nkv)
                                .flat_map(|g| {
                                    old[g * full * hd..(g * full + p0) * hd]
                                        .iter()
                                        .chain(&new[g * ms * hd..(g + 1) * ms * hd])
                                        .copied()
                                })
                                .collect()
                        };
                        (cat(&p.layers[l].0, &kh), cat(&p.layers[l].1, &vh))
                    }
                    _ => (kh, vh),
                };
                let adims = AttnDims {
                    n_heads: nh,
                    n_kv_heads: nkv,
                    head_dim: hd,
                    q_len: ms,
                    k_len: n,
                    window: dims.window_of(l),
                    scale: dims.gemma.as_ref().map(|g| g.query_scale),
                    softcap: dims.gemma.as_ref().and_then(|g| g.attn_softcap),
                };
                let zs = &mut z[r0 * nh * hd..(r0 + ms) * nh * hd];
                if obs.edits(l, Hook::AttnScores) || obs.edits(l, Hook::Pattern) {
                    attention_edited(
                        l,
                        qh,
                        &kf,
                        &vf,
                        adims,
                        &knocks[si],
                        opts.block_bytes,
                        obs,
                        zs,
                    )?;
                } else {
                    attention_into(
                        l,
                        qh,
                        &kf,
                        &vf,
                        adims,
                        &knocks[si],
                        opts.block_bytes,
                        opts.key_block,
                        obs,
                        zs,
                    )?; // [ms, nh, hd]
                }
                if opts.keep_kv {
                    kept.push((kf, vf));
                }
            }
            attn_time += t0.elapsed();
            hand(obs, l, Hook::Z, &[m, nh, hd], &mut z)?;
            obs.attention_done(l);
            // The last layer's attention output and MLP feed nothing but the logits: unless a
            // hook wants them, they run on the logits rows alone (none for `sinks`, a capture of
            // patterns or statistics; one for `inspect`'s prediction), 1/24 of the default
            // model's projections saved
            let mut mr = m;
            if l + 1 == self.weights.layers.len()
                && ![Hook::AttnOut, Hook::ResidMid, Hook::MlpOut, Hook::ResidPost]
                    .iter()
                    .any(|&h| touches(obs, l, h))
            {
                let gather = |v: &[f32], w: usize| -> Vec<f32> {
                    logit_rows
                        .iter()
                        .flat_map(|&r| v[r * w..(r + 1) * w].iter().copied())
                        .collect()
                };
                x = gather(&x, dm);
                z = gather(&z, nh * hd);
                mr = logit_rows.len();
                logit_rows = (0..mr).collect();
            }
            if mr == 0 {
                obs.layer_done(l);
                break;
            }
            let m = mr;
            let t = Instant::now();
            if layer.post_norms.is_some() || touches(obs, l, Hook::AttnOut) || layer.o.has_bias() {
                let mut attn_out = layer.o.forward(&z, m)?;
                if let Some((post_attn, _)) = &layer.post_norms {
                    // Gemma: the attention's output is normalized before the residual add
                    attn_out = rms_norm(&attn_out, post_attn, dims.rms_eps);
                }
                proj_time += t.elapsed();
                hand(obs, l, Hook::AttnOut, &[m, dm], &mut attn_out)?;
                x.iter_mut().zip(&attn_out).for_each(|(x, a)| *x += a);
            } else {
                layer.o.forward_into(&z, m, &mut x, true)?; // x += z · W_oᵀ
                proj_time += t.elapsed();
            }
            hand(obs, l, Hook::ResidMid, &[m, dm], &mut x)?;
            // hook_mlp_out needs the MLP's output on its own, not added into x as it is computed
            let mut mlp_out = touches(obs, l, Hook::MlpOut).then(|| vec![0f32; m * dm]);
            // SwiGLU MLP [Shazeer 2020, arXiv:2002.05202, eq. (5)], x += down(silu(gate) · up)
            let bias = layer.norm_biases.as_ref().map(|b| &b.1);
            norm_into(&x, &layer.mlp_norm, bias, &mut normed);
            let h = &normed;
            let gated = dims.arch != super::config::Arch::Gpt2;
            for r0 in (0..m).step_by(mlp_rows) {
                let rows = mlp_rows.min(m - r0);
                let t = Instant::now();
                layer
                    .gate_up
                    .forward_into(&h[r0 * dm..(r0 + rows) * dm], rows, &mut gu, false)?;
                proj_time += t.elapsed();
                if !gated {
                    // GPT-2: gelu_new(c_fc(h)), no gate
                    gelu_tanh(&gu[..rows * ff], &mut act[..rows * ff]);
                } else if dims.arch.is_gemma() {
                    geglu_tanh(&gu[..rows * 2 * ff], ff, &mut act[..rows * ff]);
                } else {
                    swiglu(&gu[..rows * 2 * ff], ff, &mut act[..rows * ff]);
                }
                let t = Instant::now();
                if layer.down.has_bias() || layer.post_norms.is_some() || mlp_out.is_some() {
                    let mut out = layer.down.forward(&act[..rows * ff], rows)?;
                    if let Some((_, post_mlp)) = &layer.post_norms {
                        // Gemma: the MLP's output is normalized before the residual add
                        out = rms_norm(&out, post_mlp, dims.rms_eps);
                    }
                    let dest = match mlp_out.as_mut() {
                        Some(o) => &mut o[r0 * dm..(r0 + rows) * dm],
                        None => &mut x[r0 * dm..(r0 + rows) * dm],
                    };
                    dest.iter_mut().zip(&out).for_each(|(x, a)| *x += a);
                } else {
                    layer.down.forward_into(
                        &act[..rows * ff],
                        rows,
                        &mut x[r0 * dm..(r0 + rows) * dm],
                        true,
                    )?;
                }
                proj_time += t.elapsed();
            }
            if let Some(mut out) = mlp_out {
                hand(obs, l, Hook::MlpOut, &[m, dm], &mut out)?;
                x.iter_mut().zip(&out).for_each(|(x, a)| *x += a);
            }
            if !all_finite(&x) {
                return Err(Error::NonFinite {
                    what: "the residual stream after the layer's MLP".into(),
                    layer: Some(l),
                });
            }
            hand(obs, l, Hook::ResidPost, &[m, dm], &mut x)?;
            obs.layer_done(l);
            if interrupted() {
                return Err(Error::Interrupted);
            }
        }
        // the layers' buffers are done with: a long input's tens of megabytes go back to the
        // system before the logits bring in the output head's pages (measured: `inspect` at
        // 2,041 tokens peaks 1.72 → 1.64 GB)
        let freed = 4 * (gu.len() + act.len() + normed.len() + qkv.len() + qh.len() + z.len());
        drop((gu, act, normed, qkv, qh, z));
        if freed >= 16 << 20 {
            release_attention_buffers();
            super::return_free_memory();
        }
        let n_logits = logit_rows.len();
        let logits = if n_logits == 0 {
            Vec::new()
        } else {
            let rows: Vec<f32> = logit_rows
                .iter()
                .flat_map(|&r| x[r * dm..(r + 1) * dm].iter().copied())
                .collect();
            let h = match &self.weights.final_norm_bias {
                Some(b) => layer_norm(&rows, &self.weights.final_norm, b, dims.rms_eps),
                None => rms_norm(&rows, &self.weights.final_norm, dims.rms_eps),
            };
            let mut rows = logits_rows(&self.weights.lm_head, h, n_logits, dm)?;
            if let Some(cap) = dims.gemma.as_ref().and_then(|g| g.final_softcap) {
                // Gemma 2: final-logit soft-capping
                rows.iter_mut()
                    .flatten()
                    .for_each(|z| *z = (*z / cap).tanh() * cap);
            }
            if !rows.iter().all(|r| all_finite(r)) {
                return Err(Error::NonFinite {
                    what: "the logits".into(),
                    layer: None,
                });
            }
            rows
        };
        let kv = opts.keep_kv.then_some(KvPrefix {
            len: n_max,
            n_kv: nkv,
            head_dim: hd,
            layers: kept,
        });
        Ok(ForwardOut {
            logits,
            timings: Timings {
                attention: attn_time,
                projections: proj_time,
                total: start.elapsed(),
            },
            kv,
        })
    }

    /// `hook_resid_pre` of layer 0 for the stacked segments: token embeddings, plus GPT-2's
    /// learned positions, times Gemma's √d_model. `[m, d_model]`.
    fn embed_rows(&self, segs: &[Segment], row0: &[usize]) -> Result<Vec<f32>> {
        let dims = &self.dims;
        let dm = dims.d_model;
        let all_tokens: Vec<u32> = segs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let mut x: Vec<f32> = self
            .weights
            .embed
            .lookup(&all_tokens)?
            .flatten_all()?
            .to_vec1()?; // [m, d_model]
        if let Some(pe) = &self.weights.pos_embed {
            // GPT-2: learned absolute positions
            for (seg, &r0) in segs.iter().zip(row0) {
                let rows = &mut x[r0 * dm..(r0 + seg.tokens.len()) * dm];
                for (r, row) in rows.chunks_mut(dm).enumerate() {
                    let p = seg.reuse + r;
                    row.iter_mut()
                        .zip(&pe[p * dm..(p + 1) * dm])
                        .for_each(|(v, e)| *v += e);
                }
            }
        }
        if let Some(g) = &dims.gemma {
            // Gemma scales the embeddings by √d_model
            x.iter_mut().for_each(|v| *v *= g.embed_scale);
        }
        Ok(x)
    }

    /// Each head's part of layer `layer`'s attention output before W_O's bias (TransformerLens's
    /// `hook_result`) from `z` (`[rows, n_heads, head_dim]`): `[rows, n_heads, d_model]`, and the
    /// bias (`[d_model]`, zeros without one). Their sum over heads plus the bias is the output
    /// projection of `z` (up to the order of the additions). One product per head: asked for only.
    pub fn head_results(
        &self,
        layer: usize,
        z: &[f32],
        rows: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let d = &self.dims;
        let (nh, hd, dm) = (d.n_heads, d.head_dim, d.d_model);
        let o = &self.weights.layers[layer].o;
        let width = nh * hd;
        let bias = o.forward(&vec![0f32; width], 1)?;
        let mut out = vec![0f32; rows * nh * dm];
        let mut zh = vec![0f32; rows * width];
        for h in 0..nh {
            zh.fill(0.0);
            for r in 0..rows {
                zh[r * width + h * hd..][..hd].copy_from_slice(&z[r * width + h * hd..][..hd]);
            }
            let y = o.forward(&zh, rows)?;
            for r in 0..rows {
                let dst = &mut out[(r * nh + h) * dm..][..dm];
                dst.iter_mut()
                    .zip(&y[r * dm..(r + 1) * dm])
                    .zip(&bias)
                    .for_each(|((o, &y), &b)| *o = y - b);
            }
        }
        Ok((out, bias))
    }

    /// Row `id` of the output head (TransformerLens's `W_U[:, id]`), `[d_model]` f32.
    pub fn unembed_row(&self, id: u32) -> Result<Vec<f32>> {
        let dm = self.dims.d_model;
        if id as usize >= self.dims.vocab_size {
            return Err(Error::OutOfRange {
                what: "token id".into(),
                value: id.to_string(),
                range: format!("0..{}", self.dims.vocab_size),
            });
        }
        let row_of = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(t.to_dtype(DType::F32)?
                .narrow(0, id as usize, 1)?
                .flatten_all()?
                .to_vec1()?)
        };
        match &self.weights.lm_head {
            Head::Rows(m) => {
                let mut out = vec![0f32; dm];
                m.rows_to_f32(id as usize, &mut out)?;
                Ok(out)
            }
            Head::Dense(t) => row_of(t),
            Head::Quant(q) => match q {
                candle_core::quantized::QMatMul::QTensor(qt) => {
                    row_of(&qt.dequantize(&Device::Cpu)?)
                }
                candle_core::quantized::QMatMul::Tensor(t)
                | candle_core::quantized::QMatMul::TensorF16(t) => row_of(t),
            },
        }
    }

    /// The final norm's weight and bias (LayerNorm) or weight alone (RMSNorm), and its epsilon.
    pub fn final_norm(&self) -> (&[f32], Option<&[f32]>, f32) {
        (
            &self.weights.final_norm,
            self.weights.final_norm_bias.as_deref(),
            self.dims.rms_eps,
        )
    }

    /// Whether the blocks normalize their attention and MLP outputs before adding them (Gemma's
    /// post-norms): then a block's output is not the sum of per-head parts.
    pub fn has_post_norms(&self) -> bool {
        self.weights.layers.iter().any(|l| l.post_norms.is_some())
    }

    /// Logits of the last position only, nothing captured.
    pub fn next_token_logits(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut out = self.forward(
            tokens,
            &RunOptions::last_logits(tokens.len()),
            &mut super::capture::NoCapture,
        )?;
        Ok(out.logits.pop().expect("one row of logits was asked for"))
    }
}

/// Asked after every layer of every forward whether the user wants to stop (the Python package
/// sets it to Python's signal check, so Ctrl-C interrupts a long run between layers).
static INTERRUPT_CHECK: std::sync::OnceLock<fn() -> bool> = std::sync::OnceLock::new();

/// Installs the check of [`INTERRUPT_CHECK`] (once per process; later calls are ignored).
pub fn set_interrupt_check(f: fn() -> bool) {
    let _ = INTERRUPT_CHECK.set(f);
}

fn interrupted() -> bool {
    INTERRUPT_CHECK.get().is_some_and(|f| f())
}

/// Log-softmax of one logits row (f64 accumulation).
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = (logits
        .iter()
        .map(|&x| ((x - max) as f64).exp())
        .sum::<f64>())
    .ln() as f32
        + max;
    logits.iter().map(|&x| x - lse).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_is_accurate_on_softmax_inputs() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let want = (x as f64).exp();
            let got = fast_exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 3e-7, "worst relative error {worst:e}");
        assert_eq!(fast_exp(0.0), 1.0);
    }

    #[test]
    fn max_and_index_finds_the_maximum_and_its_first_place() {
        for len in [0usize, 1, 15, 16, 17, 40, 63, 64, 65, 100, 130, 200] {
            // ties everywhere: every value occurs in many lanes
            let xs: Vec<f32> = (0..len).map(|i| (i % 7) as f32).collect();
            let want = |ys: &[f32]| {
                let m = ys.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                (m, ys.iter().position(|&x| x == m && m > f32::NEG_INFINITY))
            };
            assert_eq!(max_and_index(&xs), want(&xs), "len {len}");
            assert_eq!(max_and_index(&xs).0, max_of(&xs));
            // a lone maximum anywhere, the remainder included; and a tie at two places
            for at in 0..len {
                let mut ys = xs.clone();
                ys[at] = 9.0;
                assert_eq!(max_and_index(&ys), (9.0, Some(at)), "len {len} at {at}");
                if at + 3 < len {
                    ys[at + 3] = 9.0;
                    assert_eq!(
                        max_and_index(&ys),
                        (9.0, Some(at)),
                        "tie, len {len} at {at}"
                    );
                }
            }
            let masked = vec![f32::NEG_INFINITY; len];
            assert_eq!(max_and_index(&masked), (f32::NEG_INFINITY, None));
        }
    }

    #[test]
    fn all_finite_sees_every_nan_and_infinity() {
        for len in [0usize, 1, 15, 16, 17, 40] {
            let xs: Vec<f32> = (0..len).map(|i| i as f32 - 7.5).collect();
            assert!(all_finite(&xs));
            for at in 0..len {
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                    let mut ys = xs.clone();
                    ys[at] = bad;
                    assert!(!all_finite(&ys), "{bad} at {at} of {len}");
                }
            }
        }
    }

    #[test]
    fn a_nan_score_fails_the_layer() {
        let dims = AttnDims {
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 4,
            q_len: 5,
            k_len: 5,
            window: None,
            scale: None,
            softcap: None,
        };
        let mut rng = crate::reference::Rng::new(3);
        let (q, k, v) = (
            rng.normals(2 * 5 * 4, 1.0),
            rng.normals(5 * 4, 1.0),
            rng.normals(5 * 4, 1.0),
        );
        assert!(attention(
            3,
            &q,
            &k,
            &v,
            dims,
            &[false; 5],
            1 << 20,
            2,
            &mut crate::model::capture::NoCapture
        )
        .is_ok());
        for (at, key_block) in [(0usize, 2usize), (7, 5), (13, 1)] {
            let mut kk = k.clone();
            kk[at] = f32::NAN;
            let e = attention(
                3,
                &q,
                &kk,
                &v,
                dims,
                &[false; 5],
                1 << 20,
                key_block,
                &mut crate::model::capture::NoCapture,
            )
            .unwrap_err();
            assert!(matches!(e, Error::NonFinite { layer: Some(3), .. }), "{e}");
            // with a knocked-out key (the masked path) as well
            let e = attention(
                3,
                &q,
                &kk,
                &v,
                dims,
                &[false, false, true, false, false],
                1 << 20,
                key_block,
                &mut crate::model::capture::NoCapture,
            )
            .unwrap_err();
            assert!(matches!(e, Error::NonFinite { layer: Some(3), .. }), "{e}");
        }
    }

    /// Streamed key blocks of 512 and 1,024 keys (rows 2 and 4 KiB apart, which get
    /// [`ROW_SLACK`]) give the reference's outputs, and with a knockout (the masked path) the
    /// same as blocks whose rows get none.
    #[test]
    fn streamed_blocks_with_row_slack_match_the_reference() {
        let (h, kv, d, n) = (4usize, 2usize, 16usize, 1100usize);
        let mut rng = crate::reference::Rng::new(11);
        let (q, k, v) = (
            rng.normals(h * n * d, 1.0),
            rng.normals(kv * n * d, 1.0),
            rng.normals(kv * n * d, 1.0),
        );
        let dims = AttnDims {
            n_heads: h,
            n_kv_heads: kv,
            head_dim: d,
            q_len: n,
            k_len: n,
            window: None,
            scale: None,
            softcap: None,
        };
        let run = |knock: &[bool], key_block: usize| {
            attention(
                0,
                &q,
                &k,
                &v,
                dims,
                knock,
                1 << 20,
                key_block,
                &mut crate::model::capture::NoCapture,
            )
            .unwrap()
        };
        // the reference takes [position, head, dim] rows
        let rows = |x: &[f32], heads: usize| -> Vec<f32> {
            (0..n)
                .flat_map(|p| (0..heads).flat_map(move |g| x[(g * n + p) * d..][..d].to_vec()))
                .collect()
        };
        let want = crate::reference::grouped_query_attention(
            &rows(&q, h),
            &rows(&k, kv),
            &rows(&v, kv),
            h,
            kv,
            d,
            crate::reference::Mask::Causal { offset: 0 },
        )
        .z;
        let close = |a: &[f32], b: &[f32], what: &str| {
            assert_eq!(a.len(), b.len());
            let worst = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-5, "{what}: worst difference {worst:e}");
        };
        for key_block in [512, 1024] {
            close(
                &run(&vec![false; n], key_block),
                &want,
                &format!("key block {key_block}"),
            );
        }
        let mut knock = vec![false; n];
        for p in [3, 600, 1030] {
            knock[p] = true;
        }
        let plain = run(&knock, 300);
        for key_block in [512, 1024] {
            close(
                &run(&knock, key_block),
                &plain,
                &format!("knockout, key block {key_block}"),
            );
        }
    }

    #[test]
    fn max_of_is_the_maximum() {
        for n in [0usize, 1, 15, 16, 17, 40, 63, 64, 65, 130, 200] {
            let xs: Vec<f32> = (0..n).map(|i| ((i * 7919) % 53) as f32 - 20.0).collect();
            let want = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max_of(&xs), want, "n = {n}");
        }
        assert_eq!(max_of(&[f32::NEG_INFINITY, -3.0, f32::NEG_INFINITY]), -3.0);
    }

    #[test]
    fn streamed_stores_copy_exactly_their_stretch_at_any_alignment() {
        let src: Vec<f32> = (0..100).map(|i| i as f32 * 0.5 - 7.25).collect();
        for start in 0..17 {
            for len in [0, 1, 5, 15, 16, 17, 31, 32, 33, 47, 64, 70] {
                let mut buf = vec![f32::NAN; 120];
                stream_store(&mut buf[start..start + len], &src[..len]);
                stream_fence();
                for (i, x) in buf.iter().enumerate() {
                    if i >= start && i < start + len {
                        assert_eq!(
                            x.to_bits(),
                            src[i - start].to_bits(),
                            "{start}+{len} at {i}"
                        );
                    } else {
                        assert!(x.is_nan(), "{start}+{len}: wrote outside at {i}");
                    }
                }
            }
        }
    }

    #[test]
    fn dense_exp_sums_equal_the_masked_version_on_finite_rows() {
        let xs: Vec<f32> = (0..37)
            .map(|i| ((i * 7919) % 101) as f32 * 0.1 - 5.0)
            .collect();
        let (mut a, mut b) = (xs.clone(), xs.clone());
        let m = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let (la, ta) = exp_shift_sums::<true>(&mut a, m);
        let (lb, tb) = exp_shift_sums::<false>(&mut b, m);
        assert!(
            (la - lb).abs() < 1e-6 && (ta - tb).abs() < 1e-5,
            "{la} {lb} {ta} {tb}"
        );
        assert_eq!(a, b);
    }

    #[test]
    fn exp_shift_sums_zeroes_masked_entries() {
        let mut xs = vec![
            0.5,
            f32::NEG_INFINITY,
            0.25,
            1.0,
            f32::NEG_INFINITY,
            0.0,
            -1.0,
            2.0,
            0.3,
            f32::NEG_INFINITY,
        ];
        let orig = xs.clone();
        let (l, t) = exp_shift_sums::<true>(&mut xs, 2.0);
        let want_l: f64 = orig
            .iter()
            .filter(|x| x.is_finite())
            .map(|&x| ((x - 2.0) as f64).exp())
            .sum();
        let want_t: f64 = orig
            .iter()
            .filter(|x| x.is_finite())
            .map(|&x| ((x - 2.0) as f64).exp() * x as f64)
            .sum();
        assert!((l - want_l).abs() < 1e-6 && (t - want_t).abs() < 1e-6);
        assert_eq!((xs[1], xs[4], xs[9]), (0.0, 0.0, 0.0));
    }

    #[test]
    fn dense_logits_match_candles_matmul() {
        // a [vocab, d] head: the rows read in place against candle's matmul on the same tensor
        let (vocab, d, rows) = (1000, 72, 3);
        let mut rng = crate::reference::Rng::new(11);
        let w = Tensor::from_vec(rng.normals(vocab * d, 0.5), (vocab, d), &Device::Cpu).unwrap();
        let h = rng.normals(rows * d, 1.0);
        let got = logits_rows(&Head::Dense(w.clone()), h.clone(), rows, d).unwrap();
        let want: Vec<Vec<f32>> = Tensor::from_vec(h.clone(), (rows, d), &Device::Cpu)
            .unwrap()
            .matmul(&w.t().unwrap())
            .unwrap()
            .to_vec2()
            .unwrap();
        assert_eq!(got.len(), rows);
        let wv: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
        for (i, (g, c)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.len(), vocab);
            for v in 0..vocab {
                let exact: f64 = (0..d)
                    .map(|j| h[i * d + j] as f64 * wv[v * d + j] as f64)
                    .sum();
                assert!((g[v] as f64 - exact).abs() < 1e-5, "row {i} logit {v}");
                assert!(
                    (g[v] - c[v]).abs() < 1e-5,
                    "row {i} logit {v} against candle"
                );
            }
        }
    }

    #[test]
    fn a_quantized_head_read_a_chunk_at_a_time_equals_its_dequantized_matrix() {
        // Q8_0 blocks (`exact` keeps a file's quantized head as blocks and dequantizes 256
        // vocabulary rows at a time): the same bits as the dense dequantized head, for a vocab
        // that is not a whole number of chunks; fast's candle matmul on the blocks close by
        use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
        let (vocab, d, rows) = (700, 64, 3);
        let mut rng = crate::reference::Rng::new(12);
        let w = Tensor::from_vec(rng.normals(vocab * d, 0.5), (vocab, d), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
        let bytes = q.data().unwrap().to_vec();
        let blocks = Mapped {
            offset: 0,
            len: bytes.len(),
            map: std::sync::Arc::new(super::super::gguf::Backing::Bytes(bytes)),
            dtype: GgmlDType::Q8_0,
            dims: vec![vocab, d],
        };
        let h = rng.normals(rows * d, 1.0);
        let dense = Head::Dense(q.dequantize(&Device::Cpu).unwrap());
        let want = logits_rows(&dense, h.clone(), rows, d).unwrap();
        let got = logits_rows(&Head::Rows(blocks), h.clone(), rows, d).unwrap();
        assert_eq!(got, want);
        let quant = logits_rows(&Head::Quant(QMatMul::from_qtensor(q).unwrap()), h, rows, d);
        for (g, c) in quant.unwrap().iter().zip(&want) {
            assert_eq!(g.len(), vocab);
            // candle quantizes the rows to 8 bits too
            assert!(g
                .iter()
                .zip(c)
                .all(|(a, b)| (a - b).abs() < 0.05 * (1.0 + b.abs())));
        }
        // a head whose rows are not `d` wide is refused, not read askew
        let bad = Mapped {
            offset: 0,
            len: 34,
            map: std::sync::Arc::new(super::super::gguf::Backing::Bytes(vec![0; 34])),
            dtype: GgmlDType::Q8_0,
            dims: vec![1, 32],
        };
        assert!(logits_rows(&Head::Rows(bad), vec![0.0; d], 1, d).is_err());
    }

    #[test]
    fn every_vector_width_gives_the_same_bits() {
        use crate::kernels::simd::{all_supported, with_level, Level};
        // 1,000 values: 62 lanes of 16 and a remainder; scores, gates and a masked stretch
        let xs: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919) % 1013) as f32 * 0.02 - 10.0)
            .collect();
        let mut masked = xs.clone();
        masked[100..180]
            .iter_mut()
            .for_each(|x| *x = f32::NEG_INFINITY);
        let m = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let run = |l: Level| {
            with_level(l, || {
                let (mut d, mut k) = (xs.clone(), masked.clone());
                let sd = exp_shift_sums_dense(&mut d, m);
                let sk = exp_shift_sums_masked(&mut k, m);
                let mut out = vec![0f32; 500];
                swiglu_row(&xs[..500], &xs[500..], &mut out);
                let mut scaled = xs.clone();
                scale_by(&mut scaled, 0.37);
                let mut bad = xs.clone();
                bad[999] = f32::NAN;
                // logits: 3 rows of 100 values (6 lanes of 16 and a remainder) against 10 rows
                let mut logits = vec![0f32; 30];
                let mut rows: Vec<&mut [f32]> = logits.chunks_mut(10).collect();
                dot_rows(&xs[..300], &xs[..1000], 100, &mut rows);
                (
                    (max_of(&xs), max_of(&masked), sd, sk),
                    (d, k, out, scaled, logits),
                    (all_finite(&xs), all_finite(&bad)),
                )
            })
        };
        let levels = all_supported();
        let base = run(Level::Base);
        assert_eq!(base.0 .0, m);
        assert_eq!(base.2, (true, false));
        for l in levels {
            let got = run(l);
            assert_eq!(got.0, base.0, "{l:?}");
            assert_eq!(got.2, base.2, "{l:?}");
            // bit for bit (the loops never fuse a multiply and an add, at any width)
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for (a, b) in [
                (&got.1 .0, &base.1 .0),
                (&got.1 .1, &base.1 .1),
                (&got.1 .2, &base.1 .2),
                (&got.1 .3, &base.1 .3),
                (&got.1 .4, &base.1 .4),
            ] {
                assert_eq!(bits(a), bits(b), "{l:?}");
            }
        }
        if all_supported().len() < 3 {
            eprintln!(
                "simd: this CPU runs {:?} only; the wider bodies were not checked here",
                all_supported()
            );
        }
    }
}
