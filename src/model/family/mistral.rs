//! Mistral: Llama's blocks with a sliding window on every layer. Hugging Face folders only:
//! llama.cpp converts Mistral checkpoints as `llama` and drops the window.

use super::{Family, Hf, Window, DECODER, HF_LLAMA};
use crate::model::config::Arch;

pub static FAMILY: Family = Family {
    arch: Arch::Mistral,
    name: "mistral",
    hf_class: "MistralForCausalLM",
    gguf: None,
    hf: Hf {
        window: Window::Read,
        ..HF_LLAMA
    },
    ..DECODER
};
