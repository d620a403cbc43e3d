//! Qwen3: an RMSNorm on each head's query and key before RoPE (`q_norm`, `k_norm`;
//! `attn_q_norm`/`attn_k_norm` in GGUF), no biases; the window as Qwen2's.

use super::{Family, Hf, Window, DECODER, HF_LLAMA};
use crate::model::config::Arch;

pub static FAMILY: Family = Family {
    arch: Arch::Qwen3,
    name: "qwen3",
    hf_class: "Qwen3ForCausalLM",
    qk_norm: true,
    hf: Hf {
        window: Window::UnlessUsed,
        ..HF_LLAMA
    },
    ..DECODER
};
