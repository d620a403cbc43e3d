//! Attribution of a generated answer (issue #40, item 3), inseq-style: each answer token's
//! log-probability, teacher-forced on the generated text, attributed to the prompt tokens and to
//! the answer tokens before it. For answer token `j` the input is `prompt + answer[..j]` and the
//! target `answer[j]`; the matrix has a row per position (prompt, then answer) and a column per
//! answer token, `NaN` where the position is not in that token's input (position ≥ prompt + j).
//!
//! - The gradient methods (and AttnLRP, value zeroing, ALTI-Logit) run what `attribute` runs
//!   ([`decoder_scores`]) on each answer token's input (one backward or decomposition each, integrated gradients'
//!   steps each).
//! - `occlusion` (deletion, `f(input) − f(input without token i)`, as `attribute --method
//!   occlusion`) runs one forward per deleted token for every answer token at once: causality
//!   makes the logits at position `p` of `sequence without i` those of the input `prefix without
//!   i`, so one pass over the whole teacher-forced sequence gives every answer token's cell
//!   (instead of one forward per answer token per deleted token). The deletions reuse the full
//!   run's keys and values before the deleted position and run many to a forward
//!   ([`Model::forward_batch`]).

use super::scores::{check_steps, decoder_scores};
use super::vocab::Method;
use crate::model::backward::Metric;
use crate::model::capture::NoCapture;
use crate::model::forward::{log_softmax, KvPrefix, RunOptions, Segment};
use crate::model::{Error, Model, Result};

/// New positions per batched forward of occlusion's deletions.
const BATCH_ROWS: usize = 2048;
/// Logits rows held per batched forward (each is a vocabulary of f32): at most ~256 MB.
const LOGITS_BYTES: usize = 256 << 20;

/// The attribution matrix of a generated answer.
#[derive(Clone, Debug)]
pub struct GenAttribution {
    /// The method.
    pub method: Method,
    /// The prompt's length: rows `..prompt_len` are prompt tokens, the rest answer tokens.
    pub prompt_len: usize,
    /// The prompt's ids, then the answer's.
    pub ids: Vec<u32>,
    /// `[prompt_len + answer_len][answer_len]`: row `i` (a position), column `j` (an answer
    /// token): position `i`'s score for answer token `j`; `NaN` where `i ≥ prompt_len + j`.
    pub matrix: Vec<Vec<f32>>,
    /// Each answer token's teacher-forced `log p(answer[j] | prompt + answer[..j])`.
    pub logprobs: Vec<f32>,
    /// Integrated gradients' midpoints (`None` for the other methods).
    pub steps: Option<usize>,
}

impl GenAttribution {
    /// The answer's length (the matrix's columns).
    pub fn answer_len(&self) -> usize {
        self.ids.len() - self.prompt_len
    }
}

/// Attributes each token of `answer` (generated after `prompt`) to the positions before it, by
/// `method` (`steps`: integrated gradients' midpoints). `progress(done, total)` reports answer
/// tokens (gradient methods) or deletions (occlusion).
pub fn attribute_generation(
    model: &Model,
    prompt: &[u32],
    answer: &[u32],
    method: Method,
    steps: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<GenAttribution> {
    model.require_decoder("attribution of a generation")?;
    if prompt.is_empty() || answer.is_empty() {
        return Err(Error::OutOfRange {
            what: "attribution of a generation".into(),
            value: format!("{} prompt and {} answer tokens", prompt.len(), answer.len()),
            range: "at least one of each".into(),
        });
    }
    if method == Method::IntegratedGradients {
        check_steps(steps)?;
    }
    let ids: Vec<u32> = prompt.iter().chain(answer).copied().collect();
    let (p, a, n) = (prompt.len(), answer.len(), ids.len());
    if n - 1 > model.dims.context_len {
        return Err(Error::TooLong {
            n_tokens: n - 1,
            limit: model.dims.context_len,
            model: model.info.name.clone(),
        });
    }
    let (matrix, logprobs) = if method == Method::Occlusion {
        occlusion(model, &ids, p, progress)?
    } else {
        let mut matrix = vec![vec![f32::NAN; a]; n];
        let mut logprobs = Vec::with_capacity(a);
        progress(0, a);
        for j in 0..a {
            let metric = Metric::LogProb(Some(ids[p + j]));
            let s = decoder_scores(model, &ids[..p + j], method, steps, metric, &mut |_, _| {})?;
            s.check_finite(method)?;
            for (i, &score) in s.scores.iter().enumerate() {
                matrix[i][j] = score;
            }
            logprobs.push(s.logprob);
            progress(j + 1, a);
        }
        (matrix, logprobs)
    };
    Ok(GenAttribution {
        method,
        prompt_len: p,
        ids,
        matrix,
        logprobs,
        steps: (method == Method::IntegratedGradients).then_some(steps),
    })
}

/// Occlusion by deletion for every answer token at once: (matrix, base log-probabilities).
fn occlusion(
    model: &Model,
    ids: &[u32],
    p: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(Vec<Vec<f32>>, Vec<f32>)> {
    let (n, a) = (ids.len(), ids.len() - p);
    let (base, kv) = teacher_forced_run(model, ids, p)?;
    let mut matrix = vec![vec![f32::NAN; a]; n];
    let variants = deletion_variants(ids, p);
    let total = variants.len();
    progress(0, total);
    let max_logits = (LOGITS_BYTES / (4 * model.dims.vocab_size.max(1))).max(1);
    let mut rest = variants.as_slice();
    let mut done = 0;
    while !rest.is_empty() {
        let (batch, later) = rest.split_at(batch_len(rest, max_logits));
        let segments: Vec<Segment> = batch
            .iter()
            .map(|v| Segment {
                tokens: &v.tokens[v.reuse..],
                reuse: v.reuse,
                knockout: Vec::new(),
                logits_at: v.answers.iter().map(|&j| p + j - 2).collect(),
            })
            .collect();
        let out = model.forward_batch(Some(&kv), &segments)?;
        for (v, rows) in batch.iter().zip(out) {
            for (&j, l) in v.answers.iter().zip(rows) {
                matrix[v.deleted][j] = base[j] - log_softmax(&l)[ids[p + j] as usize];
            }
        }
        done += batch.len();
        progress(done, total);
        rest = later;
    }
    check_occlusion_finite(&matrix, p)?;
    Ok((matrix, base))
}

/// The full teacher-forced run over every token but the last answer token (answer j is
/// predicted at p − 1 + j): each answer token's log-probability, and the keys and values the
/// deletions reuse.
fn teacher_forced_run(model: &Model, ids: &[u32], p: usize) -> Result<(Vec<f32>, KvPrefix)> {
    let n = ids.len();
    let full = model.forward(
        &ids[..n - 1],
        &RunOptions {
            logits_at: (p - 1..n - 1).collect(),
            keep_kv: true,
            ..Default::default()
        },
        &mut NoCapture,
    )?;
    let base: Vec<f32> = full
        .logits
        .iter()
        .enumerate()
        .map(|(j, l)| log_softmax(l)[ids[p + j] as usize])
        .collect();
    Ok((base, full.kv.expect("keep_kv was set")))
}

/// The inputs with one token deleted, and the answer tokens each one scores.
struct Variant {
    deleted: usize,
    tokens: Vec<u32>,
    /// The full run's positions reused (those before the deletion).
    reuse: usize,
    answers: Vec<usize>,
}

/// One [`Variant`] per deletable input token that some answer token has in its input.
///
/// Deleting s[i]: answer j (with i in its input, i ≤ p − 1 + j) is predicted at p − 2 + j of
/// the shortened sequence; the positions before i are the full run's, reused (from i − 1
/// where that row's logits are needed: its input lost its last token).
fn deletion_variants(ids: &[u32], p: usize) -> Vec<Variant> {
    let (n, a) = (ids.len(), ids.len() - p);
    let s = &ids[..n - 1];
    (0..n - 1)
        .filter_map(|i| {
            let answers: Vec<usize> = (i.saturating_sub(p - 1)..a)
                .filter(|&j| p + j >= 2)
                .collect();
            if answers.is_empty() {
                return None;
            }
            let tokens: Vec<u32> = s[..i].iter().chain(&s[i + 1..]).copied().collect();
            let reuse = i.min(p + answers[0] - 2);
            Some(Variant {
                deleted: i,
                tokens,
                reuse,
                answers,
            })
        })
        .collect()
}

/// How many of `rest` go in the next batched forward: at least one, then as many as fit in
/// [`BATCH_ROWS`] new positions and `max_logits` logits rows.
fn batch_len(rest: &[Variant], max_logits: usize) -> usize {
    let (mut take, mut rows, mut logits) = (0, 0, 0);
    for v in rest {
        let (new, l) = (v.tokens.len() - v.reuse, v.answers.len());
        if take > 0 && (rows + new > BATCH_ROWS || logits + l > max_logits) {
            break;
        }
        take += 1;
        rows += new;
        logits += l;
    }
    take
}

/// Refuses a non-finite occlusion score among the cells that are in their answer token's input.
fn check_occlusion_finite(matrix: &[Vec<f32>], p: usize) -> Result<()> {
    let n = matrix.len();
    let a = matrix.first().map_or(0, Vec::len);
    if let Some((i, j)) = (0..n).find_map(|i| {
        (0..a)
            .find(|&j| i < p + j && p + j >= 2 && !matrix[i][j].is_finite())
            .map(|j| (i, j))
    }) {
        return Err(Error::NonFinite {
            what: format!("the occlusion score of position {i} for answer token {j}"),
            layer: None,
        });
    }
    Ok(())
}
