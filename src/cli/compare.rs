//! `attnscope compare`: two texts, two models or two precisions side by side.

use super::common::{emit, output_path, read_text, LESSON_SENTENCE};
use attnscope::analysis::request::unsigned_opt;
use attnscope::commands::compare::{
    self as command, CompareCommand, CompareOptions, CompareReport,
};
use attnscope::model::fetch::DEFAULT_MODEL;
use attnscope::model::tokenize::visible;
use attnscope::model::Precision;
use attnscope::render::compare_page::page;
use attnscope::render::table::{bar, title, Align, Table};
use std::io::IsTerminal;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A model (alias, .gguf, Hugging Face folder or hub id); give it twice to compare two
    /// models on one text (their tokenizers must split it the same way).
    #[arg(long, short = 'm')]
    model: Vec<String>,
    /// exact or fast; give `--precision exact --precision fast` to compare the two.
    #[arg(long, value_parser = super::common::precision_parser())]
    precision: Vec<Precision>,
    /// A text; give it twice to compare two texts on one model. Default: the lesson's sentence.
    #[arg(long, short = 't')]
    text: Vec<String>,
    /// A UTF-8 file holding a text (counts like --text).
    #[arg(long, short = 'f')]
    file: Vec<PathBuf>,
    /// Put the model's BOS token first even though its metadata does not ask for one.
    #[arg(long, conflicts_with = "no_bos")]
    bos: bool,
    /// Leave out the BOS token the models' metadata asks for.
    #[arg(long)]
    no_bos: bool,
    /// Query position whose rows are compared (default: the last token of each side).
    #[arg(long, short = 'q', allow_negative_numbers = true)]
    query: Option<i64>,
    /// How many of the most changed heads to list.
    #[arg(long, default_value_t = 10)]
    top: usize,
    /// Print one JSON document instead of the tables.
    #[arg(long)]
    json: bool,
    /// Also write a self-contained HTML page with both sides side by side.
    #[arg(long)]
    html: Option<PathBuf>,
    /// Replace the --html file if it exists.
    #[arg(long)]
    force: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let opts = CompareOptions {
        // the texts' lengths are known later: their positions, from 0, are checked there
        query: unsigned_opt(a.query, "query position", 0, "the text has")?,
        top: a.top,
        bos: a.bos,
    };
    opts.check()?;
    let models = if a.model.is_empty() {
        vec![DEFAULT_MODEL.to_string()]
    } else {
        a.model.clone()
    };
    let mut inputs: Vec<PathBuf> = models
        .iter()
        .flat_map(|m| super::common::model_paths(m))
        .collect();
    inputs.extend(a.file.iter().cloned());
    let output = a
        .html
        .as_deref()
        .map(|h| output_path(h, a.force, &inputs))
        .transpose()?;
    let texts = texts_of(&a)?;
    let precisions = if a.precision.is_empty() {
        vec![Precision::Exact]
    } else {
        a.precision.clone()
    };
    let c = CompareCommand {
        texts,
        models,
        precisions,
        no_bos: a.no_bos,
        progress: std::io::stderr().is_terminal(),
        options: opts,
    };
    let report = command::run(&c)?;
    if let Some(out) = &output {
        out.write(page(&report).as_bytes())?;
        eprintln!("wrote {}", out.path.display());
    }
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        // the rows themselves, for notebooks
        for (k, s) in [("a", &report.a), ("b", &report.b)] {
            v[k]["rows"] = serde_json::to_value(&s.rows)?;
        }
        return emit(&format!("{}\n", serde_json::to_string_pretty(&v)?));
    }
    emit(&render(&report))
}

/// The --text texts, then the --file ones; the lesson's sentence when none is given.
fn texts_of(a: &Args) -> anyhow::Result<Vec<String>> {
    let mut texts = a.text.clone();
    for f in &a.file {
        texts.push(read_text(f)?);
    }
    if texts.is_empty() {
        texts.push(LESSON_SENTENCE.into());
    }
    Ok(texts)
}

fn render(r: &CompareReport) -> String {
    let mut s = title(&format!("Compare two {}", r.mode));
    s += &sides_lines(r);
    s += "\n";
    s += &sink_profile_table(r);
    s += &top_changed_table(r);
    s += &js_shades(r);
    s += &next_token_table(r);
    s += &title("Summary");
    s += &format!("{}\n", r.summary);
    s
}

/// Each side's label, model, precision, length and query; the embeddings' cosine; where the
/// tokens differ.
fn sides_lines(r: &CompareReport) -> String {
    let mut s = String::new();
    for (k, side) in [("A", &r.a), ("B", &r.b)] {
        s += &format!(
            "{k}: {} · {} · {} · {} tokens, query {} \"{}\"\n",
            side.label,
            side.model,
            side.precision,
            side.tokens.len(),
            side.query,
            visible(&side.tokens[side.query])
        );
    }
    if let Some(c) = r.embedding_cosine {
        s += &format!("Sentence embeddings (mean-pooled): cosine similarity {c:.6}\n");
    }
    if !r.same_tokens {
        let (ta, tb) = (&r.a.token_ids, &r.b.token_ids);
        if ta.len() == tb.len() {
            let at: Vec<String> = (0..ta.len())
                .filter(|&i| ta[i] != tb[i])
                .map(|i| i.to_string())
                .collect();
            s += &format!(
                "The tokens differ at position(s) {}: rows are compared key position by key position.\n",
                at.join(", ")
            );
        } else {
            s += "The two sides have different lengths: rows are compared by key position (a shorter row counts as 0 beyond its end).\n";
        }
    }
    s
}

/// The share of attention on the first token per layer, A against B, with the mean JS.
fn sink_profile_table(r: &CompareReport) -> String {
    let mut s = String::new();
    s += &title("Sink profile per layer: share of attention on the first token (mean over heads)");
    let mut t = Table::new([
        ("layer", Align::Right),
        ("A all q", Align::Right),
        ("B all q", Align::Right),
        ("B − A", Align::Right),
        ("", Align::Left),
        ("A query", Align::Right),
        ("B query", Align::Right),
        ("B − A", Align::Right),
        ("mean JS", Align::Right),
    ]);
    let max_diff = r
        .layers
        .iter()
        .map(|l| l.sink_all_diff.abs())
        .fold(0.0f32, f32::max);
    for l in &r.layers {
        let d = l.sink_all_diff;
        let b = bar(
            if max_diff > 0.0 {
                d.abs() / max_diff
            } else {
                0.0
            },
            12,
        );
        t.row([
            l.layer.to_string(),
            format!("{:.4}", l.sink_all_a),
            format!("{:.4}", l.sink_all_b),
            format!("{d:+.4}"),
            if d < 0.0 {
                format!("-{b}")
            } else {
                format!("+{b}")
            },
            format!("{:.4}", l.sink_query_a),
            format!("{:.4}", l.sink_query_b),
            format!("{:+.4}", l.sink_query_diff),
            format!("{:.4}", l.mean_js),
        ]);
    }
    s += &t.render();
    s += &format!("bars: |B − A| over all queries, scaled to the largest ({max_diff:.4}). mean JS: Jensen–Shannon divergence of the query's rows, in bits, averaged over the layer's heads.\n\n");
    s
}

/// The heads whose query rows changed most, with each side's top keys.
fn top_changed_table(r: &CompareReport) -> String {
    let mut s = String::new();
    s += &title(&format!(
        "The {} heads whose query rows changed most (JS divergence, bits)",
        r.top_changed.len()
    ));
    let mut t = Table::new([
        ("layer.head", Align::Right),
        ("JS", Align::Right),
        ("A top keys", Align::Left),
        ("B top keys", Align::Left),
    ]);
    let keys = |k: &[attnscope::analysis::compare::Key]| {
        k.iter()
            .map(|k| format!("{} \"{}\" {:.3}", k.pos, visible(&k.token), k.weight))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for h in &r.top_changed {
        t.row([
            format!("{}.{}", h.layer, h.head),
            format!("{:.4}", h.js),
            keys(&h.top_a),
            keys(&h.top_b),
        ]);
    }
    s += &t.render();
    s
}

/// The JS divergence of every head as a shaded grid (rows: layers).
fn js_shades(r: &CompareReport) -> String {
    let mut s = String::new();
    let max_js =
        r.js.iter()
            .flatten()
            .copied()
            .filter(|v| v.is_finite())
            .fold(0.0f64, f64::max);
    s += &format!("\nJS divergence per head (rows: layers; columns: heads; ' ░▒▓█' = 0 .. {max_js:.4} bits, the largest)\n");
    for (l, hs) in r.js.iter().enumerate() {
        let shade: String = hs
            .iter()
            .map(|&v| {
                if v.is_nan() {
                    '?'
                } else if max_js > 0.0 {
                    [' ', '░', '▒', '▓', '█'][((v / max_js * 4.0).round() as usize).min(4)]
                } else {
                    ' '
                }
            })
            .collect();
        s += &format!("{l:>4} |{shade}|\n");
    }
    s += "\n";
    s
}

/// Each side's next-token prediction (none for an encoder).
fn next_token_table(r: &CompareReport) -> String {
    let mut s = String::new();
    // an encoder has no next-token prediction
    if !(r.a.next_token.is_empty() && r.b.next_token.is_empty()) {
        s += &title("Next token");
        let mut t = Table::new([
            ("rank", Align::Right),
            ("A", Align::Left),
            ("p", Align::Right),
            ("B", Align::Left),
            ("p", Align::Right),
        ]);
        for i in 0..r.a.next_token.len().max(r.b.next_token.len()) {
            let cell = |v: &[(String, f32)]| {
                v.get(i)
                    .map(|(t, p)| (format!("\"{}\"", visible(t)), format!("{p:.4}")))
                    .unwrap_or_default()
            };
            let (ta, pa) = cell(&r.a.next_token);
            let (tb, pb) = cell(&r.b.next_token);
            t.row([(i + 1).to_string(), ta, pa, tb, pb]);
        }
        s += &t.render();
        s += "\n";
    }
    s
}
