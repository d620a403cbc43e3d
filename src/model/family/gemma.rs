//! Gemma (v1, `GemmaForCausalLM`): (1 + w) RMSNorms before attention and MLP only (no
//! post-norms), embeddings scaled by √d_model, GeGLU(tanh), multi- or grouped-query attention
//! scaled by `head_dim^-½`, no soft-caps, no window (transformers' `modeling_gemma.py`).
//! From Hugging Face folders only.

use super::{Check, Family, Gemma, Hf, Want, Window, DECODER, HF_LLAMA};
use crate::model::block::MlpKind;
use crate::model::config::Arch;

pub static FAMILY: Family = Family {
    arch: Arch::Gemma,
    name: "gemma",
    hf_class: "GemmaForCausalLM",
    mlp: MlpKind::GeGluTanh,
    gemma: Some(Gemma {
        // a pattern of 1: every layer attends to every key
        pattern: 1,
        big_layers: 0,
        local_base: None,
        post_norms: false,
    }),
    gguf: None,
    hf: HF,
    ..DECODER
};

/// transformers' Gemma config: Llama's names, GeGLU with gelu_pytorch_tanh (its legacy `gelu`,
/// the first releases' value, is read as that: `GemmaConfig.__post_init__`), causal, no window.
const HF: Hf = Hf {
    window: Window::Refused,
    checks: &[
        Check {
            key: "hidden_act",
            want: Want::OneOf(&["gelu_pytorch_tanh", "gelu"]),
            why: "; attnscope's Gemma MLP is GeGLU with gelu_pytorch_tanh (transformers reads Gemma's legacy `gelu` as it)",
        },
        Check {
            key: "hidden_activation",
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
