//! `config.json` as attnscope reads it ([`HfConfig`]): below the family files (GPT-2's reads its
//! Conv1D layout from it) and `hf.rs` (the reader, which re-exports it and holds its methods).

use serde::Deserialize;

/// The fields of `config.json` attnscope reads (HF names).
#[derive(Debug, Deserialize)]
pub struct HfConfig {
    pub model_type: Option<String>,
    pub architectures: Option<Vec<String>>,
    #[serde(alias = "n_embd")]
    pub hidden_size: usize,
    #[serde(alias = "n_layer")]
    pub num_hidden_layers: usize,
    #[serde(alias = "n_head")]
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    /// GPT-2: `n_inner`, 4 · n_embd when null.
    #[serde(alias = "n_inner")]
    pub intermediate_size: Option<usize>,
    pub vocab_size: usize,
    #[serde(alias = "n_positions")]
    pub max_position_embeddings: Option<usize>,
    pub rope_theta: Option<f64>,
    /// The norms' epsilon under any family's name; `None` when config.json has none (an
    /// encoder's is transformers' default then, see `encoder_defaults`; others are refused,
    /// naming their family's key).
    #[serde(alias = "layer_norm_epsilon", alias = "layer_norm_eps")]
    pub rms_norm_eps: Option<f64>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<serde_json::Value>,
    /// One id or a list (the first is taken).
    pub eos_token_id: Option<serde_json::Value>,
    /// The hub's style: `{"rope_type": "llama3", "factor": 8, ...}` (older: `"type"`).
    pub rope_scaling: Option<serde_json::Value>,
    /// transformers 5's style: `{"rope_type": ..., "rope_theta": ..., ...}`.
    pub rope_parameters: Option<serde_json::Value>,
    /// Every other key, checked for settings that change the numbers.
    #[serde(flatten)]
    pub extra: std::collections::BTreeMap<String, serde_json::Value>,
}
