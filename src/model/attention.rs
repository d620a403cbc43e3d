//! The attention kernel: causal (or, for an encoder, bidirectional) grouped-query attention fused per head and block of query rows
//! with an online softmax (`QKᵀ·scale → mask → softmax in f32 → ·V`), the statistics it streams,
//! and the path for observers that edit the attention maps. The layer loop is in
//! [`super::forward`]; the readable reference is [`crate::reference`].

use super::capture::{Hook, Observer};
use super::error::{Error, Result};
use super::ops::{scale_by, stream_fence, stream_store};
use crate::kernels::gemm::{self, Isa, PackedB};
use crate::kernels::simd::multiversion;
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
    check_shapes(&dims, q, k, v)?;
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
        (q, &q_scaled[..q.len()], k, v),
        dims,
        knockout,
        (block_bytes, key_block),
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

/// Refuses shapes that do not fit [`AttnDims`] (a bug in the caller).
fn check_shapes(dims: &AttnDims, q: &[f32], k: &[f32], v: &[f32]) -> Result<()> {
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

/// One call of the fast kernel, set up: the inputs, what the observer wants of this layer, and
/// how the keys and query rows are blocked.
struct Kernel<'a> {
    layer: usize,
    /// the queries as given (for the rows rescored exactly) and scaled
    q_raw: &'a [f32],
    q: &'a [f32],
    k: &'a [f32],
    dims: AttnDims,
    knockout: &'a [bool],
    any_knockout: bool,
    /// query heads per KV set
    group: usize,
    /// the scale in f64 for the rows rescored exactly ([`rescore_row`])
    scale64: f64,
    /// each KV set packed once: K as the right side of Q·Kᵀ, V as the right side of P·V
    packed: Vec<(PackedB, PackedB)>,
    /// scores can be large: whole rows in one key block, rescored in f64 where they are
    precise: bool,
    want_s: bool,
    want_p: bool,
    /// a map is wanted: a key block spans the whole row
    materialize: bool,
    request: Option<StatsRequest>,
    /// the query positions whose whole rows the observer wants
    want_rows: Vec<usize>,
    /// absolute position of query row 0
    offset: usize,
    /// keys per key block
    kb_size: usize,
    /// query rows per block
    rows_per_block: usize,
    /// floats of slack between a streamed block's rows
    slack: usize,
}

/// One block of query rows, as its heads see it.
struct QueryBlock<'b> {
    /// its first query row and its rows
    q0: usize,
    rows: usize,
    /// the keys any of its rows may see (causal: up to its last row)
    kw: usize,
    /// the whole rows wanted from it: (query row in the block, absolute position)
    wanted: &'b [(usize, usize)],
    /// the caller's rows for the pattern are zeroed already
    zeroed: bool,
}

impl<'a> Kernel<'a> {
    /// The kernel's plan for `q` (as given and scaled), `k`, `v`: the KV sets packed, whether
    /// the scores can be large, and the blocks. A layer whose scores can be large (by
    /// Cauchy-Schwarz, max‖q‖·max‖k‖·scale) takes whole rows in one key block, so a row with
    /// large scores can be rescored in f64 and shifted by its exact maximum before it is
    /// rounded to f32 ([`rescore_row`]); elsewhere nothing changes.
    fn new(
        layer: usize,
        (q_raw, q, k, v): (&'a [f32], &'a [f32], &'a [f32], &'a [f32]),
        dims: AttnDims,
        knockout: &'a [bool],
        (block_bytes, key_block): (usize, usize),
        k_sq: Option<f64>,
        obs: &mut dyn Observer,
    ) -> Self {
        let AttnDims {
            n_heads,
            n_kv_heads: n_kv,
            head_dim: d,
            q_len: n,
            k_len,
            scale,
            ..
        } = dims;
        let isa = Isa::detect();
        let scale64 = scale.map_or(1.0 / (d as f64).sqrt(), |s| s as f64);
        let precise = {
            let k_sq = k_sq.unwrap_or_else(|| max_row_sq(k, d));
            (max_row_sq(q, d) * k_sq).sqrt() > EXACT_SCORES_ABOVE as f64
        };
        let (want_s, want_p) = (
            obs.wants(layer, Hook::AttnScores),
            obs.wants(layer, Hook::Pattern),
        );
        let materialize = want_s || want_p;
        let want_rows: Vec<usize> = obs
            .wants_rows(layer)
            .into_iter()
            .filter(|&i| i < k_len && i + n >= k_len)
            .collect();
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
        let kb_size = if materialize || precise {
            k_len
        } else {
            key_block.max(1)
        };
        // rows per block so that one [n_heads, rows, key block] f32 block stays under
        // block_bytes, a quarter of it when streaming: measured on the default model, streamed
        // attention at 2,048 tokens took 0.90 s with 2 MiB blocks against 1.00-1.02 s with
        // 8 MiB (512 tokens: 0.10 s against 0.115 s), while whole rows kept 8 MiB (2.34-2.45 s
        // against 2.73-2.80 s)
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
        // a streamed block's rows get a little slack: at 1,024 keys they were 4 KiB apart, so
        // the 12 rows of one tile fell in one set of the 8-way L1 (the scores' tile stores and
        // P·V's reads of them missed it, row after row)
        let slack = if materialize { 0 } else { ROW_SLACK };
        Kernel {
            layer,
            q_raw,
            q,
            k,
            dims,
            knockout,
            any_knockout: knockout.iter().any(|&b| b),
            group: n_heads / n_kv,
            scale64,
            packed,
            precise,
            want_s,
            want_p,
            materialize,
            request: obs.wants_stats(layer),
            want_rows,
            offset: k_len - n,
            kb_size,
            rows_per_block,
            slack,
        }
    }

    /// Query rows `q0..q0 + rows`: every head's scores, softmax and `P·V` in parallel
    /// ([`Kernel::head`]), in score buffers reused from block to block and layer to layer (a
    /// fresh one of each size would be page-faulted in anew: measured ~2.5 M faults, ~4 s at
    /// 2,048 tokens), or in the caller's own rows for the pattern where it offers them (the
    /// block's scores, softmax and P·V then run in place there: a whole row per query, one key
    /// block); then [`Kernel::hand_out`].
    fn query_block(
        &self,
        q0: usize,
        rows: usize,
        obs: &mut dyn Observer,
        z: &mut [f32],
    ) -> Result<()> {
        let AttnDims {
            n_heads,
            head_dim: d,
            k_len,
            causal,
            ..
        } = self.dims;
        let (layer, offset, want_s) = (self.layer, self.offset, self.want_s);
        // keys after the block's last query are masked for every row (causal); an encoder's
        // rows see every key
        let kw = if causal { offset + q0 + rows } else { k_len };
        // width of one key block's score buffer, and floats between rows of a head's block
        let kbw = self.kb_size.min(kw);
        let ldw = kbw + self.slack;
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
        let wanted: Vec<(usize, usize)> = self
            .want_rows
            .iter()
            .filter(|&&i| i >= offset + q0 && i < offset + q0 + rows)
            .map(|&i| (i - offset - q0, i))
            .collect();
        // one chunk per head (of at least one float, so the zip below has a chunk for every head)
        let row_chunk = (wanted.len() * k_len).max(1);
        let mut row_out = vec![0f32; n_heads * row_chunk];
        let (mut dests, zeroed): (Vec<Option<&mut [f32]>>, bool) = match self
            .want_p
            .then(|| obs.pattern_rows(layer, offset + q0, rows, n_heads, k_len))
            .flatten()
        {
            Some(d)
                if self.materialize
                    && d.heads.len() == n_heads
                    && d.heads.iter().all(|x| x.len() == rows * k_len) =>
            {
                (d.heads.into_iter().map(Some).collect(), d.zeroed)
            }
            _ => ((0..n_heads).map(|_| None).collect(), false),
        };
        let direct = dests[0].is_some();
        let blk = QueryBlock {
            q0,
            rows,
            kw,
            wanted: &wanted,
            zeroed,
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
                    self.head(&blk, h, s_h, raw_h, st_h, z_h, rows_h, dest.as_deref_mut())
                },
            );
        } else {
            tasks.for_each(|(h, ((((s_h, st_h), z_h), rows_h), dest))| {
                self.head(
                    &blk,
                    h,
                    s_h,
                    &mut [],
                    st_h,
                    z_h,
                    rows_h,
                    dest.as_deref_mut(),
                )
            });
        }
        drop(dests);
        let maps = (&*raw_scores, (!direct).then_some(&*scores));
        self.hand_out(&blk, &state, &row_out, maps, &zb, obs, z)
    }

    /// A block's results handed out: refused when a score was not finite (a NaN or infinite
    /// score, from corrupt weights or an overflow, poisons Σ p·s: refuse the layer rather than
    /// hand out rows in which it silently became weight 0), then the wanted whole rows
    /// (`attention_rows`), the maps (`raw` scores, `pattern` unless the caller's rows hold it),
    /// the statistics, and `zb` (`[n_heads, rows, d]`) into `z` (`[n, n_heads, d]`).
    #[allow(clippy::too_many_arguments)]
    fn hand_out(
        &self,
        blk: &QueryBlock,
        state: &[RowState],
        row_out: &[f32],
        (raw, pattern): (&[f32], Option<&[f32]>),
        zb: &[f32],
        obs: &mut dyn Observer,
        z: &mut [f32],
    ) -> Result<()> {
        let AttnDims {
            n_heads,
            head_dim: d,
            k_len,
            ..
        } = self.dims;
        let (layer, q0, rows, kw) = (self.layer, blk.q0, blk.rows, blk.kw);
        let start = self.offset + q0;
        if state
            .iter()
            .any(|st| !(st.t.is_finite() && st.l.is_finite() && st.m < f32::INFINITY))
        {
            return Err(Error::NonFinite {
                what: "the attention scores".into(),
                layer: Some(layer),
            });
        }
        let row_chunk = (blk.wanted.len() * k_len).max(1);
        for (w, &(_, i)) in blk.wanted.iter().enumerate() {
            let mut all = vec![0f32; n_heads * k_len];
            for h in 0..n_heads {
                all[h * k_len..(h + 1) * k_len]
                    .copy_from_slice(&row_out[h * row_chunk + w * k_len..][..k_len]);
            }
            obs.attention_rows(layer, i, n_heads, &all);
        }
        if self.want_s {
            obs.attention_block(layer, Hook::AttnScores, start, [n_heads, rows, kw], raw);
        }
        if let (true, Some(p)) = (self.want_p, pattern) {
            obs.attention_block(layer, Hook::Pattern, start, [n_heads, rows, kw], p);
        }
        if let Some(r) = self.request {
            let stats = AttnStats::from_states(state, n_heads, rows, r.top_k);
            obs.attention_stats(layer, start, &stats);
        }
        for h in 0..n_heads {
            for x in 0..rows {
                z[((q0 + x) * n_heads + h) * d..][..d]
                    .copy_from_slice(&zb[(h * rows + x) * d..][..d]);
            }
        }
        Ok(())
    }

    /// Head `h` of a query block: its key blocks one after another (scores
    /// [`Kernel::scores`], online softmax [`Kernel::softmax_rows`], `P·V` accumulated with the
    /// running rescale into `z_h`), then `z_h` normalized and the wanted rows recomputed
    /// ([`Kernel::streamed_rows`]); with one key block for the whole row the pattern is in the
    /// buffer and is handed from there ([`Kernel::pattern_out`]).
    #[allow(clippy::too_many_arguments)]
    fn head(
        &self,
        blk: &QueryBlock,
        h: usize,
        s_h: &mut [f32],
        raw_h: &mut [f32],
        st_h: &mut [RowState],
        z_h: &mut [f32],
        rows_h: &mut [f32],
        mut dest: Option<&mut [f32]>,
    ) {
        let AttnDims {
            head_dim: d,
            window,
            ..
        } = self.dims;
        let (q0, rows, kw) = (blk.q0, blk.rows, blk.kw);
        let (_, vp) = &self.packed[h / self.group];
        let mut corr = vec![0f32; rows];
        // a sliding window hides every key before the block's first query's window: those
        // key blocks are never computed, so a windowed layer costs O(n · window)
        let mut k0 = match window {
            Some(w) if !self.materialize && !self.precise => {
                (self.offset + q0 + 1).saturating_sub(w) / self.kb_size * self.kb_size
            }
            _ => 0,
        };
        while k0 < kw {
            let kn = self.kb_size.min(kw - k0);
            let single = k0 == 0 && kn == kw;
            // rows of kn scores in the scratch block (in L2: the caller's rows are written
            // once, finished, at the end; computed in place there, with rows 4·k_len bytes
            // apart, the GEMM's tile stores missed the cache)
            // (streamed: a stride of whole 2 KiB steps gets the slack)
            let ld = if self.slack > 0 && kn % 512 == 0 {
                kn + self.slack
            } else {
                kn
            };
            let s = &mut s_h[..rows * ld];
            self.scores(blk, h, k0..k0 + kn, s, ld, raw_h);
            self.softmax_rows(blk, h, k0..k0 + kn, s, ld, raw_h, st_h, &mut corr);
            if k0 > 0 {
                for (zr, &c) in z_h.chunks_mut(d).zip(&corr) {
                    scale_by(zr, c);
                }
            }
            gemm::gemm_sub(s, ld, rows, vp, k0..k0 + kn, 0..d, z_h, d, k0 > 0, false);
            if single {
                self.pattern_out(blk, s, ld, kn, rows_h, dest.as_deref_mut());
                return;
            }
            debug_assert!(dest.is_none(), "the caller's rows take one key block");
            k0 += kn;
        }
        for (zr, st) in z_h.chunks_mut(d).zip(st_h.iter()) {
            let inv = if st.l > 0.0 { (1.0 / st.l) as f32 } else { 0.0 };
            scale_by(zr, inv);
        }
        self.streamed_rows(blk, h, st_h, rows_h);
    }

    /// Head `h`'s raw scores `q·k` of the keys `keys` into `s` (`[rows, ld]`), soft-capped
    /// (Gemma 2); a copy with the masked keys at -inf into `raw_h` when `hook_attn_scores`
    /// is wanted.
    fn scores(
        &self,
        blk: &QueryBlock,
        h: usize,
        keys: std::ops::Range<usize>,
        s: &mut [f32],
        ld: usize,
        raw_h: &mut [f32],
    ) {
        let AttnDims {
            head_dim: d,
            q_len: n,
            softcap,
            window,
            causal,
            ..
        } = self.dims;
        let (q0, rows) = (blk.q0, blk.rows);
        let (k0, kn) = (keys.start, keys.len());
        let (kp, _) = &self.packed[h / self.group];
        let a = &self.q[(h * n + q0) * d..(h * n + q0 + rows) * d];
        gemm::gemm_sub(a, d, rows, kp, 0..d, keys, s, ld, false, false);
        if let Some(cap) = softcap {
            for row in s.chunks_mut(ld) {
                row[..kn]
                    .iter_mut()
                    .for_each(|x| *x = (*x / cap).tanh() * cap);
            }
        }
        if !raw_h.is_empty() {
            for (x, (src, dst)) in s.chunks(ld).zip(raw_h.chunks_mut(kn)).enumerate() {
                let i = self.offset + q0 + x;
                for (j, (&sc, out)) in src[..kn].iter().zip(dst.iter_mut()).enumerate() {
                    *out = if visible_in(causal, i, k0 + j, self.knockout, window) {
                        sc
                    } else {
                        f32::NEG_INFINITY
                    };
                }
            }
        }
    }

    /// The online softmax update of a key block's scores `s`, one query row at a time: mask,
    /// new shift m' = max(m, block max), rescale the sums by exp(m - m') (the factor left in
    /// `corr` for `z`), and leave p = exp(s - m') in the buffer for the weighted sum of values;
    /// normalized in place when the block holds the whole row (p is then the pattern). A row
    /// with large scores is rescored exactly first ([`rescore_row`]).
    #[allow(clippy::too_many_arguments)]
    fn softmax_rows(
        &self,
        blk: &QueryBlock,
        h: usize,
        keys: std::ops::Range<usize>,
        s: &mut [f32],
        ld: usize,
        raw_h: &mut [f32],
        st_h: &mut [RowState],
        corr: &mut [f32],
    ) {
        let AttnDims {
            head_dim: d,
            q_len: n,
            k_len,
            softcap,
            window,
            causal,
            ..
        } = self.dims;
        let (q0, kw) = (blk.q0, blk.kw);
        let (k0, kn) = (keys.start, keys.len());
        let single = k0 == 0 && kn == kw;
        let knockout = self.knockout;
        // a row's maximum, and where it first stands when the statistics want the argmax
        // (argmax is only looked for when someone takes the statistics)
        let stats = self.request.is_some();
        let peak = |xs: &[f32]| {
            if stats {
                max_and_index(xs)
            } else {
                (max_of(xs), None)
            }
        };
        for (x, (row, (st, c))) in s
            .chunks_mut(ld)
            .zip(st_h.iter_mut().zip(corr.iter_mut()))
            .enumerate()
        {
            let row = &mut row[..kn];
            let i = self.offset + q0 + x;
            if self.precise {
                // (one key block holds the whole row here: k0 == 0, kn == kw)
                let raw = (!raw_h.is_empty()).then(|| &mut raw_h[x * kn..(x + 1) * kn]);
                rescore_row(
                    row,
                    raw,
                    &self.q_raw[(h * n + q0 + x) * d..][..d],
                    &self.k[(h / self.group) * k_len * d..][..k_len * d],
                    self.scale64,
                    softcap,
                    i,
                    knockout,
                    window,
                    causal,
                );
            }
            let top_k = self
                .request
                .filter(|r| r.top_k > 0 && i >= r.top_k_from)
                .map(|r| r.top_k);
            if !self.any_knockout && window.is_none() {
                // the keys of this block the query may see are a prefix of it
                let n_vis = if causal {
                    (i + 1).saturating_sub(k0).min(kn)
                } else {
                    kn
                };
                let (bmax, at) = peak(&row[..n_vis]);
                online_update(st, c, row, n_vis, bmax, at, k0, top_k, true);
            } else {
                for (j, sc) in row.iter_mut().enumerate() {
                    if !visible_in(causal, i, k0 + j, knockout, window) {
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
    }

    /// The pattern of a block held whole in `s` (`[rows, ld]`, `kn` keys): the wanted rows
    /// into `rows_h`, and every row into the caller's `dest` past the cache (nothing reads them
    /// here again); the keys past the block are masked: zero (already, in fresh or recycled
    /// memory that says so).
    fn pattern_out(
        &self,
        blk: &QueryBlock,
        s: &[f32],
        ld: usize,
        kn: usize,
        rows_h: &mut [f32],
        dest: Option<&mut [f32]>,
    ) {
        let k_len = self.dims.k_len;
        let kw = blk.kw;
        for (w, &(x, _)) in blk.wanted.iter().enumerate() {
            rows_h[w * k_len..w * k_len + kw].copy_from_slice(&s[x * ld..x * ld + kn]);
        }
        if let Some(out) = dest {
            for (src, dst) in s.chunks(ld).zip(out.chunks_mut(k_len)) {
                stream_store(&mut dst[..kn], &src[..kn]);
                if !blk.zeroed {
                    dst[kn..].fill(0.0);
                }
            }
            stream_fence();
        }
    }

    /// Streamed: the wanted rows' scores recomputed and normalized with the row's final shift
    /// and sum, p = e^(s - m) / l (one row of work per wanted query), into `rows_h`.
    fn streamed_rows(&self, blk: &QueryBlock, h: usize, st_h: &[RowState], rows_h: &mut [f32]) {
        let AttnDims {
            head_dim: d,
            q_len: n,
            k_len,
            softcap,
            window,
            causal,
            ..
        } = self.dims;
        let (kp, _) = &self.packed[h / self.group];
        for (w, &(x, i)) in blk.wanted.iter().enumerate() {
            let st = &st_h[x];
            let out = &mut rows_h[w * k_len..(w + 1) * k_len];
            let a_row = &self.q[(h * n + blk.q0 + x) * d..(h * n + blk.q0 + x + 1) * d];
            // the keys the row may see: up to itself (causal), else all
            let end = if causal { i + 1 } else { k_len };
            gemm::gemm_sub(
                a_row,
                d,
                1,
                kp,
                0..d,
                0..end,
                &mut out[..end],
                end,
                false,
                false,
            );
            if let Some(cap) = softcap {
                out[..end]
                    .iter_mut()
                    .for_each(|x| *x = (*x / cap).tanh() * cap);
            }
            for (j, p) in out[..end].iter_mut().enumerate() {
                *p = if visible_in(causal, i, j, self.knockout, window) && st.l > 0.0 {
                    (fast_exp(*p - st.m) as f64 / st.l) as f32
                } else {
                    0.0
                };
            }
        }
    }
}

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
fn rescore_row(
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

/// Floats of slack between the rows of a streamed score block whose rows would otherwise lie a
/// multiple of 2 KiB apart (64 bytes: one cache line).
pub(crate) const ROW_SLACK: usize = 16;

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

/// Collects one segment's whole attention maps at one layer (for [`attention_edited`]) and hands
/// everything else to the observer it wraps.
pub(crate) struct MapTap<'a> {
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
pub(crate) fn attention_edited(
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
    let (nh, rows, k_len) = (dims.n_heads, dims.q_len, dims.k_len);
    let offset = k_len - rows;
    let (mut scores, mut pattern) =
        whole_maps(layer, q, k, v, dims, knockout, block_bytes, obs, z)?;
    let shape = [nh, rows, k_len];
    // a hook that only reads leaves the kernel's z as it is (the same bits as without it)
    let before = pattern.clone();
    if obs.edits(layer, Hook::AttnScores) {
        edit_scores(obs, layer, &shape, &mut scores, &mut pattern)?;
    }
    if obs.wants(layer, Hook::AttnScores) {
        obs.attention_block(layer, Hook::AttnScores, offset, shape, &scores);
    }
    if obs.edits(layer, Hook::Pattern) {
        edit_pattern(obs, layer, &shape, &mut pattern)?;
    }
    if obs.wants(layer, Hook::Pattern) {
        obs.attention_block(layer, Hook::Pattern, offset, shape, &pattern);
    }
    if pattern != before {
        pattern_times_values(&pattern, v, dims, z);
    }
    Ok(())
}

/// The fast kernel run with whole rows (one key block) into `z`, its scores and pattern kept
/// whole by a [`MapTap`] (what the observer wants besides is handed on): `(scores, pattern)`,
/// `[n_heads, q_len, k_len]` each, masked keys -inf and 0.
#[allow(clippy::too_many_arguments)]
fn whole_maps(
    layer: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    knockout: &[bool],
    block_bytes: usize,
    obs: &mut dyn Observer,
    z: &mut [f32],
) -> Result<(Vec<f32>, Vec<f32>)> {
    let (nh, rows, k_len) = (dims.n_heads, dims.q_len, dims.k_len);
    let mut tap = MapTap {
        inner: obs,
        layer,
        offset: k_len - rows,
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
    Ok((tap.scores, tap.pattern))
}

/// `hook_attn_scores` handed to the editing observer, then every edited row softmaxed again
/// into `pattern` (f64 sums); a NaN or +inf, or a row with every key masked, is refused.
fn edit_scores(
    obs: &mut dyn Observer,
    layer: usize,
    shape: &[usize; 3],
    scores: &mut [f32],
    pattern: &mut [f32],
) -> Result<()> {
    let k_len = shape[2];
    let name = || super::capture::hook_name(layer, Hook::AttnScores);
    obs.edit(layer, Hook::AttnScores, shape, scores)
        .map_err(|msg| Error::Hook { name: name(), msg })?;
    if scores.iter().any(|s| s.is_nan() || *s == f32::INFINITY) {
        return Err(Error::Hook {
            name: name(),
            msg: "left a NaN or +infinity in the scores (-infinity masks a key); refused".into(),
        });
    }
    for (row, out) in scores.chunks(k_len).zip(pattern.chunks_mut(k_len)) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            return Err(Error::Hook {
                name: name(),
                msg: "masked every key of a query row (all -infinity): its softmax is undefined"
                    .into(),
            });
        }
        let sum: f64 = row.iter().map(|&s| ((s - max) as f64).exp()).sum();
        for (o, &s) in out.iter_mut().zip(row) {
            *o = (((s - max) as f64).exp() / sum) as f32;
        }
    }
    Ok(())
}

/// `hook_pattern` handed to the editing observer; a non-finite weight is refused (the pattern
/// then weighs the values as it is, unnormalized or not).
fn edit_pattern(
    obs: &mut dyn Observer,
    layer: usize,
    shape: &[usize; 3],
    pattern: &mut [f32],
) -> Result<()> {
    let name = || super::capture::hook_name(layer, Hook::Pattern);
    obs.edit(layer, Hook::Pattern, shape, pattern)
        .map_err(|msg| Error::Hook { name: name(), msg })?;
    if !all_finite(pattern) {
        return Err(Error::Hook {
            name: name(),
            msg: "left a non-finite value (NaN or infinity) in the pattern; refused".into(),
        });
    }
    Ok(())
}

/// `z = pattern · V` (`z`: `[q_len, n_heads, head_dim]`), each query head on its KV set, for
/// an edited pattern.
fn pattern_times_values(pattern: &[f32], v: &[f32], dims: AttnDims, z: &mut [f32]) {
    let (nh, rows, k_len, d) = (dims.n_heads, dims.q_len, dims.k_len, dims.head_dim);
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
}
