//! Seed-OSS (`SeedOssForCausalLM`, ByteDance-Seed/Seed-OSS-36B): Llama's blocks (RMSNorm, SwiGLU
//! with silu, RoPE in half-split pairs, grouped-query attention, an explicit `head_dim`) with
//! q/k/v biases (`attention_bias`, read where the file has them, as Qwen2's); transformers'
//! `modeling_seed_oss.py`. Its `attention_out_bias` (o_proj) and `mlp_bias` are false in the
//! released model and refused when true: the forward reads an output or MLP bias only for the
//! learned-position families. The dropouts (`attention_dropout`, `residual_dropout`) do nothing
//! at inference. GGUF as llama.cpp's converter writes it (`seed_oss`, NEOX RoPE, no q/k
//! permutation), where the MLP's norm is `post_attention_norm`.

use super::{gguf_name, Check, Family, Gguf, Hf, Want, DECODER, GGUF_NEOX, HF_LLAMA};
use crate::model::config::Arch;
use crate::model::weights::Logical;

pub static FAMILY: Family = Family {
    arch: Arch::SeedOss,
    name: "seed_oss",
    hf_class: "SeedOssForCausalLM",
    gguf: Some(Gguf {
        name: gguf_tensor,
        ..GGUF_NEOX
    }),
    hf: Hf {
        checks: &[
            Check {
                key: "hidden_act",
                want: Want::Str("silu"),
                why: "; attnscope's MLP is SwiGLU with silu",
            },
            Check {
                key: "attention_out_bias",
                want: Want::NotTrue,
                why: "; attnscope's Seed-OSS has no o_proj bias (Seed-OSS-36B sets it false)",
            },
            Check {
                key: "mlp_bias",
                want: Want::NotTrue,
                why: "; attnscope's Seed-OSS MLP has no biases (Seed-OSS-36B sets it false)",
            },
        ],
        ..HF_LLAMA
    },
    ..DECODER
};

/// GGUF's name: llama.cpp maps Hugging Face's `post_attention_layernorm` (the MLP's norm) to
/// `post_attention_norm` for Seed-OSS (gguf-py's `MODEL_TENSORS[SEED_OSS]` has no `ffn_norm`).
fn gguf_tensor(l: &Logical) -> String {
    match l {
        Logical::MlpNorm(i) => format!("blk.{i}.post_attention_norm.weight"),
        _ => gguf_name(l),
    }
}
