//! `attnscope dla`: each head's and MLP's direct contribution to the answer's logit.

use super::common::{emit, ModelText};
use attnscope::analysis::vocab::Target;
use attnscope::commands::dla::{self as command, DlaOptions, DlaReport};
use attnscope::model::tokenize::visible;
use attnscope::render::table::{order_by_magnitude, title, Align, Table};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    input: ModelText,
    /// The token whose logit at the last position is decomposed: `next` (the model's top token),
    /// a token id, or a token's text (one token).
    #[arg(long, default_value = "next")]
    answer: Target,
    /// Decompose the logit difference answer − wrong instead.
    #[arg(long)]
    wrong: Option<Target>,
    /// Heads printed, largest |contribution| first (`--json` has all).
    #[arg(long, default_value_t = 12, value_parser = attnscope::analysis::request::at_least_one)]
    top: usize,
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let model = a.input.model.load()?;
    let tokens = a.input.text.tokens(&model, a.input.model.bos)?;
    let opts = DlaOptions {
        answer: a.answer,
        wrong: a.wrong,
    };
    let r = command::run(&model, &tokens, &opts)?;
    if a.json {
        return emit(&format!("{}\n", serde_json::to_string_pretty(&r)?));
    }
    emit(&render(&r, a.top))
}

pub fn render(r: &DlaReport, top: usize) -> String {
    let piece = |p: usize| visible(&r.tokens[p].text);
    let metric = match &r.wrong {
        Some(w) => format!(
            "logit({:?}) − logit({:?})",
            visible(&r.answer.text),
            visible(&w.text)
        ),
        None => format!("logit({:?})", visible(&r.answer.text)),
    };
    let mut s = title(&format!(
        "direct logit attribution of {metric}, {}",
        r.model
    ));
    s += &format!(
        "at position {} ({:?}): {metric} = {:.4}; the parts below add up to {:.4} (final norm scale {:.4})\n\n",
        r.query,
        piece(r.query),
        r.metric,
        r.sum_of_parts,
        r.final_scale
    );
    let order = order_by_magnitude(&r.heads.iter().map(|h| h.dla).collect::<Vec<_>>());
    let mut t = Table::new([
        ("head", Align::Left),
        ("direct", Align::Right),
        ("max weight", Align::Right),
        ("on", Align::Left),
        ("sink", Align::Right),
    ]);
    for &i in order.iter().take(top) {
        let h = &r.heads[i];
        t.row([
            format!("{}.{}", h.layer, h.head),
            format!("{:+.4}", h.dla),
            format!("{:.3}", h.max_weight),
            format!("{} {:?}", h.argmax, piece(h.argmax)),
            format!("{:.3}", h.sink),
        ]);
    }
    s += &format!(
        "The {} heads that write most into it (attention: the last query's row):\n",
        top.min(r.heads.len())
    );
    s += &t.render();
    let heads_total: f32 = r.heads.iter().map(|h| h.dla).sum();
    let mlp_total: f32 = r.mlp.iter().sum();
    let mut t = Table::new([("part", Align::Left), ("direct", Align::Right)]);
    t.row(["embedding".to_string(), format!("{:+.4}", r.embed)]);
    t.row(["all heads".to_string(), format!("{heads_total:+.4}")]);
    t.row([
        "attention biases".to_string(),
        format!("{:+.4}", r.attn_bias.iter().sum::<f32>()),
    ]);
    t.row(["all MLPs".to_string(), format!("{mlp_total:+.4}")]);
    if r.final_bias != 0.0 {
        t.row([
            "final norm's bias".to_string(),
            format!("{:+.4}", r.final_bias),
        ]);
    }
    t.row(["sum".to_string(), format!("{:+.4}", r.sum_of_parts)]);
    s += "\nBy kind:\n";
    s += &t.render();
    let mut by_layer: Vec<(usize, f32)> = r.mlp.iter().copied().enumerate().collect();
    by_layer.sort_by(|a, b| b.1.abs().total_cmp(&a.1.abs()));
    s += &format!(
        "\nThe MLPs that write most: {}\n",
        by_layer
            .iter()
            .take(5)
            .map(|(l, v)| format!("{l} ({v:+.3})"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    s
}
