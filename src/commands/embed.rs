//! `attnscope embed` (and Python's `embed`): sentence embeddings of an encoder, mean-pooled last
//! hidden states, L2-normalized as the model folder's `modules.json` says (or as asked).

pub use crate::model::forward::EmbedInput;
use crate::model::Model;
use serde::Serialize;
use std::time::Instant;

/// The texts and the normalization.
#[derive(Clone, Debug, Default)]
pub struct EmbedOptions {
    /// the texts (an encoder's sentence pairs where `pair` is given), one embedding each
    pub inputs: Vec<EmbedInput>,
    /// L2-normalize (`None`: as the model's `modules.json` says)
    pub normalize: Option<bool>,
}

/// The embeddings, row-major `[n_texts, d_model]`.
#[derive(Clone, Debug, Serialize)]
pub struct EmbedReport {
    /// the number of texts
    pub n_texts: usize,
    /// the width of an embedding
    pub d_model: usize,
    /// whether they are L2-normalized
    pub normalized: bool,
    /// the forwards' wall time
    pub seconds: f64,
    /// row-major `[n_texts, d_model]`
    pub embeddings: Vec<f32>,
}

/// The embeddings of `opts.inputs`; `tick()` after each text.
pub fn run(
    model: &Model,
    opts: &EmbedOptions,
    tick: &(dyn Fn() + Sync),
) -> anyhow::Result<EmbedReport> {
    let normalized = opts.normalize.unwrap_or_else(|| model.embeds_normalized());
    let start = Instant::now();
    let embeddings = model.embed_texts(&opts.inputs, opts.normalize, tick)?;
    Ok(EmbedReport {
        n_texts: opts.inputs.len(),
        d_model: model.dims.d_model,
        normalized,
        seconds: start.elapsed().as_secs_f64(),
        embeddings,
    })
}
