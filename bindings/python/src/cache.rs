//! The activation cache's side of a forward: what to capture ([`spec_of`]), which logit rows,
//! and the captured tensors and logits handed to numpy as arrays that own the engine's buffers
//! (reshaped, never copied).

use attnscope::model::capture::{AttnCache, CaptureSpec, Hook, Queries};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::collections::BTreeSet;

/// The rows `run(logits=...)` asks logits for: `all`, `last` or `none` of `n` positions.
pub(crate) fn logit_rows(logits: &str, n: usize) -> PyResult<Vec<usize>> {
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
pub(crate) fn spec_of(pairs: &BTreeSet<(usize, Hook)>) -> CaptureSpec {
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
pub(crate) fn logits_array(
    py: Python<'_>,
    logits: Vec<Vec<f32>>,
) -> PyResult<Option<Bound<'_, PyAny>>> {
    let Some(vocab) = logits.first().map(Vec::len) else {
        return Ok(None);
    };
    let rows = logits.len();
    // row by row as whole copies (a flattening iterator went value by value: ~4% of a forward
    // with every row's logits, 120 rows of smollm2-135m's 49,152)
    let mut flat = Vec::with_capacity(rows * vocab);
    for row in &logits {
        flat.extend_from_slice(row);
    }
    Ok(Some(
        PyArray1::from_vec(py, flat)
            .reshape([rows, vocab])?
            .into_any(),
    ))
}

/// Each captured tensor as (hook name, array): the engine's buffer, reshaped, never copied.
pub(crate) fn cache_arrays(
    py: Python<'_>,
    cache: AttnCache,
) -> PyResult<Vec<(String, Bound<'_, PyAny>)>> {
    let mut arrays = Vec::with_capacity(cache.entries.len());
    for (_, c) in cache.entries {
        let arr = PyArray1::from_vec(py, c.data)
            .reshape(c.shape.clone())?
            .into_any();
        arrays.push((c.name, arr));
    }
    Ok(arrays)
}
