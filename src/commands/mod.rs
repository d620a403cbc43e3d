//! The commands: one module per user-facing operation, each taking its options and returning
//! its report, and owning the orchestration between (the model's forward, the analyses it runs,
//! the files it writes).
//!
//! The layering rule, which `tests/layering.rs` holds for `render/` and `cli/`:
//! - `cli/` and the Python binding (`bindings/python`) parse arguments into a command's options,
//!   call the command, and print (or hand back) its report; nothing else (`cli/` loads its models
//!   through [`load::load`]; only its benchmarks time the building blocks themselves);
//! - `commands/` load, run, analyse and return a report; they may use `render/`'s writers and
//!   the observers that encode a page as the forward runs (`render::sparse::SparseView`);
//! - `analysis/` computes (its features run the model through the building blocks);
//! - `render/` formats: reports and arrays into text, HTML, PNG, SVG, npy, npz and safetensors.
//!   It runs no forward, loads no model and calls no analysis that runs one.
//!
//! Dependencies go one way: `cli`, bindings → `commands` → `analysis`, `render` → `model`;
//! `render` reads `analysis`'s report types and never imports `commands`.
pub mod ablate;
pub mod attribute;
pub mod capture;
pub mod circuit;
pub mod compare;
pub mod corpus;
pub mod dla;
pub mod embed;
pub mod explain;
pub mod faithfulness;
pub mod generate;
pub mod heads;
pub mod heatmap;
pub mod inspect;
pub mod load;
pub mod patch;
pub mod qk;
pub mod scaling;
pub mod sinks;
pub mod view;
