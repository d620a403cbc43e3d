//! A decoder block's plan: what each family does differently, resolved once when the model
//! loads, so the forward's loop reads one plan per layer instead of asking which family it
//! runs (TransformerLens's blocks: resid_pre → ln1 → attn → attn_out → resid_mid → ln2 → mlp →
//! mlp_out → resid_post).
//!
//! The weights that only some families have (q/k norms, post-norms, LayerNorm biases,
//! projection biases) stay where they are, on `weights::Layer` as `Option`s: a weight
//! that is there is applied. What is not a weight (the norm's kind, the positions, the window,
//! the score scale, the soft-cap, the MLP's activation) is the plan.

use super::config::ModelDims;
use serde::Serialize;

/// How a block normalizes (`ln1`, `ln2`, and the final norm).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum NormKind {
    /// `x / sqrt(mean(x²) + eps) · w` (Llama, Qwen, Gemma: Gemma's `1 + w` is in the weight).
    Rms,
    /// `(x − mean) / sqrt(var + eps) · w + b` (GPT-2).
    Layer,
}

/// How a block's attention learns positions.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum Positions {
    /// Rotary embeddings on the queries and keys, with this base (Gemma 3's sliding layers
    /// have their own).
    Rotary { base: f32 },
    /// None in the block: GPT-2's learned positions are added to the embeddings.
    Learned,
}

/// The MLP's activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum MlpKind {
    /// `down(silu(gate) · up)` [Shazeer 2020, eq. (5)].
    SwiGlu,
    /// `down(gelu_tanh(gate) · up)` (Gemma).
    GeGluTanh,
    /// `c_proj(gelu_tanh(c_fc(h)))`, no gate (GPT-2).
    GeluTanh,
    /// `down(gelu(up(h)))` with the erf GeLU, `½x(1 + erf(x/√2))` (computed to 1.1e-7 relative
    /// through an erfc Chebyshev fit), no gate (BERT).
    GeluErf,
}

impl MlpKind {
    /// Whether the MLP has a gate (its first projection is `[gate; up]`, 2·d_mlp wide).
    pub fn gated(self) -> bool {
        !matches!(self, MlpKind::GeluTanh | MlpKind::GeluErf)
    }
    /// transformers' name for its activation (`hidden_act`), as TransformerLens's `act_fn` gives
    /// it.
    pub fn act_name(self) -> &'static str {
        match self {
            MlpKind::SwiGlu => "silu",
            MlpKind::GeGluTanh => "gelu_pytorch_tanh",
            MlpKind::GeluTanh => "gelu_new",
            MlpKind::GeluErf => "gelu",
        }
    }
}

/// One decoder block's plan.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct LayerPlan {
    pub norm: NormKind,
    pub positions: Positions,
    /// The sliding window: a query sees itself and the `window − 1` keys before it.
    pub window: Option<usize>,
    /// Scores are `q·k · scale` with this scale (Gemma's `query_pre_attn_scalar^-½`); `None`:
    /// `1/√d_head`.
    pub score_scale: Option<f32>,
    /// Scores become `cap · tanh(s / cap)` before the mask (Gemma 2).
    pub softcap: Option<f32>,
    pub mlp: MlpKind,
    /// Whether a query sees only itself and the keys before it (every decoder); an encoder's
    /// queries see every key (bidirectional).
    pub causal: bool,
    /// Post-LN (BERT): each norm comes after its residual add (`x = LN(x + attn(x))`,
    /// `x = LN(x + mlp(x))`), not before the sublayer.
    pub post_norm: bool,
}

impl LayerPlan {
    /// Layer `layer`'s plan for a model of this shape.
    pub fn of(dims: &ModelDims, layer: usize) -> LayerPlan {
        let family = dims.arch.family();
        LayerPlan {
            norm: family.norm,
            positions: if family.learned_positions {
                Positions::Learned
            } else {
                Positions::Rotary {
                    base: dims.rope_base_of(layer),
                }
            },
            window: dims.window_of(layer),
            score_scale: dims.gemma.as_ref().map(|g| g.query_scale),
            softcap: dims.gemma.as_ref().and_then(|g| g.attn_softcap),
            mlp: family.mlp,
            causal: !family.encoder,
            post_norm: family.encoder,
        }
    }

    /// Every layer's plan.
    pub fn all(dims: &ModelDims) -> Vec<LayerPlan> {
        (0..dims.n_layers).map(|l| LayerPlan::of(dims, l)).collect()
    }

    /// The rotary base, if the block rotates.
    pub fn rope_base(&self) -> Option<f32> {
        match self.positions {
            Positions::Rotary { base } => Some(base),
            Positions::Learned => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::{Arch, GemmaSettings, RopeScaling, RopeStyle};

    fn dims(arch: Arch, gemma: Option<GemmaSettings>) -> ModelDims {
        ModelDims {
            arch,
            n_layers: 6,
            d_model: 32,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 8,
            d_ff: 64,
            vocab_size: 100,
            context_len: 128,
            rope_base: 1e6,
            rope_scaling: RopeScaling::Default,
            sliding_window: gemma.as_ref().map(|_| 16),
            rope_style: RopeStyle::Neox,
            rotary_dim: 8,
            gemma,
            rms_eps: 1e-6,
            tied_embeddings: true,
            type_vocab: 0,
            position_pad: None,
        }
    }

    #[test]
    fn plans_follow_the_family() {
        let llama = LayerPlan::of(&dims(Arch::Llama, None), 0);
        assert_eq!(llama.norm, NormKind::Rms);
        assert_eq!(llama.mlp, MlpKind::SwiGlu);
        assert_eq!(llama.rope_base(), Some(1e6));
        assert_eq!(
            (llama.score_scale, llama.softcap, llama.window),
            (None, None, None)
        );
        let gpt2 = LayerPlan::of(&dims(Arch::Gpt2, None), 0);
        assert_eq!(gpt2.norm, NormKind::Layer);
        assert_eq!(gpt2.positions, Positions::Learned);
        assert!(!gpt2.mlp.gated() && llama.mlp.gated());
        assert!(llama.causal && gpt2.causal && !llama.post_norm);
        let bert = LayerPlan::of(&dims(Arch::Bert, None), 0);
        assert_eq!(
            (bert.norm, bert.positions, bert.mlp),
            (NormKind::Layer, Positions::Learned, MlpKind::GeluErf)
        );
        assert!(!bert.causal && bert.post_norm && !bert.mlp.gated());
        let sliding: Vec<bool> = (0..6).map(|l| (l + 1) % 6 != 0).collect();
        let gemma = dims(
            Arch::Gemma3,
            Some(GemmaSettings {
                embed_scale: 32f32.sqrt(),
                query_scale: 0.25,
                attn_softcap: None,
                final_softcap: None,
                sliding_layers: sliding.clone(),
                rope_base_sliding: 1e4,
                norms_include_one: true,
            }),
        );
        let plans = LayerPlan::all(&gemma);
        for (l, p) in plans.iter().enumerate() {
            assert_eq!(p.mlp, MlpKind::GeGluTanh);
            assert_eq!(p.score_scale, Some(0.25));
            // five sliding layers of base 1e4, then a full one of 1e6
            assert_eq!(p.window, sliding[l].then_some(16), "layer {l}");
            assert_eq!(
                p.rope_base(),
                Some(if sliding[l] { 1e4 } else { 1e6 }),
                "layer {l}"
            );
        }
    }
}
