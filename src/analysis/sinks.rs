//! The sink profile of a long text, streamed (`attnscope sinks`, Python `model.sinks`): per layer
//! the share of attention on the first token, per head its statistics, Gu et al.'s sink metric on
//! prompts cut from the text and Sun et al.'s massive activations, with no attention matrix held.

use super::collect::Collector;
use super::measure::{machine, peak_rss_bytes};
use super::sinkmetrics::{gu_alpha, LayerMassive};
use super::stream::{LayerStats, StreamStats};
use crate::model::forward::RunOptions;
use crate::model::{Error, Model, Result};
use serde::Serialize;
use std::time::Instant;

/// Gu et al.'s Sink₁^ε on prompts of `prompt_len` tokens.
#[derive(Clone, Debug, Serialize)]
pub struct GuSinkMetric {
    pub epsilon: f64,
    pub prompt_len: usize,
    pub prompts: usize,
    /// per layer: the share of heads with α₁ > ε, averaged over the prompts
    pub per_layer: Vec<f64>,
    /// the mean over layers (Gu et al.'s Sink₁^ε, a share of all heads)
    pub metric: f64,
}

/// Runs each prompt (a BOS first where the model asks for one is the caller's) and averages the
/// per-layer share of heads whose α₁ exceeds `epsilon`.
pub fn gu_sink_metric(model: &Model, prompts: &[Vec<u32>], epsilon: f64) -> Result<GuSinkMetric> {
    let d = &model.dims;
    let mut per_layer = vec![0f64; d.n_layers];
    let mut prompt_len = 0;
    for p in prompts {
        let n = p.len();
        prompt_len = prompt_len.max(n);
        let mut c = Collector::new(d.n_layers, d.n_heads, n, n - 1);
        model.forward(p, &RunOptions::default(), &mut c)?;
        for (l, share) in per_layer.iter_mut().enumerate() {
            let over = c
                .head_sink(l)
                .iter()
                .filter(|&&a| gu_alpha(a as f64, n) > epsilon)
                .count();
            *share += over as f64 / d.n_heads as f64 / prompts.len() as f64;
        }
    }
    let metric = per_layer.iter().sum::<f64>() / per_layer.len().max(1) as f64;
    Ok(GuSinkMetric {
        epsilon,
        prompt_len,
        prompts: prompts.len(),
        per_layer,
        metric,
    })
}

/// What [`sinks`] computes, with the CLI's defaults ([`SinksOptions::default`]).
#[derive(Clone, Debug)]
pub struct SinksOptions {
    /// Keys per block of the streaming softmax.
    pub key_block: usize,
    /// Top keys kept for the last query of each head (1..=64).
    pub top: usize,
    /// α₁ threshold of Gu et al.'s sink metric.
    pub epsilon: f64,
    /// Prompts of Gu et al.'s metric cut from the text (0 leaves it out).
    pub gu_prompts: usize,
    /// Tokens per prompt of Gu et al.'s metric.
    pub gu_len: usize,
    /// Largest residual values kept per layer (0 leaves massive activations out).
    pub massive_top: usize,
    /// Whether the text starts with the model's BOS (the model's own choice or `--bos`), for
    /// Gu et al.'s prompts.
    pub bos: bool,
}

impl Default for SinksOptions {
    fn default() -> Self {
        SinksOptions {
            key_block: 1024,
            top: 5,
            epsilon: 0.3,
            gu_prompts: 8,
            gu_len: 64,
            massive_top: 3,
            bos: false,
        }
    }
}

/// The next token predicted after the text.
#[derive(Clone, Debug, Serialize)]
pub struct NextToken {
    pub id: u32,
    pub token: String,
    pub prob: f32,
}

/// `attnscope sinks --json`.
#[derive(Clone, Debug, Serialize)]
pub struct SinksReport {
    /// the model's name
    pub model: String,
    /// the precision it ran at (`exact` or `fast`)
    pub precision: &'static str,
    /// the number of tokens run
    pub n_tokens: usize,
    /// the keys per streamed block of the attention
    pub key_block: usize,
    /// the forward's seconds
    pub forward_s: f64,
    /// the attention's seconds within it
    pub attention_s: f64,
    /// the forward and Gu et al.'s prompts (the CLI adds the load)
    pub total_s: f64,
    /// the process's peak resident memory, where the system says it
    pub peak_rss_bytes: Option<u64>,
    /// the CPU's name
    pub cpu: String,
    /// the threads used
    pub threads: usize,
    /// each layer's sink statistics
    pub layers: Vec<LayerStats>,
    /// Gu et al.'s sink metric on their prompts, when run
    pub gu_sink_metric: Option<GuSinkMetric>,
    /// each layer's massive activations
    pub massive_activations: Vec<LayerMassive>,
    /// the first token's text
    pub first_token: String,
    /// the model's next token after the text
    pub next_token: NextToken,
}

/// The tokens of a sinks run: `text` (BOS first when `bos` or the model asks for one), or the
/// built-in corpus repeated up to `max_tokens`; cut to `max_tokens` where the caller names it.
/// A text longer than the default (32,768 tokens, or the model's context if smaller) is refused
/// when `max_tokens` is `None`: its statistics would be those of a prefix the user never asked
/// for.
pub fn sinks_tokens(
    model: &Model,
    text: Option<&str>,
    max_tokens: Option<usize>,
    bos: bool,
) -> Result<Vec<u32>> {
    let ctx = model.dims.context_len;
    let asked = max_tokens;
    let max_tokens = max_tokens_of(model, max_tokens);
    if max_tokens == 0 {
        return Err(Error::OutOfRange {
            what: "--max-tokens (Python: max_tokens)".into(),
            value: "0".into(),
            range: "at least 1".into(),
        });
    }
    let mut tokens = match text {
        Some(text) => {
            let (tokens, more) = prefix_tokens(model, text, max_tokens, bos)?;
            if asked.is_none() && (more || tokens.len() > max_tokens) {
                return Err(longer_than_default(model, &tokens, text.len(), max_tokens));
            }
            tokens
        }
        None => {
            // a BOS first when the model or --bos asks for one, as encode() does for texts
            let mut t = bos_prefix(model, bos)?;
            t.extend(crate::analysis::corpus::builtin_tokens(
                &model.tokenizer,
                max_tokens,
            )?);
            t
        }
    };
    tokens.truncate(max_tokens);
    if tokens.is_empty() {
        return Err(Error::EmptyText);
    }
    if tokens.len() > ctx {
        return Err(Error::TooLong {
            n_tokens: tokens.len(),
            limit: ctx,
            model: model.info.name.clone(),
        });
    }
    Ok(tokens)
}

fn bos_prefix(model: &Model, bos: bool) -> Result<Vec<u32>> {
    if bos || model.tokenizer.add_bos {
        model.tokenizer.encode("", true)
    } else {
        Ok(Vec::new())
    }
}

/// The tokens `sinks` runs at most: `max_tokens`, by default 32,768 or the model's context if
/// smaller.
pub fn max_tokens_of(model: &Model, max_tokens: Option<usize>) -> usize {
    max_tokens.unwrap_or(32768.min(model.dims.context_len))
}

/// The bytes of a long text `sinks` reads for `max_tokens` tokens: 64 a token, plus 64 KiB
/// ([`crate::model::text_bytes_bound`]); the rest of the text is never read.
pub fn prefix_bytes(max_tokens: usize) -> usize {
    crate::model::text_bytes_bound(max_tokens)
}

/// The tokens of `text`, or of its first [`prefix_bytes`] (cut at the whitespace before that,
/// where a word ends, so the tokens up to there are the whole text's): a long text (a book) is
/// not tokenized whole for its first `max_tokens` tokens. A prefix that gives fewer than
/// `max_tokens` tokens is refused, since the whole text's tokens would differ.
/// Also whether text past that prefix was left out (words after its last whitespace).
fn prefix_tokens(
    model: &Model,
    text: &str,
    max_tokens: usize,
    bos: bool,
) -> Result<(Vec<u32>, bool)> {
    let limit = prefix_bytes(max_tokens);
    if text.len() <= limit {
        return Ok((model.tokenizer.encode(text, bos)?, false));
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let end = text[..end]
        .rfind(char::is_whitespace)
        .filter(|&i| i > 0)
        .unwrap_or(end);
    let tokens = model.tokenizer.encode(&text[..end], bos)?;
    if tokens.len() < max_tokens {
        return Err(Error::OutOfRange {
            what: "a text of".into(),
            value: format!("{} bytes (its first {end} give {} tokens, fewer than --max-tokens {max_tokens}: more than {} bytes a token)", text.len(), tokens.len(), crate::model::TEXT_BYTES_PER_TOKEN),
            range: format!("at most {limit} bytes, or one whose first {limit} bytes hold {max_tokens} tokens; cut the text to the part to run"),
        });
    }
    Ok((tokens, !text[end..].trim().is_empty()))
}

/// The refusal of a text longer than the tokens `sinks` runs by default (`limit`), naming its
/// length (all of it, or the tokens of the part read where the text has more than `bytes`
/// [`prefix_bytes`]) and what to do.
fn longer_than_default(model: &Model, tokens: &[u32], bytes: usize, limit: usize) -> Error {
    let length = match prefix_bytes(limit) < bytes {
        true => format!(
            "more than {limit} tokens (its first {} bytes give {})",
            prefix_bytes(limit),
            tokens.len()
        ),
        false => format!("{} tokens", tokens.len()),
    };
    let why = match limit == model.dims.context_len {
        true => format!("{}'s context", model.info.name),
        false => "sinks' default".into(),
    };
    Error::NotApplicable(format!(
        "the text is {length} long, past the {limit} tokens sinks runs by default ({why}); \
         pass --max-tokens {limit} (Python: max_tokens={limit}) to run its first {limit} tokens, \
         or cut the text to the part to run"
    ))
}

/// The streamed sink statistics of `tokens` ([`sinks_tokens`]); `on_layer(l)` after each layer.
pub fn sinks(
    model: &Model,
    tokens: &[u32],
    o: &SinksOptions,
    on_layer: Box<dyn FnMut(usize) + Send>,
) -> Result<SinksReport> {
    let start = Instant::now();
    if o.top == 0 || o.top > 64 {
        return Err(Error::OutOfRange {
            what: "--top (Python: top)".into(),
            value: o.top.to_string(),
            range: "1..=64".into(),
        });
    }
    if o.key_block == 0 {
        // the kernel would take blocks of 1 and the report say 0
        return Err(Error::OutOfRange {
            what: "--key-block (Python: key_block)".into(),
            value: "0".into(),
            range: "at least 1 (keys per block of the streaming softmax)".into(),
        });
    }
    let (d, n) = (&model.dims, tokens.len());
    let mut stats = StreamStats::new(d.n_layers, d.n_heads, n, o.top, on_layer);
    if o.massive_top > 0 {
        stats = stats.with_massive(o.massive_top);
    }
    let t0 = Instant::now();
    let opts = RunOptions {
        logits_at: vec![n - 1],
        key_block: o.key_block,
        ..Default::default()
    };
    let out = model.forward(tokens, &opts, &mut stats)?;
    let forward_s = t0.elapsed().as_secs_f64();
    let layers = stats.layers();
    let massive = stats.massive.take().map(|m| m.layers).unwrap_or_default();
    // Gu et al.'s protocol: prompts of gu_len tokens from the text, each with the model's BOS
    let gu = if o.gu_prompts > 0 && o.gu_len > 0 {
        let bos = bos_prefix(model, o.bos)?;
        let body = &tokens[bos.len().min(n)..];
        let take = o.gu_len.saturating_sub(bos.len()).max(1);
        let prompts: Vec<Vec<u32>> = body
            .chunks_exact(take)
            .take(o.gu_prompts)
            .map(|c| bos.iter().chain(c).copied().collect())
            .collect();
        if prompts.is_empty() {
            None
        } else {
            Some(gu_sink_metric(model, &prompts, o.epsilon)?)
        }
    } else {
        None
    };
    let (cpu, threads) = machine();
    let top = super::vocab::next_token_top_k(&out.logits[0], 1).remove(0);
    Ok(SinksReport {
        model: model.info.name.clone(),
        precision: model.info.precision.name(),
        n_tokens: n,
        key_block: o.key_block,
        forward_s,
        attention_s: out.timings.attention.as_secs_f64(),
        total_s: start.elapsed().as_secs_f64(),
        peak_rss_bytes: peak_rss_bytes(),
        cpu,
        threads,
        layers,
        gu_sink_metric: gu,
        massive_activations: massive,
        first_token: model.tokenizer.token_text(tokens[0]),
        next_token: NextToken {
            id: top.id,
            token: model.tokenizer.token_text(top.id),
            prob: top.prob,
        },
    })
}
