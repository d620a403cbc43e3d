//! `attnscope inspect`: the lesson's tables on a real model.

use super::common::{check_index, emit, parse_index_list, usage, ModelArgs, TextArgs};
use crate::analysis::encoder::EncoderReport;
use crate::analysis::inspect::{build, InspectPlan, InspectReport};
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

/// What `inspect` reports on: the CLI's flags, Python's `model.inspect` arguments.
#[derive(Clone, Debug)]
pub struct Request {
    /// the query position (default: the last token; an encoder's [CLS])
    pub query: Option<usize>,
    /// the layer of the per-head table (default: the last)
    pub layer: Option<usize>,
    /// the heads of the per-head table: `0-3`, `1,5`, `all`
    pub heads: String,
    /// the layers of the head-averaged table (default: first, middle, last)
    pub layers: Option<String>,
    /// top keys listed (default: 3 per head, 4 head-averaged)
    pub top: Option<usize>,
    /// the max weight from which a head counts as concentrated
    pub concentrated: f32,
}

impl Default for Request {
    fn default() -> Self {
        Request {
            query: None,
            layer: None,
            heads: "0-3".into(),
            layers: None,
            top: None,
            concentrated: 0.9,
        }
    }
}

/// An `inspect` report with the forward's timings.
pub enum Inspected {
    /// a decoder's tables and next-token prediction
    Decoder {
        report: InspectReport,
        forward_s: f64,
        attention_s: f64,
    },
    /// an encoder's [CLS]/[SEP]/punctuation shares and rows
    Encoder {
        report: EncoderReport,
        forward_s: f64,
    },
}

impl Inspected {
    /// `inspect --json`: the report with `timings` (the load's too, when given).
    pub fn json(&self, load_s: Option<f64>) -> serde_json::Result<serde_json::Value> {
        let (mut v, mut t) = match self {
            Inspected::Decoder {
                report,
                forward_s,
                attention_s,
            } => (
                serde_json::to_value(report)?,
                serde_json::json!({"forward_s": forward_s, "attention_s": attention_s}),
            ),
            Inspected::Encoder { report, forward_s } => (
                serde_json::to_value(report)?,
                serde_json::json!({ "forward_s": forward_s }),
            ),
        };
        if let Some(l) = load_s {
            t["load_s"] = l.into();
        }
        v["timings"] = t;
        Ok(v)
    }
}

/// The heads of the per-head table: `0-3` means every head on a model with fewer than 4.
fn head_list(spec: &str, n_heads: usize) -> anyhow::Result<Vec<usize>> {
    if spec == "0-3" && n_heads < 4 {
        Ok((0..n_heads).collect())
    } else {
        parse_index_list(spec, n_heads, "head")
    }
}

/// The `inspect` report of `tokens` (`types`: a pair's token types, for an encoder; `segments`:
/// its segments where they differ from the types, as on RoBERTa, else `None`).
pub fn inspect(
    model: &Model,
    tokens: &[u32],
    types: Option<&[u32]>,
    segments: Option<&[u32]>,
    r: &Request,
) -> anyhow::Result<Inspected> {
    let (n, d) = (tokens.len(), &model.dims);
    let default_query = if model.is_encoder() { 0 } else { n - 1 };
    let query = check_index(r.query.unwrap_or(default_query), n, "query position")?;
    let layer = check_index(r.layer.unwrap_or(d.n_layers - 1), d.n_layers, "layer")?;
    let heads = head_list(&r.heads, d.n_heads)?;
    if r.top == Some(0) || r.top.is_some_and(|k| k > n) {
        return Err(usage(format!(
            "--top {} is out of range: valid values are 1..={n} (the number of tokens)",
            r.top.unwrap_or(0)
        )));
    }
    if model.is_encoder() {
        let t0 = Instant::now();
        let mut report = crate::analysis::encoder::inspect(
            model,
            tokens,
            types,
            query,
            layer,
            &heads,
            r.top.unwrap_or(3).min(n),
        )?;
        if let Some(s) = segments {
            if s.len() != n {
                return Err(usage(format!("{} segments for {n} tokens", s.len())));
            }
            report.segments = s.to_vec();
        }
        return Ok(Inspected::Encoder {
            report,
            forward_s: t0.elapsed().as_secs_f64(),
        });
    }
    let layers = match &r.layers {
        Some(s) => parse_index_list(s, d.n_layers, "layer")?,
        None => {
            let mut v = vec![0, d.n_layers / 2, d.n_layers - 1];
            v.dedup();
            v
        }
    };
    if !(0.0..=1.0).contains(&r.concentrated) {
        return Err(usage(format!(
            "--concentrated {} is out of range: use a weight in 0..=1",
            r.concentrated
        )));
    }
    let plan = InspectPlan {
        query,
        layer,
        heads,
        top_heads: r.top.unwrap_or(3),
        layers,
        top_layers: r.top.unwrap_or(4),
        concentrated_at: r.concentrated,
    };
    let mut collector = plan.collector(d, n);
    let t0 = Instant::now();
    let out = model.forward(
        tokens,
        &RunOptions {
            logits_at: vec![query],
            ..Default::default()
        },
        &mut collector,
    )?;
    let forward_s = t0.elapsed().as_secs_f64();
    Ok(Inspected::Decoder {
        report: build(model, tokens, &collector, &out.logits[0], &plan),
        forward_s,
        attention_s: out.timings.attention.as_secs_f64(),
    })
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let start = Instant::now();
    let model = a.model.load()?;
    let load_s = start.elapsed().as_secs_f64();
    let input = a.text.encoded(&model, a.model.bos)?;
    let (tokens, types) = (&input.tokens, &input.types);
    let req = Request {
        query: a.query,
        layer: a.layer,
        heads: a.heads.clone(),
        layers: a.layers.clone(),
        top: a.top,
        concentrated: a.concentrated,
    };
    let got = inspect(
        &model,
        tokens,
        types.as_deref(),
        input.segments.as_deref(),
        &req,
    )?;
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
            let mut s = crate::render::report::render(&report, a.mask_tokens);
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
