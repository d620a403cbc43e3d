//! `attnscope ablate`: every head's (and MLP's) effect on the prediction when it is removed,
//! beside what its attention looks like: the lesson's "a weight is not an explanation", measured.

use super::common::{emit, on_bar, parse_index_list, progress_bar, ModelText};
use attnscope::analysis::vocab::Target;
use attnscope::commands::ablate::{self as command, AblateMethod, AblateOptions, AblateReport};
use attnscope::model::tokenize::visible;
use attnscope::render::table::{order_by_magnitude, title, Align, Table};

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum MethodArg {
    /// the head's output (its slice of `hook_z`, before W_O) set to 0
    Zero,
    /// the head's output set to its mean over the text's positions
    Mean,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    input: ModelText,
    /// How a head is removed.
    #[arg(long, value_enum, default_value_t = MethodArg::Zero)]
    method: MethodArg,
    /// The token whose log-probability at the last position is measured: `next` (the model's
    /// own top token), a token id, or a token's text (e.g. " Paris"; must be one token).
    #[arg(long, default_value = "next")]
    target: Target,
    /// Ablate only at these positions (e.g. `0`, `3-5`, `0,7`); default all.
    #[arg(long, allow_negative_numbers = true)]
    positions: Option<String>,
    /// Also ablate each layer's MLP output.
    #[arg(long)]
    mlp: bool,
    /// Heads printed, largest |Δ log p| first (`--json` has all).
    #[arg(long, default_value_t = 15, value_parser = attnscope::analysis::request::at_least_one)]
    top: usize,
    /// Most positions stacked into one forward (edited runs of one layer go together).
    #[arg(long, default_value_t = attnscope::analysis::intervene::DEFAULT_BATCH_ROWS, hide = true)]
    batch_rows: usize,
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let model = a.input.model.load()?;
    let tokens = a.input.text.tokens(&model, a.input.model.bos)?;
    let positions = a
        .positions
        .as_deref()
        .map(|s| parse_index_list(s, tokens.len(), "position"))
        .transpose()?;
    let opts = AblateOptions {
        method: match a.method {
            MethodArg::Zero => AblateMethod::Zero,
            MethodArg::Mean => AblateMethod::Mean,
        },
        target: a.target,
        positions,
        mlp: a.mlp,
        batch_rows: a.batch_rows,
    };
    let bar = progress_bar("ablations [{bar:30}] {pos}/{len} ({eta})");
    let report = command::run(&model, &tokens, &opts, on_bar(&bar))?;
    bar.finish_and_clear();
    if a.json {
        return emit(&format!("{}\n", serde_json::to_string_pretty(&report)?));
    }
    emit(&render(&report, a.top))
}

fn opt(x: Option<f64>, digits: usize) -> String {
    x.map(|v| format!("{v:+.digits$}"))
        .unwrap_or_else(|| "—".into())
}

/// `ablate`'s text report: the target, the heads whose removal matters most, the most
/// concentrated heads and their ranks, the MLPs, the rank correlations and the work done.
pub fn render(r: &AblateReport, top: usize) -> String {
    let piece = |p: usize| visible(&r.tokens[p].text);
    let mut s = title(&format!(
        "{} ablation of every head ({} heads), {}",
        r.method,
        r.heads.len(),
        r.model
    ));
    s += &format!(
        "target after {:?} (position {}): {:?} (id {}), log p = {:.4}\n",
        piece(r.query),
        r.query,
        visible(&r.target.text),
        r.target.id,
        r.baseline_logprob
    );
    if let Some(ps) = &r.positions {
        s += &format!("ablated at positions {ps:?} only\n");
    }
    let order = order_by_magnitude(&r.heads.iter().map(|h| h.delta_logprob).collect::<Vec<_>>());
    s += &top_heads(r, &order, top);
    s += &concentrated_heads(r, &order);
    if !r.mlp.is_empty() {
        s += "\nMLP ablations:\n";
        let mut t = Table::new([
            ("layer", Align::Right),
            ("Δ log p", Align::Right),
            ("KL", Align::Right),
        ]);
        for m in &r.mlp {
            t.row([
                m.layer.to_string(),
                format!("{:+.4}", m.delta_logprob),
                format!("{:.4}", m.kl),
            ]);
        }
        s += &t.render();
    }
    s += &correlations(r);
    s += &format!(
        "\n{} forward passes; {} layer-position rows computed ({:.0}% of running each ablation from scratch)\n",
        r.forward_passes,
        r.layer_rows,
        100.0 * r.layer_rows as f64 / r.layer_rows_from_scratch.max(1) as f64
    );
    s
}

/// A token's text by position, made visible.
fn piece(r: &AblateReport, p: usize) -> String {
    visible(&r.tokens[p].text)
}

/// The `top` heads by |Δ log p| (`order`), with their attention of the last query.
fn top_heads(r: &AblateReport, order: &[usize], top: usize) -> String {
    let piece = |p: usize| piece(r, p);
    let mut s = String::new();
    let mut t = Table::new([
        ("head", Align::Left),
        ("Δ log p", Align::Right),
        ("KL", Align::Right),
        ("max weight", Align::Right),
        ("on", Align::Left),
        ("sink", Align::Right),
        ("entropy", Align::Right),
    ]);
    for &i in order.iter().take(top) {
        let h = &r.heads[i];
        t.row([
            format!("{}.{}", h.layer, h.head),
            format!("{:+.4}", h.delta_logprob),
            format!("{:.4}", h.kl),
            format!("{:.3}", h.max_weight),
            format!("{} {:?}", h.argmax, piece(h.argmax)),
            format!("{:.3}", h.sink),
            format!("{:.2}", h.entropy),
        ]);
    }
    s += &format!(
        "\nThe {} heads whose removal moves log p(target) most (attention: the last query's row):\n",
        top.min(r.heads.len())
    );
    s += &t.render();
    s
}

/// The 5 most concentrated heads and where their removal ranks by |Δ log p| (`order`).
fn concentrated_heads(r: &AblateReport, order: &[usize]) -> String {
    let piece = |p: usize| piece(r, p);
    let mut s = String::new();
    // the most concentrated heads, to set beside the most important ones
    let mut conc: Vec<usize> = (0..r.heads.len()).collect();
    conc.sort_by(|&x, &y| {
        r.heads[y]
            .max_weight
            .total_cmp(&r.heads[x].max_weight)
            .then(x.cmp(&y))
    });
    let rank_of = |i: usize| order.iter().position(|&j| j == i).unwrap_or(0) + 1;
    s += "\nThe 5 most concentrated heads, and where their removal ranks by |Δ log p|:\n";
    let mut t = Table::new([
        ("head", Align::Left),
        ("max weight", Align::Right),
        ("on", Align::Left),
        ("Δ log p", Align::Right),
        ("rank", Align::Right),
    ]);
    for &i in conc.iter().take(5) {
        let h = &r.heads[i];
        t.row([
            format!("{}.{}", h.layer, h.head),
            format!("{:.3}", h.max_weight),
            format!("{} {:?}", h.argmax, piece(h.argmax)),
            format!("{:+.4}", h.delta_logprob),
            format!("{} of {}", rank_of(i), r.heads.len()),
        ]);
    }
    s += &t.render();
    s
}

/// The rank correlations of attention against the effects over the heads.
fn correlations(r: &AblateReport) -> String {
    let mut s = String::new();
    s += "\nIs a concentrated head an important one? Rank correlations over the heads:\n";
    let mut t = Table::new([
        ("attention", Align::Left),
        ("effect", Align::Left),
        ("n", Align::Right),
        ("Spearman ρ", Align::Right),
        ("p", Align::Right),
        ("Kendall τ", Align::Right),
    ]);
    for c in &r.correlations {
        t.row([
            c.attention.clone(),
            c.effect.clone(),
            c.n.to_string(),
            opt(c.spearman, 3),
            c.spearman_p
                .map(|p| format!("{p:.3}"))
                .unwrap_or_else(|| "—".into()),
            opt(c.kendall, 3),
        ]);
    }
    s += &t.render();
    s
}
