//! `attnscope faithfulness` (and Python's `faithfulness`): attention's rankings of the input
//! tokens against what occluding each token does, beside the gradient-based and context-mixing
//! rankings ([`crate::analysis::faithfulness`]).

pub use crate::analysis::faithfulness::{
    FaithReport, FaithRequest as FaithOptions, Faithfulness, Gradients,
};
use crate::model::Model;

/// The rankings and the occlusions of `tokens` for `opts`' target; `tick(done, total)` after
/// each forward.
pub fn run(
    model: &Model,
    tokens: &[u32],
    opts: &FaithOptions,
    tick: &mut dyn FnMut(usize, usize),
) -> anyhow::Result<Faithfulness> {
    Ok(crate::analysis::faithfulness::faithfulness(
        model, tokens, opts, tick,
    )?)
}
