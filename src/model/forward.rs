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
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions { logits_at: Vec::new(), knockout: Vec::new(), block_bytes: 64 << 20 }
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

/// Causal grouped-query attention over a whole sequence, in blocks of query rows.
/// `q: [n_heads, n, d]`, `k, v: [n_kv_heads, n, d]` (after RoPE); returns `z: [n_heads, n, d]`.
/// Query heads `g·group..(g+1)·group` share K/V set `g` ([`crate::reference::kv_head`]); K/V are
/// never copied per head: the group's queries are stacked into one matmul against its keys.
pub fn attention(layer: usize, q: &Tensor, k: &Tensor, v: &Tensor, knockout: &[bool], block_bytes: usize, obs: &mut dyn Observer) -> Result<Tensor> {
    let (n_heads, n, d) = q.dims3()?;
    let (n_kv, k_len, dk) = k.dims3()?;
    if k_len != n || dk != d || n_heads % n_kv != 0 {
        return Err(Error::Candle(candle_core::Error::Msg(format!("attention shapes q {:?} k {:?}: you likely have a bug", q.dims(), k.dims()))));
    }
    let group = n_heads / n_kv;
    let scale = 1.0 / (d as f64).sqrt();
    let (want_s, want_p) = (obs.wants(layer, Hook::AttnScores), obs.wants(layer, Hook::Pattern));
    // rows per block so that one [n_heads, rows, n] f32 block stays under block_bytes
    let rows_per_block = (block_bytes / (n_heads * n * 4).max(1)).clamp(1, n);
    let mut zs = Vec::with_capacity(n.div_ceil(rows_per_block));
    let mut q0 = 0;
    while q0 < n {
        let rows = rows_per_block.min(n - q0);
        let kw = q0 + rows; // keys after the block's last query are masked for every row
        let qb = q.narrow(1, q0, rows)?.contiguous()?.reshape((n_kv, group * rows, d))?;
        let (kb, vb) = if kw == n { (k.clone(), v.clone()) } else { (k.narrow(1, 0, kw)?.contiguous()?, v.narrow(1, 0, kw)?.contiguous()?) };
        // scores = q·kᵀ / √d, per head: [n_heads, rows, kw]
        let scores = (qb.matmul(&kb.t()?)? * scale)?.reshape((n_heads, rows, kw))?;
        let mask = Tensor::from_vec(block_mask(q0, rows, knockout), (rows, kw), &Device::Cpu)?;
        let scores = scores.broadcast_add(&mask)?;
        if want_s {
            obs.attention_block(layer, Hook::AttnScores, q0, [n_heads, rows, kw], &scores.flatten_all()?.to_vec1::<f32>()?);
        }
        // softmax in f32 over keys; masked (-inf) keys get exactly 0
        let pattern = candle_nn::ops::softmax_last_dim(&scores.to_dtype(DType::F32)?)?;
        if want_p {
            obs.attention_block(layer, Hook::Pattern, q0, [n_heads, rows, kw], &pattern.flatten_all()?.to_vec1::<f32>()?);
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
        let start = Instant::now();
        let dims = &self.dims;
        let n = tokens.len();
        if n == 0 {
            return Err(Error::EmptyText);
        }
        if n > dims.context_len {
            return Err(Error::TooLong { n_tokens: n, limit: dims.context_len, model: self.info.name.clone() });
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= dims.vocab_size) {
            return Err(Error::OutOfRange { what: "token id".into(), value: bad.to_string(), range: format!("0..{}", dims.vocab_size) });
        }
        for &p in opts.logits_at.iter().chain(&opts.knockout) {
            if p >= n {
                return Err(Error::OutOfRange { what: "position".into(), value: p.to_string(), range: format!("0..={}", n - 1) });
            }
        }
        let (nh, nkv, hd, dm) = (dims.n_heads, dims.n_kv_heads, dims.head_dim, dims.d_model);
        let mut knock = vec![false; n];
        for &p in &opts.knockout {
            knock[p] = true;
        }
        let (cos, sin) = rope_tables(hd, dims.rope_base, n)?;
        let mut x = self.weights.embed.lookup(tokens)?; // [n, d_model]
        let mut attn_time = Duration::ZERO;
        for (l, layer) in self.weights.layers.iter().enumerate() {
            emit(obs, l, Hook::ResidPre, &x, &[n, dm])?;
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, dims.rms_eps)?;
            let q = layer.q.forward(&h)?; // [n, n_heads * head_dim]
            let k = layer.k.forward(&h)?; // [n, n_kv_heads * head_dim]
            let v = layer.v.forward(&h)?;
            emit(obs, l, Hook::Q, &q, &[n, nh, hd])?;
            emit(obs, l, Hook::K, &k, &[n, nkv, hd])?;
            emit(obs, l, Hook::V, &v, &[n, nkv, hd])?;
            // [n, heads, d] → [1, heads, n, d] for RoPE and per-head matmuls
            let to_heads = |t: &Tensor, heads: usize| -> Result<Tensor> { Ok(t.reshape((1, n, heads, hd))?.transpose(1, 2)?.contiguous()?) };
            let q = rope(&to_heads(&q, nh)?, &cos, &sin, self.weights.rope_style)?.squeeze(0)?;
            let k = rope(&to_heads(&k, nkv)?, &cos, &sin, self.weights.rope_style)?.squeeze(0)?;
            let v = to_heads(&v, nkv)?.squeeze(0)?;
            if obs.wants(l, Hook::RotQ) {
                emit(obs, l, Hook::RotQ, &q.transpose(0, 1)?.contiguous()?, &[n, nh, hd])?;
            }
            if obs.wants(l, Hook::RotK) {
                emit(obs, l, Hook::RotK, &k.transpose(0, 1)?.contiguous()?, &[n, nkv, hd])?;
            }
            let t0 = Instant::now();
            let z = attention(l, &q, &k, &v, &knock, opts.block_bytes, obs)?; // [n_heads, n, d]
            attn_time += t0.elapsed();
            let z = z.transpose(0, 1)?.contiguous()?; // [n, n_heads, d]
            emit(obs, l, Hook::Z, &z, &[n, nh, hd])?;
            let attn_out = layer.o.forward(&z.reshape((n, nh * hd))?)?;
            emit(obs, l, Hook::AttnOut, &attn_out, &[n, dm])?;
            x = (x + attn_out)?;
            // SwiGLU MLP [Shazeer 2020, arXiv:2002.05202, eq. (5)]
            let h = candle_nn::ops::rms_norm(&x, &layer.mlp_norm, dims.rms_eps)?;
            let mlp = layer.down.forward(&(layer.gate.forward(&h)?.silu()? * layer.up.forward(&h)?)?)?;
            x = (x + mlp)?;
            emit(obs, l, Hook::ResidPost, &x, &[n, dm])?;
        }
        let logits = if opts.logits_at.is_empty() {
            Vec::new()
        } else {
            let pos: Vec<u32> = opts.logits_at.iter().map(|&p| p as u32).collect();
            let xs = x.index_select(&Tensor::new(pos.as_slice(), &Device::Cpu)?, 0)?;
            let h = candle_nn::ops::rms_norm(&xs, &self.weights.final_norm, dims.rms_eps)?;
            candle_core::Module::forward(&self.weights.lm_head, &h)?.to_dtype(DType::F32)?.to_vec2()?
        };
        Ok(ForwardOut { logits, timings: Timings { attention: attn_time, total: start.elapsed() } })
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
