//! The crossing between Python and the engine: a call without the GIL that no panic escapes
//! ([`engine`]), the engine's errors as Python's exceptions ([`to_py`]), Ctrl-C between layers,
//! reports as Python objects ([`to_object`]) and the checks of arguments every domain shares.

use attnscope::analysis::vocab::Target;
use attnscope::model::Error as ModelError;
use pyo3::exceptions::{
    PyFileExistsError, PyFileNotFoundError, PyFloatingPointError, PyKeyboardInterrupt, PyOSError,
    PyRuntimeError, PyValueError,
};
use pyo3::prelude::*;

/// The Python exception for an engine error, with the CLI's message.
pub(crate) fn to_py(e: anyhow::Error) -> PyErr {
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

thread_local! {
    /// What a signal handler raised when the engine ran it ([`python_interrupted`]), kept for
    /// this thread's [`engine`] call to raise: Python would have raised it there.
    static SIGNALLED: std::cell::RefCell<Option<PyErr>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` without the GIL; a panic inside becomes a RuntimeError, never a crash. A signal
/// handler that raised while it ran (Ctrl-C's KeyboardInterrupt, a SIGALRM handler's timeout)
/// is raised here, whatever `f` returned: a KeyboardInterrupt with the engine's message when the
/// engine stopped for it, the handler's own exception otherwise; never lost.
pub(crate) fn engine<R: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> anyhow::Result<R> + Send,
) -> PyResult<R> {
    // one left by a call that ran the handler outside an engine call: raised before running
    if let Some(e) = SIGNALLED.with(|s| s.borrow_mut().take()) {
        return Err(e);
    }
    let r = py.detach(|| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    if let Some(e) = SIGNALLED.with(|s| s.borrow_mut().take()) {
        let stopped = matches!(&r, Ok(Err(err)) if err.chain().any(|c| {
            matches!(c.downcast_ref::<ModelError>(), Some(ModelError::Interrupted))
        }));
        if !e.is_instance_of::<PyKeyboardInterrupt>(py) {
            return Err(e);
        }
        if !stopped {
            return Err(PyKeyboardInterrupt::new_err(
                "interrupted (Ctrl-C); the engine's result was dropped",
            ));
        }
    }
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
pub(crate) fn python_interrupted() -> bool {
    Python::attach(|py| match py.check_signals() {
        Ok(()) => false,
        Err(e) => {
            // the handler's exception, for this thread's engine call to raise (the first one)
            SIGNALLED.with(|s| {
                s.borrow_mut().get_or_insert(e);
            });
            true
        }
    })
}

/// A report as Python objects (dicts, lists, floats), without a JSON round trip: an f32 becomes
/// the Python float of the same value.
pub(crate) fn to_object<'py, T: serde::Serialize>(
    py: Python<'py>,
    v: &T,
) -> PyResult<Bound<'py, PyAny>> {
    pythonize::pythonize(py, v).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// `next`, a token id or one token's text, as the CLI's `--target` reads it.
pub(crate) fn parse_target(t: Option<String>, what: &str) -> PyResult<Option<Target>> {
    t.map(|t| {
        t.parse::<Target>()
            .map_err(|e| PyValueError::new_err(format!("{what}={t:?}: {e}")))
    })
    .transpose()
}

/// A count or an index given from Python (an int): negative ones are refused, naming `what`.
pub(crate) fn count(v: i64, what: &str) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| PyValueError::new_err(format!("{what}={v}: must be 0 or more")))
}
