//! Interventions: head and MLP ablation ([`ablate`]) and activation patching ([`patch`]), as
//! TransformerLens users run them with editing hooks, on the editing machinery of
//! [`super::edit`] (an edit resumes at its layer and reuses the clean run's prefix).

use super::collect::{last_query_attention, Collector};
use super::edit::{Fill, Runner, Variant};
use super::vocab::{entropy, kendall_tau_b, max_argmax, permutation_p, spearman};
use super::vocab::{PatchCell, PatchHook, Target, TokenRef};
use crate::model::capture::Hook;
use crate::model::forward::log_softmax;
use crate::model::{Error, Model, Result};
use serde::Serialize;
use std::ops::Range;

/// Zero or mean ablation (`ablate --method`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AblateMethod {
    Zero,
    Mean,
}

impl AblateMethod {
    pub fn name(self) -> &'static str {
        match self {
            AblateMethod::Zero => "zero",
            AblateMethod::Mean => "mean",
        }
    }
}

/// The most positions stacked into one forward by default (`--batch-rows`).
pub const DEFAULT_BATCH_ROWS: usize = 1024;

/// What `ablate` removes (each head in turn, zeroed or replaced by its mean) and the token whose
/// log-probability it watches.
#[derive(Clone, Debug)]
pub struct AblateOptions {
    /// how a head is removed (zeroed or replaced by its mean)
    pub method: AblateMethod,
    /// the token whose log-probability is watched
    pub target: Target,
    /// positions whose activation is ablated (None: all)
    pub positions: Option<Vec<usize>>,
    /// ablate each layer's MLP output too
    pub mlp: bool,
    /// the most rows stacked in one forward
    pub batch_rows: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct HeadEffect {
    pub layer: usize,
    pub head: usize,
    /// log p(target) with the head ablated, minus the clean run's
    pub delta_logprob: f32,
    /// KL(clean ‖ ablated) of the next-token distribution, nats
    pub kl: f32,
    /// the head's attention for the last query (the one that predicts): largest weight, where,
    /// weight on the first token, entropy in nats
    pub max_weight: f32,
    pub argmax: usize,
    pub sink: f32,
    pub entropy: f32,
}

#[derive(Clone, Debug, Serialize)]
pub struct MlpEffect {
    pub layer: usize,
    pub delta_logprob: f32,
    pub kl: f32,
}

/// A rank correlation over the heads between an attention statistic and |Δ log p|.
#[derive(Clone, Debug, Serialize)]
pub struct Correlation {
    pub attention: String,
    pub effect: String,
    pub n: usize,
    pub spearman: Option<f64>,
    /// two-sided permutation p-value
    pub spearman_p: Option<f64>,
    pub kendall: Option<f64>,
}

/// `ablate`'s report: each head's effect on the target's log-probability when removed, and how
/// the effects correlate with the head's attention.
#[derive(Clone, Debug, Serialize)]
pub struct AblateReport {
    /// the model's name
    pub model: String,
    /// the ablation method
    pub method: String,
    /// the input tokens
    pub tokens: Vec<TokenRef>,
    /// the position whose prediction is watched
    pub query: usize,
    /// the positions ablated (`None`: all)
    pub positions: Option<Vec<usize>>,
    /// the watched token
    pub target: TokenRef,
    /// its log-probability with nothing ablated
    pub baseline_logprob: f32,
    /// each head's effect
    pub heads: Vec<HeadEffect>,
    /// each layer's MLP's effect, when asked
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mlp: Vec<MlpEffect>,
    /// how the effects correlate with attention-based scores
    pub correlations: Vec<Correlation>,
    /// forward passes (the clean ones included) and the layer-position rows they computed,
    /// beside what one full forward per ablation would compute
    pub forward_passes: usize,
    /// the layer-position rows the forwards computed
    pub layer_rows: usize,
    /// the rows one full forward per ablation would compute
    pub layer_rows_from_scratch: usize,
}

/// Δ log p(target) and KL(clean ‖ edited) from the edited run's logits.
fn effect(base_lp: &[f32], logits: &[f32], target: u32) -> (f32, f32) {
    let lp = log_softmax(logits);
    let kl: f64 = base_lp
        .iter()
        .zip(&lp)
        .map(|(&b, &e)| (b as f64).exp() * (b as f64 - e as f64))
        .sum();
    (
        lp[target as usize] - base_lp[target as usize],
        kl.max(0.0) as f32,
    )
}

/// The positions `--positions` ablates (each checked below `n`), or every position.
fn ablated_positions(positions: Option<&[usize]>, n: usize) -> Result<Vec<usize>> {
    match positions {
        Some(ps) => {
            if let Some(&bad) = ps.iter().find(|&&p| p >= n) {
                return Err(Error::OutOfRange {
                    what: "--positions".into(),
                    value: bad.to_string(),
                    range: format!("0..={}", n - 1),
                });
            }
            Ok(ps.to_vec())
        }
        None => Ok((0..n).collect()),
    }
}

/// The rank correlations over the heads of their attention (max weight, −entropy, sink) with
/// their ablation's effect (|Δ log p|, KL).
fn correlations(heads: &[HeadEffect]) -> Vec<Correlation> {
    let importance: Vec<f64> = heads.iter().map(|h| h.delta_logprob.abs() as f64).collect();
    let kls: Vec<f64> = heads.iter().map(|h| h.kl as f64).collect();
    let correlation = |name: &str, xs: Vec<f64>, effect: &str, ys: &[f64]| Correlation {
        attention: name.into(),
        effect: effect.into(),
        n: xs.len(),
        spearman: spearman(&xs, ys),
        spearman_p: permutation_p(&xs, ys, spearman),
        kendall: kendall_tau_b(&xs, ys),
    };
    let maxw: Vec<f64> = heads.iter().map(|h| h.max_weight as f64).collect();
    let sink: Vec<f64> = heads.iter().map(|h| h.sink as f64).collect();
    let neg_entropy: Vec<f64> = heads.iter().map(|h| -h.entropy as f64).collect();
    vec![
        correlation("max_weight", maxw.clone(), "|delta_logprob|", &importance),
        correlation("-entropy", neg_entropy, "|delta_logprob|", &importance),
        correlation("sink", sink, "|delta_logprob|", &importance),
        correlation("max_weight", maxw, "kl", &kls),
    ]
}

/// One ablation setting: what each edit writes where, and what its effect is measured against.
struct Ablation<'a> {
    /// the positions whose activation is ablated
    positions: &'a [usize],
    fill: Fill<'static>,
    /// the clean run's next-token log-probabilities
    base_lp: &'a [f32],
    target: u32,
}

impl Ablation<'_> {
    /// The edit of values `cols` at the ablated positions (the whole text rerun from layer l).
    fn variant(&self, cols: Range<usize>) -> Variant<'static> {
        Variant {
            from: 0,
            cols,
            at: self.positions.to_vec(),
            fill: self.fill,
        }
    }

    /// One variant per head: its `hook_z` slice.
    fn head_variants(&self, n_heads: usize, head_dim: usize) -> Vec<Variant<'static>> {
        (0..n_heads)
            .map(|h| self.variant(h * head_dim..(h + 1) * head_dim))
            .collect()
    }

    /// Each head's effect at layer `l` (from its ablated run's logits `outs[h]`), beside its
    /// attention for the last query (`rows`).
    fn head_effects(&self, l: usize, outs: &[Vec<f32>], rows: &Collector) -> Vec<HeadEffect> {
        outs.iter()
            .enumerate()
            .map(|(h, lg)| {
                let (delta, kl) = effect(self.base_lp, lg, self.target);
                let row = rows.row(l, h);
                let (max_weight, argmax) = max_argmax(row);
                HeadEffect {
                    layer: l,
                    head: h,
                    delta_logprob: delta,
                    kl,
                    max_weight,
                    argmax,
                    sink: row[0],
                    entropy: entropy(row),
                }
            })
            .collect()
    }

    /// Layer `l`'s MLP effect from its ablated run's logits.
    fn mlp_effect(&self, l: usize, logits: &[f32]) -> MlpEffect {
        let (delta, kl) = effect(self.base_lp, logits, self.target);
        MlpEffect {
            layer: l,
            delta_logprob: delta,
            kl,
        }
    }
}

/// Ablates every head of every layer (its `hook_z` slice, TransformerLens's head output before
/// `W_O`), and with `opts.mlp` every layer's MLP output, one at a time; reports each one's effect
/// on the target beside the head's attention for the last query. `tick(done, total)` reports
/// progress in variants.
pub fn ablate(
    model: &Model,
    tokens: &[u32],
    opts: &AblateOptions,
    mut tick: impl FnMut(usize, usize),
) -> Result<AblateReport> {
    let d = &model.dims;
    let n = tokens.len();
    let positions = ablated_positions(opts.positions.as_deref(), n)?;
    let (mut runner, logits, _) = Runner::clean(model, tokens, &[])?;
    runner.batch_rows = opts.batch_rows.max(1);
    let target = opts.target.resolve(model, &logits)?;
    let base_lp = log_softmax(&logits);
    let rows = last_query_attention(model, tokens)?;
    runner.passes += 1;
    let total = d.n_layers * (d.n_heads + usize::from(opts.mlp));
    let ablation = Ablation {
        positions: &positions,
        fill: match opts.method {
            AblateMethod::Zero => Fill::Zero,
            AblateMethod::Mean => Fill::Mean,
        },
        base_lp: &base_lp,
        target,
    };
    let mut heads = Vec::with_capacity(d.n_layers * d.n_heads);
    let mut mlp = Vec::new();
    let mut done = 0;
    for l in 0..d.n_layers {
        let variants = ablation.head_variants(d.n_heads, d.head_dim);
        let outs = runner.run(l, Hook::Z, &variants, |k| tick(done + k, total))?;
        done += variants.len();
        heads.extend(ablation.head_effects(l, &outs, &rows));
        if opts.mlp {
            let v = ablation.variant(0..d.d_model);
            let outs = runner.run(l, Hook::MlpOut, &[v], |_| {})?;
            done += 1;
            tick(done, total);
            mlp.push(ablation.mlp_effect(l, &outs[0]));
        }
    }
    let correlations = correlations(&heads);
    Ok(AblateReport {
        model: model.info.name.clone(),
        method: opts.method.name().into(),
        tokens: TokenRef::all(model, tokens),
        query: n - 1,
        positions: opts.positions.clone(),
        target: TokenRef::of(model, target),
        baseline_logprob: base_lp[target as usize],
        heads,
        mlp,
        correlations,
        forward_passes: runner.passes,
        layer_rows: runner.layer_rows,
        layer_rows_from_scratch: (total + 2) * d.n_layers * n,
    })
}

/// What `patch` patches: the hook point, the answer and wrong tokens whose logit difference it
/// measures.
#[derive(Clone, Debug)]
pub struct PatchOptions {
    /// the hook point patched
    pub hook: PatchHook,
    /// the token the clean run should predict (None: the clean run's top next token)
    pub answer: Option<Target>,
    /// the token the corrupted run should predict (None: the corrupted run's top next token)
    pub wrong: Option<Target>,
    /// the most rows stacked in one forward
    pub batch_rows: usize,
}

/// `patch`'s report: activation patching from the clean run into the corrupted one, per layer and
/// position (or head), as the share of the logit difference restored.
#[derive(Clone, Debug, Serialize)]
pub struct PatchReport {
    /// the model's name
    pub model: String,
    /// the hook point patched
    pub hook: String,
    /// the clean text's tokens
    pub clean: Vec<TokenRef>,
    /// the corrupted text's tokens
    pub corrupt: Vec<TokenRef>,
    /// the answer token
    pub answer: TokenRef,
    /// the wrong token
    pub wrong: TokenRef,
    /// `logit(answer) − logit(wrong)` on the clean run
    pub clean_logit_diff: f32,
    /// `logit(answer) − logit(wrong)` on the corrupted run
    pub corrupt_logit_diff: f32,
    /// each patched cell's result
    pub results: Vec<PatchCell>,
    /// the forward passes run
    pub forward_passes: usize,
    /// the layer-position rows the forwards computed
    pub layer_rows: usize,
    /// the rows one full forward per patch would compute
    pub layer_rows_from_scratch: usize,
    /// what makes the numbers hard to read (a clean and corrupted logit difference so close
    /// that `recovered`, which divides by their gap, is a ratio of small numbers)
    pub warnings: Vec<String>,
}

/// Below this gap between the clean and the corrupted logit difference (in logits), `recovered`
/// is warned about: a change of 0.001 in a patched run's logit difference already moves it by
/// more than 1%, and the texts barely tell the answer from the wrong token.
pub const SMALL_LOGIT_DIFF_GAP: f32 = 0.1;

/// Refuses a clean and a corrupted logit difference (answer − wrong) that are equal, since
/// `recovered` divides by their gap (it would be NaN or infinite in every cell), and returns a
/// warning when the gap is below [`SMALL_LOGIT_DIFF_GAP`].
pub fn check_logit_diff_gap(clean: f32, corrupt: f32) -> Result<Option<String>> {
    let gap = clean - corrupt;
    if gap == 0.0 || !gap.is_finite() {
        return Err(Error::NotApplicable(format!(
            "the clean and corrupted runs give the same logit difference answer − wrong (clean {clean:+.6}, \
             corrupt {corrupt:+.6}): each cell's recovered share, (patched − corrupt) / (clean − corrupt), \
             would divide by zero; choose texts the model tells apart, or another --answer/--wrong"
        )));
    }
    Ok((gap.abs() < SMALL_LOGIT_DIFF_GAP).then(|| {
        format!(
            "the clean and corrupted logit differences differ by only {:.4} (clean {clean:+.4}, corrupt {corrupt:+.4}; \
             below {SMALL_LOGIT_DIFF_GAP}): recovered divides by that gap, so it is a ratio of small numbers \
             and hard to read; texts the model tells apart, or another --answer/--wrong, give a clearer grid",
            gap.abs()
        )
    }))
}

/// The first position where two token lists differ (or the shorter length).
fn first_difference(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Refuses a corrupted text of another token count than the clean one (patching pairs
/// positions), naming where they first differ.
fn check_same_length(clean: &[u32], corrupt: &[u32]) -> Result<()> {
    let n = clean.len();
    if corrupt.len() != n {
        let at = first_difference(clean, corrupt);
        return Err(Error::OutOfRange {
            what: "the corrupted text's token count".into(),
            value: format!(
                "{} (the clean text has {n}; they first differ at position {at})",
                corrupt.len()
            ),
            range: format!(
                "{n}: patching pairs positions, so both texts must be the same number of tokens"
            ),
        });
    }
    Ok(())
}

/// The variants of one layer's patching of `hook` from the clean run's activation `src`: each
/// head's map (`hook_pattern`) or its `hook_z` columns at every position, or each position's row
/// (the corrupted run recomputed from there).
fn patch_variants(
    hook: PatchHook,
    src: &[f32],
    n: usize,
    nh: usize,
    hd: usize,
    dm: usize,
) -> Vec<Variant<'_>> {
    if hook == PatchHook::Pattern {
        // head h's [query, key] map from the clean run
        (0..nh)
            .map(|h| Variant {
                from: 0,
                cols: 0..n * n,
                at: vec![h],
                fill: Fill::From(src),
            })
            .collect()
    } else if hook.per_head() {
        (0..nh)
            .map(|h| Variant {
                from: 0,
                cols: h * hd..(h + 1) * hd,
                at: (0..n).collect(),
                fill: Fill::From(src),
            })
            .collect()
    } else {
        // position p: the corrupted run recomputed from p on, its row p taken from clean
        (0..n)
            .map(|p| Variant {
                from: p,
                cols: 0..dm,
                at: vec![0],
                fill: Fill::From(&src[p * dm..]),
            })
            .collect()
    }
}

/// What to do when the answer and the wrong token are one token, by which of them were given.
fn same_token_advice(opts: &PatchOptions) -> String {
    match (opts.answer.is_some(), opts.wrong.is_some()) {
        (false, false) => "two different tokens (the clean and corrupted texts predict the same top token: pass --answer and --wrong)",
        (true, false) => "two different tokens (--answer is the corrupted run's top token, the default --wrong: pass --wrong)",
        (false, true) => "two different tokens (--wrong is the clean run's top token, the default --answer: pass --answer)",
        (true, true) => "two different tokens (--answer and --wrong name the same token)",
    }
    .into()
}

/// How a patched run is scored: the logit difference answer − wrong at the last position, and
/// how much of the clean run's it recovers from the corrupted run's.
struct LogitDiff {
    answer: u32,
    wrong: u32,
    clean: f32,
    corrupt: f32,
}

impl LogitDiff {
    /// `opts`' answer (default: the clean run's top token) and wrong token (default: the
    /// corrupted run's), refused when they are the same token.
    fn resolve(
        model: &Model,
        opts: &PatchOptions,
        clean_logits: &[f32],
        corrupt_logits: &[f32],
    ) -> Result<LogitDiff> {
        let pick = |t: &Option<Target>, logits: &[f32], flag: &str| match t {
            Some(t) => t.resolve_as(model, logits, flag),
            None => Ok(max_argmax(logits).1 as u32),
        };
        let answer = pick(&opts.answer, clean_logits, "--answer")?;
        let wrong = pick(&opts.wrong, corrupt_logits, "--wrong")?;
        if answer == wrong {
            return Err(Error::OutOfRange {
                what: "--answer and --wrong".into(),
                value: format!("both {answer} ({:?})", model.tokenizer.token_text(answer)),
                range: same_token_advice(opts),
            });
        }
        let diff = |lg: &[f32]| lg[answer as usize] - lg[wrong as usize];
        Ok(LogitDiff {
            answer,
            wrong,
            clean: diff(clean_logits),
            corrupt: diff(corrupt_logits),
        })
    }

    /// The cell of layer `layer`'s `i`-th variant (a head when `per_head`, else a position),
    /// scored from its run's logits.
    fn cell(&self, layer: usize, i: usize, per_head: bool, lg: &[f32]) -> PatchCell {
        let v = lg[self.answer as usize] - lg[self.wrong as usize];
        let (pos, head) = if per_head {
            (None, Some(i))
        } else {
            (Some(i), None)
        };
        PatchCell {
            layer,
            pos,
            head,
            logit_diff: v,
            recovered: (v - self.corrupt) / (self.clean - self.corrupt),
        }
    }
}

/// Activation patching: for every layer and position (or head, for `z`), the corrupted run with
/// that activation taken from the clean run, scored by the logit difference answer − wrong at
/// the last position. `tick(done, total)` reports progress in variants.
pub fn patch(
    model: &Model,
    clean: &[u32],
    corrupt: &[u32],
    opts: &PatchOptions,
    mut tick: impl FnMut(usize, usize),
) -> Result<PatchReport> {
    let d = &model.dims;
    let n = clean.len();
    check_same_length(clean, corrupt)?;
    let hook = opts.hook.hook();
    let (_, clean_logits, clean_cache) = Runner::clean(model, clean, &[hook])?;
    let (mut runner, corrupt_logits, _) = Runner::clean(model, corrupt, &[])?;
    runner.passes += 1;
    runner.layer_rows += d.n_layers * n;
    runner.batch_rows = opts.batch_rows.max(1);
    let score = LogitDiff::resolve(model, opts, &clean_logits, &corrupt_logits)?;
    let warnings = check_logit_diff_gap(score.clean, score.corrupt)?
        .into_iter()
        .collect();
    let (nh, hd, dm) = (d.n_heads, d.head_dim, d.d_model);
    let per_head = opts.hook.per_head();
    let total = d.n_layers * if per_head { nh } else { n };
    let mut results = Vec::with_capacity(total);
    let mut done = 0;
    for l in 0..d.n_layers {
        let src = &clean_cache
            .get(l, hook)
            .expect("the clean run captured the hook at every layer")
            .data;
        let variants = patch_variants(opts.hook, src, n, nh, hd, dm);
        let outs = runner.run(l, hook, &variants, |k| tick(done + k, total))?;
        done += variants.len();
        for (i, lg) in outs.iter().enumerate() {
            results.push(score.cell(l, i, per_head, lg));
        }
    }
    Ok(PatchReport {
        model: model.info.name.clone(),
        hook: crate::model::capture::hook_name(0, hook)
            .trim_start_matches("blocks.0.")
            .to_string(),
        clean: TokenRef::all(model, clean),
        corrupt: TokenRef::all(model, corrupt),
        answer: TokenRef::of(model, score.answer),
        wrong: TokenRef::of(model, score.wrong),
        clean_logit_diff: score.clean,
        corrupt_logit_diff: score.corrupt,
        results,
        forward_passes: runner.passes,
        layer_rows: runner.layer_rows,
        layer_rows_from_scratch: (total + 2) * d.n_layers * n,
        warnings,
    })
}
