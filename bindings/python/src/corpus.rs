//! The corpus calls: `attnscope corpus` (sink statistics over many texts, sharded and resumed),
//! its merge, the per-text records and head roles that `attnscope.distributed` farms out, and
//! a corpus file's texts.

use crate::engine::{count, engine, to_object, to_py};
use crate::model::Model;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// `Model.corpus_records`'s body (its documentation is there, in the Python surface).
pub(crate) fn corpus_records(
    this: &Model,
    py: Python<'_>,
    items: Vec<(usize, String)>,
    bos: bool,
    faithfulness: bool,
) -> PyResult<Vec<(usize, String, String)>> {
    let m = this.inner.clone();
    engine(py, move || {
        // many texts to a forward: each record is its one-text run's
        let refs: Vec<(usize, &str)> = items.iter().map(|(i, t)| (*i, t.as_str())).collect();
        let recs = attnscope::commands::corpus::text_records(&m, &refs, bos, faithfulness, |_| {})?;
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

/// `Model.head_roles`'s body (its documentation is there, in the Python surface).
pub(crate) fn head_roles(
    this: &Model,
    py: Python<'_>,
    items: Vec<(usize, String)>,
    bos: bool,
) -> PyResult<Vec<(usize, String, String)>> {
    let m = this.inner.clone();
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

/// `Model.head_roles_document`'s body (its documentation is there, in the Python surface).
pub(crate) fn head_roles_document(this: &Model, scores: Vec<String>) -> PyResult<String> {
    let all: Vec<attnscope::commands::heads::HeadRoles> = scores
        .iter()
        .map(|s| serde_json::from_str(s))
        .collect::<Result<_, _>>()
        .map_err(|e| PyValueError::new_err(format!("not a head-roles record: {e}")))?;
    if all.is_empty() {
        return Err(PyValueError::new_err("no scores to merge"));
    }
    let doc = attnscope::commands::heads::document(&this.inner, &all, serde_json::Map::new())
        .map_err(to_py)?;
    serde_json::to_string(&doc).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// `Model.corpus`'s body (its documentation is there, in the Python surface).
#[allow(clippy::too_many_arguments)]
pub(crate) fn corpus<'py>(
    this: &Model,
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
    use attnscope::commands::corpus::{load_texts, parse_shard, run, CorpusInput, CorpusRequest};
    check_epsilon(epsilon)?;
    let req = CorpusRequest {
        limit: limit.map(|l| count(l, "limit")).transpose()?,
        shard: match &shard {
            Some(s) => {
                parse_shard(s).map_err(|e| PyValueError::new_err(format!("shard={s:?}: {e:#}")))?
            }
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
    let m = this.inner.clone();
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

/// `attnscope corpus merge`: the aggregate of the record files `files` (`corpus --out`'s), as
/// Python objects.
#[pyfunction]
#[pyo3(signature = (files, epsilon = 0.3))]
pub(crate) fn corpus_merge(
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
pub(crate) fn check_epsilon(epsilon: f32) -> PyResult<()> {
    attnscope::analysis::request::check_weight_threshold(epsilon.into())
        .map_err(|e| PyValueError::new_err(format!("epsilon={epsilon}: {e}")))
}

/// A corpus aggregate's `epsilon` as `corpus --json` prints it: pythonize widens the f32 to the
/// f64 of its bits (0.30000001192092896), the CLI's JSON writes its shortest decimal (0.3),
/// which is what the user gave.
pub(crate) fn epsilon_as_given(obj: Bound<'_, PyAny>, epsilon: f32) -> PyResult<Bound<'_, PyAny>> {
    if let Ok(d) = obj.cast::<pyo3::types::PyDict>() {
        if d.contains("epsilon")? {
            let shortest: f64 = epsilon.to_string().parse().expect("an f32's decimal");
            d.set_item("epsilon", shortest)?;
        }
    }
    Ok(obj)
}

/// The texts of a corpus file (.txt: one per line, .jsonl: strings or {"text": ...}), or of the
/// built-in corpus for None, with the ids `attnscope corpus` gives them (their index).
#[pyfunction]
#[pyo3(signature = (path = None))]
pub(crate) fn corpus_texts(
    py: Python<'_>,
    path: Option<std::path::PathBuf>,
) -> PyResult<Vec<String>> {
    engine(py, move || {
        Ok(attnscope::commands::corpus::load_texts(path.as_deref())?.0)
    })
}
