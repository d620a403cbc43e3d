//! `attnscope sinks` (and Python's `sinks`): a long text's sink profile and per-head statistics,
//! streamed layer by layer ([`crate::analysis::sinks`]).

use crate::analysis::sinks::{max_tokens_of, prefix_bytes, sinks, sinks_tokens};
pub use crate::analysis::sinks::{SinksOptions, SinksReport};
use crate::model::Model;
use crate::render::progress::progress_bar;
use std::path::PathBuf;

/// The text and how far it runs.
#[derive(Clone, Debug)]
pub struct SinksInput {
    /// a long UTF-8 text's file, read only as far as `max_tokens` tokens reach (`None`: `text`)
    pub file: Option<PathBuf>,
    /// the text where there is no file (`None`: the built-in corpus, repeated until
    /// `max_tokens`)
    pub text: Option<String>,
    /// at most this many tokens (`None`: 32768, or the model's context if smaller)
    pub max_tokens: Option<usize>,
}

/// The tokens `input` gives on `model` (BOS first where `opts.bos` or the model asks), and
/// their report, streamed; with `progress`, a progress bar of the layers on standard error
/// (where it is a terminal).
pub fn run(
    model: &Model,
    input: &SinksInput,
    opts: &SinksOptions,
    progress: bool,
) -> anyhow::Result<(Vec<u32>, SinksReport)> {
    // a long text (a book) is read as far as max_tokens tokens can reach, no further
    let reach = prefix_bytes(max_tokens_of(model, input.max_tokens));
    let text = match &input.file {
        Some(f) => Some(crate::analysis::files::read_text_prefix(f, reach)?),
        None => input.text.clone(),
    };
    let tokens = sinks_tokens(model, text.as_deref(), input.max_tokens, opts.bos)?;
    let (d, n) = (&model.dims, tokens.len());
    let bar_ = match progress {
        true => progress_bar("{msg} [{bar:30}] layer {pos}/{len} ({elapsed}, {eta} left)"),
        false => indicatif::ProgressBar::hidden(),
    };
    bar_.set_length(d.n_layers as u64);
    bar_.set_message(format!("{n} tokens"));
    let b2 = bar_.clone();
    let r = sinks(
        model,
        &tokens,
        opts,
        Box::new(move |l| b2.set_position(l as u64 + 1)),
    )?;
    bar_.finish_and_clear();
    Ok((tokens, r))
}
