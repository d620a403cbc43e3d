//! `attnscope generate` (and Python's `generate`): the answer token by token on a KV cache, with
//! what each answer token's query attended to ([`crate::model::generate`]), and why each answer
//! token came ([`crate::analysis::gen_attribute`]).

pub use crate::analysis::gen_attribute::GenAttribution;
use crate::analysis::vocab::Method;
pub use crate::model::generate::{GenOptions, GenToken, Generation};
use crate::model::Model;

/// The answer to `prompt`'s tokens as `opts` samples it; `on_token` sees each token as it comes.
pub fn run(
    model: &Model,
    prompt: &[u32],
    opts: &GenOptions,
    on_token: impl FnMut(&GenToken),
) -> anyhow::Result<Generation> {
    Ok(model.generate(prompt, opts, on_token)?)
}

/// Why each of `answer`'s tokens came after `prompt` and the answer before it, by `method`
/// (integrated gradients with `steps` midpoints); `tick(done, total)` as the runs go.
pub fn attribution(
    model: &Model,
    prompt: &[u32],
    answer: &[u32],
    method: Method,
    steps: usize,
    tick: &mut dyn FnMut(usize, usize),
) -> anyhow::Result<GenAttribution> {
    Ok(crate::analysis::gen_attribute::attribute_generation(
        model, prompt, answer, method, steps, tick,
    )?)
}
