//! Is attention an explanation? Measure it: occlude each input token three ways and see how much
//! the model's log-probability of its target changes, then ask how well attention-based rankings
//! (raw attention, mean over layers, rollout, single heads) agree with those changes.
//!
//! - Leave-one-out: delete the token. Replacement: swap it for a neutral token. Knockout: hide
//!   it as a key in every layer and head (positions unchanged). Each gives Δ log p(target) =
//!   occluded − full; importance is −Δ (the drop).
//! - Attention rollout [Abnar & Zuidema 2020, arXiv:2005.00928]: per layer
//!   `A = 0.5·mean_h(P) + 0.5·I`, rows renormalized, multiplied across layers.
//! - Norm-based attention [Kobayashi et al. 2020, arXiv:2004.10102]: `‖Σₕ αʰᵢⱼ·W_Oʰ vⱼ‖`, what
//!   key j moves into the query's residual stream (last layer; and shares averaged over layers).
//! - Metrics: Spearman ρ, Kendall τ-b, top-1 agreement; comprehensiveness and sufficiency at
//!   k = 1, 3, 5 [DeYoung et al. 2020, ERASER, arXiv:1911.03429]:
//!   `comp@k = p(full) − p(without top-k)`, `suff@k = p(full) − p(only top-k)`.
//!
//! Runs reuse the keys and values of the unchanged prefix, so each occlusion recomputes only
//! the positions from the occluded one on, and they run many to a forward
//! ([`crate::model::Model::forward_batch`]): a short variant alone is bound by reading the weights.

use super::enc_faith::EncFaithReport;
use super::enc_target::EncoderTarget;
use super::norms::{mixed_norms, shares, Values};
use super::occlusion::{full_run, without_and_only, without_positions, Occlusions};
use super::scores::{check_steps, ranked_scores};
use super::vocab::{best_of, kendall_tau_b, mean_rows, permutation_p, rollout, single_token};
use super::vocab::{spearman, top_positions, AtK, Best, ByMethod, MetricRow, Target};
use crate::model::backward::Metric;
use crate::model::capture::{AttnCache, CaptureSpec};
use crate::model::forward::{log_softmax, KvPrefix};
use crate::model::{Model, Result};
use crate::reference::Rng;
use rayon::prelude::*;
use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct TargetInfo {
    pub id: u32,
    pub token: String,
    pub logprob: f32,
    pub prob: f32,
}

#[derive(Clone, Debug, Serialize)]
pub struct TokenRow {
    pub pos: usize,
    pub id: u32,
    pub text: String,
    pub attention_last: f32,
    pub attention_mean: f32,
    pub rollout: f32,
    /// norm-based attention of the last layer, `‖Σₕ αʰ·W_Oʰ vⱼ‖` (Kobayashi et al. 2020)
    pub norm_last: f32,
    /// norm-based attention, each layer's row as shares of its total, averaged over layers
    pub norm_mean: f32,
    /// Δ log p(target) when the token is deleted (None when the text has one token only).
    pub loo: Option<f32>,
    pub replace: f32,
    /// Δ log p(target) when the token is hidden as a key in every layer and head; None for the
    /// query token itself, which always sees itself (it cannot be knocked out).
    pub knockout: Option<f32>,
    /// Each method's score that ran ([`super::vocab::Method`]'s order and keys: `gradient`,
    /// `grad_x_input`, `integrated_gradients`, `attention_x_gradient`, `attnlrp`,
    /// `value_zeroing`, `alti_logit`; none when gradients were not asked for), from
    /// [`super::scores::ranked_scores`].
    #[serde(flatten)]
    pub methods: ByMethod<f32>,
}

/// `faithfulness`'s report: how well attention, gradients and the other explanations rank the
/// tokens that matter, against occlusion.
#[derive(Clone, Debug, Serialize)]
pub struct FaithReport {
    /// the model's name
    pub model: String,
    /// the precision it ran at (`exact` or `fast`)
    pub precision: String,
    /// the token whose probability the rankings are measured on
    pub target: TargetInfo,
    /// what an occluded token is replaced with
    pub replacement: TargetInfoLite,
    /// the query position
    pub query: usize,
    /// each token's scores under every explanation
    pub tokens: Vec<TokenRow>,
    /// each explanation's agreement with occlusion
    pub metrics: Vec<MetricRow>,
    /// the forward passes run
    pub forward_passes: usize,
    /// Integrated gradients' completeness gap `Σ scores − (f(x) − f(0))`, when they ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ig_completeness_gap: Option<f32>,
    /// AttnLRP's conservation error `Σ relevances − logit(target)`, when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attnlrp_conservation_error: Option<f32>,
    /// The explanation (every ranking but the single heads and the random one) with the highest
    /// Spearman ρ against deletion over all tokens.
    pub most_faithful: Option<Best>,
    /// the result in one sentence
    pub conclusion: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct TargetInfoLite {
    pub id: u32,
    pub token: String,
}

/// How a faithfulness run ranks (the target, the replacement token, the seed, which gradient
/// methods): what a [`FaithRequest`] comes to, and what `corpus` and `explain` ask for alone.
#[derive(Clone, Debug)]
pub struct FaithSettings {
    pub target: Target,
    /// Text of the neutral replacement token (must be one token).
    pub replacement: String,
    pub seed: u64,
    /// Also rank by gradient, gradient × input and attention × gradient (one backward), AttnLRP
    /// (one backward), value zeroing and ALTI-Logit.
    pub gradients: bool,
    /// With `gradients`, integrated gradients too, with this many midpoints (0: not run).
    pub ig_steps: usize,
}

impl FaithSettings {
    /// The attention rankings only, as `corpus` and `explain` run them: next token, `" "` as
    /// the replacement, seed 7.
    pub fn attention_only() -> Self {
        FaithSettings {
            target: Target::Next,
            replacement: " ".into(),
            seed: 7,
            gradients: false,
            ig_steps: 0,
        }
    }
}

/// Which gradient-based rankings [`faithfulness`] adds beside the attention ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gradients {
    /// Gradient, gradient × input and attention × gradient (one backward), AttnLRP, value
    /// zeroing, ALTI-Logit, and integrated gradients (`steps` backwards).
    All,
    /// All but integrated gradients.
    Fast,
    /// No gradient-based ranking.
    None,
}

impl Gradients {
    /// `all`, `fast` or `none`.
    pub fn name(self) -> &'static str {
        match self {
            Gradients::All => "all",
            Gradients::Fast => "fast",
            Gradients::None => "none",
        }
    }
}

/// What `faithfulness` is asked: the CLI's flags, Python's `model.faithfulness` arguments.
#[derive(Clone, Debug)]
pub struct FaithRequest {
    /// The target: the model's next token, an id or a token's text; on an encoder `next` or
    /// `embedding` (the sentence embedding) or `cls` (the \[CLS\] vector).
    pub target: Target,
    /// The neutral token swapped in by the replacement occlusion (one token).
    pub replacement: String,
    /// The seed of the random baseline ranking.
    pub seed: u64,
    /// The gradient-based rankings; `None`: all on a decoder, none on an encoder (whose
    /// backward attnscope does not have: `All` and `Fast` are refused there).
    pub gradients: Option<Gradients>,
    /// Integrated gradients' midpoints (1..=4096).
    pub steps: usize,
}

impl Default for FaithRequest {
    /// The CLI's defaults: the next token, `" "`, seed 7, the default gradients, 32 steps.
    fn default() -> Self {
        FaithRequest {
            target: Target::Next,
            replacement: " ".into(),
            seed: 7,
            gradients: None,
            steps: 32,
        }
    }
}

/// A faithfulness report: a decoder's (against occlusion, for the target's log-probability) or
/// an encoder's (against deletion, for the sentence embedding or the \[CLS\] vector). Serialized
/// as the report itself (`faithfulness --json`).
#[derive(Clone, Debug, Serialize)]
#[serde(untagged)]
pub enum Faithfulness {
    /// A decoder's report.
    Decoder(FaithReport),
    /// An encoder's report.
    Encoder(EncFaithReport),
}

/// `attnscope faithfulness` on `tokens`: the request checked against the model (the steps'
/// range; gradients refused on an encoder), then the decoder's or the encoder's report.
/// `tick(done, total)` after each forward.
pub fn faithfulness(
    model: &Model,
    tokens: &[u32],
    req: &FaithRequest,
    tick: &mut dyn FnMut(usize, usize),
) -> Result<Faithfulness> {
    check_steps(req.steps)?;
    if model.is_encoder() {
        if let Some(g @ (Gradients::All | Gradients::Fast)) = req.gradients {
            return Err(crate::model::Error::NotApplicable(format!(
                "--gradients {} is not available on an encoder ({}): attnscope's backward is decoder-only (it differentiates a next-token log-probability); use --gradients none, or leave it out",
                g.name(),
                model.info.name
            )));
        }
        let target = EncoderTarget::of(model, &req.target)?;
        return Ok(Faithfulness::Encoder(super::enc_faith::run(
            model, tokens, target, req.seed, tick,
        )?));
    }
    let gradients = req.gradients.unwrap_or(Gradients::All);
    let opts = FaithSettings {
        target: req.target.clone(),
        replacement: req.replacement.clone(),
        seed: req.seed,
        gradients: gradients != Gradients::None,
        ig_steps: if gradients == Gradients::All {
            req.steps
        } else {
            0
        },
    };
    Ok(Faithfulness::Decoder(run(model, tokens, &opts, tick)?))
}

/// Runs every forward needed and computes the report. `tick(done, total)` reports progress.
pub fn run(
    model: &Model,
    tokens: &[u32],
    opts: &FaithSettings,
    mut tick: impl FnMut(usize, usize),
) -> Result<FaithReport> {
    if model.is_encoder() {
        return Err(crate::model::Error::NotApplicable(format!(
            "faithfulness ranks explanations against a next-token log-probability, and {} is an encoder (no next-token prediction); `analysis::enc_faith::run` (what `attnscope faithfulness` runs on an encoder) ranks against deletion of the sentence embedding or the [CLS] vector instead",
            model.info.name
        )));
    }
    let n = tokens.len();
    let q = n - 1;
    // 1. the full run: patterns of every layer and head, keys/values for prefix reuse
    let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
    let (logits, kv) = full_run(model, tokens, &mut cache)?;
    let full_lp = log_softmax(&logits);
    let target_id = opts.target.resolve(model, &logits)?;
    let replacement = single_token(model, &opts.replacement, "--replace-with")?;
    let base = full_lp[target_id as usize];
    let mut runner = Occlusions::new(model, tokens, &kv, Metric::LogProb(Some(target_id)));
    // 2. the explanations' rankings, from the full run (and the backward)
    let ex = Explanations::of(model, tokens, &cache, &kv, opts, target_id)?;
    let rankings = ex.rankings(model, &cache, n, opts.seed)?;
    // 3. every occlusion the report needs, run in batches (the loops below then read them)
    let wanted = occlusions_wanted(tokens, replacement, &rankings);
    runner.prefetch(&wanted, &mut tick)?;
    let rows = token_rows(&mut runner, &ex, replacement, base)?;
    // 4. metrics
    let p_full = base.exp();
    let metrics = metric_rows(&mut runner, &rankings, &rows, p_full)?;
    tick(runner.passes, runner.passes);
    let target = TargetInfo {
        id: target_id,
        token: model.tokenizer.token_text(target_id),
        logprob: base,
        prob: p_full,
    };
    let most_faithful = most_faithful(&metrics);
    let mut conclusion = conclude(&rows, &metrics, &target);
    if let (true, Some(b)) = (opts.gradients, &most_faithful) {
        conclusion += &format!(
            " Of every explanation, {} tracks deletion best here (ρ = {:+.2}).",
            b.ranking, b.spearman
        );
    }
    Ok(FaithReport {
        model: model.info.name.clone(),
        precision: model.info.precision.name().into(),
        target,
        replacement: TargetInfoLite {
            id: replacement,
            token: model.tokenizer.token_text(replacement),
        },
        query: q,
        tokens: rows,
        metrics,
        forward_passes: runner.passes,
        ig_completeness_gap: ex.ig_gap,
        attnlrp_conservation_error: ex.lrp_err,
        most_faithful,
        conclusion,
    })
}

/// The k of comprehensiveness and sufficiency at k.
const TOP_KS: [usize; 3] = [1, 3, 5];

/// Every explanation's score per position of the last query: the attention ones from the full
/// run's patterns and values, and (with `FaithSettings::gradients`) the gradient-based and mixing
/// ones of the same target.
struct Explanations {
    attention_last: Vec<f32>,
    attention_mean: Vec<f32>,
    rollout: Vec<f32>,
    norm_last: Vec<f32>,
    norm_mean: Vec<f32>,
    /// every attribution method's scores that ran, in [`super::vocab::Method::ALL`]'s order
    methods: ByMethod<Vec<f32>>,
    /// integrated gradients' completeness gap, when they ran
    ig_gap: Option<f32>,
    /// AttnLRP's conservation error, when it ran
    lrp_err: Option<f32>,
}

impl Explanations {
    /// The explanations of `target_id` at the last position, from the full run's `cache` (every
    /// layer's patterns) and `kv` (its values), plus one backward (and IG's steps) and the
    /// mixing methods when `opts.gradients`.
    fn of(
        model: &Model,
        tokens: &[u32],
        cache: &AttnCache,
        kv: &KvPrefix,
        opts: &FaithSettings,
        target_id: u32,
    ) -> Result<Self> {
        let (n, d) = (tokens.len(), &model.dims);
        let q = n - 1;
        let head_means: Vec<Vec<f32>> = (0..d.n_layers)
            .map(|l| {
                let p = cache.pattern(l).expect("all layers captured");
                mean_rows((0..d.n_heads).map(|h| &p.data[h * n * n..][..n * n]))
            })
            .collect();
        // norm-based attention [Kobayashi et al. 2020]: what each key moves, per layer
        let norm_rows: Vec<Vec<f32>> = (0..d.n_layers)
            .map(|l| {
                let p = cache.pattern(l).expect("all layers captured");
                let alphas: Vec<&[f32]> = (0..d.n_heads).map(|h| p.row(h, q)).collect();
                let values = kv.values(l);
                let v = Values::head_major(&values, n, d.n_kv_heads, d.head_dim);
                mixed_norms(model, l, &v, &alphas, n)
            })
            .collect();
        let norm_shares: Vec<Vec<f32>> = norm_rows.iter().map(|r| shares(r)).collect();
        let mut ex = Explanations {
            attention_last: head_means[d.n_layers - 1][q * n..][..n].to_vec(),
            attention_mean: mean_rows(head_means.iter().map(|hm| &hm[q * n..][..n])),
            rollout: rollout(&head_means, n, q),
            norm_last: norm_rows[d.n_layers - 1].clone(),
            norm_mean: mean_rows(norm_shares.iter().map(Vec::as_slice)),
            methods: ByMethod::default(),
            ig_gap: None,
            lrp_err: None,
        };
        if opts.gradients {
            ex.add_gradients(model, tokens, cache, opts.ig_steps, target_id)?;
        }
        Ok(ex)
    }

    /// The attribution methods' explanations of the same target
    /// ([`super::scores::ranked_scores`]: one backward, IG's steps when `ig_steps` > 0, AttnLRP,
    /// value zeroing, ALTI-Logit).
    fn add_gradients(
        &mut self,
        model: &Model,
        tokens: &[u32],
        cache: &AttnCache,
        ig_steps: usize,
        target_id: u32,
    ) -> Result<()> {
        let (n, d) = (tokens.len(), &model.dims);
        let pattern: Vec<Vec<f32>> = (0..d.n_layers)
            .map(|l| {
                let p = cache.pattern(l).expect("all layers captured");
                (0..d.n_heads)
                    .flat_map(|h| p.row(h, n - 1).to_vec())
                    .collect()
            })
            .collect();
        let r = ranked_scores(model, tokens, &pattern, ig_steps, target_id)?;
        (self.methods, self.ig_gap, self.lrp_err) = (r.scores, r.ig_gap, r.lrp_err);
        Ok(())
    }

    /// Every ranking the metrics compare, by name: the attention ones, the gradient-based ones
    /// that ran (each checked finite), each head of the last layer, and a seeded random one.
    fn rankings(
        &self,
        model: &Model,
        cache: &AttnCache,
        n: usize,
        seed: u64,
    ) -> Result<Vec<(String, Vec<f32>)>> {
        let mut rankings: Vec<(String, Vec<f32>)> = vec![
            ("attention_last".into(), self.attention_last.clone()),
            ("attention_mean".into(), self.attention_mean.clone()),
            ("rollout".into(), self.rollout.clone()),
            ("norm_last".into(), self.norm_last.clone()),
            ("norm_mean".into(), self.norm_mean.clone()),
        ];
        for (m, v) in self.methods.iter() {
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                return Err(crate::model::Error::NonFinite {
                    what: format!("the {} score of position {i}", m.key()),
                    layer: None,
                });
            }
            rankings.push((m.key(), v.clone()));
        }
        let d = &model.dims;
        let last_p = cache.pattern(d.n_layers - 1).expect("captured");
        for h in 0..d.n_heads {
            rankings.push((format!("head_{h}"), last_p.row(h, n - 1).to_vec()));
        }
        let mut rng = Rng::new(seed);
        rankings.push((
            "random".into(),
            (0..n).map(|_| rng.uniform() as f32).collect(),
        ));
        Ok(rankings)
    }
}

/// The candidates of the metrics: every position, or every position but the first.
fn candidates_of(n: usize, without_first: bool) -> Vec<usize> {
    (if without_first { 1 } else { 0 }..n).collect()
}

/// Every token variant the report reads (with the key knocked out, if any): each position
/// deleted, replaced by `replacement` and knocked out, and each ranking's top-k deleted and
/// kept alone, over all positions and without the first.
fn occlusions_wanted(
    tokens: &[u32],
    replacement: u32,
    rankings: &[(String, Vec<f32>)],
) -> Vec<(Vec<u32>, Option<usize>)> {
    let n = tokens.len();
    let q = n - 1;
    let mut wanted: Vec<(Vec<u32>, Option<usize>)> = Vec::new();
    for j in 0..n {
        if n > 1 {
            wanted.push((without_positions(tokens, &[j]), None));
        }
        let mut rep = tokens.to_vec();
        rep[j] = replacement;
        wanted.push((rep, None));
        if j != q {
            wanted.push((tokens.to_vec(), Some(j)));
        }
    }
    for without_first in [false, true] {
        let candidates = candidates_of(n, without_first);
        for (_, scores) in rankings {
            for &k in TOP_KS.iter().filter(|&&k| k <= candidates.len()) {
                let top = top_positions(scores, &candidates, k);
                let (without, only) = without_and_only(tokens, &top, without_first);
                if !without.is_empty() {
                    wanted.push((without, None));
                }
                wanted.push((only, None));
            }
        }
    }
    wanted
}

/// Each position's row: its explanations' scores and the three deletion truths (Δ log p of the
/// target when it is deleted, replaced by `replacement`, knocked out), against `base`.
fn token_rows(
    runner: &mut Occlusions,
    ex: &Explanations,
    replacement: u32,
    base: f32,
) -> Result<Vec<TokenRow>> {
    let (model, tokens) = (runner.model, runner.tokens);
    let n = tokens.len();
    let q = n - 1;
    let mut rows = Vec::with_capacity(n);
    for j in 0..n {
        let loo = if n > 1 {
            Some(runner.logprob(&without_positions(tokens, &[j]), None)? - base)
        } else {
            None
        };
        let mut rep = tokens.to_vec();
        rep[j] = replacement;
        let replace = runner.logprob(&rep, None)? - base;
        let knockout = if j == q {
            None
        } else {
            Some(runner.logprob(tokens, Some(j))? - base)
        };
        rows.push(TokenRow {
            pos: j,
            id: tokens[j],
            text: model.tokenizer.token_text(tokens[j]),
            attention_last: ex.attention_last[j],
            attention_mean: ex.attention_mean[j],
            rollout: ex.rollout[j],
            norm_last: ex.norm_last[j],
            norm_mean: ex.norm_mean[j],
            loo,
            replace,
            knockout,
            methods: ex.methods.map(|v| v[j]),
        });
    }
    Ok(rows)
}

/// Comprehensiveness and sufficiency at each k of [`TOP_KS`] for `scores`' top positions among
/// `candidates` (None where k is more than there are), as drops of the target's probability
/// from `p_full`.
fn at_k(
    runner: &mut Occlusions,
    scores: &[f32],
    candidates: &[usize],
    without_first: bool,
    p_full: f32,
) -> Result<(AtK, AtK)> {
    let tokens = runner.tokens;
    let (mut comp, mut suff) = (AtK::default(), AtK::default());
    for &k in &TOP_KS {
        let (c, s) = if k <= candidates.len() {
            let top = top_positions(scores, candidates, k);
            let (without, only) = without_and_only(tokens, &top, without_first);
            let c = if without.is_empty() {
                None
            } else {
                Some(p_full - runner.logprob(&without, None)?.exp())
            };
            let s = Some(p_full - runner.logprob(&only, None)?.exp());
            (c, s)
        } else {
            (None, None)
        };
        match k {
            1 => (comp.k1, suff.k1) = (c, s),
            3 => (comp.k3, suff.k3) = (c, s),
            _ => (comp.k5, suff.k5) = (c, s),
        }
    }
    Ok((comp, suff))
}

/// Each ranking's agreement with each deletion truth (`loo`, `replace`, `knockout`), over all
/// positions and without the first: Spearman's ρ, Kendall's τ-b and their permutation p-values,
/// top-1 agreement, and comprehensiveness and sufficiency at k.
fn metric_rows(
    runner: &mut Occlusions,
    rankings: &[(String, Vec<f32>)],
    rows: &[TokenRow],
    p_full: f32,
) -> Result<Vec<MetricRow>> {
    let n = runner.tokens.len();
    let mut metrics = Vec::new();
    // each metric row's (scores, importances), for its p-values
    let mut pending: Vec<(Vec<f64>, Vec<f64>)> = Vec::new();
    for without_first in [false, true] {
        let candidates = candidates_of(n, without_first);
        for (name, scores) in rankings {
            let (comp, suff) = at_k(runner, scores, &candidates, without_first, p_full)?;
            for truth in ["loo", "replace", "knockout"] {
                let (sc, imp) = scores_and_importances(scores, rows, &candidates, truth);
                metrics.push(MetricRow {
                    ranking: name.clone(),
                    truth: truth.into(),
                    n: sc.len(),
                    spearman: spearman(&sc, &imp),
                    // the permutation p-values below, every row's on every core
                    spearman_p: None,
                    kendall: kendall_tau_b(&sc, &imp),
                    kendall_p: None,
                    top1: top1_agrees(&sc, &imp),
                    comprehensiveness: comp.clone(),
                    sufficiency: suff.clone(),
                    without_first,
                });
                pending.push((sc, imp));
            }
        }
    }
    // each p-value from its own seeded permutations: the same numbers in any order
    let ps: Vec<(Option<f64>, Option<f64>)> = pending
        .par_iter()
        .map(|(sc, imp)| {
            (
                permutation_p(sc, imp, spearman),
                permutation_p(sc, imp, kendall_tau_b),
            )
        })
        .collect();
    for (m, (sp, kp)) in metrics.iter_mut().zip(ps) {
        (m.spearman_p, m.kendall_p) = (sp, kp);
    }
    Ok(metrics)
}

/// A ranking's scores and the importances a deletion `truth` gives (minus its Δ log p), over the
/// `candidates` that have that truth (the query cannot be knocked out: it sees itself).
fn scores_and_importances(
    scores: &[f32],
    rows: &[TokenRow],
    candidates: &[usize],
    truth: &str,
) -> (Vec<f64>, Vec<f64>) {
    let cands: Vec<usize> = candidates
        .iter()
        .copied()
        .filter(|&i| truth != "knockout" || rows[i].knockout.is_some())
        .collect();
    let imp: Vec<f64> = cands
        .iter()
        .map(|&i| {
            let r = &rows[i];
            -(match truth {
                "loo" => r.loo.unwrap_or(0.0),
                "replace" => r.replace,
                _ => r.knockout.unwrap_or(0.0),
            }) as f64
        })
        .collect();
    let sc: Vec<f64> = cands.iter().map(|&i| scores[i] as f64).collect();
    (sc, imp)
}

/// Whether the top-scored candidate is the most important one (ties to the earliest); None
/// without candidates.
fn top1_agrees(sc: &[f64], imp: &[f64]) -> Option<bool> {
    let first_max = |v: &[f64]| {
        v.iter()
            .enumerate()
            .max_by(|x, y| x.1.total_cmp(y.1).then(y.0.cmp(&x.0)))
            .map(|x| x.0)
    };
    (!sc.is_empty()).then(|| first_max(sc) == first_max(imp))
}

/// The explanation with the highest Spearman ρ against deletion over all positions (every
/// ranking but the single heads and the random one).
fn most_faithful(metrics: &[MetricRow]) -> Option<Best> {
    best_of(metrics.iter().filter(|m| {
        m.truth == "loo"
            && !m.without_first
            && m.ranking != "random"
            && !m.ranking.starts_with("head_")
    }))
}

/// The report's conclusion: the most attended token against the one whose deletion matters
/// most, how last-layer attention, rollout and norm-based attention rank against leave-one-out
/// (beside a random ranking), and a verdict.
fn conclude(rows: &[TokenRow], metrics: &[MetricRow], target: &TargetInfo) -> String {
    let find = |ranking: &str, truth: &str, wf: bool| {
        metrics
            .iter()
            .find(|m| m.ranking == ranking && m.truth == truth && m.without_first == wf)
    };
    let fmt = |x: Option<f64>| {
        x.map(|v| format!("{v:+.2}"))
            .unwrap_or_else(|| "n/a".into())
    };
    let (most_attended, most_important) = (most_attended(rows), most_important(rows));
    let (al, ro, ra) = (
        find("attention_last", "loo", false),
        find("rollout", "loo", false),
        find("random", "loo", false),
    );
    let alw = find("attention_last", "loo", true);
    let nl = find("norm_last", "loo", false);
    let norm_share = norm_share(rows, most_attended);
    let rho = al.and_then(|m| m.spearman);
    let rand_rho = ra.and_then(|m| m.spearman).unwrap_or(0.0);
    let same = most_attended.pos == most_important.pos;
    let verdict = verdict(rho, rand_rho, same);
    format!(
        "Target \"{}\" (p = {:.4}). The last layer attends most to {} \"{}\" (weight {:.3}); deleting it changes log p by {:+.3}. The token whose deletion matters most is {} \"{}\" (Δ log p = {:+.3}){}. Against leave-one-out, last-layer attention has Spearman ρ = {} ({} agreement; without the first token {}), rollout {}, norm-based attention {} (it gives {} \"{}\" {:.1}% of what the last layer moves), a random ranking {}. {verdict}",
        target.token,
        target.prob,
        most_attended.pos,
        most_attended.text,
        most_attended.attention_last,
        most_attended.loo.unwrap_or(f32::NAN),
        most_important.pos,
        most_important.text,
        most_important.loo.unwrap_or(f32::NAN),
        if same { ", the same token" } else { "" },
        fmt(rho),
        strength(rho),
        fmt(alw.and_then(|m| m.spearman)),
        fmt(ro.and_then(|m| m.spearman)),
        fmt(nl.and_then(|m| m.spearman)),
        most_attended.pos,
        most_attended.text,
        norm_share * 100.0,
        fmt(ra.and_then(|m| m.spearman)),
    )
}

/// The token the last layer attends to most (ties to the earliest).
fn most_attended(rows: &[TokenRow]) -> &TokenRow {
    rows.iter()
        .max_by(|a, b| {
            a.attention_last
                .total_cmp(&b.attention_last)
                .then(b.pos.cmp(&a.pos))
        })
        .expect("at least one token")
}

/// The token whose deletion lowers log p(target) most (ties to the earliest).
fn most_important(rows: &[TokenRow]) -> &TokenRow {
    rows.iter()
        .max_by(|a, b| {
            (-a.loo.unwrap_or(0.0))
                .total_cmp(&-b.loo.unwrap_or(0.0))
                .then(b.pos.cmp(&a.pos))
        })
        .expect("at least one token")
}

/// `row`'s share of the last layer's norm-based attention over every token (0 when it moves
/// nothing).
fn norm_share(rows: &[TokenRow], row: &TokenRow) -> f32 {
    let norm_total: f32 = rows.iter().map(|r| r.norm_last).sum();
    if norm_total > 0.0 {
        row.norm_last / norm_total
    } else {
        0.0
    }
}

/// A correlation's strength in words.
fn strength(r: Option<f64>) -> &'static str {
    match r {
        Some(v) if v >= 0.7 => "strong",
        Some(v) if v >= 0.4 => "moderate",
        Some(v) if v >= 0.2 => "weak",
        Some(_) => "no",
        None => "no measurable",
    }
}

/// The conclusion's verdict from last-layer attention's ρ against leave-one-out, the random
/// ranking's, and whether the most attended token is the most important one (`same`).
fn verdict(rho: Option<f64>, rand_rho: f64, same: bool) -> String {
    match rho {
        Some(r) if r >= 0.7 && same => "Here attention ranks the tokens much as occlusion does, but that is a finding about this sentence, not a guarantee.".to_string(),
        Some(r) if r > rand_rho + 0.2 => format!(
            "Attention beats the random ranking by {:.2} in ρ, yet {} of the importance order is unexplained: read the weights as a hint, not as importance.",
            r - rand_rho,
            if r < 0.7 { "much" } else { "some" }
        ),
        _ => "Attention does no better than a random ranking here: high weight is not importance.".to_string(),
    }
}
