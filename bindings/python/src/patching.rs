//! The resumed runs behind `attnscope.patching`'s sweeps (TransformerLens's `get_act_patch_*`,
//! #59): one row's unedited (corrupted) run is kept, and each batch of patches of one hook of one
//! layer runs from that layer on, reusing the unedited run's keys and values before the first
//! patched position ([`Runner`], as `attnscope patch` runs), with the logits of every position
//! from there on. A patch at layer `l`, position `p` leaves every earlier layer and position as
//! it was, so the numbers are those of TransformerLens's one full forward per patch.

use crate::engine::engine;
use crate::hooks::hook_by_suffix;
use crate::model::Model;
use attnscope::analysis::edit::{Fill, Runner, Variant};
use attnscope::analysis::intervene::DEFAULT_BATCH_ROWS;
use attnscope::model::capture::hook_name;
use attnscope::model::forward::KvPrefix;
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::sync::Arc;

/// One token row's unedited run, ready to resume (`_native.PatchBase(model, ids)`).
#[pyclass(module = "attnscope._native")]
pub struct PatchBase {
    model: Arc<attnscope::model::Model>,
    tokens: Vec<u32>,
    /// the unedited run's `hook_resid_pre` of every layer and its keys and values ([`Runner`]'s)
    resid_pre: Vec<Vec<f32>>,
    kv: Option<KvPrefix>,
}

/// A patch as Python gives it: (first position run, first value, end value, rows written).
type PatchSpec = (usize, usize, usize, Vec<usize>);

#[pymethods]
impl PatchBase {
    #[new]
    fn new(py: Python<'_>, model: &Model, ids: Vec<u32>) -> PyResult<Self> {
        model.check_ids(&ids)?;
        if ids.is_empty() {
            return Err(PyValueError::new_err(
                "the tokens are empty: give at least one",
            ));
        }
        let m = model.inner.clone();
        let (resid_pre, kv) = engine(py, || {
            let (r, _, _) = Runner::clean(&m, &ids, &[])?;
            Ok((r.resid_pre, r.kv))
        })?;
        Ok(PatchBase {
            model: m,
            tokens: ids,
            resid_pre,
            kv,
        })
    }

    /// Each patch of `hook` (a hook point's name within its block, `hook_resid_pre`,
    /// `attn.hook_z`, ...) at `layer`, the values from `src` (the clean run's activation of this
    /// row in the engine's layout, `[positions, ...]`, or `[heads, query, key]` for a map,
    /// flattened); `patches`: (from, c0, c1, at): values `c0..c1` of rows `at` (positions
    /// relative to `from`, or heads for a map, where `from` must be 0) written, the run resumed
    /// from position `from`. Returns each patch's logits at positions `from..n`, `[n - from, vocab]`,
    /// or with `every=False` at the last position only, `[1, vocab]` (a logit row costs about
    /// as much as the layers of a short text: a metric that reads the last position needs no more).
    #[pyo3(signature = (layer, hook, src, patches, every = true))]
    fn run<'py>(
        &mut self,
        py: Python<'py>,
        layer: usize,
        hook: &str,
        src: PyReadonlyArray1<'py, f32>,
        patches: Vec<PatchSpec>,
        every: bool,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let h = hook_by_suffix(hook)
            .ok_or_else(|| PyValueError::new_err(format!("unknown hook {hook:?}")))?;
        let d = &self.model.dims;
        let (n, vocab) = (self.tokens.len(), d.vocab_size);
        if layer >= d.n_layers {
            let msg = format!(
                "layer {layer} is out of range: the model has {} layers",
                d.n_layers
            );
            return Err(PyValueError::new_err(msg));
        }
        let maps = h.is_attention_map();
        let src = src.as_slice()?.to_vec();
        let rows = if maps { d.n_heads } else { n };
        if src.is_empty() || src.len() % rows != 0 {
            return Err(PyValueError::new_err(format!(
                "the source of {} has {} values, not a whole number of {rows} rows",
                hook_name(layer, h),
                src.len()
            )));
        }
        let width = src.len() / rows;
        check_patches(&patches, maps, n, rows, width)?;
        let variants: Vec<Variant> = patches
            .iter()
            .map(|(from, c0, c1, at)| Variant {
                from: *from,
                cols: *c0..*c1,
                at: at.clone(),
                fill: Fill::From(&src[from * width..]),
            })
            .collect();
        let (m, tokens) = (self.model.clone(), &self.tokens);
        let (resid_pre, kv) = (&mut self.resid_pre, &mut self.kv);
        let out = engine(py, move || {
            let mut r = Runner {
                model: &m,
                tokens,
                resid_pre: std::mem::take(resid_pre),
                kv: kv.take(),
                batch_rows: DEFAULT_BATCH_ROWS,
                passes: 0,
                layer_rows: 0,
            };
            let out = if every {
                r.run_every_position(layer, h, &variants)
            } else {
                r.run(layer, h, &variants, |_| {})
            };
            (*resid_pre, *kv) = (r.resid_pre, r.kv);
            Ok(out?)
        })?;
        out.into_iter()
            .map(|lg| {
                let rows = lg.len() / vocab;
                Ok(PyArray1::from_vec(py, lg)
                    .reshape([rows, vocab])?
                    .into_any())
            })
            .collect()
    }
}

/// Every patch inside the tensor: a map's rows are heads and it runs from position 0.
fn check_patches(
    patches: &[PatchSpec],
    maps: bool,
    n: usize,
    rows: usize,
    width: usize,
) -> PyResult<()> {
    for (from, c0, c1, at) in patches {
        let bad = if *from >= n || (maps && *from != 0) {
            Some(format!("from={from} (positions 0..{n}; 0 for a map)"))
        } else if c0 >= c1 || *c1 > width {
            Some(format!("values {c0}..{c1} of rows of {width}"))
        } else {
            let limit = if maps { rows } else { n - from };
            at.iter()
                .find(|&&r| r >= limit)
                .map(|r| format!("row {r} (0..{limit})"))
        };
        if let Some(what) = bad {
            return Err(PyValueError::new_err(format!(
                "a patch out of range: {what}"
            )));
        }
    }
    Ok(())
}
