//! GPT-2: learned absolute positions, LayerNorms with biases, biases everywhere, a GeLU(tanh)
//! MLP without gate, no RoPE. Hugging Face's Conv1D stores weights as `[in, out]` and q|k|v in
//! one `c_attn`; GGUF's converter fuses q|k|v into `attn_qkv`.

use super::{gguf_name, Check, Conv1dPart, Family, Gguf, Hf, Want, Window, DECODER, GGUF_NEOX};
use crate::model::block::{MlpKind, NormKind};
use crate::model::config::Arch;
use crate::model::hf::HfConfig;
use crate::model::weights::Logical;

pub static FAMILY: Family = Family {
    arch: Arch::Gpt2,
    name: "gpt2",
    hf_class: "GPT2LMHeadModel",
    norm: NormKind::Layer,
    mlp: MlpKind::GeluTanh,
    learned_positions: true,
    final_norm_bias: true,
    gguf: Some(Gguf {
        eps_key: "attention.layer_norm_epsilon",
        name: gguf_tensor,
        fused_qkv: true,
        ..GGUF_NEOX
    }),
    hf: Hf {
        name: hf_tensor,
        eps_key: "layer_norm_epsilon",
        window: Window::Refused,
        reads: &[],
        checks: &[
            Check {
                key: "activation_function",
                want: Want::Str("gelu_new"),
                why: "; attnscope's GPT-2 MLP uses gelu_new",
            },
            Check {
                key: "scale_attn_by_inverse_layer_idx",
                want: Want::Bool(false),
                why: "",
            },
            Check {
                key: "scale_attn_weights",
                want: Want::Bool(true),
                why: "",
            },
            Check {
                key: "add_cross_attention",
                want: Want::Bool(false),
                why: "",
            },
        ],
        config_keys: None,
        d_ff_default: Some(4),
        position_pad: false,
        base_prefix: None,
        conv1d: Some(part),
    },
    ..DECODER
};

/// GGUF's name: q|k|v (and their biases) in one `attn_qkv`.
fn gguf_tensor(l: &Logical) -> String {
    match l {
        Logical::Q(i) | Logical::K(i) | Logical::V(i) => format!("blk.{i}.attn_qkv.weight"),
        Logical::QBias(i) | Logical::KBias(i) | Logical::VBias(i) => {
            format!("blk.{i}.attn_qkv.bias")
        }
        _ => gguf_name(l),
    }
}

/// A config for naming GPT-2's tensors (names do not depend on the sizes).
static NAMES: std::sync::LazyLock<HfConfig> = std::sync::LazyLock::new(|| {
    serde_json::from_value(serde_json::json!({
        "n_embd": 1, "n_layer": 1, "n_head": 1, "vocab_size": 1, "layer_norm_epsilon": 1e-5
    }))
    .expect("a minimal GPT-2 config")
});

/// Hugging Face's name (the config is not needed for the name).
fn hf_tensor(l: &Logical) -> String {
    match l {
        Logical::Embed | Logical::LmHead => "transformer.wte.weight".into(),
        _ => part(&NAMES, l).0,
    }
}

/// GPT-2's tensor for a logical weight: its name, the columns the part takes and whether the
/// stored matrix is transposed (Conv1D keeps weights as `[in, out]`).
fn part(c: &HfConfig, l: &Logical) -> Conv1dPart {
    let d = c.hidden_size;
    let h = |i: &usize, s: &str| format!("transformer.h.{i}.{s}");
    match l {
        Logical::Embed | Logical::LmHead => ("transformer.wte.weight".into(), None, false),
        Logical::PosEmbed => ("transformer.wpe.weight".into(), None, false),
        Logical::FinalNorm => ("transformer.ln_f.weight".into(), None, false),
        Logical::FinalNormBias => ("transformer.ln_f.bias".into(), None, false),
        Logical::AttnNorm(i) => (h(i, "ln_1.weight"), None, false),
        Logical::AttnNormBias(i) => (h(i, "ln_1.bias"), None, false),
        Logical::MlpNorm(i) => (h(i, "ln_2.weight"), None, false),
        Logical::MlpNormBias(i) => (h(i, "ln_2.bias"), None, false),
        Logical::Q(i) => (h(i, "attn.c_attn.weight"), Some((0, d)), true),
        Logical::K(i) => (h(i, "attn.c_attn.weight"), Some((d, d)), true),
        Logical::V(i) => (h(i, "attn.c_attn.weight"), Some((2 * d, d)), true),
        Logical::QBias(i) => (h(i, "attn.c_attn.bias"), Some((0, d)), false),
        Logical::KBias(i) => (h(i, "attn.c_attn.bias"), Some((d, d)), false),
        Logical::VBias(i) => (h(i, "attn.c_attn.bias"), Some((2 * d, d)), false),
        Logical::O(i) => (h(i, "attn.c_proj.weight"), None, true),
        Logical::OBias(i) => (h(i, "attn.c_proj.bias"), None, false),
        Logical::Up(i) => (h(i, "mlp.c_fc.weight"), None, true),
        Logical::UpBias(i) => (h(i, "mlp.c_fc.bias"), None, false),
        Logical::Down(i) => (h(i, "mlp.c_proj.weight"), None, true),
        Logical::DownBias(i) => (h(i, "mlp.c_proj.bias"), None, false),
        other => (format!("(GPT-2 has no {other:?})"), None, false),
    }
}
