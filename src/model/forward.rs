//! The forward pass: embeddings → blocks → final norm → logits, on candle tensors, with every
//! hook point handed to an [`Observer`]. [`attention`] is the crate's one fast attention; it is
//! explicit (`QKᵀ·scale → mask → softmax in f32 → ·V`) so the weights can be captured, and it
//! works on blocks of query rows so a long sequence never needs a whole `[heads, n, n]` at once.
//! It is tested against [`crate::reference`] on tiny models and against Hugging Face transformers
//! on the real ones.

use super::capture::{Hook, Observer};
use super::config::RopeStyle;
use super::error::{Error, Result};
use super::Model;
use candle_core::{DType, Device, Tensor};
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
    /// Upper bound for one `[heads, rows, keys]` score block, in bytes. 8 MiB keeps a block in
    /// the last-level cache: measured here, 64 MiB blocks made attention 2.2x slower at 1,024
    /// tokens (3.43 s against 1.58 s), 4 MiB was no better than 8.
    pub block_bytes: usize,
    /// Return every layer's keys and values (after RoPE) so later runs can reuse a prefix.
    pub keep_kv: bool,
    /// Keys per block of the streaming softmax (when no pattern is captured).
    pub key_block: usize,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions { logits_at: Vec::new(), knockout: Vec::new(), block_bytes: 8 << 20, keep_kv: false, key_block: 1024 }
    }
}

/// Keys and values (after RoPE) of the first `len` positions of a sequence, per layer
/// (`[n_kv_heads, len, head_dim]` each). Running the rest of a sequence on top of it gives the
/// same numbers as running the whole sequence, since a causal model's first positions do not
/// depend on what comes after them.
#[derive(Clone)]
pub struct KvPrefix {
    pub len: usize,
    layers: Vec<(Tensor, Tensor)>,
}

impl KvPrefix {
    /// The first `len` positions of this prefix.
    pub fn truncate(&self, len: usize) -> Result<KvPrefix> {
        let len = len.min(self.len);
        let layers = self.layers.iter().map(|(k, v)| Ok((k.narrow(1, 0, len)?.contiguous()?, v.narrow(1, 0, len)?.contiguous()?))).collect::<Result<_>>()?;
        Ok(KvPrefix { len, layers })
    }
}

impl RunOptions {
    pub fn last_logits(n: usize) -> Self {
        RunOptions { logits_at: vec![n.saturating_sub(1)], ..Default::default() }
    }
}

/// Where the time went.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timings {
    /// scores, mask, softmax, weighted sum (all layers)
    pub attention: Duration,
    pub total: Duration,
}

pub struct ForwardOut {
    /// One row of `vocab_size` logits per entry of `RunOptions::logits_at`.
    pub logits: Vec<Vec<f32>>,
    pub timings: Timings,
    /// Every layer's keys and values, when `RunOptions::keep_kv` was set.
    pub kv: Option<KvPrefix>,
}

fn emit(obs: &mut dyn Observer, layer: usize, hook: Hook, t: &Tensor, shape: &[usize]) -> Result<()> {
    if obs.wants(layer, hook) {
        let data: Vec<f32> = t.flatten_all()?.to_vec1()?;
        obs.tensor(layer, hook, shape, &data);
    }
    Ok(())
}

/// cos/sin tables `[n, head_dim/2]` for positions `0..n`, computed as transformers does
/// (`inv_freq = 1 / base^(2i/d)` and `pos · inv_freq` in f32), so the rotation angles agree.
pub fn rope_tables(head_dim: usize, base: f32, n: usize) -> Result<(Tensor, Tensor)> {
    let half = head_dim / 2;
    let inv: Vec<f32> = (0..half).map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32)).collect();
    let mut cos = Vec::with_capacity(n * half);
    let mut sin = Vec::with_capacity(n * half);
    for t in 0..n {
        for &f in &inv {
            let angle = (t as f32 * f) as f64;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    Ok((Tensor::from_vec(cos, (n, half), &Device::Cpu)?, Tensor::from_vec(sin, (n, half), &Device::Cpu)?))
}

fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, style: RopeStyle) -> Result<Tensor> {
    Ok(match style {
        RopeStyle::Neox => candle_nn::rotary_emb::rope(x, cos, sin)?,
        RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(x, cos, sin)?,
    })
}

/// Whether key `j` is visible to the query at absolute position `i` (causal mask and knockout;
/// a token always sees itself).
#[inline]
fn visible(i: usize, j: usize, knockout: &[bool]) -> bool {
    j <= i && (j == i || !knockout.get(j).copied().unwrap_or(false))
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

/// Causal grouped-query attention, blocked over query rows and over keys with an online softmax
/// [Milakov & Gimelshein 2018, arXiv:1805.02867; Dao et al. 2022, FlashAttention].
/// `q: [n_heads, n, d]` holds the last `n` of the `k_len` positions of `k, v: [n_kv_heads,
/// k_len, d]` (after RoPE; the first `k_len - n` come from a reused prefix). Returns
/// `z: [n_heads, n, d]`.
///
/// When the observer wants `hook_pattern` or `hook_attn_scores`, each key block spans the
/// whole visible row, which makes the online softmax the ordinary one, and the weights are handed
/// out. Otherwise keys stream in blocks of `key_block`, and no `[n, n]` (not even `[rows, n]`)
/// is ever held; per-row statistics (first-key weight, entropy, max weight, argmax, top-k) come
/// from the same accumulators in both cases.
///
/// Query heads `g·group..(g+1)·group` share K/V set `g` ([`crate::reference::kv_head`]); K/V are
/// never copied per head: the group's queries are stacked into one matmul against its keys.
#[allow(clippy::too_many_arguments)]
pub fn attention(layer: usize, q: &Tensor, k: &Tensor, v: &Tensor, knockout: &[bool], block_bytes: usize, key_block: usize, obs: &mut dyn Observer) -> Result<Tensor> {
    use rayon::prelude::*;
    let (n_heads, n, d) = q.dims3()?;
    let (n_kv, k_len, dk) = k.dims3()?;
    if k_len < n || dk != d || n_heads % n_kv != 0 {
        return Err(Error::Candle(candle_core::Error::Msg(format!("attention shapes q {:?} k {:?}: you likely have a bug", q.dims(), k.dims()))));
    }
    let group = n_heads / n_kv;
    let scale = 1.0 / (d as f32).sqrt();
    let (want_s, want_p) = (obs.wants(layer, Hook::AttnScores), obs.wants(layer, Hook::Pattern));
    let materialize = want_s || want_p;
    let request = obs.wants_stats(layer);
    let top_k = request.map(|r| r.top_k);
    let offset = k_len - n; // absolute position of query row 0
    let kb_size = if materialize { k_len } else { key_block.max(1) };
    // rows per block so that one [n_heads, rows, key block] f32 block stays under block_bytes
    let rows_per_block = (block_bytes / (n_heads * kb_size.min(k_len) * 4).max(1)).clamp(1, n);
    let mut zs = Vec::with_capacity(n.div_ceil(rows_per_block));
    let mut q0 = 0;
    while q0 < n {
        let rows = rows_per_block.min(n - q0);
        let kw = offset + q0 + rows; // keys after the block's last query are masked for every row
        let qb = q.narrow(1, q0, rows)?.contiguous()?.reshape((n_kv, group * rows, d))?;
        let mut state = vec![RowState { m: f32::NEG_INFINITY, l: 0.0, t: 0.0, argmax: 0, s0: f32::NEG_INFINITY, top: Vec::new() }; n_heads * rows];
        let mut acc: Option<Tensor> = None; // Σ exp(s - m) v, [n_kv, group * rows, d]
        let mut k0 = 0;
        while k0 < kw {
            let kn = kb_size.min(kw - k0);
            let (kb, vb) = if k0 == 0 && kn == k_len { (k.clone(), v.clone()) } else { (k.narrow(1, k0, kn)?.contiguous()?, v.narrow(1, k0, kn)?.contiguous()?) };
            // raw scores q·k for this block: [n_kv, group·rows, kn] = [n_heads, rows, kn] row-major
            let mut buf: Vec<f32> = qb.matmul(&kb.t()?)?.flatten_all()?.to_vec1()?;
            if want_s {
                let mut scores = buf.clone();
                for (x, row) in scores.chunks_mut(kn).enumerate() {
                    let i = offset + q0 + x % rows;
                    for (j, sc) in row.iter_mut().enumerate() {
                        *sc = if visible(i, k0 + j, knockout) { *sc * scale } else { f32::NEG_INFINITY };
                    }
                }
                obs.attention_block(layer, Hook::AttnScores, offset + q0, [n_heads, rows, kn], &scores);
            }
            // online softmax update, one (head, query) row at a time, rows in parallel:
            // scale and mask, new shift m' = max(m, block max), rescale the sums by exp(m - m'),
            // and leave p = exp(s - m') in the buffer for the weighted sum of values
            let mut corr = vec![0f32; n_heads * rows];
            let any_knockout = knockout.iter().any(|&b| b);
            buf.par_chunks_mut(kn).zip(state.par_iter_mut()).zip(corr.par_iter_mut()).enumerate().for_each(|(x, ((row, st), c))| {
                let i = offset + q0 + x % rows;
                let top_k = request.filter(|r| r.top_k > 0 && i >= r.top_k_from).map(|r| r.top_k);
                // keys k0.. of this block the query may see: a prefix of the block without
                // knockout (the common case, vectorized below), anything with it
                let n_vis = (i + 1).saturating_sub(k0).min(kn);
                if !any_knockout {
                    row[n_vis..].iter_mut().for_each(|p| *p = f32::NEG_INFINITY);
                    let vis = &mut row[..n_vis];
                    vis.iter_mut().for_each(|sc| *sc *= scale);
                    let bmax = vis.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    online_update(st, c, row, n_vis, bmax, k0, top_k);
                } else {
                    for (j, sc) in row.iter_mut().enumerate() {
                        *sc = if visible(i, k0 + j, knockout) { *sc * scale } else { f32::NEG_INFINITY };
                    }
                    let bmax = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    online_update(st, c, row, kn, bmax, k0, top_k);
                }
            });
            let single = k0 == 0 && kn == kw;
            if single {
                // one block holds every visible key: normalize in place, p is the pattern
                buf.par_chunks_mut(kn).zip(state.par_iter()).for_each(|(row, st)| {
                    let inv = if st.l > 0.0 { (1.0 / st.l) as f32 } else { 0.0 };
                    row.iter_mut().for_each(|p| *p *= inv);
                });
                if want_p {
                    obs.attention_block(layer, Hook::Pattern, offset + q0, [n_heads, rows, kn], &buf);
                }
            }
            let p = Tensor::from_vec(buf, (n_kv, group * rows, kn), &Device::Cpu)?;
            let pv = p.matmul(&vb)?;
            acc = Some(match acc {
                None => pv,
                Some(a) => {
                    let c = Tensor::from_vec(corr, (n_kv, group * rows, 1), &Device::Cpu)?;
                    a.broadcast_mul(&c)?.add(&pv)?
                }
            });
            if single {
                break;
            }
            k0 += kn;
        }
        let acc = acc.expect("every block has at least one key");
        let z = if kb_size >= kw {
            acc // already normalized
        } else {
            let inv: Vec<f32> = state.iter().map(|st| if st.l > 0.0 { (1.0 / st.l) as f32 } else { 0.0 }).collect();
            acc.broadcast_mul(&Tensor::from_vec(inv, (n_kv, group * rows, 1), &Device::Cpu)?)?
        };
        if let Some(kk) = top_k {
            let stats = AttnStats::from_states(&state, n_heads, rows, kk);
            obs.attention_stats(layer, offset + q0, &stats);
        }
        zs.push(z.reshape((n_heads, rows, d))?);
        q0 += rows;
    }
    Ok(if zs.len() == 1 { zs.pop().expect("one block") } else { Tensor::cat(&zs, 1)? })
}

/// One row's online-softmax step over a key block whose scores (scaled, masked = -inf) are in
/// `row[..len]` (the rest is masked): updates the shift, the sums, argmax, first-key score and
/// top-k, leaves `p = exp(s - m')` in `row` (masked → exactly 0) and the rescale factor in `c`.
#[inline]
fn online_update(st: &mut RowState, c: &mut f32, row: &mut [f32], len: usize, bmax: f32, k0: usize, top_k: Option<usize>) {
    // top_k is None for rows whose top keys nobody asked for
    if k0 == 0 {
        st.s0 = row[0];
    }
    let m_new = st.m.max(bmax);
    if m_new == f32::NEG_INFINITY {
        // nothing visible yet in this row
        row.iter_mut().for_each(|p| *p = 0.0);
        *c = 1.0;
        return;
    }
    *c = if st.m == f32::NEG_INFINITY { 0.0 } else { (st.m - m_new).exp() };
    if bmax > st.m {
        st.argmax = (k0 + row[..len].iter().position(|&s| s == bmax).unwrap_or(0)) as u32;
    }
    if let Some(kk) = top_k {
        for (j, &s_j) in row[..len].iter().enumerate() {
            if s_j > f32::NEG_INFINITY && (st.top.len() < kk || s_j > st.top[st.top.len() - 1].0) {
                let at = st.top.iter().position(|&(ts, _)| s_j > ts).unwrap_or(st.top.len());
                st.top.insert(at, (s_j, (k0 + j) as u32));
                st.top.truncate(kk);
            }
        }
    }
    let (l, t) = exp_shift_sums(&mut row[..len], m_new);
    row[len..].iter_mut().for_each(|p| *p = 0.0);
    st.l = st.l * *c as f64 + l;
    st.t = st.t * *c as f64 + t;
    st.m = m_new;
}

/// `x ← exp(x - m)` over a slice (masked `-inf` → exactly 0), returning `(Σ exp, Σ exp · x)`.
/// Written in lanes of 8 without branches so the compiler vectorizes it.
fn exp_shift_sums(xs: &mut [f32], m: f32) -> (f64, f64) {
    const L: usize = 8;
    let (mut sl, mut st) = ([0f32; L], [0f32; L]);
    let mut chunks = xs.chunks_exact_mut(L);
    for ch in &mut chunks {
        for k in 0..L {
            let s = ch[k];
            let live = s > f32::NEG_INFINITY;
            // masked entries are computed on a finite stand-in and then selected away
            let p = fast_exp(if live { s - m } else { -100.0 });
            let p = if live { p } else { 0.0 };
            ch[k] = p;
            sl[k] += p;
            st[k] += p * if live { s } else { 0.0 };
        }
    }
    let (mut l, mut t) = (sl.iter().map(|&v| v as f64).sum::<f64>(), st.iter().map(|&v| v as f64).sum::<f64>());
    for x in chunks.into_remainder() {
        let s = *x;
        let p = if s == f32::NEG_INFINITY { 0.0 } else { fast_exp(s - m) };
        *x = p;
        l += p as f64;
        if p > 0.0 {
            t += (p * s) as f64;
        }
    }
    (l, t)
}

/// `e^x` for x ≤ 0 (the shifted scores of a softmax), as in Cephes `expf`: x = n·ln 2 + r,
/// e^r by a degree-5 polynomial, 2^n through the exponent bits. Relative error ~1e-7.
#[inline(always)]
fn fast_exp(x: f32) -> f32 {
    let x = x.max(-87.0);
    // round to nearest by the 1.5·2^23 trick (vectorizes, unlike f32::round)
    const MAGIC: f32 = 12_582_912.0;
    let n = (x * std::f32::consts::LOG2_E + MAGIC) - MAGIC;
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let r2 = r * r;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 0.166_666_65) * r + 0.5;
    let er = 1.0 + r + r2 * p;
    er * f32::from_bits(((n as i32 + 127) as u32) << 23)
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
        let mut s = AttnStats { n_heads, rows, top_k, first_key: Vec::new(), max_weight: Vec::new(), argmax: Vec::new(), entropy: Vec::new(), top: Vec::new() };
        for st in states {
            let (l, m) = (st.l, st.m as f64);
            let w = |score: f32| if score == f32::NEG_INFINITY || l <= 0.0 { 0.0 } else { ((score as f64 - m).exp() / l) as f32 };
            s.first_key.push(w(st.s0));
            s.max_weight.push(if l > 0.0 { (1.0 / l) as f32 } else { 0.0 });
            s.argmax.push(st.argmax);
            // H = -Σ p ln p with p = e^(s-m)/l: H = m + ln l - (Σ e^(s-m) s)/l
            s.entropy.push(if l > 0.0 { (m + l.ln() - st.t / l).max(0.0) as f32 } else { 0.0 });
            for i in 0..top_k {
                s.top.push(st.top.get(i).map(|&(sc, j)| (j, w(sc))).unwrap_or((u32::MAX, 0.0)));
            }
        }
        s
    }
}

impl Model {
    /// Runs the model over `tokens`, handing every hook point the observer wants to it.
    pub fn forward(&self, tokens: &[u32], opts: &RunOptions, obs: &mut dyn Observer) -> Result<ForwardOut> {
        self.forward_from(None, tokens, opts, obs)
    }

    /// Runs `tokens` as positions `P..P+m` after a reused `prefix` of `P` positions (or from 0).
    /// Positions in `opts` are absolute; logits and knockouts must lie in the new positions.
    /// Per-position hooks then cover the new positions, attention blocks carry absolute rows.
    pub fn forward_from(&self, prefix: Option<&KvPrefix>, tokens: &[u32], opts: &RunOptions, obs: &mut dyn Observer) -> Result<ForwardOut> {
        let start = Instant::now();
        let dims = &self.dims;
        let p0 = prefix.map_or(0, |p| p.len);
        let m = tokens.len();
        let n = p0 + m;
        if m == 0 {
            return Err(Error::EmptyText);
        }
        if n > dims.context_len {
            return Err(Error::TooLong { n_tokens: n, limit: dims.context_len, model: self.info.name.clone() });
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= dims.vocab_size) {
            return Err(Error::OutOfRange { what: "token id".into(), value: bad.to_string(), range: format!("0..{}", dims.vocab_size) });
        }
        for &p in opts.logits_at.iter().chain(&opts.knockout) {
            if p < p0 || p >= n {
                return Err(Error::OutOfRange { what: "position".into(), value: p.to_string(), range: format!("{p0}..={}", n - 1) });
            }
        }
        if prefix.is_some_and(|p| p.layers.len() != dims.n_layers) {
            return Err(Error::Candle(candle_core::Error::Msg("the KV prefix belongs to another model: you likely have a bug".into())));
        }
        let (nh, nkv, hd, dm) = (dims.n_heads, dims.n_kv_heads, dims.head_dim, dims.d_model);
        let mut knock = vec![false; n];
        for &p in &opts.knockout {
            knock[p] = true;
        }
        let (cos, sin) = rope_tables(hd, dims.rope_base, n)?;
        let (cos, sin) = (cos.narrow(0, p0, m)?, sin.narrow(0, p0, m)?);
        let mut x = self.weights.embed.lookup(tokens)?; // [m, d_model]
        let mut attn_time = Duration::ZERO;
        let mut kept = Vec::with_capacity(if opts.keep_kv { dims.n_layers } else { 0 });
        for (l, layer) in self.weights.layers.iter().enumerate() {
            emit(obs, l, Hook::ResidPre, &x, &[m, dm])?;
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, dims.rms_eps)?;
            let q = layer.q.forward(&h)?; // [m, n_heads * head_dim]
            let k = layer.k.forward(&h)?; // [m, n_kv_heads * head_dim]
            let v = layer.v.forward(&h)?;
            emit(obs, l, Hook::Q, &q, &[m, nh, hd])?;
            emit(obs, l, Hook::K, &k, &[m, nkv, hd])?;
            emit(obs, l, Hook::V, &v, &[m, nkv, hd])?;
            // [m, heads, d] → [1, heads, m, d] for RoPE and per-head matmuls
            let to_heads = |t: &Tensor, heads: usize| -> Result<Tensor> { Ok(t.reshape((1, m, heads, hd))?.transpose(1, 2)?.contiguous()?) };
            let q = rope(&to_heads(&q, nh)?, &cos, &sin, self.weights.rope_style)?.squeeze(0)?;
            let k = rope(&to_heads(&k, nkv)?, &cos, &sin, self.weights.rope_style)?.squeeze(0)?;
            let v = to_heads(&v, nkv)?.squeeze(0)?;
            if obs.wants(l, Hook::RotQ) {
                emit(obs, l, Hook::RotQ, &q.transpose(0, 1)?.contiguous()?, &[m, nh, hd])?;
            }
            if obs.wants(l, Hook::RotK) {
                emit(obs, l, Hook::RotK, &k.transpose(0, 1)?.contiguous()?, &[m, nkv, hd])?;
            }
            let (k, v) = match prefix {
                Some(p) => (Tensor::cat(&[&p.layers[l].0, &k], 1)?, Tensor::cat(&[&p.layers[l].1, &v], 1)?),
                None => (k, v),
            };
            let t0 = Instant::now();
            let z = attention(l, &q, &k, &v, &knock, opts.block_bytes, opts.key_block, obs)?; // [n_heads, m, d]
            attn_time += t0.elapsed();
            if opts.keep_kv {
                kept.push((k, v));
            }
            let z = z.transpose(0, 1)?.contiguous()?; // [m, n_heads, d]
            emit(obs, l, Hook::Z, &z, &[m, nh, hd])?;
            let attn_out = layer.o.forward(&z.reshape((m, nh * hd))?)?;
            emit(obs, l, Hook::AttnOut, &attn_out, &[m, dm])?;
            x = (x + attn_out)?;
            // SwiGLU MLP [Shazeer 2020, arXiv:2002.05202, eq. (5)], in blocks of positions so
            // the [positions, d_ff] intermediates stay small on long inputs
            let h = candle_nn::ops::rms_norm(&x, &layer.mlp_norm, dims.rms_eps)?;
            let mlp_rows = ((64usize << 20) / (dims.d_ff * 4 * 3)).max(16);
            let mut parts = Vec::with_capacity(m.div_ceil(mlp_rows));
            for r0 in (0..m).step_by(mlp_rows) {
                let hb = h.narrow(0, r0, mlp_rows.min(m - r0))?;
                parts.push(layer.down.forward(&(layer.gate.forward(&hb)?.silu()? * layer.up.forward(&hb)?)?)?);
            }
            let mlp = if parts.len() == 1 { parts.pop().expect("one block") } else { Tensor::cat(&parts, 0)? };
            x = (x + mlp)?;
            emit(obs, l, Hook::ResidPost, &x, &[m, dm])?;
            obs.layer_done(l);
        }
        let logits = if opts.logits_at.is_empty() {
            Vec::new()
        } else {
            let pos: Vec<u32> = opts.logits_at.iter().map(|&p| (p - p0) as u32).collect();
            let xs = x.index_select(&Tensor::new(pos.as_slice(), &Device::Cpu)?, 0)?;
            let h = candle_nn::ops::rms_norm(&xs, &self.weights.final_norm, dims.rms_eps)?;
            candle_core::Module::forward(&self.weights.lm_head, &h)?.to_dtype(DType::F32)?.to_vec2()?
        };
        let kv = opts.keep_kv.then_some(KvPrefix { len: n, layers: kept });
        Ok(ForwardOut { logits, timings: Timings { attention: attn_time, total: start.elapsed() }, kv })
    }

    /// Logits of the last position only, nothing captured.
    pub fn next_token_logits(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut out = self.forward(tokens, &RunOptions::last_logits(tokens.len()), &mut super::capture::NoCapture)?;
        Ok(out.logits.pop().expect("one row of logits was asked for"))
    }
}

/// Log-softmax of one logits row (f64 accumulation).
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = (logits.iter().map(|&x| ((x - max) as f64).exp()).sum::<f64>()).ln() as f32 + max;
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
    fn exp_shift_sums_zeroes_masked_entries() {
        let mut xs = vec![0.5, f32::NEG_INFINITY, 0.25, 1.0, f32::NEG_INFINITY, 0.0, -1.0, 2.0, 0.3, f32::NEG_INFINITY];
        let orig = xs.clone();
        let (l, t) = exp_shift_sums(&mut xs, 2.0);
        let want_l: f64 = orig.iter().filter(|x| x.is_finite()).map(|&x| ((x - 2.0) as f64).exp()).sum();
        let want_t: f64 = orig.iter().filter(|x| x.is_finite()).map(|&x| ((x - 2.0) as f64).exp() * x as f64).sum();
        assert!((l - want_l).abs() < 1e-6 && (t - want_t).abs() < 1e-6);
        assert_eq!((xs[1], xs[4], xs[9]), (0.0, 0.0, 0.0));
    }
}
