//! The model families attnscope runs, one file each, registered once in [`FAMILIES`].
//!
//! A family's file holds what is its own: its names (`general.architecture` in a GGUF file,
//! `model_type` in config.json), its config keys (the norm epsilon's, the settings its forward
//! reads or refuses), its tensor names in each format, its block plan (the norm, the MLP, the
//! positions) and its quirks. The loaders (`gguf.rs`, `hf.rs`, `weights/`), the block plan
//! (`block.rs`), `info`, the refusal of an unknown architecture (`error.rs`) and the docs' table
//! of families (checked by a test) all read this list; the forward stays one loop over the plan.
//!
//! Adding a family: a file here, its line in [`FAMILIES`] and its `Arch` variant
//! (`config.rs`); see `docs/ARCHITECTURE.md`, "Adding a family".

use super::block::{MlpKind, NormKind};
use super::config::{Arch, RopeStyle};
use super::error::Error;
use super::logical::Logical;
use std::path::PathBuf;

mod bert;
mod distilbert;
mod gemma;
mod gemma2;
mod gemma3;
mod gpt2;
mod llama;
mod mistral;
mod phi3;
mod qwen2;
mod qwen3;
mod roberta;
mod seed_oss;

/// Every family, in the order the refusal message and the docs name them.
pub static FAMILIES: [&Family; 13] = [
    &qwen2::FAMILY,
    &llama::FAMILY,
    &qwen3::FAMILY,
    &gemma2::FAMILY,
    &gemma3::FAMILY,
    &phi3::FAMILY,
    &gpt2::FAMILY,
    &seed_oss::FAMILY,
    &mistral::FAMILY,
    &gemma::FAMILY,
    &bert::FAMILY,
    &roberta::FAMILY,
    &distilbert::FAMILY,
];

/// One model family: what the loaders, the plan and the messages need to know about it.
#[derive(Debug)]
pub struct Family {
    pub arch: Arch,
    /// Its name in `general.architecture` (GGUF) and `model_type` (config.json); `info` prints it.
    pub name: &'static str,
    /// transformers' class for it (`architectures` in config.json: `Qwen2ForCausalLM`), which
    /// TransformerLens reports as `cfg.original_architecture`.
    pub hf_class: &'static str,
    /// Other `model_type`s read as this family (Gemma 3's `gemma3_text`).
    pub aliases: &'static [&'static str],
    /// An encoder: every token attends to every other (no causal mask), post-LN blocks, no
    /// next-token prediction.
    pub encoder: bool,
    /// How its blocks normalize (`ln1`, `ln2`, the final norm).
    pub norm: NormKind,
    /// Its MLP's activation (and whether it has a gate).
    pub mlp: MlpKind,
    /// Learned absolute positions added to the embeddings, LayerNorms with biases, biases on
    /// every projection (GPT-2, BERT); no RoPE.
    pub learned_positions: bool,
    /// A bias on the final norm (GPT-2's `ln_f`).
    pub final_norm_bias: bool,
    /// An RMSNorm on each head's query and key before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// Token-type embeddings (BERT's `type_vocab_size`; 2 when config.json leaves it out).
    pub token_types: bool,
    /// Gemma's conventions: (1 + w) norms, post-norms, scaled embeddings, GeLU(tanh),
    /// soft-caps, windows on some layers.
    pub gemma: Option<Gemma>,
    /// Its GGUF layout; `None`: read from Hugging Face folders only, refused in GGUF.
    pub gguf: Option<Gguf>,
    /// Its Hugging Face layout.
    pub hf: Hf,
}

/// What the Gemma families set apart.
#[derive(Debug)]
pub struct Gemma {
    /// Every `pattern`-th layer attends to every key when the file gives no pattern (Gemma 2:
    /// 2, alternating; Gemma 3: 6), as transformers and llama.cpp take them.
    pub pattern: usize,
    /// The 27B model's layer count: in GGUF, without `attention.scale`, it scales queries by
    /// `(d_model / heads)^-½` (llama.cpp's rule), the others by `head_dim^-½`.
    pub big_layers: usize,
    /// The sliding layers' own RoPE base (Gemma 3: GGUF's fixed 10000, config.json's
    /// `rope_local_base_freq` or the sliding set of `rope_parameters`); `None`: the one base.
    pub local_base: Option<f32>,
    /// An RMSNorm on the attention's and the MLP's outputs before each residual add (Gemma 2
    /// and 3; not Gemma 1).
    pub post_norms: bool,
}

/// A family's GGUF layout (llama.cpp's converter).
#[derive(Debug)]
pub struct Gguf {
    /// How the converter lays out q/k for RoPE: llama.cpp's `LLAMA_ROPE_TYPE_NEOX` keeps
    /// Hugging Face's layout, `NORM` (llama) permutes q/k to interleaved pairs.
    pub rope: RopeStyle,
    /// The norms' epsilon key, after `{arch}.`.
    pub eps_key: &'static str,
    /// Of the metadata keys refused by name, those this family's forward reads (after `{arch}.`).
    pub reads: &'static [&'static str],
    /// A tensor's name in the file.
    pub name: fn(&Logical) -> String,
    /// q|k|v in one `attn_qkv` tensor (Phi-3, GPT-2).
    pub fused_qkv: bool,
    /// gate|up in one `ffn_up` tensor (Phi-3).
    pub fused_gate_up: bool,
    /// The tensors a layer has at least (a block count beyond the file's tensors is refused).
    pub tensors_per_layer: usize,
    /// `rope.dimension_count` may rotate part of a head (Phi-3's partial rotary factor).
    pub partial_rotary: bool,
    /// A window of 0 means none (llama.cpp's Phi-3 converter writes 0 for `sliding_window: null`).
    pub window_zero_is_none: bool,
}

/// A family's Hugging Face layout (transformers' names).
#[derive(Debug)]
pub struct Hf {
    /// A tensor's name in the safetensors files (without an encoder's base-model prefix).
    pub name: fn(&Logical) -> String,
    /// The key its config.json writes the norms' epsilon under (named when it is missing).
    pub eps_key: &'static str,
    /// What `sliding_window` means for it.
    pub window: Window,
    /// Of the settings refused by name as other families', those its forward reads.
    pub reads: &'static [&'static str],
    /// What its config.json must say where it says anything (the activation and the like).
    pub checks: &'static [Check],
    /// Its config.json's keys renamed to the ones attnscope reads (DistilBERT's `dim`...).
    pub config_keys: Option<fn(&mut serde_json::Value)>,
    /// The MLP's width when config.json leaves it out, in multiples of the model's (GPT-2: 4).
    pub d_ff_default: Option<usize>,
    /// Positions count from `pad_token_id + 1` (RoBERTa).
    pub position_pad: bool,
    /// The prefix of its base model in a checkpoint saved with a task head (`bert.`).
    pub base_prefix: Option<&'static str>,
    /// GPT-2's Conv1D layout: a logical weight's tensor, the columns it takes of a fused one,
    /// and whether the stored matrix is transposed (`[in, out]`).
    pub conv1d: Option<fn(&super::hf_config::HfConfig, &Logical) -> Conv1dPart>,
}

/// A tensor of GPT-2's Conv1D layout: its name, the columns the part takes (of a fused
/// `c_attn`), and whether it is stored transposed.
pub type Conv1dPart = (String, Option<(usize, usize)>, bool);

/// What `sliding_window` in config.json means for a family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    /// A window (on every layer, or Gemma's sliding ones).
    Read,
    /// Unused unless `use_sliding_window` is true, which is refused (Qwen's per-layer windows).
    UnlessUsed,
    /// Refused: the family attends to every earlier token.
    Refused,
}

/// A config.json setting a family's forward implements one way: any other value is refused,
/// naming the key.
#[derive(Debug)]
pub struct Check {
    pub key: &'static str,
    pub want: Want,
    /// What attnscope implements, starting with "; " (or empty).
    pub why: &'static str,
}

/// The value a [`Check`] accepts.
#[derive(Clone, Copy, Debug)]
pub enum Want {
    /// This string.
    Str(&'static str),
    /// This boolean.
    Bool(bool),
    /// Anything but `true`.
    NotTrue,
    /// One of these strings.
    OneOf(&'static [&'static str]),
}

impl Want {
    /// Whether `v` is accepted.
    pub fn accepts(self, v: &serde_json::Value) -> bool {
        match self {
            Want::Str(s) => v.as_str() == Some(s),
            Want::Bool(b) => v.as_bool() == Some(b),
            Want::NotTrue => v.as_bool() != Some(true),
            Want::OneOf(s) => v.as_str().is_some_and(|v| s.contains(&v)),
        }
    }
}

/// The family of `arch`.
pub fn of(arch: Arch) -> &'static Family {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.arch == arch)
        .expect("every Arch is registered in FAMILIES")
}

/// The family a file names (`general.architecture` or `model_type`).
pub fn parse(name: &str) -> Option<&'static Family> {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.name == name || f.aliases.contains(&name))
}

/// What a family's entry says of it (here, so that `config.rs` below the registry needs none of
/// it).
impl Arch {
    /// This family's entry in the registry ([`FAMILIES`]).
    pub fn family(self) -> &'static Family {
        of(self)
    }
    /// The family's name, as `info` prints it.
    pub fn name(self) -> &'static str {
        self.family().name
    }
    /// Gemma's conventions: (1 + w) norms, post-norms, scaled embeddings, GeLU(tanh).
    pub fn is_gemma(self) -> bool {
        self.family().gemma.is_some()
    }
    /// An encoder: every token attends to every other (no causal mask), and there is no
    /// next-token prediction.
    pub fn is_encoder(self) -> bool {
        self.family().encoder
    }
    /// Learned absolute positions added to the embeddings, LayerNorms with biases, biases on
    /// every projection (GPT-2, BERT).
    pub fn learned_positions(self) -> bool {
        self.family().learned_positions
    }
    /// The family a file names (`general.architecture`, `model_type`), from the registry.
    pub fn parse(s: &str) -> Option<Arch> {
        parse(s).map(|f| f.arch)
    }
}

impl Error {
    /// The refusal of an architecture attnscope does not run, `arch` as the file names it,
    /// naming every family it runs ([`supported_sentence`]).
    pub fn unknown_arch(arch: String, path: PathBuf) -> Error {
        Error::UnknownArch {
            arch,
            path,
            supported: supported_sentence(),
        }
    }
}

/// "qwen2, llama, ..., and from Hugging Face folders mistral and the encoders bert, roberta and
/// distilbert": the families, as the refusal of an unknown architecture names them.
pub fn supported_sentence() -> String {
    let names = |keep: &dyn Fn(&Family) -> bool| -> Vec<&str> {
        FAMILIES
            .iter()
            .filter(|f| keep(f))
            .map(|f| f.name)
            .collect()
    };
    let both = names(&|f| f.gguf.is_some());
    let hf_only = names(&|f| f.gguf.is_none() && !f.encoder);
    let encoders = names(&|f| f.encoder);
    let and_list = |v: &[&str]| match v {
        [] => String::new(),
        [one] => one.to_string(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    };
    let mut s = both.join(", ");
    if !hf_only.is_empty() || !encoders.is_empty() {
        s.push_str(", and from Hugging Face folders ");
        let mut parts = Vec::new();
        if !hf_only.is_empty() {
            parts.push(and_list(&hf_only));
        }
        if !encoders.is_empty() {
            parts.push(format!("the encoders {}", and_list(&encoders)));
        }
        // "mistral and gemma, and the encoders ...": the comma keeps the two lists apart
        s.push_str(&parts.join(if hf_only.len() > 1 { ", and " } else { " and " }));
    }
    s
}

/// The checks of a decoder with a SwiGLU MLP (Llama, Qwen, Mistral, Phi-3).
pub(crate) const SILU: &[Check] = &[Check {
    key: "hidden_act",
    want: Want::Str("silu"),
    why: "; attnscope's MLP is SwiGLU with silu",
}];

/// Hugging Face's name for a logical weight (transformers' Llama layout, which Qwen, Mistral
/// and Phi-3 share).
pub fn hf_name(l: &Logical) -> String {
    match l {
        Logical::Embed => "model.embed_tokens.weight".into(),
        Logical::FinalNorm => "model.norm.weight".into(),
        Logical::LmHead => "lm_head.weight".into(),
        Logical::AttnNorm(i) => format!("model.layers.{i}.input_layernorm.weight"),
        Logical::Q(i) => format!("model.layers.{i}.self_attn.q_proj.weight"),
        Logical::QBias(i) => format!("model.layers.{i}.self_attn.q_proj.bias"),
        Logical::K(i) => format!("model.layers.{i}.self_attn.k_proj.weight"),
        Logical::KBias(i) => format!("model.layers.{i}.self_attn.k_proj.bias"),
        Logical::V(i) => format!("model.layers.{i}.self_attn.v_proj.weight"),
        Logical::VBias(i) => format!("model.layers.{i}.self_attn.v_proj.bias"),
        Logical::O(i) => format!("model.layers.{i}.self_attn.o_proj.weight"),
        Logical::MlpNorm(i) => format!("model.layers.{i}.post_attention_layernorm.weight"),
        Logical::Gate(i) => format!("model.layers.{i}.mlp.gate_proj.weight"),
        Logical::Up(i) => format!("model.layers.{i}.mlp.up_proj.weight"),
        Logical::Down(i) => format!("model.layers.{i}.mlp.down_proj.weight"),
        // Hugging Face folders carry rope scaling in config.json, not as a tensor
        Logical::RopeFreqs => "(rope_freqs)".into(),
        Logical::PostAttnNorm(i) => format!("(no post-attention norm in layer {i})"),
        Logical::PosEmbed => "(no learned positions)".into(),
        Logical::FinalNormBias => "(no final norm bias)".into(),
        Logical::AttnNormBias(i) => format!("model.layers.{i}.input_layernorm.bias"),
        Logical::MlpNormBias(i) => format!("model.layers.{i}.post_attention_layernorm.bias"),
        Logical::OBias(i) => format!("model.layers.{i}.self_attn.o_proj.bias"),
        Logical::UpBias(i) => format!("model.layers.{i}.mlp.up_proj.bias"),
        Logical::DownBias(i) => format!("model.layers.{i}.mlp.down_proj.bias"),
        Logical::PostMlpNorm(i) => format!("(no post-MLP norm in layer {i})"),
        Logical::QNorm(i) => format!("model.layers.{i}.self_attn.q_norm.weight"),
        Logical::KNorm(i) => format!("model.layers.{i}.self_attn.k_norm.weight"),
        Logical::TypeEmbed
        | Logical::EmbedNorm
        | Logical::EmbedNormBias
        | Logical::Pooler
        | Logical::PoolerBias => format!("(only an encoder has {l:?})"),
    }
}

/// GGUF's name for a logical weight (llama.cpp's names, which every family shares but for its
/// fused tensors).
pub fn gguf_name(l: &Logical) -> String {
    match l {
        Logical::Embed => "token_embd.weight".into(),
        Logical::FinalNorm => "output_norm.weight".into(),
        Logical::LmHead => "output.weight".into(),
        Logical::AttnNorm(i) => format!("blk.{i}.attn_norm.weight"),
        Logical::Q(i) => format!("blk.{i}.attn_q.weight"),
        Logical::QBias(i) => format!("blk.{i}.attn_q.bias"),
        Logical::K(i) => format!("blk.{i}.attn_k.weight"),
        Logical::KBias(i) => format!("blk.{i}.attn_k.bias"),
        Logical::V(i) => format!("blk.{i}.attn_v.weight"),
        Logical::VBias(i) => format!("blk.{i}.attn_v.bias"),
        Logical::O(i) => format!("blk.{i}.attn_output.weight"),
        Logical::MlpNorm(i) => format!("blk.{i}.ffn_norm.weight"),
        Logical::Gate(i) => format!("blk.{i}.ffn_gate.weight"),
        Logical::Up(i) => format!("blk.{i}.ffn_up.weight"),
        Logical::Down(i) => format!("blk.{i}.ffn_down.weight"),
        Logical::RopeFreqs => "rope_freqs.weight".into(),
        Logical::PostAttnNorm(i) => format!("blk.{i}.post_attention_norm.weight"),
        Logical::PosEmbed => "position_embd.weight".into(),
        Logical::FinalNormBias => "output_norm.bias".into(),
        Logical::AttnNormBias(i) => format!("blk.{i}.attn_norm.bias"),
        Logical::MlpNormBias(i) => format!("blk.{i}.ffn_norm.bias"),
        Logical::OBias(i) => format!("blk.{i}.attn_output.bias"),
        Logical::UpBias(i) => format!("blk.{i}.ffn_up.bias"),
        Logical::DownBias(i) => format!("blk.{i}.ffn_down.bias"),
        Logical::PostMlpNorm(i) => format!("blk.{i}.post_ffw_norm.weight"),
        Logical::QNorm(i) => format!("blk.{i}.attn_q_norm.weight"),
        Logical::KNorm(i) => format!("blk.{i}.attn_k_norm.weight"),
        Logical::TypeEmbed
        | Logical::EmbedNorm
        | Logical::EmbedNormBias
        | Logical::Pooler
        | Logical::PoolerBias => format!("(only an encoder has {l:?})"),
    }
}

/// The GGUF layout most decoders share: llama.cpp's names, half-split RoPE pairs, an RMSNorm
/// epsilon, nothing fused.
pub(crate) const GGUF_NEOX: Gguf = Gguf {
    rope: RopeStyle::Neox,
    eps_key: "attention.layer_norm_rms_epsilon",
    reads: &[],
    name: gguf_name,
    fused_qkv: false,
    fused_gate_up: false,
    tensors_per_layer: 9,
    partial_rotary: false,
    window_zero_is_none: false,
};

/// The Hugging Face layout most decoders share: transformers' Llama names, an RMSNorm epsilon,
/// SwiGLU with silu, no window.
pub(crate) const HF_LLAMA: Hf = Hf {
    name: hf_name,
    eps_key: "rms_norm_eps",
    window: Window::Refused,
    reads: &[],
    checks: SILU,
    config_keys: None,
    d_ff_default: None,
    position_pad: false,
    base_prefix: None,
    conv1d: None,
};

/// A decoder with Llama's blocks (RMSNorm, SwiGLU, RoPE): the fields a family file changes.
pub(crate) const DECODER: Family = Family {
    arch: Arch::Llama,
    name: "llama",
    // no default: every family names its own (checked by a test below)
    hf_class: "",
    aliases: &[],
    encoder: false,
    norm: NormKind::Rms,
    mlp: MlpKind::SwiGlu,
    learned_positions: false,
    final_norm_bias: false,
    qk_norm: false,
    token_types: false,
    gemma: None,
    gguf: Some(GGUF_NEOX),
    hf: HF_LLAMA,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_arch_has_one_family_and_every_name_parses_back() {
        for f in FAMILIES {
            assert!(std::ptr::eq(of(f.arch), f), "{}", f.name);
            assert!(std::ptr::eq(parse(f.name).unwrap(), f), "{}", f.name);
            assert!(!f.hf_class.is_empty(), "{}: hf_class", f.name);
            for a in f.aliases {
                assert!(std::ptr::eq(parse(a).unwrap(), f), "{a}");
            }
        }
        let mut names: Vec<&str> = FAMILIES.iter().map(|f| f.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), FAMILIES.len());
    }

    #[test]
    fn the_refusal_names_the_families_as_before() {
        assert_eq!(
            supported_sentence(),
            "qwen2, llama, qwen3, gemma2, gemma3, phi3, gpt2, seed_oss, and from Hugging Face folders \
             mistral and gemma, and the encoders bert, roberta and distilbert"
        );
    }
}
