//! One decoder block's steps, in the order [`Model::forward_segments`]'s loop runs them:
//! [`Model::qkv_step`] (`ln1`, the fused q|k|v projection, Qwen3's q/k norms, `hook_q/k/v`),
//! [`Model::attention_step`] (per segment: RoPE, `hook_rot_q/k`, the prefix's keys and values,
//! the attention kernel into `z`), [`narrow_to_logit_rows`] (the last layer's rows that feed
//! only the logits), [`Model::attn_out_step`] (`hook_result`, the output projection, Gemma's
//! post-norm, the residual add) and [`Model::mlp_step`] (`ln2`, gate|up, the activation, down,
//! the residual add); then [`Model::final_logits`]. The buffers they share live in [`Scratch`].

use super::{
    hand, hand_half_split, hand_qkv, norm_hooked, touches, KvPrefix, Prefix, RopeTables,
    RunOptions, Segment, Stack, Timings,
};
use crate::model::attention::{
    all_finite, attention_edited, attention_strided, max_row_sq, AttnDims,
};
use crate::model::block::{MlpKind, NormKind};
use crate::model::capture::{Hook, Observer};
use crate::model::config::RopeStyle;
use crate::model::error::{Error, Result};
use crate::model::ops::{
    geglu_tanh, gelu_erf, gelu_tanh, layer_norm, logits_rows_as, merge_heads, rms_norm,
    rms_norm_in_place, split_heads, split_heads_into, swiglu,
};
use crate::model::weights::Layer;
use crate::model::Model;
use rayon::prelude::*;
use std::time::Instant;

/// The hooks of the last layer after its attention, and `ln_final`'s: when none is watched or
/// edited, that layer's output projection and MLP run on the logits rows alone.
const AFTER_ATTENTION: [Hook; 12] = [
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
];

/// The layers' big buffers, allocated once per forward and reused by every layer (fresh ones
/// were zeroed anew for every layer: memset took 4% of a 2,048-token run).
pub(super) struct Scratch {
    /// a norm's output, `[m, d_model]`
    pub(super) normed: Vec<f32>,
    /// the fused projection's output, `[m, q | k | v]`
    pub(super) qkv: Vec<f32>,
    /// one segment's queries after RoPE, `[n_heads, rows, head_dim]`
    pub(super) qh: Vec<f32>,
    /// the attention's output, `[m, n_heads, head_dim]`
    pub(super) z: Vec<f32>,
    /// gate|up's output for one block of MLP rows, `[rows, 2·d_ff]`
    pub(super) gu: Vec<f32>,
    /// the MLP's activation for one block of rows, `[rows, d_ff]`
    pub(super) act: Vec<f32>,
    /// rows per block of the MLP (so its `[rows, 2·d_ff]` intermediate stays small)
    pub(super) mlp_rows: usize,
    /// a decode step's forward: one-row products from the file's blocks
    /// ([`crate::model::weights::Linear::forward_into_as`])
    pub(super) from_blocks: bool,
}

impl Scratch {
    /// The buffers of a forward over `m` stacked rows.
    pub(super) fn new(model: &Model, m: usize) -> Self {
        let d = &model.dims;
        let (nh, nkv, hd, dm, ff) = (d.n_heads, d.n_kv_heads, d.head_dim, d.d_model, d.d_ff);
        let width = (nh + 2 * nkv) * hd;
        let mlp_rows = super::mlp_block_rows(ff).min(m);
        Scratch {
            gu: vec![0f32; mlp_rows * 2 * ff],
            act: vec![0f32; mlp_rows * ff],
            normed: vec![0f32; m * dm],
            qkv: vec![0f32; m * width],
            qh: vec![0f32; nh * m * hd],
            z: vec![0f32; m * nh * hd],
            mlp_rows,
            from_blocks: false,
        }
    }

    /// Frees the buffers: a long input's tens of megabytes go back to the system before the
    /// logits bring in the output head's pages (measured: `inspect` at 2,041 tokens peaks
    /// 1.72 → 1.64 GB).
    pub(super) fn release(self) {
        let s = self;
        let freed =
            4 * (s.gu.len() + s.act.len() + s.normed.len() + s.qkv.len() + s.qh.len() + s.z.len());
        drop(s);
        if freed >= 16 << 20 {
            crate::model::attention::release_attention_buffers();
            crate::model::return_free_memory();
        }
    }
}

/// Every layer's keys and values (after RoPE) and their bounds, kept when
/// `RunOptions::keep_kv` asks for them (one segment from layer 0).
#[derive(Default)]
pub(super) struct KeptKv {
    pub(super) layers: Vec<(Vec<f32>, Vec<f32>)>,
    pub(super) k_sq: Vec<f64>,
}

/// Cuts the stacked rows down to the logits rows (`x` `[m, d_model]`, `z` `[m, n_heads·head_dim]`)
/// and renumbers `logit_rows` in them; returns the rows left. The last layer's attention output
/// and MLP feed nothing but the logits: unless a hook wants them, they run on these rows alone
/// (none for `sinks`, a capture of patterns or statistics; one for `inspect`'s prediction), 1/24
/// of the default model's projections saved.
pub(super) fn narrow_to_logit_rows(
    x: &mut Vec<f32>,
    z: &mut Vec<f32>,
    logit_rows: &mut Vec<usize>,
    dm: usize,
    zw: usize,
) -> usize {
    let gather = |v: &[f32], w: usize| -> Vec<f32> {
        logit_rows
            .iter()
            .flat_map(|&r| v[r * w..(r + 1) * w].iter().copied())
            .collect()
    };
    *x = gather(x, dm);
    *z = gather(z, zw);
    let mr = logit_rows.len();
    *logit_rows = (0..mr).collect();
    mr
}

/// Whether layer `l` is the last one and no hook after its attention is watched or edited
/// (then [`narrow_to_logit_rows`] applies).
pub(super) fn only_logits_follow(model: &Model, obs: &dyn Observer, l: usize) -> bool {
    l + 1 == model.weights.layers.len() && !AFTER_ATTENTION.iter().any(|&h| touches(obs, l, h))
}

impl Model {
    /// The attention's inputs of layer `l`: `ln1` of the residual `x` (`m` rows) into
    /// `s.normed`, the fused q|k|v projection into `s.qkv` (`[m, q | k | v]`), Qwen3's per-head
    /// q/k RMSNorms, then `hook_q`, `hook_k`, `hook_v` (in Hugging Face's row order, edits
    /// written back into `s.qkv`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn qkv_step(
        &self,
        obs: &mut dyn Observer,
        l: usize,
        layer: &Layer,
        x: &[f32],
        m: usize,
        s: &mut Scratch,
        timings: &mut Timings,
    ) -> Result<()> {
        let dims = &self.dims;
        let (nh, nkv, hd) = (dims.n_heads, dims.n_kv_heads, dims.head_dim);
        let (nq, nk) = (nh * hd, nkv * hd);
        let width = nq + 2 * nk;
        let bias = layer.norm_biases.as_ref().map(|b| b.0.as_slice());
        let ln1 = (Hook::Ln1Scale, Hook::Ln1Normalized);
        norm_hooked(
            obs,
            l,
            ln1,
            layer.plan.norm,
            x,
            &layer.attn_norm,
            bias,
            dims.rms_eps,
            &mut s.normed,
        )?;
        let t = Instant::now();
        // [m, q | k | v]
        (layer.qkv).forward_into_as(&s.normed, m, &mut s.qkv, false, s.from_blocks)?;
        timings.projections += t.elapsed();
        if let Some((qn, kn)) = &layer.qk_norm {
            // Qwen3: RMSNorm over each head's query and key, before RoPE
            s.qkv.par_chunks_mut(width).for_each(|row| {
                let (q, rest) = row.split_at_mut(nq);
                for head in q.chunks_mut(hd) {
                    rms_norm_in_place(head, qn, dims.rms_eps);
                }
                for head in rest[..nk].chunks_mut(hd) {
                    rms_norm_in_place(head, kn, dims.rms_eps);
                }
            });
        }
        let interleaved = self.weights.rope_style == RopeStyle::Interleaved;
        hand_qkv(obs, l, &mut s.qkv, m, dims, interleaved)
    }

    /// Layer `l`'s attention, one segment at a time (`Observer::segment(i)` first): its rows
    /// of `s.qkv` split into heads with RoPE ([`Model::rotated_heads`]), the prefix's keys and
    /// values before its own ([`Model::with_prefix`]), then the kernel
    /// ([`attention_bounded`], or [`attention_edited`] when an observer edits the maps) into
    /// the segment's rows of `s.z`. The keys and values are kept in `kept` when asked.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_step(
        &self,
        obs: &mut dyn Observer,
        l: usize,
        layer: &Layer,
        (segs, stack): (&[Segment], &Stack),
        prefix: &mut Prefix,
        opts: &RunOptions,
        (cos, sin): &RopeTables,
        s: &mut Scratch,
        kept: &mut KeptKv,
    ) -> Result<()> {
        let dims = &self.dims;
        let (nh, nkv, hd) = (dims.n_heads, dims.n_kv_heads, dims.head_dim);
        let width = (nh + 2 * nkv) * hd;
        let plan = layer.plan;
        let half = dims.rotary_dim / 2;
        let style = self.weights.rope_style;
        for (si, (seg, &r0)) in segs.iter().zip(&stack.row0).enumerate() {
            obs.segment(si);
            let (p0, ms) = (seg.reuse, seg.tokens.len());
            let n = p0 + ms;
            let rows = &s.qkv[r0 * width..(r0 + ms) * width];
            // the tables of this segment's positions, exactly (split_heads reads their width
            // from their length); a block with learned positions (GPT-2) has no rotation
            let rope = plan
                .rope_base()
                .map(|_| (&cos[p0 * half..n * half], &sin[p0 * half..n * half], style));
            let qh = &mut s.qh[..nh * ms * hd];
            let (kh, vh) = self.rotated_heads(obs, l, rows, ms, rope, qh)?;
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
            let zs = &mut s.z[r0 * nh * hd..(r0 + ms) * nh * hd];
            let knock = &stack.knocks[si];
            let edits = obs.edits(l, Hook::AttnScores) || obs.edits(l, Hook::Pattern);
            let prefix = match prefix {
                Prefix::Read(p) => *p,
                Prefix::Grow(p) => {
                    // the new keys and values written after the cache's own, read where they
                    // lie (`forward_segments` checked: one segment, on the whole cache)
                    let k_sq = p.write_layer(l, &kh, &vh, ms);
                    let (k, v, cap) = p.layer(l);
                    if edits {
                        let (kf, vf) = (p.sets_of(k, n), p.sets_of(v, n));
                        attention_edited(l, qh, &kf, &vf, adims, knock, opts.block_bytes, obs, zs)?;
                    } else {
                        let blocks = (opts.block_bytes, opts.key_block, opts.decode_step);
                        let kv = (k, v, cap);
                        attention_strided(l, qh, kv, adims, knock, blocks, Some(k_sq), obs, zs)?;
                    }
                    continue;
                }
            };
            let (kf, vf, k_sq) = self.with_prefix(l, prefix, stack.full, p0, ms, kh, vh, opts);
            if edits {
                attention_edited(l, qh, &kf, &vf, adims, knock, opts.block_bytes, obs, zs)?;
            } else {
                let blocks = (opts.block_bytes, opts.key_block, opts.decode_step);
                let kv = (&kf[..], &vf[..], n);
                attention_strided(l, qh, kv, adims, knock, blocks, k_sq, obs, zs)?;
                // [ms, nh, hd]
            }
            if let (true, Some(b)) = (opts.keep_kv, k_sq) {
                kept.layers.push((kf, vf));
                kept.k_sq.push(b);
            }
        }
        Ok(())
    }

    /// One segment's `ms` rows of q|k|v (`rows`) as heads after RoPE: the queries into `qh`
    /// (`[n_heads, ms, head_dim]`), the keys and values returned (`[n_kv_heads, ms, head_dim]`),
    /// with `hook_rot_q` and `hook_rot_k` handed in Hugging Face's row order (edits written back).
    fn rotated_heads(
        &self,
        obs: &mut dyn Observer,
        l: usize,
        rows: &[f32],
        ms: usize,
        rope: Option<(&[f32], &[f32], RopeStyle)>,
        qh: &mut [f32],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let dims = &self.dims;
        let (nh, nkv, hd) = (dims.n_heads, dims.n_kv_heads, dims.head_dim);
        let (nq, nk) = (nh * hd, nkv * hd);
        let width = nq + 2 * nk;
        let style = self.weights.rope_style;
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
                hand_half_split(obs, l, hook, &[ms, heads, hd], &mut merged, reorder)?;
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
        Ok((kh, vh))
    }

    /// A segment's keys and values for layer `l`: the first `p0` positions of the prefix's
    /// (of `full`) before its own `ms` new ones (`kh`, `vh`), and the keys' bound
    /// ([`max_row_sq`]) where it is had cheaply (a whole prefix's is kept with it, so only the
    /// new keys are read for it) or needed (keys to keep); `None` lets the kernel compute it.
    #[allow(clippy::too_many_arguments)]
    fn with_prefix(
        &self,
        l: usize,
        prefix: Option<&KvPrefix>,
        full: usize,
        p0: usize,
        ms: usize,
        kh: Vec<f32>,
        vh: Vec<f32>,
        opts: &RunOptions,
    ) -> (Vec<f32>, Vec<f32>, Option<f64>) {
        let (nkv, hd) = (self.dims.n_kv_heads, self.dims.head_dim);
        let k_sq = match prefix {
            Some(p) if p0 > 0 && p0 == full => Some(p.k_sq[l].max(max_row_sq(&kh, hd))),
            _ => None,
        };
        let (kf, vf) = match prefix {
            Some(p) if p0 > 0 => {
                // the segment's first p0 positions of each KV set, then its own (copied a
                // slice at a time: element by element, this copy was 6% of a decode step at
                // 600 positions)
                let cap = p.cap;
                let cat = |old: &[f32], new: &[f32]| -> Vec<f32> {
                    let mut out = Vec::with_capacity(nkv * (p0 + ms) * hd);
                    for g in 0..nkv {
                        out.extend_from_slice(&old[g * cap * hd..(g * cap + p0) * hd]);
                        out.extend_from_slice(&new[g * ms * hd..(g + 1) * ms * hd]);
                    }
                    out
                };
                (cat(&p.layers[l].0, &kh), cat(&p.layers[l].1, &vh))
            }
            _ => (kh, vh),
        };
        let k_sq = k_sq.or_else(|| opts.keep_kv.then(|| max_row_sq(&kf, hd)));
        (kf, vf, k_sq)
    }

    /// The attention's output of layer `l` added into the residual `x` (`m` rows) from `z`,
    /// `hook_attn_out` handed. `hook_result` (each head's z through its slice of W_O,
    /// `[m, heads, d_model]`) is computed only when asked: one product per head. Read, it
    /// changes nothing (the output projection runs as always); edited, the output is the sum
    /// of the edited results plus W_O's bias. Gemma normalizes the output before the add.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attn_out_step(
        &self,
        obs: &mut dyn Observer,
        l: usize,
        layer: &Layer,
        x: &mut [f32],
        (z, from_blocks): (&[f32], bool),
        m: usize,
        timings: &mut Timings,
    ) -> Result<()> {
        let (nh, dm) = (self.dims.n_heads, self.dims.d_model);
        let t = Instant::now();
        let mut results = None;
        if touches(obs, l, Hook::Result) {
            let (mut res, bias) = self.head_results(l, z, m)?;
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
            timings.projections += t.elapsed();
            hand(obs, l, Hook::AttnOut, &[m, dm], out)?;
            x.iter_mut().zip(out.iter()).for_each(|(x, a)| *x += a);
        } else if results.is_some()
            || layer.post_norms.is_some()
            || obs.edits(l, Hook::AttnOut)
            || layer.o.has_bias()
            || self.centres_writers()
        {
            let mut attn_out = match results {
                Some(r) => r,
                None => {
                    let mut out = layer.o.forward_as(z, m, from_blocks)?;
                    if self.centres_writers() {
                        // center_writing_weights: W_O and b_O centred over d_model
                        crate::model::processing::centre_rows(&mut out, dm);
                    }
                    out
                }
            };
            if let Some((post_attn, _)) = &layer.post_norms {
                // Gemma: the attention's output is normalized before the residual add
                attn_out = rms_norm(&attn_out, post_attn, self.dims.rms_eps);
            }
            timings.projections += t.elapsed();
            hand(obs, l, Hook::AttnOut, &[m, dm], &mut attn_out)?;
            x.iter_mut().zip(&attn_out).for_each(|(x, a)| *x += a);
        } else {
            if obs.wants(l, Hook::AttnOut) {
                // read only: the output on its own for the hook, while the residual gets the
                // product accumulated into it as always, so reading changes no bit
                let mut attn_out = layer.o.forward_as(z, m, from_blocks)?;
                hand(obs, l, Hook::AttnOut, &[m, dm], &mut attn_out)?;
            }
            layer.o.forward_into_as(z, m, x, true, from_blocks)?; // x += z · W_oᵀ
            timings.projections += t.elapsed();
        }
        Ok(())
    }

    /// Layer `l`'s MLP added into the residual `x` (`m` rows): `ln2`, then over blocks of
    /// `s.mlp_rows` rows gate|up, `hook_pre`/`hook_pre_linear`, the activation
    /// (SwiGLU [Shazeer 2020, arXiv:2002.05202, eq. (5)], GeGLU or GELU), `hook_post`, down
    /// (Gemma's post-norm), then `hook_mlp_out`. `mlp.hook_pre`/`hook_post` are whole
    /// `[m, d_mlp]` tensors: the MLP then runs in one block.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mlp_step(
        &self,
        obs: &mut dyn Observer,
        l: usize,
        layer: &Layer,
        x: &mut [f32],
        m: usize,
        s: &mut Scratch,
        timings: &mut Timings,
    ) -> Result<()> {
        let dims = &self.dims;
        let (dm, ff) = (dims.d_model, dims.d_ff);
        let plan = layer.plan;
        // hook_mlp_out needs the MLP's output on its own, not added into x as it is computed
        // (edited; one that only reads gets its own copy while x accumulates as always, so
        // reading changes no bit)
        let mut mlp_out = obs.edits(l, Hook::MlpOut).then(|| vec![0f32; m * dm]);
        let mut mlp_read =
            (mlp_out.is_none() && obs.wants(l, Hook::MlpOut)).then(|| vec![0f32; m * dm]);
        let bias = layer.norm_biases.as_ref().map(|b| b.1.as_slice());
        let ln2 = (Hook::Ln2Scale, Hook::Ln2Normalized);
        norm_hooked(
            obs,
            l,
            ln2,
            plan.norm,
            x,
            &layer.mlp_norm,
            bias,
            dims.rms_eps,
            &mut s.normed,
        )?;
        let h = &s.normed;
        let gated = plan.mlp.gated();
        let whole = [Hook::MlpPre, Hook::MlpPreLinear, Hook::MlpPost]
            .iter()
            .any(|&h| touches(obs, l, h));
        let mut own =
            (whole && m > s.mlp_rows).then(|| (vec![0f32; m * 2 * ff], vec![0f32; m * ff]));
        let (gu, act) = match own.as_mut() {
            Some((g, a)) => (g, a),
            None => (&mut s.gu, &mut s.act),
        };
        let block = if whole { m } else { s.mlp_rows };
        let gw = if gated { 2 * ff } else { ff };
        for r0 in (0..m).step_by(block) {
            let rows = block.min(m - r0);
            let t = Instant::now();
            let h = &h[r0 * dm..(r0 + rows) * dm];
            (layer.gate_up).forward_into_as(h, rows, gu, false, s.from_blocks)?;
            timings.projections += t.elapsed();
            pre_activation_hooks(obs, l, gated, &mut gu[..rows * gw], ff)?;
            activate(plan.mlp, &gu[..rows * gw], ff, &mut act[..rows * ff]);
            hand(obs, l, Hook::MlpPost, &[rows, ff], &mut act[..rows * ff])?;
            let t = Instant::now();
            let out_rows = r0 * dm..(r0 + rows) * dm;
            let read = mlp_read.as_mut().map(|o| &mut o[out_rows.clone()]);
            let dest = match mlp_out.as_mut() {
                Some(o) => (&mut o[out_rows], true),
                None => (&mut x[out_rows], false),
            };
            let act = (&act[..rows * ff], s.from_blocks);
            self.down_step(layer, act, rows, dest, read)?;
            timings.projections += t.elapsed();
        }
        if let Some(mut out) = mlp_read {
            hand(obs, l, Hook::MlpOut, &[m, dm], &mut out)?;
        }
        if let Some(mut out) = mlp_out {
            hand(obs, l, Hook::MlpOut, &[m, dm], &mut out)?;
            x.iter_mut().zip(&out).for_each(|(x, a)| *x += a);
        }
        Ok(())
    }

    /// The MLP's down projection of `rows` activation rows `act`, added into `dest` (the
    /// residual's rows, or `hook_mlp_out`'s own buffer when that is edited: `dest.1`), and
    /// copied into `read` for an observer that only reads `hook_mlp_out` (while the residual
    /// gets the product accumulated into it as always, so reading changes no bit). Gemma
    /// normalizes the output before the add.
    fn down_step(
        &self,
        layer: &Layer,
        (act, from_blocks): (&[f32], bool),
        rows: usize,
        (dest, own): (&mut [f32], bool),
        read: Option<&mut [f32]>,
    ) -> Result<()> {
        let centre = self.centres_writers();
        if layer.down.has_bias() || layer.post_norms.is_some() || own || centre {
            let mut out = layer.down.forward_as(act, rows, from_blocks)?;
            if centre {
                // center_writing_weights: W_out and b_out centred over d_model
                crate::model::processing::centre_rows(&mut out, self.dims.d_model);
            }
            if let Some((_, post_mlp)) = &layer.post_norms {
                // Gemma: the MLP's output is normalized before the residual add
                out = rms_norm(&out, post_mlp, self.dims.rms_eps);
            }
            if let Some(o) = read {
                o.copy_from_slice(&out);
            }
            dest.iter_mut().zip(&out).for_each(|(x, a)| *x += a);
        } else {
            if let Some(o) = read {
                let out = layer.down.forward_as(act, rows, from_blocks)?;
                o.copy_from_slice(&out);
            }
            layer
                .down
                .forward_into_as(act, rows, dest, true, from_blocks)?;
        }
        Ok(())
    }

    /// The logits of `logit_rows` (rows of the final residual `x`): `ln_final` (its hooks see
    /// every position, when watched), the output head, Gemma 2's final soft-cap; a non-finite
    /// logit is refused. `stopped`: the forward stopped before the final norm (no logits, no
    /// `ln_final` hooks).
    pub(super) fn final_logits(
        &self,
        obs: &mut dyn Observer,
        x: &[f32],
        logit_rows: &[usize],
        (stopped, from_blocks): (bool, bool),
    ) -> Result<Vec<Vec<f32>>> {
        let dims = &self.dims;
        let dm = dims.d_model;
        let logit_rows = if stopped { &[][..] } else { logit_rows };
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
                x,
                w,
                final_bias,
                dims.rms_eps,
                &mut h,
            )?;
            Ok(h)
        })
        .transpose()?;
        if n_logits == 0 {
            return Ok(Vec::new());
        }
        let gather = |v: &[f32]| -> Vec<f32> {
            logit_rows
                .iter()
                .flat_map(|&r| v[r * dm..(r + 1) * dm].iter().copied())
                .collect()
        };
        let h = match &final_all {
            Some(h) => gather(h),
            None => {
                let rows = gather(x);
                match final_bias {
                    Some(b) => layer_norm(&rows, &self.weights.final_norm, b, dims.rms_eps),
                    None => rms_norm(&rows, &self.weights.final_norm, dims.rms_eps),
                }
            }
        };
        let mut rows = logits_rows_as(&self.weights.lm_head, h, n_logits, dm, from_blocks)?;
        if let Some(cap) = dims.gemma.as_ref().and_then(|g| g.final_softcap) {
            // Gemma 2: final-logit soft-capping
            rows.iter_mut()
                .flatten()
                .for_each(|z| *z = (*z / cap).tanh() * cap);
        }
        if self.centres_logits() {
            // TransformerLens's center_unembed: W_U centred over the vocabulary
            rows.iter_mut().for_each(|r| {
                let width = r.len();
                crate::model::processing::centre_rows(r, width)
            });
        }
        if !rows.iter().all(|r| all_finite(r)) {
            return Err(Error::NonFinite {
                what: "the logits".into(),
                layer: None,
            });
        }
        Ok(rows)
    }
}

/// `mlp.hook_pre` (the gate's pre-activation; GPT-2: c_fc's output) and, for a gated MLP,
/// `mlp.hook_pre_linear` (the up projection), each `[rows, d_mlp]`, handed from the gate|up
/// rows `gu` (`[rows, gw]`) and written back into them.
fn pre_activation_hooks(
    obs: &mut dyn Observer,
    l: usize,
    gated: bool,
    gu: &mut [f32],
    ff: usize,
) -> Result<()> {
    let gw = if gated { 2 * ff } else { ff };
    let rows = gu.len() / gw;
    for (hook, cols) in [(Hook::MlpPre, 0..ff), (Hook::MlpPreLinear, ff..2 * ff)] {
        if (hook == Hook::MlpPreLinear && !gated) || !touches(obs, l, hook) {
            continue;
        }
        let mut part: Vec<f32> = gu
            .chunks(gw)
            .flat_map(|r| r[cols.clone()].iter().copied())
            .collect();
        hand(obs, l, hook, &[rows, ff], &mut part)?;
        for (row, new) in gu.chunks_mut(gw).zip(part.chunks(ff)) {
            row[cols.clone()].copy_from_slice(new);
        }
    }
    Ok(())
}

/// The MLP's activation of `rows` gate|up rows `gu` (`[rows, 2·d_ff]`, gated; `[rows, d_ff]`
/// otherwise) into `act` (`[rows, d_ff]`).
fn activate(kind: MlpKind, gu: &[f32], ff: usize, act: &mut [f32]) {
    let rows = act.len() / ff;
    match kind {
        // GPT-2: gelu_new(c_fc(h)), no gate
        MlpKind::GeluTanh => gelu_tanh(&gu[..rows * ff], act),
        MlpKind::GeluErf => gelu_erf(&gu[..rows * ff], act),
        MlpKind::GeGluTanh => geglu_tanh(&gu[..rows * 2 * ff], ff, act),
        MlpKind::SwiGlu => swiglu(&gu[..rows * 2 * ff], ff, act),
    }
}
