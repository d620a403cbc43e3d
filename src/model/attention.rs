//! The attention kernel: causal (or, for an encoder, bidirectional) grouped-query attention fused per head and block of query rows
//! with an online softmax (`QKᵀ·scale → mask → softmax in f32 → ·V`), the statistics it streams,
//! and the path for observers that edit the attention maps. The layer loop is in
//! `forward`; the readable reference is [`crate::reference`].
//!
//! The parts: the fused kernel and its steps (`kernel`), the online softmax's arithmetic
//! (`online`), the rows of large scores rescored in f64 (`exact`), and the path of an
//! observer that edits the maps (`edited`).

mod edited;
mod exact;
mod kernel;
mod online;

pub(crate) use edited::attention_edited;
pub(crate) use exact::{dot_f64, EXACT_SCORES_ABOVE};
pub(crate) use online::{all_finite, exp_shift_sums_masked, fast_exp};
#[cfg(test)]
pub(crate) use online::{exp_shift_sums, exp_shift_sums_dense, max_and_index, max_of};

use super::capture::Observer;
use super::error::{Error, Result};
use kernel::Kernel;
use rayon::prelude::*;

/// Whether key `j` is visible to the query at absolute position `i` (causal mask, sliding
/// window and knockout; a token always sees itself).
#[inline]
pub(crate) fn visible(i: usize, j: usize, knockout: &[bool], window: Option<usize>) -> bool {
    j <= i
        && window.is_none_or(|w| j + w > i)
        && (j == i || !knockout.get(j).copied().unwrap_or(false))
}

/// [`visible`], or with `causal` false (an encoder) every key but the knocked-out ones.
#[inline]
pub(crate) fn visible_in(
    causal: bool,
    i: usize,
    j: usize,
    knockout: &[bool],
    window: Option<usize>,
) -> bool {
    if causal {
        visible(i, j, knockout, window)
    } else {
        j == i || !knockout.get(j).copied().unwrap_or(false)
    }
}

/// The running state of one (head, query) row of the online softmax.
#[derive(Clone)]
pub(crate) struct RowState {
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
pub(crate) struct Reused {
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
pub(crate) fn release_attention_buffers() {
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
    /// Causal (every decoder): a query sees itself and the keys before it. `false`
    /// (an encoder): every query sees every key, the keys after it too; no window then.
    pub causal: bool,
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
    attention_bounded(
        layer,
        q,
        k,
        v,
        dims,
        knockout,
        (block_bytes, key_block),
        None,
        obs,
        z,
    )
}

/// The largest squared norm of the `d`-wide rows of `xs`, each summed in f64 in order: the key
/// side of [`attention_into`]'s score bound. Exact as a maximum, so the bound of keys that are
/// a prefix's and then new ones is the larger of the two parts' bounds, bit for bit.
pub(crate) fn max_row_sq(xs: &[f32], d: usize) -> f64 {
    xs.chunks_exact(d)
        .map(|r| r.iter().map(|&x| x as f64 * x as f64).sum::<f64>())
        .fold(0f64, f64::max)
}

/// [`attention_into`] with the keys' [`max_row_sq`] given where the caller has it (`k_sq`): a
/// decode step's keys are the cached prefix's and one new row, whose bound the forward keeps
/// beside the cache ([`crate::model::forward::KvPrefix`]), so a step does not read every
/// cached key again for it (measured: 7 ms of each step at 2,048 cached tokens of the default
/// model). `None`: computed here. `blocks`: `(block_bytes, key_block)`.
///
/// The steps: the shapes checked ([`check_shapes`]), the queries scaled once
/// ([`scale_queries`]), what the observer wants and how the keys are blocked
/// ([`Kernel::new`]), then one block of query rows at a time ([`Kernel::query_block`]): every
/// head's key blocks ([`Kernel::head`]), then the block's maps, rows, statistics and `z`
/// handed out ([`Kernel::hand_out`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_bounded(
    layer: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    knockout: &[bool],
    (block_bytes, key_block): (usize, usize),
    k_sq: Option<f64>,
    obs: &mut dyn Observer,
    z: &mut [f32],
) -> Result<()> {
    let kv = (k, v, dims.k_len);
    attention_strided(
        layer,
        q,
        kv,
        dims,
        knockout,
        (block_bytes, key_block, false),
        k_sq,
        obs,
        z,
    )
}

/// The keys and values of a layer's KV sets as they lie, `[n_kv_heads, kv_stride, d]` each,
/// and `kv_stride`, the positions from one set's first to the next one's (`≥ k_len`).
pub(crate) type KvLaid<'a> = (&'a [f32], &'a [f32], usize);

/// [`attention_bounded`] on KV sets `kv_stride ≥ k_len` positions apart: `k, v:
/// [n_kv_heads, kv_stride, d]`, of which each set's first `k_len` positions are read. With
/// `decode_step` (`RunOptions::decode_step`, `generate`'s steps), one query row reads the keys
/// and values as they lie instead of packing them for the GEMM (its own bits, within the
/// tested bounds of the whole forward's row). A
/// growing KV cache (`generate`'s, [`crate::model::forward::KvPrefix::reserve`]) keeps room
/// after each set's positions, so a decode step writes its new key and value in place instead
/// of copying the whole cache (the same numbers: only where the sets start moves).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_strided(
    layer: usize,
    q: &[f32],
    (k, v, kv_stride): KvLaid,
    dims: AttnDims,
    knockout: &[bool],
    (block_bytes, key_block, decode_step): (usize, usize, bool),
    k_sq: Option<f64>,
    obs: &mut dyn Observer,
    z: &mut [f32],
) -> Result<()> {
    check_shapes(&dims, q, (k, v, kv_stride))?;
    let n = dims.q_len;
    let z = &mut z[..n * dims.n_heads * dims.head_dim];
    if n == 0 {
        return Ok(());
    }
    // the queries scaled once, so the scores come out of the GEMM already divided by √d
    let scale = dims.scale.unwrap_or(1.0 / (dims.head_dim as f32).sqrt());
    let q_scaled = scale_queries(q, scale);
    let kernel = Kernel::new(
        layer,
        (q, &q_scaled[..q.len()], (k, v, kv_stride)),
        dims,
        knockout,
        (block_bytes, key_block, decode_step),
        k_sq,
        obs,
    );
    let mut q0 = 0;
    while q0 < n {
        let rows = kernel.rows_per_block.min(n - q0);
        kernel.query_block(q0, rows, obs, z)?;
        q0 += rows;
    }
    Ok(())
}

/// Refuses shapes that do not fit [`AttnDims`] (a bug in the caller): `k` and `v` hold
/// `n_kv_heads` sets `kv_stride ≥ k_len` positions apart.
fn check_shapes(dims: &AttnDims, q: &[f32], (k, v, kv_stride): KvLaid) -> Result<()> {
    let AttnDims {
        n_heads,
        n_kv_heads: n_kv,
        head_dim: d,
        q_len: n,
        k_len,
        window,
        causal,
        ..
    } = *dims;
    if k_len < n
        || (!causal && (window.is_some() || k_len != n))
        || n_kv == 0
        || n_heads % n_kv != 0
        || q.len() != n_heads * n * d
        || kv_stride < k_len
        || k.len() != n_kv * kv_stride * d
        || v.len() != k.len()
    {
        return Err(Error::Bug(format!(
            "attention shapes {dims:?} (KV sets {kv_stride} positions apart) with q {} k {} v {} values: you likely have a bug",
            q.len(),
            k.len(),
            v.len()
        )));
    }
    Ok(())
}

/// `q · scale` in a buffer kept on this thread (a fresh one per layer costs its pages every
/// time); its first `q.len()` floats are the scaled queries.
fn scale_queries(q: &[f32], scale: f32) -> Reused {
    let mut q_scaled = Reused::take(&Q_SCALED, q.len());
    let out = &mut q_scaled[..q.len()];
    if q.len() >= 1 << 16 {
        out.par_iter_mut()
            .zip(q.par_iter())
            .for_each(|(y, &x)| *y = x * scale);
    } else {
        out.iter_mut().zip(q).for_each(|(y, &x)| *y = x * scale);
    }
    q_scaled
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
