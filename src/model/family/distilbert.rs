//! DistilBERT (an encoder): BERT's blocks under its own tensor names and config keys (`dim`,
//! `n_layers`, `n_heads`, `hidden_dim`, `activation`), no token types, no pooler, LayerNorm
//! epsilon 1e-12.

use super::bert::{checks, ENCODER, ENCODER_HF};
use super::{Check, Family, Hf, Want};
use crate::model::config::Arch;
use crate::model::weights::Logical;

pub static FAMILY: Family = Family {
    arch: Arch::DistilBert,
    name: "distilbert",
    hf_class: "DistilBertModel",
    token_types: false,
    hf: Hf {
        name: hf_tensor,
        config_keys: Some(config_keys),
        base_prefix: Some("distilbert."),
        checks: &checks!("distilbert"),
        ..ENCODER_HF
    },
    ..ENCODER
};

/// DistilBERT's config keys under BERT's names (its `config.json` says `dim`, `n_layers`...),
/// with its fixed LayerNorm epsilon (1e-12) and no token types.
fn config_keys(v: &mut serde_json::Value) {
    let Some(m) = v.as_object_mut() else { return };
    for (from, to) in [
        ("dim", "hidden_size"),
        ("n_layers", "num_hidden_layers"),
        ("n_heads", "num_attention_heads"),
        ("hidden_dim", "intermediate_size"),
        ("activation", "hidden_act"),
    ] {
        if let Some(x) = m.remove(from) {
            m.entry(to).or_insert(x);
        }
    }
    m.entry("layer_norm_eps").or_insert(1e-12.into());
    m.insert("type_vocab_size".into(), 0.into());
}

/// DistilBERT's name for a logical weight (`DistilBertModel`: `transformer.layer.N...`; the
/// attention's post-norm is `sa_layer_norm`, the MLP's `output_layer_norm`).
fn hf_tensor(l: &Logical) -> String {
    let layer = |i: &usize, s: &str| format!("transformer.layer.{i}.{s}");
    match l {
        Logical::Embed => "embeddings.word_embeddings.weight".into(),
        Logical::PosEmbed => "embeddings.position_embeddings.weight".into(),
        Logical::EmbedNorm => "embeddings.LayerNorm.weight".into(),
        Logical::EmbedNormBias => "embeddings.LayerNorm.bias".into(),
        Logical::Q(i) => layer(i, "attention.q_lin.weight"),
        Logical::QBias(i) => layer(i, "attention.q_lin.bias"),
        Logical::K(i) => layer(i, "attention.k_lin.weight"),
        Logical::KBias(i) => layer(i, "attention.k_lin.bias"),
        Logical::V(i) => layer(i, "attention.v_lin.weight"),
        Logical::VBias(i) => layer(i, "attention.v_lin.bias"),
        Logical::O(i) => layer(i, "attention.out_lin.weight"),
        Logical::OBias(i) => layer(i, "attention.out_lin.bias"),
        Logical::AttnNorm(i) => layer(i, "sa_layer_norm.weight"),
        Logical::AttnNormBias(i) => layer(i, "sa_layer_norm.bias"),
        Logical::Up(i) => layer(i, "ffn.lin1.weight"),
        Logical::UpBias(i) => layer(i, "ffn.lin1.bias"),
        Logical::Down(i) => layer(i, "ffn.lin2.weight"),
        Logical::DownBias(i) => layer(i, "ffn.lin2.bias"),
        Logical::MlpNorm(i) => layer(i, "output_layer_norm.weight"),
        Logical::MlpNormBias(i) => layer(i, "output_layer_norm.bias"),
        other => format!("(DistilBERT has no {other:?})"),
    }
}
