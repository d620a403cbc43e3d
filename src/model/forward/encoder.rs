//! The encoder's forward (BERT): `LayerNorm(word + position + token type)`, then post-LN blocks
//! with bidirectional attention — `x = LN₁(x + attn(x))`, `x = LN₂(x + mlp(x))` — and no output
//! head. The attention is the decoders' kernel with `causal: false`; the hooks are the
//! decoders' names, handed in the same order. Two differ from TransformerLens's `BertBlock`,
//! which hands `hook_resid_mid` and `hook_resid_post` before their LayerNorm: here both are the
//! stream after it (what the next sublayer reads), so `resid_post` of layer l is `resid_pre` of
//! layer l + 1, as for a decoder; `ln1`/`ln2`'s `hook_scale` and `hook_normalized` are the two
//! post-norms.
//!
//! A token's type (segment) comes with the tokens, as the tokenizer gave it
//! (`RunOptions::token_types`): all 0 for `[CLS] A [SEP]` (a literal `[SEP]` inside A included),
//! 0 then 1 for the pair `[CLS] A [SEP] B [SEP]` ([`Model::encode_pair`]). One sequence runs at
//! a time, so there is no padding to mask.

use super::{hand, norm_hooked, touches, ForwardOut, Resume, RunOptions, Segment, Timings};
use crate::model::attention::{attention_edited, attention_into, AttnDims};
use crate::model::block::NormKind;
use crate::model::capture::{Hook, Observer};
use crate::model::error::{Error, Result};
use crate::model::ops::{gelu_erf, layer_norm_into, split_heads, split_heads_into};
use crate::model::weights::Layer;
use crate::model::Model;
use std::time::Instant;

impl Model {
    /// Whether the model is an encoder (BERT): bidirectional attention, no next-token prediction.
    pub fn is_encoder(&self) -> bool {
        self.dims.arch.is_encoder()
    }

    /// Refuses an encoder for `what` (something only a decoder has: next-token logits, generation,
    /// gradients of a next-token metric), saying why.
    pub fn require_decoder(&self, what: &str) -> Result<()> {
        if self.is_encoder() {
            return Err(Error::NotApplicable(format!(
                "{what} needs a decoder (a causal language model that predicts the next token); {} is an encoder ({}: bidirectional attention, no next-token prediction): pass a decoder with -m, such as qwen2.5-coder-0.5b (the default)",
                self.info.name,
                self.dims.arch.name()
            )));
        }
        Ok(())
    }

    /// The ids of `[CLS]` and `[SEP]` in an encoder's vocabulary (RoBERTa's `<s>` and `</s>`,
    /// which stand where BERT's do, where the vocabulary has no `[CLS]`/`[SEP]`).
    pub fn special_ids(&self) -> (Option<u32>, Option<u32>) {
        let id = |a: &str, b: &str| {
            self.tokenizer
                .token_id(a)
                .or_else(|| self.tokenizer.token_id(b))
        };
        (id("[CLS]", "<s>"), id("[SEP]", "</s>"))
    }

    /// A sentence pair for an encoder, as its tokenizer builds it: the ids and each token's type
    /// (pass the types to the forward in `RunOptions::token_types`). BERT's
    /// `[CLS] a [SEP] b [SEP]` with types 0 then 1; RoBERTa's `<s> a </s></s> b </s>` and
    /// DistilBERT's `[CLS] a [SEP] b [SEP]` with every type 0 (a RoBERTa has one type, a
    /// DistilBERT none: transformers runs them so). Refused for a decoder, an empty text, a BERT
    /// with a single token type (its tokenizer's type 1 has no embedding), or a pair past the
    /// model's positions.
    pub fn encode_pair(&self, a: &str, b: &str) -> Result<(Vec<u32>, Vec<u32>)> {
        self.encode_pair_typed(a, b)
            .map(|(ids, types, _)| (ids, types))
    }

    /// [`Model::encode_pair`] and, third, each token's segment: 0 for the first text's part, 1
    /// for the second's, also where the model runs no token types (RoBERTa: `<s> A </s>` then
    /// `</s> B </s>`; DistilBERT: its tokenizer's `[CLS] A [SEP]` then `B [SEP]`). The segments
    /// are for display and selection (`inspect`'s B marks, the view's A→B selector); the forward
    /// takes the second list, the types.
    pub fn encode_pair_segments(&self, a: &str, b: &str) -> Result<(Vec<u32>, Vec<u32>, Vec<u32>)> {
        let (ids, types, own) = self.encode_pair_typed(a, b)?;
        let segments = self.tokenizer.pair_segments(a, &ids, &own)?;
        Ok((ids, types, segments))
    }

    /// The pair's ids, the types the model runs, and the tokenizer's own types.
    fn encode_pair_typed(&self, a: &str, b: &str) -> Result<(Vec<u32>, Vec<u32>, Vec<u32>)> {
        if !self.is_encoder() {
            return Err(Error::NotApplicable(format!(
                "a sentence pair (--pair) is for an encoder (BERT: [CLS] A [SEP] B [SEP]); {} is a decoder",
                self.info.name
            )));
        }
        if self.dims.arch == crate::model::config::Arch::Bert && self.dims.type_vocab < 2 {
            return Err(Error::NotApplicable(format!(
                "{} has {} token type(s) (type_vocab_size), so it cannot tell the two texts of a pair apart",
                self.info.name, self.dims.type_vocab
            )));
        }
        self.check_text_bytes(a.len() + b.len())?;
        if a.trim().is_empty() || b.trim().is_empty() {
            return Err(Error::EmptyText);
        }
        let (ids, types) = self.tokenizer.encode_pair(a, b)?;
        if ids.len() > self.dims.context_len {
            return Err(Error::TooLong {
                n_tokens: ids.len(),
                limit: self.dims.context_len,
                model: self.info.name.clone(),
            });
        }
        let run = if self.dims.type_vocab < 2 {
            vec![0; ids.len()]
        } else {
            types.clone()
        };
        Ok((ids, run, types))
    }

    /// The row of the learned position table each token takes: its position (BERT,
    /// DistilBERT); RoBERTa's `padding_idx + 1 +` the count of non-padding tokens before it, and
    /// `padding_idx` for a padding token (transformers' `create_position_ids_from_input_ids`).
    pub fn position_rows(&self, tokens: &[u32]) -> Vec<usize> {
        match self.dims.position_pad {
            None => (0..tokens.len()).collect(),
            Some(pad) => {
                let mut seen = 0;
                tokens
                    .iter()
                    .map(|&t| {
                        if t as usize == pad {
                            pad
                        } else {
                            seen += 1;
                            pad + seen
                        }
                    })
                    .collect()
            }
        }
    }

    /// The encoder's last hidden states, `[n, d_model]` (transformers' `last_hidden_state`), of
    /// one text (every token type 0); a pair's types go to [`Model::encoder_states_typed`].
    pub fn encoder_states(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.encoder_states_typed(tokens, None)
    }

    /// [`Model::encoder_states`] for `tokens` of the given types (`None`: all 0, a single text;
    /// a pair's as [`Model::encode_pair`] gives them).
    pub fn encoder_states_typed(&self, tokens: &[u32], types: Option<&[u32]>) -> Result<Vec<f32>> {
        if !self.is_encoder() {
            return Err(Error::NotApplicable(format!(
                "hidden states of an encoder were asked for, but {} is a decoder",
                self.info.name
            )));
        }
        struct Last {
            layer: usize,
            out: Vec<f32>,
        }
        impl Observer for Last {
            fn wants(&self, layer: usize, hook: Hook) -> bool {
                layer == self.layer && hook == Hook::ResidPost
            }
            fn tensor(&mut self, _: usize, _: Hook, _: &[usize], data: &[f32]) {
                self.out = data.to_vec();
            }
            fn attention_block(&mut self, _: usize, _: Hook, _: usize, _: [usize; 3], _: &[f32]) {}
        }
        let mut last = Last {
            layer: self.dims.n_layers - 1,
            out: Vec::new(),
        };
        let opts = RunOptions {
            token_types: types.map(<[u32]>::to_vec),
            ..Default::default()
        };
        self.forward(tokens, &opts, &mut last)?;
        Ok(last.out)
    }

    /// The sentence embedding: the mean of the last hidden states over every token (\[CLS\] and
    /// \[SEP\] included), as sentence-transformers' mean pooling computes it for one text.
    pub fn embed_tokens(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.embed_tokens_typed(tokens, None)
    }

    /// [`Model::embed_tokens`] for `tokens` of the given types (`None`: all 0; a pair's as
    /// [`Model::encode_pair`] gives them).
    pub fn embed_tokens_typed(&self, tokens: &[u32], types: Option<&[u32]>) -> Result<Vec<f32>> {
        let h = self.encoder_states_typed(tokens, types)?;
        let dm = self.dims.d_model;
        let n = tokens.len();
        let mut sum = vec![0f64; dm];
        for row in h.chunks(dm) {
            sum.iter_mut().zip(row).for_each(|(s, &v)| *s += v as f64);
        }
        Ok(sum.iter().map(|s| (s / n as f64) as f32).collect())
    }

    /// BERT's pooler output, `tanh(W · h_[CLS] + b)`, where the checkpoint has a pooler (`types`
    /// as in [`Model::encoder_states_typed`]).
    pub fn pooler_output(&self, tokens: &[u32], types: Option<&[u32]>) -> Result<Option<Vec<f32>>> {
        let Some((w, b)) = self
            .weights
            .encoder
            .as_ref()
            .and_then(|e| e.pooler.as_ref())
        else {
            return Ok(None);
        };
        let h = self.encoder_states_typed(tokens, types)?;
        let dm = self.dims.d_model;
        let cls = &h[..dm];
        Ok(Some(
            w.chunks(dm)
                .zip(b)
                .map(|(row, &bias)| {
                    let s: f64 = row
                        .iter()
                        .zip(cls)
                        .map(|(&a, &x)| a as f64 * x as f64)
                        .sum();
                    ((s + bias as f64) as f32).tanh()
                })
                .collect(),
        ))
    }

    /// [`Model::forward_segments`] for an encoder: every segment is its own sequence (no reused
    /// prefix, no resumed layer, no logits). A block's steps: `hook_resid_pre`, q|k|v
    /// ([`Model::encoder_qkv`]), the attention per segment ([`Model::encoder_attention`]),
    /// `hook_z`, the output projection and `ln1` ([`Model::encoder_attn_out`]),
    /// `hook_resid_mid`, the MLP and `ln2` ([`Model::encoder_mlp`]), `hook_resid_post`.
    pub(super) fn forward_encoder(
        &self,
        reuses_prefix: bool,
        segs: &[Segment],
        resume: Option<Resume>,
        opts: &RunOptions,
        obs: &mut dyn Observer,
    ) -> Result<ForwardOut> {
        let row0 = self.check_encoder_segments(reuses_prefix, segs, resume.is_some(), opts)?;
        let start = Instant::now();
        let dims = &self.dims;
        let (nh, hd, dm) = (dims.n_heads, dims.head_dim, dims.d_model);
        let m: usize = segs.iter().map(|s| s.tokens.len()).sum();
        let mut x = self.encoder_embeddings(segs, &row0, opts, obs)?;
        let width = (nh + 2 * dims.n_kv_heads) * hd;
        let mut qkv = vec![0f32; m * width];
        let mut z = vec![0f32; m * nh * hd];
        let mut sum = vec![0f32; m * dm];
        // the sublayers' buffers, made once per forward (not per layer: at 384 rows the MLP's
        // two are 2.4 MB each, and their page faults and zeroing showed in `embed`'s profile)
        let mut out = vec![0f32; m * dm];
        let mut mlp = (vec![0f32; m * dims.d_ff], vec![0f32; m * dims.d_ff]);
        let mut timings = Timings::default();
        let knocks: Vec<Vec<bool>> = segs
            .iter()
            .map(|seg| {
                let mut k = vec![false; seg.tokens.len()];
                seg.knockout.iter().for_each(|&p| k[p] = true);
                k
            })
            .collect();
        for (l, layer) in self.weights.layers.iter().enumerate() {
            hand(obs, l, Hook::ResidPre, &[m, dm], &mut x)?;
            if obs.stops_before(l) {
                break;
            }
            self.encoder_qkv(obs, l, layer, &x, m, &mut qkv, &mut timings)?;
            let t0 = Instant::now();
            let stacked = (segs, &row0[..], &knocks[..]);
            self.encoder_attention(obs, l, layer, stacked, opts, &qkv, &mut z)?;
            timings.attention += t0.elapsed();
            hand(obs, l, Hook::Z, &[m, nh, hd], &mut z)?;
            obs.attention_done(l);
            let xs = (&mut x[..], &mut sum[..], &mut out[..]);
            self.encoder_attn_out(obs, l, layer, xs, &z, m, &mut timings)?;
            hand(obs, l, Hook::ResidMid, &[m, dm], &mut x)?;
            let xs = (&mut x[..], &mut sum[..], &mut out[..]);
            let hidden = (&mut mlp.0[..], &mut mlp.1[..]);
            self.encoder_mlp(obs, l, layer, xs, hidden, m, &mut timings)?;
            super::check_residual_finite(&x, l)?;
            hand(obs, l, Hook::ResidPost, &[m, dm], &mut x)?;
            obs.layer_done(l);
            if super::interrupted() {
                return Err(Error::Interrupted);
            }
        }
        timings.total = start.elapsed();
        Ok(ForwardOut {
            logits: Vec::new(),
            timings,
            kv: None,
        })
    }

    /// An encoder's segments checked (no logits, no prefix, no resumed layer or kept keys,
    /// tokens and knockouts in range): each one's first row among the stacked rows.
    fn check_encoder_segments(
        &self,
        reuses_prefix: bool,
        segs: &[Segment],
        resumes: bool,
        opts: &RunOptions,
    ) -> Result<Vec<usize>> {
        if segs.iter().any(|s| !s.logits_at.is_empty()) {
            self.require_decoder("a next-token prediction (logits)")?;
        }
        if reuses_prefix || resumes || opts.keep_kv || segs.iter().any(|s| s.reuse > 0) {
            return Err(Error::NotApplicable(format!(
                "reusing a prefix's keys and values or resuming at a layer is for decoders (a causal model's earlier positions do not depend on later ones); {} is an encoder",
                self.info.name
            )));
        }
        self.encoder_weights()?;
        let mut row0 = Vec::with_capacity(segs.len());
        let mut m = 0;
        for seg in segs {
            let n = seg.tokens.len();
            if n == 0 {
                return Err(Error::EmptyText);
            }
            self.check_tokens(n, seg.tokens)?;
            if let Some(&p) = seg.knockout.iter().find(|&&p| p >= n) {
                return Err(Error::OutOfRange {
                    what: "position".into(),
                    value: p.to_string(),
                    range: format!("0..={}", n - 1),
                });
            }
            row0.push(m);
            m += n;
        }
        Ok(row0)
    }

    /// The encoder's embedding weights (a bug when missing).
    fn encoder_weights(&self) -> Result<&crate::model::weights::EncoderWeights> {
        self.weights.encoder.as_ref().ok_or_else(|| {
            Error::Bug("an encoder without its embedding weights: you likely have a bug".into())
        })
    }

    /// `hook_resid_pre` of layer 0: word (`hook_embed`) + position and token type
    /// (`hook_pos_embed`), then the embeddings' LayerNorm. A token type past the model's, or
    /// types not one per token, are refused.
    fn encoder_embeddings(
        &self,
        segs: &[Segment],
        row0: &[usize],
        opts: &RunOptions,
        obs: &mut dyn Observer,
    ) -> Result<Vec<f32>> {
        let dims = &self.dims;
        let dm = dims.d_model;
        let enc = self.encoder_weights()?;
        let all: Vec<u32> = segs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let m = all.len();
        let mut x: Vec<f32> = self.weights.embed.lookup(&all)?.flatten_all()?.to_vec1()?;
        hand(obs, 0, Hook::Embed, &[m, dm], &mut x)?;
        let pe = self.weights.pos_embed.as_deref().unwrap_or(&[]);
        let mut pos = vec![0f32; m * dm];
        for (seg, &r0) in segs.iter().zip(row0) {
            let types = match &opts.token_types {
                Some(t) if t.len() != seg.tokens.len() => {
                    return Err(Error::NotApplicable(format!(
                        "{} token types were given for a sequence of {} tokens (one per token)",
                        t.len(),
                        seg.tokens.len()
                    )))
                }
                Some(t) => t.clone(),
                None => vec![0; seg.tokens.len()],
            };
            let rows = self.position_rows(seg.tokens);
            for (r, &t) in types.iter().enumerate() {
                let t = t as usize;
                if t >= enc.type_vocab.max(1) {
                    return Err(Error::OutOfRange {
                        what: "token type".into(),
                        value: t.to_string(),
                        range: format!("0..{}", enc.type_vocab),
                    });
                }
                let row = &mut pos[(r0 + r) * dm..][..dm];
                let p = rows[r];
                row.copy_from_slice(&pe[p * dm..(p + 1) * dm]);
                // transformers adds word + token type, then position (DistilBERT: no types)
                if enc.type_vocab > 0 {
                    let ty = &enc.token_types[t * dm..(t + 1) * dm];
                    row.iter_mut().zip(ty).for_each(|(p, &y)| *p += y);
                }
            }
        }
        // hook_pos_embed holds position + token type (TransformerLens: hook_pos_embed and
        // hook_token_type_embed, added together)
        hand(obs, 0, Hook::PosEmbed, &[m, dm], &mut pos)?;
        x.iter_mut().zip(&pos).for_each(|(v, e)| *v += e);
        let mut normed = vec![0f32; m * dm];
        layer_norm_into(&x, &enc.norm.0, &enc.norm.1, dims.rms_eps, &mut normed);
        Ok(normed)
    }

    /// The q|k|v projection of the residual `x` (`m` rows) into `qkv`, with `hook_q`, `hook_k`,
    /// `hook_v` (edits written back).
    #[allow(clippy::too_many_arguments)]
    fn encoder_qkv(
        &self,
        obs: &mut dyn Observer,
        l: usize,
        layer: &Layer,
        x: &[f32],
        m: usize,
        qkv: &mut [f32],
        timings: &mut Timings,
    ) -> Result<()> {
        let t = Instant::now();
        layer.qkv.forward_into(x, m, qkv, false)?;
        timings.projections += t.elapsed();
        super::hand_qkv(obs, l, qkv, m, &self.dims, false)
    }

    /// Layer `l`'s bidirectional attention, one segment at a time (`Observer::segment(i)`
    /// first), from its rows of `qkv` into its rows of `z`: the kernel with `causal: false`, or
    /// [`attention_edited`] when an observer edits the maps.
    #[allow(clippy::too_many_arguments)]
    fn encoder_attention(
        &self,
        obs: &mut dyn Observer,
        l: usize,
        layer: &Layer,
        (segs, row0, knocks): (&[Segment], &[usize], &[Vec<bool>]),
        opts: &RunOptions,
        qkv: &[f32],
        z: &mut [f32],
    ) -> Result<()> {
        let (nh, nkv, hd) = (self.dims.n_heads, self.dims.n_kv_heads, self.dims.head_dim);
        let (nq, nk) = (nh * hd, nkv * hd);
        let width = nq + 2 * nk;
        let plan = layer.plan;
        for (si, (seg, &r0)) in segs.iter().zip(row0).enumerate() {
            obs.segment(si);
            let n = seg.tokens.len();
            let rows = &qkv[r0 * width..(r0 + n) * width];
            let mut qh = vec![0f32; nh * n * hd];
            split_heads_into(rows, n, width, 0, nh, hd, None, &mut qh);
            let kh = split_heads(rows, n, width, nq, nkv, hd, None);
            let vh = split_heads(rows, n, width, nq + nk, nkv, hd, None);
            let adims = AttnDims {
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
                q_len: n,
                k_len: n,
                window: None,
                scale: plan.score_scale,
                softcap: plan.softcap,
                causal: plan.causal,
            };
            let zs = &mut z[r0 * nh * hd..(r0 + n) * nh * hd];
            let knock = &knocks[si];
            if obs.edits(l, Hook::AttnScores) || obs.edits(l, Hook::Pattern) {
                attention_edited(l, &qh, &kh, &vh, adims, knock, opts.block_bytes, obs, zs)?;
            } else {
                let (bb, kb) = (opts.block_bytes, opts.key_block);
                attention_into(l, &qh, &kh, &vh, adims, knock, bb, kb, obs, zs)?;
            }
        }
        Ok(())
    }

    /// The attention's output (`hook_result` when asked: the output is then the sum of the
    /// results plus W_O's bias where edited), `hook_attn_out`, then post-LN:
    /// `x = LN₁(x + attn_out)` (`sum` holds the sum, `attn_out` the output: `[m, d_model]`).
    #[allow(clippy::too_many_arguments)]
    fn encoder_attn_out(
        &self,
        obs: &mut dyn Observer,
        l: usize,
        layer: &Layer,
        (x, sum, attn_out): (&mut [f32], &mut [f32], &mut [f32]),
        z: &[f32],
        m: usize,
        timings: &mut Timings,
    ) -> Result<()> {
        let (nh, dm) = (self.dims.n_heads, self.dims.d_model);
        let t = Instant::now();
        if touches(obs, l, Hook::Result) {
            let (mut res, bias) = self.head_results(l, z, m)?;
            hand(obs, l, Hook::Result, &[m, nh, dm], &mut res)?;
            for (o, r) in attn_out.chunks_mut(dm).zip(res.chunks(nh * dm)) {
                o.copy_from_slice(&bias);
                for head in r.chunks(dm) {
                    o.iter_mut().zip(head).for_each(|(o, v)| *o += v);
                }
            }
            if !obs.edits(l, Hook::Result) {
                layer.o.forward_into(z, m, attn_out, false)?;
            }
        } else {
            layer.o.forward_into(z, m, attn_out, false)?;
        }
        timings.projections += t.elapsed();
        hand(obs, l, Hook::AttnOut, &[m, dm], attn_out)?;
        sum.iter_mut()
            .zip(x.iter().zip(attn_out.iter()))
            .for_each(|(s, (a, b))| *s = a + b);
        let b1 = ln_bias(layer, false)?;
        norm_hooked(
            obs,
            l,
            (Hook::Ln1Scale, Hook::Ln1Normalized),
            NormKind::Layer,
            sum,
            &layer.attn_norm,
            Some(&b1),
            self.dims.rms_eps,
            x,
        )
    }

    /// The MLP, `down(gelu(up(x)))` with `hook_pre`, `hook_post`, `hook_mlp_out`, then
    /// post-LN: `x = LN₂(x + mlp_out)` (`sum` holds the sum, `mlp_out` the output; `pre` and
    /// `act`, `[m, d_ff]`, the MLP's hidden values before and after the GELU).
    #[allow(clippy::too_many_arguments)]
    fn encoder_mlp(
        &self,
        obs: &mut dyn Observer,
        l: usize,
        layer: &Layer,
        (x, sum, mlp_out): (&mut [f32], &mut [f32], &mut [f32]),
        (pre, act): (&mut [f32], &mut [f32]),
        m: usize,
        timings: &mut Timings,
    ) -> Result<()> {
        let (dm, ff) = (self.dims.d_model, self.dims.d_ff);
        let t = Instant::now();
        layer.gate_up.forward_into(x, m, pre, false)?;
        timings.projections += t.elapsed();
        hand(obs, l, Hook::MlpPre, &[m, ff], pre)?;
        gelu_erf(pre, act);
        hand(obs, l, Hook::MlpPost, &[m, ff], act)?;
        let t = Instant::now();
        layer.down.forward_into(act, m, mlp_out, false)?;
        timings.projections += t.elapsed();
        hand(obs, l, Hook::MlpOut, &[m, dm], mlp_out)?;
        sum.iter_mut()
            .zip(x.iter().zip(mlp_out.iter()))
            .for_each(|(s, (a, b))| *s = a + b);
        let b2 = ln_bias(layer, true)?;
        norm_hooked(
            obs,
            l,
            (Hook::Ln2Scale, Hook::Ln2Normalized),
            NormKind::Layer,
            sum,
            &layer.mlp_norm,
            Some(&b2),
            self.dims.rms_eps,
            x,
        )
    }
}

/// A BERT block's LayerNorm bias: `ln1`'s, or `ln2`'s when `second` (a bug when missing).
fn ln_bias(layer: &Layer, second: bool) -> Result<Vec<f32>> {
    layer
        .norm_biases
        .as_ref()
        .map(|(b1, b2)| if second { b2.clone() } else { b1.clone() })
        .ok_or_else(|| {
            Error::Bug("a BERT block without LayerNorm biases: you likely have a bug".into())
        })
}
