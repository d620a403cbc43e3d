//! `attnscope corpus` (and Python's `corpus`): sink and concentration statistics over many texts,
//! one forward each, with confidence intervals; shardable, resumable (`out`'s records) and
//! mergeable ([`crate::analysis::corpus_run`]).

pub use crate::analysis::corpus::text_records;
pub use crate::analysis::corpus_run::{
    load_texts, merge_files as merge, parse_shard, CorpusAggregate, CorpusOutcome, CorpusRequest,
};
use crate::model::Model;

/// The texts and the name of their source.
#[derive(Clone, Debug)]
pub struct CorpusInput {
    /// the texts (their index is their id)
    pub texts: Vec<String>,
    /// where they came from (`the built-in corpus`, a file's name)
    pub source: String,
}

/// The aggregate of `req`'s texts of `input` (its shard, up to its limit), the records appended
/// to `req.out` where given; `note` gets what a resumed run says, `progress(done, total)` after
/// each text.
pub fn run(
    model: &Model,
    input: &CorpusInput,
    req: &CorpusRequest,
    note: &mut dyn FnMut(&str),
    progress: &mut dyn FnMut(usize, usize),
) -> anyhow::Result<CorpusOutcome> {
    crate::analysis::corpus_run::run_corpus(model, &input.texts, &input.source, req, note, progress)
}
