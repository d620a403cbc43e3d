//! `attnscope circuit` (and Python's `circuit`): which edges carry the answer (EAP, EAP-IG) and,
//! where asked, how faithful the top edges' circuits are ([`crate::analysis::circuit`] computes
//! both); and what the page's head views show.

pub use crate::analysis::circuit::head_views::HeadViews;
use crate::analysis::circuit::head_views::{head_views, touched_heads};
pub use crate::analysis::circuit::{CircuitOptions, CircuitReport};
use crate::model::Model;

/// The circuit `opts` asks for on its pairs.
pub fn run(model: &Model, opts: &CircuitOptions) -> anyhow::Result<CircuitReport> {
    crate::analysis::circuit::circuit(model, opts)
}

/// The attention of the heads `report`'s top edges touch, on the first pair's clean text: what a
/// click on a head shows on the page.
pub fn page_views(
    model: &Model,
    opts: &CircuitOptions,
    report: &CircuitReport,
) -> anyhow::Result<HeadViews> {
    let tokens = model.encode(&opts.pairs[0].clean, opts.force_bos)?;
    let heads = touched_heads(&report.nodes, &report.edges);
    head_views(model, &tokens, &heads)
}
