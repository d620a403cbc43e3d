//! The weights' names in attnscope's own vocabulary ([`Logical`]): what the family files, the
//! readers (`gguf.rs`, `hf.rs`) and `weights/` all speak, below them all. Its methods (every
//! weight a model reads, each one's shape) are in `weights/`, which re-exports it.

/// A weight's name in attnscope's own vocabulary, mapped to each format's names in its loader.
#[derive(Clone, Debug)]
pub enum Logical {
    Embed,
    FinalNorm,
    LmHead,
    AttnNorm(usize),
    Q(usize),
    QBias(usize),
    K(usize),
    KBias(usize),
    V(usize),
    VBias(usize),
    O(usize),
    MlpNorm(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
    /// llama.cpp's per-frequency RoPE divisors (Llama 3.1+ GGUF files), `[head_dim / 2]`.
    RopeFreqs,
    /// Qwen3's RMSNorm weights of each head's query and key, `[head_dim]`.
    QNorm(usize),
    KNorm(usize),
    /// Gemma: the norms after attention and after the MLP.
    PostAttnNorm(usize),
    PostMlpNorm(usize),
    /// GPT-2: learned absolute positions `[context, d_model]`, and the biases it has everywhere.
    PosEmbed,
    FinalNormBias,
    AttnNormBias(usize),
    MlpNormBias(usize),
    OBias(usize),
    UpBias(usize),
    DownBias(usize),
    /// BERT: token-type (segment) embeddings `[type_vocab, d_model]`, the embeddings'
    /// LayerNorm, and the pooler (`tanh(W · h_[CLS] + b)`).
    TypeEmbed,
    EmbedNorm,
    EmbedNormBias,
    Pooler,
    PoolerBias,
}
