//! Gemma 3: Gemma 2's blocks without soft-capping, a (1 + w) RMSNorm on each head's query and
//! key, a RoPE base for the sliding layers (GGUF: 10000; config.json: `rope_local_base_freq` or
//! the sliding set of `rope_parameters`) and one for the full layers, every 6th layer full.

use super::{Family, Gemma, DECODER};
use crate::model::block::MlpKind;
use crate::model::config::Arch;

pub static FAMILY: Family = Family {
    arch: Arch::Gemma3,
    name: "gemma3",
    hf_class: "Gemma3ForCausalLM",
    aliases: &["gemma3_text"],
    mlp: MlpKind::GeGluTanh,
    qk_norm: true,
    gemma: Some(Gemma {
        pattern: 6,
        big_layers: 62,
        local_base: Some(10000.0),
        post_norms: true,
    }),
    gguf: Some(super::gemma2::GGUF),
    hf: super::gemma2::HF,
    ..DECODER
};
