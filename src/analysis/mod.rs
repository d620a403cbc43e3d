//! Analyses: what attnscope computes from a model's attention, activations and gradients, and
//! each command's analysis as one call the CLI and Python share (an options struct in, a
//! serializable report out). Three layers; a file imports only from its own layer or those below:
//!
//! 1. **Words** ([`vocab`]): the vocabulary every analysis shares: [`vocab::Target`],
//!    [`vocab::TokenRef`], the attribution methods ([`vocab::Method`], [`vocab::ByMethod`]), the
//!    rank statistics (Spearman, Kendall, permutation p-values, top positions), one row's
//!    statistics (top-k, entropy, rollout, ...), the faithfulness metric rows, the patching words.
//!    Pure functions and types; no model is run.
//! 2. **Building blocks** that several analyses use. Pure: `norms` (norm-based attention, from
//!    captured patterns and the model's weights), `sinkmetrics` (Gu's α₁, Sun's massive
//!    activations as an observer), `stream`, `measure`, `request` (usage errors), `files` (the
//!    files read and written). **Running the model**: `collect` (the [`collect::Collector`]
//!    observer and [`collect::last_query_attention`], one forward), `edit` (editing observers and
//!    the runner of edited variants), `occlusion` (a text's occluded variants, memoized),
//!    `enc_target` (an encoder's target vector, occlusion by cosine), `mixing` (value zeroing,
//!    ALTI-Logit), `scores` (each attribution method's scores: the one place a method is
//!    computed, for `attribute` and `faithfulness` alike), `head_scoring` (what the decoder's and
//!    the encoder's head-role scorers share: `HeadRoles`, the streamed rows, the watched forward).
//! 3. **Features**, one per command (or its encoder half), each running the model through the
//!    blocks: `inspect` + `encoder`, `compare`, `heads` + `heads_encoder`, `faithfulness` +
//!    `enc_faith`, `attribute`, `gen_attribute` (`generate --attribute`), `intervene` (`ablate`,
//!    `patch`), `attrpatch` (`patch --approx`), `dla`, `qk`, `sinks`, `corpus` +
//!    `corpus_encoder` + `corpus_run`, `circuit/`. A feature imports no other feature, but for
//!    a command and its own parts: `inspect`→`encoder`, `faithfulness`→`enc_faith`,
//!    `heads`→`heads_encoder`, `corpus_run`→`corpus`/`corpus_encoder`, `corpus_encoder`→
//!    `corpus`/`encoder`, and `corpus`→`faithfulness` (each record's attention rankings).
//!
//! Only the words and the pure blocks are pure functions; every feature runs the model.

pub mod attribute;
pub mod attrpatch;
pub mod circuit;
pub mod collect;
pub mod compare;
pub mod corpus;
pub mod corpus_encoder;
pub mod corpus_run;
pub mod dla;
pub mod edit;
pub mod enc_faith;
pub mod enc_target;
pub mod encoder;
pub mod faithfulness;
pub mod files;
pub mod gen_attribute;
mod head_scoring;
pub mod heads;
pub mod heads_encoder;
pub mod inspect;
pub mod intervene;
pub mod measure;
pub mod mixing;
pub mod norms;
pub mod occlusion;
pub mod qk;
pub mod request;
pub mod scores;
pub mod sinkmetrics;
pub mod sinks;
pub mod stream;
pub mod vocab;

/// The lesson's sentence: the text `explain`, `compare`, the benches and Python's `heads` use when
/// none is given.
pub const LESSON_SENTENCE: &str = "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc.";
