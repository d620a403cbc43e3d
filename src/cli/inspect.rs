//! `attnscope inspect`: the lesson's tables on a real model.

use super::common::{check_index, emit, parse_index_list, usage, ModelArgs, TextArgs};
use crate::analysis::inspect::{build, InspectPlan};
use crate::model::forward::RunOptions;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    text: TextArgs,
    /// Query position to look from (default: the last token).
    #[arg(long, short = 'q')]
    query: Option<usize>,
    /// Layer of the per-head table (default: the last layer).
    #[arg(long, short = 'l')]
    layer: Option<usize>,
    /// Heads of the per-head table: 0-3, 1,5, all.
    #[arg(long, default_value = "0-3")]
    heads: String,
    /// Layers of the head-averaged table (default: first, middle, last): 0,12,23, all.
    #[arg(long)]
    layers: Option<String>,
    /// How many top keys to list (default: 3 per head, 4 head-averaged).
    #[arg(long, short = 'k')]
    top: Option<usize>,
    /// A head is flagged as concentrated when its max weight is at least this.
    #[arg(long, default_value_t = 0.9)]
    concentrated: f32,
    /// Tokens shown in the causal-mask grid.
    #[arg(long, default_value_t = 16)]
    mask_tokens: usize,
    /// Print one JSON document instead of the tables.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let start = Instant::now();
    let model = a.model.load()?;
    let loaded = start.elapsed();
    let tokens = a.text.tokens(&model, a.model.bos)?;
    let (n, d) = (tokens.len(), &model.dims);
    let query = check_index(a.query.unwrap_or(n - 1), n, "query position")?;
    let layer = check_index(a.layer.unwrap_or(d.n_layers - 1), d.n_layers, "layer")?;
    let heads = if a.heads == "0-3" && d.n_heads < 4 {
        (0..d.n_heads).collect()
    } else {
        parse_index_list(&a.heads, d.n_heads, "head")?
    };
    let layers = match &a.layers {
        Some(s) => parse_index_list(s, d.n_layers, "layer")?,
        None => {
            let mut v = vec![0, d.n_layers / 2, d.n_layers - 1];
            v.dedup();
            v
        }
    };
    if a.top == Some(0) || a.top.is_some_and(|k| k > n) {
        return Err(usage(format!(
            "--top {} is out of range: valid values are 1..={n} (the number of tokens)",
            a.top.unwrap_or(0)
        )));
    }
    if !(0.0..=1.0).contains(&a.concentrated) {
        return Err(usage(format!(
            "--concentrated {} is out of range: use a weight in 0..=1",
            a.concentrated
        )));
    }
    let plan = InspectPlan {
        query,
        layer,
        heads,
        top_heads: a.top.unwrap_or(3),
        layers,
        top_layers: a.top.unwrap_or(4),
        concentrated_at: a.concentrated,
    };
    let mut collector = plan.collector(d, n);
    let t0 = Instant::now();
    let out = model.forward(
        &tokens,
        &RunOptions {
            logits_at: vec![query],
            ..Default::default()
        },
        &mut collector,
    )?;
    let forward = t0.elapsed();
    let report = build(&model, &tokens, &collector, &out.logits[0], &plan);
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        v["timings"] = serde_json::json!({"load_s": loaded.as_secs_f64(), "forward_s": forward.as_secs_f64(), "attention_s": out.timings.attention.as_secs_f64()});
        return emit(&format!("{}\n", serde_json::to_string_pretty(&v)?));
    }
    let mut s = crate::render::report::render(&report, a.mask_tokens);
    s += &format!(
        "\n{} of which attention {:.3} s)\n",
        super::common::timings_opening(loaded.as_secs_f64(), "forward", forward.as_secs_f64()),
        out.timings.attention.as_secs_f64()
    );
    emit(&s)
}
