//! `attnscope inspect` (and Python's `inspect`): the lesson's tables on a model and its input,
//! one forward ([`crate::analysis::inspect`] computes them).

pub use crate::analysis::inspect::{Inspected, Request as InspectOptions};
use crate::model::Model;

/// The input `inspect` runs: its tokens and, for an encoder's sentence pair, the token types
/// the model runs and each token's segment (which text it belongs to).
#[derive(Clone, Debug, Default)]
pub struct InspectInput {
    /// the token ids
    pub tokens: Vec<u32>,
    /// a pair's token types (`None`: one text, all 0)
    pub types: Option<Vec<u32>>,
    /// a pair's segments, 0 then 1 (`None`: one text)
    pub segments: Option<Vec<u32>>,
}

/// The tables `opts` asks for on `input`: a decoder's report (attention, sinks, the next
/// token) or an encoder's (\[CLS\]/\[SEP\]/punctuation shares, one query's rows).
pub fn run(
    model: &Model,
    input: &InspectInput,
    opts: &InspectOptions,
) -> anyhow::Result<Inspected> {
    crate::analysis::inspect::inspect(
        model,
        &input.tokens,
        input.types.as_deref(),
        input.segments.as_deref(),
        opts,
    )
}
