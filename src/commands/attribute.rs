//! `attnscope attribute` (and Python's `attribute`): a score per input token for the last
//! position's prediction by one method ([`crate::analysis::attribute`]).

pub use crate::analysis::attribute::{AttributeOptions, AttributeReport};
use crate::model::Model;

/// The scores of `tokens` by `opts.method`; `tick(done, total)` as the forwards and backwards
/// run.
pub fn run(
    model: &Model,
    tokens: &[u32],
    opts: &AttributeOptions,
    tick: &mut dyn FnMut(usize, usize),
) -> anyhow::Result<AttributeReport> {
    Ok(crate::analysis::attribute::attribute(
        model, tokens, opts, tick,
    )?)
}
