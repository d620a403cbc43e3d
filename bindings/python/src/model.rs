//! [`Model`], the loaded model, and its Python surface: every method Python calls is declared
//! here (its documentation and signature), loading, configuration, tokens and weights with their
//! bodies; the forward with hooks, the analyses, the corpus calls and the views call into
//! [`crate::hooks`], [`crate::analyses`], [`crate::corpus`], [`crate::views`] and
//! [`crate::circuits`].

use crate::engine::{engine, to_py};
use crate::{analyses, circuits, corpus, hooks, views};
use attnscope::model::Precision;
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use std::sync::Arc;

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

/// A loaded model.
#[pyclass(frozen, module = "attnscope._native")]
pub(crate) struct Model {
    pub(crate) inner: Arc<attnscope::model::Model>,
    /// what it was loaded from (an alias, a path, a hub id): its name in `compare`'s labels
    pub(crate) spec: String,
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
        let family = d.arch.family();
        v["hf_class"] = family.hf_class.into();
        v["act_fn"] = family.mlp.act_name().into();
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
        analyses::generate(
            self,
            py,
            text,
            ids,
            chat,
            system,
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
        )
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
        hooks::run(
            self,
            py,
            ids,
            hooks,
            logits,
            edits,
            editor,
            stop_at_layer,
            token_types,
        )
    }

    /// Runs a batch of token rows of one length (a padded batch) as one forward: the norms,
    /// projections and MLP on every row's positions stacked (each weight read once for the
    /// batch), the attention row by row; each row's numbers are those of its own `run` (the
    /// kernels compute each row alone). Returns (logits `[b, n or 1, vocab]` or None, [(hook
    /// name, array `[b, ...]`)]). `edits` (with `editor`): per-position hook points only; the
    /// editor gets each one on every row at once, `[b, pos, ...]`, and what it returns flows on
    /// (an edit of an attention map, `hook_rot_q` or `hook_rot_k`, which the forward hands row
    /// by row, is refused: `run` edits those). A decoder only.
    #[pyo3(signature = (rows, hooks, logits = "all", edits = Vec::new(), editor = None, stop_at_layer = None))]
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn run_batch<'py>(
        &self,
        py: Python<'py>,
        rows: Vec<Vec<u32>>,
        hooks: Vec<(i64, String)>,
        logits: &str,
        edits: Vec<(i64, String)>,
        editor: Option<Py<PyAny>>,
        stop_at_layer: Option<usize>,
    ) -> PyResult<(Option<Bound<'py, PyAny>>, Vec<(String, Bound<'py, PyAny>)>)> {
        hooks::run_batch(self, py, rows, hooks, logits, edits, editor, stop_at_layer)
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
        hooks::head_results(self, py, layer, z, rows)
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
        analyses::embed(self, py, texts, pairs, normalize)
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
        corpus::corpus_records(self, py, items, bos, faithfulness)
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
        corpus::head_roles(self, py, items, bos)
    }

    /// `attnscope heads --each-line --json` from each text's scores (JSON of `head_roles`), in
    /// the order given: the mean over texts, each counting once.
    fn head_roles_document(&self, scores: Vec<String>) -> PyResult<String> {
        corpus::head_roles_document(self, scores)
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
        views::view_html(self, py, text, bos, faithfulness, ablate, target)
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
        analyses::inspect(
            self,
            py,
            text,
            pair,
            query,
            layer,
            heads,
            layers,
            top,
            concentrated,
            bos,
        )
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
        analyses::faithfulness(self, py, text, target, replace_with, bos)
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
        analyses::compare(self, py, text, other_text, other, query, top, html, force)
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
        analyses::capture(self, py, text, path, hooks, layers, heads, queries, force)
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
        corpus::corpus(
            self,
            py,
            texts,
            path,
            limit,
            shard,
            out,
            epsilon,
            faithfulness,
            bos,
        )
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
        analyses::ablate(self, py, text, method, target, positions, mlp, bos)
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
        analyses::patch(self, py, clean, corrupt, hook, answer, wrong, bos)
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
        analyses::heads(self, py, text, random_repeat, seed, bos, pair)
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
        analyses::sinks(self, py, text, max_tokens, key_block, top, bos, file)
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
        analyses::attribute(self, py, ids, method, target, wrong, steps)
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
        hooks::hook_gradients(self, py, ids, names, metric, target, wrong, dlogits)
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
        analyses::attribute_generation(
            self,
            py,
            text,
            method,
            chat,
            system,
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            steps,
        )
    }
}

impl Model {
    /// Refuses a token id outside the vocabulary, naming it.
    pub(crate) fn check_ids(&self, ids: &[u32]) -> PyResult<()> {
        let v = self.inner.dims.vocab_size;
        match ids.iter().find(|&&t| t as usize >= v) {
            Some(t) => Err(PyValueError::new_err(format!(
                "token id {t} is out of range; valid: 0..{v}"
            ))),
            None => Ok(()),
        }
    }
}
