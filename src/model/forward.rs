//! The forward pass: embeddings → blocks → final norm → logits, on plain f32 buffers, with
//! every hook point handed to an [`Observer`]. The projections run on the packed GEMM of
//! [`crate::kernels::gemm`] (q|k|v and gate|up fused); [`attention`] is the crate's one fast
//! attention, explicit (`QKᵀ·scale → mask → softmax in f32 → ·V`) so the weights can be
//! captured, fused per head and query block with an online softmax, so a long sequence never
//! needs a whole `[heads, n, n]` at once. It is tested against [`crate::reference`] on tiny
//! models and against Hugging Face transformers on the real ones.

// the kernel and the row-wise operations live in their own modules; their public items are
// reachable here too, where they were before the split
pub use super::attention::*;
use super::block::{MlpKind, NormKind};
use super::capture::{Hook, Observer};
use super::config::RopeStyle;
use super::error::{Error, Result};
pub use super::ops::*;
use super::tl_weights::{half_split_to_interleaved, interleaved_to_half_split};
use super::weights::Head;
use super::Model;
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;
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

/// Whether the observer wants or edits `hook` at `layer`.
fn touches(obs: &dyn Observer, layer: usize, hook: Hook) -> bool {
    obs.wants(layer, hook) || obs.edits(layer, hook)
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
            return Err(Error::Candle(candle_core::Error::Msg(format!(
                "a {kind:?} norm with{} a bias: you likely have a bug",
                if b.is_some() { "" } else { "out" }
            ))))
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
    /// per layer, the keys' largest squared norm ([`max_row_sq`]): the key side of the
    /// attention's score bound, so a step on top of the prefix reads only its new keys for it
    k_sq: Vec<f64>,
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
        let layers: Vec<_> = self.layers.iter().map(|(k, v)| (cut(k), cut(v))).collect();
        let k_sq = layers.iter().map(|(k, _)| max_row_sq(k, hd)).collect();
        Ok(KvPrefix {
            len,
            n_kv: nkv,
            head_dim: hd,
            layers,
            k_sq,
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
        // one pair of tables per rotary base the plans use (Gemma 3's sliding layers have their own)
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
            None => self.embed_rows(segs, &row0, obs)?,
        };
        let (mut attn_time, mut proj_time) = (Duration::ZERO, Duration::ZERO);
        let mut kept = Vec::with_capacity(if opts.keep_kv { dims.n_layers } else { 0 });
        let mut kept_sq = Vec::with_capacity(kept.capacity());
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
        let mut stopped = false;
        for (l, layer) in self.weights.layers.iter().enumerate().skip(first_layer) {
            let plan = layer.plan;
            let no_tables = (Vec::new(), Vec::new());
            let (cos, sin) = plan
                .rope_base()
                .and_then(|base| rope_sets.iter().find(|(b, _)| *b == base))
                .map_or(&no_tables, |(_, t)| t);
            hand(obs, l, Hook::ResidPre, &[m, dm], &mut x)?;
            if obs.stops_before(l) {
                // TransformerLens's stop_at_layer: block l and what follows do not run
                stopped = true;
                break;
            }
            let bias = layer.norm_biases.as_ref().map(|b| b.0.as_slice());
            let ln1 = (Hook::Ln1Scale, Hook::Ln1Normalized);
            norm_hooked(
                obs,
                l,
                ln1,
                plan.norm,
                &x,
                &layer.attn_norm,
                bias,
                dims.rms_eps,
                &mut normed,
            )?;
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
                    // Q and K in Hugging Face's row order whatever the file's (llama GGUF
                    // interleaves each head's halves)
                    let reorder = style == RopeStyle::Interleaved && hook != Hook::V;
                    if reorder {
                        interleaved_to_half_split(&mut part, hd, 1);
                    }
                    hand(obs, l, hook, &[m, heads, hd], &mut part)?;
                    if obs.edits(l, hook) {
                        if reorder {
                            half_split_to_interleaved(&mut part, hd, 1);
                        }
                        for (row, new) in qkv.chunks_mut(width).zip(part.chunks(w)) {
                            row[c0..c0 + w].copy_from_slice(new);
                        }
                    }
                }
            }
            let t0 = Instant::now();
            for (si, (seg, &r0)) in segs.iter().zip(&row0).enumerate() {
                obs.segment(si);
                let (p0, ms) = (seg.reuse, seg.tokens.len());
                let n = p0 + ms;
                let rows = &qkv[r0 * width..(r0 + ms) * width];
                // the tables of this segment's positions, exactly (split_heads reads their width
                // from their length); a block with learned positions (GPT-2) has no rotation
                let rope = plan
                    .rope_base()
                    .map(|_| (&cos[p0 * half..n * half], &sin[p0 * half..n * half], style));
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
                        let reorder = style == RopeStyle::Interleaved;
                        if reorder {
                            interleaved_to_half_split(&mut merged, hd, 1);
                        }
                        hand(obs, l, hook, &[ms, heads, hd], &mut merged)?;
                        if obs.edits(l, hook) {
                            if reorder {
                                half_split_to_interleaved(&mut merged, hd, 1);
                            }
                            // back to [heads, ms, hd]
                            for (r, row) in merged.chunks(heads * hd).enumerate() {
                                for (h, v) in row.chunks(hd).enumerate() {
                                    buf[(h * ms + r) * hd..][..hd].copy_from_slice(v);
                                }
                            }
                        }
                    }
                }
                // the keys' bound: a whole prefix's is kept with it, so only the new keys are
                // read for it; a prefix's part, or keys to keep, get theirs here
                let k_sq = match prefix {
                    Some(p) if p0 > 0 && p0 == full => Some(p.k_sq[l].max(max_row_sq(&kh, hd))),
                    _ => None,
                };
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
                let k_sq = k_sq.or_else(|| opts.keep_kv.then(|| max_row_sq(&kf, hd)));
                let adims = AttnDims {
                    n_heads: nh,
                    n_kv_heads: nkv,
                    head_dim: hd,
                    q_len: ms,
                    k_len: n,
                    window: plan.window,
                    scale: plan.score_scale,
                    softcap: plan.softcap,
                    causal: plan.causal,
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
                    attention_bounded(
                        l,
                        qh,
                        &kf,
                        &vf,
                        adims,
                        &knocks[si],
                        (opts.block_bytes, opts.key_block),
                        k_sq,
                        obs,
                        zs,
                    )?; // [ms, nh, hd]
                }
                if let (true, Some(b)) = (opts.keep_kv, k_sq) {
                    kept.push((kf, vf));
                    kept_sq.push(b);
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
                && ![
                    Hook::Result,
                    Hook::AttnOut,
                    Hook::ResidMid,
                    Hook::MlpPre,
                    Hook::MlpPost,
                    Hook::Ln2Scale,
                    Hook::Ln2Normalized,
                    Hook::MlpPreLinear,
                    Hook::MlpOut,
                    Hook::ResidPost,
                    Hook::LnFinalScale,
                    Hook::LnFinalNormalized,
                ]
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
            // attn.hook_result (each head's z through its slice of W_O, [m, heads, d_model]) is
            // computed only when asked: one product per head. Read, it changes nothing (the
            // output projection runs as always); edited, the output is the sum of the edited
            // results plus W_O's bias
            let mut results = None;
            if touches(obs, l, Hook::Result) {
                let (mut res, bias) = self.head_results(l, &z, m)?;
                hand(obs, l, Hook::Result, &[m, nh, dm], &mut res)?;
                if obs.edits(l, Hook::Result) {
                    let mut out = vec![0f32; m * dm];
                    for (o, r) in out.chunks_mut(dm).zip(res.chunks(nh * dm)) {
                        o.copy_from_slice(&bias);
                        for head in r.chunks(dm) {
                            o.iter_mut().zip(head).for_each(|(o, v)| *o += v);
                        }
                    }
                    results = Some(out);
                }
            }
            if let Some(out) = results.as_mut().filter(|_| layer.post_norms.is_none()) {
                proj_time += t.elapsed();
                hand(obs, l, Hook::AttnOut, &[m, dm], out)?;
                x.iter_mut().zip(out.iter()).for_each(|(x, a)| *x += a);
            } else if results.is_some()
                || layer.post_norms.is_some()
                || obs.edits(l, Hook::AttnOut)
                || layer.o.has_bias()
            {
                let mut attn_out = match results {
                    Some(r) => r,
                    None => layer.o.forward(&z, m)?,
                };
                if let Some((post_attn, _)) = &layer.post_norms {
                    // Gemma: the attention's output is normalized before the residual add
                    attn_out = rms_norm(&attn_out, post_attn, dims.rms_eps);
                }
                proj_time += t.elapsed();
                hand(obs, l, Hook::AttnOut, &[m, dm], &mut attn_out)?;
                x.iter_mut().zip(&attn_out).for_each(|(x, a)| *x += a);
            } else {
                if obs.wants(l, Hook::AttnOut) {
                    // read only: the output on its own for the hook, while the residual gets the
                    // product accumulated into it as always, so reading changes no bit
                    let mut attn_out = layer.o.forward(&z, m)?;
                    hand(obs, l, Hook::AttnOut, &[m, dm], &mut attn_out)?;
                }
                layer.o.forward_into(&z, m, &mut x, true)?; // x += z · W_oᵀ
                proj_time += t.elapsed();
            }
            hand(obs, l, Hook::ResidMid, &[m, dm], &mut x)?;
            // hook_mlp_out needs the MLP's output on its own, not added into x as it is computed
            // (edited; one that only reads gets its own copy while x accumulates as always, so
            // reading changes no bit)
            let mut mlp_out = obs.edits(l, Hook::MlpOut).then(|| vec![0f32; m * dm]);
            let mut mlp_read =
                (mlp_out.is_none() && obs.wants(l, Hook::MlpOut)).then(|| vec![0f32; m * dm]);
            // SwiGLU MLP [Shazeer 2020, arXiv:2002.05202, eq. (5)], x += down(silu(gate) · up)
            let bias = layer.norm_biases.as_ref().map(|b| b.1.as_slice());
            let ln2 = (Hook::Ln2Scale, Hook::Ln2Normalized);
            norm_hooked(
                obs,
                l,
                ln2,
                plan.norm,
                &x,
                &layer.mlp_norm,
                bias,
                dims.rms_eps,
                &mut normed,
            )?;
            let h = &normed;
            let gated = plan.mlp.gated();
            // mlp.hook_pre / hook_post are whole [m, d_mlp] tensors: the MLP then runs in one block
            let whole = [Hook::MlpPre, Hook::MlpPreLinear, Hook::MlpPost]
                .iter()
                .any(|&h| touches(obs, l, h));
            let mut own =
                (whole && m > mlp_rows).then(|| (vec![0f32; m * 2 * ff], vec![0f32; m * ff]));
            let (gu, act) = match own.as_mut() {
                Some((g, a)) => (g, a),
                None => (&mut gu, &mut act),
            };
            let block = if whole { m } else { mlp_rows };
            let gw = if gated { 2 * ff } else { ff };
            for r0 in (0..m).step_by(block) {
                let rows = block.min(m - r0);
                let t = Instant::now();
                layer
                    .gate_up
                    .forward_into(&h[r0 * dm..(r0 + rows) * dm], rows, gu, false)?;
                proj_time += t.elapsed();
                if touches(obs, l, Hook::MlpPre) {
                    // the gate's pre-activation (GPT-2: c_fc's output), [m, d_mlp]
                    let mut pre: Vec<f32> = gu[..rows * gw]
                        .chunks(gw)
                        .flat_map(|r| r[..ff].iter().copied())
                        .collect();
                    hand(obs, l, Hook::MlpPre, &[rows, ff], &mut pre)?;
                    for (row, new) in gu[..rows * gw].chunks_mut(gw).zip(pre.chunks(ff)) {
                        row[..ff].copy_from_slice(new);
                    }
                }
                if gated && touches(obs, l, Hook::MlpPreLinear) {
                    // a gated MLP's up projection, [m, d_mlp]
                    let mut lin: Vec<f32> = gu[..rows * gw]
                        .chunks(gw)
                        .flat_map(|r| r[ff..].iter().copied())
                        .collect();
                    hand(obs, l, Hook::MlpPreLinear, &[rows, ff], &mut lin)?;
                    for (row, new) in gu[..rows * gw].chunks_mut(gw).zip(lin.chunks(ff)) {
                        row[ff..].copy_from_slice(new);
                    }
                }
                match plan.mlp {
                    // GPT-2: gelu_new(c_fc(h)), no gate
                    MlpKind::GeluTanh => gelu_tanh(&gu[..rows * ff], &mut act[..rows * ff]),
                    MlpKind::GeluErf => gelu_erf(&gu[..rows * ff], &mut act[..rows * ff]),
                    MlpKind::GeGluTanh => {
                        geglu_tanh(&gu[..rows * 2 * ff], ff, &mut act[..rows * ff])
                    }
                    MlpKind::SwiGlu => swiglu(&gu[..rows * 2 * ff], ff, &mut act[..rows * ff]),
                }
                hand(obs, l, Hook::MlpPost, &[rows, ff], &mut act[..rows * ff])?;
                let t = Instant::now();
                if layer.down.has_bias() || layer.post_norms.is_some() || mlp_out.is_some() {
                    let mut out = layer.down.forward(&act[..rows * ff], rows)?;
                    if let Some((_, post_mlp)) = &layer.post_norms {
                        // Gemma: the MLP's output is normalized before the residual add
                        out = rms_norm(&out, post_mlp, dims.rms_eps);
                    }
                    if let Some(o) = mlp_read.as_mut() {
                        o[r0 * dm..(r0 + rows) * dm].copy_from_slice(&out);
                    }
                    let dest = match mlp_out.as_mut() {
                        Some(o) => &mut o[r0 * dm..(r0 + rows) * dm],
                        None => &mut x[r0 * dm..(r0 + rows) * dm],
                    };
                    dest.iter_mut().zip(&out).for_each(|(x, a)| *x += a);
                } else {
                    if let Some(o) = mlp_read.as_mut() {
                        let out = layer.down.forward(&act[..rows * ff], rows)?;
                        o[r0 * dm..(r0 + rows) * dm].copy_from_slice(&out);
                    }
                    layer.down.forward_into(
                        &act[..rows * ff],
                        rows,
                        &mut x[r0 * dm..(r0 + rows) * dm],
                        true,
                    )?;
                }
                proj_time += t.elapsed();
            }
            if let Some(mut out) = mlp_read {
                hand(obs, l, Hook::MlpOut, &[m, dm], &mut out)?;
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
        let stopped = stopped || obs.stops_before(dims.n_layers);
        if stopped {
            // stopped before a block, or before the final norm: no logits
            logit_rows.clear();
        }
        let n_logits = logit_rows.len();
        let last = dims.n_layers - 1;
        let final_bias = self.weights.final_norm_bias.as_deref();
        let final_kind = if final_bias.is_some() {
            NormKind::Layer
        } else {
            NormKind::Rms
        };
        // ln_final's hooks see every position (the last layer then kept them all)
        let final_all = (!stopped
            && (touches(obs, last, Hook::LnFinalScale)
                || touches(obs, last, Hook::LnFinalNormalized)))
        .then(|| -> Result<Vec<f32>> {
            let mut h = vec![0f32; x.len()];
            let hooks = (Hook::LnFinalScale, Hook::LnFinalNormalized);
            let w = &self.weights.final_norm;
            norm_hooked(
                obs,
                last,
                hooks,
                final_kind,
                &x,
                w,
                final_bias,
                dims.rms_eps,
                &mut h,
            )?;
            Ok(h)
        })
        .transpose()?;
        let logits = if n_logits == 0 {
            Vec::new()
        } else {
            let gather = |v: &[f32]| -> Vec<f32> {
                logit_rows
                    .iter()
                    .flat_map(|&r| v[r * dm..(r + 1) * dm].iter().copied())
                    .collect()
            };
            let h = match &final_all {
                Some(h) => gather(h),
                None => {
                    let rows = gather(&x);
                    match final_bias {
                        Some(b) => layer_norm(&rows, &self.weights.final_norm, b, dims.rms_eps),
                        None => rms_norm(&rows, &self.weights.final_norm, dims.rms_eps),
                    }
                }
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
            k_sq: kept_sq,
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
            hand(obs, 0, Hook::PosEmbed, &[m, dm], &mut pos)?;
            x.iter_mut().zip(&pos).for_each(|(v, e)| *v += e);
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

mod embed;
mod encoder;
pub use embed::{l2_normalize, EmbedInput};
#[cfg(test)]
mod tests;
