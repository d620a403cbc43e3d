//! `attnscope ablate` (and Python's `ablate`): every head (and MLP) removed in turn and the
//! change in the target's log-probability ([`crate::analysis::intervene`]).

pub use crate::analysis::intervene::{AblateMethod, AblateOptions, AblateReport};
use crate::model::Model;

/// The ablations `opts` asks for on `tokens`; `tick(done, total)` after each edited run.
pub fn run(
    model: &Model,
    tokens: &[u32],
    opts: &AblateOptions,
    tick: impl FnMut(usize, usize),
) -> anyhow::Result<AblateReport> {
    Ok(crate::analysis::intervene::ablate(
        model, tokens, opts, tick,
    )?)
}
