//! Llama (SmolLM2, Llama 2 and 3): RMSNorm, SwiGLU, RoPE, no biases. llama.cpp's converter
//! permutes q/k to interleaved RoPE pairs (`LLAMA_ROPE_TYPE_NORM`); Llama 3's rope scaling
//! comes from config.json or GGUF's `rope_freqs.weight`.

use super::{Family, Gguf, DECODER, GGUF_NEOX};
use crate::model::config::{Arch, RopeStyle};

pub static FAMILY: Family = Family {
    arch: Arch::Llama,
    name: "llama",
    hf_class: "LlamaForCausalLM",
    gguf: Some(Gguf {
        rope: RopeStyle::Interleaved,
        ..GGUF_NEOX
    }),
    ..DECODER
};
