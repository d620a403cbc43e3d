//! attnscope: compute, see and measure the attention inside real language models, exactly, on a
//! CPU.
//!
//! The crate follows the data: `text → tokens → forward (with capture) → attention → analyses →
//! reports → renderers`. Its layers, each calling only the ones below it:
//! - [`reference`](mod@reference): attention from scratch on slices, the readable oracle every kernel and the
//!   forward are checked against;
//! - the model ([`Model`]): loading (GGUF files, Hugging Face folders, aliases such as
//!   `qwen2.5-coder-0.5b`), the [`Tokenizer`], the forward and backward, and the hook points an
//!   [`Observer`] sees ([`Hook`], [`AttnCache`]);
//! - the analyses: functions on what a forward hands out (top keys, entropy, sinks, faithfulness,
//!   patching, attribution, circuits), their words ([`Target`], [`Method`], [`TokenRef`]);
//! - the commands: one function per operation of the `attnscope` command and the Python package,
//!   an options struct in and a serializable report out ([`inspect`], [`capture`], [`view`],
//!   [`faithfulness`], [`ablate`], [`patch`], [`dla`], [`attribute`], [`generate`], [`embed`],
//!   [`corpus`], [`compare`], [`heads`], [`sinks`], [`qk`], [`circuit`], [`heatmap`]);
//! - the renderers: reports and arrays into text, HTML, PNG, SVG and tensor files
//!   ([`render_report`], [`view_page`], [`heatmap_png`], [`heatmap_svg`], [`to_npy`],
//!   [`to_npz`], [`to_safetensors`]); they run no model.
//!
//! The front ends are separate crates: the `attnscope` binary (its `cli`, `bench` and `serve`
//! live in `src/cli/`, the binary's own crate) and the Python package (`bindings/python`).
//!
//! What this page lists is the supported surface. The modules behind it (`model`, `analysis`,
//! `commands`, `render`, `kernels`) stay public for the project's own tests, benchmarks, fuzz
//! targets and Python binding, but are hidden from these docs and may change without notice.
//!
//! # Example
//!
//! A tiny generated model (the `test-fixtures` feature, on by default), loaded and run with every
//! head's pattern captured; each pattern row is a distribution over the keys a query may see:
//!
//! ```
//! use attnscope::{AttnCache, CaptureSpec, Model, Precision, RunOptions};
//! use attnscope::fixtures::{tiny_model, write_gguf, Arch, GgmlDType};
//!
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("tiny.gguf");
//! write_gguf(&tiny_model(Arch::Qwen2, 1), Arch::Qwen2, GgmlDType::F32, &path)?;
//! let model = Model::load(path.to_str().unwrap(), Precision::Exact, false)?;
//!
//! let tokens = model.encode("hello world", false)?;
//! let mut cache = AttnCache::new(&CaptureSpec::patterns(), tokens.len());
//! let out = model.forward(&tokens, &RunOptions::last_logits(tokens.len()), &mut cache)?;
//! assert_eq!(out.logits[0].len(), model.dims.vocab_size);
//!
//! let pattern = cache.pattern(0).expect("layer 0 was captured");
//! let last = tokens.len() - 1;
//! let row = pattern.row_at(0, last).expect("head 0, last query");
//! assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

#[doc(hidden)]
pub mod analysis;
#[doc(hidden)]
pub mod commands;
#[doc(hidden)]
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
#[doc(hidden)]
pub mod kernels;
#[doc(hidden)]
pub mod model;
pub mod reference;
#[doc(hidden)]
pub mod render;

// ---- loading a model, its precision and memory, the error type ----
pub use commands::load::{load, ModelSpec};
pub use model::config::Arch;
pub use model::{Error, Memory, Model, ModelDims, ModelInfo, Precision, Result};

// ---- tokenizing ----
pub use model::tokenize::Tokenizer;

// ---- the forward with capture, and the hook points an observer sees ----
pub use model::capture::{
    hook_name, AttnCache, AttnPattern, CaptureSpec, Captured, Hook, NoCapture, Observer, Queries,
};
pub use model::forward::{ForwardOut, RunOptions};

// ---- the analyses' shared words ----
pub use analysis::vocab::{Method, Target, TokenRef};

// ---- the commands: options in, a report out ----
pub use commands::ablate::{run as ablate, AblateOptions, AblateReport};
pub use commands::attribute::{run as attribute, AttributeOptions, AttributeReport};
pub use commands::capture::{capture, CaptureReport, CaptureRequest};
pub use commands::circuit::{run as circuit, CircuitOptions, CircuitReport};
pub use commands::compare::{run as compare, CompareCommand, CompareReport};
pub use commands::corpus::{run as corpus, CorpusInput, CorpusOutcome, CorpusRequest};
pub use commands::dla::{run as dla, DlaOptions, DlaReport};
pub use commands::embed::{run as embed, EmbedOptions, EmbedReport};
pub use commands::faithfulness::{run as faithfulness, FaithOptions, FaithReport, Faithfulness};
pub use commands::generate::{run as generate, GenOptions, GenToken, Generation};
pub use commands::heads::{run as heads, HeadRoles, HeadsInput};
pub use commands::heatmap::{heatmap, HeatmapOptions, HeatmapReport};
pub use commands::inspect::{run as inspect, InspectInput, InspectOptions, Inspected};
pub use commands::patch::{run as patch, PatchInput, PatchOptions, PatchReport};
pub use commands::qk::{run as qk, QkOptions, QkReport};
pub use commands::sinks::{run as sinks, SinksInput, SinksOptions, SinksReport};
pub use commands::view::{view, view_html, ViewOptions};

// ---- the renderers ----
pub use analysis::inspect::InspectReport;
pub use render::heatmap::{png as heatmap_png, svg as heatmap_svg};
pub use render::npy::to_npy;
pub use render::report::render as render_report;
pub use render::tensorfile::{to_npz, to_safetensors, NamedTensor};
pub use render::view::{page as view_page, ViewReport};

/// The tiny generated models the tests and the examples build: a random two-layer model of a
/// family, written as a GGUF file or a Hugging Face folder (the `test-fixtures` feature, on by
/// default).
#[cfg(feature = "test-fixtures")]
pub mod fixtures {
    pub use crate::model::config::Arch;
    pub use crate::model::tiny::{tiny_model, write_gguf, write_hf_folder};
    pub use candle_core::quantized::GgmlDType;
}
