//! The loaded model's weights as f32 in Hugging Face's layout, for TransformerLens's `W_Q`,
//! `W_O`, `W_in`, `W_E`, `W_U`, ... (the Python package rearranges them into TL's shapes).
//!
//! They are read back from what the forward computes with (dequantized, for a quantized file),
//! so `ln1.hook_normalized · w @ W_Q + b_Q` is the forward's `hook_q`. Q and K rows come in
//! Hugging Face's order for every format: llama.cpp's converter permutes them in llama GGUF
//! files (each head's half-split rows `(i, i + d/2)` become `(2i, 2i + 1)`), and this undoes it,
//! as the forward does for the `hook_q`/`hook_k`/`hook_rot_q`/`hook_rot_k` it hands out.

use super::config::RopeStyle;
use super::error::{Error, Result};
use super::weights::{Embedding, Head};
use super::Model;
use candle_core::{DType, Device};

/// A block's projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Projection {
    /// `[W_q; W_k; W_v]`: `(n_heads + 2·n_kv_heads)·head_dim` rows of `d_model`.
    Qkv,
    /// `W_o`: `d_model` rows of `n_heads·head_dim`.
    O,
    /// `[W_gate; W_up]` (`2·d_mlp` rows of `d_model`), or GPT-2's `c_fc` alone (`d_mlp` rows).
    GateUp,
    /// `W_down`: `d_model` rows of `d_mlp`.
    Down,
}

impl std::str::FromStr for Projection {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Ok(match s {
            "qkv" => Projection::Qkv,
            "o" => Projection::O,
            "gate_up" => Projection::GateUp,
            "down" => Projection::Down,
            o => {
                return Err(format!(
                    "projection `{o}` is not one of: qkv, o, gate_up, down"
                ))
            }
        })
    }
}

/// A projection's weights: `(W [rows, cols] row-major, bias [rows] or None, rows, cols)`.
pub type ProjectionWeights = (Vec<f32>, Option<Vec<f32>>, usize, usize);

/// A block's norm weights: the weight and, for LayerNorm (GPT-2), the bias.
pub type NormWeights<'a> = (&'a [f32], Option<&'a [f32]>);

/// Within each head of `head_dim` values, llama.cpp's interleaved order `(2i, 2i + 1)` back to
/// Hugging Face's half-split order `(i, i + d/2)`: `out[i] = x[2i]`, `out[i + d/2] = x[2i + 1]`.
/// `x` holds whole heads (rows of a weight: pass `cols` values per row).
pub fn interleaved_to_half_split(x: &mut [f32], head_dim: usize, cols: usize) {
    let half = head_dim / 2;
    let mut tmp = vec![0f32; head_dim * cols];
    for head in x.chunks_mut(head_dim * cols) {
        tmp[..head.len()].copy_from_slice(head);
        for i in 0..half {
            for (dst, src) in [(i, 2 * i), (i + half, 2 * i + 1)] {
                head[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&tmp[src * cols..(src + 1) * cols]);
            }
        }
    }
}

/// The inverse of [`interleaved_to_half_split`].
pub fn half_split_to_interleaved(x: &mut [f32], head_dim: usize, cols: usize) {
    let half = head_dim / 2;
    let mut tmp = vec![0f32; head_dim * cols];
    for head in x.chunks_mut(head_dim * cols) {
        tmp[..head.len()].copy_from_slice(head);
        for i in 0..half {
            for (src, dst) in [(i, 2 * i), (i + half, 2 * i + 1)] {
                head[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&tmp[src * cols..(src + 1) * cols]);
            }
        }
    }
}

impl Model {
    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.dims.n_layers {
            return Err(Error::OutOfRange {
                what: "layer".into(),
                value: layer.to_string(),
                range: format!("0..{}", self.dims.n_layers),
            });
        }
        Ok(())
    }

    /// Whether the file's Q/K rows are in llama.cpp's interleaved order (the forward hands its
    /// `hook_q`, `hook_k`, `hook_rot_q`, `hook_rot_k` in Hugging Face's order all the same).
    pub fn qk_interleaved(&self) -> bool {
        self.weights.rope_style == RopeStyle::Interleaved
    }

    /// Layer `layer`'s projection `part` as `(W [rows, cols] row-major f32, bias [rows] or None,
    /// rows, cols)`, in Hugging Face's layout (`y = x Wᵀ + b`); Q and K rows in Hugging Face's
    /// order. Computed on each call (a few milliseconds to a second).
    pub fn projection_weights(&self, layer: usize, part: Projection) -> Result<ProjectionWeights> {
        self.check_layer(layer)?;
        let l = &self.weights.layers[layer];
        let lin = match part {
            Projection::Qkv => &l.qkv,
            Projection::O => &l.o,
            Projection::GateUp => &l.gate_up,
            Projection::Down => &l.down,
        };
        let (rows, cols) = (lin.n, lin.k);
        let mut w = lin.weight_f32();
        let mut b = lin.bias().map(<[f32]>::to_vec);
        if part == Projection::Qkv && self.qk_interleaved() {
            let d = &self.dims;
            let qk_rows = (d.n_heads + d.n_kv_heads) * d.head_dim;
            interleaved_to_half_split(&mut w[..qk_rows * cols], d.head_dim, cols);
            if let Some(b) = b.as_mut() {
                interleaved_to_half_split(&mut b[..qk_rows], d.head_dim, 1);
            }
        }
        Ok((w, b, rows, cols))
    }

    /// Layer `layer`'s norms: `(ln1, ln2)`, each its weight and (LayerNorm) bias, as the forward
    /// applies them (Gemma's `1 +` included, as its files store it).
    pub fn layer_norms(&self, layer: usize) -> Result<(NormWeights<'_>, NormWeights<'_>)> {
        self.check_layer(layer)?;
        let l = &self.weights.layers[layer];
        let (b1, b2) = match &l.norm_biases {
            Some((a, b)) => (Some(a.as_slice()), Some(b.as_slice())),
            None => (None, None),
        };
        Ok(((&l.attn_norm, b1), (&l.mlp_norm, b2)))
    }

    /// Layer `layer`'s norms after attention and after the MLP (Gemma's post-norms, RMSNorm
    /// weights with the `1 +` included), if the family has them.
    pub fn post_norms(&self, layer: usize) -> Result<Option<(&[f32], &[f32])>> {
        self.check_layer(layer)?;
        let l = &self.weights.layers[layer];
        Ok(l.post_norms
            .as_ref()
            .map(|(a, m)| (a.as_slice(), m.as_slice())))
    }

    /// Layer `layer`'s per-head RMSNorm weights of the queries and of the keys (`[head_dim]`
    /// each, applied before RoPE: Qwen3, Gemma 3), in Hugging Face's row order, if the family
    /// has them.
    pub fn qk_norms(&self, layer: usize) -> Result<Option<(Vec<f32>, Vec<f32>)>> {
        self.check_layer(layer)?;
        let hd = self.dims.head_dim;
        Ok(self.weights.layers[layer].qk_norm.as_ref().map(|(q, k)| {
            let (mut q, mut k) = (q.clone(), k.clone());
            if self.qk_interleaved() {
                interleaved_to_half_split(&mut q, hd, 1);
                interleaved_to_half_split(&mut k, hd, 1);
            }
            (q, k)
        }))
    }

    /// Layer `layer`'s output projection's bias (`b_O`, `[d_model]`), if it has one (GPT-2).
    pub fn output_bias(&self, layer: usize) -> Result<Option<&[f32]>> {
        self.check_layer(layer)?;
        Ok(self.weights.layers[layer].o.bias())
    }

    /// The token embeddings `[vocab, d_model]` as the forward adds them (TransformerLens's
    /// `W_E`: Gemma's √d_model scale included, as TL folds it in).
    pub fn embedding_matrix(&self) -> Result<Vec<f32>> {
        let mut e: Vec<f32> = match &self.weights.embed {
            Embedding::Dense(t) => t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?,
            Embedding::Rows(m) => m.to_vec()?,
        };
        if let Some(g) = &self.dims.gemma {
            e.iter_mut().for_each(|v| *v *= g.embed_scale);
        }
        Ok(e)
    }

    /// The learned absolute position embeddings `[n_ctx, d_model]` (GPT-2), or None.
    pub fn position_embeddings(&self) -> Option<&[f32]> {
        self.weights.pos_embed.as_deref()
    }

    /// The output head `[vocab, d_model]` (TransformerLens's `W_U` transposed).
    pub fn unembed_matrix(&self) -> Result<Vec<f32>> {
        Ok(match &self.weights.lm_head {
            Head::Rows(m) => m.to_vec()?,
            Head::Dense(t) => t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?,
            Head::Quant(q) => match q {
                candle_core::quantized::QMatMul::QTensor(qt) => {
                    qt.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1()?
                }
                candle_core::quantized::QMatMul::Tensor(t)
                | candle_core::quantized::QMatMul::TensorF16(t) => {
                    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?
                }
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_two_orders_are_inverse_and_match_llama_cpps_permutation() {
        let (heads, hd, cols) = (3, 8, 5);
        let hf: Vec<f32> = (0..heads * hd * cols).map(|i| i as f32).collect();
        let gguf = crate::model::tiny::permute_for_gguf(&hf, heads, hd, cols);
        let mut back = gguf.clone();
        interleaved_to_half_split(&mut back, hd, cols);
        assert_eq!(back, hf);
        half_split_to_interleaved(&mut back, hd, cols);
        assert_eq!(back, gguf);
    }
}
