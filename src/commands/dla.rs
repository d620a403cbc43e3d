//! `attnscope dla` (and Python's `dla`): each head's, MLP's and the embedding's direct
//! contribution to the answer's logit at the last position ([`crate::analysis::dla`]).

pub use crate::analysis::dla::DlaReport;
use crate::analysis::vocab::Target;
use crate::model::Model;

/// The logit decomposed.
#[derive(Clone, Debug)]
pub struct DlaOptions {
    /// the token whose logit is decomposed (`next`: the model's top token)
    pub answer: Target,
    /// decompose the logit difference answer − wrong instead
    pub wrong: Option<Target>,
}

/// The direct logit attribution of `opts`' logit on `tokens`: one forward.
pub fn run(model: &Model, tokens: &[u32], opts: &DlaOptions) -> anyhow::Result<DlaReport> {
    Ok(crate::analysis::dla::dla(
        model,
        tokens,
        &opts.answer,
        opts.wrong.as_ref(),
    )?)
}
