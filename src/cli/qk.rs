//! `attnscope qk`: a head's pre-softmax score of one query and one key split exactly into
//! (query-side component × key-side component) terms ([`attnscope::analysis::qk`]).

use super::common::{emit, usage, ModelText};
use attnscope::analysis::request::{unsigned_index, unsigned_opt};
use attnscope::commands::qk::{self as command, Against, QkOptions, QkReport};
use attnscope::model::tokenize::visible;
use attnscope::render::table::{title, Align, Table};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    input: ModelText,
    /// The head's layer.
    #[arg(long, allow_negative_numbers = true)]
    layer: i64,
    /// The head (its key side comes from its key/value group).
    #[arg(long, allow_negative_numbers = true)]
    head: i64,
    /// The query position (default: the last token).
    #[arg(long, allow_negative_numbers = true)]
    query: Option<i64>,
    /// The key position. Default: the key the head attends to most, its lead over `--against`
    /// split.
    #[arg(long, allow_negative_numbers = true)]
    key: Option<i64>,
    /// Without --key: what the attended key's score is set against, `second` (the second
    /// key's score) or `mean` (the mean score over the keys the query sees).
    #[arg(long, default_value = "second", conflicts_with = "key")]
    against: Against,
    /// Terms printed, largest |value| first (`--json` has every term).
    #[arg(long, default_value_t = 15)]
    top: usize,
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.top == 0 {
        return Err(usage("--top 0 prints no term; give 1 or more"));
    }
    let model = a.input.model.load()?;
    let tokens = a.input.text.tokens(&model, a.input.model.bos)?;
    let (d, n) = (&model.dims, tokens.len());
    let opts = QkOptions {
        layer: unsigned_index(a.layer, "layer", d.n_layers, "this model has")?,
        head: unsigned_index(a.head, "head", d.n_heads, "this model has")?,
        query: unsigned_opt(a.query, "query position", n, "the text has")?,
        key: unsigned_opt(a.key, "key position", n, "the text has")?,
        tokens,
        against: a.against,
    };
    let r = command::run(&model, &opts)?;
    if a.json {
        return emit(&format!("{}\n", serde_json::to_string(&r)?));
    }
    emit(&render(&r, a.top))
}

/// The terminal report: what is split, the score, the sum and the gap, the largest terms and
/// each side's components summed over the other side.
pub fn render(r: &QkReport, top: usize) -> String {
    let piece = |p: usize| format!("{p} {:?}", visible(&r.tokens[p].text));
    let mut s = title(&format!(
        "QK split of head {}.{} (key/value group {}), {}",
        r.layer, r.head, r.kv_head, r.model
    ));
    let what = match (r.against, r.against_key) {
        (None, _) => format!("score(query {}, key {})", piece(r.query), piece(r.key)),
        (Some(_), Some(j)) => format!(
            "score(query {}, key {}) − score(second key {})",
            piece(r.query),
            piece(r.key),
            piece(j)
        ),
        (Some(_), None) => format!(
            "score(query {}, key {}) − mean score over its {} keys",
            piece(r.query),
            piece(r.key),
            r.row_scores.iter().flatten().count()
        ),
    };
    s += &format!(
        "{what} = {:.4} (pre-softmax, scale {:.4}{})\n",
        r.score,
        r.scale,
        r.softcap
            .map(|c| format!(", before the soft-cap {c}·tanh(s/{c})"))
            .unwrap_or_default()
    );
    s += &format!(
        "its {} terms add up to {:.4}: gap {:+.2e}\n",
        r.terms.len(),
        r.sum,
        r.gap
    );
    s += &format!("frozen from the run: {}\n\n", r.frozen.join("; "));
    s += &format!("The {} largest terms:\n", top.min(r.terms.len()));
    s += &terms_table(r, top).render();
    s += &format!("\n{}", marginals(r));
    s
}

/// The `top` largest terms with their share of the split score.
fn terms_table(r: &QkReport, top: usize) -> Table {
    let mut t = Table::new([
        ("query side", Align::Left),
        ("key side", Align::Left),
        ("value", Align::Right),
        ("share", Align::Right),
    ]);
    for term in r.terms.iter().take(top) {
        t.row([
            term.query_side.clone(),
            term.key_side.clone(),
            format!("{:+.4}", term.value),
            share(term.value, r.score),
        ]);
    }
    t
}

/// `value / score` as a percentage (a dash when the score is too close to 0 for one).
fn share(value: f64, score: f64) -> String {
    if score.abs() < 1e-9 {
        "—".into()
    } else {
        format!("{:+.1}%", 100.0 * value / score)
    }
}

/// Each side's components summed over the other side, the five largest of each.
fn marginals(r: &QkReport) -> String {
    let mut s = String::new();
    for (label, query_side) in [("query side", true), ("key side", false)] {
        let mut by_name: std::collections::BTreeMap<&str, f64> = Default::default();
        for t in &r.terms {
            let name = if query_side {
                &t.query_side
            } else {
                &t.key_side
            };
            *by_name.entry(name).or_default() += t.value;
        }
        let mut sums: Vec<(&str, f64)> = by_name.into_iter().collect();
        sums.sort_by(|a, b| b.1.abs().total_cmp(&a.1.abs()));
        let top: Vec<String> = sums
            .iter()
            .take(5)
            .map(|(n, v)| format!("{n} {v:+.3}"))
            .collect();
        s += &format!(
            "By {label} component (summed over the other side): {}\n",
            top.join(", ")
        );
    }
    s
}
