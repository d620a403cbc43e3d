//! A whole decoder (Qwen2 / Llama shape) forward on plain slices, built from the loops of
//! [`super`]: the oracle the candle forward of [`crate::model`] is tested against on tiny models.
//!
//! Per layer (pre-norm residual block, as in Llama and Qwen2):
//! `h = x + W_O · attn(RoPE(W_Q·n(x) + b_q), RoPE(W_K·n(x) + b_k), W_V·n(x) + b_v)`,
//! `x' = h + W_down · (silu(W_gate·n(h)) ⊙ W_up·n(h))`, with `n` = RMSNorm.
//! Weights are in Hugging Face layout (`[out, in]`, RoPE pairs `(i, i + d/2)`).

use super::{grouped_query_attention, linear, Mask};

/// Shape of a reference model (plain numbers, no file format).
#[derive(Clone, Debug)]
pub struct RefConfig {
    pub n_layers: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub d_ff: usize,
    pub vocab: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
}

/// One layer's weights, Hugging Face names in the comments.
#[derive(Clone, Debug)]
pub struct RefLayer {
    pub attn_norm: Vec<f32>,   // input_layernorm.weight [d_model]
    pub w_q: Vec<f32>,         // self_attn.q_proj.weight [n_heads*head_dim, d_model]
    pub b_q: Option<Vec<f32>>, // self_attn.q_proj.bias (Qwen2 only)
    pub w_k: Vec<f32>,         // self_attn.k_proj.weight [n_kv_heads*head_dim, d_model]
    pub b_k: Option<Vec<f32>>,
    pub w_v: Vec<f32>, // self_attn.v_proj.weight
    pub b_v: Option<Vec<f32>>,
    pub w_o: Vec<f32>,      // self_attn.o_proj.weight [d_model, n_heads*head_dim]
    pub mlp_norm: Vec<f32>, // post_attention_layernorm.weight
    pub w_gate: Vec<f32>,   // mlp.gate_proj.weight [d_ff, d_model]
    pub w_up: Vec<f32>,     // mlp.up_proj.weight [d_ff, d_model]
    pub w_down: Vec<f32>,   // mlp.down_proj.weight [d_model, d_ff]
}

#[derive(Clone, Debug)]
pub struct RefModel {
    pub cfg: RefConfig,
    pub embed: Vec<f32>, // model.embed_tokens.weight [vocab, d_model]
    pub layers: Vec<RefLayer>,
    pub final_norm: Vec<f32>,      // model.norm.weight
    pub lm_head: Option<Vec<f32>>, // lm_head.weight; None = tied to embed
}

/// What the reference forward returns.
#[derive(Clone, Debug)]
pub struct RefOutput {
    /// per layer `[n_heads, seq, seq]`.
    pub patterns: Vec<Vec<f32>>,
    /// `[seq, vocab]`.
    pub logits: Vec<f32>,
}

/// RMSNorm [Zhang & Sennrich 2019]: `x / sqrt(mean(x²) + eps) * w`.
pub fn rms_norm(xs: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    xs.chunks(d)
        .flat_map(|x| {
            let ms = x.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let r = 1.0 / (ms + eps).sqrt();
            x.iter().zip(w).map(move |(v, g)| v * r * g)
        })
        .collect()
}

/// RoPE [Su et al. 2021, arXiv:2104.09864] in the Hugging Face "rotate_half" layout:
/// dimension `i < d/2` is paired with `i + d/2` and rotated by `pos · base^(-2i/d)`.
/// `xs: [seq, n_heads * d]`, positions start at `pos0`.
pub fn rope_half(xs: &mut [f32], n_heads: usize, d: usize, base: f32, pos0: usize) {
    let half = d / 2;
    for (t, row) in xs.chunks_mut(n_heads * d).enumerate() {
        let pos = (pos0 + t) as f32;
        for h in 0..n_heads {
            let x = &mut row[h * d..][..d];
            for i in 0..half {
                let theta = pos * base.powf(-2.0 * i as f32 / d as f32);
                let (s, c) = theta.sin_cos();
                let (a, b) = (x[i], x[i + half]);
                x[i] = a * c - b * s;
                x[i + half] = b * c + a * s;
            }
        }
    }
}

fn add_bias(xs: &mut [f32], b: &Option<Vec<f32>>) {
    if let Some(b) = b {
        for row in xs.chunks_mut(b.len()) {
            row.iter_mut().zip(b).for_each(|(x, bi)| *x += bi);
        }
    }
}

/// The whole forward: embeddings → layers → final norm → logits, keeping every pattern.
pub fn forward(m: &RefModel, tokens: &[u32]) -> RefOutput {
    let c = &m.cfg;
    let (dm, hd) = (c.d_model, c.head_dim);
    let mut x: Vec<f32> = tokens
        .iter()
        .flat_map(|&t| m.embed[t as usize * dm..][..dm].iter().copied())
        .collect();
    let mut patterns = Vec::new();
    for l in &m.layers {
        let n = rms_norm(&x, &l.attn_norm, c.rms_eps);
        let mut q = linear(&n, &l.w_q, dm, c.n_heads * hd);
        let mut k = linear(&n, &l.w_k, dm, c.n_kv_heads * hd);
        let mut v = linear(&n, &l.w_v, dm, c.n_kv_heads * hd);
        add_bias(&mut q, &l.b_q);
        add_bias(&mut k, &l.b_k);
        add_bias(&mut v, &l.b_v);
        rope_half(&mut q, c.n_heads, hd, c.rope_base, 0);
        rope_half(&mut k, c.n_kv_heads, hd, c.rope_base, 0);
        let mh = grouped_query_attention(
            &q,
            &k,
            &v,
            c.n_heads,
            c.n_kv_heads,
            hd,
            Mask::Causal { offset: 0 },
        );
        let o = linear(&mh.z, &l.w_o, c.n_heads * hd, dm);
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        patterns.push(mh.pattern);
        // SwiGLU MLP [Shazeer 2020, arXiv:2002.05202, eq. (5)]
        let n = rms_norm(&x, &l.mlp_norm, c.rms_eps);
        let g = linear(&n, &l.w_gate, dm, c.d_ff);
        let u = linear(&n, &l.w_up, dm, c.d_ff);
        let act: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        let down = linear(&act, &l.w_down, c.d_ff, dm);
        x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
    }
    let n = rms_norm(&x, &m.final_norm, c.rms_eps);
    let head = m.lm_head.as_ref().unwrap_or(&m.embed);
    let logits = linear(&n, head, dm, c.vocab);
    RefOutput { patterns, logits }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm() {
        let mut x = vec![1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0];
        let orig = x.clone();
        rope_half(&mut x, 1, 4, 10000.0, 0);
        assert_eq!(&x[..4], &orig[..4]);
        let n0: f32 = orig[4..].iter().map(|v| v * v).sum();
        let n1: f32 = x[4..].iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-4);
        assert_ne!(&x[4..], &orig[4..]);
    }

    #[test]
    fn rms_norm_of_constant_row_is_weight() {
        let y = rms_norm(&[3.0, 3.0, -3.0, -3.0], &[1.0, 2.0, 1.0, 1.0], 0.0);
        assert_eq!(y, vec![1.0, 2.0, -1.0, -1.0]);
    }
}
