//! Gemma 2: (1 + w) RMSNorms before and after attention and MLP, embeddings scaled by
//! √d_model, GeGLU(tanh), `query_pre_attn_scalar`, attention and final-logit soft-capping,
//! sliding windows on alternate layers.

use super::{hf_name, Check, Family, Gemma, Gguf, Hf, Want, Window, DECODER, GGUF_NEOX, HF_LLAMA};
use crate::model::block::MlpKind;
use crate::model::config::Arch;
use crate::model::weights::Logical;

pub static FAMILY: Family = Family {
    arch: Arch::Gemma2,
    name: "gemma2",
    hf_class: "Gemma2ForCausalLM",
    mlp: MlpKind::GeGluTanh,
    gemma: Some(Gemma {
        pattern: 2,
        big_layers: 46,
        local_base: None,
        post_norms: true,
    }),
    gguf: Some(GGUF),
    hf: HF,
    ..DECODER
};

/// Gemma's GGUF layout: the window, the soft-caps and the query scale read.
pub(super) const GGUF: Gguf = Gguf {
    reads: &[
        "attention.sliding_window",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "attention.scale",
        "attention.sliding_window_pattern",
    ],
    ..GGUF_NEOX
};

/// Gemma's Hugging Face layout: its norms' names, GeGLU with gelu_pytorch_tanh, causal
/// attention, the soft-caps and the query scalar read.
pub(super) const HF: Hf = Hf {
    name: hf_tensor,
    window: Window::Read,
    reads: &[
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "query_pre_attn_scalar",
    ],
    checks: &[
        Check {
            key: "hidden_activation",
            want: Want::Str("gelu_pytorch_tanh"),
            why: "; attnscope's Gemma MLP is GeGLU with gelu_pytorch_tanh",
        },
        Check {
            key: "hidden_act",
            want: Want::Str("gelu_pytorch_tanh"),
            why: "; attnscope's Gemma MLP is GeGLU with gelu_pytorch_tanh",
        },
        Check {
            key: "use_bidirectional_attention",
            want: Want::NotTrue,
            why: "; attnscope runs causal attention",
        },
    ],
    ..HF_LLAMA
};

/// Hugging Face's name: Gemma's `post_attention_layernorm` follows the attention, its MLP's
/// norm is `pre_feedforward_layernorm`.
fn hf_tensor(l: &Logical) -> String {
    match l {
        Logical::MlpNorm(i) => format!("model.layers.{i}.pre_feedforward_layernorm.weight"),
        Logical::PostAttnNorm(i) => format!("model.layers.{i}.post_attention_layernorm.weight"),
        Logical::PostMlpNorm(i) => format!("model.layers.{i}.post_feedforward_layernorm.weight"),
        _ => hf_name(l),
    }
}
