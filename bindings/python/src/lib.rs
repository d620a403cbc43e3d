//! `attnscope._native`: the Rust engine for Python. The Python package (`python/attnscope/`)
//! builds the TransformerLens-shaped API on these few calls:
//! - [`model::Model`]: load, tokenize, and `run` a forward that captures exactly the (layer, hook) pairs
//!   asked for, handing each tensor to numpy without a copy (the Rust buffer becomes the
//!   array's memory);
//! - the analyses as typed calls on `Model` (`inspect`, `faithfulness`, `ablate`, `patch`,
//!   `heads`, `sinks`, `compare`, `capture`, `corpus`, `attribute`, ...) and [`corpus::corpus_merge`]: the
//!   library's own functions, their reports handed to Python as objects ([`engine::to_object`]), never
//!   through command-line arguments or JSON text;
//! - `Model.view_html` / [`views::pattern_page`]: the HTML page of `attnscope view`.
//!
//! The GIL is released while the engine runs, Python's signal handlers are asked between layers
//! (so Ctrl-C interrupts a long forward), and no panic crosses into Python.
//!
//! One module per domain: [`model`] (the `Model` class: loading, configuration, tokens, weights,
//! and every method's signature), [`cache`] (captured tensors as numpy arrays), [`hooks`] (the
//! forward with hooks, gradients at hook points), [`analyses`] (the commands' calls),
//! [`corpus`], [`views`] (HTML pages), [`circuits`] (`circuit`, `qk`), [`patching`] (TL's
//! patching sweeps), and [`engine`] (the crossing: no GIL, no panic, errors as exceptions).

use pyo3::prelude::*;

mod analyses;
mod cache;
mod circuits;
mod corpus;
mod engine;
mod hooks;
mod model;
mod patching;
mod views;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    attnscope::model::forward::set_interrupt_check(engine::python_interrupted);
    m.add_class::<model::Model>()?;
    m.add_class::<patching::PatchBase>()?;
    m.add_function(wrap_pyfunction!(corpus::corpus_merge, m)?)?;
    m.add_function(wrap_pyfunction!(views::pattern_page, m)?)?;
    m.add_function(wrap_pyfunction!(hooks::hook_suffixes, m)?)?;
    m.add_function(wrap_pyfunction!(hooks::global_hooks, m)?)?;
    m.add_function(wrap_pyfunction!(corpus::corpus_texts, m)?)?;
    m.add_function(wrap_pyfunction!(views::write_new_file, m)?)?;
    m.add_function(wrap_pyfunction!(hooks::full_hook_name, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
