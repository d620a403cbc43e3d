//! The forward pass: embeddings → blocks → final norm → logits, on plain f32 buffers, with
//! every hook point handed to an [`Observer`]. The projections run on the packed GEMM of
//! [`crate::kernels::gemm`] (q|k|v and gate|up fused); `attention` is the crate's one fast
//! attention, explicit (`QKᵀ·scale → mask → softmax in f32 → ·V`) so the weights can be
//! captured, fused per head and query block with an online softmax, so a long sequence never
//! needs a whole `[heads, n, n]` at once. It is tested against [`crate::reference`] on tiny
//! models and against Hugging Face transformers on the real ones.

use super::attention::{all_finite, max_row_sq};
use super::block::NormKind;
use super::capture::{Hook, Observer};
use super::error::{Error, Result};
use super::ops::{layer_norm_into, norm_parts, rms_norm_into, rope_tables_of};
use super::tl_weights::{half_split_to_interleaved, interleaved_to_half_split};
use super::weights::Head;
use super::Model;
use candle_core::{DType, Device, Tensor};
use std::time::{Duration, Instant};

/// A rotary base's cos and sin tables, `[positions, rotary_dim / 2]` each.
type RopeTables = (Vec<f32>, Vec<f32>);

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
    /// An encoder's token types (segment ids), one per position of every segment, as the
    /// tokenizer gave them ([`Model::encode_pair`]: 0 for the first text of a pair, 1 for the
    /// second). `None`: every token's type is 0, as the tokenizer types a single text (a
    /// literal `[SEP]` inside it included). A decoder ignores them.
    pub token_types: Option<Vec<u32>>,
    /// The forward is one of `generate`'s steps (the prompt's, then each KV-cache step): its
    /// one-row products multiply straight from a GGUF's blocks (unless
    /// `ATTNSCOPE_DECODE=panels`: [`crate::model::weights::matvec::decode_from_blocks`]) and the
    /// attention of one query row reads the keys and values as they lie. Its numbers are then
    /// the decode path's (transformers' within the tested bounds), not the same bits as the
    /// row in a whole forward; every other forward leaves it `false`.
    pub decode_step: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            logits_at: Vec::new(),
            knockout: Vec::new(),
            block_bytes: 8 << 20,
            keep_kv: false,
            key_block: 1024,
            token_types: None,
            decode_step: false,
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

/// The segments of one forward, checked and stacked ([`Model::forward_segments`]).
struct Stack {
    /// each segment's first row among the stacked rows
    row0: Vec<usize>,
    /// the stacked rows (the segments' new positions)
    m: usize,
    /// the longest segment's positions, its reused ones included
    n_max: usize,
    /// per segment, whether each of its positions is knocked out
    knocks: Vec<Vec<bool>>,
    /// the prefix's positions (0 without one)
    full: usize,
    /// the stacked rows whose logits are asked for, in order
    logit_rows: Vec<usize>,
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

/// Whether the observer wants or edits `hook` at `layer`.
fn touches(obs: &dyn Observer, layer: usize, hook: Hook) -> bool {
    obs.wants(layer, hook) || obs.edits(layer, hook)
}

/// `hook_q`, `hook_k`, `hook_v` on the `[m, q | k | v]` rows `qkv`: each part the observer
/// touches is copied out as `[m, heads, head_dim]`, handed over and, when edited, written back.
/// With `interleaved` (llama GGUF interleaves each head's halves), Q and K are handed in Hugging
/// Face's row order and put back in the file's.
fn hand_qkv(
    obs: &mut dyn Observer,
    l: usize,
    qkv: &mut [f32],
    m: usize,
    dims: &super::config::ModelDims,
    interleaved: bool,
) -> Result<()> {
    let (nh, nkv, hd) = (dims.n_heads, dims.n_kv_heads, dims.head_dim);
    let (nq, nk) = (nh * hd, nkv * hd);
    let width = nq + 2 * nk;
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
            let reorder = interleaved && hook != Hook::V;
            hand_half_split(obs, l, hook, &[m, heads, hd], &mut part, reorder)?;
            if obs.edits(l, hook) {
                for (row, new) in qkv.chunks_mut(width).zip(part.chunks(w)) {
                    row[c0..c0 + w].copy_from_slice(new);
                }
            }
        }
    }
    Ok(())
}

/// [`hand`] of `[rows, heads, head_dim]` query or key heads in Hugging Face's row order: with
/// `reorder` (a llama GGUF interleaves each head's halves) they are handed half-split, and an
/// edit is put back in the file's order.
fn hand_half_split(
    obs: &mut dyn Observer,
    l: usize,
    hook: Hook,
    shape: &[usize; 3],
    data: &mut [f32],
    reorder: bool,
) -> Result<()> {
    let hd = shape[2];
    if reorder {
        interleaved_to_half_split(data, hd, 1);
    }
    hand(obs, l, hook, shape, data)?;
    if reorder && obs.edits(l, hook) {
        half_split_to_interleaved(data, hd, 1);
    }
    Ok(())
}

/// The RoPE tables of `layer`'s rotary base among `rope_sets` (none for a layer without RoPE).
fn layer_rope_tables<'a>(
    layer: &super::weights::Layer,
    rope_sets: &'a [(f32, RopeTables)],
) -> Option<&'a RopeTables> {
    let base = layer.plan.rope_base()?;
    rope_sets.iter().find(|(b, _)| *b == base).map(|(_, t)| t)
}

/// Which of a segment's positions (the reused ones included) are knocked out as keys.
fn knocked_out_keys(seg: &Segment) -> Vec<bool> {
    let mut knock = vec![false; seg.reuse + seg.tokens.len()];
    for &p in &seg.knockout {
        knock[p] = true;
    }
    knock
}

/// Refuses a residual stream that left layer `l`'s MLP with a NaN or an infinity.
fn check_residual_finite(x: &[f32], l: usize) -> Result<()> {
    if all_finite(x) {
        return Ok(());
    }
    Err(Error::NonFinite {
        what: "the residual stream after the layer's MLP".into(),
        layer: Some(l),
    })
}

/// A norm (`ln1`, `ln2`, `ln_final`) of the `[m, width]` rows `x` into `out`, with its two hooks
/// (TransformerLens's order): `hook_scale` `[m, 1]`, then `hook_normalized` `[m, width]` (the
/// rows over their scale, before the weight and bias). Without a hook on either, the plain norm;
/// with one that only reads, the same bits (the same operations in the same order).
#[allow(clippy::too_many_arguments)]
fn norm_hooked(
    obs: &mut dyn Observer,
    l: usize,
    (scale_hook, normalized_hook): (Hook, Hook),
    kind: NormKind,
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    eps: f32,
    out: &mut [f32],
) -> Result<()> {
    match (kind, b) {
        (NormKind::Layer, Some(_)) | (NormKind::Rms, None) => {}
        (kind, b) => {
            return Err(Error::Bug(format!(
                "a {kind:?} norm with{} a bias: you likely have a bug",
                if b.is_some() { "" } else { "out" }
            )))
        }
    }
    if !touches(obs, l, scale_hook) && !touches(obs, l, normalized_hook) {
        match b {
            Some(b) => layer_norm_into(x, w, b, eps, out),
            None => rms_norm_into(x, w, eps, out),
        }
        return Ok(());
    }
    let width = w.len();
    let m = x.len() / width;
    let (mut scale, mut normalized) = norm_parts(kind, x, width, eps);
    hand(obs, l, scale_hook, &[m, 1], &mut scale)?;
    normalized
        .chunks_mut(width)
        .zip(&scale)
        .for_each(|(row, &s)| {
            let inv = 1.0 / s;
            row.iter_mut().for_each(|v| *v *= inv);
        });
    hand(obs, l, normalized_hook, &[m, width], &mut normalized)?;
    for (dst, src) in out[..x.len()]
        .chunks_mut(width)
        .zip(normalized.chunks(width))
    {
        match b {
            Some(b) => {
                for (((d, &v), &g), &bb) in dst.iter_mut().zip(src).zip(w).zip(b) {
                    *d = v * g + bb;
                }
            }
            None => dst
                .iter_mut()
                .zip(src)
                .zip(w)
                .for_each(|((d, &v), &g)| *d = v * g),
        }
    }
    Ok(())
}

/// Where a decoder forward's reused positions come from.
pub(super) enum Prefix<'a> {
    /// none, or a prefix read as it is: its positions copied before each segment's own
    Read(Option<&'a KvPrefix>),
    /// a cache grown in place by the forward's one segment ([`Model::forward_grow`])
    Grow(&'a mut KvPrefix),
}

impl Prefix<'_> {
    /// The prefix as it is before the forward.
    fn read(&self) -> Option<&KvPrefix> {
        match self {
            Prefix::Read(p) => *p,
            Prefix::Grow(p) => Some(p),
        }
    }
}

/// Keys and values (after RoPE) of the first `len` positions of a sequence, per layer
/// (`[n_kv_heads, cap, head_dim]` each, of which each KV set's first `len` positions are the
/// prefix's; `cap == len` unless room was kept with [`KvPrefix::reserve`]). Running the rest of
/// a sequence on top of it gives the same numbers as running the whole sequence, since a causal
/// model's first positions do not depend on what comes after them.
#[derive(Clone)]
pub struct KvPrefix {
    pub len: usize,
    /// positions each KV set has room for (`≥ len`): [`Model::forward_grow`] writes a step's
    /// keys and values there in place
    cap: usize,
    n_kv: usize,
    head_dim: usize,
    layers: Vec<(Vec<f32>, Vec<f32>)>,
    /// per layer, the keys' largest squared norm ([`max_row_sq`]): the key side of the
    /// attention's score bound, so a step on top of the prefix reads only its new keys for it
    k_sq: Vec<f64>,
}

impl KvPrefix {
    /// Layer `l`'s value vectors, `[n_kv_heads, len, head_dim]` (copied together where room was
    /// kept after each set).
    pub fn values(&self, l: usize) -> std::borrow::Cow<'_, [f32]> {
        let v = &self.layers[l].1;
        if self.cap == self.len {
            std::borrow::Cow::Borrowed(&v[..])
        } else {
            std::borrow::Cow::Owned(self.sets_of(v, self.len))
        }
    }

    /// The first `len` positions of each KV set of `x` (a layer's keys or values), `[n_kv,
    /// len, head_dim]`.
    fn sets_of(&self, x: &[f32], len: usize) -> Vec<f32> {
        let (hd, cap) = (self.head_dim, self.cap);
        let mut out = Vec::with_capacity(self.n_kv * len * hd);
        for g in 0..self.n_kv {
            out.extend_from_slice(&x[g * cap * hd..(g * cap + len) * hd]);
        }
        out
    }

    /// Keeps room for `extra` more positions in every layer's KV sets, so the next forwards
    /// of [`Model::forward_grow`] write their keys and values in place (one copy of the cache
    /// now instead of one per step; the numbers are the same).
    pub fn reserve(&mut self, extra: usize) {
        let want = self.len + extra;
        if want <= self.cap {
            return;
        }
        let (hd, cap, len) = (self.head_dim, self.cap, self.len);
        let grow = |x: &Vec<f32>| -> Vec<f32> {
            let mut out = vec![0f32; self.n_kv * want * hd];
            for g in 0..self.n_kv {
                out[g * want * hd..(g * want + len) * hd]
                    .copy_from_slice(&x[g * cap * hd..(g * cap + len) * hd]);
            }
            out
        };
        let layers = self
            .layers
            .iter()
            .map(|(k, v)| (grow(k), grow(v)))
            .collect();
        self.layers = layers;
        self.cap = want;
    }

    /// Writes layer `l`'s keys and values of positions `len..len + ms` (`kh`, `vh`:
    /// `[n_kv, ms, head_dim]`) into the room kept after each set, and returns the layer's
    /// keys' bound with them ([`max_row_sq`]). `len` itself moves on once every layer has
    /// written ([`Model::forward_grow`]).
    pub(super) fn write_layer(&mut self, l: usize, kh: &[f32], vh: &[f32], ms: usize) -> f64 {
        let (hd, cap, len) = (self.head_dim, self.cap, self.len);
        debug_assert!(len + ms <= cap && kh.len() == self.n_kv * ms * hd);
        let (k, v) = &mut self.layers[l];
        for g in 0..self.n_kv {
            let at = (g * cap + len) * hd;
            k[at..at + ms * hd].copy_from_slice(&kh[g * ms * hd..(g + 1) * ms * hd]);
            v[at..at + ms * hd].copy_from_slice(&vh[g * ms * hd..(g + 1) * ms * hd]);
        }
        self.k_sq[l] = self.k_sq[l].max(max_row_sq(kh, hd));
        self.k_sq[l]
    }

    /// Layer `l`'s keys and values as they lie (`[n_kv, cap, head_dim]` each) and `cap`, the
    /// positions between one KV set and the next.
    pub(super) fn layer(&self, l: usize) -> (&[f32], &[f32], usize) {
        let (k, v) = &self.layers[l];
        (k, v, self.cap)
    }

    /// The first `len` positions of this prefix.
    pub fn truncate(&self, len: usize) -> Result<KvPrefix> {
        let len = len.min(self.len);
        let (nkv, hd) = (self.n_kv, self.head_dim);
        let layers: Vec<_> = (self.layers.iter())
            .map(|(k, v)| (self.sets_of(k, len), self.sets_of(v, len)))
            .collect();
        let k_sq = layers.iter().map(|(k, _)| max_row_sq(k, hd)).collect();
        Ok(KvPrefix {
            len,
            cap: len,
            n_kv: nkv,
            head_dim: hd,
            layers,
            k_sq,
        })
    }
}

impl RunOptions {
    /// Options that compute the logits of the last of `n` positions only.
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

/// What a forward returns besides what its observer saw: the logits asked for, the timings and,
/// when asked, the keys and values.
pub struct ForwardOut {
    /// One row of `vocab_size` logits per entry of `RunOptions::logits_at`.
    pub logits: Vec<Vec<f32>>,
    /// how long the parts of the forward took
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

impl Model {
    /// A segment of `n` positions (the reused prefix included) holding `tokens`: refused when it
    /// passes the context or holds a token id past the vocabulary.
    pub(crate) fn check_tokens(&self, n: usize, tokens: &[u32]) -> Result<()> {
        let dims = &self.dims;
        if n > dims.context_len {
            return Err(Error::TooLong {
                n_tokens: n,
                limit: dims.context_len,
                model: self.info.name.clone(),
            });
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= dims.vocab_size) {
            return Err(Error::OutOfRange {
                what: "token id".into(),
                value: bad.to_string(),
                range: format!("0..{}", dims.vocab_size),
            });
        }
        Ok(())
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
    ///
    /// The loop reads as a block's steps (`forward/layer.rs`): `hook_resid_pre`, `ln1` and
    /// q|k|v (`Model::qkv_step`), the attention per segment (`Model::attention_step`),
    /// `hook_z`, the output projection (`Model::attn_out_step`), `hook_resid_mid`, the MLP
    /// (`Model::mlp_step`), `hook_resid_post`; then the final norm and the logits
    /// (`Model::final_logits`).
    pub fn forward_segments(
        &self,
        prefix: Option<&KvPrefix>,
        segs: &[Segment],
        resume: Option<Resume>,
        opts: &RunOptions,
        obs: &mut dyn Observer,
    ) -> Result<ForwardOut> {
        if self.dims.arch.is_encoder() {
            return self.forward_encoder(prefix.is_some(), segs, resume, opts, obs);
        }
        self.forward_decoder(Prefix::Read(prefix), segs, resume, opts, obs)
    }

    /// Runs `tokens` as the positions after the whole cache `kv` and writes their keys and
    /// values into it, in the room [`KvPrefix::reserve`] kept (made here if there is none): a
    /// decode step of `generate` then reads and writes only its own position's keys and values
    /// instead of copying the whole cache (at ~600 cached positions the copy was 12% of a step
    /// of SmolLM2). The numbers are [`Model::forward_from`]'s on `kv`, bit for bit; the
    /// returned [`ForwardOut::kv`] is `None` (`kv` itself has grown, `kv.len` moved on).
    /// On an error `kv` keeps its length (the rows past it are unused room).
    pub fn forward_grow(
        &self,
        kv: &mut KvPrefix,
        tokens: &[u32],
        opts: &RunOptions,
        obs: &mut dyn Observer,
    ) -> Result<ForwardOut> {
        if self.dims.arch.is_encoder() {
            return Err(Error::Bug(
                "an encoder has no KV cache to grow: you likely have a bug".into(),
            ));
        }
        self.check_prefix_fits(Some(kv))?;
        if kv.len + tokens.len() > kv.cap {
            // room for as many again (amortized: a step of one token then rarely copies)
            kv.reserve(tokens.len().max(kv.len / 2));
        }
        let seg = Segment {
            tokens,
            reuse: kv.len,
            knockout: opts.knockout.clone(),
            logits_at: opts.logits_at.clone(),
        };
        let opts = RunOptions {
            keep_kv: false,
            ..opts.clone()
        };
        self.forward_decoder(
            Prefix::Grow(kv),
            std::slice::from_ref(&seg),
            None,
            &opts,
            obs,
        )
    }

    /// [`Model::forward_segments`] of a decoder, on a prefix read or grown in place.
    fn forward_decoder(
        &self,
        mut prefix: Prefix,
        segs: &[Segment],
        resume: Option<Resume>,
        opts: &RunOptions,
        obs: &mut dyn Observer,
    ) -> Result<ForwardOut> {
        let start = Instant::now();
        let dims = &self.dims;
        let (nh, hd, dm) = (dims.n_heads, dims.head_dim, dims.d_model);
        let first_layer = resume.as_ref().map_or(0, |r| r.layer);
        let mut stack = self.stack_segments(prefix.read(), segs, first_layer, opts)?;
        if let Prefix::Grow(kv) = &prefix {
            // the one segment, on the whole cache, every layer run, with room for it
            let whole = segs.len() == 1 && segs[0].reuse == kv.len && first_layer == 0;
            if !whole || stack.n_max > kv.cap {
                return Err(Error::Bug(format!(
                    "a cache of {} positions (room for {}) grown by {} segments from layer {first_layer}: you likely have a bug",
                    kv.len,
                    kv.cap,
                    segs.len()
                )));
            }
        }
        let m = stack.m;
        let rope_sets = self.rope_sets(stack.n_max);
        let mut x: Vec<f32> = match resume {
            Some(r) => self.check_resume(r, m)?,
            None => self.embed_rows(segs, &stack.row0, obs)?,
        };
        let mut timings = Timings::default();
        let mut kept = KeptKv::default();
        let mut s = Scratch::new(self, m);
        // a decode step's one-row products from the file's blocks
        s.from_blocks = opts.decode_step && super::weights::matvec::decode_from_blocks();
        let no_tables = (Vec::new(), Vec::new());
        let mut stopped = false;
        // layers whose keys and values a growing cache has been given
        let mut written = 0;
        for (l, layer) in self.weights.layers.iter().enumerate().skip(first_layer) {
            hand(obs, l, Hook::ResidPre, &[m, dm], &mut x)?;
            if obs.stops_before(l) {
                // TransformerLens's stop_at_layer: block l and what follows do not run
                stopped = true;
                break;
            }
            self.qkv_step(obs, l, layer, &x, m, &mut s, &mut timings)?;
            let tables = layer_rope_tables(layer, &rope_sets).unwrap_or(&no_tables);
            let t = Instant::now();
            let stacked = (segs, &stack);
            self.attention_step(
                obs,
                l,
                layer,
                stacked,
                &mut prefix,
                opts,
                tables,
                &mut s,
                &mut kept,
            )?;
            written += 1;
            timings.attention += t.elapsed();
            hand(obs, l, Hook::Z, &[m, nh, hd], &mut s.z)?;
            obs.attention_done(l);
            let m = if only_logits_follow(self, obs, l) {
                narrow_to_logit_rows(&mut x, &mut s.z, &mut stack.logit_rows, dm, nh * hd)
            } else {
                m
            };
            if m == 0 {
                obs.layer_done(l);
                break;
            }
            let from_blocks = s.from_blocks;
            self.attn_out_step(obs, l, layer, &mut x, (&s.z, from_blocks), m, &mut timings)?;
            hand(obs, l, Hook::ResidMid, &[m, dm], &mut x)?;
            self.mlp_step(obs, l, layer, &mut x, m, &mut s, &mut timings)?;
            check_residual_finite(&x, l)?;
            hand(obs, l, Hook::ResidPost, &[m, dm], &mut x)?;
            obs.layer_done(l);
            if interrupted() {
                return Err(Error::Interrupted);
            }
        }
        let from_blocks = s.from_blocks;
        s.release();
        // stopped before a block, or before the final norm: no logits
        let stopped = stopped || obs.stops_before(dims.n_layers);
        let logits = self.final_logits(obs, &x, &stack.logit_rows, (stopped, from_blocks))?;
        if let Prefix::Grow(kv) = prefix {
            // the cache's length moves on only when every layer wrote its new positions
            if written != dims.n_layers {
                return Err(Error::Bug(format!(
                    "a growing cache's forward stopped after {written} of {} layers: you likely have a bug",
                    dims.n_layers
                )));
            }
            kv.len = stack.n_max;
        }
        let kv = opts.keep_kv.then(|| self.kv_prefix_of(kept, stack.n_max));
        timings.total = start.elapsed();
        Ok(ForwardOut {
            logits,
            timings,
            kv,
        })
    }

    /// The segments of one forward checked (against the model, the prefix and `opts`) and
    /// stacked: each one's first row, the rows in all, the longest, the knocked-out keys and
    /// the rows whose logits are asked for.
    fn stack_segments(
        &self,
        prefix: Option<&KvPrefix>,
        segs: &[Segment],
        first_layer: usize,
        opts: &RunOptions,
    ) -> Result<Stack> {
        self.check_prefix_fits(prefix)?;
        let full = prefix.map_or(0, |p| p.len);
        if segs.is_empty() || (opts.keep_kv && (segs.len() > 1 || first_layer > 0)) {
            return Err(Error::Bug(format!(
                "a forward of {} segments (keep_kv {}, from layer {first_layer}): you likely have a bug",
                segs.len(),
                opts.keep_kv
            )));
        }
        // each segment's first row in the stacked rows
        let mut row0 = Vec::with_capacity(segs.len());
        let mut m = 0;
        for seg in segs {
            self.check_segment(seg, full)?;
            row0.push(m);
            m += seg.tokens.len();
        }
        let n_max = segs
            .iter()
            .map(|s| s.reuse + s.tokens.len())
            .max()
            .unwrap_or(0);
        let knocks = segs.iter().map(knocked_out_keys).collect();
        // the stacked rows whose logits are asked for, in order
        let logit_rows: Vec<usize> = segs
            .iter()
            .zip(&row0)
            .flat_map(|(seg, &r0)| seg.logits_at.iter().map(move |&p| r0 + p - seg.reuse))
            .collect();
        Ok(Stack {
            row0,
            m,
            n_max,
            knocks,
            full,
            logit_rows,
        })
    }

    /// Refuses a KV prefix whose layers, KV heads or head width are not this model's.
    fn check_prefix_fits(&self, prefix: Option<&KvPrefix>) -> Result<()> {
        let dims = &self.dims;
        if prefix.is_some_and(|p| {
            p.layers.len() != dims.n_layers
                || p.n_kv != dims.n_kv_heads
                || p.head_dim != dims.head_dim
        }) {
            return Err(Error::Bug(
                "the KV prefix belongs to another model: you likely have a bug".into(),
            ));
        }
        Ok(())
    }

    /// Checks one segment against the model and a prefix of `full` positions: some tokens,
    /// no more reused positions than the prefix has, tokens that fit the vocabulary and the
    /// context, and logits and knockouts among its own new positions.
    fn check_segment(&self, seg: &Segment, full: usize) -> Result<()> {
        let (p0, ms) = (seg.reuse, seg.tokens.len());
        let n = p0 + ms;
        if ms == 0 {
            return Err(Error::EmptyText);
        }
        if p0 > full {
            return Err(Error::Bug(format!(
                "a segment reuses {p0} positions of a {full}-position prefix: you likely have a bug"
            )));
        }
        self.check_tokens(n, seg.tokens)?;
        for &p in seg.logits_at.iter().chain(&seg.knockout) {
            if p < p0 || p >= n {
                return Err(Error::OutOfRange {
                    what: "position".into(),
                    value: p.to_string(),
                    range: format!("{p0}..={}", n - 1),
                });
            }
        }
        Ok(())
    }

    /// The KV cache a forward leaves for the next one: the `kept` keys and values of its
    /// `len` positions.
    fn kv_prefix_of(&self, kept: KeptKv, len: usize) -> KvPrefix {
        KvPrefix {
            len,
            cap: len,
            n_kv: self.dims.n_kv_heads,
            head_dim: self.dims.head_dim,
            layers: kept.layers,
            k_sq: kept.k_sq,
        }
    }

    /// One pair of RoPE tables (`n` positions) per rotary base the layers' plans use (Gemma 3's
    /// sliding layers have their own), with llama.cpp's per-frequency divisors where the file
    /// has them: `theta_i = pos · base^(-2i/d) / freq_factors[i]`.
    fn rope_sets(&self, n: usize) -> Vec<(f32, RopeTables)> {
        let tables = |base: f32| self.rope_tables_of_base(base, n);
        let mut rope_sets: Vec<(f32, RopeTables)> = Vec::new();
        for base in self
            .weights
            .layers
            .iter()
            .filter_map(|l| l.plan.rope_base())
        {
            if !rope_sets.iter().any(|(b, _)| *b == base) {
                rope_sets.push((base, tables(base)));
            }
        }
        rope_sets
    }

    /// The RoPE tables of rotary base `base` for positions `0..n`, with the model's scaling and
    /// llama.cpp's per-frequency divisors where the file has them.
    fn rope_tables_of_base(&self, base: f32, n: usize) -> RopeTables {
        let dims = &self.dims;
        let mut inv = dims.rope_scaling.inv_freq(dims.rotary_dim, base);
        if let Some(f) = &self.weights.rope_freqs {
            inv.iter_mut().zip(f).for_each(|(x, f)| *x /= f);
        }
        rope_tables_of(&inv, n)
    }

    /// Layer `layer`'s RoPE tables for positions `0..n`, as the forward rotates by them:
    /// `(cos, sin)`, `[n, rotary_dim / 2]` each; the first `rotary_dim` values of a head vector
    /// rotate, pairs `(i, i + rotary_dim/2)` in Hugging Face's row order. `None` for a layer
    /// without rotary positions (GPT-2's learned ones) or out of range.
    pub fn rope_tables(&self, layer: usize, n: usize) -> Option<(Vec<f32>, Vec<f32>)> {
        let base = self.weights.layers.get(layer)?.plan.rope_base()?;
        Some(self.rope_tables_of_base(base, n))
    }

    /// The residual a resumed forward starts from, checked against the model and the `m`
    /// stacked rows.
    fn check_resume(&self, r: Resume, m: usize) -> Result<Vec<f32>> {
        let (n_layers, dm) = (self.dims.n_layers, self.dims.d_model);
        if r.layer >= n_layers || r.resid.len() != m * dm {
            return Err(Error::Bug(format!(
                "resuming at layer {} of {n_layers} with {} residual values for {m} rows of {dm}: you likely have a bug",
                r.layer,
                r.resid.len()
            )));
        }
        Ok(r.resid)
    }

    /// `hook_resid_pre` of layer 0 for the stacked segments: token embeddings times Gemma's
    /// √d_model (`hook_embed`), plus GPT-2's learned positions (`hook_pos_embed`). `[m, d_model]`.
    fn embed_rows(
        &self,
        segs: &[Segment],
        row0: &[usize],
        obs: &mut dyn Observer,
    ) -> Result<Vec<f32>> {
        let dims = &self.dims;
        let dm = dims.d_model;
        let all_tokens: Vec<u32> = segs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let m = all_tokens.len();
        let mut x: Vec<f32> = self
            .weights
            .embed
            .lookup(&all_tokens)?
            .flatten_all()?
            .to_vec1()?; // [m, d_model]
        if let Some(g) = &dims.gemma {
            // Gemma scales the embeddings by √d_model
            x.iter_mut().for_each(|v| *v *= g.embed_scale);
        }
        if self.centres_writers() {
            // TransformerLens's center_writing_weights: W_E centred over d_model
            crate::model::processing::centre_rows(&mut x, dm);
        }
        hand(obs, 0, Hook::Embed, &[m, dm], &mut x)?;
        if let Some(pe) = &self.weights.pos_embed {
            // GPT-2: learned absolute positions
            let mut pos = vec![0f32; m * dm];
            for (seg, &r0) in segs.iter().zip(row0) {
                let rows = &mut pos[r0 * dm..(r0 + seg.tokens.len()) * dm];
                for (r, row) in rows.chunks_mut(dm).enumerate() {
                    let p = seg.reuse + r;
                    row.copy_from_slice(&pe[p * dm..(p + 1) * dm]);
                }
            }
            if self.centres_writers() {
                crate::model::processing::centre_rows(&mut pos, dm);
            }
            hand(obs, 0, Hook::PosEmbed, &[m, dm], &mut pos)?;
            x.iter_mut().zip(&pos).for_each(|(v, e)| *v += e);
        }
        Ok(x)
    }

    /// Each head's part of layer `layer`'s attention output before W_O's bias (TransformerLens's
    /// `hook_result`) from `z` (`[rows, n_heads, head_dim]`): `[rows, n_heads, d_model]`, and the
    /// bias (`[d_model]`, zeros without one). Their sum over heads plus the bias is the output
    /// projection of `z` (up to the order of the additions). One product per head with its own
    /// columns of W_O (a whole projection's work in all, where the weights are held in column
    /// slices; else each head's zero-padded `z` through the whole projection): asked for only.
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
            let cols = h * hd..(h + 1) * hd;
            // this head's z alone, [rows, head_dim]: the product with its columns of W_O
            let own: Vec<f32> = z
                .chunks(width)
                .take(rows)
                .flat_map(|r| r[cols.clone()].iter().copied())
                .collect();
            let y = match self.head_output_projection(layer, h, &own, rows) {
                Some(y) => y,
                None => {
                    // a packing without column slices: the other heads as zeros, bias taken off
                    zh.fill(0.0);
                    for r in 0..rows {
                        zh[r * width + h * hd..][..hd].copy_from_slice(&own[r * hd..][..hd]);
                    }
                    let mut y = o.forward(&zh, rows)?;
                    for row in y.chunks_mut(dm) {
                        row.iter_mut().zip(&bias).for_each(|(y, &b)| *y -= b);
                    }
                    y
                }
            };
            for r in 0..rows {
                out[(r * nh + h) * dm..][..dm].copy_from_slice(&y[r * dm..(r + 1) * dm]);
            }
        }
        let mut bias = bias;
        if self.centres_writers() {
            // center_writing_weights: each head's slice of W_O and b_O centred over d_model
            crate::model::processing::centre_rows(&mut out, dm);
            crate::model::processing::centre_rows(&mut bias, dm);
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

/// Installs the check of `INTERRUPT_CHECK` (once per process; later calls are ignored).
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

mod embed;
mod encoder;
mod layer;
pub use embed::{l2_normalize, EmbedInput};
use layer::{narrow_to_logit_rows, only_logits_follow, KeptKv, Scratch};
#[cfg(test)]
mod tests;
