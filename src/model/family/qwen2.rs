//! Qwen2 / Qwen2.5: Llama's blocks with q/k/v biases (applied where the file has them), RoPE in
//! half-split pairs in both formats; config.json's `sliding_window` is unused unless
//! `use_sliding_window` is true (refused: Qwen's per-layer windows).

use super::{Family, Hf, Window, DECODER, HF_LLAMA};
use crate::model::config::Arch;

pub static FAMILY: Family = Family {
    arch: Arch::Qwen2,
    name: "qwen2",
    hf_class: "Qwen2ForCausalLM",
    hf: Hf {
        window: Window::UnlessUsed,
        ..HF_LLAMA
    },
    ..DECODER
};
