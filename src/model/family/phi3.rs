//! Phi-3: q|k|v and gate|up fused (`qkv_proj`, `gate_up_proj`; GGUF's `attn_qkv` and a
//! double-height `ffn_up`), partial rotary (`partial_rotary_factor`, GGUF's
//! `rope.dimension_count`), a sliding window on every layer.

use super::{gguf_name, Family, Gguf, Hf, Window, DECODER, GGUF_NEOX, HF_LLAMA};
use crate::model::config::Arch;
use crate::model::weights::Logical;

pub static FAMILY: Family = Family {
    arch: Arch::Phi3,
    name: "phi3",
    hf_class: "Phi3ForCausalLM",
    gguf: Some(Gguf {
        reads: &["attention.sliding_window"],
        name: gguf_tensor,
        fused_qkv: true,
        fused_gate_up: true,
        // q|k|v and gate|up fused: 6 tensors a layer
        tensors_per_layer: 6,
        partial_rotary: true,
        window_zero_is_none: true,
        ..GGUF_NEOX
    }),
    hf: Hf {
        window: Window::Read,
        ..HF_LLAMA
    },
    ..DECODER
};

/// GGUF's name: q|k|v in one `attn_qkv`, gate|up in one `ffn_up`.
fn gguf_tensor(l: &Logical) -> String {
    match l {
        Logical::Q(i) | Logical::K(i) | Logical::V(i) => format!("blk.{i}.attn_qkv.weight"),
        Logical::Gate(i) => format!("blk.{i}.ffn_up.weight"),
        _ => gguf_name(l),
    }
}
