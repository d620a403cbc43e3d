//! The views: `attnscope view`'s HTML page of a text, the page of given patterns (`viz`), and
//! the file writer every page goes through (never replacing a file unless asked).

use crate::engine::{engine, to_py};
use crate::model::Model;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// `Model.view_html`'s body (its documentation is there, in the Python surface).
pub(crate) fn view_html(
    this: &Model,
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
    let (m, text) = (this.inner.clone(), text.to_string());
    engine(py, move || Ok(view_html_with(&m, &text, bos, &opts)?.0))
}

/// The `attnscope view` page for given patterns `[layers, heads, n, n]` and token texts; for a
/// sentence pair (bidirectional patterns) `sentence_b_start` turns on the head view's selector,
/// shown first at `pair` (`all`, `a->b`, `b->a`, `a->a`, `b->b`).
#[pyfunction]
#[pyo3(signature = (patterns, shape, tokens, title, sentence_b_start = None, pair = "all".to_string()))]
pub(crate) fn pattern_page(
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
pub(crate) fn write_new_file(
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
