//! `attnscope faithfulness`: attention rankings against what occluding each token does.

use super::common::ModelText;
use super::scoring::{run_scored, ScoringArgs};
use attnscope::analysis::enc_faith::EncFaithReport;
use attnscope::analysis::vocab::{Method, MetricRow, Target};
use attnscope::commands::faithfulness::{self as command, FaithOptions, FaithReport, Faithfulness};
use attnscope::model::tokenize::visible;
use attnscope::render::table::{title, Align, Table};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    input: ModelText,
    /// What the model should predict after the text: `next` (its own top token), a token id,
    /// or a token's text (e.g. " Paris"; must be one token). On an encoder: `embedding` (the
    /// mean-pooled sentence embedding; also what `next` means there) or `cls` (the [CLS]
    /// vector), deletion scored by 1 − cosine similarity.
    #[arg(long, default_value = "next")]
    target: Target,
    /// The neutral token swapped in by the replacement occlusion (must be one token).
    #[arg(long, default_value = " ")]
    replace_with: String,
    /// Seed of the random baseline ranking.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// The gradient-based and context-mixing rankings (as `attnscope attribute` computes them,
    /// for the target): `all` (gradient, gradient × input, attention × gradient from one
    /// backward, AttnLRP, value zeroing, ALTI-Logit, and integrated gradients with --steps
    /// midpoints), `fast` (all but integrated gradients), `none`. Default `all` (`none` on an
    /// encoder, whose backward attnscope does not have: `all` or `fast` are refused there).
    #[arg(long, value_enum)]
    gradients: Option<Gradients>,
    #[command(flatten)]
    scoring: ScoringArgs,
}

/// Which gradient-based rankings `faithfulness` adds to the table.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gradients {
    /// Gradient, gradient × input and attention × gradient (one backward), AttnLRP, value
    /// zeroing, ALTI-Logit, and integrated gradients (--steps backwards).
    All,
    /// All but integrated gradients.
    Fast,
    /// No gradient-based ranking.
    None,
}

impl From<Gradients> for attnscope::commands::faithfulness::Gradients {
    fn from(g: Gradients) -> Self {
        match g {
            Gradients::All => Self::All,
            Gradients::Fast => Self::Fast,
            Gradients::None => Self::None,
        }
    }
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let req = FaithOptions {
        target: a.target,
        replacement: a.replace_with,
        seed: a.seed,
        gradients: a.gradients.map(Into::into),
        steps: a.scoring.steps,
    };
    run_scored(
        &a.input.model,
        &a.input.text,
        &a.scoring,
        "forward passes",
        |model, tokens, tick| command::run(model, tokens, &req, tick),
        |r| match r {
            Faithfulness::Decoder(r) => render(r),
            Faithfulness::Encoder(r) => render_encoder(r),
        },
    )
}

/// `faithfulness` on an encoder, as text: the forward-only rankings against deletion of the
/// sentence embedding or the [CLS] vector.
fn render_encoder(r: &EncFaithReport) -> String {
    let mut s = title(&format!(
        "Faithfulness on an encoder: {} ({} precision)",
        r.model, r.precision
    ));
    s += &format!(
        "target: the {} vector; truth: 1 − cos(v(text without the token), v(text)); {} forward passes\n\n",
        r.encoder_target.name(),
        r.forward_passes
    );
    let mut t = Table::new([
        ("pos", Align::Right),
        ("token", Align::Left),
        ("deletion", Align::Right),
        ("attn last", Align::Right),
        ("attn mean", Align::Right),
        ("rollout", Align::Right),
        ("norm last", Align::Right),
        ("norm mean", Align::Right),
    ]);
    let mut rows: Vec<_> = r.tokens.iter().collect();
    rows.sort_by(|x, y| y.deletion.total_cmp(&x.deletion).then(x.pos.cmp(&y.pos)));
    for x in rows {
        t.row([
            x.pos.to_string(),
            visible(&x.text),
            format!("{:.4}", x.deletion),
            format!("{:.4}", x.attention_last),
            format!("{:.4}", x.attention_mean),
            format!("{:.4}", x.rollout),
            format!("{:.4}", x.norm_last),
            format!("{:.4}", x.norm_mean),
        ]);
    }
    s += &t.render();
    s += "\n";
    s += &title("Each ranking against deletion (comprehensiveness and sufficiency as 1 − cos)");
    let mut t = metric_table();
    for m in &r.metrics {
        metric_row(&mut t, m, true);
    }
    s += &t.render();
    s += &format!("\n{}\n", r.conclusion);
    s
}

fn f(x: Option<f64>) -> String {
    x.map(|v| format!("{v:+.3}")).unwrap_or_else(|| "—".into())
}

fn g(x: Option<f32>) -> String {
    x.map(|v| format!("{v:+.4}")).unwrap_or_else(|| "—".into())
}

/// The metrics table's columns.
fn metric_table() -> Table {
    Table::new([
        ("ranking", Align::Left),
        ("truth", Align::Left),
        ("n", Align::Right),
        ("Spearman ρ", Align::Right),
        ("Kendall τ", Align::Right),
        ("top-1", Align::Left),
        ("comp@1", Align::Right),
        ("comp@3", Align::Right),
        ("comp@5", Align::Right),
        ("suff@1", Align::Right),
        ("suff@3", Align::Right),
        ("suff@5", Align::Right),
    ])
}

/// One row; comprehensiveness and sufficiency do not depend on the truth, so they are printed
/// on the ranking's first row only (`first`).
fn metric_row(t: &mut Table, m: &MetricRow, first: bool) {
    let p = |v: Option<f64>, pv: Option<f64>| match (v, pv) {
        (Some(_), Some(pv)) => format!("{} (p {:.2})", f(v), pv),
        _ => f(v),
    };
    let at = |v: Option<f32>| if first { g(v) } else { String::new() };
    t.row([
        m.ranking.clone(),
        m.truth.clone(),
        m.n.to_string(),
        p(m.spearman, m.spearman_p),
        p(m.kendall, m.kendall_p),
        m.top1
            .map(|b| if b { "yes" } else { "no" }.to_string())
            .unwrap_or_else(|| "—".into()),
        at(m.comprehensiveness.k1),
        at(m.comprehensiveness.k3),
        at(m.comprehensiveness.k5),
        at(m.sufficiency.k1),
        at(m.sufficiency.k3),
        at(m.sufficiency.k5),
    ]);
}

/// `faithfulness`'s text report: the target, each token's explanations against occlusion, the
/// rankings' metrics (all tokens, then without the first) and the conclusion.
pub fn render(r: &FaithReport) -> String {
    let mut s = title(&format!(
        "Faithfulness: {} ({} precision)",
        r.model, r.precision
    ));
    s += &format!(
        "target after position {}: \"{}\" (id {}), log p = {:.4}, p = {:.4}; replacement token \"{}\"; {} forward passes\n\n",
        r.query,
        visible(&r.target.token),
        r.target.id,
        r.target.logprob,
        r.target.prob,
        visible(&r.replacement.token),
        r.forward_passes
    );
    s += &title(
        "Each token: attention against Δ log p(target) when it is occluded (most important first)",
    );
    s += &token_table(r);
    for wf in [false, true] {
        s += &rankings_table(r, wf);
    }
    s += "comp@k = p(full) − p(without the ranking's top k tokens), higher = the ranking found tokens that matter;\nsuff@k = p(full) − p(only those k tokens), lower = they suffice (DeYoung et al. 2020).\n\n";
    s += &title("Conclusion");
    s += &format!("{}\n", r.conclusion);
    s
}

/// Each token (most important first): its explanations, the gradient methods that ran, and the
/// three occlusions' Δ log p, with the notes that define them.
fn token_table(r: &FaithReport) -> String {
    let mut s = String::new();
    let mut rows: Vec<_> = r.tokens.iter().collect();
    rows.sort_by(|a, b| {
        a.loo
            .unwrap_or(0.0)
            .total_cmp(&b.loo.unwrap_or(0.0))
            .then(a.pos.cmp(&b.pos))
    });
    let mut head = vec![
        ("pos", Align::Right),
        ("token", Align::Left),
        ("attn last layer", Align::Right),
        ("attn all layers", Align::Right),
        ("rollout", Align::Right),
        ("norm last", Align::Right),
        ("norm all", Align::Right),
    ];
    // the gradient columns that ran
    let first = r.tokens.first();
    let grads: Vec<Method> = first
        .map(|x| x.methods.iter().map(|(m, _)| m).collect())
        .unwrap_or_default();
    head.extend(grads.iter().map(|m| (m.column(), Align::Right)));
    head.extend([
        ("Δ delete", Align::Right),
        ("Δ replace", Align::Right),
        ("Δ knockout", Align::Right),
    ]);
    let mut t = Table::new(head);
    for x in rows {
        let mut cells = vec![
            x.pos.to_string(),
            visible(&x.text),
            format!("{:.4}", x.attention_last),
            format!("{:.4}", x.attention_mean),
            format!("{:.4}", x.rollout),
            format!("{:.3}", x.norm_last),
            format!("{:.4}", x.norm_mean),
        ];
        cells.extend(grads.iter().map(|&m| g(x.methods.get(m).copied())));
        cells.extend([
            g(x.loo),
            format!("{:+.4}", x.replace),
            x.knockout
                .map(|k| format!("{k:+.4}"))
                .unwrap_or_else(|| "n/a (query)".into()),
        ]);
        t.row(cells);
    }
    s += &t.render();
    if !grads.is_empty() {
        s += "‖grad‖ = ‖∂ log p/∂x_i‖₂, grad×x = ∂ log p/∂x_i · x_i, IG = integrated gradients from the zero embedding, attn×grad = Σ_layers mean_heads max(0, ∂ log p/∂A · A) on the last query's row (see `attnscope attribute --help`).\n";
        if grads.contains(&Method::AttnLrp) {
            s += "AttnLRP = relevance of logit(target) (Achtibat et al. 2024), VZ = value zeroing's rollout into the last position (Mohebbi et al. 2023), ALTI-logit = logit(target) decomposed through ALTI's token-to-token contributions (Ferrando et al. 2023).\n";
        }
        if let Some(e) = r.attnlrp_conservation_error {
            s += &format!("AttnLRP's conservation error Σ relevances − logit(target) = {e:+.4}\n");
        }
        if let Some(gap) = r.ig_completeness_gap {
            s += &format!(
                "integrated gradients' completeness gap Σ IG − (log p(x) − log p(0)) = {gap:+.4}\n"
            );
        }
    }
    s += "norm last = ‖Σₕ αʰ·W_Oʰ vⱼ‖ of the last layer, what the token moves into the query (Kobayashi et al. 2020); norm all = its share of each layer's total, averaged over layers.\nΔ = log p(target | occluded) − log p(target | full text); a large negative Δ means the token mattered.\n\n";
    s
}

/// The rankings' metrics against occlusion (`wf`: without the first token), the last layer's best
/// head and the heads' mean ρ.
fn rankings_table(r: &FaithReport, wf: bool) -> String {
    let mut s = String::new();
    s += &title(if wf {
        "Rankings against occlusion, first token excluded (the sink)"
    } else {
        "Rankings against occlusion, all tokens"
    });
    let mut t = metric_table();
    for m in r
        .metrics
        .iter()
        .filter(|m| m.without_first == wf && !m.ranking.starts_with("head_"))
    {
        metric_row(&mut t, m, m.truth == "loo");
    }
    // the heads of the last layer: the best one by ρ against deletion
    let heads: Vec<&MetricRow> = r
        .metrics
        .iter()
        .filter(|m| m.without_first == wf && m.ranking.starts_with("head_") && m.truth == "loo")
        .collect();
    if let Some(best) = heads
        .iter()
        .filter(|m| m.spearman.is_some())
        .max_by(|a, b| {
            a.spearman
                .unwrap_or(-2.0)
                .total_cmp(&b.spearman.unwrap_or(-2.0))
        })
    {
        let mut b = (*best).clone();
        b.ranking = format!("best head ({})", best.ranking);
        metric_row(&mut t, &b, true);
        let rhos: Vec<f64> = heads.iter().filter_map(|m| m.spearman).collect();
        if !rhos.is_empty() {
            s += &t.render();
            s += &format!("mean Spearman ρ over the {} heads of the last layer (against deletion): {:+.3}\n\n", heads.len(), rhos.iter().sum::<f64>() / rhos.len() as f64);
            return s;
        }
    }
    s += &t.render();
    s += "\n";
    s
}
