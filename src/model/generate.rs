//! Generation: the model's chat template (rendered with minijinja), greedy or seeded sampling, and
//! incremental decoding on the forward's reused keys and values ([`KvPrefix`]): each new token
//! runs one row against the cached K/V of every layer. For every generated token, the attention
//! row of the query that produced it gives the sink profile, the head-averaged top keys and the
//! concentrated heads, streamed by the kernel (no n × n map).

use super::capture::{Hook, Observer};
use super::forward::{log_softmax, KvPrefix, RunOptions};
use super::{Error, Model, Result};
use crate::reference::Rng;

/// One message of a chat: `role` ("system", "user", "assistant") and its text.
#[derive(Clone, Debug)]
pub struct Message {
    /// "system", "user" or "assistant".
    pub role: String,
    /// The message's text.
    pub content: String,
}

/// Renders a Hugging Face chat template (Jinja) with `messages`, `add_generation_prompt`,
/// `bos_token`, `eos_token`, Python-style string methods (`.strip()`, `.startswith()`, ...),
/// `raise_exception` and `strftime_now`. A template that fails names minijinja's error.
pub fn render_chat(
    template: &str,
    messages: &[Message],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    let mut env = minijinja::Environment::new();
    // as transformers renders chat templates
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| Error::NotApplicable(format!("the template syntax: {e}")))?,
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_function("strftime_now", |fmt: String| strftime_now(&fmt));
    let fail = |e: minijinja::Error| {
        let mut msg = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            msg.push_str(&format!(": {s}"));
            src = s.source();
        }
        Error::NotApplicable(format!("the model's chat template failed to render: {msg}"))
    };
    env.add_template("chat", template).map_err(fail)?;
    let msgs: Vec<_> = messages
        .iter()
        .map(|m| minijinja::context! { role => m.role.clone(), content => m.content.clone() })
        .collect();
    env.get_template("chat")
        .map_err(fail)?
        .render(minijinja::context! {
            messages => msgs,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
        })
        .map_err(fail)
}

/// Today's date in the few `strftime` forms chat templates use (`%d`, `%b`, `%B`, `%Y`, `%m`).
fn strftime_now(fmt: &str) -> String {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400) as i64;
    // civil-from-days (Howard Hinnant's algorithm)
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let name = MONTHS[(m - 1) as usize];
    fmt.replace("%d", &format!("{d:02}"))
        .replace("%m", &format!("{m:02}"))
        .replace("%Y", &y.to_string())
        .replace("%B", name)
        .replace("%b", &name[..3])
}

/// How to pick each next token.
#[derive(Clone, Debug)]
pub struct GenOptions {
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// 0 is greedy (the default); otherwise the logits are divided by it before sampling.
    pub temperature: f32,
    /// Sample among the `top_k` most likely tokens only, and those tied with the k-th (0: all).
    pub top_k: usize,
    /// Sample among the smallest set of tokens whose probability reaches `top_p` (1: all).
    pub top_p: f32,
    /// The sampler's seed (the same seed gives the same text).
    pub seed: u64,
    /// A head is listed as concentrated when its largest weight is at least this.
    pub concentrated: f32,
    /// Keys listed per token in [`GenToken::top`].
    pub top: usize,
}

impl Default for GenOptions {
    fn default() -> Self {
        GenOptions {
            max_new_tokens: 64,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            concentrated: 0.9,
            top: 5,
        }
    }
}

impl GenOptions {
    /// Refuses sampling parameters out of range.
    pub fn check(&self) -> Result<()> {
        let bad = |what: &str, value: String, range: &str| {
            Err(Error::OutOfRange {
                what: what.into(),
                value,
                range: range.into(),
            })
        };
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(
                "temperature",
                self.temperature.to_string(),
                "0 (greedy) or more",
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top-p", self.top_p.to_string(), "(0, 1]");
        }
        if self.max_new_tokens == 0 {
            return bad("max-new-tokens", "0".into(), "1 or more");
        }
        if !(0.0..=1.0).contains(&self.concentrated) {
            return bad("concentrated", self.concentrated.to_string(), "[0, 1]");
        }
        Ok(())
    }
}

/// A head whose attention from the producing query is concentrated on one key.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ConcentratedHead {
    pub layer: usize,
    pub head: usize,
    /// The key position it puts its largest weight on.
    pub key: usize,
    pub weight: f32,
}

/// One generated token and what the query that produced it attended to.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GenToken {
    /// the token id
    pub id: u32,
    /// The token's readable text.
    pub text: String,
    /// Its log-probability under the model (before temperature).
    pub logprob: f32,
    /// The position the token takes in the sequence (prompt length + index).
    pub position: usize,
    /// Per layer, the head-averaged weight on position 0 of the producing query's row.
    pub sink: Vec<f32>,
    /// The keys with the most weight, averaged over heads and layers: (position, weight).
    pub top: Vec<(usize, f32)>,
    /// Heads whose largest weight reaches [`GenOptions::concentrated`].
    pub concentrated: Vec<ConcentratedHead>,
    /// The producing query's whole row, averaged over heads and layers: a weight per key
    /// `0..=position − 1` (what `top` ranks; the HTML view of `generate --attribute` shows it).
    #[serde(skip)]
    pub attention: Vec<f32>,
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// An end-of-turn or EOS token was generated (it is included).
    Eos,
    /// `max_new_tokens` were generated.
    MaxNewTokens,
}

/// The result of [`Model::generate`].
#[derive(Clone, Debug, serde::Serialize)]
pub struct Generation {
    /// the prompt's token ids
    pub prompt_ids: Vec<u32>,
    /// the generated tokens, in order
    pub generated: Vec<GenToken>,
    /// why generation stopped
    pub stop: StopReason,
    /// Seconds of the prompt's forward (the first token's).
    pub prefill_s: f64,
    /// Seconds of the decoding steps after the first token (one row each on the KV cache).
    pub decode_s: f64,
}

/// Picks the next token from `logits`: the argmax (lowest id on ties) when the temperature is 0,
/// else a draw from the softmax of `logits / temperature` restricted by top-k and top-p, as
/// transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper restrict it (in
/// that order): top-k keeps the tokens tied with the k-th too; top-p keeps the most likely
/// tokens up to and including the one whose cumulative probability reaches p
/// (`tests/ref_sampling.rs` checks the draws against transformers' distributions).
pub fn pick(logits: &[f32], o: &GenOptions, rng: &mut Rng) -> u32 {
    let argmax = || {
        let mut best = 0;
        for (i, &x) in logits.iter().enumerate() {
            if x > logits[best] {
                best = i;
            }
        }
        best as u32
    };
    if o.temperature == 0.0 {
        return argmax();
    }
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if o.top_k > 0 && o.top_k < idx.len() {
        // transformers' TopKLogitsWarper removes only the tokens below the k-th logit: tokens
        // tied with it stay
        let kth = logits[idx[o.top_k - 1]];
        let tied = idx[o.top_k..]
            .iter()
            .take_while(|&&i| logits[i] == kth)
            .count();
        idx.truncate(o.top_k + tied);
    }
    let t = o.temperature as f64;
    let max = logits[idx[0]] as f64;
    let mut p: Vec<f64> = idx
        .iter()
        .map(|&i| ((logits[i] as f64 - max) / t).exp())
        .collect();
    let sum: f64 = p.iter().sum();
    p.iter_mut().for_each(|x| *x /= sum);
    if o.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = p.len();
        for (j, &x) in p.iter().enumerate() {
            acc += x;
            if acc >= o.top_p as f64 {
                keep = j + 1;
                break;
            }
        }
        p.truncate(keep);
        let s: f64 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= s);
    }
    let u = rng.uniform();
    let mut acc = 0.0;
    for (j, &x) in p.iter().enumerate() {
        acc += x;
        if u < acc {
            return idx[j] as u32;
        }
    }
    idx[p.len() - 1] as u32
}

/// The observer of one producing query: its whole rows (every head) per layer, reduced as they
/// come to the sink profile, the head-and-layer-averaged weights and the concentrated heads.
struct RowStats {
    q: usize,
    threshold: f32,
    sink: Vec<f32>,
    avg: Vec<f64>,
    concentrated: Vec<ConcentratedHead>,
}

impl Observer for RowStats {
    fn wants(&self, _layer: usize, _hook: Hook) -> bool {
        false
    }
    fn tensor(&mut self, _: usize, _: Hook, _: &[usize], _: &[f32]) {}
    fn attention_block(&mut self, _: usize, _: Hook, _: usize, _: [usize; 3], _: &[f32]) {}
    fn wants_rows(&self, _layer: usize) -> Vec<usize> {
        vec![self.q]
    }
    fn attention_rows(&mut self, layer: usize, q: usize, n_heads: usize, rows: &[f32]) {
        if q != self.q || n_heads == 0 {
            return;
        }
        let k = rows.len() / n_heads;
        if self.avg.len() < k {
            self.avg.resize(k, 0.0);
        }
        let mut s0 = 0f64;
        for h in 0..n_heads {
            let row = &rows[h * k..(h + 1) * k];
            s0 += row[0] as f64;
            let (mut key, mut w) = (0, f32::NEG_INFINITY);
            for (j, &x) in row.iter().enumerate() {
                self.avg[j] += x as f64;
                if x > w {
                    (key, w) = (j, x);
                }
            }
            if w >= self.threshold {
                self.concentrated.push(ConcentratedHead {
                    layer,
                    head: h,
                    key,
                    weight: w,
                });
            }
        }
        if self.sink.len() <= layer {
            self.sink.resize(layer + 1, 0.0);
        }
        self.sink[layer] = (s0 / n_heads as f64) as f32;
    }
}

impl Model {
    /// The ids that end a turn: the model's EOS and, where the vocabulary has them,
    /// `<|im_end|>`, `<|endoftext|>`, `<end_of_turn>`, `<|eot_id|>`, `<|end|>`.
    pub fn stop_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.tokenizer.eos_id.into_iter().collect();
        for t in [
            "<|im_end|>",
            "<|endoftext|>",
            "<end_of_turn>",
            "<|eot_id|>",
            "<|end|>",
        ] {
            if let Some(i) = self.tokenizer.token_id(t) {
                if !ids.contains(&i) {
                    ids.push(i);
                }
            }
        }
        ids
    }

    /// The token ids of a chat through the model's own template, with the generation prompt
    /// added; `system` adds a system message first (else the template's default, if any).
    pub fn chat_ids(&self, user: &str, system: Option<&str>) -> Result<Vec<u32>> {
        let rendered = self.chat_text(user, system)?;
        // the template writes the BOS itself where the model wants one
        self.encode_with(&rendered, Some(false))
    }

    /// The text of a chat as the model's own template renders it (generation prompt added), the
    /// text [`Model::chat_ids`] tokenizes. A model without a template is refused
    /// ([`Error::NotApplicable`], a bad input), with a suggestion of `--text`.
    pub fn chat_text(&self, user: &str, system: Option<&str>) -> Result<String> {
        let tpl = self.tokenizer.chat_template.as_deref().ok_or_else(|| {
            Error::NotApplicable(format!(
                "{} has no chat template (no tokenizer.chat_template in its metadata, no \
                 chat_template in tokenizer_config.json); use --text for a raw continuation",
                self.info.name
            ))
        })?;
        let mut msgs = Vec::new();
        if let Some(s) = system {
            msgs.push(Message {
                role: "system".into(),
                content: s.into(),
            });
        }
        msgs.push(Message {
            role: "user".into(),
            content: user.into(),
        });
        let text_of = |id: Option<u32>| {
            id.map(|i| String::from_utf8_lossy(&self.tokenizer.token_bytes(i)).into_owned())
                .unwrap_or_default()
        };
        render_chat(
            tpl,
            &msgs,
            true,
            &text_of(self.tokenizer.bos_id),
            &text_of(self.tokenizer.eos_id),
        )
    }

    /// Generates from `prompt` with a KV cache (one new row per token against every layer's
    /// cached keys and values), calling `on_token` as each token comes. Stops at a token of
    /// [`Model::stop_ids`] or after `max_new_tokens`. Refuses a prompt plus `max_new_tokens`
    /// past the context length.
    pub fn generate(
        &self,
        prompt: &[u32],
        o: &GenOptions,
        mut on_token: impl FnMut(&GenToken),
    ) -> Result<Generation> {
        self.check_prompt(prompt, o)?;
        let stops = self.stop_ids();
        let mut rng = Rng::new(o.seed);
        let mut kv: Option<KvPrefix> = None;
        let mut next: Vec<u32> = prompt.to_vec();
        let mut generated = Vec::new();
        let mut stop = StopReason::MaxNewTokens;
        let t0 = std::time::Instant::now();
        let mut prefill_s = 0.0;
        for step in 0..o.max_new_tokens {
            let tok = self.generate_step(&mut kv, &next, prompt.len() + step, o, &mut rng)?;
            if step == 0 {
                prefill_s = t0.elapsed().as_secs_f64();
            }
            on_token(&tok);
            let id = tok.id;
            generated.push(tok);
            next = vec![id];
            if stops.contains(&id) {
                stop = StopReason::Eos;
                break;
            }
        }
        let decode_s = t0.elapsed().as_secs_f64() - prefill_s;
        Ok(Generation {
            prompt_ids: prompt.to_vec(),
            generated,
            stop,
            prefill_s,
            decode_s,
        })
    }

    /// Refuses bad options, an empty prompt, or a prompt plus `max_new_tokens` past the context.
    fn check_prompt(&self, prompt: &[u32], o: &GenOptions) -> Result<()> {
        o.check()?;
        if prompt.is_empty() {
            return Err(Error::EmptyText);
        }
        let limit = self.dims.context_len;
        if prompt.len() >= limit {
            // no room for even one new token: the prompt is what is too long
            return Err(Error::TooLong {
                n_tokens: prompt.len() + 1,
                limit,
                model: format!(
                    "{} (the prompt's {} tokens plus one new token)",
                    self.info.name,
                    prompt.len()
                ),
            });
        }
        let room = limit - prompt.len();
        if o.max_new_tokens > room {
            return Err(Error::OutOfRange {
                what: "max-new-tokens".into(),
                value: o.max_new_tokens.to_string(),
                range: format!(
                    "1..={room}: {} has a context of {limit} tokens and the prompt takes {}",
                    self.info.name,
                    prompt.len()
                ),
            });
        }
        Ok(())
    }

    /// One step: `next` (the prompt, then the last token) run on the cache `kv`, the token
    /// at `position` picked from the last row's logits, with its log-probability and the
    /// attention of its query row (sink weight, average over heads and layers, the top keys,
    /// the concentrated heads). The cache grows by `next`'s positions: the prompt's forward
    /// makes it, with room for every token to come ([`KvPrefix::reserve`]), and each step
    /// writes its own keys and values there ([`Model::forward_grow`]).
    fn generate_step(
        &self,
        kv: &mut Option<KvPrefix>,
        next: &[u32],
        position: usize,
        o: &GenOptions,
        rng: &mut Rng,
    ) -> Result<GenToken> {
        let start = kv.as_ref().map_or(0, |p| p.len);
        let q = start + next.len() - 1;
        let mut obs = RowStats {
            q,
            threshold: o.concentrated,
            sink: Vec::new(),
            avg: Vec::new(),
            concentrated: Vec::new(),
        };
        let opts = RunOptions {
            logits_at: vec![q],
            keep_kv: true,
            // one row a product from the prompt's last layer on: from the file's blocks; one
            // query row's attention from the keys and values as they lie
            decode_step: true,
            ..Default::default()
        };
        // the step runs on one of rayon's threads (`scope`), so its ~170 parallel products a
        // token are handed to the other threads without waking this one each time (20.1-20.4
        // tokens/s against 18.5-19.1 on the default model, 2 cores)
        let out = rayon::scope(|_| match kv {
            Some(cache) => self.forward_grow(cache, next, &opts, &mut obs),
            None => self.forward_from(None, next, &opts, &mut obs),
        })?;
        if let Some(mut cache) = out.kv {
            // the prompt's cache, with room for the steps to come (at most max_new_tokens - 1)
            cache.reserve(o.max_new_tokens.saturating_sub(1));
            *kv = Some(cache);
        }
        let logits = out
            .logits
            .into_iter()
            .next()
            .expect("one row was asked for");
        let id = pick(&logits, o, rng);
        let logprob = log_softmax(&logits)[id as usize];
        let scale = 1.0 / (self.dims.n_heads * self.dims.n_layers) as f64;
        let attention: Vec<f32> = obs.avg.iter().map(|&w| (w * scale) as f32).collect();
        let mut top: Vec<(usize, f32)> = attention.iter().copied().enumerate().collect();
        top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        top.truncate(o.top);
        let tok = GenToken {
            id,
            text: String::from_utf8_lossy(&self.tokenizer.token_bytes(id)).into_owned(),
            logprob,
            position,
            sink: obs.sink,
            top,
            concentrated: obs.concentrated,
            attention,
        };
        Ok(tok)
    }
}
