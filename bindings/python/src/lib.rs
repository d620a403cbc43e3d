//! `attnscope._native`: the Rust engine for Python. The Python package (`python/attnscope/`)
//! builds the TransformerLens-shaped API on these few calls:
//! - [`Model`]: load, tokenize, and `run` a forward that captures exactly the (layer, hook) pairs
//!   asked for, handing each tensor to numpy without a copy (the Rust buffer becomes the
//!   array's memory);
//! - the analyses as typed calls on [`Model`] (`inspect`, `faithfulness`, `ablate`, `patch`,
//!   `heads`, `sinks`, `compare`, `capture`, `corpus`, `attribute`, ...) and [`corpus_merge`]: the
//!   library's own functions, their reports handed to Python as objects ([`to_object`]), never
//!   through command-line arguments or JSON text;
//! - [`view_page`] / [`pattern_page`]: the HTML page of `attnscope view`.
//!
//! The GIL is released while the engine runs, Python's signal handlers are asked between layers
//! (so Ctrl-C interrupts a long forward), and no panic crosses into Python.

use attnscope::analysis::vocab::Target;
use attnscope::analysis::LESSON_SENTENCE;
use attnscope::model::capture::{hook_name, AttnCache, CaptureSpec, Hook, Observer, Queries};
use attnscope::model::forward::RunOptions;
use attnscope::model::{Error as ModelError, Precision};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::{
    PyFileExistsError, PyFileNotFoundError, PyFloatingPointError, PyKeyboardInterrupt, PyOSError,
    PyRuntimeError, PyValueError,
};
use pyo3::prelude::*;
use std::collections::BTreeSet;
use std::sync::Arc;

mod circuits;
mod patching;

/// The Python exception for an engine error, with the CLI's message.
fn to_py(e: anyhow::Error) -> PyErr {
    let msg = format!("{e:#}");
    for c in e.chain() {
        if let Some(m) = c.downcast_ref::<ModelError>() {
            return match m {
                ModelError::MissingModel { .. } => PyFileNotFoundError::new_err(msg),
                ModelError::Exists { .. } => PyFileExistsError::new_err(msg),
                ModelError::Io { .. } => PyOSError::new_err(msg),
                ModelError::Interrupted => PyKeyboardInterrupt::new_err(msg),
                ModelError::NonFinite { .. } => PyFloatingPointError::new_err(msg),
                m if m.is_bad_input() => PyValueError::new_err(msg),
                _ => PyRuntimeError::new_err(msg),
            };
        }
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::NotFound {
                return PyFileNotFoundError::new_err(msg);
            }
        }
    }
    if attnscope::analysis::request::is_bad_input(&e) {
        PyValueError::new_err(msg)
    } else {
        PyRuntimeError::new_err(msg)
    }
}

/// Runs `f` without the GIL; a panic inside becomes a RuntimeError, never a crash.
fn engine<R: Send>(py: Python<'_>, f: impl FnOnce() -> anyhow::Result<R> + Send) -> PyResult<R> {
    let r = py.detach(|| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    match r {
        Ok(r) => r.map_err(to_py),
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(PyRuntimeError::new_err(format!(
                "attnscope panicked: {what}; you likely have found a bug"
            )))
        }
    }
}

/// Python's pending signals (Ctrl-C), asked by the forward after every layer.
fn python_interrupted() -> bool {
    Python::attach(|py| py.check_signals().is_err())
}

/// An [`AttnCache`] that keeps only the exact (layer, hook) pairs asked for; and, with an
/// `editor`, hands the activations at `edit` to that Python callable, `editor(name, array)`,
/// whose returned array is what flows on (TransformerLens's editing hooks). An exception raised
/// there stops the forward and is raised again, as it was, once the engine is done.
struct Wanted {
    cache: AttnCache,
    pairs: BTreeSet<(usize, Hook)>,
    edit: BTreeSet<(usize, Hook)>,
    editor: Option<Py<PyAny>>,
    error: Option<PyErr>,
    /// TransformerLens's `stop_at_layer`: the forward ends before this block
    stop: Option<usize>,
}

impl Wanted {
    fn call(&self, layer: usize, hook: Hook, shape: &[usize], data: &mut [f32]) -> PyResult<()> {
        Python::attach(|py| {
            let arr = PyArray1::from_slice(py, data).reshape(shape.to_vec())?;
            let back = self
                .editor
                .as_ref()
                .expect("edits only with an editor")
                .call1(py, (hook_name(layer, hook), arr))?;
            let back = back.bind(py);
            let back = back.cast::<numpy::PyArrayDyn<f32>>().map_err(|_| {
                PyValueError::new_err(format!(
                    "the hook at {} must leave a float32 array",
                    hook_name(layer, hook)
                ))
            })?;
            let ro = back.readonly();
            let view = ro.as_array();
            if view.shape() != shape {
                return Err(PyValueError::new_err(format!(
                    "the hook at {} returned an array of shape {:?}; the activation is {:?}",
                    hook_name(layer, hook),
                    view.shape(),
                    shape
                )));
            }
            data.iter_mut().zip(view.iter()).for_each(|(d, &x)| *d = x);
            Ok(())
        })
    }
}

impl Observer for Wanted {
    fn wants(&self, layer: usize, hook: Hook) -> bool {
        self.pairs.contains(&(layer, hook))
    }
    attnscope::delegate_observer!(cache: tensor, attention_block);
    fn pattern_rows(
        &mut self,
        layer: usize,
        q_start: usize,
        rows: usize,
        n_heads: usize,
        k_len: usize,
    ) -> Option<attnscope::model::capture::PatternRows<'_>> {
        // the kernel writes the patterns asked for straight into the arrays handed to Python
        if !self.pairs.contains(&(layer, Hook::Pattern)) {
            return None;
        }
        self.cache
            .pattern_rows(layer, q_start, rows, n_heads, k_len)
    }
    fn stops_before(&self, layer: usize) -> bool {
        self.stop == Some(layer)
    }
    fn edits(&self, layer: usize, hook: Hook) -> bool {
        self.editor.is_some() && self.error.is_none() && self.edit.contains(&(layer, hook))
    }
    fn edit(
        &mut self,
        layer: usize,
        hook: Hook,
        shape: &[usize],
        data: &mut [f32],
    ) -> Result<(), String> {
        self.call(layer, hook, shape, data).map_err(|e| {
            let msg = format!("raised {e}");
            self.error = Some(e);
            msg
        })
    }
}

/// TransformerLens's processing steps named in `names`, refusing an unknown one.
fn processing_of(names: &[String]) -> PyResult<attnscope::model::processing::Processing> {
    let mut p = attnscope::model::processing::Processing::default();
    for n in names {
        match n.as_str() {
            "fold_ln" => p.fold_ln = true,
            "center_writing_weights" => p.center_writing_weights = true,
            "center_unembed" => p.center_unembed = true,
            "fold_value_biases" => p.fold_value_biases = true,
            o => {
                return Err(PyValueError::new_err(format!(
                    "unknown processing step `{o}`; use fold_ln, center_writing_weights, center_unembed, fold_value_biases"
                )))
            }
        }
    }
    Ok(p)
}

/// The rows `run(logits=...)` asks logits for: `all`, `last` or `none` of `n` positions.
fn logit_rows(logits: &str, n: usize) -> PyResult<Vec<usize>> {
    match logits {
        "all" => Ok((0..n).collect()),
        "last" => Ok(vec![n.saturating_sub(1)]),
        "none" => Ok(Vec::new()),
        o => Err(PyValueError::new_err(format!(
            "logits=`{o}` is not one of: all, last, None"
        ))),
    }
}

/// The capture that keeps every (layer, hook) of `pairs`, every head and query.
fn spec_of(pairs: &BTreeSet<(usize, Hook)>) -> CaptureSpec {
    let layers: BTreeSet<usize> = pairs.iter().map(|p| p.0).collect();
    let hooks: BTreeSet<Hook> = pairs.iter().map(|p| p.1).collect();
    CaptureSpec {
        hooks: hooks.into_iter().collect(),
        layers: Some(layers.into_iter().collect()),
        heads: None,
        queries: Queries::All,
    }
}

/// The forward's logit rows as one `[rows, vocab]` array, or None when none were asked for.
fn logits_array(py: Python<'_>, logits: Vec<Vec<f32>>) -> PyResult<Option<Bound<'_, PyAny>>> {
    let Some(vocab) = logits.first().map(Vec::len) else {
        return Ok(None);
    };
    let rows = logits.len();
    let flat: Vec<f32> = logits.into_iter().flatten().collect();
    Ok(Some(
        PyArray1::from_vec(py, flat)
            .reshape([rows, vocab])?
            .into_any(),
    ))
}

/// Each captured tensor as (hook name, array): the engine's buffer, reshaped, never copied.
fn cache_arrays(py: Python<'_>, cache: AttnCache) -> PyResult<Vec<(String, Bound<'_, PyAny>)>> {
    let mut arrays = Vec::with_capacity(cache.entries.len());
    for (_, c) in cache.entries {
        let arr = PyArray1::from_vec(py, c.data)
            .reshape(c.shape.clone())?
            .into_any();
        arrays.push((c.name, arr));
    }
    Ok(arrays)
}

/// The (layer, hook) pairs of `(layer, suffix)` items; negative layers count from the end.
fn hook_pairs(n_layers: usize, hooks: Vec<(i64, String)>) -> PyResult<BTreeSet<(usize, Hook)>> {
    let mut pairs = BTreeSet::new();
    for (l, h) in hooks {
        let layer = if l < 0 { l + n_layers as i64 } else { l };
        if layer < 0 || layer >= n_layers as i64 {
            return Err(PyValueError::new_err(format!(
                "layer {l} is out of range: the model has {n_layers} layers"
            )));
        }
        let hook = hook_by_suffix(&h).ok_or_else(|| {
            PyValueError::new_err(format!(
                "unknown hook `{h}`; known: {}",
                Hook::ALL
                    .iter()
                    .chain(&Hook::GLOBAL)
                    .map(|h| h.suffix())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
        // a hook outside the blocks is handed at its own layer (the embeddings at 0, the final
        // norm at the last)
        pairs.insert((hook.layer_of(layer as usize, n_layers), hook));
    }
    Ok(pairs)
}

fn hook_by_suffix(s: &str) -> Option<Hook> {
    Hook::GLOBAL
        .iter()
        .copied()
        .find(|h| h.suffix() == s)
        .or_else(|| {
            Hook::ALL
                .iter()
                .copied()
                .find(|h| h.suffix() == s || h.suffix().rsplit('.').next() == Some(s))
        })
}

/// A loaded model.
#[pyclass(frozen, module = "attnscope._native")]
struct Model {
    inner: Arc<attnscope::model::Model>,
    /// what it was loaded from (an alias, a path, a hub id): its name in `compare`'s labels
    spec: String,
}

#[pymethods]
impl Model {
    /// Loads an alias (fetched on first use), a .gguf file, a Hugging Face folder or a hub id.
    #[staticmethod]
    /// `add_bos`: `None` follows the model's metadata; `False` leaves its BOS out, `True` adds one.
    /// `memory`: `"low"` (the file's quantized blocks, mapped, a panel dequantized per product),
    /// `"fast"` (packed at load), or `None` (chosen from the model's size and the free memory).
    /// `process`: TransformerLens's weight processing steps to apply after loading (`fold_ln`,
    /// `center_writing_weights`, `center_unembed`, `fold_value_biases`); the ones that apply to
    /// the family are in `facts_json()["processing"]`.
    #[pyo3(signature = (spec, precision = "exact", add_bos = None, memory = None, process = Vec::new()))]
    fn load(
        py: Python<'_>,
        spec: &str,
        precision: &str,
        add_bos: Option<bool>,
        memory: Option<&str>,
        process: Vec<String>,
    ) -> PyResult<Model> {
        let steps = processing_of(&process)?;
        let precision = match precision {
            "exact" => Precision::Exact,
            "fast" => Precision::Fast,
            p => {
                return Err(PyValueError::new_err(format!(
                    "precision `{p}` is not one of: exact, fast"
                )))
            }
        };
        let memory = memory
            .map(|m| {
                m.parse::<attnscope::model::Memory>()
                    .map_err(|e| PyValueError::new_err(format!("memory={m:?}: {e}")))
            })
            .transpose()?;
        let spec = spec.to_string();
        let from = spec.clone();
        let mut model = engine(py, move || {
            Ok(attnscope::model::Model::load_memory(
                &from, precision, memory, false,
            )?)
        })?;
        if let Some(b) = add_bos {
            model
                .tokenizer
                .set_add_bos(b)
                .map_err(|e| PyValueError::new_err(format!("default_prepend_bos={b}: {e}")))?;
        }
        // the steps TL's processing has that a family lacks here: refused, named
        model
            .process_weights(steps)
            .map_err(|e| pyo3::exceptions::PyNotImplementedError::new_err(e.to_string()))?;
        Ok(Model {
            inner: Arc::new(model),
            spec,
        })
    }

    /// The model's facts as JSON (`attnscope info --json`'s `model` part).
    fn facts_json(&self) -> PyResult<String> {
        let facts = attnscope::analysis::vocab::ModelFacts::of(&self.inner);
        let mut v =
            serde_json::to_value(&facts).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        let d = &self.inner.dims;
        v["d_model"] = d.d_model.into();
        v["d_ff"] = d.d_ff.into();
        v["n_ctx"] = d.context_len.into();
        v["d_vocab"] = d.vocab_size.into();
        v["precision"] = self.inner.info.precision.name().into();
        v["adds_bos"] = self.inner.tokenizer.add_bos.into();
        v["pad_id"] = self.inner.tokenizer.pad_id.into();
        v["bos_id"] = self.inner.tokenizer.bos_id.into();
        v["is_encoder"] = self.inner.is_encoder().into();
        v["processing"] = serde_json::to_value(self.inner.processing())
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        v["eps"] = self.inner.dims.rms_eps.into();
        v["rope_base"] = self.inner.dims.rope_base.into();
        v["rotary_dim"] = self.inner.dims.rotary_dim.into();
        v["tied_embeddings"] = self.inner.dims.tied_embeddings.into();
        v["eos_id"] = self.inner.tokenizer.eos_id.into();
        Ok(v.to_string())
    }

    /// An encoder's sentence pair `[CLS] a [SEP] b [SEP]`: (token ids, token types 0 then 1), as
    /// transformers' tokenizer gives them. Refused on a decoder.
    fn encode_pair(&self, py: Python<'_>, a: &str, b: &str) -> PyResult<(Vec<u32>, Vec<u32>)> {
        let (m, a, b) = (self.inner.clone(), a.to_string(), b.to_string());
        engine(py, move || Ok(m.encode_pair(&a, &b)?))
    }

    /// Token ids of `text`, a BOS first as `bos` says: `None` when the model asks for one,
    /// `True` always, `False` never.
    #[pyo3(signature = (text, bos = None))]
    fn encode(&self, py: Python<'_>, text: &str, bos: Option<bool>) -> PyResult<Vec<u32>> {
        let (m, text) = (self.inner.clone(), text.to_string());
        engine(py, move || Ok(m.encode_with(&text, bos)?))
    }

    /// Generates from `text` (a chat message through the model's template when `chat`, with
    /// `system` first if given; else a raw text) or from token `ids`, on a KV cache. Returns
    /// (prompt ids, generated ids, the whole generation as JSON: per token its log-probability,
    /// sink profile, top keys and concentrated heads).
    #[pyo3(signature = (text = None, ids = None, chat = false, system = None, max_new_tokens = 10,
                        temperature = 0.0, top_k = 0, top_p = 1.0, seed = 0))]
    #[allow(clippy::too_many_arguments)]
    fn generate(
        &self,
        py: Python<'_>,
        text: Option<String>,
        ids: Option<Vec<u32>>,
        chat: bool,
        system: Option<String>,
        max_new_tokens: usize,
        temperature: f32,
        top_k: usize,
        top_p: f32,
        seed: u64,
    ) -> PyResult<(Vec<u32>, Vec<u32>, String)> {
        if let Some(ids) = &ids {
            self.check_ids(ids)?;
        }
        let m = self.inner.clone();
        engine(py, move || {
            let prompt = match (text, ids) {
                (Some(t), None) if chat => m.chat_ids(&t, system.as_deref())?,
                (Some(t), None) => m.encode_with(&t, None)?,
                (None, Some(ids)) if !chat => ids,
                _ => {
                    return Err(anyhow::Error::new(ModelError::NotApplicable(
                        "generate: give a text, or token ids without chat=True".into(),
                    )))
                }
            };
            let o = attnscope::model::generate::GenOptions {
                max_new_tokens,
                temperature,
                top_k,
                top_p,
                seed,
                ..Default::default()
            };
            let g = attnscope::commands::generate::run(&m, &prompt, &o, |_| {})?;
            let gen = g.generated.iter().map(|t| t.id).collect();
            Ok((g.prompt_ids.clone(), gen, serde_json::to_string(&g)?))
        })
    }

    /// The text of each token (byte-level pieces decoded; split UTF-8 shown as <xx> bytes).
    fn token_texts(&self, ids: Vec<u32>) -> PyResult<Vec<String>> {
        self.check_ids(&ids)?;
        Ok(self.inner.token_texts(&ids))
    }

    /// The bytes of each token.
    fn token_bytes(&self, ids: Vec<u32>) -> PyResult<Vec<Vec<u8>>> {
        self.check_ids(&ids)?;
        Ok(ids
            .iter()
            .map(|&t| self.inner.tokenizer.token_bytes(t))
            .collect())
    }

    /// Runs `ids` and captures each (layer, hook suffix) in `hooks`, e.g. (0, "hook_pattern").
    /// `logits`: "all", "last" or "none". Returns (logits `[n or 1, vocab]` or None,
    /// [(hook name, array)]); every array is the engine's own buffer, reshaped, never copied.
    /// `edits` (with `editor`): the (layer, hook suffix) pairs whose activation is handed to
    /// `editor(name, array)` during the forward; the array it returns is what flows on.
    /// `stop_at_layer` (0..=n_layers): the forward ends before that block, once its
    /// `hook_resid_pre` is handed (`n_layers`: before the final norm); no logits then.
    /// `token_types`: an encoder's token types, one per id (a pair's 0/1); None: all 0.
    #[pyo3(signature = (ids, hooks, logits = "all", edits = Vec::new(), editor = None, stop_at_layer = None, token_types = None))]
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn run<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<u32>,
        hooks: Vec<(i64, String)>,
        logits: &str,
        edits: Vec<(i64, String)>,
        editor: Option<Py<PyAny>>,
        stop_at_layer: Option<usize>,
        token_types: Option<Vec<u32>>,
    ) -> PyResult<(Option<Bound<'py, PyAny>>, Vec<(String, Bound<'py, PyAny>)>)> {
        let d = &self.inner.dims;
        let n = ids.len();
        if let Some(s) = stop_at_layer.filter(|&s| s > d.n_layers) {
            return Err(PyValueError::new_err(format!(
                "stop_at_layer={s} is out of range: the model has {} layers",
                d.n_layers
            )));
        }
        let pairs = hook_pairs(d.n_layers, hooks)?;
        let edit = hook_pairs(d.n_layers, edits)?;
        let editor = match (editor, edit.is_empty()) {
            (Some(e), _) => Some(e),
            (None, true) => None,
            (None, false) => return Err(PyValueError::new_err("edits given without an editor")),
        };
        let logits_at = logit_rows(logits, n)?;
        if n == 0 {
            return Err(to_py(ModelError::EmptyText.into()));
        }
        let spec = spec_of(&pairs);
        let m = self.inner.clone();
        let (out, cache) = engine(py, move || {
            let mut obs = Wanted {
                cache: AttnCache::new(&spec, n),
                pairs,
                edit,
                editor,
                error: None,
                stop: stop_at_layer,
            };
            let opts = RunOptions {
                logits_at,
                token_types,
                ..Default::default()
            };
            let out = m.forward(&ids, &opts, &mut obs);
            // an exception in a hook is raised as it was
            match (out, obs.error) {
                (_, Some(e)) => Ok((Err(e), obs.cache)),
                (out, None) => Ok((Ok(out?), obs.cache)),
            }
        })?;
        let logits = logits_array(py, out?.logits)?;
        Ok((logits, cache_arrays(py, cache)?))
    }

    /// Each head's part of layer `layer`'s attention output from `z` (`[rows, n_heads, d_head]`,
    /// flattened): `([rows, n_heads, d_model]` flattened, W_O's bias `[d_model]`), TransformerLens's
    /// `hook_result` and `b_O`.
    fn head_results<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
        z: numpy::PyReadonlyArray1<'py, f32>,
        rows: usize,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let d = &self.inner.dims;
        if layer >= d.n_layers {
            return Err(PyValueError::new_err(format!(
                "layer {layer} is out of range: the model has {} layers",
                d.n_layers
            )));
        }
        let z = z.as_slice()?.to_vec();
        if z.len() != rows * d.n_heads * d.head_dim {
            return Err(PyValueError::new_err(format!(
                "z has {} values; {rows} rows of {} heads × {} need {}",
                z.len(),
                d.n_heads,
                d.head_dim,
                rows * d.n_heads * d.head_dim
            )));
        }
        let m = self.inner.clone();
        let (res, bias) = engine(py, move || Ok(m.head_results(layer, &z, rows)?))?;
        Ok((
            PyArray1::from_vec(py, res).into_any(),
            PyArray1::from_vec(py, bias).into_any(),
        ))
    }

    /// Layer `layer`'s projection `part` (`qkv`, `o`, `gate_up`, `down`) as f32 in Hugging Face's
    /// layout: (`W` `[out, in]`, bias `[out]` or None); Q and K rows in Hugging Face's order
    /// (llama GGUF's interleaving undone). The weights the forward multiplies by, dequantized.
    fn projection<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
        part: &str,
    ) -> PyResult<(Bound<'py, PyAny>, Option<Bound<'py, PyAny>>)> {
        let part: attnscope::model::tl_weights::Projection =
            part.parse().map_err(PyValueError::new_err)?;
        let m = self.inner.clone();
        let (w, b, rows, cols) = engine(py, move || Ok(m.projection_weights(layer, part)?))?;
        Ok((
            PyArray1::from_vec(py, w).reshape([rows, cols])?.into_any(),
            b.map(|b| PyArray1::from_vec(py, b).into_any()),
        ))
    }

    /// Layer `layer`'s norms as the forward applies them: (ln1 weight, ln1 bias or None, ln2
    /// weight, ln2 bias or None).
    #[allow(clippy::type_complexity)]
    fn layer_norms<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
    ) -> PyResult<(
        Bound<'py, PyAny>,
        Option<Bound<'py, PyAny>>,
        Bound<'py, PyAny>,
        Option<Bound<'py, PyAny>>,
    )> {
        let ((w1, b1), (w2, b2)) = self.inner.layer_norms(layer).map_err(|e| to_py(e.into()))?;
        let arr = |v: &[f32]| PyArray1::from_slice(py, v).into_any();
        Ok((arr(w1), b1.map(arr), arr(w2), b2.map(arr)))
    }

    /// Sentence embeddings `[len(texts), d_model]` of an encoder: each item a text or a pair
    /// `(a, b)` (`pair` None or the second text), mean-pooled last hidden state, L2-normalized as
    /// `normalize` says (None: when the folder's modules.json lists a Normalize module).
    #[pyo3(signature = (texts, pairs, normalize = None))]
    fn embed<'py>(
        &self,
        py: Python<'py>,
        texts: Vec<String>,
        pairs: Vec<Option<String>>,
        normalize: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if texts.len() != pairs.len() {
            return Err(PyValueError::new_err(format!(
                "{} texts but {} pair entries",
                texts.len(),
                pairs.len()
            )));
        }
        let m = self.inner.clone();
        let n = texts.len();
        let dm = m.dims.d_model;
        let inputs: Vec<attnscope::model::forward::EmbedInput> = texts
            .into_iter()
            .zip(pairs)
            .map(|(text, pair)| attnscope::model::forward::EmbedInput { text, pair })
            .collect();
        let opts = attnscope::commands::embed::EmbedOptions { inputs, normalize };
        let e = engine(py, move || {
            Ok(attnscope::commands::embed::run(&m, &opts, &|| {})?.embeddings)
        })?;
        Ok(PyArray1::from_vec(py, e).reshape([n, dm])?.into_any())
    }

    /// Whether the model folder's modules.json lists a Normalize module.
    fn embeds_normalized(&self) -> bool {
        self.inner.embeds_normalized()
    }

    /// The token embeddings `[vocab, d_model]` as the forward adds them (Gemma's √d_model in).
    fn embedding_matrix<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let m = self.inner.clone();
        let (v, dm) = (m.dims.vocab_size, m.dims.d_model);
        let e = engine(py, move || Ok(m.embedding_matrix()?))?;
        Ok(PyArray1::from_vec(py, e).reshape([v, dm])?.into_any())
    }

    /// The output head `[vocab, d_model]` (TransformerLens's `W_U` transposed).
    fn unembed_matrix<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let m = self.inner.clone();
        let (v, dm) = (m.dims.vocab_size, m.dims.d_model);
        let e = engine(py, move || Ok(m.unembed_matrix()?))?;
        Ok(PyArray1::from_vec(py, e).reshape([v, dm])?.into_any())
    }

    /// GPT-2's learned position embeddings `[n_ctx, d_model]`, or None.
    fn position_embeddings<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let dm = self.inner.dims.d_model;
        self.inner
            .position_embeddings()
            .map(|p| -> PyResult<_> {
                Ok(PyArray1::from_slice(py, p)
                    .reshape([p.len() / dm, dm])?
                    .into_any())
            })
            .transpose()
    }

    /// Rows `ids` of the output head (`W_U[:, ids]` transposed): `[len(ids), d_model]` flattened.
    fn unembed_rows<'py>(&self, py: Python<'py>, ids: Vec<u32>) -> PyResult<Bound<'py, PyAny>> {
        self.check_ids(&ids)?;
        let m = self.inner.clone();
        let rows = engine(py, move || {
            let mut out = Vec::new();
            for id in ids {
                out.extend(m.unembed_row(id)?);
            }
            Ok(out)
        })?;
        Ok(PyArray1::from_vec(py, rows).into_any())
    }

    /// The final norm: (weight, bias or None, epsilon).
    fn final_norm<'py>(
        &self,
        py: Python<'py>,
    ) -> (Bound<'py, PyAny>, Option<Bound<'py, PyAny>>, f32) {
        let (w, b, eps) = self.inner.final_norm();
        (
            PyArray1::from_slice(py, w).into_any(),
            b.map(|b| PyArray1::from_slice(py, b).into_any()),
            eps,
        )
    }

    /// The `corpus` records of `(id, text)` pairs: for each, (id, record JSON, "") or (id, "",
    /// the text's error: empty, too long). An engine failure raises.
    #[pyo3(signature = (items, bos = false, faithfulness = false))]
    fn corpus_records(
        &self,
        py: Python<'_>,
        items: Vec<(usize, String)>,
        bos: bool,
        faithfulness: bool,
    ) -> PyResult<Vec<(usize, String, String)>> {
        let m = self.inner.clone();
        engine(py, move || {
            // many texts to a forward: each record is its one-text run's
            let refs: Vec<(usize, &str)> = items.iter().map(|(i, t)| (*i, t.as_str())).collect();
            let recs =
                attnscope::commands::corpus::text_records(&m, &refs, bos, faithfulness, |_| {})?;
            let mut out = Vec::with_capacity(items.len());
            for ((id, _), rec) in items.iter().zip(recs) {
                match rec {
                    Ok(r) => out.push((*id, serde_json::to_string(&r)?, String::new())),
                    Err(e) => out.push((*id, String::new(), e)),
                }
            }
            Ok(out)
        })
    }

    /// Head-role scores of `(id, text)` pairs: for each, (id, scores JSON, "") or (id, "", the
    /// text's error). The scores are `attnscope heads --json`'s `tokens`, `roles`, `uniform`.
    #[pyo3(signature = (items, bos = false))]
    fn head_roles(
        &self,
        py: Python<'_>,
        items: Vec<(usize, String)>,
        bos: bool,
    ) -> PyResult<Vec<(usize, String, String)>> {
        let m = self.inner.clone();
        engine(py, move || {
            let mut out = Vec::with_capacity(items.len());
            for (id, text) in items {
                match m.encode(&text, bos) {
                    Ok(t) => out.push((
                        id,
                        serde_json::to_string(&roles_of_one(&m, t)?)?,
                        String::new(),
                    )),
                    Err(e) => out.push((id, String::new(), e.to_string())),
                }
            }
            Ok(out)
        })
    }

    /// `attnscope heads --each-line --json` from each text's scores (JSON of `head_roles`), in
    /// the order given: the mean over texts, each counting once.
    fn head_roles_document(&self, scores: Vec<String>) -> PyResult<String> {
        let all: Vec<attnscope::commands::heads::HeadRoles> = scores
            .iter()
            .map(|s| serde_json::from_str(s))
            .collect::<Result<_, _>>()
            .map_err(|e| PyValueError::new_err(format!("not a head-roles record: {e}")))?;
        if all.is_empty() {
            return Err(PyValueError::new_err("no scores to merge"));
        }
        let doc = attnscope::commands::heads::document(&self.inner, &all, serde_json::Map::new())
            .map_err(to_py)?;
        serde_json::to_string(&doc).map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// The page of `attnscope view` for `text`; `ablate` (`zero` or `mean`) adds the ablation
    /// panel, `target` (`next`, a token id or a token's text) the token it measures.
    #[pyo3(signature = (text, bos = false, faithfulness = false, ablate = None, target = None))]
    fn view_html(
        &self,
        py: Python<'_>,
        text: &str,
        bos: bool,
        faithfulness: bool,
        ablate: Option<String>,
        target: Option<String>,
    ) -> PyResult<String> {
        use attnscope::commands::view::{ablate_method, view_html_with, ViewOptions};
        let opts = ViewOptions {
            faithfulness,
            ablate: ablate
                .as_deref()
                .map(ablate_method)
                .transpose()
                .map_err(to_py)?,
            target: target
                .map(|t| {
                    t.parse::<attnscope::analysis::vocab::Target>()
                        .map_err(|e| PyValueError::new_err(format!("target {t:?}: {e}")))
                })
                .transpose()?,
            progress: false,
            token_types: None,
            segments: None,
        };
        let (m, text) = (self.inner.clone(), text.to_string());
        engine(py, move || Ok(view_html_with(&m, &text, bos, &opts)?.0))
    }

    /// The lesson's tables for one query (`attnscope inspect`) of `text`, or of the encoder pair
    /// (`text`, `pair`): the report as Python objects, with the forward's `timings`.
    #[pyo3(signature = (text, pair = None, query = None, layer = None, heads = "0-3".to_string(),
                        layers = None, top = None, concentrated = 0.9, bos = false))]
    #[allow(clippy::too_many_arguments)]
    fn inspect<'py>(
        &self,
        py: Python<'py>,
        text: &str,
        pair: Option<String>,
        query: Option<usize>,
        layer: Option<usize>,
        heads: String,
        layers: Option<String>,
        top: Option<usize>,
        concentrated: f32,
        bos: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let req = attnscope::commands::inspect::InspectOptions {
            query,
            layer,
            heads,
            layers,
            top,
            concentrated,
        };
        let (m, text) = (self.inner.clone(), text.to_string());
        let v = engine(py, move || {
            use attnscope::commands::inspect::{run, InspectInput};
            let input = match &pair {
                Some(b) => {
                    let (tokens, ty, seg) = m.encode_pair_segments(&text, b)?;
                    InspectInput {
                        tokens,
                        types: Some(ty),
                        segments: Some(seg),
                    }
                }
                None => InspectInput {
                    tokens: m.encode(&text, bos)?,
                    ..Default::default()
                },
            };
            Ok(run(&m, &input, &req)?.json(None)?)
        })?;
        to_object(py, &v)
    }

    /// Attention rankings against occlusion (`attnscope faithfulness`) of `text`, for `target`
    /// (`next`, a token id or one token's text; an encoder's `embedding` or `cls`), with
    /// `replace_with` (one token; default " ") as the replacement: the report as Python objects.
    #[pyo3(signature = (text, target = None, replace_with = None, bos = false))]
    fn faithfulness<'py>(
        &self,
        py: Python<'py>,
        text: &str,
        target: Option<String>,
        replace_with: Option<String>,
        bos: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        use attnscope::commands::faithfulness::{run, FaithOptions};
        let mut req = FaithOptions {
            target: parse_target(target, "target")?.unwrap_or(Target::Next),
            ..Default::default()
        };
        if let Some(r) = replace_with {
            req.replacement = r;
        }
        let (m, text) = (self.inner.clone(), text.to_string());
        let report = engine(py, move || {
            let tokens = m.encode(&text, bos)?;
            run(&m, &tokens, &req, &mut |_, _| {})
        })?;
        to_object(py, &report)
    }

    /// Two runs side by side (`attnscope compare`): `text` against `other_text` on this model,
    /// or `text` on this model against `other`. The report as Python objects, each side's
    /// `rows` a float32 array `[layers, heads, keys]`; `html` also writes the page (refusing
    /// an existing file unless `force`).
    #[pyo3(signature = (text, other_text = None, other = None, query = None, top = 10, html = None, force = false))]
    #[allow(clippy::too_many_arguments)]
    fn compare<'py>(
        &self,
        py: Python<'py>,
        text: String,
        other_text: Option<String>,
        other: Option<PyRef<'py, Model>>,
        query: Option<i64>,
        top: i64,
        html: Option<std::path::PathBuf>,
        force: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        use attnscope::commands::compare::{
            compare_sides, text_label, CompareOptions, Mode, SideInput,
        };
        let opts = CompareOptions {
            query: query.map(|q| count(q, "query")).transpose()?,
            top: match count(top, "top")? {
                0 => return Err(PyValueError::new_err("top=0: list at least 1 head")),
                t => t,
            },
            bos: false,
        };
        let (mode, (b, b_spec), other_text) =
            match (other_text, other) {
                (Some(t), None) => (Mode::Texts, (self.inner.clone(), self.spec.clone()), t),
                (None, Some(o)) => (
                    Mode::Models,
                    (o.inner.clone(), o.spec.clone()),
                    text.clone(),
                ),
                _ => return Err(PyValueError::new_err(
                    "give other_text (two texts on this model) or other (a second model), not both",
                )),
            };
        let sides = [
            (self.inner.clone(), self.spec.clone(), text),
            (b, b_spec, other_text),
        ];
        let report = engine(py, move || {
            // the page's path checked before the runs, written after them
            let output = html
                .as_deref()
                .map(|p| attnscope::render::Output::check(p, force, &[]))
                .transpose()?;
            let [a, b] = sides.each_ref().map(|(m, name, text)| SideInput {
                model: m,
                name,
                text,
                label: match mode {
                    Mode::Texts => text_label(text),
                    _ => format!("model {name}"),
                },
            });
            let report = compare_sides(mode, [a, b], &opts)?;
            if let Some(out) = output {
                out.write(attnscope::render::compare_page::page(&report).as_bytes())?;
            }
            Ok(report)
        })?;
        let dict = to_object(py, &report)?;
        for (k, side) in [("a", &report.a), ("b", &report.b)] {
            let (l, h) = (side.rows.len(), side.rows.first().map_or(0, Vec::len));
            let keys = side
                .rows
                .first()
                .and_then(|r| r.first())
                .map_or(0, Vec::len);
            let flat: Vec<f32> = side.rows.iter().flatten().flatten().copied().collect();
            let rows = PyArray1::from_vec(py, flat).reshape([l, h, keys])?;
            dict.get_item(k)?.set_item("rows", rows)?;
        }
        Ok(dict)
    }

    /// Streams the captured tensors of `text` to `path` (`.safetensors` or `.npz`; `attnscope
    /// capture`): `hooks`, `layers`, `heads` and `queries` as the CLI's flags take them;
    /// refuses an existing file unless `force`. Returns the line the command prints.
    #[pyo3(signature = (text, path, hooks = "pattern".to_string(), layers = "all".to_string(),
                        heads = "all".to_string(), queries = "all".to_string(), force = false))]
    #[allow(clippy::too_many_arguments)]
    fn capture(
        &self,
        py: Python<'_>,
        text: String,
        path: std::path::PathBuf,
        hooks: String,
        layers: String,
        heads: String,
        queries: String,
        force: bool,
    ) -> PyResult<String> {
        use attnscope::commands::capture::{capture, CaptureRequest};
        let req = CaptureRequest {
            hooks,
            layers,
            heads,
            queries,
            force,
            ..CaptureRequest::new(path)
        };
        let m = self.inner.clone();
        let report = engine(py, move || {
            req.check()?;
            let tokens = m.encode(&text, false)?;
            let plan = req.plan(&m, tokens.len())?;
            capture(&m, &tokens, None, &req, plan, &mut |_| {})
        })?;
        // the model was loaded before: no load time
        Ok(report.message(0.0, report.seconds).trim_end().to_string())
    }

    /// Sink statistics over many texts (`attnscope corpus`): `texts` (a list) or the texts of
    /// the file `path` (or of the built-in corpus), the first `limit`, shard `shard` (`i/n`),
    /// records appended to `out` (and resumed from it); the aggregate as Python objects. What
    /// the command says on standard error (a skipped text, a torn line dropped) goes there.
    #[pyo3(signature = (texts = None, path = None, limit = None, shard = None, out = None,
                        epsilon = 0.3, faithfulness = false, bos = false))]
    #[allow(clippy::too_many_arguments)]
    fn corpus<'py>(
        &self,
        py: Python<'py>,
        texts: Option<Vec<String>>,
        path: Option<std::path::PathBuf>,
        limit: Option<i64>,
        shard: Option<String>,
        out: Option<std::path::PathBuf>,
        epsilon: f32,
        faithfulness: bool,
        bos: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        use attnscope::commands::corpus::{
            load_texts, parse_shard, run, CorpusInput, CorpusRequest,
        };
        check_epsilon(epsilon)?;
        let req = CorpusRequest {
            limit: limit.map(|l| count(l, "limit")).transpose()?,
            shard: match &shard {
                Some(s) => parse_shard(s)
                    .map_err(|e| PyValueError::new_err(format!("shard={s:?}: {e:#}")))?,
                None => (0, 1),
            },
            out,
            faithfulness,
            epsilon,
            bos,
            inputs: path.iter().cloned().collect(),
        };
        if texts.as_ref().is_some_and(Vec::is_empty) {
            return Err(PyValueError::new_err(
                "texts: an empty list; give at least one text",
            ));
        }
        if texts.is_some() && path.is_some() {
            return Err(PyValueError::new_err("give texts or path, not both"));
        }
        let m = self.inner.clone();
        let outcome = engine(py, move || {
            let (texts, source) = match texts {
                Some(t) => (t, "the given texts".to_string()),
                None => load_texts(path.as_deref())?,
            };
            let note = &mut |n: &str| eprintln!("attnscope: {n}");
            run(
                &m,
                &CorpusInput { texts, source },
                &req,
                note,
                &mut |_, _| {},
            )
        })?;
        for s in &outcome.skipped {
            eprintln!("attnscope: skipped {s}");
        }
        epsilon_as_given(to_object(py, &outcome.aggregate)?, epsilon)
    }

    /// Every head (and with `mlp` each MLP) ablated in turn (`attnscope ablate`): the report as
    /// Python objects. `method` `zero` or `mean`; `target` `next`, a token id or one token's
    /// text; `positions` like `0,3-5` (default all).
    #[pyo3(signature = (text, method = "zero", target = None, positions = None, mlp = false, bos = false))]
    #[allow(clippy::too_many_arguments)]
    fn ablate<'py>(
        &self,
        py: Python<'py>,
        text: &str,
        method: &str,
        target: Option<String>,
        positions: Option<String>,
        mlp: bool,
        bos: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        use attnscope::analysis::intervene::DEFAULT_BATCH_ROWS;
        use attnscope::commands::ablate::{run, AblateOptions};
        let method = attnscope::commands::view::ablate_method(method).map_err(to_py)?;
        let target = parse_target(target, "target")?.unwrap_or(Target::Next);
        let (m, text) = (self.inner.clone(), text.to_string());
        let report = engine(py, move || {
            let tokens = m.encode(&text, bos)?;
            let positions = positions
                .as_deref()
                .map(|s| {
                    attnscope::analysis::request::parse_index_list(s, tokens.len(), "position")
                })
                .transpose()?;
            let opts = AblateOptions {
                method,
                target,
                positions,
                mlp,
                batch_rows: DEFAULT_BATCH_ROWS,
            };
            run(&m, &tokens, &opts, |_, _| {})
        })?;
        to_object(py, &report)
    }

    /// Activation patching from `clean` into `corrupt` (`attnscope patch`): the report as Python
    /// objects. `hook` one of resid-pre, attn-out, mlp-out, z, pattern; `answer`/`wrong` a token
    /// id or one token's text (default: each run's top next token).
    #[pyo3(signature = (clean, corrupt, hook = "resid-pre", answer = None, wrong = None, bos = false))]
    #[allow(clippy::too_many_arguments)]
    fn patch<'py>(
        &self,
        py: Python<'py>,
        clean: &str,
        corrupt: &str,
        hook: &str,
        answer: Option<String>,
        wrong: Option<String>,
        bos: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        use attnscope::analysis::intervene::DEFAULT_BATCH_ROWS;
        use attnscope::analysis::vocab::PatchHook;
        use attnscope::commands::patch::{run, PatchInput, PatchOptions};
        // TransformerLens's spellings too (resid_pre, hook_resid_pre, attn.hook_z, ...)
        let spelled = hook.replace('_', "-");
        let bare = spelled
            .trim_start_matches("attn.")
            .trim_start_matches("hook-");
        let hook = match bare {
            "resid-pre" => PatchHook::ResidPre,
            "attn-out" => PatchHook::AttnOut,
            "mlp-out" => PatchHook::MlpOut,
            "z" => PatchHook::Z,
            "pattern" | "attn" => PatchHook::Pattern,
            h => {
                return Err(PyValueError::new_err(format!(
                    "unknown hook {h:?}: valid values are resid-pre, attn-out, mlp-out, z, pattern"
                )))
            }
        };
        let (answer, wrong) = (
            parse_target(answer, "answer")?,
            parse_target(wrong, "wrong")?,
        );
        for (t, what) in [(&answer, "answer"), (&wrong, "wrong")] {
            if matches!(t, Some(Target::Next)) {
                return Err(PyValueError::new_err(format!(
                    "{what}=\"next\": give a token id or a token's text (the default, None, is already the run's top token)"
                )));
            }
        }
        for (text, what) in [(clean, "clean"), (corrupt, "corrupt")] {
            if text.trim().is_empty() {
                return Err(PyValueError::new_err(format!(
                    "{what} is empty (or only whitespace); give the {what} text"
                )));
            }
        }
        let opts = PatchOptions {
            hook,
            answer,
            wrong,
            batch_rows: DEFAULT_BATCH_ROWS,
        };
        let (m, clean, corrupt) = (self.inner.clone(), clean.to_string(), corrupt.to_string());
        let report = engine(py, move || {
            let input = PatchInput {
                clean: m.encode(&clean, bos)?,
                corrupt: m.encode(&corrupt, bos)?,
            };
            run(&m, &input, &opts, |_, _| {})
        })?;
        to_object(py, &report)
    }

    /// `attnscope circuit`: one pair (`clean`, `corrupt`, `answer`, `wrong`) or `pairs`, a JSONL
    /// text (`pairs_source` names it in errors). Returns (the report without `edges`, the scores
    /// as a float32 `[n_nodes, n_readers]` matrix with NaN where no edge is, and the ranked
    /// edges' node indices, reader indices and scores).
    #[pyo3(signature = (clean = None, corrupt = None, answer = None, wrong = None, pairs = None,
                        pairs_source = "pairs".to_string(), method = "eap".to_string(), steps = None,
                        metric = "logit-diff".to_string(), evaluate = false, exact_edges = 0, bos = false))]
    #[allow(clippy::too_many_arguments)]
    fn circuit<'py>(
        &self,
        py: Python<'py>,
        clean: Option<String>,
        corrupt: Option<String>,
        answer: Option<String>,
        wrong: Option<String>,
        pairs: Option<String>,
        pairs_source: String,
        method: String,
        steps: Option<usize>,
        metric: String,
        evaluate: bool,
        exact_edges: usize,
        bos: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let one = match (clean, corrupt, answer, wrong) {
            (Some(c), Some(k), Some(a), Some(w)) => Some([c, k, a, w]),
            (None, None, None, None) => None,
            _ => {
                return Err(PyValueError::new_err(
                    "give clean, corrupt, answer and wrong together (or pairs)",
                ))
            }
        };
        let args = circuits::CircuitArgs {
            one,
            pairs: pairs.map(|t| (t, pairs_source)),
            method,
            steps,
            metric,
            evaluate,
            exact_edges,
            bos,
        };
        circuits::run_circuit(py, &self.inner, args)
    }

    /// `attnscope qk`: head `layer`.`head`'s score of `query` and `key` on `text` split into
    /// (query-side × key-side) terms; without `key`, the attended key's lead over `against`
    /// (`second` or `mean`). The report as Python objects.
    #[pyo3(signature = (text, layer, head, query = None, key = None, against = "second", bos = false))]
    #[allow(clippy::too_many_arguments)]
    fn qk_attribution<'py>(
        &self,
        py: Python<'py>,
        text: String,
        layer: usize,
        head: usize,
        query: Option<usize>,
        key: Option<usize>,
        against: &str,
        bos: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let at = (layer, head);
        circuits::run_qk(py, &self.inner, text, at, (query, key), against, bos)
    }

    /// Head-role scores (`attnscope heads`) of `text` (with `pair`, an encoder's sentence pair
    /// `[CLS] text [SEP] pair [SEP]`), or of `random_repeat` random tokens repeated once (the
    /// induction test): the document as Python objects.
    #[pyo3(signature = (text = None, random_repeat = None, seed = 0, bos = false, pair = None))]
    fn heads<'py>(
        &self,
        py: Python<'py>,
        text: Option<String>,
        random_repeat: Option<usize>,
        seed: u64,
        bos: bool,
        pair: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        use attnscope::analysis::heads::random_repeat_tokens;
        use attnscope::commands::heads::{document, run, HeadsInput};
        let m = self.inner.clone();
        let doc = engine(py, move || {
            let mut extra = serde_json::Map::new();
            let (tokens, types) = match (random_repeat, text, pair) {
                (Some(nr), None, None) => {
                    extra.insert("random_repeat".into(), nr.into());
                    extra.insert("seed".into(), seed.into());
                    (random_repeat_tokens(&m, nr, seed, bos)?, None)
                }
                (None, text, Some(b)) => {
                    let (t, ty) = m.encode_pair(text.as_deref().unwrap_or(LESSON_SENTENCE), &b)?;
                    (t, Some(ty))
                }
                (None, text, None) => (
                    m.encode(text.as_deref().unwrap_or(LESSON_SENTENCE), bos)?,
                    None,
                ),
                (Some(_), _, _) => {
                    return Err(attnscope::analysis::request::usage(
                        "give a text (or a pair) or random_repeat, not both",
                    ))
                }
            };
            let texts = vec![tokens];
            document(&m, &run(&m, &HeadsInput { texts, types })?, extra)
        })?;
        to_object(py, &doc)
    }

    /// The streamed sink profile (`attnscope sinks`) of `text`, or of the built-in corpus up to
    /// `max_tokens`: the report as Python objects.
    #[pyo3(signature = (text = None, max_tokens = None, key_block = 1024, top = 5, bos = false, file = None))]
    #[allow(clippy::too_many_arguments)]
    fn sinks<'py>(
        &self,
        py: Python<'py>,
        text: Option<String>,
        max_tokens: Option<usize>,
        key_block: usize,
        top: usize,
        bos: bool,
        file: Option<std::path::PathBuf>,
    ) -> PyResult<Bound<'py, PyAny>> {
        use attnscope::commands::sinks::{run, SinksInput, SinksOptions};
        let opts = SinksOptions {
            key_block,
            top,
            bos,
            ..Default::default()
        };
        let m = self.inner.clone();
        let report = engine(py, move || {
            // a file is read as far as max_tokens tokens can reach, as `attnscope sinks --file`
            let input = SinksInput {
                file,
                text,
                max_tokens,
            };
            Ok(run(&m, &input, &opts, false)?.1)
        })?;
        to_object(py, &report)
    }

    /// A score per token of `ids` for the last position's prediction (`attnscope attribute`):
    /// `method` one of gradient, grad-x-input, integrated-gradients, attention-x-gradient,
    /// occlusion; `target` `next`, a token id or one token's text; `wrong` for a logit difference.
    /// Returns (the report as JSON, its scores as a float32 array).
    #[pyo3(signature = (ids, method, target = None, wrong = None, steps = 32))]
    fn attribute<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<u32>,
        method: &str,
        target: Option<String>,
        wrong: Option<String>,
        steps: usize,
    ) -> PyResult<(String, Bound<'py, PyAny>)> {
        use attnscope::analysis::vocab::Target;
        use attnscope::commands::attribute::{run, AttributeOptions};
        self.check_ids(&ids)?;
        let method = method.parse().map_err(PyValueError::new_err)?;
        let parse = |t: Option<String>| -> PyResult<Option<Target>> {
            t.map(|t| t.parse::<Target>().map_err(PyValueError::new_err))
                .transpose()
        };
        let opts = AttributeOptions {
            method,
            target: parse(target)?.unwrap_or(Target::Next),
            wrong: parse(wrong)?,
            steps,
        };
        let m = self.inner.clone();
        let r = engine(py, move || run(&m, &ids, &opts, &mut |_, _| {}))?;
        let scores: Vec<f32> = r.tokens.iter().map(|t| t.score).collect();
        let json = serde_json::to_string(&r).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        Ok((json, PyArray1::from_vec(py, scores).into_any()))
    }

    /// The gradients of a scalar at the hook points `names` (full TransformerLens names, without
    /// `_grad`; only those with a gradient: `Model::hook_gradients`) from one forward and one
    /// backward. `metric`: `target_logprob` (log p(target), default the top next token), `loss`
    /// (the mean next-token cross-entropy) or `logit_diff` (logit(target) − logit(wrong), both
    /// needed). Returns (the target id, the scalar's value, [(name + "_grad", shape, float32
    /// array flattened)]).
    /// `metric="logits"` takes `dlogits` instead: the gradient of the caller's scalar with
    /// respect to every position's logits (`[n, vocab]` flattened, float32), as a torch metric's
    /// backward hands it over (the Python package's backward hooks); the value returned is 0.
    #[pyo3(signature = (ids, names, metric, target = None, wrong = None, dlogits = None))]
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn hook_gradients<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<u32>,
        names: Vec<String>,
        metric: &str,
        target: Option<String>,
        wrong: Option<String>,
        dlogits: Option<numpy::PyReadonlyArray1<'py, f32>>,
    ) -> PyResult<(u32, f32, Vec<(String, Vec<usize>, Bound<'py, PyAny>)>)> {
        use attnscope::analysis::vocab::Target;
        use attnscope::model::backward::{GradMetric, Metric};
        self.check_ids(&ids)?;
        let m = self.inner.clone();
        let resolve = |t: Option<String>, what: &str| -> PyResult<Option<u32>> {
            match t
                .map(|t| t.parse::<Target>().map_err(PyValueError::new_err))
                .transpose()?
            {
                None | Some(Target::Next) => Ok(None),
                Some(t) => t
                    .resolve(&m, &[])
                    .map(Some)
                    .map_err(|e| PyValueError::new_err(format!("{what}: {e}"))),
            }
        };
        let (t, w) = (resolve(target, "target")?, resolve(wrong, "wrong")?);
        let dlogits = dlogits
            .map(|d| d.as_slice().map(<[f32]>::to_vec))
            .transpose()?;
        if dlogits.is_some() != (metric == "logits") {
            return Err(PyValueError::new_err(
                "dlogits= goes with metric='logits' (and metric='logits' needs it)",
            ));
        }
        let metric = match (metric, t, w) {
            ("logits", None, None) => GradMetric::Logits(dlogits.unwrap_or_default()),
            ("target_logprob", t, None) => GradMetric::Metric(Metric::LogProb(t)),
            ("loss", None, None) => GradMetric::Loss,
            ("logit_diff", Some(answer), Some(wrong)) if answer != wrong => {
                GradMetric::Metric(Metric::LogitDiff { answer, wrong })
            }
            ("logit_diff", Some(_), Some(_)) => {
                return Err(PyValueError::new_err(
                    "metric='logit_diff' needs two different tokens for target= and wrong=",
                ))
            }
            ("logit_diff", _, _) => return Err(PyValueError::new_err(
                "metric='logit_diff' needs target= and wrong= (token ids or one token's text each)",
            )),
            ("target_logprob" | "loss", _, _) => {
                return Err(PyValueError::new_err(format!(
                    "metric={metric:?} takes {}; wrong= is for metric='logit_diff'",
                    if metric == "loss" {
                        "no target= (the loss scores every next token)"
                    } else {
                        "target= only"
                    }
                )))
            }
            _ => {
                return Err(PyValueError::new_err(format!(
                    "unknown metric {metric:?}; use 'target_logprob', 'loss' or 'logit_diff'"
                )))
            }
        };
        let wanted: BTreeSet<String> = names.into_iter().collect();
        let g = engine(py, move || {
            Ok(m.hook_gradients(&ids, metric, &|n: &str| wanted.contains(n))?)
        })?;
        let grads = g
            .grads
            .into_iter()
            .map(|(name, shape, data)| (name, shape, PyArray1::from_vec(py, data).into_any()))
            .collect();
        Ok((g.target, g.value, grads))
    }

    /// Generates from `text` (a chat message through the model's template when `chat`, with
    /// `system` first if given; else a raw text), greedy or sampled as [`Model::generate`], then
    /// attributes each answer token's teacher-forced log-probability to the positions before it
    /// by `method` (`attnscope generate --attribute`). Returns (the token texts, the prompt's
    /// length, the matrix `[prompt + answer, answer]` as float32 with NaN where a position is
    /// not in the token's input, each answer token's log-probability, the ids, the
    /// head-and-layer-averaged attention row of the query that produced each answer token).
    #[pyo3(signature = (text, method = "occlusion", chat = true, system = None, max_new_tokens = 32,
                        temperature = 0.0, top_k = 0, top_p = 1.0, seed = 0, steps = 32))]
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn attribute_generation<'py>(
        &self,
        py: Python<'py>,
        text: String,
        method: &str,
        chat: bool,
        system: Option<String>,
        max_new_tokens: usize,
        temperature: f32,
        top_k: usize,
        top_p: f32,
        seed: u64,
        steps: usize,
    ) -> PyResult<(
        Vec<String>,
        usize,
        Bound<'py, PyAny>,
        Vec<f32>,
        Vec<u32>,
        Vec<Vec<f32>>,
    )> {
        use attnscope::commands::generate::{attribution, run};
        let method: attnscope::analysis::vocab::Method =
            method.parse().map_err(PyValueError::new_err)?;
        let m = self.inner.clone();
        let (r, attention) = engine(py, move || {
            let prompt = if chat {
                m.chat_ids(&text, system.as_deref())?
            } else {
                m.encode_with(&text, None)?
            };
            let o = attnscope::model::generate::GenOptions {
                max_new_tokens,
                temperature,
                top_k,
                top_p,
                seed,
                ..Default::default()
            };
            let g = run(&m, &prompt, &o, |_| {})?;
            let answer: Vec<u32> = g.generated.iter().map(|t| t.id).collect();
            let r = attribution(&m, &prompt, &answer, method, steps, &mut |_, _| {})?;
            let attention = g.generated.into_iter().map(|t| t.attention).collect();
            Ok((r, attention))
        })?;
        let (rows, cols) = (r.matrix.len(), r.answer_len());
        let flat: Vec<f32> = r.matrix.iter().flatten().copied().collect();
        let matrix = PyArray1::from_vec(py, flat)
            .reshape([rows, cols])?
            .into_any();
        Ok((
            self.inner.token_texts(&r.ids),
            r.prompt_len,
            matrix,
            r.logprobs,
            r.ids,
            attention,
        ))
    }
}

/// A report as Python objects (dicts, lists, floats), without a JSON round trip: an f32 becomes
/// the Python float of the same value.
/// The head roles of one text (`attnscope heads` on it).
fn roles_of_one(
    m: &attnscope::model::Model,
    tokens: Vec<u32>,
) -> anyhow::Result<attnscope::commands::heads::HeadRoles> {
    use attnscope::commands::heads::{run, HeadsInput};
    let input = HeadsInput {
        texts: vec![tokens],
        types: None,
    };
    Ok(run(m, &input)?.remove(0))
}

fn to_object<'py, T: serde::Serialize>(py: Python<'py>, v: &T) -> PyResult<Bound<'py, PyAny>> {
    pythonize::pythonize(py, v).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// `next`, a token id or one token's text, as the CLI's `--target` reads it.
fn parse_target(t: Option<String>, what: &str) -> PyResult<Option<Target>> {
    t.map(|t| {
        t.parse::<Target>()
            .map_err(|e| PyValueError::new_err(format!("{what}={t:?}: {e}")))
    })
    .transpose()
}

/// A count or an index given from Python (an int): negative ones are refused, naming `what`.
fn count(v: i64, what: &str) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| PyValueError::new_err(format!("{what}={v}: must be 0 or more")))
}

impl Model {
    fn check_ids(&self, ids: &[u32]) -> PyResult<()> {
        let v = self.inner.dims.vocab_size;
        match ids.iter().find(|&&t| t as usize >= v) {
            Some(t) => Err(PyValueError::new_err(format!(
                "token id {t} is out of range; valid: 0..{v}"
            ))),
            None => Ok(()),
        }
    }
}

/// `attnscope corpus merge`: the aggregate of the record files `files` (`corpus --out`'s), as
/// Python objects.
#[pyfunction]
#[pyo3(signature = (files, epsilon = 0.3))]
fn corpus_merge(
    py: Python<'_>,
    files: Vec<std::path::PathBuf>,
    epsilon: f32,
) -> PyResult<Bound<'_, PyAny>> {
    if files.is_empty() {
        return Err(PyValueError::new_err(
            "files: an empty list; give at least one record file",
        ));
    }
    check_epsilon(epsilon)?;
    let agg = engine(py, move || {
        attnscope::commands::corpus::merge(&files, epsilon)
    })?;
    epsilon_as_given(to_object(py, &agg)?, epsilon)
}

/// Refuses an `epsilon` that is NaN or outside [0, 1] (`--epsilon`'s rule), naming it.
fn check_epsilon(epsilon: f32) -> PyResult<()> {
    attnscope::analysis::request::check_weight_threshold(epsilon.into())
        .map_err(|e| PyValueError::new_err(format!("epsilon={epsilon}: {e}")))
}

/// A corpus aggregate's `epsilon` as `corpus --json` prints it: pythonize widens the f32 to the
/// f64 of its bits (0.30000001192092896), the CLI's JSON writes its shortest decimal (0.3),
/// which is what the user gave.
fn epsilon_as_given(obj: Bound<'_, PyAny>, epsilon: f32) -> PyResult<Bound<'_, PyAny>> {
    if let Ok(d) = obj.cast::<pyo3::types::PyDict>() {
        if d.contains("epsilon")? {
            let shortest: f64 = epsilon.to_string().parse().expect("an f32's decimal");
            d.set_item("epsilon", shortest)?;
        }
    }
    Ok(obj)
}

/// The `attnscope view` page for given patterns `[layers, heads, n, n]` and token texts; for a
/// sentence pair (bidirectional patterns) `sentence_b_start` turns on the head view's selector,
/// shown first at `pair` (`all`, `a->b`, `b->a`, `a->a`, `b->b`).
#[pyfunction]
#[pyo3(signature = (patterns, shape, tokens, title, sentence_b_start = None, pair = "all".to_string()))]
fn pattern_page(
    py: Python<'_>,
    patterns: numpy::PyReadonlyArray1<'_, f32>,
    shape: [usize; 4],
    tokens: Vec<String>,
    title: String,
    sentence_b_start: Option<usize>,
    pair: String,
) -> PyResult<String> {
    let patterns = patterns.as_slice()?.to_vec();
    engine(py, move || {
        attnscope::render::view::pattern_page_pair(
            &patterns,
            shape,
            &tokens,
            &title,
            sentence_b_start,
            &pair,
        )
    })
}

/// Writes `text` to the file `path` as every attnscope writer does (a temporary file beside it,
/// renamed into place; a missing or unwritable folder is a `ValueError`): an existing file is
/// replaced only with `overwrite`, else `FileExistsError`. Returns the path.
#[pyfunction]
#[pyo3(signature = (path, text, overwrite = false))]
fn write_new_file(
    py: Python<'_>,
    path: std::path::PathBuf,
    text: String,
    overwrite: bool,
) -> PyResult<String> {
    engine(py, move || {
        attnscope::render::write_new_file(&path, text.as_bytes(), overwrite)?;
        Ok(path.display().to_string())
    })
}

/// The texts of a corpus file (.txt: one per line, .jsonl: strings or {"text": ...}), or of the
/// built-in corpus for None, with the ids `attnscope corpus` gives them (their index).
#[pyfunction]
#[pyo3(signature = (path = None))]
fn corpus_texts(py: Python<'_>, path: Option<std::path::PathBuf>) -> PyResult<Vec<String>> {
    engine(py, move || {
        Ok(attnscope::commands::corpus::load_texts(path.as_deref())?.0)
    })
}

/// The hook names the engine knows, in order (TransformerLens's names).
#[pyfunction]
fn hook_suffixes() -> Vec<&'static str> {
    Hook::ALL.iter().map(|h| h.suffix()).collect()
}

/// The hooks outside the blocks, by their whole names (`hook_embed`, `hook_pos_embed`,
/// `ln_final.hook_scale`, `ln_final.hook_normalized`).
#[pyfunction]
fn global_hooks() -> Vec<&'static str> {
    Hook::GLOBAL.iter().map(|h| h.suffix()).collect()
}

/// `blocks.{layer}.{suffix}`.
#[pyfunction]
fn full_hook_name(layer: usize, suffix: &str) -> PyResult<String> {
    let h = hook_by_suffix(suffix)
        .ok_or_else(|| PyValueError::new_err(format!("unknown hook `{suffix}`")))?;
    Ok(hook_name(layer, h))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    attnscope::model::forward::set_interrupt_check(python_interrupted);
    m.add_class::<Model>()?;
    m.add_class::<patching::PatchBase>()?;
    m.add_function(wrap_pyfunction!(corpus_merge, m)?)?;
    m.add_function(wrap_pyfunction!(pattern_page, m)?)?;
    m.add_function(wrap_pyfunction!(hook_suffixes, m)?)?;
    m.add_function(wrap_pyfunction!(global_hooks, m)?)?;
    m.add_function(wrap_pyfunction!(corpus_texts, m)?)?;
    m.add_function(wrap_pyfunction!(write_new_file, m)?)?;
    m.add_function(wrap_pyfunction!(full_hook_name, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
