//! `attnscope circuit`: which edges between heads, MLPs and the input carry the answer (EAP,
//! EAP-IG), and how faithful the circuits of the top edges are (exact edge patching).

use super::common::{emit, usage, ModelArgs};
use attnscope::analysis::circuit::evaluate::{Evaluation, ExactEdges, LadderPoint};
use attnscope::analysis::circuit::{read_pairs, Method, MetricKind, Pair};
use attnscope::analysis::vocab::Target;
use attnscope::commands::circuit::{self as command, CircuitOptions, CircuitReport};
use attnscope::render::circuit_page::page;
use attnscope::render::table::{title, Align, Table};
use std::path::PathBuf;

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum MethodArg {
    /// edge attribution patching (Syed et al. 2023): the gradient at the clean run
    Eap,
    /// EAP with integrated gradients (Hanna et al. 2024): the gradient averaged over inputs
    /// between the corrupted and the clean embeddings
    EapIg,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum MetricArg {
    /// logit(answer) − logit(wrong) at the last position
    LogitDiff,
    /// log p(answer) at the last position
    Logprob,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The clean text (the model gets it right).
    #[arg(long, conflicts_with = "pairs")]
    clean: Option<String>,
    /// The corrupted text: the same number of tokens, one detail changed.
    #[arg(long, conflicts_with = "pairs")]
    corrupt: Option<String>,
    /// The token the clean text should predict: its text (e.g. " Alice", exactly one token) or id.
    #[arg(long, conflicts_with = "pairs")]
    answer: Option<Target>,
    /// The token the corrupted text should predict (the logit difference's other side).
    #[arg(long, conflicts_with = "pairs")]
    wrong: Option<Target>,
    /// Many pairs, averaged: a JSONL file, one {"clean", "corrupt", "answer", "wrong"} a line.
    #[arg(long)]
    pairs: Option<PathBuf>,
    /// How edges are scored.
    #[arg(long, value_enum, default_value_t = MethodArg::Eap)]
    method: MethodArg,
    /// EAP-IG's steps between the corrupted and the clean embeddings (midpoints; default 5).
    #[arg(long)]
    steps: Option<usize>,
    /// The metric the circuit explains.
    #[arg(long, value_enum, default_value_t = MetricArg::LogitDiff)]
    metric: MetricArg,
    /// Also evaluate the circuits of the top 0.1 .. 100% of edges by exact edge patching:
    /// faithfulness per size, MIB's CPR and CMD.
    #[arg(long)]
    evaluate: bool,
    /// Also patch the top N edges one at a time, exactly, beside their scores.
    #[arg(long, default_value_t = 0, value_name = "N")]
    exact_edges: usize,
    /// Edges printed.
    #[arg(long, default_value_t = 20, value_parser = attnscope::analysis::request::at_least_one)]
    top: usize,
    #[arg(long)]
    json: bool,
    /// Also write the circuit's page: the graph (layers left to right, the top edges by score),
    /// a slider for the circuit size beside the faithfulness curve (with --evaluate), each
    /// edge's score and exact patch (with --exact-edges) on hover, and for the heads the top
    /// edges touch, on a click, the head's attention row from the clean text's last position
    /// (the first pair's with --pairs) and the QK split of its top key.
    #[arg(long, value_name = "FILE")]
    html: Option<PathBuf>,
    /// Replace the --html file if it exists.
    #[arg(long, requires = "html")]
    force: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let opts = options(&a)?;
    let mut inputs = a.model.input_paths();
    inputs.extend(a.pairs.iter().cloned());
    let output = a
        .html
        .as_deref()
        .map(|h| super::common::output_path(h, a.force, &inputs))
        .transpose()?;
    let model = a.model.load()?;
    let report = command::run(&model, &opts)?;
    if let Some(out) = &output {
        // the heads a click shows, on the (first pair's) clean text
        let views = command::page_views(&model, &opts, &report)?;
        let d = &model.dims;
        let shape = [d.n_layers, d.n_heads, d.n_kv_heads];
        out.write(page(&report, shape, &views).as_bytes())?;
        eprintln!("wrote {}", out.path.display());
    }
    if a.json {
        return emit(&format!("{}\n", serde_json::to_string(&report)?));
    }
    emit(&render(&report, a.top))
}

/// The flags checked (before the model loads) into the command's options.
fn options(a: &Args) -> anyhow::Result<CircuitOptions> {
    let method = match (a.method, a.steps) {
        (MethodArg::Eap, Some(_)) => {
            return Err(usage("--steps is EAP-IG's: add --method eap-ig"));
        }
        (MethodArg::Eap, None) => Method::Eap,
        (MethodArg::EapIg, Some(0)) => {
            return Err(usage("--steps 0: EAP-IG needs at least one step"));
        }
        (MethodArg::EapIg, steps) => Method::EapIg {
            steps: steps.unwrap_or(5),
        },
    };
    let metric = match a.metric {
        MetricArg::LogitDiff => MetricKind::LogitDiff,
        MetricArg::Logprob => MetricKind::Logprob,
    };
    let pairs = match &a.pairs {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| usage(format!("--pairs {}: {e}", path.display())))?;
            read_pairs(&text, &path.display().to_string())?
        }
        None => vec![one_pair(a, metric)?],
    };
    Ok(CircuitOptions {
        force_bos: a.model.bos,
        evaluate: a.evaluate,
        exact_edges: a.exact_edges,
        ..CircuitOptions::new(pairs, method, metric)
    })
}

/// The pair of `--clean`, `--corrupt`, `--answer`, `--wrong` (the wrong token only for a logit
/// difference).
fn one_pair(a: &Args, metric: MetricKind) -> anyhow::Result<Pair> {
    let missing = [
        ("--clean", a.clean.is_none()),
        ("--corrupt", a.corrupt.is_none()),
        ("--answer", a.answer.is_none()),
        (
            "--wrong",
            a.wrong.is_none() && metric == MetricKind::LogitDiff,
        ),
    ];
    if let Some((flag, _)) = missing.iter().find(|(_, m)| *m) {
        return Err(usage(format!(
            "{flag} is missing: give --clean, --corrupt, --answer and --wrong (or --pairs FILE.jsonl)"
        )));
    }
    let answer = a.answer.clone().expect("checked above");
    Ok(Pair {
        clean: a.clean.clone().expect("checked above"),
        corrupt: a.corrupt.clone().expect("checked above"),
        wrong: a.wrong.clone().unwrap_or_else(|| answer.clone()),
        answer,
    })
}

/// The report as the terminal shows it: the runs, the top edges and the nodes they join, and
/// the evaluation and exact edges when asked.
fn render(r: &CircuitReport, top: usize) -> String {
    let method = match r.steps {
        Some(s) => format!("{} ({s} steps)", r.method),
        None => r.method.to_string(),
    };
    let mut s = title(&format!("Circuit: {} on {}", method, r.model));
    s += &format!(
        "metric {}: clean {:.4}, corrupted {:.4} ({} pair{}); graph: {} nodes, {} readers, {} edges; {:.1} s\n\n",
        r.metric.name(),
        r.clean_metric,
        r.corrupt_metric,
        r.pairs,
        if r.pairs == 1 { "" } else { "s" },
        r.n_nodes,
        r.n_readers,
        r.n_edges,
        r.seconds
    );
    let shown = &r.edges[..top.min(r.edges.len())];
    let mut t = Table::new([
        ("#", Align::Right),
        ("from", Align::Left),
        ("to", Align::Left),
        ("score", Align::Right),
    ]);
    for (i, e) in shown.iter().enumerate() {
        t.row([
            (i + 1).to_string(),
            e.from.clone(),
            e.to.clone(),
            format!("{:+.5}", e.score),
        ]);
    }
    s += &format!(
        "the top {} edges by |score| (score ≈ the metric's change if the edge carried the corrupted activation)\n",
        shown.len()
    );
    s += &t.render();
    let mut joined: Vec<&str> = Vec::new();
    for e in shown {
        for n in [e.from.as_str(), e.to.as_str()] {
            if !joined.contains(&n) {
                joined.push(n);
            }
        }
    }
    s += &format!("nodes they join: {}\n", joined.join(", "));
    if let Some(ev) = &r.evaluation {
        s += &render_evaluation(ev);
    }
    if let Some(x) = &r.exact_edges {
        s += &render_exact(x);
    }
    s
}

fn ladder_table(points: &[LadderPoint]) -> String {
    let mut t = Table::new([
        ("edges", Align::Right),
        ("share", Align::Right),
        ("metric", Align::Right),
        ("faithfulness", Align::Right),
    ]);
    for p in points {
        t.row([
            p.edges.to_string(),
            format!("{}%", p.fraction * 100.0),
            format!("{:.4}", p.metric),
            format!("{:.3}", p.faithfulness),
        ]);
    }
    t.render()
}

fn render_evaluation(ev: &Evaluation) -> String {
    let mut s = format!(
        "\nfaithfulness by exact edge patching ((m(circuit) − m(corrupted)) / (m(clean) − m(corrupted)); clean {:.4}, corrupted {:.4}; {:.1} s)\n",
        ev.clean_metric, ev.corrupt_metric, ev.seconds
    );
    s += "circuits of the top edges by |score|:\n";
    s += &ladder_table(&ev.ladder);
    s += "circuits of the top edges by −score (those that carry the clean answer first):\n";
    s += &ladder_table(&ev.signed_ladder);
    s += &format!(
        "MIB's CPR (area under the faithfulness of the −score ladder, higher is better): {:.4}\nMIB's CMD (area between the |score| ladder's faithfulness and 1, lower is better): {:.4}\n",
        ev.cpr, ev.cmd
    );
    s
}

fn render_exact(x: &ExactEdges) -> String {
    let mut t = Table::new([
        ("from", Align::Left),
        ("to", Align::Left),
        ("score", Align::Right),
        ("exact Δm", Align::Right),
    ]);
    for e in &x.edges {
        t.row([
            e.from.clone(),
            e.to.clone(),
            format!("{:+.5}", e.score),
            format!("{:+.5}", e.exact),
        ]);
    }
    format!(
        "\nthe top {} edges patched one at a time (exact Δm: the clean run with that edge carrying the corrupted activation; {:.1} s)\n{}Spearman's ρ of score and exact Δm: {}\n",
        x.edges.len(),
        x.seconds,
        t.render(),
        x.spearman.map_or("n/a".into(), |r| format!("{r:.3}"))
    )
}
