//! `attnscope corpus`: sink and head statistics over many texts, shardable and resumable;
//! `attnscope corpus merge` combines shards.

use super::common::{emit, usage, ModelArgs};
use crate::analysis::corpus::{
    aggregate, builtin, parse_lines, read_record_files, read_records, text_records, Aggregate,
    Record, BATCH_TEXTS,
};
use crate::render::table::{bar, sparkline, title, Align, Table};
use anyhow::Context;
use std::io::{IsTerminal, Write};
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
    #[arg(long, default_value_t = 0.3)]
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
        #[arg(long, default_value_t = 0.3)]
        epsilon: f32,
        #[arg(long)]
        json: bool,
    },
}

/// The texts of `--file` (or the built-in corpus) with the ids `corpus` gives them, and a name
/// for the source.
pub fn load_texts(file: &Option<PathBuf>) -> anyhow::Result<(Vec<String>, String)> {
    let Some(f) = file else {
        return Ok((builtin(), "the built-in corpus".into()));
    };
    let bytes =
        std::fs::read(f).map_err(|e| usage(format!("cannot read --file {}: {e}", f.display())))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        usage(format!(
            "{} is not valid UTF-8 (first bad byte at offset {})",
            f.display(),
            e.utf8_error().valid_up_to()
        ))
    })?;
    let texts = if f.extension().is_some_and(|e| e == "jsonl") {
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                let v: serde_json::Value = serde_json::from_str(l)
                    .map_err(|e| usage(format!("{}:{}: not JSON: {e}", f.display(), i + 1)))?;
                match v {
                    serde_json::Value::String(s) => Ok(s),
                    serde_json::Value::Object(o) => o
                        .get("text")
                        .and_then(|t| t.as_str())
                        .map(String::from)
                        .ok_or_else(|| {
                            usage(format!("{}:{}: no \"text\" field", f.display(), i + 1))
                        }),
                    _ => Err(usage(format!(
                        "{}:{}: expected a string or an object with \"text\"",
                        f.display(),
                        i + 1
                    ))),
                }
            })
            .collect::<anyhow::Result<Vec<_>>>()?
    } else {
        parse_lines(&text, false)
    };
    if texts.is_empty() {
        return Err(usage(format!("{} holds no texts", f.display())));
    }
    Ok((texts, f.display().to_string()))
}

fn parse_shard(s: &str) -> anyhow::Result<(usize, usize)> {
    let bad = || {
        usage(format!(
            "--shard {s} is not of the form i/n with 0 <= i < n, e.g. 0/4"
        ))
    };
    let (i, n) = s.split_once('/').ok_or_else(bad)?;
    let (i, n): (usize, usize) = (
        i.trim().parse().map_err(|_| bad())?,
        n.trim().parse().map_err(|_| bad())?,
    );
    if n == 0 || i >= n {
        return Err(bad());
    }
    Ok((i, n))
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if let Some(Sub::Merge {
        files,
        epsilon,
        json,
    }) = a.cmd
    {
        let mut texts = Vec::new();
        for f in &files {
            let text = std::fs::read_to_string(f)
                .map_err(|e| usage(format!("cannot read {}: {e}", f.display())))?;
            texts.push((text, f.display().to_string()));
        }
        let encoders = texts
            .iter()
            .filter(|(t, _)| crate::analysis::corpus_encoder::is_encoder_file(t))
            .count();
        if encoders == texts.len() {
            return super::corpus_encoder::merge(&texts, json);
        }
        if encoders > 0 {
            return Err(usage(format!(
                "{encoders} of the {} record files hold an encoder's records and the others a decoder's; merge the records of one model at a time",
                texts.len()
            )));
        }
        let records = read_record_files(&texts).map_err(usage)?;
        let agg = aggregate(&records, epsilon).map_err(usage)?;
        let source = format!("{} record files", files.len());
        return emit(&if json {
            format!("{}\n", serde_json::to_string_pretty(&agg)?)
        } else {
            render(&agg, &source)
        });
    }
    // clap leaves the flattened model arguments out when none is given
    let model_args = a.model.clone().unwrap_or_default();
    let (texts, source) = load_texts(&a.file)?;
    let (si, sn) = match &a.shard {
        Some(s) => parse_shard(s)?,
        None => (0, 1),
    };
    let selected: Vec<usize> = (0..texts.len().min(a.limit.unwrap_or(usize::MAX)))
        .filter(|i| i % sn == si)
        .collect();
    let model = model_args.load()?;
    if model.is_encoder() {
        if a.faithfulness {
            return Err(usage(format!("--faithfulness ranks tokens against a next token's probability; {} is an encoder (no next-token prediction)", model.info.name)));
        }
        let shard = if sn > 1 {
            format!(", shard {si}/{sn}")
        } else {
            String::new()
        };
        return super::corpus_encoder::run(
            &model,
            &texts,
            &selected,
            a.out.as_deref(),
            &format!("{source}{shard}"),
            a.json,
        );
    }
    let (mut records, mut out_file) = resume::<Record>(
        a.out.as_deref(),
        &model.info.name,
        &texts,
        &source,
        &|t, name| read_records(t, name),
        &|r| (r.model.as_str(), r.id, r.text.as_str()),
    )?;
    let todo: Vec<usize> = selected
        .iter()
        .copied()
        .filter(|i| !records.iter().any(|r| r.id == *i))
        .collect();
    let bar_ = if std::io::stderr().is_terminal() {
        indicatif::ProgressBar::new(todo.len() as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar_.set_style(
        indicatif::ProgressStyle::with_template("texts [{bar:30}] {pos}/{len} ({eta} left)")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let mut skipped = Vec::new();
    // many texts to a forward (`text_records`), their records written as each chunk ends
    for chunk in todo.chunks(BATCH_TEXTS) {
        let items: Vec<(usize, &str)> = chunk.iter().map(|&i| (i, texts[i].as_str())).collect();
        let recs = text_records(&model, &items, model_args.bos, a.faithfulness, |_| {})?;
        for (&i, rec) in chunk.iter().zip(recs) {
            let rec = match rec {
                Ok(r) => r,
                Err(e) => {
                    skipped.push(format!("text {i}: {e}"));
                    bar_.inc(1);
                    continue;
                }
            };
            if let Some(f) = out_file.as_mut() {
                writeln!(f, "{}", serde_json::to_string(&rec)?).context("appending to --out")?;
                f.flush()?;
            }
            records.push(rec);
            bar_.inc(1);
        }
    }
    bar_.finish_and_clear();
    for s in &skipped {
        eprintln!("attnscope: skipped {s}");
    }
    let agg = aggregate(&records, a.epsilon).map_err(usage)?;
    let shard = if sn > 1 {
        format!(", shard {si}/{sn}")
    } else {
        String::new()
    };
    let source = format!("{source}{shard}");
    emit(&if a.json {
        format!("{}\n", serde_json::to_string_pretty(&agg)?)
    } else {
        render(&agg, &source)
    })
}

fn render(a: &Aggregate, source: &str) -> String {
    let mut s = title(&format!(
        "Attention over {} texts ({} tokens) of {source}, model {}",
        a.sentences, a.tokens, a.model
    ));
    s += "These numbers belong to this corpus and this model; another text set or checkpoint gives others.\n\n";
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
            format!("[{:.4}, {:.4}]", l.sink_all.ci95.0, l.sink_all.ci95.1),
            bar(l.sink_all.mean as f32, 20)
                + if l.layer == a.peak_layer {
                    " ▲ peak"
                } else {
                    ""
                },
            format!("{:.1}%", 100.0 * l.sink_heads_fraction),
            format!("{:.1}%", 100.0 * l.gu_heads_fraction),
            format!("{:.1}%", 100.0 * l.concentrated_fraction),
            format!("{:.3}", l.mean_entropy),
            l.massive_texts_fraction
                .map_or("-".into(), |f| format!("{:.0}%", 100.0 * f)),
        ]);
    }
    s += &t.render();
    let means: Vec<f32> = a.layers.iter().map(|l| l.sink_all.mean as f32).collect();
    s += &format!("sink profile  {}\n\n", sparkline(&means));
    let total: usize = a.max_weight_histogram.iter().sum();
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
    }
    s
}

/// `--out`'s records so far and the file opened for appending (none without `--out`): a torn last
/// line (a run killed while appending: no newline, not a whole record) is dropped and its text runs
/// again; a whole record whose newline was never written gets it. Records of another model, or of
/// a text that is not the same text here, are refused: the file belongs to another run.
/// `parse(text, name)` reads a file's records, `meta(r)` gives a record's (model, id, text).
#[allow(clippy::type_complexity)]
pub(super) fn resume<R: serde::de::DeserializeOwned>(
    out: Option<&std::path::Path>,
    model_name: &str,
    texts: &[String],
    source: &str,
    parse: &dyn Fn(&str, &str) -> Result<Vec<R>, String>,
    meta: &dyn Fn(&R) -> (&str, usize, &str),
) -> anyhow::Result<(Vec<R>, Option<std::fs::File>)> {
    let Some(path) = out else {
        return Ok((Vec::new(), None));
    };
    let mut records = Vec::new();
    if path.exists() {
        let mut text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        if !text.is_empty() && !text.ends_with('\n') {
            let start = text.rfind('\n').map_or(0, |i| i + 1);
            let last = &text[start..];
            let complete = serde_json::from_str::<R>(last).is_ok();
            // only a fragment of one of our records is dropped, and only below records that
            // read back: another kind of file is refused by `parse` below, untouched
            if !complete && last.starts_with("{\"id\":") && parse(&text[..start], "").is_ok() {
                eprintln!("attnscope: {} ends in a torn line ({} bytes, written when a run was stopped); dropping it, its text runs again", path.display(), last.len());
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .and_then(|f| f.set_len(start as u64))
                    .with_context(|| format!("dropping the torn line of {}", path.display()))?;
                text.truncate(start);
            } else if complete {
                // a whole record whose newline was never written: end its line before appending
                std::fs::OpenOptions::new()
                    .append(true)
                    .open(path)
                    .and_then(|mut f| f.write_all(b"\n"))
                    .with_context(|| format!("appending to {}", path.display()))?;
            }
        }
        records = parse(&text, &path.display().to_string()).map_err(usage)?;
        for r in &records {
            let (model, id, t) = meta(r);
            if model != model_name {
                return Err(usage(format!(
                    "{} holds records of model `{model}`, not `{model_name}`; use another --out",
                    path.display()
                )));
            }
            if texts.get(id).map(String::as_str) != Some(t) {
                return Err(usage(format!("{} holds record {id} for a text that is not text {id} of {source}; use another --out", path.display())));
            }
        }
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    Ok((records, Some(file)))
}
