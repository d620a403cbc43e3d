//! Circuits (issue #58): which edges between a decoder's components carry the answer. The graph
//! is data ([`graph`]: nodes, readers, edges, one score per edge); the scores come from EAP or
//! EAP-IG ([`eap`]); a circuit is evaluated by exact edge patching ([`evaluate`]). [`circuit`] is
//! the command: a [`CircuitOptions`] in, a serializable [`CircuitReport`] out.
//!
//! ```no_run
//! use attnscope::analysis::circuit::{circuit, CircuitOptions, Method, MetricKind, Pair};
//! use attnscope::model::{Model, Precision};
//! let model = Model::load("qwen2.5-coder-0.5b", Precision::Exact, false)?;
//! let pair = Pair::new(
//!     "After Alice and Bob walked to the park, Bob handed a ball to",
//!     "After Alice and Bob walked to the park, Alice handed a ball to",
//!     " Alice",
//!     " Bob",
//! );
//! let opts = CircuitOptions::new(vec![pair], Method::EapIg { steps: 5 }, MetricKind::LogitDiff);
//! let report = circuit(&model, &opts)?;
//! println!("{} -> {}: {}", report.edges[0].from, report.edges[0].to, report.edges[0].score);
//! # Ok::<(), anyhow::Error>(())
//! ```

pub mod eap;
pub mod evaluate;
pub mod graph;
pub mod head_views;

use crate::analysis::request::usage;
use crate::analysis::vocab::{single_token, Target};
use crate::model::backward::Metric;
use crate::model::Model;
use anyhow::Context;
use graph::{Graph, NodeInfo};
use serde::Serialize;

/// EAP-IG's steps: at most this many.
pub const MAX_STEPS: usize = 1024;

/// One clean/corrupted pair and the two tokens its metric compares.
#[derive(Clone, Debug)]
pub struct Pair {
    pub clean: String,
    pub corrupt: String,
    /// the token the clean text predicts (a token's text, or its id)
    pub answer: Target,
    /// the token the corrupted text predicts
    pub wrong: Target,
}

impl Pair {
    /// A pair whose answer and wrong token are given as text (each exactly one token).
    pub fn new(clean: &str, corrupt: &str, answer: &str, wrong: &str) -> Pair {
        Pair {
            clean: clean.into(),
            corrupt: corrupt.into(),
            answer: Target::Text(answer.into()),
            wrong: Target::Text(wrong.into()),
        }
    }
}

/// A pair as token ids.
#[derive(Clone, Debug)]
pub struct PairTokens {
    pub clean: Vec<u32>,
    pub corrupt: Vec<u32>,
    pub answer: u32,
    pub wrong: u32,
}

/// How edges are scored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// Edge attribution patching: the gradient at the clean run.
    Eap,
    /// EAP with integrated gradients: the gradient averaged over `steps` inputs between the
    /// corrupted and the clean embeddings.
    EapIg { steps: usize },
}

/// The scalar `m` of the last position's logits the circuit explains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MetricKind {
    /// `logit(answer) − logit(wrong)`
    LogitDiff,
    /// `log p(answer)`
    Logprob,
}

impl MetricKind {
    fn of(self, pair: &PairTokens) -> Metric {
        match self {
            MetricKind::LogitDiff => Metric::LogitDiff {
                answer: pair.answer,
                wrong: pair.wrong,
            },
            MetricKind::Logprob => Metric::LogProb(Some(pair.answer)),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            MetricKind::LogitDiff => "logit-diff",
            MetricKind::Logprob => "logprob",
        }
    }
}

/// What `attnscope circuit` computes.
#[derive(Clone, Debug)]
pub struct CircuitOptions {
    /// the clean and corrupted texts, each pair with its answer and wrong token
    pub pairs: Vec<Pair>,
    /// how the edges are scored (EAP or EAP-IG)
    pub method: Method,
    /// the metric the scores explain
    pub metric: MetricKind,
    /// Put the model's BOS token first even when its metadata does not ask for one.
    pub force_bos: bool,
    /// Evaluate circuits of the top edges at MIB's ladder of sizes by exact edge patching.
    pub evaluate: bool,
    /// Patch the top this many edges one at a time, exactly, beside their scores.
    pub exact_edges: usize,
}

impl CircuitOptions {
    /// Options for `pairs` scored by `method` on `metric`, with no BOS forced, no evaluation and no
    /// exact edges.
    pub fn new(pairs: Vec<Pair>, method: Method, metric: MetricKind) -> CircuitOptions {
        CircuitOptions {
            pairs,
            method,
            metric,
            force_bos: false,
            evaluate: false,
            exact_edges: 0,
        }
    }
}

/// One edge and its score.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct EdgeScore {
    pub from: String,
    pub to: String,
    pub score: f32,
}

/// The edge scores of a graph: one per edge, in the graph's edge order.
#[derive(Clone, Debug)]
pub struct Scores {
    pub graph: Graph,
    pub scores: Vec<f32>,
    /// the metric at the clean and corrupted runs, averaged over the pairs
    pub clean_metric: f32,
    pub corrupt_metric: f32,
}

/// What `attnscope circuit --json` prints.
#[derive(Clone, Debug, Serialize)]
pub struct CircuitReport {
    /// the model's name
    pub model: String,
    /// `eap` or `eap-ig`
    pub method: &'static str,
    /// EAP-IG's steps (none for EAP)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<usize>,
    /// the metric the scores explain
    pub metric: MetricKind,
    /// the number of pairs
    pub pairs: usize,
    /// the metric on the clean runs, averaged over the pairs
    pub clean_metric: f32,
    /// the metric on the corrupted runs, averaged over the pairs
    pub corrupt_metric: f32,
    /// the number of upstream nodes
    pub n_nodes: usize,
    /// the number of readers (the nodes edges end at)
    pub n_readers: usize,
    /// the number of edges
    pub n_edges: usize,
    /// every upstream node, then every reader
    pub nodes: Vec<NodeInfo>,
    /// every edge, the largest |score| first
    pub edges: Vec<EdgeScore>,
    /// the circuits of the top edges evaluated by exact patching, when asked
    #[serde(skip_serializing_if = "Option::is_none")]
    pub evaluation: Option<evaluate::Evaluation>,
    /// the top edges patched one at a time, when asked
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exact_edges: Option<evaluate::ExactEdges>,
    /// the wall time, in seconds
    pub seconds: f64,
}

/// The pairs as token ids, every one checked before any run: equal token counts (else the
/// first position where the texts differ is named), one-token answers, two different tokens
/// for a logit difference.
pub fn tokenize_pairs(
    model: &Model,
    pairs: &[Pair],
    metric: MetricKind,
    force_bos: bool,
) -> anyhow::Result<Vec<PairTokens>> {
    model.require_decoder("a circuit (edge attribution patching)")?;
    if pairs.is_empty() {
        return Err(usage(
            "no pairs: give --clean, --corrupt, --answer and --wrong, or --pairs FILE.jsonl",
        ));
    }
    pairs
        .iter()
        .enumerate()
        .map(|(i, p)| {
            tokenize_pair(model, p, metric, force_bos).with_context(|| match pairs.len() {
                1 => "the pair".to_string(),
                _ => format!("pair {}", i + 1),
            })
        })
        .collect()
}

fn tokenize_pair(
    model: &Model,
    p: &Pair,
    metric: MetricKind,
    force_bos: bool,
) -> anyhow::Result<PairTokens> {
    let clean = model.encode(&p.clean, force_bos)?;
    let corrupt = model.encode(&p.corrupt, force_bos)?;
    if clean.is_empty() || corrupt.is_empty() {
        return Err(usage("a clean or corrupted text is empty"));
    }
    if clean.len() != corrupt.len() {
        let at = clean
            .iter()
            .zip(&corrupt)
            .position(|(a, b)| a != b)
            .unwrap_or(clean.len().min(corrupt.len()));
        let piece = |t: &[u32]| {
            t.get(at).map_or("(end)".to_string(), |&id| {
                format!("{:?}", model.tokenizer.token_text(id))
            })
        };
        return Err(usage(format!(
            "the clean text has {} tokens and the corrupted text {}: a circuit compares them position by position, so they must have the same count; they first differ at position {at} (clean {}, corrupted {})",
            clean.len(),
            corrupt.len(),
            piece(&clean),
            piece(&corrupt)
        )));
    }
    let token = |t: &Target, what: &str| -> anyhow::Result<u32> {
        match t {
            Target::Next => Err(usage(format!("{what}: give a token's text or id"))),
            Target::Text(s) => Ok(single_token(model, s, what)?),
            Target::Id(_) => Ok(t.resolve(model, &[])?),
        }
    };
    let answer = token(&p.answer, "--answer")?;
    let wrong = token(&p.wrong, "--wrong")?;
    if metric == MetricKind::LogitDiff && answer == wrong {
        return Err(usage(format!(
            "--answer and --wrong are the same token ({answer}): the logit difference would be 0"
        )));
    }
    Ok(PairTokens {
        clean,
        corrupt,
        answer,
        wrong,
    })
}

/// Every edge's score by `method`, averaged over the pairs.
pub fn scores(
    model: &Model,
    pairs: &[PairTokens],
    method: Method,
    metric: MetricKind,
) -> anyhow::Result<Scores> {
    if let Method::EapIg { steps } = method {
        if steps == 0 || steps > MAX_STEPS {
            return Err(usage(format!(
                "--steps {steps} is out of range: EAP-IG needs 1..={MAX_STEPS} steps"
            )));
        }
    }
    let graph = Graph::new(&model.dims);
    let mut acc = vec![0f64; graph.n_edges()];
    let (mut clean, mut corrupt) = (0f64, 0f64);
    let w = 1.0 / pairs.len() as f64;
    for p in pairs {
        let (c, x) = eap::score_pair(model, &graph, p, (method, metric.of(p)), &mut acc, w)?;
        clean += c as f64 * w;
        corrupt += x as f64 * w;
    }
    Ok(Scores {
        graph,
        scores: acc.into_iter().map(|v| v as f32).collect(),
        clean_metric: clean as f32,
        corrupt_metric: corrupt as f32,
    })
}

/// `attnscope circuit`: the pairs checked, every edge scored, and with the options the
/// circuits' evaluation and the top edges patched one at a time.
pub fn circuit(model: &Model, opts: &CircuitOptions) -> anyhow::Result<CircuitReport> {
    let t0 = std::time::Instant::now();
    let pairs = tokenize_pairs(model, &opts.pairs, opts.metric, opts.force_bos)?;
    let s = scores(model, &pairs, opts.method, opts.metric)?;
    // the forward with edited readers, packed once for both
    let fwd = match opts.evaluate || opts.exact_edges > 0 {
        true => Some(model.edited_forward()?),
        false => None,
    };
    let evaluation = match (&fwd, opts.evaluate) {
        (Some(f), true) => Some(evaluate::evaluate(f, &pairs, opts.metric, &s)?),
        _ => None,
    };
    let exact_edges = match (&fwd, opts.exact_edges) {
        (Some(f), k) if k > 0 => Some(evaluate::exact_edges(f, &pairs, opts.metric, &s, k)?),
        _ => None,
    };
    let g = &s.graph;
    let edges = graph::ranked(&s.scores, graph::Ranking::Absolute)
        .into_iter()
        .map(|e| edge_score(g, &s.scores, e))
        .collect();
    Ok(CircuitReport {
        model: model.info.name.clone(),
        method: match opts.method {
            Method::Eap => "eap",
            Method::EapIg { .. } => "eap-ig",
        },
        steps: match opts.method {
            Method::EapIg { steps } => Some(steps),
            Method::Eap => None,
        },
        metric: opts.metric,
        pairs: pairs.len(),
        clean_metric: s.clean_metric,
        corrupt_metric: s.corrupt_metric,
        n_nodes: g.n_nodes(),
        n_readers: g.n_readers(),
        n_edges: g.n_edges(),
        nodes: g.node_infos(),
        edges,
        evaluation,
        exact_edges,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// The first position at which a pair's clean and corrupted tokens differ (their length if
/// none does): the rows before it are the same in both runs and in every run between or
/// patched from them, so every node's difference there is exactly zero; EAP, the evaluation
/// ladder and exact edge patching compute only the rows from it on.
pub fn first_difference(pair: &PairTokens) -> usize {
    pair.clean
        .iter()
        .zip(&pair.corrupt)
        .position(|(a, b)| a != b)
        .unwrap_or(pair.clean.len())
}

/// Edge `e` named, with its score.
pub fn edge_score(g: &Graph, scores: &[f32], e: usize) -> EdgeScore {
    let (u, r) = g.edge(e);
    EdgeScore {
        from: g.node_name(u),
        to: g.reader_name(r),
        score: scores[e],
    }
}

/// The pairs of a JSONL file's text (`source` names it in errors): one object a line with the
/// strings `clean`, `corrupt`, `answer` and `wrong` (an answer may also be a token id); blank
/// lines are skipped. A line that is not such an object is refused, named by its number.
pub fn read_pairs(text: &str, source: &str) -> anyhow::Result<Vec<Pair>> {
    let mut pairs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{source} line {}", i + 1);
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| usage(format!("{}: not a JSON object ({e})", at())))?;
        let field = |name: &str| -> anyhow::Result<Target> {
            match v.get(name) {
                Some(serde_json::Value::String(s)) => Ok(Target::Text(s.clone())),
                Some(serde_json::Value::Number(x)) if name == "answer" || name == "wrong" => {
                    x.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .map(Target::Id)
                        .ok_or_else(|| usage(format!("{}: \"{name}\" is not a token id", at())))
                }
                Some(_) => Err(usage(format!("{}: \"{name}\" is not a string", at()))),
                None => Err(usage(format!(
                    "{}: no \"{name}\" field (each line needs \"clean\", \"corrupt\", \"answer\" and \"wrong\")",
                    at()
                ))),
            }
        };
        let text_of = |name: &str| -> anyhow::Result<String> {
            match field(name)? {
                Target::Text(s) => Ok(s),
                _ => Err(usage(format!("{}: \"{name}\" is not a string", at()))),
            }
        };
        pairs.push(Pair {
            clean: text_of("clean")?,
            corrupt: text_of("corrupt")?,
            answer: field("answer")?,
            wrong: field("wrong")?,
        });
    }
    if pairs.is_empty() {
        return Err(usage(format!(
            "{source}: no pairs (one JSON object a line)"
        )));
    }
    Ok(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_files_name_the_line_that_is_wrong() {
        let ok = "{\"clean\": \"a b\", \"corrupt\": \"a c\", \"answer\": \" x\", \"wrong\": 7}\n\n";
        let p = read_pairs(ok, "p.jsonl").unwrap();
        assert_eq!(p.len(), 1);
        assert!(matches!(p[0].wrong, Target::Id(7)));
        assert!(matches!(&p[0].answer, Target::Text(t) if t == " x"));
        let bad = format!("{ok}{{\"clean\": \"a\", \"corrupt\": \"b\", \"answer\": \"c\"}}\n");
        let e = read_pairs(&bad, "p.jsonl").unwrap_err();
        assert!(crate::analysis::request::is_bad_input(&e));
        assert!(
            e.to_string().contains("p.jsonl line 3: no \"wrong\" field"),
            "{e}"
        );
        let e = read_pairs("{\"clean\": 1}", "p.jsonl")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 1: \"clean\" is not a string"), "{e}");
        let e = read_pairs("nope", "p.jsonl").unwrap_err().to_string();
        assert!(e.contains("line 1: not a JSON object"), "{e}");
        assert!(read_pairs("\n", "p.jsonl").is_err());
    }
}
