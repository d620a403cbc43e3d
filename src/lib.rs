//! attnscope: compute, see and measure the attention inside real language models.
//!
//! The crate follows the data: `text → tokens → forward (with capture) → attention → analyses →
//! renderers`.
//! - [`reference`]: attention from scratch on slices, the readable oracle;
//! - [`model`]: loading (GGUF, Hugging Face folders, aliases), tokenizer, the forward with capture;
//! - [`analysis`]: pure functions on captured attention (top-k, entropy, sinks, ...);
//! - [`commands`]: one module per user-facing operation (options in, a report out): the
//!   orchestration of loading, running and analysing;
//! - [`render`]: reports and arrays into text, HTML, PNG, SVG and tensor files; no forward;
//! - [`cli`]: the `attnscope` command (parse into a command's options, call it, print).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod analysis;
pub mod commands;
#[doc(hidden)]
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod kernels;
pub mod model;
pub mod reference;
pub mod render;
