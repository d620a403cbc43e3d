//! `attnscope inspect`: the lesson's tables on a real model.

use super::common::{emit, ModelText};
use attnscope::analysis::encoder::EncoderReport;
use attnscope::analysis::request::unsigned_opt;
use attnscope::commands::inspect::{self as command, InspectInput, InspectOptions, Inspected};
use attnscope::model::Model;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    input: ModelText,
    /// Query position to look from (default: the last token).
    #[arg(long, short = 'q', allow_negative_numbers = true)]
    query: Option<i64>,
    /// Layer of the per-head table (default: the last layer).
    #[arg(long, short = 'l', allow_negative_numbers = true)]
    layer: Option<i64>,
    /// Heads of the per-head table: 0-3, 1,5, all.
    #[arg(long, default_value = "0-3", allow_negative_numbers = true)]
    heads: String,
    /// Layers of the head-averaged table (default: first, middle, last): 0,12,23, all.
    #[arg(long, allow_negative_numbers = true)]
    layers: Option<String>,
    /// How many top keys to list (default: 3 per head, 4 head-averaged).
    #[arg(long, short = 'k')]
    top: Option<usize>,
    /// A head is flagged as concentrated when its max weight is at least this.
    #[arg(long, default_value_t = 0.9)]
    concentrated: f32,
    /// Tokens shown in the causal-mask grid.
    #[arg(long, default_value_t = 16, value_parser = attnscope::analysis::request::at_least_one)]
    mask_tokens: usize,
    /// Print one JSON document instead of the tables.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let start = Instant::now();
    let model = a.input.model.load()?;
    let load_s = start.elapsed().as_secs_f64();
    let e = a.input.text.encoded(&model, a.input.model.bos)?;
    let input = InspectInput {
        tokens: e.tokens,
        types: e.types,
        segments: e.segments,
    };
    let tokens = &input.tokens;
    let req = InspectOptions {
        query: unsigned_opt(a.query, "query position", tokens.len(), "the text has")?,
        layer: unsigned_opt(a.layer, "layer", model.dims.n_layers, "this model has")?,
        heads: a.heads.clone(),
        layers: a.layers.clone(),
        top: a.top,
        concentrated: a.concentrated,
    };
    let got = command::run(&model, &input, &req)?;
    if a.json {
        return emit(&format!(
            "{}\n",
            serde_json::to_string_pretty(&got.json(Some(load_s))?)?
        ));
    }
    match got {
        Inspected::Decoder {
            report,
            forward_s,
            attention_s,
        } => {
            let mut s = attnscope::render::report::render(&report, a.mask_tokens);
            s += &format!(
                "\n{} of which attention {attention_s:.3} s)\n",
                super::common::timings_opening(load_s, "forward", forward_s),
            );
            emit(&s)
        }
        Inspected::Encoder { report, forward_s } => {
            let top = a.top.unwrap_or(3).min(tokens.len());
            emit(&encoder_text(&model, &report, top, forward_s, load_s))
        }
    }
}

/// `inspect` on an encoder, as text: the share of attention on [CLS], [SEP] and punctuation per
/// layer, and the rows of one query; no next-token prediction.
fn encoder_text(model: &Model, r: &EncoderReport, top: usize, forward: f64, load_s: f64) -> String {
    let (n, d) = (r.tokens.len(), &model.dims);
    let (query, layer) = (r.query, r.layer);
    let tok = |i: usize| attnscope::model::tokenize::visible(&r.tokens[i].text);
    let cell = |t: &[attnscope::analysis::vocab::TopEntry]| {
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
        .map(|i| match r.segments[i] {
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
    s
}
