//! `attnscope generate`: chat with the model (its own template) or continue a text, token by token
//! on a KV cache, and show what the query that produced each token attended to.

use super::common::{emit, on_bar, output_path, progress_bar, usage, ModelArgs, Output};
use attnscope::analysis::vocab::Method;
use attnscope::commands::generate::{
    self as command, GenAttribution, GenOptions, GenToken, Generation,
};
use attnscope::model::tokenize::visible;
use attnscope::render::gen_attribute as render;
use std::io::IsTerminal;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// A user message, put through the model's own chat template (generation prompt added).
    #[arg(long, conflicts_with = "text")]
    chat: Option<String>,
    /// A system message for --chat (default: the template's own, if it has one).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// A raw text to continue (no template).
    #[arg(long, short = 't')]
    text: Option<String>,
    /// Tokens to generate at most (it stops earlier at an end-of-turn or EOS token).
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// 0 is greedy; above 0, sample from softmax(logits / temperature).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Sample among the k most likely tokens only, and any tied with the k-th (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Sample among the most likely tokens whose probabilities reach p (1: all).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// The sampler's seed: the same seed gives the same text.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// A head is listed as concentrated when its largest weight is at least this.
    #[arg(long, default_value_t = 0.9)]
    concentrated: f32,
    /// Prompt tokens listed per generated token (head- and layer-averaged weight).
    #[arg(long, short = 'k', default_value_t = 3, value_parser = attnscope::analysis::request::at_least_one)]
    top: usize,
    /// Print one JSON document at the end instead of streaming text and tables.
    #[arg(long)]
    json: bool,
    /// Stream only the answer's text (no per-token table).
    #[arg(long)]
    quiet: bool,
    /// Why each answer token came: its log-probability, teacher-forced on the generated text,
    /// attributed to the prompt tokens and the answer tokens before it (a matrix, inseq-style):
    /// occlusion (deletion: f − f without the token; one forward per token for the whole answer),
    /// gradient, grad-x-input, integrated-gradients, attention-x-gradient, attnlrp (the
    /// target's logit under AttnLRP's rules), value-zeroing, alti-logit (one backward or
    /// decomposition per answer token; integrated gradients `--steps` each), as `attribute`.
    #[arg(long, value_parser = parse_method, value_name = "METHOD")]
    attribute: Option<Method>,
    /// Integrated gradients' midpoints per answer token.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// With --attribute: also write a self-contained HTML page (prompt and answer; click an
    /// answer token to shade the prompt by attribution and by attention, side by side).
    #[arg(long, requires = "attribute", value_name = "FILE")]
    html: Option<PathBuf>,
    /// Replace an existing --html file.
    #[arg(long)]
    force: bool,
}

fn parse_method(s: &str) -> Result<Method, String> {
    s.parse()
}

/// `attnscope generate`: the answer streamed as it comes, then (with `--attribute`) why each
/// answer token came, and the table of what each token's query attended to, or `--json`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let o = GenOptions {
        max_new_tokens: a.max_new_tokens,
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
        concentrated: a.concentrated,
        top: a.top,
    };
    o.check()?;
    let output = check_request(&a)?;
    let model = a.model.load()?;
    model.require_decoder("generate (predicting one token after another)")?;
    let prompt = match (&a.chat, &a.text) {
        (Some(q), _) => model.chat_ids(q, a.system.as_deref())?,
        (None, Some(t)) => model.encode(t, a.model.bos)?,
        _ => unreachable!("checked above"),
    };
    let texts = model.token_texts(&prompt);
    let stream = !a.json;
    let g = generate_streamed(&model, &prompt, &o, &a)?;
    let gen_ids: Vec<u32> = g.generated.iter().map(|t| t.id).collect();
    let attribution = match a.attribute {
        Some(method) => {
            if stream {
                emit("\n")?;
            }
            let bar = progress_bar("attribution [{bar:30}] {pos}/{len} ({eta})");
            let t0 = std::time::Instant::now();
            let r = command::attribution(
                &model,
                &prompt,
                &gen_ids,
                method,
                a.steps,
                &mut on_bar(&bar),
            )?;
            bar.finish_and_clear();
            Some((r, t0.elapsed().as_secs_f64()))
        }
        None => None,
    };
    let all_texts: Vec<String> = texts
        .iter()
        .cloned()
        .chain(gen_ids.iter().map(|&i| model.tokenizer.token_text(i)))
        .collect();
    if let (Some((r, _)), Some(out)) = (&attribution, &output) {
        write_page(&model, r, &g, &all_texts, out, &a)?;
    }
    // position j's label: `j:token`, the prompt's or the answer's
    let label = |j: usize| format!("{j}:{}", visible(&all_texts[j]));
    if a.json {
        let mut v = json_doc(&model, &a, &g, &texts, &label);
        if let Some((r, secs)) = &attribution {
            v["attribution"] = render::json(r, &all_texts);
            v["attribution"]["seconds"] = serde_json::json!(secs);
        }
        emit(&format!("{}\n", serde_json::to_string_pretty(&v)?))?;
        return Ok(());
    }
    if attribution.is_none() {
        emit("\n")?;
    }
    let colour = std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    if a.quiet {
        return match &attribution {
            Some((r, _)) => emit(&render::terminal(r, &all_texts, colour)),
            None => Ok(()),
        };
    }
    let mut s = token_table(model.dims.n_layers, a.concentrated, &g, &label);
    if let Some((r, secs)) = &attribution {
        s.push_str(&render::terminal(r, &all_texts, colour));
        s.push_str(&format!("attribution {secs:.2} s\n"));
    }
    emit(&s)
}

/// The checks that need no model: `--system` with `--chat`, a prompt given, `--steps` for
/// integrated gradients, `--html` writable ([`Output::check`]), which it returns.
fn check_request(a: &Args) -> anyhow::Result<Option<Output>> {
    super::common::check_system(a.chat.is_some(), a.system.is_some())?;
    if a.chat.is_none() && a.text.is_none() {
        return Err(usage(
            "say what to generate from: --chat \"a question\" (the model's chat template) or --text \"a text\" (a raw continuation)",
        ));
    }
    if a.attribute == Some(Method::IntegratedGradients) {
        attnscope::analysis::scores::check_steps(a.steps)?;
    }
    a.html
        .as_deref()
        .map(|h| output_path(h, a.force, &a.model.input_paths()))
        .transpose()
}

/// Generates from `prompt`, printing each token's text as it comes unless `--json` (the
/// end-of-turn token not printed; a character split over tokens printed once its last byte came).
fn generate_streamed(
    model: &attnscope::model::Model,
    prompt: &[u32],
    o: &GenOptions,
    a: &Args,
) -> anyhow::Result<Generation> {
    let stream = !a.json;
    // a character split over tokens is printed once its last byte has come
    let mut pending: Vec<u8> = Vec::new();
    if stream {
        eprintln!(
            "{} prompt tokens ({}); generating up to {}:",
            prompt.len(),
            if a.chat.is_some() {
                "chat template"
            } else {
                "raw text"
            },
            a.max_new_tokens
        );
    }
    let stops = model.stop_ids();
    let g = command::run(model, prompt, o, |t: &GenToken| {
        // the end-of-turn token is not printed (it is in the table and in --json)
        if stream && !stops.contains(&t.id) {
            pending.extend(model.tokenizer.token_bytes(t.id));
            let ok = match std::str::from_utf8(&pending) {
                Ok(_) => pending.len(),
                Err(e) if e.error_len().is_none() => e.valid_up_to(),
                Err(_) => pending.len(),
            };
            let _ = emit(&String::from_utf8_lossy(&pending[..ok]));
            pending.drain(..ok);
        }
    })?;
    if !pending.is_empty() {
        emit(&String::from_utf8_lossy(&pending))?;
    }
    Ok(g)
}

/// `--html`: the page of the answer's attribution beside each answer token's attention.
fn write_page(
    model: &attnscope::model::Model,
    r: &GenAttribution,
    g: &Generation,
    all_texts: &[String],
    out: &Output,
    a: &Args,
) -> anyhow::Result<()> {
    let attention: Vec<Vec<f32>> = g.generated.iter().map(|t| t.attention.clone()).collect();
    let title = format!(
        "attnscope · {} · why each answer token ({})",
        model.info.name,
        r.method.name()
    );
    let html = render::page(r, all_texts, &attention, &title, &model.info.name);
    out.write(html.as_bytes())?;
    if !a.json {
        eprintln!(
            "wrote {}; open it in a browser, no network needed",
            out.path.display()
        );
    }
    Ok(())
}

/// `--json`'s document (without the attribution): the prompt, the text, each answer token with
/// its sink profile, top keys (labelled by `label`) and concentrated heads, and the timings.
fn json_doc(
    model: &attnscope::model::Model,
    a: &Args,
    g: &Generation,
    texts: &[String],
    label: &dyn Fn(usize) -> String,
) -> serde_json::Value {
    let all_bytes: Vec<u8> = g
        .generated
        .iter()
        .flat_map(|t| model.tokenizer.token_bytes(t.id))
        .collect();
    serde_json::json!({
        "model": model.info.name,
        "mode": if a.chat.is_some() { "chat" } else { "text" },
        "prompt_ids": g.prompt_ids,
        "prompt_tokens": texts,
        "text": String::from_utf8_lossy(&all_bytes),
        "stop": g.stop,
        "prefill_s": g.prefill_s,
        "decode_s": g.decode_s,
        "decode_tokens_per_s": (g.generated.len().saturating_sub(1)) as f64 / g.decode_s.max(1e-9),
        "generated": g.generated.iter().map(|t| serde_json::json!({
            "id": t.id,
            "text": t.text,
            "logprob": t.logprob,
            "position": t.position,
            "sink": t.sink,
            "top": t.top.iter().map(|&(k, w)| serde_json::json!({
                "position": k, "token": label(k), "weight": w})).collect::<Vec<_>>(),
            "concentrated": t.concentrated,
        })).collect::<Vec<_>>(),
    })
}

/// The table of what the query that produced each token attended to, and the timings.
fn token_table(
    n_layers: usize,
    concentrated: f32,
    g: &Generation,
    label: &dyn Fn(usize) -> String,
) -> String {
    let mut s = format!(
        "\nwhat the query that produced each token attended to (weights averaged over heads and {n_layers} layers; sink = mean weight on position 0 over layers; conc = heads with max ≥ {} off position 0):\n",
        concentrated
    );
    s.push_str(&format!(
        "{:>5}  {:<16} {:>8}  {:>6}  {:>4}  top keys\n",
        "pos", "token", "logprob", "sink", "conc"
    ));
    for t in &g.generated {
        let sink = t.sink.iter().sum::<f32>() / t.sink.len().max(1) as f32;
        let conc = t.concentrated.iter().filter(|c| c.key != 0).count();
        let top: Vec<String> = t
            .top
            .iter()
            .map(|&(k, w)| format!("{} {:.2}", label(k), w))
            .collect();
        s.push_str(&format!(
            "{:>5}  {:<16} {:>8.3}  {:>6.3}  {:>4}  {}\n",
            t.position,
            visible(&t.text),
            t.logprob,
            sink,
            conc,
            top.join(", ")
        ));
    }
    s.push_str(&format!(
        "stopped: {:?}; prompt {:.2} s, decoding {:.1} tokens/s\n",
        g.stop,
        g.prefill_s,
        g.generated.len().saturating_sub(1) as f64 / g.decode_s.max(1e-9)
    ));
    s
}
