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
    /// Upper bound for one `[heads, rows, keys]` score block, in bytes.
    pub block_bytes: usize,
    /// Return every layer's keys and values (after RoPE) so later runs can reuse a prefix.
    pub keep_kv: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions { logits_at: Vec::new(), knockout: Vec::new(), block_bytes: 64 << 20, keep_kv: false }
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

/// Causal (and knockout) mask for query rows `q0..q0+rows` over keys `0..q0+rows`: 0 where the
/// key is visible, `-inf` where it is not.
fn block_mask(q0: usize, rows: usize, knockout: &[bool]) -> Vec<f32> {
    let kw = q0 + rows;
    let mut m = vec![0.0f32; rows * kw];
    for r in 0..rows {
        let i = q0 + r;
        for j in 0..kw {
            let hidden = j > i || (j != i && knockout.get(j).copied().unwrap_or(false));
            if hidden {
                m[r * kw + j] = f32::NEG_INFINITY;
            }
        }
    }
    m
}

/// Causal grouped-query attention, in blocks of query rows. `q: [n_heads, n, d]` holds the
/// last `n` of the `k_len` positions of `k, v: [n_kv_heads, k_len, d]` (after RoPE; the first
/// `k_len - n` come from a reused prefix). Returns `z: [n_heads, n, d]`.
/// Query heads `g·group..(g+1)·group` share K/V set `g` ([`crate::reference::kv_head`]); K/V are
/// never copied per head: the group's queries are stacked into one matmul against its keys.
pub fn attention(layer: usize, q: &Tensor, k: &Tensor, v: &Tensor, knockout: &[bool], block_bytes: usize, obs: &mut dyn Observer) -> Result<Tensor> {
    let (n_heads, n, d) = q.dims3()?;
    let (n_kv, k_len, dk) = k.dims3()?;
    if k_len < n || dk != d || n_heads % n_kv != 0 {
        return Err(Error::Candle(candle_core::Error::Msg(format!("attention shapes q {:?} k {:?}: you likely have a bug", q.dims(), k.dims()))));
    }
    let group = n_heads / n_kv;
    let scale = 1.0 / (d as f64).sqrt();
    let (want_s, want_p) = (obs.wants(layer, Hook::AttnScores), obs.wants(layer, Hook::Pattern));
    let offset = k_len - n; // absolute position of query row 0
    // rows per block so that one [n_heads, rows, k_len] f32 block stays under block_bytes
    let rows_per_block = (block_bytes / (n_heads * k_len * 4).max(1)).clamp(1, n);
    let mut zs = Vec::with_capacity(n.div_ceil(rows_per_block));
    let mut q0 = 0;
    while q0 < n {
        let rows = rows_per_block.min(n - q0);
        let kw = offset + q0 + rows; // keys after the block's last query are masked for every row
        let qb = q.narrow(1, q0, rows)?.contiguous()?.reshape((n_kv, group * rows, d))?;
        let (kb, vb) = if kw == k_len { (k.clone(), v.clone()) } else { (k.narrow(1, 0, kw)?.contiguous()?, v.narrow(1, 0, kw)?.contiguous()?) };
        // scores = q·kᵀ / √d, per head: [n_heads, rows, kw]
        let scores = (qb.matmul(&kb.t()?)? * scale)?.reshape((n_heads, rows, kw))?;
        let mask = Tensor::from_vec(block_mask(offset + q0, rows, knockout), (rows, kw), &Device::Cpu)?;
        let scores = scores.broadcast_add(&mask)?;
        if want_s {
            obs.attention_block(layer, Hook::AttnScores, offset + q0, [n_heads, rows, kw], &scores.flatten_all()?.to_vec1::<f32>()?);
        }
        // softmax in f32 over keys; masked (-inf) keys get exactly 0
        let pattern = candle_nn::ops::softmax_last_dim(&scores.to_dtype(DType::F32)?)?;
        if want_p {
            obs.attention_block(layer, Hook::Pattern, offset + q0, [n_heads, rows, kw], &pattern.flatten_all()?.to_vec1::<f32>()?);
        }
        // z = pattern · V
        let z = pattern.reshape((n_kv, group * rows, kw))?.matmul(&vb)?.reshape((n_heads, rows, d))?;
        zs.push(z);
        q0 += rows;
    }
    Ok(if zs.len() == 1 { zs.pop().expect("one block") } else { Tensor::cat(&zs, 1)? })
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
            let z = attention(l, &q, &k, &v, &knock, opts.block_bytes, obs)?; // [n_heads, m, d]
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
