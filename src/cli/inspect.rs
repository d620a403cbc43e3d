//! `attnscope inspect`: the lesson's tables on a real model.

use super::common::{check_index, emit, parse_index_list, usage, ModelArgs, TextArgs};
use crate::analysis::inspect::{build, InspectPlan};
use crate::model::forward::RunOptions;
use crate::model::Model;
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
    let (tokens, types) = a.text.tokens_or_pair(&model, a.model.bos)?;
    let (n, d) = (tokens.len(), &model.dims);
    if model.is_encoder() {
        return encoder(&a, &model, &tokens, types.as_deref(), loaded.as_secs_f64());
    }
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

/// `inspect` on an encoder: the share of attention on [CLS], [SEP] and punctuation per layer,
/// and the rows of one query (default: [CLS], position 0); no next-token prediction.
fn encoder(
    a: &Args,
    model: &Model,
    tokens: &[u32],
    types: Option<&[u32]>,
    load_s: f64,
) -> anyhow::Result<()> {
    let (n, d) = (tokens.len(), &model.dims);
    let query = check_index(a.query.unwrap_or(0), n, "query position")?;
    let layer = check_index(a.layer.unwrap_or(d.n_layers - 1), d.n_layers, "layer")?;
    let heads = if a.heads == "0-3" && d.n_heads < 4 {
        (0..d.n_heads).collect()
    } else {
        parse_index_list(&a.heads, d.n_heads, "head")?
    };
    let top = a.top.unwrap_or(3);
    if top == 0 || top > n {
        return Err(usage(format!(
            "--top {top} is out of range: valid values are 1..={n} (the number of tokens)"
        )));
    }
    let t0 = Instant::now();
    let r = crate::analysis::encoder::inspect(model, tokens, types, query, layer, &heads, top)?;
    let forward = t0.elapsed().as_secs_f64();
    if a.json {
        let mut v = serde_json::to_value(&r)?;
        v["timings"] = serde_json::json!({"load_s": load_s, "forward_s": forward});
        return emit(&format!("{}\n", serde_json::to_string_pretty(&v)?));
    }
    let tok = |i: usize| crate::model::tokenize::visible(&r.tokens[i].text);
    let cell = |t: &[crate::analysis::inspect::TopEntry]| {
        t.iter()
            .map(|e| format!("{} {:.3}", tok(e.pos), e.weight))
            .collect::<Vec<_>>()
            .join("  ")
    };
    let mut s = format!(
        "{} — {}, {} layers × {} heads; {} tokens\n",
        r.model.name, r.kind, d.n_layers, d.n_heads, n
    );
    s += "every token attends to every other (no causal mask); no next token is predicted\n\n";
    let pieces: Vec<String> = (0..n)
        .map(|i| match r.token_types[i] {
            1 => format!("{i}:{}ᴮ", tok(i)),
            _ => format!("{i}:{}", tok(i)),
        })
        .collect();
    s += &format!(
        "tokens (ᴮ: the pair's second text): {}\n\n",
        pieces.join(" ")
    );
    s += "share of attention on [CLS], [SEP] and punctuation (mean over heads and queries)\n";
    s += &format!(
        "{:>5}  {:>7}  {:>7}  {:>7}  query {} \"{}\", head-averaged top {top}\n",
        "layer",
        "[CLS]",
        "[SEP]",
        "punct",
        query,
        tok(query)
    );
    let sh = &r.special_shares;
    for l in &r.layers {
        let i = l.layer;
        s += &format!(
            "{:>5}  {:>7.3}  {:>7.3}  {:>7.3}  {}\n",
            i,
            sh.cls[i],
            sh.sep[i],
            sh.punct[i],
            cell(&l.top)
        );
    }
    s += &format!(
        "\nlayer {layer}, query {query} \"{}\", per head\n",
        tok(query)
    );
    s += &format!("{:>4}  {:>6}  {:>7}  top {top}\n", "head", "max", "entropy");
    for h in &r.heads {
        s += &format!(
            "{:>4}  {:>6.3}  {:>7.3}  {}\n",
            h.head,
            h.max_weight,
            h.entropy,
            cell(&h.top)
        );
    }
    s += &format!(
        "\n{})\n",
        super::common::timings_opening(load_s, "forward", forward)
    );
    emit(&s)
}
