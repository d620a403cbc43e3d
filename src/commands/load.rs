//! Loading a model for a command: the one place the CLI's commands load one (`Model::load_*`
//! behind it), and where the executable keeps what it loaded to the end of the process.

use crate::model::{Memory, Model, Precision};
use anyhow::Context;
use std::sync::{Arc, Mutex};

/// Which model to load and how.
#[derive(Clone, Debug)]
pub struct ModelSpec {
    /// an alias, a .gguf file, a Hugging Face folder or a hub id
    pub model: String,
    /// exact or fast
    pub precision: Precision,
    /// how the projections are held (`None`: chosen from the machine's memory)
    pub memory: Option<Memory>,
    /// leave out the BOS token the model's metadata asks for
    pub no_bos: bool,
    /// a progress bar for the load on standard error
    pub progress: bool,
}

/// The models commands loaded, kept to the end of the process and never dropped (statics are
/// not), once the executable's `main` asked for it ([`keep_models_to_exit`]); `None` for a
/// library user running commands in its own process, whose models are freed as usual.
static KEPT: Mutex<Option<Vec<Arc<Model>>>> = Mutex::new(None);

/// Keeps every model a command loads from now on to the end of the process: freeing a
/// vocabulary's maps one string at a time cost the lesson's `inspect` its last ~30 ms, and the
/// kernel takes the memory back at exit in one piece.
pub fn keep_models_to_exit() {
    if let Ok(mut kept) = KEPT.lock() {
        kept.get_or_insert_with(Vec::new);
    }
}

/// The model `spec` names, loaded (the error names it), its BOS left out where asked.
pub fn load(spec: &ModelSpec) -> anyhow::Result<Arc<Model>> {
    let mut m = Model::load_memory(&spec.model, spec.precision, spec.memory, spec.progress)
        .with_context(|| format!("loading model `{}`", spec.model))?;
    if spec.no_bos {
        m.tokenizer.set_add_bos(false)?;
    }
    let m = Arc::new(m);
    if let Ok(mut kept) = KEPT.lock() {
        if let Some(kept) = kept.as_mut() {
            kept.push(m.clone());
        }
    }
    Ok(m)
}
