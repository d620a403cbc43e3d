//! The fused kernel of [`super::attention_bounded`]: its plan for a layer ([`Kernel::new`]), one
//! block of query rows at a time ([`Kernel::query_block`]), each head's key blocks
//! ([`Kernel::head`]) and what is handed to the observer ([`Kernel::hand_out`]).

use super::exact::{rescore_row, EXACT_SCORES_ABOVE};
use super::online::{fast_exp, max_and_index, max_of, online_update};
use super::{max_row_sq, visible_in, AttnDims, AttnStats, KvLaid, Reused, RowState, StatsRequest};
use super::{RAW_SCRATCH, SCRATCH};
use crate::kernels::gemm::{self, Isa, PackedB};
use crate::kernels::simd::multiversion;
use crate::model::capture::{Hook, Observer};
use crate::model::error::{Error, Result};
use crate::model::ops::{dot_rows, scale_by, stream_fence, stream_store};
use rayon::prelude::*;

/// One call of the fast kernel, set up: the inputs, what the observer wants of this layer, and
/// how the keys and query rows are blocked.
pub(super) struct Kernel<'a> {
    layer: usize,
    /// the queries as given (for the rows rescored exactly) and scaled
    q_raw: &'a [f32],
    q: &'a [f32],
    k: &'a [f32],
    /// positions between one KV set's first key and the next set's in `k` and the values
    /// (`k_len`, or more where a growing cache keeps room: [`super::attention_strided`])
    kv_stride: usize,
    dims: AttnDims,
    knockout: &'a [bool],
    any_knockout: bool,
    /// query heads per KV set
    group: usize,
    /// the scale in f64 for the rows rescored exactly ([`rescore_row`])
    scale64: f64,
    /// where each KV set's keys and values are read
    kv: KvSets<'a>,
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
    pub(super) rows_per_block: usize,
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

/// What the heads of one block of query rows leave: each (head, row)'s softmax state
/// (`[n_heads, rows]`), the block's `z` (`[n_heads, rows, d]`) and the wanted whole rows (a
/// chunk of `row_chunk` floats per head).
struct BlockOut {
    state: Vec<RowState>,
    zb: Vec<f32>,
    row_out: Vec<f32>,
    row_chunk: usize,
}

impl BlockOut {
    fn new(dims: &AttnDims, rows: usize, wanted: usize) -> Self {
        let (n_heads, d) = (dims.n_heads, dims.head_dim);
        // one chunk per head (of at least one float, so the zip of the heads has a chunk for
        // every head)
        let row_chunk = (wanted * dims.k_len).max(1);
        BlockOut {
            state: vec![RowState::new(); n_heads * rows],
            zb: vec![0f32; n_heads * rows * d],
            row_out: vec![0f32; n_heads * row_chunk],
            row_chunk,
        }
    }
}

impl<'a> Kernel<'a> {
    /// The kernel's plan for `q` (as given and scaled), `k`, `v` (sets `kv_stride` positions
    /// apart: [`super::attention_strided`]): the KV sets packed, whether
    /// the scores can be large, and the blocks. A layer whose scores can be large (by
    /// Cauchy-Schwarz, max‖q‖·max‖k‖·scale) takes whole rows in one key block, so a row with
    /// large scores can be rescored in f64 and shifted by its exact maximum before it is
    /// rounded to f32 ([`rescore_row`]); elsewhere nothing changes.
    pub(super) fn new(
        layer: usize,
        (q_raw, q, (k, v, kv_stride)): (&'a [f32], &'a [f32], KvLaid<'a>),
        dims: AttnDims,
        knockout: &'a [bool],
        (block_bytes, key_block, decode_step): (usize, usize, bool),
        k_sq: Option<f64>,
        obs: &mut dyn Observer,
    ) -> Self {
        let isa = Isa::detect();
        let d = dims.head_dim;
        let scale64 = dims.scale.map_or(1.0 / (d as f64).sqrt(), |s| s as f64);
        let precise = scores_can_be_large(q, (k, kv_stride), &dims, k_sq);
        let (want_s, want_p) = (
            obs.wants(layer, Hook::AttnScores),
            obs.wants(layer, Hook::Pattern),
        );
        let materialize = want_s || want_p;
        let want_rows = rows_of_this_segment(obs.wants_rows(layer), &dims);
        // one query row of a decode step (`generate`'s: `RunOptions::decode_step`): the keys
        // and values as they are; packing them for the GEMM read and wrote each twice for one
        // row of products (9.6 ms of a 40 ms step of the default model at ~520 keys, with the
        // prefix's copy). Only there: a one-row forward elsewhere (a patching sweep's row
        // resumed on a prefix) keeps the GEMM's bits, which the same row in a whole forward has
        // (`tests/compare_prefix.rs`, `bindings/python/tests/test_patching.py`)
        let kv = if dims.q_len == 1 && decode_step {
            KvSets::Rows { k, v }
        } else {
            KvSets::Packed(pack_kv_sets((k, v, kv_stride), &dims, isa))
        };
        let blocks = Blocking::plan(
            &dims,
            materialize || precise,
            materialize,
            block_bytes,
            key_block,
            isa,
        );
        Kernel {
            layer,
            q_raw,
            q,
            k,
            kv_stride,
            dims,
            knockout,
            any_knockout: knockout.iter().any(|&b| b),
            group: dims.n_heads / dims.n_kv_heads,
            scale64,
            kv,
            precise,
            want_s,
            want_p,
            materialize,
            request: obs.wants_stats(layer),
            want_rows,
            offset: dims.k_len - dims.q_len,
            kb_size: blocks.kb_size,
            rows_per_block: blocks.rows_per_block,
            slack: blocks.slack,
        }
    }

    /// Query rows `q0..q0 + rows`: every head's scores, softmax and `P·V` in parallel
    /// ([`Kernel::head`]), in score buffers reused from block to block and layer to layer (a
    /// fresh one of each size would be page-faulted in anew: measured ~2.5 M faults, ~4 s at
    /// 2,048 tokens), or in the caller's own rows for the pattern where it offers them (the
    /// block's scores, softmax and P·V then run in place there: a whole row per query, one key
    /// block); then [`Kernel::hand_out`].
    pub(super) fn query_block(
        &self,
        q0: usize,
        rows: usize,
        obs: &mut dyn Observer,
        z: &mut [f32],
    ) -> Result<()> {
        let n_heads = self.dims.n_heads;
        let want_s = self.want_s;
        let kw = self.keys_seen(q0, rows);
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
        let wanted = self.wanted_in(q0, rows);
        let mut out = BlockOut::new(&self.dims, rows, wanted.len());
        let (mut dests, zeroed) = self.pattern_dests(obs, q0, rows);
        let direct = dests[0].is_some();
        let blk = QueryBlock {
            q0,
            rows,
            kw,
            wanted: &wanted,
            zeroed,
        };
        self.run_heads(&blk, (scores, ldw), (raw_scores, kbw), &mut out, &mut dests);
        drop(dests);
        let maps = (&*raw_scores, (!direct).then_some(&*scores));
        self.hand_out(&blk, &out.state, &out.row_out, maps, &out.zb, obs, z)
    }

    /// The keys any row of the block `q0..q0 + rows` may see: keys after the block's last
    /// query are masked for every row (causal); an encoder's rows see every key.
    fn keys_seen(&self, q0: usize, rows: usize) -> usize {
        if self.dims.causal {
            self.offset + q0 + rows
        } else {
            self.dims.k_len
        }
    }

    /// The wanted whole rows among the block `q0..q0 + rows`: (query row in the block,
    /// absolute position).
    fn wanted_in(&self, q0: usize, rows: usize) -> Vec<(usize, usize)> {
        let offset = self.offset;
        self.want_rows
            .iter()
            .filter(|&&i| i >= offset + q0 && i < offset + q0 + rows)
            .map(|&i| (i - offset - q0, i))
            .collect()
    }

    /// The caller's own rows for the block's pattern, one per head, where it offers them
    /// whole and the block holds whole rows (else `None` for every head), and whether they are
    /// zeroed already.
    fn pattern_dests<'o>(
        &self,
        obs: &'o mut dyn Observer,
        q0: usize,
        rows: usize,
    ) -> (Vec<Option<&'o mut [f32]>>, bool) {
        let (n_heads, k_len) = (self.dims.n_heads, self.dims.k_len);
        match self
            .want_p
            .then(|| obs.pattern_rows(self.layer, self.offset + q0, rows, n_heads, k_len))
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
        }
    }

    /// Every head of the block in parallel ([`Kernel::head`]), each on its own chunk of the
    /// score buffer (`[rows, ld]` per head), of the raw scores (`[rows, kbw]`, when
    /// `hook_attn_scores` is wanted), of `out` and of `dests`.
    fn run_heads(
        &self,
        blk: &QueryBlock,
        (scores, ldw): (&mut [f32], usize),
        (raw_scores, kbw): (&mut [f32], usize),
        out: &mut BlockOut,
        dests: &mut [Option<&mut [f32]>],
    ) {
        let (rows, d) = (blk.rows, self.dims.head_dim);
        let raw_chunk = if self.want_s { rows * kbw } else { 0 };
        let tasks = scores
            .par_chunks_mut(rows * ldw)
            .zip(out.state.par_chunks_mut(rows))
            .zip(out.zb.par_chunks_mut(rows * d))
            .zip(out.row_out.par_chunks_mut(out.row_chunk))
            .zip(dests.par_iter_mut())
            .enumerate();
        if self.want_s {
            tasks.zip(raw_scores.par_chunks_mut(raw_chunk)).for_each(
                |((h, ((((s_h, st_h), z_h), rows_h), dest)), raw_h)| {
                    self.head(blk, h, s_h, raw_h, st_h, z_h, rows_h, dest.as_deref_mut())
                },
            );
        } else {
            tasks.for_each(|(h, ((((s_h, st_h), z_h), rows_h), dest))| {
                self.head(blk, h, s_h, &mut [], st_h, z_h, rows_h, dest.as_deref_mut())
            });
        }
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
            self.weighted_values(h, s, ld, rows, k0..k0 + kn, z_h, k0 > 0);
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
        let (q0, rows) = (blk.q0, blk.rows);
        let (k0, kn) = (keys.start, keys.len());
        let a = self.queries(h, q0, rows);
        self.scores_of(h, a, rows, keys, s, ld);
        if let Some(cap) = self.dims.softcap {
            for row in s.chunks_mut(ld) {
                soft_cap(&mut row[..kn], cap);
            }
        }
        if !raw_h.is_empty() {
            for (x, (src, dst)) in s.chunks(ld).zip(raw_h.chunks_mut(kn)).enumerate() {
                let i = self.offset + q0 + x;
                for (j, (&sc, out)) in src[..kn].iter().zip(dst.iter_mut()).enumerate() {
                    *out = if self.visible(i, k0 + j) {
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
        let (q0, kw) = (blk.q0, blk.kw);
        let (k0, kn) = (keys.start, keys.len());
        let single = k0 == 0 && kn == kw;
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
                self.rescore(h, q0 + x, i, row, raw);
            }
            self.update_row(i, k0, row, st, c);
            if single {
                // one block holds every visible key: normalize in place, p is the pattern
                let inv = if st.l > 0.0 { (1.0 / st.l) as f32 } else { 0.0 };
                scale_by(row, inv);
            }
        }
    }

    /// Query row `r` (absolute position `i`) of head `h`, held whole in `row`, rescored
    /// exactly where its scores are large ([`rescore_row`]); `raw`: its row of the scores hook.
    #[inline(always)]
    fn rescore(&self, h: usize, r: usize, i: usize, row: &mut [f32], raw: Option<&mut [f32]>) {
        let AttnDims {
            head_dim: d,
            q_len: n,
            ..
        } = self.dims;
        rescore_row(
            row,
            raw,
            &self.q_raw[(h * n + r) * d..][..d],
            kv_set(self.k, h / self.group, self.kv_stride, &self.dims),
            self.scale64,
            self.dims.softcap,
            i,
            self.knockout,
            self.dims.window,
            self.dims.causal,
        );
    }

    /// The online softmax step of query `i`'s scores `row` over the keys `k0..`: the masked
    /// keys set to -inf where some may be (a window or a knockout; else the visible keys are a
    /// prefix of the block), then [`online_update`] with the row's maximum.
    #[inline(always)]
    fn update_row(&self, i: usize, k0: usize, row: &mut [f32], st: &mut RowState, c: &mut f32) {
        let kn = row.len();
        let top_k = self
            .request
            .filter(|r| r.top_k > 0 && i >= r.top_k_from)
            .map(|r| r.top_k);
        if !self.any_knockout && self.dims.window.is_none() {
            // the keys of this block the query may see are a prefix of it
            let n_vis = if self.dims.causal {
                (i + 1).saturating_sub(k0).min(kn)
            } else {
                kn
            };
            let (bmax, at) = self.peak(&row[..n_vis]);
            online_update(st, c, row, n_vis, bmax, at, k0, top_k, true);
        } else {
            for (j, sc) in row.iter_mut().enumerate() {
                if !self.visible(i, k0 + j) {
                    *sc = f32::NEG_INFINITY;
                }
            }
            let (bmax, at) = self.peak(row);
            online_update(st, c, row, kn, bmax, at, k0, top_k, false);
        }
    }

    /// A row's maximum, and where it first stands when the statistics want the argmax (it is
    /// only looked for when someone takes the statistics).
    #[inline(always)]
    fn peak(&self, xs: &[f32]) -> (f32, Option<usize>) {
        if self.request.is_some() {
            max_and_index(xs)
        } else {
            (max_of(xs), None)
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
        let k_len = self.dims.k_len;
        for (w, &(x, i)) in blk.wanted.iter().enumerate() {
            let st = &st_h[x];
            let out = &mut rows_h[w * k_len..(w + 1) * k_len];
            let a_row = self.queries(h, blk.q0 + x, 1);
            // the keys the row may see: up to itself (causal), else all
            let end = if self.dims.causal { i + 1 } else { k_len };
            self.scores_of(h, a_row, 1, 0..end, &mut out[..end], end);
            if let Some(cap) = self.dims.softcap {
                soft_cap(&mut out[..end], cap);
            }
            for (j, p) in out[..end].iter_mut().enumerate() {
                *p = if self.visible(i, j) && st.l > 0.0 {
                    (fast_exp(*p - st.m) as f64 / st.l) as f32
                } else {
                    0.0
                };
            }
        }
    }

    /// `s[x, j − keys.start] = a[x] · k_j` for the `rows` query rows `a` (`[rows, d]`) of head
    /// `h` and the keys `keys` of its KV set (`s`: `[rows, ld]`).
    fn scores_of(
        &self,
        h: usize,
        a: &[f32],
        rows: usize,
        keys: std::ops::Range<usize>,
        s: &mut [f32],
        ld: usize,
    ) {
        let d = self.dims.head_dim;
        match &self.kv {
            KvSets::Packed(sets) => {
                let (kp, _) = &sets[h / self.group];
                gemm::gemm_sub(a, d, rows, kp, 0..d, keys, s, ld, false, false);
            }
            KvSets::Rows { k, .. } => {
                let kg = &self.set_of(k, h)[keys.start * d..keys.end * d];
                for (ar, sr) in a.chunks_exact(d).zip(s.chunks_mut(ld)).take(rows) {
                    row_scores(ar, kg, d, &mut sr[..keys.len()]);
                }
            }
        }
    }

    /// `z[x] (+)= Σ_j p[x, j − keys.start] · v_j` for the `rows` rows of weights `p` (`[rows,
    /// ld]`) over the keys `keys` of head `h`'s KV set (`z`: `[rows, d]`; added with
    /// `accumulate`).
    #[allow(clippy::too_many_arguments)]
    fn weighted_values(
        &self,
        h: usize,
        p: &[f32],
        ld: usize,
        rows: usize,
        keys: std::ops::Range<usize>,
        z: &mut [f32],
        accumulate: bool,
    ) {
        let d = self.dims.head_dim;
        match &self.kv {
            KvSets::Packed(sets) => {
                let (_, vp) = &sets[h / self.group];
                gemm::gemm_sub(p, ld, rows, vp, keys, 0..d, z, d, accumulate, false);
            }
            KvSets::Rows { v, .. } => {
                let vg = &self.set_of(v, h)[keys.start * d..keys.end * d];
                for (pr, zr) in p.chunks(ld).zip(z.chunks_exact_mut(d)).take(rows) {
                    if !accumulate {
                        zr.fill(0.0);
                    }
                    row_values(&pr[..keys.len()], vg, d, zr);
                }
            }
        }
    }

    /// Head `h`'s KV set of `x` (the keys or the values, `[n_kv_heads, kv_stride, d]`): its
    /// first `k_len` positions, `[k_len, d]`.
    #[inline(always)]
    fn set_of<'x>(&self, x: &'x [f32], h: usize) -> &'x [f32] {
        kv_set(x, h / self.group, self.kv_stride, &self.dims)
    }

    /// Head `h`'s scaled queries of rows `r0..r0 + rows` (`[rows, head_dim]`).
    #[inline(always)]
    fn queries(&self, h: usize, r0: usize, rows: usize) -> &[f32] {
        let (n, d) = (self.dims.q_len, self.dims.head_dim);
        &self.q[(h * n + r0) * d..(h * n + r0 + rows) * d]
    }

    /// Whether query `i` sees key `j` in this call ([`visible_in`] with its mask).
    #[inline(always)]
    fn visible(&self, i: usize, j: usize) -> bool {
        visible_in(self.dims.causal, i, j, self.knockout, self.dims.window)
    }
}

/// `s[j] = q · k_j` for the rows `k_j` of `kg` (`[s.len(), d]`), each
/// [`crate::model::ops::dot16`]'s bits: one query row's scores read from the keys as they lie
/// ([`KvSets::Rows`]), in the register tiles of [`dot_rows`] (the same bits at every width; a
/// loop of `dot16` calls compiled to 8-byte loads: SmolLM2 decoded 1.3x slower)
fn row_scores(q: &[f32], kg: &[f32], d: usize, s: &mut [f32]) {
    dot_rows(q, &kg[..s.len() * d], d, &mut [s]);
}

multiversion! {
    /// `z += Σ_j p_j · v_j` over the rows `v_j` of `vg` (`[p.len(), d]`), in order of `j`, each
    /// product rounded before it is added (the same bits at every width)
    fn row_values(p: &[f32], vg: &[f32], d: usize, z: &mut [f32]) {
        for (&w, vr) in p.iter().zip(vg.chunks_exact(d)) {
            z.iter_mut().zip(vr).for_each(|(z, v)| *z += w * v);
        }
    }
}

/// Gemma 2's soft-capping in place: `s ← cap · tanh(s / cap)`.
#[inline]
fn soft_cap(xs: &mut [f32], cap: f32) {
    xs.iter_mut().for_each(|x| *x = (*x / cap).tanh() * cap);
}

/// Whether a layer's scores can be large (by Cauchy-Schwarz, max‖q‖·max‖k‖·scale past
/// [`EXACT_SCORES_ABOVE`]; `q` scaled already): its rows are then rescored exactly
/// ([`rescore_row`]). `k_sq`: the keys' [`max_row_sq`] where the caller has it.
fn scores_can_be_large(
    q: &[f32],
    (k, kv_stride): (&[f32], usize),
    dims: &AttnDims,
    k_sq: Option<f64>,
) -> bool {
    let d = dims.head_dim;
    let k_sq = k_sq.unwrap_or_else(|| {
        (0..dims.n_kv_heads)
            .map(|g| max_row_sq(kv_set(k, g, kv_stride, dims), d))
            .fold(0f64, f64::max)
    });
    (max_row_sq(q, d) * k_sq).sqrt() > EXACT_SCORES_ABOVE as f64
}

/// KV set `g` of `x` (keys or values, `[n_kv_heads, kv_stride, d]`): its first `k_len`
/// positions, `[k_len, d]`.
#[inline(always)]
fn kv_set<'x>(x: &'x [f32], g: usize, kv_stride: usize, dims: &AttnDims) -> &'x [f32] {
    let d = dims.head_dim;
    &x[g * kv_stride * d..][..dims.k_len * d]
}

/// Where the kernel reads each KV set's keys and values.
enum KvSets<'a> {
    /// each set packed once: K as the right side of Q·Kᵀ, V as the right side of P·V (the
    /// GEMM's, for blocks of query rows)
    Packed(Vec<(PackedB, PackedB)>),
    /// as given, `[n_kv_heads, kv_stride, d]` each (one query row: dot products and sums of
    /// rows)
    Rows { k: &'a [f32], v: &'a [f32] },
}

/// Each KV set packed once, in parallel: K as the right side of Q·Kᵀ, V as the right side of
/// P·V.
fn pack_kv_sets((k, v, kv_stride): KvLaid, dims: &AttnDims, isa: Isa) -> Vec<(PackedB, PackedB)> {
    let (d, k_len) = (dims.head_dim, dims.k_len);
    (0..dims.n_kv_heads)
        .into_par_iter()
        .map(|g| {
            let (kg, vg) = (kv_set(k, g, kv_stride, dims), kv_set(v, g, kv_stride, dims));
            (
                PackedB::from_rows(kg, k_len, d, d, isa),
                PackedB::from_cols(vg, k_len, d, d, isa),
            )
        })
        .collect()
}

/// The query positions whose whole rows the observer wants (`wanted`) that lie among this
/// call's query rows.
fn rows_of_this_segment(wanted: Vec<usize>, dims: &AttnDims) -> Vec<usize> {
    let (n, k_len) = (dims.q_len, dims.k_len);
    wanted
        .into_iter()
        .filter(|&i| i < k_len && i + n >= k_len)
        .collect()
}

/// How a call's keys and query rows are blocked.
struct Blocking {
    /// keys per key block
    kb_size: usize,
    /// query rows per block
    rows_per_block: usize,
    /// floats of slack between a streamed block's rows
    slack: usize,
}

impl Blocking {
    /// `whole_rows`: one key block spans the whole row (a map is wanted, or the scores can be
    /// large); `materialize`: a map is wanted. Query rows per block so that one
    /// `[n_heads, rows, key block]` f32 block stays under `block_bytes`, a quarter of it when
    /// streaming: measured on the default model, streamed attention at 2,048 tokens took 0.90 s
    /// with 2 MiB blocks against 1.00-1.02 s with 8 MiB (512 tokens: 0.10 s against 0.115 s),
    /// while whole rows kept 8 MiB (2.34-2.45 s against 2.73-2.80 s).
    fn plan(
        dims: &AttnDims,
        whole_rows: bool,
        materialize: bool,
        block_bytes: usize,
        key_block: usize,
        isa: Isa,
    ) -> Self {
        let (n, k_len) = (dims.q_len, dims.k_len);
        let kb_size = if whole_rows { k_len } else { key_block.max(1) };
        let budget = if materialize {
            block_bytes
        } else {
            block_bytes / 4
        };
        let rows_per_block = (budget / (dims.n_heads * kb_size.min(k_len) * 4).max(1)).clamp(1, n);
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
        Blocking {
            kb_size,
            rows_per_block,
            slack,
        }
    }
}

/// Floats of slack between the rows of a streamed score block whose rows would otherwise lie a
/// multiple of 2 KiB apart (64 bytes: one cache line).
pub(crate) const ROW_SLACK: usize = 16;
