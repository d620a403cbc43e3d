//! TransformerLens's weight processing, on the loaded model: what `HookedTransformer.from_pretrained`
//! (TL 3) and `TransformerBridge.enable_compatibility_mode()` (TL 4) do to the weights by default,
//! with TL's semantics per family (`ProcessWeights.process_weights` in TL's
//! `weight_processing.py`):
//!
//! - `fold_ln`: each norm's weight (LayerNorm: and bias) folded into the matrices that read its
//!   output (`ln1` into W_Q/W_K/W_V, `ln2` into W_in/W_gate, `ln_final` into W_U); LayerNorm's
//!   folded weights are also centred over `d_model`. The forward computes the same numbers
//!   either way (`(x̂·w)·W = x̂·(w·W)`), and `hook_normalized` is the normalized vector before the
//!   weight in both, so this changes only the weights the Python package reports.
//! - `center_writing_weights` (LayerNorm models only; TL skips it for RMSNorm, whose output
//!   depends on the mean): every matrix that writes into the residual stream centred, so the
//!   stream is mean-free. The forward then centres what each writer adds (`hook_embed`,
//!   `hook_pos_embed`, each head's `hook_result`, `hook_attn_out`, `hook_mlp_out`): what the
//!   centred weights give, without repacking them. The LayerNorms that read the stream remove
//!   its mean anyway, so the logits and the attention do not move.
//! - `center_unembed`: W_U centred over the vocabulary, so each position's logits lose their
//!   mean (log-probabilities unchanged). Skipped with a final soft-cap, as TL skips it (tanh is
//!   not shift-invariant).
//! - `fold_value_biases`: each head's value bias moved into the output bias
//!   (`b_O += Σ_h b_V[h] · W_O[h]`, `b_V = 0`): the attention's rows sum to 1, so the output
//!   does not move, but `hook_v`, `hook_z` and `hook_result` lose the bias's part. With a folded
//!   LayerNorm, `ln1`'s bias reaches V through W_V as a bias too (`b_ln · W_V`), and is moved
//!   with it.
//!
//! `refactor_factored_attn_matrices` is refused by the caller for these rotary models, as TL
//! refuses it. Encoders (post-LN) are not processed: TL's bridge does not fold a post-LN model.

use super::block::NormKind;
use super::error::{Error, Result};
use super::Model;
use serde::Serialize;

/// Which of TransformerLens's processing steps a model's weights went through.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Processing {
    pub fold_ln: bool,
    pub center_writing_weights: bool,
    pub center_unembed: bool,
    pub fold_value_biases: bool,
}

impl Processing {
    /// TransformerLens's defaults: every step (`from_pretrained`, `enable_compatibility_mode()`).
    pub const TRANSFORMER_LENS: Processing = Processing {
        fold_ln: true,
        center_writing_weights: true,
        center_unembed: true,
        fold_value_biases: true,
    };

    /// Whether any step applies.
    pub fn any(self) -> bool {
        self.fold_ln || self.center_writing_weights || self.center_unembed || self.fold_value_biases
    }
}

impl Model {
    /// The processing the weights went through ([`Model::process_weights`]).
    pub fn processing(&self) -> Processing {
        self.processing
    }

    /// Whether the stream's writers are centred (`center_writing_weights` on a LayerNorm model).
    pub(crate) fn centres_writers(&self) -> bool {
        self.processing.center_writing_weights
    }

    /// Whether each position's logits are centred over the vocabulary (`center_unembed`).
    pub(crate) fn centres_logits(&self) -> bool {
        self.processing.center_unembed
    }

    /// Applies TransformerLens's processing steps `asked` to the loaded weights, as TL does for
    /// this family, and returns the steps that apply: `center_writing_weights` only on a
    /// LayerNorm model, `center_unembed` only without a final soft-cap. Refused on an encoder
    /// (post-LN, which TL does not fold) and on a model already processed (TL skips a second
    /// pass, which would fold its factors again).
    pub fn process_weights(&mut self, asked: Processing) -> Result<Processing> {
        if !asked.any() {
            return Ok(self.processing);
        }
        if self.is_encoder() {
            return Err(Error::NotApplicable(format!(
                "{} is an encoder (post-LN): TransformerLens does not fold or centre its weights; load it unprocessed",
                self.info.name
            )));
        }
        if self.dims.gemma.is_some() || self.weights.final_norm_bias.is_some() {
            // Gemma's offset norms and post-norms, and GPT-2's LayerNorms (biases folded, writers
            // centred), are not yet checked against TransformerLens: refused, not guessed
            return Err(Error::NotApplicable(format!(
                "TransformerLens's weight processing of {} ({}) is not implemented yet (#59: Qwen2 and Llama/SmolLM2 are); load it with from_pretrained_no_processing",
                self.info.name,
                if self.dims.gemma.is_some() { "Gemma's norms" } else { "LayerNorm" }
            )));
        }
        if self.processing.any() {
            return Err(Error::NotApplicable(
                "the weights are already processed; load the model again to process them otherwise"
                    .into(),
            ));
        }
        let layer_norm = self.weights.final_norm_bias.is_some();
        let softcap = self.dims.gemma.as_ref().and_then(|g| g.final_softcap);
        let applied = Processing {
            fold_ln: asked.fold_ln,
            center_writing_weights: asked.center_writing_weights && layer_norm,
            center_unembed: asked.center_unembed && softcap.is_none(),
            fold_value_biases: asked.fold_value_biases,
        };
        if applied.fold_value_biases {
            for l in 0..self.dims.n_layers {
                self.fold_value_bias(l, applied.fold_ln)?;
            }
        }
        self.processing = applied;
        Ok(applied)
    }

    /// Layer `l`'s value bias (with `ln1`'s bias through W_V, where a folded LayerNorm puts it
    /// there) moved into the output projection's bias. V's own bias becomes what cancels the
    /// LayerNorm's part, so `hook_v` is `x̂·w·W_V`: TL's folded value with no bias.
    fn fold_value_bias(&mut self, l: usize, fold_ln: bool) -> Result<()> {
        let d = &self.dims;
        let (nh, nkv, hd) = (d.n_heads, d.n_kv_heads, d.head_dim);
        let v0 = (nh + nkv) * hd;
        let layer = &self.weights.layers[l];
        let raw: Vec<f32> = match layer.qkv.bias() {
            Some(b) => b[v0..v0 + nkv * hd].to_vec(),
            None => vec![0f32; nkv * hd],
        };
        // a LayerNorm's bias b reaches V as b · W_Vᵀ: a bias too, once the norm is folded
        let from_norm: Vec<f32> = match (&layer.norm_biases, fold_ln, layer.plan.norm) {
            (Some((b1, _)), true, NormKind::Layer) => {
                layer.qkv.forward_unbiased(b1, 1)[v0..v0 + nkv * hd].to_vec()
            }
            _ => vec![0f32; nkv * hd],
        };
        let moved: Vec<f32> = raw.iter().zip(&from_norm).map(|(a, b)| a + b).collect();
        if moved.iter().all(|&v| v == 0.0) {
            return Ok(());
        }
        // each query head reads its KV set's bias (GQA: kv_head = head / group)
        let group = nh / nkv;
        let per_head: Vec<f32> = (0..nh)
            .flat_map(|h| {
                moved[(h / group) * hd..(h / group + 1) * hd]
                    .iter()
                    .copied()
            })
            .collect();
        let delta = layer.o.forward_unbiased(&per_head, 1); // Σ_h b_V[h] · W_O[h]
        let width = (nh + 2 * nkv) * hd;
        let layer = &mut self.weights.layers[l];
        let mut qkv_bias = layer
            .qkv
            .bias()
            .map(<[f32]>::to_vec)
            .unwrap_or_else(|| vec![0f32; width]);
        for (b, f) in qkv_bias[v0..v0 + nkv * hd].iter_mut().zip(&from_norm) {
            *b = -f;
        }
        let keep = qkv_bias.iter().any(|&v| v != 0.0);
        layer.qkv.set_bias(keep.then_some(qkv_bias));
        let mut o_bias = layer
            .o
            .bias()
            .map(<[f32]>::to_vec)
            .unwrap_or_else(|| vec![0f32; d.d_model]);
        o_bias.iter_mut().zip(&delta).for_each(|(b, x)| *b += x);
        layer.o.set_bias(Some(o_bias));
        Ok(())
    }
}

/// Subtracts each row's mean (over its last axis of `width`), in f64: the centring of a writer's
/// output (`center_writing_weights`) and of the logits (`center_unembed`).
pub(crate) fn centre_rows(x: &mut [f32], width: usize) {
    for row in x.chunks_mut(width) {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / width as f64;
        row.iter_mut().for_each(|v| *v = (*v as f64 - mean) as f32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn centred_rows_sum_to_zero() {
        let mut x = vec![1.0f32, 2.0, 3.0, 10.0, -10.0, 6.0];
        centre_rows(&mut x, 3);
        assert_eq!(x, vec![-1.0, 0.0, 1.0, 8.0, -12.0, 4.0]);
    }
}
