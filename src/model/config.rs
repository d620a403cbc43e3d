//! `ModelDims`: the shape of a model in one vocabulary. Hugging Face names
//! (`num_key_value_heads`) and GGUF keys (`qwen2.attention.head_count_kv`) are mapped into it
//! in `gguf.rs` and `hf.rs` only.

use serde::Serialize;

/// The architectures attnscope runs; each one's names, keys, tensor names and plan are in its
/// file under `src/model/family/`, registered in `family::FAMILIES` (which also holds `Arch`'s
/// methods: what each reads is its family's entry).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Qwen2 / Qwen2.5: q/k/v biases, RoPE half-split pairs.
    Qwen2,
    /// Llama / SmolLM2: no biases.
    Llama,
    /// Qwen3: RMSNorm on each head's query and key before RoPE, no biases.
    Qwen3,
    /// Mistral: Llama's blocks with sliding-window attention.
    Mistral,
    /// Phi-3: fused q|k|v and gate|up projections, partial rotary.
    Phi3,
    /// Seed-OSS: Llama's blocks with q/k/v biases (no o_proj or MLP biases).
    #[serde(rename = "seed_oss")]
    SeedOss,
    /// Gemma (v1): (1 + w) RMSNorms before attention and MLP, embeddings scaled by √d_model,
    /// GeLU(tanh), no post-norms, soft-caps or windows.
    Gemma,
    /// Gemma 2: (1 + w) RMSNorms before and after attention and MLP, embeddings scaled by
    /// √d_model, GeLU(tanh), `query_pre_attn_scalar`, attention and final-logit soft-capping,
    /// sliding windows on some layers.
    Gemma2,
    /// Gemma 3: Gemma 2's blocks without soft-capping, q/k (1 + w) RMSNorm, a rope base for
    /// sliding layers and one for full layers.
    Gemma3,
    /// GPT-2: learned absolute positions, LayerNorm with biases, biases everywhere, a GeLU MLP
    /// without gate, no RoPE.
    Gpt2,
    /// BERT (an encoder): word + learned position + token-type embeddings and a LayerNorm,
    /// bidirectional attention, post-LN blocks (LayerNorm after each residual add), GELU (erf),
    /// biases everywhere, no output head.
    Bert,
    /// RoBERTa (an encoder): BERT's blocks; positions counted from `padding_idx + 1` (a padding
    /// token sits at `padding_idx`), usually one token type, a byte-level BPE tokenizer with
    /// `<s>`/`</s>` (pairs as `<s> A </s></s> B </s>`).
    Roberta,
    /// DistilBERT (an encoder): BERT's blocks under its own tensor names, no token types, no
    /// pooler, LayerNorm epsilon 1e-12.
    DistilBert,
}

/// How RoPE pairs the dimensions of a head. The choice depends on the architecture AND the file
/// format, because llama.cpp's converter permutes llama-arch Q/K rows:
// NEOX (half-split): pairs (i, i + d/2) — Qwen2 in GGUF, and every Hugging Face checkpoint
//   (transformers' rotate_half).
// NORM (interleaved): pairs (2i, 2i + 1) — llama-arch GGUF (convert_hf_to_gguf.py permutes
//   q_proj/k_proj). See llama_model_rope_type() in llama.cpp for the authoritative mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeStyle {
    Neox,
    Interleaved,
}

/// How the RoPE frequencies are rescaled (Hugging Face's `rope_type`).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// `inv_freq[i] = base^(-2i/d)`.
    Default,
    /// Llama 3.x (transformers' `_compute_llama3_parameters`): wavelengths longer than
    /// `original_context / low_freq_factor` are slowed by `factor`, shorter than
    /// `original_context / high_freq_factor` kept, a smooth blend between.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_context: f32,
    },
}

impl RopeScaling {
    /// The inverse frequencies of a head of `head_dim`, in f32 as transformers computes them.
    pub fn inv_freq(&self, head_dim: usize, base: f32) -> Vec<f32> {
        let half = head_dim / 2;
        let plain = (0..half).map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32));
        match *self {
            RopeScaling::Default => plain.collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_context,
            } => plain
                .map(|f| {
                    let low_wavelen = original_context / low_freq_factor;
                    let high_wavelen = original_context / high_freq_factor;
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    let slowed = if wavelen > low_wavelen { f / factor } else { f };
                    // transformers: ~(wavelen < high) * ~(wavelen > low); wavelengths are finite
                    let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                    if medium {
                        let smooth = (original_context / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * slowed / factor + smooth * slowed
                    } else {
                        slowed
                    }
                })
                .collect(),
        }
    }
}

/// What Gemma 2 and 3 add to the shape.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GemmaSettings {
    /// The embeddings are multiplied by this (√d_model, as f32).
    pub embed_scale: f32,
    /// Scores are `q·k · query_scale` (`query_pre_attn_scalar^-½`), not `/√head_dim`.
    pub query_scale: f32,
    /// Scores become `cap · tanh(s / cap)` before the mask (Gemma 2).
    pub attn_softcap: Option<f32>,
    /// Logits become `cap · tanh(z / cap)` (Gemma 2).
    pub final_softcap: Option<f32>,
    /// Per layer: whether it attends through the sliding window.
    pub sliding_layers: Vec<bool>,
    /// RoPE base of the sliding layers (Gemma 3's local base; Gemma 2: the one base).
    pub rope_base_sliding: f32,
    /// The file's norm weights already hold Gemma's `1 + w` (llama.cpp's GGUF converter adds the
    /// one); Hugging Face checkpoints store `w`.
    pub norms_include_one: bool,
}

/// The numbers that define a model's shape.
#[derive(Clone, Debug, Serialize)]
pub struct ModelDims {
    /// the architecture family
    pub arch: Arch,
    /// the number of layers (blocks)
    pub n_layers: usize,
    /// the width of the residual stream
    pub d_model: usize,
    /// the number of query heads
    pub n_heads: usize,
    /// the number of key/value heads (fewer than `n_heads` with grouped-query attention)
    pub n_kv_heads: usize,
    /// the width of one head
    pub head_dim: usize,
    /// the width of the MLP's hidden layer
    pub d_ff: usize,
    /// the number of tokens in the vocabulary
    pub vocab_size: usize,
    /// the longest text the model takes, in tokens
    pub context_len: usize,
    /// RoPE's base frequency
    pub rope_base: f32,
    /// RoPE's scaling of long contexts
    pub rope_scaling: RopeScaling,
    /// Sliding-window attention (every layer): a query sees itself and the `window - 1` keys
    /// before it (transformers' rule); `None` = every earlier key.
    pub sliding_window: Option<usize>,
    /// how RoPE pairs the dimensions it rotates
    pub rope_style: RopeStyle,
    /// How many dimensions of each head RoPE rotates (the first ones; `head_dim` unless the
    /// config has a partial rotary factor, as Phi-3 does).
    pub rotary_dim: usize,
    /// Gemma 2 / 3 settings (`None` for every other family).
    pub gemma: Option<GemmaSettings>,
    /// the norms' epsilon
    pub rms_eps: f32,
    /// whether the output head shares the token embeddings' matrix
    pub tied_embeddings: bool,
    /// Token types (segment ids) of an encoder's inputs (BERT's `type_vocab_size`; 0: none).
    pub type_vocab: usize,
    /// RoBERTa's `padding_idx` (`pad_token_id`): positions count from `padding_idx + 1`, and a
    /// padding token sits at position `padding_idx`; the position table then has
    /// `context_len + padding_idx + 1` rows. `None` for every other family (positions from 0).
    pub position_pad: Option<usize>,
}

impl ModelDims {
    /// The first row of the learned position table a text's first token takes (RoBERTa:
    /// `padding_idx + 1`; 0 otherwise).
    pub fn position_offset(&self) -> usize {
        self.position_pad.map_or(0, |p| p + 1)
    }

    /// The sliding window of `layer`, if it has one.
    pub fn window_of(&self, layer: usize) -> Option<usize> {
        match &self.gemma {
            Some(g) if !g.sliding_layers.get(layer).copied().unwrap_or(false) => None,
            _ => self.sliding_window,
        }
    }
    /// The layers that attend through a sliding window (all of them for Mistral, some for Gemma).
    pub fn windowed_layers(&self) -> Vec<usize> {
        (0..self.n_layers)
            .filter(|&l| self.window_of(l).is_some())
            .collect()
    }
    /// The RoPE base of `layer`.
    pub fn rope_base_of(&self, layer: usize) -> f32 {
        match &self.gemma {
            Some(g) if g.sliding_layers.get(layer).copied().unwrap_or(false) => g.rope_base_sliding,
            _ => self.rope_base,
        }
    }
    /// Query heads per key/value set.
    pub fn group_size(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }
    /// Checks the numbers are consistent, naming the first that is not.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("n_layers", self.n_layers),
            ("d_model", self.d_model),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("d_ff", self.d_ff),
            ("vocab_size", self.vocab_size),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(format!("{name} is 0"));
            }
            if v > 1 << 24 {
                return Err(format!("{name} = {v} is absurdly large"));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(format!(
                "n_heads {} is not a multiple of n_kv_heads {}",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head_dim {} is odd; RoPE needs an even head dimension",
                self.head_dim
            ));
        }
        if self.rotary_dim == 0
            || self.rotary_dim > self.head_dim
            || !self.rotary_dim.is_multiple_of(2)
        {
            return Err(format!(
                "{} rotary dimensions of a head of {}: RoPE needs an even number, at most the head dimension",
                self.rotary_dim, self.head_dim
            ));
        }
        if self.sliding_window == Some(0) {
            return Err("sliding_window is 0; a query must see at least itself".into());
        }
        if !(self.rope_base.is_finite() && self.rope_base > 1.0) {
            return Err(format!("rope base {} is not a number > 1", self.rope_base));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return Err(format!(
                "rms eps {} is not a non-negative number",
                self.rms_eps
            ));
        }
        Ok(())
    }
    /// "7 query heads share each key/value set (grouped-query attention)".
    pub fn gqa_sentence(&self) -> String {
        let g = self.group_size();
        if self.n_kv_heads == self.n_heads {
            "every query head has its own key/value set (multi-head attention)".to_string()
        } else if self.n_kv_heads == 1 {
            format!(
                "all {} query heads share one key/value set (multi-query attention)",
                self.n_heads
            )
        } else {
            format!("{g} query heads share each key/value set (grouped-query attention)")
        }
    }
}
