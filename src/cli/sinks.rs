//! `attnscope sinks`: the sink profile and per-head statistics of a long text, streamed.

use super::common::{emit, ModelArgs};
use attnscope::analysis::request::weight_threshold;
use attnscope::analysis::sinkmetrics::LayerMassive;
use attnscope::analysis::stream::LayerStats;
use attnscope::commands::sinks::{self as command, SinksInput, SinksOptions, SinksReport};
use attnscope::model::tokenize::visible;
use attnscope::model::Model;
use attnscope::render::table::{bar, sparkline, title, Align, Table};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// A long UTF-8 text. Default: the built-in corpus, repeated until --max-tokens.
    #[arg(long, short = 'f')]
    file: Option<PathBuf>,
    /// Run the text's first this many tokens (default: 32768, or the model's context if
    /// smaller; a --file longer than that is refused unless this is given).
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Keys per block of the streaming softmax.
    #[arg(long, default_value_t = 1024)]
    key_block: usize,
    /// Top keys kept for the last query of each head.
    #[arg(long, default_value_t = 5)]
    top: usize,
    /// α₁ threshold for counting a head as a sink head.
    #[arg(long, default_value_t = 0.3, value_parser = weight_threshold::<f64>)]
    epsilon: f64,
    /// Gu et al. 2024's sink metric on this many prompts of --gu-len tokens cut from the text
    /// (their protocol: 64-token prompts, ε 0.3; α₁ over every query, the first one included);
    /// 0 leaves it out.
    #[arg(long, default_value_t = 8)]
    gu_prompts: usize,
    /// Tokens per prompt of Gu et al.'s metric.
    #[arg(long, default_value_t = 64, value_parser = attnscope::analysis::request::at_least_one)]
    gu_len: usize,
    /// Largest residual values listed per layer (Sun et al. 2024's massive activations: |x| >
    /// 100 and ≥ 1,000 × the layer's median magnitude are counted); 0 leaves them out.
    #[arg(long, default_value_t = 3)]
    massive_top: usize,
    #[arg(long)]
    json: bool,
}

/// `attnscope sinks`: the text's tokens streamed through the model, the report as JSON or as
/// the per-layer table, the sink profile, Gu et al.'s metric and the massive activations.
pub fn run(a: Args) -> anyhow::Result<()> {
    let start = Instant::now();
    let model = a.model.load()?;
    let input = SinksInput {
        file: a.file.clone(),
        text: None,
        max_tokens: a.max_tokens,
    };
    let (tokens, mut r) = command::run(&model, &input, &options(&a), true)?;
    r.total_s = start.elapsed().as_secs_f64();
    if a.json {
        return emit(&format!("{}\n", serde_json::to_string_pretty(&r)?));
    }
    emit(&render(&model, &tokens, &a, &r))
}

/// The flags as [`SinksOptions`].
fn options(a: &Args) -> SinksOptions {
    SinksOptions {
        key_block: a.key_block,
        top: a.top,
        epsilon: a.epsilon,
        gu_prompts: a.gu_prompts,
        gu_len: a.gu_len,
        massive_top: a.massive_top,
        bos: a.model.bos,
    }
}

/// The report as text: the per-layer table, the sink profile, what a sliding window hides,
/// Gu et al.'s metric, the massive activations and the timings.
fn render(model: &Model, tokens: &[u32], a: &Args, r: &SinksReport) -> String {
    let (d, n) = (&model.dims, tokens.len());
    let layers = &r.layers;
    let mut s = title(&format!(
        "Attention sinks over {n} tokens, {} ({} precision), streamed",
        model.info.name,
        model.info.precision.name()
    ));
    s += &format!(
        "first token \"{}\"; online softmax over blocks of {} keys: no attention matrix is stored (a full one would take {}).\n\n",
        visible(&model.tokenizer.token_text(tokens[0])),
        a.key_block,
        super::cost::human_bytes(4.0 * (d.n_layers * d.n_heads) as f64 * (n as f64).powi(2))
    );
    let peak_layer = layers
        .iter()
        .max_by(|x, y| x.sink_all_queries.total_cmp(&y.sink_all_queries))
        .map(|l| l.layer)
        .unwrap_or(0);
    s += &layer_table(layers, a.epsilon, peak_layer);
    let prof: Vec<f32> = layers.iter().map(|l| l.sink_all_queries as f32).collect();
    s += &format!(
        "sink profile {}\npeak: layer {peak_layer} ({:.4})\n",
        sparkline(&prof),
        layers[peak_layer].sink_all_queries
    );
    s += &window_and_gu_lines(d, n, r);
    if !r.massive_activations.is_empty() {
        s += &massive_lines(model, tokens, &r.massive_activations);
    }
    s += "\n";
    s += &format!(
        "forward {:.1} s (attention {:.1} s), total {:.1} s; peak memory {}; {} threads on {}\n",
        r.forward_s,
        r.attention_s,
        r.total_s,
        r.peak_rss_bytes
            .map(|p| super::cost::human_bytes(p as f64))
            .unwrap_or_else(|| "unknown".into()),
        r.threads,
        r.cpu
    );
    s
}

/// What a sliding window hides from the first token, and Gu et al.'s metric when measured.
fn window_and_gu_lines(d: &attnscope::model::ModelDims, n: usize, r: &SinksReport) -> String {
    let mut s = String::new();
    // a sliding window hides the first token from every query at or past the window
    let windowed: Vec<String> = d.windowed_layers().iter().map(|l| l.to_string()).collect();
    if let (false, Some(w)) = (windowed.is_empty(), d.sliding_window.filter(|&w| n > w)) {
        s += &format!(
            "layers {} attend through a sliding window of {w} tokens: queries from position {w} on cannot see the first token, so their share is 0 by construction ({} of the {n} queries); the other layers see it from every query.\n",
            windowed.join(", "),
            n - w
        );
    }
    if let Some(g) = &r.gu_sink_metric {
        s += &format!(
            "Gu et al. 2024's sink metric (α₁ over every query, first included, > {}) on {} prompts of {} tokens from this text: {:.1}% of heads (per layer {})\n",
            g.epsilon,
            g.prompts,
            g.prompt_len,
            100.0 * g.metric,
            sparkline(&g.per_layer.iter().map(|&v| v as f32).collect::<Vec<_>>())
        );
    }
    s
}

/// The table of every layer: its sink share (all queries, with a bar; ▲ at `peak_layer`), the
/// last query's, the heads above `epsilon` and each head shaded by α₁, entropy, concentration.
fn layer_table(layers: &[LayerStats], epsilon: f64, peak_layer: usize) -> String {
    let mut t = Table::new([
        ("layer", Align::Right),
        ("sink (all queries)", Align::Right),
        ("", Align::Left),
        ("last query", Align::Right),
        (format!("heads α₁>{epsilon}").as_str(), Align::Right),
        ("heads by α₁ (░▒▓█)", Align::Left),
        ("mean entropy", Align::Right),
        ("rows ≥0.9", Align::Right),
    ]);
    for l in layers {
        let shade: String = l
            .heads
            .iter()
            .map(|h| [' ', '░', '▒', '▓', '█'][((h.first_token * 4.0).round() as usize).min(4)])
            .collect();
        let sinks = l.heads.iter().filter(|h| h.first_token > epsilon).count();
        let ent = l.heads.iter().map(|h| h.mean_entropy).sum::<f64>() / l.heads.len() as f64;
        let conc = l.heads.iter().map(|h| h.concentrated).sum::<f64>() / l.heads.len() as f64;
        t.row([
            l.layer.to_string(),
            format!("{:.4}", l.sink_all_queries),
            bar(l.sink_all_queries as f32, 20) + if l.layer == peak_layer { " ▲" } else { "" },
            format!("{:.4}", l.sink_last_query),
            format!("{sinks}/{}", l.heads.len()),
            format!("|{shade}|"),
            format!("{ent:.3}"),
            format!("{:.1}%", 100.0 * conc),
        ]);
    }
    t.render()
}

/// The massive activations' lines (Sun et al. 2024): in how many layers, the largest, and the
/// dimensions and tokens they sit on.
fn massive_lines(
    model: &attnscope::model::Model,
    tokens: &[u32],
    massive: &[LayerMassive],
) -> String {
    let with: Vec<&LayerMassive> = massive.iter().filter(|m| m.massive > 0).collect();
    let mut s = format!(
        "massive activations (Sun et al. 2024: |x| > 100 and ≥ 1,000 × the layer's median |x|) in {} of {} layers' outputs",
        with.len(),
        massive.len()
    );
    let Some(m) = with.iter().max_by(|x, y| x.max_abs.total_cmp(&y.max_abs)) else {
        return s + "\n";
    };
    let t = &m.top[0];
    s += &format!(
        "; the largest: {:.1} at layer {}, dimension {}, token {} {:?} ({:.0} × the median)\n",
        t.value,
        m.layer,
        t.dim,
        t.pos,
        visible(&model.tokenizer.token_text(tokens[t.pos])),
        m.ratio
    );
    let dims: std::collections::BTreeSet<usize> = with
        .iter()
        .flat_map(|m| m.top.iter().map(|t| t.dim))
        .collect();
    let pos: std::collections::BTreeSet<usize> = with
        .iter()
        .flat_map(|m| m.top.iter().map(|t| t.pos))
        .collect();
    s += &format!(
        "  on dimensions {:?} and tokens {}\n",
        dims,
        pos.iter()
            .take(8)
            .map(|&p| format!("{p} {:?}", visible(&model.tokenizer.token_text(tokens[p]))))
            .collect::<Vec<_>>()
            .join(", ")
    );
    s
}
