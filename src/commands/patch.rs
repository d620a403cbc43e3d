//! `attnscope patch` (and Python's `patch`): activation patching of a corrupted text with a
//! clean one's activations ([`crate::analysis::intervene`]), and with `approx` attribution
//! patching's first-order estimate beside it ([`crate::analysis::attrpatch`]).

use crate::analysis::attrpatch::{agreement, attribution_patch};
pub use crate::analysis::attrpatch::{Agreement, ApproxKind, ApproxReport};
pub use crate::analysis::intervene::{PatchOptions, PatchReport};
use crate::analysis::request::usage;
use crate::model::Model;

/// The clean and corrupted runs' tokens (the same length).
#[derive(Clone, Debug)]
pub struct PatchInput {
    /// the clean text's tokens
    pub clean: Vec<u32>,
    /// the corrupted text's tokens
    pub corrupt: Vec<u32>,
}

/// Attribution patching's estimate for the patched hook, and how it agrees with the exact grid.
#[derive(Clone, Debug)]
pub struct Approx {
    /// every hook's estimate (two forwards and one backward)
    pub report: ApproxReport,
    /// the patched hook's
    pub kind: ApproxKind,
    /// its agreement with the exact cells
    pub agreement: Agreement,
}

/// The exact grid of `opts` on `input`; `tick(done, total)` after each patched run.
pub fn run(
    model: &Model,
    input: &PatchInput,
    opts: &PatchOptions,
    tick: impl FnMut(usize, usize),
) -> anyhow::Result<PatchReport> {
    let (clean, corrupt) = (&input.clean, &input.corrupt);
    Ok(crate::analysis::intervene::patch(
        model, clean, corrupt, opts, tick,
    )?)
}

/// Attribution patching's estimate of `exact` (the grid [`run`] gave for `opts` on `input`):
/// two forwards and one backward.
pub fn approx(
    model: &Model,
    input: &PatchInput,
    opts: &PatchOptions,
    exact: &PatchReport,
) -> anyhow::Result<Approx> {
    let (clean, corrupt) = (&input.clean, &input.corrupt);
    let r = attribution_patch(model, clean, corrupt, exact.answer.id, exact.wrong.id)?;
    let kind = r
        .kind(opts.hook)
        .cloned()
        .ok_or_else(|| usage("--approx: no estimate for this hook"))?;
    let agreement = agreement(&exact.results, &kind);
    Ok(Approx {
        report: r,
        kind,
        agreement,
    })
}
