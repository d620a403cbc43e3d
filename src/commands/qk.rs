//! `attnscope qk` (and Python's `qk`): one head's pre-softmax score of a query and a key split
//! exactly into (query-side component × key-side component) terms ([`crate::analysis::qk`]).

pub use crate::analysis::qk::{Against, QkOptions, QkReport};
use crate::model::Model;

/// The split `opts` asks for: one forward capturing what the split needs.
pub fn run(model: &Model, opts: &QkOptions) -> anyhow::Result<QkReport> {
    crate::analysis::qk::qk(model, opts)
}
