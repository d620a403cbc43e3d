//! BERT (an encoder): word + learned position + token-type embeddings and a LayerNorm,
//! bidirectional attention, post-LN blocks (LayerNorm after each residual add), GELU (erf),
//! biases everywhere, the pooler when present, no output head. Hugging Face folders only.

use super::{Check, Family, Hf, Want, Window, DECODER, HF_LLAMA};
use crate::model::block::{MlpKind, NormKind};
use crate::model::config::Arch;
use crate::model::weights::Logical;

pub static FAMILY: Family = Family {
    arch: Arch::Bert,
    name: "bert",
    hf_class: "BertModel",
    hf: Hf {
        name: hf_tensor,
        base_prefix: Some("bert."),
        checks: &checks!("bert"),
        ..ENCODER_HF
    },
    ..ENCODER
};

/// An encoder's blocks (BERT, RoBERTa, DistilBERT): the fields their files change.
pub(super) const ENCODER: Family = Family {
    encoder: true,
    norm: NormKind::Layer,
    mlp: MlpKind::GeluErf,
    learned_positions: true,
    token_types: true,
    gguf: None,
    ..DECODER
};

/// An encoder's Hugging Face layout: `layer_norm_eps`, no window.
pub(super) const ENCODER_HF: Hf = Hf {
    eps_key: "layer_norm_eps",
    window: Window::Refused,
    ..HF_LLAMA
};

/// What an encoder's config.json must say: the erf GELU, absolute positions, an encoder.
macro_rules! checks {
    ($name:literal) => {
        [
            Check {
                key: "hidden_act",
                want: Want::Str("gelu"),
                why: concat!("; attnscope's ", $name, " has hidden_act = gelu"),
            },
            Check {
                key: "position_embedding_type",
                want: Want::Str("absolute"),
                why: concat!(
                    "; attnscope's ",
                    $name,
                    " has position_embedding_type = absolute"
                ),
            },
            Check {
                key: "is_decoder",
                want: Want::Bool(false),
                why: "; attnscope runs BERT as an encoder (bidirectional, no cross-attention)",
            },
            Check {
                key: "add_cross_attention",
                want: Want::Bool(false),
                why: "; attnscope runs BERT as an encoder (bidirectional, no cross-attention)",
            },
        ]
    };
}
pub(super) use checks;

/// BERT's name for a logical weight (transformers' `BertModel`, as sentence-transformers saves
/// it: no `bert.` prefix). The attention's output LayerNorm is `AttnNorm` and the MLP's is
/// `MlpNorm`; both come after their residual add (post-LN).
pub(super) fn hf_tensor(l: &Logical) -> String {
    let layer = |i: &usize, s: &str| format!("encoder.layer.{i}.{s}");
    match l {
        Logical::Embed => "embeddings.word_embeddings.weight".into(),
        Logical::PosEmbed => "embeddings.position_embeddings.weight".into(),
        Logical::TypeEmbed => "embeddings.token_type_embeddings.weight".into(),
        Logical::EmbedNorm => "embeddings.LayerNorm.weight".into(),
        Logical::EmbedNormBias => "embeddings.LayerNorm.bias".into(),
        Logical::Pooler => "pooler.dense.weight".into(),
        Logical::PoolerBias => "pooler.dense.bias".into(),
        Logical::Q(i) => layer(i, "attention.self.query.weight"),
        Logical::QBias(i) => layer(i, "attention.self.query.bias"),
        Logical::K(i) => layer(i, "attention.self.key.weight"),
        Logical::KBias(i) => layer(i, "attention.self.key.bias"),
        Logical::V(i) => layer(i, "attention.self.value.weight"),
        Logical::VBias(i) => layer(i, "attention.self.value.bias"),
        Logical::O(i) => layer(i, "attention.output.dense.weight"),
        Logical::OBias(i) => layer(i, "attention.output.dense.bias"),
        Logical::AttnNorm(i) => layer(i, "attention.output.LayerNorm.weight"),
        Logical::AttnNormBias(i) => layer(i, "attention.output.LayerNorm.bias"),
        Logical::Up(i) => layer(i, "intermediate.dense.weight"),
        Logical::UpBias(i) => layer(i, "intermediate.dense.bias"),
        Logical::Down(i) => layer(i, "output.dense.weight"),
        Logical::DownBias(i) => layer(i, "output.dense.bias"),
        Logical::MlpNorm(i) => layer(i, "output.LayerNorm.weight"),
        Logical::MlpNormBias(i) => layer(i, "output.LayerNorm.bias"),
        other => format!("(BERT has no {other:?})"),
    }
}
