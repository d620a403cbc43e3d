//! Hooks: the (layer, hook) pairs Python names, the observer that keeps exactly those and hands
//! the edited ones to a Python callable (TransformerLens's editing hooks), the forward behind
//! `Model.run` (`run_with_cache`, `run_with_hooks`), each head's `hook_result`, and the
//! gradients at hook points (`incl_bwd`, backward hooks).

use crate::cache::{cache_arrays, logit_rows, logits_array, spec_of};
use crate::engine::{engine, to_py};
use crate::model::Model;
use attnscope::model::capture::{hook_name, AttnCache, Hook, Observer};
use attnscope::model::forward::{RunOptions, Segment};
use attnscope::model::Error as ModelError;
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::collections::BTreeSet;

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
        let editor = self.editor.as_ref().expect("edits only with an editor");
        call_editor(editor, layer, hook, shape, data)
    }
}

/// Hands `data` (shape `shape`) to the Python `editor(name, array)` and writes the float32 array
/// of the same shape it returns back into `data`.
fn call_editor(
    editor: &Py<PyAny>,
    layer: usize,
    hook: Hook,
    shape: &[usize],
    data: &mut [f32],
) -> PyResult<()> {
    Python::attach(|py| {
        let arr = PyArray1::from_slice(py, data).reshape(shape.to_vec())?;
        let back = editor.call1(py, (hook_name(layer, hook), arr))?;
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

/// [`Wanted`] for a batch of rows of one length run as one forward over stacked segments
/// (`Model::forward_segments`): the projections, norms and MLP read their weights once for every
/// row, the attention runs per row. Each row keeps its own cache (its numbers are those of its own
/// forward: the kernels compute each row alone); an edited per-position activation is handed to
/// Python once, on every row at once (`[b, pos, ...]`, TransformerLens's batch axis). The
/// attention maps are computed row by row, so an edit of `hook_attn_scores` or `hook_pattern`
/// (which must see the whole batch) is not taken here: `_run_rows` runs those rows in lockstep.
struct WantedBatch {
    /// each row's captures
    caches: Vec<AttnCache>,
    pairs: BTreeSet<(usize, Hook)>,
    edit: BTreeSet<(usize, Hook)>,
    editor: Option<Py<PyAny>>,
    error: Option<PyErr>,
    stop: Option<usize>,
    /// the row the attention's calls belong to (`Observer::segment`)
    cur: usize,
}

impl Observer for WantedBatch {
    fn wants(&self, layer: usize, hook: Hook) -> bool {
        self.pairs.contains(&(layer, hook))
    }
    fn tensor(&mut self, layer: usize, hook: Hook, shape: &[usize], data: &[f32]) {
        if per_row(hook) {
            // handed in the attention, the row's own
            return self.caches[self.cur].tensor(layer, hook, shape, data);
        }
        // every other per-position tensor covers every row, stacked: `[b · pos, ...]`
        let b = self.caches.len();
        let per = shape[0] / b;
        debug_assert_eq!(per * b, shape[0], "a stacked tensor of whole rows");
        let width: usize = shape[1..].iter().product();
        let mut s = shape.to_vec();
        s[0] = per;
        for (i, c) in self.caches.iter_mut().enumerate() {
            c.tensor(
                layer,
                hook,
                &s,
                &data[i * per * width..(i + 1) * per * width],
            );
        }
    }
    attnscope::delegate_observer!(caches[cur]: attention_block);
    fn pattern_rows(
        &mut self,
        layer: usize,
        q_start: usize,
        rows: usize,
        n_heads: usize,
        k_len: usize,
    ) -> Option<attnscope::model::capture::PatternRows<'_>> {
        if !self.pairs.contains(&(layer, Hook::Pattern)) {
            return None;
        }
        self.caches[self.cur].pattern_rows(layer, q_start, rows, n_heads, k_len)
    }
    fn segment(&mut self, index: usize) {
        self.cur = index;
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
        let b = self.caches.len();
        if per_row(hook) || !shape[0].is_multiple_of(b) {
            // run_batch refuses these edits before the forward
            return Err(format!(
                "an edit of {} in a stacked batch: you likely have found a bug",
                hook_name(layer, hook)
            ));
        }
        // [b · pos, ...] is [b, pos, ...]: the rows are stacked in order and of one length
        let mut batched = vec![b, shape[0] / b];
        batched.extend_from_slice(&shape[1..]);
        let editor = self.editor.as_ref().expect("edits only with an editor");
        call_editor(editor, layer, hook, &batched, data).map_err(|e| {
            let msg = format!("raised {e}");
            self.error = Some(e);
            msg
        })
    }
}

/// The (layer, hook) pairs of `(layer, suffix)` items; negative layers count from the end.
pub(crate) fn hook_pairs(
    n_layers: usize,
    hooks: Vec<(i64, String)>,
) -> PyResult<BTreeSet<(usize, Hook)>> {
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

pub(crate) fn hook_by_suffix(s: &str) -> Option<Hook> {
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

/// The hook names the engine knows, in order (TransformerLens's names).
#[pyfunction]
pub(crate) fn hook_suffixes() -> Vec<&'static str> {
    Hook::ALL.iter().map(|h| h.suffix()).collect()
}

/// The hooks outside the blocks, by their whole names (`hook_embed`, `hook_pos_embed`,
/// `ln_final.hook_scale`, `ln_final.hook_normalized`).
#[pyfunction]
pub(crate) fn global_hooks() -> Vec<&'static str> {
    Hook::GLOBAL.iter().map(|h| h.suffix()).collect()
}

/// `blocks.{layer}.{suffix}`.
#[pyfunction]
pub(crate) fn full_hook_name(layer: usize, suffix: &str) -> PyResult<String> {
    let h = hook_by_suffix(suffix)
        .ok_or_else(|| PyValueError::new_err(format!("unknown hook `{suffix}`")))?;
    Ok(hook_name(layer, h))
}

/// `Model.run`'s body (its documentation is there, in the Python surface).
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub(crate) fn run<'py>(
    this: &Model,
    py: Python<'py>,
    ids: Vec<u32>,
    hooks: Vec<(i64, String)>,
    logits: &str,
    edits: Vec<(i64, String)>,
    editor: Option<Py<PyAny>>,
    stop_at_layer: Option<usize>,
    token_types: Option<Vec<u32>>,
) -> PyResult<(Option<Bound<'py, PyAny>>, Vec<(String, Bound<'py, PyAny>)>)> {
    let d = &this.inner.dims;
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
    let m = this.inner.clone();
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

/// The hook points a forward over stacked rows hands inside the attention, one row at a time:
/// the maps and the rotated queries and keys.
fn per_row(hook: Hook) -> bool {
    hook.is_attention_map() || matches!(hook, Hook::RotQ | Hook::RotK)
}

/// `Model.run_batch`'s body (its documentation is there, in the Python surface).
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub(crate) fn run_batch<'py>(
    this: &Model,
    py: Python<'py>,
    rows: Vec<Vec<u32>>,
    hooks: Vec<(i64, String)>,
    logits: &str,
    edits: Vec<(i64, String)>,
    editor: Option<Py<PyAny>>,
    stop_at_layer: Option<usize>,
) -> PyResult<(Option<Bound<'py, PyAny>>, Vec<(String, Bound<'py, PyAny>)>)> {
    let d = &this.inner.dims;
    if d.arch.is_encoder() {
        return Err(PyValueError::new_err(
            "run_batch runs a decoder's rows; an encoder's run one by one (Model.run)",
        ));
    }
    let Some(n) = rows.first().map(Vec::len) else {
        return Err(PyValueError::new_err("run_batch needs at least one row"));
    };
    if let Some(r) = rows.iter().find(|r| r.len() != n) {
        return Err(PyValueError::new_err(format!(
            "run_batch takes rows of one length (padded): {} and {n} tokens",
            r.len()
        )));
    }
    if n == 0 {
        return Err(to_py(ModelError::EmptyText.into()));
    }
    if let Some(s) = stop_at_layer.filter(|&s| s > d.n_layers) {
        return Err(PyValueError::new_err(format!(
            "stop_at_layer={s} is out of range: the model has {} layers",
            d.n_layers
        )));
    }
    let pairs = hook_pairs(d.n_layers, hooks)?;
    let edit = hook_pairs(d.n_layers, edits)?;
    if let Some((l, h)) = edit.iter().find(|(_, h)| per_row(*h)) {
        return Err(PyValueError::new_err(format!(
            "run_batch edits the activations handed on every row at once; {} is handed row by row (edit it with Model.run)",
            hook_name(*l, *h)
        )));
    }
    let editor = match (editor, edit.is_empty()) {
        (Some(e), _) => Some(e),
        (None, true) => None,
        (None, false) => return Err(PyValueError::new_err("edits given without an editor")),
    };
    let logits_at = logit_rows(logits, n)?;
    for r in &rows {
        this.check_ids(r)?;
    }
    let spec = spec_of(&pairs);
    let m = this.inner.clone();
    let b = rows.len();
    let k = logits_at.len();
    let (out, caches) = engine(py, move || {
        let mut obs = WantedBatch {
            caches: (0..b).map(|_| AttnCache::new(&spec, n)).collect(),
            pairs,
            edit,
            editor,
            error: None,
            stop: stop_at_layer,
            cur: 0,
        };
        let segs: Vec<Segment> = rows
            .iter()
            .map(|t| Segment {
                tokens: t,
                reuse: 0,
                knockout: Vec::new(),
                logits_at: logits_at.clone(),
            })
            .collect();
        let out = m.forward_segments(None, &segs, None, &RunOptions::default(), &mut obs);
        // an exception in a hook is raised as it was
        match (out, obs.error) {
            (_, Some(e)) => Ok((Err(e), obs.caches)),
            (out, None) => Ok((Ok(out?), obs.caches)),
        }
    })?;
    let out = out?;
    // the logits rows come row after row: [b, k, vocab]
    let logits = match out.logits.first().map(Vec::len) {
        Some(vocab) if k > 0 => {
            let mut flat = Vec::with_capacity(b * k * vocab);
            for row in &out.logits {
                flat.extend_from_slice(row);
            }
            Some(
                PyArray1::from_vec(py, flat)
                    .reshape([b, k, vocab])?
                    .into_any(),
            )
        }
        _ => None,
    };
    Ok((logits, stack_caches(py, caches)?))
}

/// Each row's captures stacked into `[b, ...]` arrays, by hook name (every row has the same
/// entries, of the same shapes).
fn stack_caches(
    py: Python<'_>,
    caches: Vec<AttnCache>,
) -> PyResult<Vec<(String, Bound<'_, PyAny>)>> {
    let b = caches.len();
    let mut rows: Vec<_> = caches
        .into_iter()
        .map(|c| c.entries.into_values())
        .collect();
    let mut out = Vec::new();
    let Some((first, rest)) = rows.split_first_mut() else {
        return Ok(out);
    };
    for c in first.by_ref() {
        let mut data = Vec::with_capacity(c.data.len() * b);
        data.extend_from_slice(&c.data);
        drop(c.data);
        for r in rest.iter_mut() {
            let o = r.next().expect("every row captures the same hooks");
            debug_assert!(o.name == c.name && o.shape == c.shape);
            data.extend_from_slice(&o.data);
        }
        let mut shape = vec![b];
        shape.extend_from_slice(&c.shape);
        out.push((
            c.name,
            PyArray1::from_vec(py, data).reshape(shape)?.into_any(),
        ));
    }
    Ok(out)
}

/// `Model.head_results`'s body (its documentation is there, in the Python surface).
pub(crate) fn head_results<'py>(
    this: &Model,
    py: Python<'py>,
    layer: usize,
    z: numpy::PyReadonlyArray1<'py, f32>,
    rows: usize,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let d = &this.inner.dims;
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
    let m = this.inner.clone();
    let (res, bias) = engine(py, move || Ok(m.head_results(layer, &z, rows)?))?;
    Ok((
        PyArray1::from_vec(py, res).into_any(),
        PyArray1::from_vec(py, bias).into_any(),
    ))
}

/// `Model.hook_gradients`'s body (its documentation is there, in the Python surface).
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub(crate) fn hook_gradients<'py>(
    this: &Model,
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
    this.check_ids(&ids)?;
    let m = this.inner.clone();
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
    let metric =
        match (metric, t, w) {
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
