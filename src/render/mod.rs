//! Renderers: they format the reports and arrays that `commands/` and the analyses made (text,
//! HTML, PNG, SVG, npy, npz, safetensors). They run no model: no forward, no model loaded, no
//! analysis that runs one (`tests/layering.rs`; the rule is `crate::commands`'s header).
pub mod circuit_page;
pub mod compare_page;
pub mod direct;
pub mod gen_attribute;
pub mod heatmap;
pub mod html;
pub mod npy;
pub mod patch_page;
pub mod progress;
pub mod report;
pub mod sparse;
pub mod table;
pub mod tensorfile;
pub mod view;

/// Every writer's one rule ([`crate::analysis::files`]), where renderers write.
pub use crate::analysis::files::{write_new_file, Output};

/// How `inspect` and `capture` end their output with their own timings: `(load X s, what Y s`
/// (the caller closes the parenthesis); `bench` reads them back with the same words.
pub fn timings_opening(load_s: f64, what: &str, after_s: f64) -> String {
    format!("(load {load_s:.2} s, {what} {after_s:.3} s")
}
