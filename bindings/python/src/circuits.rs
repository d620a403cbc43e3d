//! The circuit calls of `Model`: `attnscope circuit`'s report with its edge scores as
//! a `[nodes, readers]` matrix, and `attnscope qk`'s split.

use crate::engine::{engine, to_object};
use attnscope::analysis::circuit::{read_pairs, Method, MetricKind, Pair};
use attnscope::analysis::vocab::Target;
use attnscope::commands::circuit::{CircuitOptions, CircuitReport};
use attnscope::commands::qk::{Against, QkOptions};
use attnscope::model::Model;
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;

/// What Python asks of a circuit: one pair, or a JSONL text of pairs (`source` names it).
pub struct CircuitArgs {
    pub one: Option<[String; 4]>,
    pub pairs: Option<(String, String)>,
    pub method: String,
    pub steps: Option<usize>,
    pub metric: String,
    pub evaluate: bool,
    pub exact_edges: usize,
    pub bos: bool,
}

/// The arguments checked into the command's options, with the CLI's rules and messages.
fn options(a: CircuitArgs) -> PyResult<CircuitOptions> {
    let method = match (a.method.as_str(), a.steps) {
        ("eap", None) => Method::Eap,
        ("eap", Some(_)) => return Err(bad("steps is EAP-IG's: give method=\"eap-ig\"")),
        ("eap-ig", Some(0)) => return Err(bad("steps=0: EAP-IG needs at least one step")),
        ("eap-ig", steps) => Method::EapIg {
            steps: steps.unwrap_or(5),
        },
        (m, _) => return Err(bad(format!("method={m:?}: valid values are eap, eap-ig"))),
    };
    let metric = match a.metric.as_str() {
        "logit-diff" => MetricKind::LogitDiff,
        "logprob" => MetricKind::Logprob,
        m => {
            return Err(bad(format!(
                "metric={m:?}: valid values are logit-diff, logprob"
            )))
        }
    };
    let pairs = match (a.one, a.pairs) {
        (Some([clean, corrupt, answer, wrong]), None) => vec![Pair {
            clean,
            corrupt,
            answer: target(&answer, "answer")?,
            wrong: target(&wrong, "wrong")?,
        }],
        (None, Some((text, source))) => read_pairs(&text, &source).map_err(crate::engine::to_py)?,
        _ => {
            return Err(bad(
                "give clean, corrupt, answer and wrong, or pairs (a JSONL file or a list of dicts), not both",
            ))
        }
    };
    Ok(CircuitOptions {
        force_bos: a.bos,
        evaluate: a.evaluate,
        exact_edges: a.exact_edges,
        ..CircuitOptions::new(pairs, method, metric)
    })
}

fn bad(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}

/// A token's text or its id (a string of digits), as `--answer` reads it (never `next`).
fn target(t: &str, what: &str) -> PyResult<Target> {
    match t.parse::<Target>() {
        Ok(Target::Next) => Err(bad(format!(
            "{what}=\"next\": give a token's text or its id"
        ))),
        Ok(t) => Ok(t),
        Err(e) => Err(bad(format!("{what}={t:?}: {e}"))),
    }
}

/// The circuit: (the report without its `edges`, as Python objects; the scores as a float32
/// `[n_nodes, n_readers]` matrix, NaN where no edge joins the pair; the edges ranked as the
/// JSON ranks them, as each edge's node index, reader index and score).
pub fn run_circuit<'py>(
    py: Python<'py>,
    model: &Arc<Model>,
    a: CircuitArgs,
) -> PyResult<Bound<'py, PyAny>> {
    let opts = options(a)?;
    let m = model.clone();
    let mut report = engine(py, move || attnscope::commands::circuit::run(&m, &opts))?;
    let (from, to, scores) = edge_indices(&report)?;
    let (n, r) = (report.n_nodes, report.n_readers);
    let mut matrix = vec![f32::NAN; n * r];
    for ((&u, &v), &s) in from.iter().zip(&to).zip(&scores) {
        matrix[u as usize * r + v as usize] = s;
    }
    report.edges = Vec::new();
    let out = (
        to_object(py, &report)?,
        PyArray1::from_vec(py, matrix).reshape([n, r])?,
        PyArray1::from_vec(py, from),
        PyArray1::from_vec(py, to),
        PyArray1::from_vec(py, scores),
    );
    Ok(out.into_pyobject(py)?.into_any())
}

/// Each ranked edge's upstream node index and reader index (into the report's nodes, readers
/// counted from 0 after the upstream nodes), and its score.
#[allow(clippy::type_complexity)]
fn edge_indices(r: &CircuitReport) -> PyResult<(Vec<i64>, Vec<i64>, Vec<f32>)> {
    let index = |upstream: bool| -> HashMap<&str, i64> {
        r.nodes
            .iter()
            .filter(|n| n.upstream == upstream)
            .enumerate()
            .map(|(i, n)| (n.name.as_str(), i as i64))
            .collect()
    };
    let (ups, downs) = (index(true), index(false));
    let mut out = (Vec::new(), Vec::new(), Vec::new());
    for e in &r.edges {
        let (Some(&u), Some(&v)) = (ups.get(e.from.as_str()), downs.get(e.to.as_str())) else {
            return Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
                "edge {} -> {} names a node the report does not list (a bug)",
                e.from, e.to
            )));
        };
        out.0.push(u);
        out.1.push(v);
        out.2.push(e.score);
    }
    Ok(out)
}

/// `attnscope qk`'s split of head `layer`.`head`'s score on `text`, as Python objects.
#[allow(clippy::too_many_arguments)]
pub fn run_qk<'py>(
    py: Python<'py>,
    model: &Arc<Model>,
    text: String,
    (layer, head): (usize, usize),
    (query, key): (Option<usize>, Option<usize>),
    against: &str,
    bos: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let against: Against = against
        .parse()
        .map_err(|e: String| bad(format!("against={against:?}: {e}")))?;
    let m = model.clone();
    let r = engine(py, move || {
        let tokens = m.encode(&text, bos)?;
        let opts = QkOptions {
            tokens,
            layer,
            head,
            query,
            key,
            against,
        };
        attnscope::commands::qk::run(&m, &opts)
    })?;
    to_object(py, &r)
}
