//! `attnscope corpus`: sink and head statistics over many texts, shardable and resumable;
//! `attnscope corpus merge` combines shards.

use super::common::{emit, on_bar, progress_bar, ModelArgs};
use attnscope::analysis::corpus::Aggregate;
use attnscope::analysis::request::weight_threshold;
use attnscope::commands::corpus::{
    self as command, load_texts, parse_shard, CorpusAggregate, CorpusInput, CorpusRequest,
};
use attnscope::render::table::{bar, sparkline, title, Align, Table};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    cmd: Option<Sub>,
    #[command(flatten)]
    model: Option<ModelArgs>,
    /// Texts: a .txt file (one per line) or .jsonl (objects with "text", or strings).
    /// Default: the built-in corpus of 224 texts.
    #[arg(long, short = 'f')]
    file: Option<PathBuf>,
    /// Use only the first N texts.
    #[arg(long)]
    limit: Option<usize>,
    /// Run shard i of n (texts whose index % n == i), e.g. 0/4.
    #[arg(long)]
    shard: Option<String>,
    /// Append one JSON record per text to this file; rerunning with the same file skips the
    /// texts already in it (resume), and `corpus merge` combines several.
    #[arg(long, short = 'o')]
    out: Option<PathBuf>,
    /// Also run the faithfulness measurement on every text (many forward passes per text).
    #[arg(long)]
    faithfulness: bool,
    /// A head counts as a sink head when its mean first-token weight α₁ exceeds this
    /// (Gu et al. 2025 use 0.3).
    #[arg(long, default_value_t = 0.3, value_parser = weight_threshold::<f32>)]
    epsilon: f32,
    /// Print the aggregate as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Subcommand, Debug)]
enum Sub {
    /// Combine record files of shards; the aggregate equals a single run over all texts.
    Merge {
        /// Record files written with --out.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        #[arg(long, default_value_t = 0.3, value_parser = weight_threshold::<f32>)]
        epsilon: f32,
        #[arg(long)]
        json: bool,
    },
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if let Some(Sub::Merge {
        files,
        epsilon,
        json,
    }) = a.cmd
    {
        let agg = command::merge(&files, epsilon)?;
        return print(&agg, &format!("{} record files", files.len()), json);
    }
    // clap leaves the flattened model arguments out when none is given
    let model_args = a.model.clone().unwrap_or_default();
    let (texts, source) = load_texts(a.file.as_deref())?;
    let req = CorpusRequest {
        limit: a.limit,
        shard: match &a.shard {
            Some(s) => parse_shard(s)?,
            None => (0, 1),
        },
        out: a.out.clone(),
        faithfulness: a.faithfulness,
        epsilon: a.epsilon,
        bos: model_args.bos,
        inputs: model_args
            .input_paths()
            .into_iter()
            .chain(a.file.clone())
            .collect(),
    };
    if let Some(out) = &req.out {
        // refused before the model loads (the run checks it again before it appends)
        let inputs: Vec<&std::path::Path> = req.inputs.iter().map(PathBuf::as_path).collect();
        attnscope::analysis::files::Output::check_append(out, &inputs)?;
    }
    let model = model_args.load()?;
    let bar = progress_bar("texts [{bar:30}] {pos}/{len} ({eta} left)");
    let input = CorpusInput { texts, source };
    let outcome = command::run(
        &model,
        &input,
        &req,
        &mut |note| eprintln!("attnscope: {note}"),
        &mut on_bar(&bar),
    );
    bar.finish_and_clear();
    let outcome = outcome?;
    for s in &outcome.skipped {
        eprintln!("attnscope: skipped {s}");
    }
    let source = format!("{}{}", input.source, req.shard_suffix());
    print(&outcome.aggregate, &source, a.json)
}

/// The aggregate as JSON (`--json`) or as tables.
fn print(agg: &CorpusAggregate, source: &str, json: bool) -> anyhow::Result<()> {
    if json {
        return emit(&format!("{}\n", serde_json::to_string_pretty(agg)?));
    }
    emit(&match agg {
        CorpusAggregate::Decoder(a) => render(a, source),
        CorpusAggregate::Encoder(a) => super::corpus_encoder::render(a, source),
    })
}

/// `corpus`'s text report: the per-layer table, the sink profile, the histogram of the heads'
/// concentration, the summary sentences and the faithfulness table.
fn render(a: &Aggregate, source: &str) -> String {
    let mut s = title(&format!(
        "Attention over {} texts ({} tokens) of {source}, model {}",
        a.sentences, a.tokens, a.model
    ));
    s += "These numbers belong to this corpus and this model; another text set or checkpoint gives others.\n\n";
    s += &layer_table(a);
    let means: Vec<f32> = a.layers.iter().map(|l| l.sink_all.mean as f32).collect();
    s += &format!("sink profile  {}\n\n", sparkline(&means));
    let total: usize = a.max_weight_histogram.iter().sum();
    s += &histogram(a, total);
    let conc = a.max_weight_histogram[9] as f64 / total.max(1) as f64;
    let sinky = a.layers.iter().filter(|l| l.sink_all.ci95.0 > 0.5).count();
    s += &format!(
        "\n{:.1}% of (text, layer, head) rows put ≥ 90% of the last query's attention on one token. In {sinky} of {} layers the 95% CI of the sink share lies above 0.5; the peak is layer {} ({:.3}).\n",
        100.0 * conc,
        a.layers.len(),
        a.peak_layer,
        a.layers[a.peak_layer].sink_all.mean
    );
    s += &format!(
        "Gu et al. 2024's sink metric on these texts (heads with α₁ > {} counting the first token's own row, mean over layers): {:.1}% (their protocol, 64-token prompts: `attnscope sinks --gu-prompts`).\n",
        a.epsilon,
        100.0 * a.gu_sink_metric
    );
    if let Some(m) = &a.massive {
        let dims: Vec<String> = m.dims.iter().map(|(d, k)| format!("{d} ({k})")).collect();
        s += &format!(
            "Massive activations (Sun et al. 2024: |x| > 100 and ≥ 1,000 × the layer's median) in {:.1}% of {} texts{}; {}; {:.1}% of those listed sit on the first token.\n",
            100.0 * m.texts_with_any,
            m.texts,
            m.first_layer
                .map(|l| format!(", in half of them from layer {l} on"))
                .unwrap_or_default(),
            if dims.is_empty() {
                "no dimension holds one".to_string()
            } else {
                format!("dimensions (text-layer pairs): {}", dims.join(", "))
            },
            100.0 * m.first_token_share
        );
    }
    if !a.faithfulness.is_empty() {
        s += &faithfulness_table(a);
    }
    s
}

/// Each layer's sink share (mean, std, 95% CI, ▲ at the peak), sink heads (ours and Gu et
/// al.'s), concentrated heads, entropy and massive activations.
fn layer_table(a: &Aggregate) -> String {
    let mut t = Table::new([
        ("layer", Align::Right),
        ("sink share (all queries)", Align::Right),
        ("± std", Align::Right),
        ("95% CI", Align::Left),
        ("", Align::Left),
        (format!("heads α₁>{}", a.epsilon).as_str(), Align::Right),
        ("Gu et al.", Align::Right),
        ("heads ≥0.9 on one token", Align::Right),
        ("entropy", Align::Right),
        ("massive", Align::Right),
    ]);
    for l in &a.layers {
        t.row([
            l.layer.to_string(),
            format!("{:.4}", l.sink_all.mean),
            format!("{:.4}", l.sink_all.std),
            ci95_text(&l.sink_all),
            mean_bar(&l.sink_all, l.layer == a.peak_layer),
            format!("{:.1}%", 100.0 * l.sink_heads_fraction),
            format!("{:.1}%", 100.0 * l.gu_heads_fraction),
            format!("{:.1}%", 100.0 * l.concentrated_fraction),
            format!("{:.3}", l.mean_entropy),
            l.massive_texts_fraction
                .map_or("-".into(), |f| format!("{:.0}%", 100.0 * f)),
        ]);
    }
    t.render()
}

/// The histogram of the last query's max weight over every text, layer and head (`total` rows).
fn histogram(a: &Aggregate, total: usize) -> String {
    let mut s = String::new();
    s += &title(
        "How concentrated are heads? Last-query max weight over all texts, layers and heads",
    );
    let mut t = Table::new([
        ("max weight", Align::Left),
        ("share", Align::Right),
        ("", Align::Left),
    ]);
    for (i, &c) in a.max_weight_histogram.iter().enumerate() {
        let f = c as f32 / total.max(1) as f32;
        t.row([
            format!("{:.1}–{:.1}", i as f32 / 10.0, (i + 1) as f32 / 10.0),
            format!("{:.1}%", 100.0 * f),
            bar(f, 40),
        ]);
    }
    s += &t.render();
    s
}

/// Each ranking's mean Spearman ρ against leave-one-out over the texts, with its 95% CI and
/// top-1 agreement.
fn faithfulness_table(a: &Aggregate) -> String {
    let mut s = String::new();
    s += &title("\nFaithfulness: Spearman ρ against leave-one-out, over texts");
    let mut t = Table::new([
        ("ranking", Align::Left),
        ("first token", Align::Left),
        ("mean ρ", Align::Right),
        ("95% CI", Align::Left),
        ("top-1 agreement", Align::Right),
    ]);
    for f in &a.faithfulness {
        t.row([
            f.ranking.clone(),
            if f.without_first {
                "excluded"
            } else {
                "included"
            }
            .into(),
            format!("{:+.3}", f.spearman.mean),
            format!("[{:+.3}, {:+.3}]", f.spearman.ci95.0, f.spearman.ci95.1),
            format!("{:.1}%", 100.0 * f.top1_rate),
        ]);
    }
    s += &t.render();
    s
}
/// A statistic's 95% confidence interval, as the tables print it.
pub(super) fn ci95_text(s: &attnscope::analysis::corpus::Stat) -> String {
    format!("[{:.4}, {:.4}]", s.ci95.0, s.ci95.1)
}

/// A bar of a statistic's mean, marked when its layer is the peak.
pub(super) fn mean_bar(s: &attnscope::analysis::corpus::Stat, peak: bool) -> String {
    bar(s.mean as f32, 20) + if peak { " ▲ peak" } else { "" }
}
