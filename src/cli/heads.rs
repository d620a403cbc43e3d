//! `attnscope heads`: a role score for every (layer, head): previous token, duplicate token,
//! induction, sink and local, TransformerLens's head-detector definitions, streamed; on an
//! encoder previous token, next token, [CLS], [SEP] and broad (Clark et al. 2019), on a text or
//! a sentence pair (`--pair`).

use super::common::{emit, usage, ModelText};
use attnscope::analysis::heads::{mean_roles, mean_uniform, random_repeat_tokens, role_names};
use attnscope::commands::heads::{self as command, document, HeadRoles, HeadsInput};
use attnscope::render::table::{title, Align, Table};
use std::collections::BTreeMap;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    input: ModelText,
    /// Instead of a text: N random token ids, then the same N again (BOS first if the model uses
    /// one). The standard test for induction heads.
    #[arg(long, value_name = "N", conflicts_with_all = ["text", "file", "chat"])]
    random_repeat: Option<usize>,
    /// Seed of --random-repeat.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Treat each non-empty line of --file as its own text and average the scores over the texts
    /// (every text counts once).
    #[arg(long, requires = "file")]
    each_line: bool,
    /// Top heads listed per role.
    #[arg(long, default_value_t = 5)]
    top: usize,
    /// Print one JSON document: {"tokens", "roles": {role: [[score per head] per layer]}, "uniform", ...}.
    #[arg(long)]
    json: bool,
}

/// `attnscope heads`: the role scores of the input, as JSON or as the top heads per role and a
/// shaded grid per role.
pub fn run(a: Args) -> anyhow::Result<()> {
    if a.top == 0 {
        return Err(usage("--top must be at least 1"));
    }
    if a.random_repeat.is_some() && a.input.text.pair.is_some() {
        return Err(usage(
            "--random-repeat makes its own tokens; --pair (a sentence pair) needs a text",
        ));
    }
    let model = a.input.model.load()?;
    let input = inputs(&model, &a)?;
    let all: Vec<HeadRoles> = command::run(&model, &input.texts)?;
    if a.json {
        return emit(&format!(
            "{}\n",
            serde_json::to_string_pretty(&document(&model, &all, input.doc)?)?
        ));
    }
    let roles = mean_roles(&all);
    let uniform = mean_uniform(&all);
    let n_tokens: usize = all.iter().map(|r| r.tokens.len()).sum();
    let mut s = title(&format!(
        "Head roles of {}, {} ({n_tokens} tokens)",
        model.info.name, input.source
    ));
    s += if model.is_encoder() {
        "an encoder (bidirectional): each score is a mean over the queries of the weight on the previous token, the next token, [CLS], [SEP], and (broad) the row's entropy / ln n; × = times a uniform head's score\n\n"
    } else {
        "score = Σ(A ⊙ P) / Σ A for the role's pattern P (TransformerLens's head detector, \"mul\"); × = times a uniform head's score\n\n"
    };
    let names = role_names(&model);
    s += &top_heads_table(names, &roles, &uniform, a.top);
    for &role in names {
        s += &format!("\n{role} (rows: layers; columns: heads; ' ░▒▓█' = 0 .. 1)\n");
        for (l, hs) in roles[role].iter().enumerate() {
            let shade: String = hs
                .iter()
                .map(|&v| [' ', '░', '▒', '▓', '█'][((v * 4.0).round() as usize).min(4)])
                .collect();
            s += &format!("{l:>4} |{shade}|\n");
        }
    }
    emit(&s)
}

/// What `heads` scores: the token sequences, a pair's token types, the JSON document's extra
/// fields and the words that name the input.
struct Inputs {
    texts: HeadsInput,
    doc: serde_json::Map<String, serde_json::Value>,
    source: String,
}

/// The input `a` asks for: random repeated tokens, each line of the text, or the text (or pair).
fn inputs(model: &attnscope::model::Model, a: &Args) -> anyhow::Result<Inputs> {
    let mut doc = serde_json::Map::new();
    if let Some(nr) = a.random_repeat {
        let t = random_repeat_tokens(model, nr, a.seed, a.input.model.bos)?;
        doc.insert("random_repeat".into(), nr.into());
        doc.insert("seed".into(), a.seed.into());
        return Ok(Inputs {
            texts: HeadsInput {
                texts: vec![t],
                types: None,
            },
            doc,
            source: format!("{nr} random tokens repeated once (seed {})", a.seed),
        });
    }
    if a.each_line {
        let text = a.input.text.read_lines(model)?;
        let mut texts = Vec::new();
        for line in attnscope::analysis::corpus::parse_lines(&text, false) {
            texts.push(model.encode(&line, a.input.model.bos)?);
        }
        if texts.is_empty() {
            return Err(anyhow::Error::new(attnscope::model::Error::EmptyText));
        }
        let source = format!("{} texts, one per line", texts.len());
        return Ok(Inputs {
            texts: HeadsInput { texts, types: None },
            doc,
            source,
        });
    }
    let (t, ty) = a.input.text.tokens_or_pair(model, a.input.model.bos)?;
    Ok(Inputs {
        source: if ty.is_some() {
            "the sentence pair".into()
        } else {
            "the text".into()
        },
        texts: HeadsInput {
            texts: vec![t],
            types: ty,
        },
        doc,
    })
}

/// Per role, the uniform head's score and the `top` heads by score (×uniform where it is > 0).
fn top_heads_table(
    names: &[&str],
    roles: &BTreeMap<String, Vec<Vec<f64>>>,
    uniform: &BTreeMap<String, f64>,
    top: usize,
) -> String {
    let mut t = Table::new([
        ("role", Align::Left),
        ("uniform head", Align::Right),
        (
            format!("top {top} heads (layer.head score ×uniform)").as_str(),
            Align::Left,
        ),
    ]);
    for &role in names {
        let mut ranked: Vec<(usize, usize, f64)> = roles[role]
            .iter()
            .enumerate()
            .flat_map(|(l, hs)| hs.iter().enumerate().map(move |(h, &v)| (l, h, v)))
            .collect();
        ranked.sort_by(|x, y| y.2.total_cmp(&x.2).then(x.0.cmp(&y.0)).then(x.1.cmp(&y.1)));
        let u = uniform[role];
        let listed: Vec<String> = ranked
            .iter()
            .take(top)
            .map(|&(l, h, v)| {
                if u > 0.0 {
                    format!("{l}.{h} {v:.3} ×{:.1}", v / u)
                } else {
                    format!("{l}.{h} {v:.3}")
                }
            })
            .collect();
        t.row([role.to_string(), format!("{u:.3}"), listed.join(", ")]);
    }
    t.render()
}
