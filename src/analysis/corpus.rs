//! Many sentences, not one: per-sentence records (one JSON line each) and their aggregation.
//! The aggregates are a function of the set of records only, so shards merged with
//! `attnscope corpus merge` give exactly the numbers of a single run.

use super::collect::Collector;
use super::faithfulness::{run as run_faith, FaithSettings};
use crate::model::forward::RunOptions;
use serde::{Deserialize, Serialize};

/// The built-in corpus: texts written for this project (Vietnamese, English, Chinese, code,
/// numbers, punctuation; short and long).
pub fn builtin() -> Vec<String> {
    parse_lines(include_str!("../../data/corpus.txt"), true)
}

/// The built-in corpus joined by newlines, tokenized once and repeated up to `n` tokens: real
/// text of any length, for `sinks` and `scaling`.
pub fn builtin_tokens(
    tokenizer: &crate::model::tokenize::Tokenizer,
    n: usize,
) -> crate::model::Result<Vec<u32>> {
    // a stretch of text, not a document: no BOS inside it (the callers put one first)
    let once = tokenizer.encode_with(&builtin().join("\n"), Some(false))?;
    Ok(once.iter().copied().cycle().take(n).collect())
}

/// One text per non-empty line; `#` lines are comments. With `unescape`, `\n` is a newline.
pub fn parse_lines(s: &str, unescape: bool) -> Vec<String> {
    s.lines()
        .map(|l| l.trim_end_matches('\r'))
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            if unescape {
                l.replace("\\n", "\n")
            } else {
                l.to_string()
            }
        })
        .collect()
}

/// Per-sentence faithfulness summary: Spearman ρ of each ranking against deletion.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FaithSummary {
    pub ranking: String,
    pub without_first: bool,
    pub spearman: Option<f64>,
    pub top1: Option<bool>,
}

/// What made a record, which every record carries: records are merged (or a run resumed) only
/// when all of these agree, since each of them moves the numbers.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Made {
    /// The sha256 of the model's file(s) ([`crate::model::Model::sha256`]): the weights
    /// themselves, not a name or a path that may point at other weights tomorrow.
    pub model_sha256: String,
    /// Whether the texts ran with a BOS token first (the model's own choice, `--bos` or
    /// `--no-bos`); an encoder's `[CLS]` is not a BOS: false.
    pub bos: bool,
    /// `exact` or `fast`.
    pub precision: String,
    /// The attnscope version that made it.
    pub attnscope_version: String,
}

impl Made {
    /// What records of `model` made now have, with a BOS first when the model asks for one or
    /// `force_bos` (`corpus --bos`).
    pub fn of(model: &crate::model::Model, force_bos: bool) -> crate::model::Result<Made> {
        Ok(Made {
            model_sha256: model.sha256()?,
            bos: !model.is_encoder() && (force_bos || model.tokenizer.add_bos),
            precision: model.info.precision.name().into(),
            attnscope_version: env!("CARGO_PKG_VERSION").into(),
        })
    }

    /// The first setting on which `self` and `other` differ: its name and both values.
    pub fn differs(&self, other: &Made) -> Option<(&'static str, String, String)> {
        let pairs = [
            ("model_sha256", &self.model_sha256, &other.model_sha256),
            ("precision", &self.precision, &other.precision),
            (
                "attnscope_version",
                &self.attnscope_version,
                &other.attnscope_version,
            ),
        ];
        if self.bos != other.bos {
            return Some(("bos", self.bos.to_string(), other.bos.to_string()));
        }
        pairs
            .into_iter()
            .find(|(_, a, b)| a != b)
            .map(|(name, a, b)| (name, a.clone(), b.clone()))
    }
}

/// The error for a record line that does not read as a record: an older attnscope's record
/// (without [`Made`]'s settings) is told how to regenerate it, anything else is not a record.
pub fn not_a_record(line: &str, at: &str, e: &serde_json::Error, what: &str) -> String {
    let v: Option<serde_json::Value> = serde_json::from_str(line).ok();
    let old = v.is_some_and(|v| v.get("id").is_some() && v.get("model_sha256").is_none());
    if old {
        return format!("{at}: this record does not say which model file, BOS and precision made it (an older attnscope wrote it), so it cannot be checked against the others; run `attnscope corpus --out NEW` again to regenerate its file");
    }
    format!("{at}: not an attnscope {what}: {e}")
}

/// What one sentence contributes.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Record {
    /// Index of the text in its corpus.
    pub id: usize,
    pub text: String,
    pub model: String,
    /// The model file, BOS, precision and version that made it.
    #[serde(flatten)]
    pub made: Made,
    pub n_tokens: usize,
    /// Per layer: sink share of the last query (head mean).
    pub sink_query: Vec<f32>,
    /// Per layer: sink share over queries 1..n-1 (head mean).
    pub sink_all: Vec<f32>,
    /// Per layer, per head: α₁, the mean first-token weight over queries 1..n-1.
    pub head_alpha1: Vec<Vec<f32>>,
    /// Per layer, per head: the last query's max weight.
    pub head_max_last: Vec<Vec<f32>>,
    /// Per layer, per head: mean over queries of the max weight / entropy (nats).
    pub head_mean_max: Vec<Vec<f32>>,
    pub head_mean_entropy: Vec<Vec<f32>>,
    pub next_token_id: u32,
    pub next_token: String,
    pub next_token_prob: f32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub faithfulness: Option<Vec<FaithSummary>>,
    /// Per layer: Sun et al.'s massive activations in the layer's output (`hook_resid_post`),
    /// when the run kept them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub massive: Option<Vec<super::sinkmetrics::LayerMassive>>,
}

impl Record {
    pub fn from_collector(
        id: usize,
        text: &str,
        (model, made): (&str, &Made),
        c: &Collector,
        next: (u32, String, f32),
    ) -> Record {
        let nl = c.n_layers();
        let last = c.n - 1;
        Record {
            id,
            text: text.to_string(),
            model: model.to_string(),
            made: made.clone(),
            n_tokens: c.n,
            sink_query: (0..nl).map(|l| c.sink_query(l)).collect(),
            sink_all: (0..nl).map(|l| c.sink_all_queries(l)).collect(),
            head_alpha1: (0..nl).map(|l| c.head_sink(l)).collect(),
            head_max_last: (0..nl)
                .map(|l| {
                    (0..c.n_heads)
                        .map(|h| super::vocab::max_argmax(&c.row(l, h)[..=last]).0)
                        .collect()
                })
                .collect(),
            head_mean_max: (0..nl).map(|l| c.mean_max_weight(l)).collect(),
            head_mean_entropy: (0..nl).map(|l| c.mean_entropy(l)).collect(),
            next_token_id: next.0,
            next_token: next.1,
            next_token_prob: next.2,
            faithfulness: None,
            massive: c.massive.as_ref().map(|m| m.layers.clone()),
        }
    }
}

/// Mean, sample standard deviation and the 95% confidence interval of the mean (normal
/// approximation, 1.96·sd/√n).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Stat {
    pub mean: f64,
    pub std: f64,
    pub ci95: (f64, f64),
    pub n: usize,
}

pub fn stat(xs: &[f64]) -> Stat {
    let n = xs.len();
    let mean = xs.iter().sum::<f64>() / n.max(1) as f64;
    let var = if n > 1 {
        xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64
    } else {
        0.0
    };
    let std = var.sqrt();
    let half = 1.96 * std / (n.max(1) as f64).sqrt();
    Stat {
        mean,
        std,
        ci95: (mean - half, mean + half),
        n,
    }
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct LayerAggregate {
    pub layer: usize,
    pub sink_all: Stat,
    pub sink_query: Stat,
    /// Fraction of (sentence, head) pairs with α₁ > ε.
    pub sink_heads_fraction: f64,
    /// Fraction of (sentence, head) pairs whose last-query max weight is ≥ 0.9.
    pub concentrated_fraction: f64,
    pub mean_entropy: f64,
    /// Gu et al. 2024's count: the fraction of (text, head) pairs whose first-token score (α₁
    /// with the first token's own row, [`super::sinkmetrics::gu_alpha`]) exceeds ε.
    pub gu_heads_fraction: f64,
    /// The fraction of texts with a massive activation in this layer's output (records that
    /// kept them; `None` if none did).
    pub massive_texts_fraction: Option<f64>,
}

/// Sun et al.'s massive activations over the corpus.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct MassiveAggregate {
    /// texts that kept them
    pub texts: usize,
    /// the fraction of those texts with a massive activation in some layer
    pub texts_with_any: f64,
    /// the residual dimensions they sit on, most (text, layer) pairs first: (dim, pairs)
    pub dims: Vec<(usize, usize)>,
    /// the fraction of the listed massive values that sit on the first token
    pub first_token_share: f64,
    /// the first layer whose output has one in at least half the texts
    pub first_layer: Option<usize>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct FaithAggregate {
    pub ranking: String,
    pub without_first: bool,
    pub spearman: Stat,
    pub top1_rate: f64,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Aggregate {
    pub model: String,
    pub sentences: usize,
    pub tokens: usize,
    pub epsilon: f32,
    pub layers: Vec<LayerAggregate>,
    /// Histogram of last-query head max weights over all sentences, layers and heads:
    /// 10 bins [0, 0.1), …, [0.9, 1.0].
    pub max_weight_histogram: Vec<usize>,
    /// Layer with the largest mean sink share (all queries).
    pub peak_layer: usize,
    pub faithfulness: Vec<FaithAggregate>,
    /// Gu et al. 2024's Sink₁^ε on these texts: the mean over layers of `gu_heads_fraction` (they
    /// measured it on 64-token prompts; `sinks --gu-prompts` runs their protocol).
    pub gu_sink_metric: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub massive: Option<MassiveAggregate>,
}

/// Aggregates records (order and duplicates by id do not matter).
pub fn aggregate(records: &[Record], epsilon: f32) -> Result<Aggregate, String> {
    let mut recs: Vec<&Record> = records.iter().collect();
    recs.sort_by_key(|r| r.id);
    recs.dedup_by_key(|r| r.id);
    let first = recs.first().ok_or("no records to aggregate")?;
    for r in &recs {
        check_record(r).map_err(|e| format!("record {} is malformed: {e}", r.id))?;
    }
    let (model, nl, heads) = (
        first.model.clone(),
        first.sink_all.len(),
        first.head_alpha1[0].len(),
    );
    if let Some(r) = recs
        .iter()
        .find(|r| r.model != model || r.sink_all.len() != nl || r.head_alpha1[0].len() != heads)
    {
        return Err(format!("record {} comes from model `{}` ({} layers, {} heads), others from `{model}` ({nl} layers, {heads} heads); aggregate one model at a time", r.id, r.model, r.sink_all.len(), r.head_alpha1[0].len()));
    }
    let mut hist = vec![0usize; 10];
    let layers = (0..nl)
        .map(|l| layer_aggregate(&recs, l, epsilon, &mut hist))
        .collect::<Vec<_>>();
    let peak_layer = layers
        .iter()
        .max_by(|a, b| {
            a.sink_all
                .mean
                .total_cmp(&b.sink_all.mean)
                .then(b.layer.cmp(&a.layer))
        })
        .map(|l| l.layer)
        .unwrap_or(0);
    let faith = faith_aggregates(&recs);
    let gu_sink_metric =
        layers.iter().map(|l| l.gu_heads_fraction).sum::<f64>() / layers.len().max(1) as f64;
    let massive = massive_aggregate(&recs, &layers);
    Ok(Aggregate {
        gu_sink_metric,
        massive,
        model,
        sentences: recs.len(),
        tokens: recs.iter().map(|r| r.n_tokens).sum(),
        epsilon,
        layers,
        max_weight_histogram: hist,
        peak_layer,
        faithfulness: faith,
    })
}

/// Layer `l`'s aggregate over `recs`: the sink shares' statistics, the fractions of sink heads
/// (α₁ > `epsilon`, ours and Gu et al.'s), of concentrated heads and of texts with massive
/// activations, the mean entropy; each head's last-query max weight counted into `hist`.
fn layer_aggregate(recs: &[&Record], l: usize, epsilon: f32, hist: &mut [usize]) -> LayerAggregate {
    let all: Vec<f64> = recs.iter().map(|r| r.sink_all[l] as f64).collect();
    let q: Vec<f64> = recs.iter().map(|r| r.sink_query[l] as f64).collect();
    let (mut sink_heads, mut conc, mut total, mut ent) = (0usize, 0usize, 0usize, 0.0f64);
    let mut gu = 0usize;
    for r in recs {
        for (h, &a) in r.head_alpha1[l].iter().enumerate() {
            total += 1;
            sink_heads += (a > epsilon) as usize;
            gu += (super::sinkmetrics::gu_alpha(a as f64, r.n_tokens) > epsilon as f64) as usize;
            let m = r.head_max_last[l][h];
            conc += (m >= 0.9) as usize;
            hist[((m * 10.0) as usize).min(9)] += 1;
            ent += r.head_mean_entropy[l][h] as f64;
        }
    }
    let t = total.max(1) as f64;
    let kept: Vec<bool> = recs
        .iter()
        .filter_map(|r| r.massive.as_ref())
        .map(|m| m.iter().any(|x| x.layer == l && x.massive > 0))
        .collect();
    LayerAggregate {
        gu_heads_fraction: gu as f64 / t,
        massive_texts_fraction: (!kept.is_empty())
            .then(|| kept.iter().filter(|&&b| b).count() as f64 / kept.len() as f64),
        layer: l,
        sink_all: stat(&all),
        sink_query: stat(&q),
        sink_heads_fraction: sink_heads as f64 / t,
        concentrated_fraction: conc as f64 / t,
        mean_entropy: ent / t,
    }
}

/// Each ranking's (and first-token setting's) Spearman ρ statistics and top-1 rate over the
/// records that measured faithfulness.
fn faith_aggregates(recs: &[&Record]) -> Vec<FaithAggregate> {
    let mut faith: Vec<FaithAggregate> = Vec::new();
    let with_f: Vec<&Vec<FaithSummary>> = recs
        .iter()
        .filter_map(|r| r.faithfulness.as_ref())
        .collect();
    if let Some(first) = with_f.first() {
        for key in first.iter() {
            let rows: Vec<&FaithSummary> = with_f
                .iter()
                .flat_map(|v| {
                    v.iter().filter(|f| {
                        f.ranking == key.ranking && f.without_first == key.without_first
                    })
                })
                .collect();
            let rhos: Vec<f64> = rows.iter().filter_map(|f| f.spearman).collect();
            let top1: Vec<bool> = rows.iter().filter_map(|f| f.top1).collect();
            faith.push(FaithAggregate {
                ranking: key.ranking.clone(),
                without_first: key.without_first,
                spearman: stat(&rhos),
                top1_rate: top1.iter().filter(|&&b| b).count() as f64 / top1.len().max(1) as f64,
            });
        }
    }
    faith
}

fn massive_aggregate(recs: &[&Record], layers: &[LayerAggregate]) -> Option<MassiveAggregate> {
    let kept: Vec<&Vec<super::sinkmetrics::LayerMassive>> =
        recs.iter().filter_map(|r| r.massive.as_ref()).collect();
    if kept.is_empty() {
        return None;
    }
    let with_any = kept
        .iter()
        .filter(|m| m.iter().any(|x| x.massive > 0))
        .count();
    let mut dims: std::collections::BTreeMap<usize, usize> = Default::default();
    let (mut listed, mut first) = (0usize, 0usize);
    for m in &kept {
        for layer in m.iter().filter(|x| x.massive > 0) {
            let cut = (1000.0 * layer.median_abs).max(100.0);
            let big: Vec<_> = layer.top.iter().filter(|a| a.value.abs() > cut).collect();
            listed += big.len();
            first += big.iter().filter(|a| a.pos == 0).count();
            let mut seen: Vec<usize> = big.iter().map(|a| a.dim).collect();
            seen.sort_unstable();
            seen.dedup();
            for d in seen {
                *dims.entry(d).or_default() += 1;
            }
        }
    }
    let mut dims: Vec<(usize, usize)> = dims.into_iter().collect();
    dims.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    dims.truncate(5);
    Some(MassiveAggregate {
        texts: kept.len(),
        texts_with_any: with_any as f64 / kept.len() as f64,
        dims,
        first_token_share: first as f64 / listed.max(1) as f64,
        first_layer: layers
            .iter()
            .find(|l| l.massive_texts_fraction.is_some_and(|f| f >= 0.5))
            .map(|l| l.layer),
    })
}

/// Reads JSON-lines records, naming the file and line of a bad one: a line that is not a record,
/// or a record whose arrays do not agree ([`check_record`]).
pub fn read_records(text: &str, source: &str) -> Result<Vec<Record>, String> {
    Ok(read_lines(text, source)?
        .into_iter()
        .map(|(r, _)| r)
        .collect())
}

/// Each record with its line number (1-based).
fn read_lines(text: &str, source: &str) -> Result<Vec<(Record, usize)>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            let r: Record = serde_json::from_str(l).map_err(|e| {
                not_a_record(l, &format!("{source}:{}", i + 1), &e, "corpus record")
            })?;
            check_record(&r).map_err(|e| {
                format!("{source}:{}: record {} is malformed: {e}; the file is damaged or was not written by `attnscope corpus --out`", i + 1, r.id)
            })?;
            Ok((r, i + 1))
        })
        .collect()
}

/// A record's own shape: at least one layer, every per-layer array as long as the layer count,
/// the same number of heads (at least one) in every layer of every per-head array.
pub fn check_record(r: &Record) -> Result<(), String> {
    let nl = r.sink_all.len();
    if nl == 0 {
        return Err("its profile is empty (no layers in `sink_all`)".into());
    }
    if r.n_tokens == 0 {
        return Err("it has 0 tokens".into());
    }
    let per_layer: [(&str, usize); 5] = [
        ("sink_query", r.sink_query.len()),
        ("head_alpha1", r.head_alpha1.len()),
        ("head_max_last", r.head_max_last.len()),
        ("head_mean_max", r.head_mean_max.len()),
        ("head_mean_entropy", r.head_mean_entropy.len()),
    ];
    if let Some((name, n)) = per_layer.iter().find(|(_, n)| *n != nl) {
        return Err(format!("`{name}` has {n} layers but `sink_all` has {nl}"));
    }
    let heads = r.head_alpha1[0].len();
    if heads == 0 {
        return Err("layer 0 of `head_alpha1` has no heads".into());
    }
    for (name, arr) in [
        ("head_alpha1", &r.head_alpha1),
        ("head_max_last", &r.head_max_last),
        ("head_mean_max", &r.head_mean_max),
        ("head_mean_entropy", &r.head_mean_entropy),
    ] {
        if let Some((l, row)) = arr.iter().enumerate().find(|(_, row)| row.len() != heads) {
            return Err(format!(
                "layer {l} of `{name}` has {} heads but layer 0 of `head_alpha1` has {heads}",
                row.len()
            ));
        }
    }
    check_record_values(r)?;
    if let Some(m) = &r.massive {
        if m.len() != nl {
            return Err(format!(
                "`massive` has {} layers but `sink_all` has {nl}",
                m.len()
            ));
        }
        for (l, x) in m.iter().enumerate() {
            if x.layer != l {
                return Err(format!("entry {l} of `massive` is for layer {}", x.layer));
            }
            if let Some(a) = x.top.iter().find(|a| a.pos >= r.n_tokens) {
                return Err(format!(
                    "layer {l} of `massive` lists position {} of a {}-token text",
                    a.pos, r.n_tokens
                ));
            }
        }
    }
    Ok(())
}

/// Every weight and share of `r` is one (finite, in [0, 1]) and every entropy finite and at
/// least 0: an edited or damaged record's 5.0 would move the merged means silently.
fn check_record_values(r: &Record) -> Result<(), String> {
    const SLACK: f32 = 1e-4; // an f32 sum of softmax weights may pass 1 by rounding
    let share = |v: f32| v.is_finite() && (-SLACK..=1.0 + SLACK).contains(&v);
    let rows = |a: &Vec<Vec<f32>>| a.iter().flatten().copied().collect::<Vec<f32>>();
    for (name, values) in [
        ("sink_query", r.sink_query.clone()),
        ("sink_all", r.sink_all.clone()),
        ("head_alpha1", rows(&r.head_alpha1)),
        ("head_max_last", rows(&r.head_max_last)),
        ("head_mean_max", rows(&r.head_mean_max)),
        ("next_token_prob", vec![r.next_token_prob]),
    ] {
        if let Some(v) = values.iter().find(|&&v| !share(v)) {
            return Err(format!(
                "`{name}` holds {v}, not an attention weight or probability (0 to 1)"
            ));
        }
    }
    if let Some(v) = rows(&r.head_mean_entropy)
        .iter()
        .find(|&&v| !(v.is_finite() && v >= -SLACK))
    {
        return Err(format!(
            "`head_mean_entropy` holds {v}, not an entropy (finite, at least 0)"
        ));
    }
    Ok(())
}

/// Reads the record files of shards (`(text, source name)` each) for `corpus merge`: every
/// record is checked ([`check_record`]) and must agree with the first one read (the same model,
/// layers and heads, and the same [`Made`] settings: model file, BOS, precision, version), and a
/// record id that appears twice must be the same record (a resumed shard repeats records; two
/// different corpora, or two runs' different numbers, under one id would be merged silently).
/// An error names the file and line of the record at fault, and of the one it disagrees with.
pub fn read_record_files<S: AsRef<str>>(files: &[(S, S)]) -> Result<Vec<Record>, String> {
    let mut out: Vec<Record> = Vec::new();
    // the first record's place, and where each id was first seen
    let mut first_at = String::new();
    let mut seen: std::collections::HashMap<usize, (usize, String)> = Default::default();
    for (text, source) in files {
        let source = source.as_ref();
        for (r, line) in read_lines(text.as_ref(), source)? {
            let at = format!("{source}:{line}");
            match out.first() {
                Some(r0) => agrees_with_first(&r, &at, r0, &first_at)?,
                None => first_at = at.clone(),
            }
            match seen.get(&r.id) {
                Some((i, where0)) => same_record(&r, &at, &out[*i], where0)?,
                None => {
                    seen.insert(r.id, (out.len(), at));
                }
            }
            out.push(r);
        }
    }
    if out.is_empty() {
        return Err(format!(
            "{} hold no records",
            files
                .iter()
                .map(|(_, s)| s.as_ref())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    Ok(out)
}

/// Refuses record `r` (at `at`) when it comes from another model than `r0` (at `first_at`), or
/// was made with other settings ([`Made::differs`]), naming both places and values.
fn agrees_with_first(r: &Record, at: &str, r0: &Record, first_at: &str) -> Result<(), String> {
    let (heads, heads0) = (r.head_alpha1[0].len(), r0.head_alpha1[0].len());
    if r.model != r0.model || r.sink_all.len() != r0.sink_all.len() || heads != heads0 {
        return Err(format!(
            "{at}: record {} comes from model `{}` ({} layers, {heads} heads), but {first_at} from `{}` ({} layers, {heads0} heads); merge the records of one model at a time",
            r.id, r.model, r.sink_all.len(), r0.model, r0.sink_all.len()
        ));
    }
    settings_agree(&r.made, at, &r0.made, first_at)
}

/// Refuses records made with other settings than the first one's, naming both places and the
/// setting's two values.
pub fn settings_agree(made: &Made, at: &str, made0: &Made, at0: &str) -> Result<(), String> {
    match made.differs(made0) {
        Some((name, v, v0)) => Err(format!(
            "{at}: this record was made with {name} {v}, but {at0} with {name} {v0}; records made with other settings (model file, BOS, precision, attnscope version) give other numbers: merge or resume those of one run's settings"
        )),
        None => Ok(()),
    }
}

/// Refuses a record `r` (at `at`) whose id `r0` (at `where0`) had already, unless it is the same
/// record (a resumed shard repeats records): another text, or the same text with other numbers.
fn same_record(r: &Record, at: &str, r0: &Record, where0: &str) -> Result<(), String> {
    if r0.text != r.text {
        return Err(format!(
            "{at}: record {} is for the text {:?}, but {where0} has record {} for {:?}; the files come from different corpora (or --file), so their ids do not name the same texts",
            r.id,
            excerpt(&r.text),
            r.id,
            excerpt(&r0.text)
        ));
    }
    if r0 != r {
        return Err(format!(
            "{at}: record {} repeats the text of {where0}'s record {} with other numbers; the two come from different runs, and merging them once would keep whichever came first",
            r.id, r0.id
        ));
    }
    Ok(())
}

/// The first 40 characters of a text, for messages.
fn excerpt(t: &str) -> String {
    let mut s: String = t.chars().take(40).collect();
    if t.chars().count() > 40 {
        s.push('…');
    }
    s
}

/// The record of text `id` (what `corpus --out` writes for it). The outer error is the engine's
/// (fatal); the inner one the text's own (empty, too long: the text is skipped, and said).
pub fn text_record(
    model: &crate::model::Model,
    id: usize,
    text: &str,
    bos: bool,
    faithfulness: bool,
) -> anyhow::Result<Result<Record, String>> {
    let d = &model.dims;
    let tokens = match model.encode(text, bos) {
        Ok(t) => t,
        Err(e) => return Ok(Err(e.to_string())),
    };
    let n = tokens.len();
    // every layer's output passes through Sun et al.'s statistics (its 3 largest values kept)
    let mut c = Collector::new(d.n_layers, d.n_heads, n, n - 1).with_massive(3);
    let out = model.forward(&tokens, &RunOptions::last_logits(n), &mut c)?;
    let top = super::vocab::next_token_top_k(&out.logits[0], 1).remove(0);
    let made = Made::of(model, bos)?;
    let mut rec = Record::from_collector(
        id,
        text,
        (&model.info.name, &made),
        &c,
        (top.id, model.tokenizer.token_text(top.id), top.prob),
    );
    if faithfulness {
        add_faithfulness(model, &tokens, &mut rec)?;
    }
    Ok(Ok(rec))
}

/// Rows per forward of [`text_records`]: about what a 2,048-token forward holds.
pub const BATCH_ROWS: usize = 2048;
/// Texts per forward of [`text_records`].
pub const BATCH_TEXTS: usize = 64;

/// The records of `(id, text)` pairs, as [`text_record`] gives each, with the texts run many to
/// a forward ([`crate::model::Model::forward_many`]: rows stacked through the projections,
/// attention per text, no padding; up to [`BATCH_TEXTS`] texts and [`BATCH_ROWS`] tokens per
/// forward). Every record equals its one-text run's (tested bit for bit on the exact kernels).
/// `done(k)` is told after each forward how many texts it finished.
pub fn text_records(
    model: &crate::model::Model,
    items: &[(usize, &str)],
    bos: bool,
    faithfulness: bool,
    mut done: impl FnMut(usize),
) -> anyhow::Result<Vec<Result<Record, String>>> {
    let d = &model.dims;
    let made = Made::of(model, bos)?;
    let encoded: Vec<Result<Vec<u32>, String>> = items
        .iter()
        .map(|(_, t)| model.encode(t, bos).map_err(|e| e.to_string()))
        .collect();
    let mut out: Vec<Option<Result<Record, String>>> = encoded
        .iter()
        .map(|e| e.as_ref().err().map(|e| Err(e.clone())))
        .collect();
    let good: Vec<usize> = (0..items.len()).filter(|&i| encoded[i].is_ok()).collect();
    let tokens = |i: usize| encoded[i].as_ref().expect("kept only the encoded texts");
    let lens: Vec<usize> = good.iter().map(|&i| tokens(i).len()).collect();
    for range in crate::model::segments::batches(&lens, BATCH_ROWS, BATCH_TEXTS) {
        let idx = &good[range];
        let texts: Vec<&[u32]> = idx.iter().map(|&i| tokens(i).as_slice()).collect();
        let mut cs: Vec<Collector> = texts
            .iter()
            .map(|t| Collector::new(d.n_layers, d.n_heads, t.len(), t.len() - 1).with_massive(3))
            .collect();
        let logits = model.forward_many(&texts, &mut cs)?;
        for ((&i, c), row) in idx.iter().zip(&cs).zip(&logits) {
            let top = super::vocab::next_token_top_k(row, 1).remove(0);
            let (id, text) = items[i];
            let mut rec = Record::from_collector(
                id,
                text,
                (&model.info.name, &made),
                c,
                (top.id, model.tokenizer.token_text(top.id), top.prob),
            );
            if faithfulness {
                add_faithfulness(model, tokens(i), &mut rec)?;
            }
            out[i] = Some(Ok(rec));
        }
        done(idx.len());
    }
    Ok(out
        .into_iter()
        .map(|r| r.expect("every text has its record or its error"))
        .collect())
}

/// The faithfulness summary of a text's record (`corpus --faithfulness`).
fn add_faithfulness(
    model: &crate::model::Model,
    tokens: &[u32],
    rec: &mut Record,
) -> anyhow::Result<()> {
    {
        let f = run_faith(model, tokens, &FaithSettings::attention_only(), |_, _| {})?;
        rec.faithfulness = Some(
            f.metrics
                .iter()
                .filter(|m| {
                    m.truth == "loo"
                        && [
                            "attention_last",
                            "attention_mean",
                            "rollout",
                            "norm_last",
                            "norm_mean",
                            "random",
                        ]
                        .contains(&m.ranking.as_str())
                })
                .map(|m| FaithSummary {
                    ranking: m.ranking.clone(),
                    without_first: m.without_first,
                    spearman: m.spearman,
                    top1: m.top1,
                })
                .collect(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn made() -> Made {
        Made {
            model_sha256: "ab".repeat(32),
            bos: false,
            precision: "exact".into(),
            attnscope_version: env!("CARGO_PKG_VERSION").into(),
        }
    }

    fn rec(id: usize, sink: f32) -> Record {
        Record {
            id,
            text: format!("t{id}"),
            model: "m".into(),
            made: made(),
            n_tokens: 5,
            sink_query: vec![sink, 0.1],
            sink_all: vec![sink, 0.2],
            head_alpha1: vec![vec![sink, 0.5], vec![0.1, 0.2]],
            head_max_last: vec![vec![0.95, 0.5], vec![0.3, 0.99]],
            head_mean_max: vec![vec![0.5, 0.5], vec![0.5, 0.5]],
            head_mean_entropy: vec![vec![1.0, 1.0], vec![1.0, 1.0]],
            next_token_id: 1,
            next_token: "x".into(),
            next_token_prob: 0.5,
            faithfulness: None,
            massive: None,
        }
    }

    #[test]
    fn stats_by_hand() {
        let s = stat(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(s.mean, 2.5);
        assert!((s.std - 1.290_994_448_735_805_6).abs() < 1e-12);
        assert!((s.ci95.1 - (2.5 + 1.96 * s.std / 2.0)).abs() < 1e-12);
    }

    #[test]
    fn merged_shards_equal_a_single_run() {
        let all: Vec<Record> = (0..7).map(|i| rec(i, i as f32 / 10.0)).collect();
        let single = aggregate(&all, 0.3).unwrap();
        let (a, b): (Vec<Record>, Vec<Record>) = all.iter().cloned().partition(|r| r.id % 2 == 0);
        let mut merged = b.clone();
        merged.extend(a);
        merged.push(all[3].clone()); // a resumed shard may repeat a record
        assert_eq!(aggregate(&merged, 0.3).unwrap(), single);
        assert_eq!(single.sentences, 7);
        // α₁ > 0.3: layer 0 head 0 for ids 4,5,6 and head 1 always → (3 + 7) / 14
        assert!((single.layers[0].sink_heads_fraction - 10.0 / 14.0).abs() < 1e-12);
        assert!((single.layers[1].concentrated_fraction - 0.5).abs() < 1e-12);
        assert_eq!(single.max_weight_histogram.iter().sum::<usize>(), 28);
    }

    /// Gu et al.'s count includes the first token's own row: α = (1 + (n−1)·α₁)/n, n = 5.
    /// Massive activations: a text has one in a layer when its count is > 0; the dims and the
    /// first-token share come from the listed values above the cut.
    #[test]
    fn gu_heads_and_massive_activations_by_hand() {
        use super::super::sinkmetrics::{Activation, LayerMassive};
        let mut all: Vec<Record> = (0..4).map(|i| rec(i, 0.2)).collect();
        // layer 0: head 0 α₁ 0.2 → α 0.36 > 0.3 (but α₁ ≤ 0.3); head 1 α₁ 0.5 → 0.6
        // layer 1: α₁ 0.1 → 0.28, α₁ 0.2 → 0.36
        let a = aggregate(&all, 0.3).unwrap();
        assert_eq!(a.layers[0].sink_heads_fraction, 0.5);
        assert_eq!(a.layers[0].gu_heads_fraction, 1.0);
        assert_eq!(a.layers[1].gu_heads_fraction, 0.5);
        assert!((a.gu_sink_metric - 0.75).abs() < 1e-12);
        assert!(a.massive.is_none() && a.layers[0].massive_texts_fraction.is_none());
        let layer = |l: usize, massive: usize, top: Vec<(usize, usize, f32)>| LayerMassive {
            layer: l,
            median_abs: 0.05,
            max_abs: top.first().map_or(1.0, |t| t.2.abs()),
            ratio: 1.0,
            massive,
            top: top
                .into_iter()
                .map(|(pos, dim, value)| Activation { pos, dim, value })
                .collect(),
        };
        // texts 0-2 kept them: two with one in layer 1 (dim 7 at the first token, and dim 7
        // and dim 3 at position 2); text 3 kept none
        all[0].massive = Some(vec![
            layer(0, 0, vec![(0, 1, 5.0)]),
            layer(1, 1, vec![(0, 7, 900.0), (1, 2, 3.0)]),
        ]);
        all[1].massive = Some(vec![
            layer(0, 0, vec![]),
            layer(1, 2, vec![(2, 7, -800.0), (2, 3, 400.0)]),
        ]);
        all[2].massive = Some(vec![layer(0, 0, vec![]), layer(1, 0, vec![(0, 7, 50.0)])]);
        let a = aggregate(&all, 0.3).unwrap();
        assert_eq!(a.layers[0].massive_texts_fraction, Some(0.0));
        assert!((a.layers[1].massive_texts_fraction.unwrap() - 2.0 / 3.0).abs() < 1e-12);
        let m = a.massive.unwrap();
        assert_eq!(m.texts, 3);
        assert!((m.texts_with_any - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(m.dims, vec![(7, 2), (3, 1)]);
        assert!((m.first_token_share - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(m.first_layer, Some(1));
        // a record whose massive list disagrees with it is refused
        let mut bad = all[0].clone();
        bad.massive.as_mut().unwrap()[1].top[0].pos = 5;
        assert!(check_record(&bad)
            .unwrap_err()
            .contains("position 5 of a 5-token text"));
        bad.massive.as_mut().unwrap().pop();
        assert!(check_record(&bad)
            .unwrap_err()
            .contains("`massive` has 1 layers"));
        // and records round-trip with it
        let line = serde_json::to_string(&all[1]).unwrap();
        assert_eq!(read_records(&line, "f").unwrap()[0], all[1]);
    }

    #[test]
    fn records_roundtrip_and_mixed_models_are_refused() {
        let r = rec(1, 0.5);
        let line = serde_json::to_string(&r).unwrap();
        assert_eq!(read_records(&line, "x").unwrap(), vec![r.clone()]);
        let mut other = rec(2, 0.5);
        other.model = "other".into();
        assert!(aggregate(&[r, other], 0.3)
            .unwrap_err()
            .contains("one model at a time"));
        assert!(read_records("{bad", "f.jsonl")
            .unwrap_err()
            .starts_with("f.jsonl:1:"));
    }

    #[test]
    fn builtin_corpus_has_at_least_200_texts() {
        let b = builtin();
        assert!(b.len() >= 200, "{}", b.len());
        assert!(
            b.iter().any(|t| t.contains('\n')),
            "code samples keep their newlines"
        );
        assert!(b.iter().any(|t| t.contains("北京")) && b.iter().any(|t| t.contains("Hà Nội")));
    }
}
