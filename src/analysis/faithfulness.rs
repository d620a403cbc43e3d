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

use super::norms::{mixed_norms, shares, Values};
use crate::model::backward::Metric;
use crate::model::capture::{AttnCache, CaptureSpec, Observer};
use crate::model::forward::{log_softmax, KvPrefix, RunOptions, Segment};
use crate::model::{Model, Result};
use crate::reference::Rng;
use rayon::prelude::*;
use serde::Serialize;
use std::collections::HashMap;

/// Ranks with ties averaged (1-based), as Spearman's ρ needs.
pub fn average_ranks(v: &[f64]) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[a].total_cmp(&v[b]));
    let mut ranks = vec![0.0; v.len()];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && v[idx[j + 1]] == v[idx[i]] {
            j += 1;
        }
        let r = (i + j) as f64 / 2.0 + 1.0;
        for &k in &idx[i..=j] {
            ranks[k] = r;
        }
        i = j + 1;
    }
    ranks
}

fn pearson(a: &[f64], b: &[f64]) -> Option<f64> {
    let n = a.len() as f64;
    let (ma, mb) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
    let cov: f64 = a.iter().zip(b).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let va: f64 = a.iter().map(|x| (x - ma).powi(2)).sum();
    let vb: f64 = b.iter().map(|y| (y - mb).powi(2)).sum();
    (va > 0.0 && vb > 0.0).then(|| cov / (va * vb).sqrt())
}

/// Spearman's rank correlation; `None` when either side is constant or shorter than 2.
pub fn spearman(a: &[f64], b: &[f64]) -> Option<f64> {
    if a.len() < 2 {
        return None;
    }
    pearson(&average_ranks(a), &average_ranks(b))
}

/// The two-sided permutation p-value of `stat(a, b)`: the share of orderings of `b` whose
/// statistic is at least as far from 0 as the observed one. Exact (every permutation) for n ≤ 7;
/// above, 2,000 permutations from a fixed seed, p = (hits + 1) / (2,000 + 1).
pub fn permutation_p(a: &[f64], b: &[f64], stat: fn(&[f64], &[f64]) -> Option<f64>) -> Option<f64> {
    let obs = stat(a, b)?.abs() - 1e-12;
    let n = b.len();
    let mut perm: Vec<f64> = b.to_vec();
    if n <= 7 {
        // Heap's algorithm over every ordering
        let (mut hits, mut total) = (0usize, 0usize);
        let mut c = vec![0usize; n];
        let mut visit = |p: &[f64]| {
            total += 1;
            if stat(a, p).is_some_and(|v| v.abs() >= obs) {
                hits += 1;
            }
        };
        visit(&perm);
        let mut i = 0;
        while i < n {
            if c[i] < i {
                if i % 2 == 0 {
                    perm.swap(0, i)
                } else {
                    perm.swap(c[i], i)
                }
                visit(&perm);
                c[i] += 1;
                i = 0;
            } else {
                c[i] = 0;
                i += 1;
            }
        }
        return Some(hits as f64 / total as f64);
    }
    let mut rng = crate::reference::Rng::new(20260);
    let mut hits = 0usize;
    const B: usize = 2000;
    for _ in 0..B {
        for i in (1..n).rev() {
            perm.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        if stat(a, &perm).is_some_and(|v| v.abs() >= obs) {
            hits += 1;
        }
    }
    Some((hits + 1) as f64 / (B + 1) as f64)
}

/// Kendall's τ-b (ties corrected); `None` when either side is constant or shorter than 2.
///
/// Counted in O(n log n) (Knight 1966: sort by `a`, then count `b`'s inversions by merge sort),
/// the same integer counts of concordant, discordant and tied pairs as comparing every pair
/// ([`kendall_tau_b_pairs`]), so the same value bit for bit; `faithfulness`'s permutation
/// p-values take 2,000 of them per metric row, which every pair made seconds at 200 tokens.
/// Non-finite values go to the pairwise count (whose comparisons define how they count).
pub fn kendall_tau_b(a: &[f64], b: &[f64]) -> Option<f64> {
    let n = a.len();
    if n != b.len() || !a.iter().chain(b).all(|x| x.is_finite()) {
        return kendall_tau_b_pairs(a, b);
    }
    // pairs tied in a run of equal values (== , so -0.0 ties 0.0 as in the pairwise count)
    let tied = |sorted: &mut dyn Iterator<Item = f64>| -> i64 {
        let (mut total, mut run, mut prev) = (0i64, 0i64, None::<f64>);
        for x in sorted {
            if prev == Some(x) {
                run += 1;
            } else {
                total += run * (run - 1) / 2;
                run = 1;
            }
            prev = Some(x);
        }
        total + run * (run - 1) / 2
    };
    let cmp = |x: f64, y: f64| x.partial_cmp(&y).expect("finite");
    let mut idx: Vec<usize> = (0..n).collect();
    idx.sort_unstable_by(|&i, &j| cmp(a[i], a[j]).then(cmp(b[i], b[j])));
    let t_a = tied(&mut idx.iter().map(|&i| a[i]));
    // pairs tied in both: runs of equal (a, b) in that order
    let t_ab = {
        let (mut total, mut run) = (0i64, 0i64);
        for w in 0..n {
            if w > 0 && a[idx[w]] == a[idx[w - 1]] && b[idx[w]] == b[idx[w - 1]] {
                run += 1;
            } else {
                total += run * (run - 1) / 2;
                run = 1;
            }
        }
        total + run * (run - 1) / 2
    };
    // b in a's order: its inversions (strictly greater before smaller) are the discordant pairs
    let mut v: Vec<f64> = idx.iter().map(|&i| b[i]).collect();
    let mut buf = vec![0f64; n];
    let disc = merge_inversions(&mut v, &mut buf);
    let t_b = tied(&mut v.iter().copied());
    let n0 = (n as i64) * (n as i64 - 1) / 2;
    // conc + disc = n0 − t_a − t_b + t_ab: every pair tied in neither
    let conc = n0 - t_a - t_b + t_ab - disc;
    let (ties_a, ties_b) = (t_a - t_ab, t_b - t_ab);
    let denom = (((conc + disc + ties_a) * (conc + disc + ties_b)) as f64).sqrt();
    (n >= 2 && denom > 0.0).then(|| (conc - disc) as f64 / denom)
}

/// Sorts `v` ascending (stable merge sort) and returns how many pairs `i < j` had
/// `v[i] > v[j]` (equal values are not inversions).
fn merge_inversions(v: &mut [f64], buf: &mut [f64]) -> i64 {
    let n = v.len();
    if n < 2 {
        return 0;
    }
    let mid = n / 2;
    let mut inv = {
        let (l, r) = v.split_at_mut(mid);
        let (bl, br) = buf.split_at_mut(mid);
        merge_inversions(l, bl) + merge_inversions(r, br)
    };
    let (mut i, mut j, mut k) = (0, mid, 0);
    while i < mid && j < n {
        if v[j] < v[i] {
            // v[j] is smaller than every value left in the left half
            inv += (mid - i) as i64;
            buf[k] = v[j];
            j += 1;
        } else {
            buf[k] = v[i];
            i += 1;
        }
        k += 1;
    }
    buf[k..k + mid - i].copy_from_slice(&v[i..mid]);
    k += mid - i;
    buf[k..k + n - j].copy_from_slice(&v[j..n]);
    v.copy_from_slice(&buf[..n]);
    inv
}

/// Kendall's τ-b by comparing every pair (O(n²)): the definition [`kendall_tau_b`] counts
/// faster, kept for non-finite values and as the tests' reference.
pub fn kendall_tau_b_pairs(a: &[f64], b: &[f64]) -> Option<f64> {
    let n = a.len();
    let (mut conc, mut disc, mut ties_a, mut ties_b) = (0i64, 0i64, 0i64, 0i64);
    for i in 0..n {
        for j in i + 1..n {
            let (da, db) = (a[i] - a[j], b[i] - b[j]);
            match (da == 0.0, db == 0.0) {
                (true, true) => {}
                (true, false) => ties_a += 1,
                (false, true) => ties_b += 1,
                _ if da.signum() == db.signum() => conc += 1,
                _ => disc += 1,
            }
        }
    }
    let denom = (((conc + disc + ties_a) * (conc + disc + ties_b)) as f64).sqrt();
    (n >= 2 && denom > 0.0).then(|| (conc - disc) as f64 / denom)
}

/// Attention rollout for query `q` from per-layer head-averaged patterns (`[n, n]` each).
pub fn rollout(head_means: &[Vec<f32>], n: usize, q: usize) -> Vec<f32> {
    // the query's row, carried down through the layers: r ← r · A_l, from the last layer down
    let mut r: Vec<f64> = (0..n).map(|j| if j == q { 1.0 } else { 0.0 }).collect();
    for hm in head_means.iter().rev() {
        let mut next = vec![0.0f64; n];
        for i in 0..n {
            if r[i] == 0.0 {
                continue;
            }
            let row = &hm[i * n..][..n];
            let sum: f64 = row.iter().map(|&x| 0.5 * x as f64).sum::<f64>() + 0.5;
            for j in 0..n {
                let a = 0.5 * row[j] as f64 + if i == j { 0.5 } else { 0.0 };
                next[j] += r[i] * a / sum;
            }
        }
        r = next;
    }
    r.into_iter().map(|x| x as f32).collect()
}

/// The `k` highest-scoring positions among `candidates` (ties to the lower position).
pub fn top_positions(scores: &[f32], candidates: &[usize], k: usize) -> Vec<usize> {
    let mut c = candidates.to_vec();
    c.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    c.truncate(k);
    c.sort_unstable();
    c
}

/// What the model should predict: its own next token, an id, or a token's text.
#[derive(Clone, Debug)]
pub enum Target {
    Next,
    Id(u32),
    Text(String),
}

impl std::str::FromStr for Target {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Ok(match s {
            "next" => Target::Next,
            _ if !s.is_empty() && s.chars().all(|c| c.is_ascii_digit()) => {
                Target::Id(s.parse().map_err(|e| format!("{e}"))?)
            }
            _ => Target::Text(s.to_string()),
        })
    }
}

impl Target {
    /// The token id: the top of `logits` for [`Target::Next`], else the id or the one token the
    /// text is (an error naming `--target` otherwise).
    pub fn resolve(&self, model: &Model, logits: &[f32]) -> Result<u32> {
        self.resolve_as(model, logits, "--target")
    }

    /// [`Target::resolve`] for the flag `flag` (`--answer`, `--wrong`): its errors name it.
    pub fn resolve_as(&self, model: &Model, logits: &[f32], flag: &str) -> Result<u32> {
        Ok(match self {
            Target::Next => super::max_argmax(logits).1 as u32,
            Target::Id(i) => {
                if *i as usize >= model.dims.vocab_size {
                    return Err(crate::model::Error::OutOfRange {
                        what: format!("{flag} id"),
                        value: i.to_string(),
                        range: format!("0..{}", model.dims.vocab_size),
                    });
                }
                *i
            }
            Target::Text(t) => single_token(model, t, flag)?,
        })
    }
}

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
    /// `‖∂ log p(target)/∂x_i‖₂` ([`super::attribute`]; None when gradients were not asked for)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gradient: Option<f32>,
    /// `∂ log p(target)/∂x_i · x_i`
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_x_input: Option<f32>,
    /// integrated gradients from the zero embedding (`FaithOptions::ig_steps` midpoints)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub integrated_gradients: Option<f32>,
    /// attention × gradient (Chefer et al. 2021), summed over layers, on the last query's row
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attention_x_gradient: Option<f32>,
    /// AttnLRP's relevance of the target's logit (Achtibat et al. 2024)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attnlrp: Option<f32>,
    /// value zeroing's rolled-out mixing into the last position (Mohebbi et al. 2023)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value_zeroing: Option<f32>,
    /// ALTI-Logit's share of the target's logit (Ferrando et al. 2023)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alti_logit: Option<f32>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct AtK {
    #[serde(rename = "1")]
    pub k1: Option<f32>,
    #[serde(rename = "3")]
    pub k3: Option<f32>,
    #[serde(rename = "5")]
    pub k5: Option<f32>,
}

#[derive(Clone, Debug, Serialize)]
pub struct MetricRow {
    pub ranking: String,
    pub truth: String,
    /// tokens ranked (with a handful, ρ and τ mean little: see the p-values)
    pub n: usize,
    pub spearman: Option<f64>,
    /// two-sided permutation p-value of ρ (exact for n ≤ 7, else 2,000 seeded permutations)
    pub spearman_p: Option<f64>,
    pub kendall: Option<f64>,
    pub kendall_p: Option<f64>,
    pub top1: Option<bool>,
    pub comprehensiveness: AtK,
    pub sufficiency: AtK,
    pub without_first: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct FaithReport {
    pub model: String,
    pub precision: String,
    pub target: TargetInfo,
    pub replacement: TargetInfoLite,
    pub query: usize,
    pub tokens: Vec<TokenRow>,
    pub metrics: Vec<MetricRow>,
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
    pub conclusion: String,
}

/// A ranking and its ρ against deletion.
#[derive(Clone, Debug, Serialize)]
pub struct Best {
    pub ranking: String,
    pub spearman: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct TargetInfoLite {
    pub id: u32,
    pub token: String,
}

/// Options of a faithfulness run.
#[derive(Clone, Debug)]
pub struct FaithOptions {
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

impl FaithOptions {
    /// The attention rankings only, as `corpus` and `explain` run them: next token, `" "` as
    /// the replacement, seed 7.
    pub fn attention_only() -> Self {
        FaithOptions {
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
    /// `embedding` (the sentence embedding) or `cls` (the [CLS] vector).
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
/// an encoder's (against deletion, for the sentence embedding or the [CLS] vector). Serialized
/// as the report itself (`faithfulness --json`).
#[derive(Clone, Debug, Serialize)]
#[serde(untagged)]
pub enum Faithfulness {
    /// A decoder's report.
    Decoder(FaithReport),
    /// An encoder's report.
    Encoder(super::enc_faith::EncFaithReport),
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
    super::attribute::check_steps(req.steps)?;
    if model.is_encoder() {
        use super::enc_target::EncoderTarget;
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
    let opts = FaithOptions {
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
    opts: &FaithOptions,
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
    let mut runner = Runner::new(model, tokens, &kv, Metric::LogProb(Some(target_id)));
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
/// run's patterns and values, and (with `FaithOptions::gradients`) the gradient-based and mixing
/// ones of the same target.
struct Explanations {
    attention_last: Vec<f32>,
    attention_mean: Vec<f32>,
    rollout: Vec<f32>,
    norm_last: Vec<f32>,
    norm_mean: Vec<f32>,
    gradient: Option<Vec<f32>>,
    grad_x_input: Option<Vec<f32>>,
    integrated_gradients: Option<Vec<f32>>,
    attention_x_gradient: Option<Vec<f32>>,
    attnlrp: Option<Vec<f32>>,
    value_zeroing: Option<Vec<f32>>,
    alti_logit: Option<Vec<f32>>,
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
        opts: &FaithOptions,
        target_id: u32,
    ) -> Result<Self> {
        let (n, d) = (tokens.len(), &model.dims);
        let q = n - 1;
        let head_means: Vec<Vec<f32>> = (0..d.n_layers)
            .map(|l| {
                let p = cache.pattern(l).expect("all layers captured");
                super::mean_rows((0..d.n_heads).map(|h| &p.data[h * n * n..][..n * n]))
            })
            .collect();
        // norm-based attention [Kobayashi et al. 2020]: what each key moves, per layer
        let norm_rows: Vec<Vec<f32>> = (0..d.n_layers)
            .map(|l| {
                let p = cache.pattern(l).expect("all layers captured");
                let alphas: Vec<&[f32]> = (0..d.n_heads).map(|h| p.row(h, q)).collect();
                let v = Values::head_major(kv.values(l), n, d.n_kv_heads, d.head_dim);
                mixed_norms(model, l, &v, &alphas, n)
            })
            .collect();
        let norm_shares: Vec<Vec<f32>> = norm_rows.iter().map(|r| shares(r)).collect();
        let mut ex = Explanations {
            attention_last: head_means[d.n_layers - 1][q * n..][..n].to_vec(),
            attention_mean: super::mean_rows(head_means.iter().map(|hm| &hm[q * n..][..n])),
            rollout: rollout(&head_means, n, q),
            norm_last: norm_rows[d.n_layers - 1].clone(),
            norm_mean: super::mean_rows(norm_shares.iter().map(Vec::as_slice)),
            gradient: None,
            grad_x_input: None,
            integrated_gradients: None,
            attention_x_gradient: None,
            attnlrp: None,
            value_zeroing: None,
            alti_logit: None,
            ig_gap: None,
            lrp_err: None,
        };
        if opts.gradients {
            ex.add_gradients(model, tokens, cache, opts.ig_steps, target_id)?;
        }
        Ok(ex)
    }

    /// The gradient-based explanations of the same target (one backward, and IG's steps when
    /// `ig_steps` > 0) and the mixing ones (AttnLRP, value zeroing, ALTI-Logit).
    fn add_gradients(
        &mut self,
        model: &Model,
        tokens: &[u32],
        cache: &AttnCache,
        ig_steps: usize,
        target_id: u32,
    ) -> Result<()> {
        use super::attribute as at;
        let (n, d) = (tokens.len(), &model.dims);
        let q = n - 1;
        let metric = Metric::LogProb(Some(target_id));
        let g = model.gradient(tokens, metric)?;
        let pattern: Vec<Vec<f32>> = (0..d.n_layers)
            .map(|l| {
                let p = cache.pattern(l).expect("all layers captured");
                (0..d.n_heads).flat_map(|h| p.row(h, q).to_vec()).collect()
            })
            .collect();
        let dm = d.d_model;
        self.gradient = Some(at::gradient_norms(&g.grad_input, dm));
        self.grad_x_input = Some(at::grad_times_input(&g.grad_input, &g.input, dm));
        self.attention_x_gradient = Some(at::attention_times_gradient(
            &g.grad_pattern_last,
            &pattern,
            n,
        ));
        if ig_steps > 0 {
            let (s, gap) = at::integrated(model, tokens, metric, ig_steps, &mut |_| {})?;
            self.integrated_gradients = Some(s);
            self.ig_gap = Some(gap);
        }
        let (r, v, a) = super::mixing::rankings(model, tokens, target_id)?;
        self.attnlrp = Some(r.scores);
        self.value_zeroing = Some(v);
        self.alti_logit = Some(a);
        self.lrp_err = Some(r.conservation_error);
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
        for (name, v) in [
            ("gradient", &self.gradient),
            ("grad_x_input", &self.grad_x_input),
            ("integrated_gradients", &self.integrated_gradients),
            ("attention_x_gradient", &self.attention_x_gradient),
            ("attnlrp", &self.attnlrp),
            ("value_zeroing", &self.value_zeroing),
            ("alti_logit", &self.alti_logit),
        ] {
            if let Some(v) = v {
                if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                    return Err(crate::model::Error::NonFinite {
                        what: format!("the {name} score of position {i}"),
                        layer: None,
                    });
                }
                rankings.push((name.into(), v.clone()));
            }
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
    runner: &mut Runner,
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
        let at = |v: &Option<Vec<f32>>| v.as_ref().map(|v| v[j]);
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
            gradient: at(&ex.gradient),
            grad_x_input: at(&ex.grad_x_input),
            integrated_gradients: at(&ex.integrated_gradients),
            attention_x_gradient: at(&ex.attention_x_gradient),
            attnlrp: at(&ex.attnlrp),
            value_zeroing: at(&ex.value_zeroing),
            alti_logit: at(&ex.alti_logit),
        });
    }
    Ok(rows)
}

/// Comprehensiveness and sufficiency at each k of [`TOP_KS`] for `scores`' top positions among
/// `candidates` (None where k is more than there are), as drops of the target's probability
/// from `p_full`.
fn at_k(
    runner: &mut Runner,
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
    runner: &mut Runner,
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

/// The metric row with the highest Spearman ρ among `metrics` (those that have one; ties to
/// the last), as a [`Best`].
pub(super) fn best_of<'a>(metrics: impl Iterator<Item = &'a MetricRow>) -> Option<Best> {
    metrics
        .filter_map(|m| m.spearman.map(|r| (m, r)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(m, r)| Best {
            ranking: m.ranking.clone(),
            spearman: r,
        })
}

/// The id of `text` when it is exactly one token (as inside a text: no BOS), else an error naming
/// `what` (the flag).
pub fn single_token(model: &Model, text: &str, what: &str) -> Result<u32> {
    // one token as it would appear inside a text: no BOS
    let ids = model.tokenizer.encode_with(text, Some(false))?;
    match ids.as_slice() {
        [one] => Ok(*one),
        _ => Err(crate::model::Error::OutOfRange {
            what: format!("{what} {text:?}"),
            value: format!("({} tokens: {ids:?})", ids.len()),
            range: "text that is exactly one token, or a token id".into(),
        }),
    }
}

/// `tokens` without the positions in `drop`.
fn without_positions(tokens: &[u32], drop: &[usize]) -> Vec<u32> {
    (0..tokens.len())
        .filter(|i| !drop.contains(i))
        .map(|i| tokens[i])
        .collect()
}

/// The two variants of a comprehensiveness/sufficiency metric: the text without the `top`
/// positions, and only them (without_first: the first token is not ranked, so it stays in both).
fn without_and_only(tokens: &[u32], top: &[usize], without_first: bool) -> (Vec<u32>, Vec<u32>) {
    let only = (0..tokens.len())
        .filter(|i| top.contains(i) || (without_first && *i == 0))
        .map(|i| tokens[i])
        .collect();
    (without_positions(tokens, top), only)
}

/// New positions per batch of [`Runner::prefetch`]: about what a 2,048-token forward holds.
const BATCH_ROWS: usize = 2048;
/// Variants per batch: each brings a logits row of the whole vocabulary (0.6 MB for Qwen2.5),
/// held twice for a moment, and a long text has many short variants.
const BATCH_VARIANTS: usize = 64;

/// The value of a resolved `metric` (its target given) on one row of logits.
pub fn metric_value(metric: Metric, logits: &[f32]) -> f32 {
    match metric {
        Metric::LogProb(t) => {
            let lp = log_softmax(logits);
            lp[t.unwrap_or_else(|| super::max_argmax(logits).1 as u32) as usize]
        }
        Metric::LogitDiff { answer, wrong } => logits[answer as usize] - logits[wrong as usize],
    }
}

/// Occlusion by deletion: `metric(text) − metric(text without token i)` for every position
/// (positive: the token raised the metric), with `metric(text)`. The deletions reuse the full
/// run's keys and values before each deleted position and run many to a forward, as
/// `faithfulness` does. `metric` must name its target; a text of one token has nothing to
/// delete (an error).
pub fn deletion_effects(
    model: &Model,
    tokens: &[u32],
    metric: Metric,
    mut tick: impl FnMut(usize, usize),
) -> Result<(f32, Vec<f32>)> {
    let n = tokens.len();
    if n < 2 {
        return Err(crate::model::Error::OutOfRange {
            what: "text".into(),
            value: format!("{n} token(s)"),
            range: "at least 2 tokens (occlusion deletes one and predicts from the rest)".into(),
        });
    }
    let (logits, kv) = full_run(model, tokens, &mut crate::model::capture::NoCapture)?;
    let base = metric_value(metric, &logits);
    let mut runner = Runner::new(model, tokens, &kv, metric);
    let wanted: Vec<(Vec<u32>, Option<usize>)> = (0..n)
        .map(|j| (without_positions(tokens, &[j]), None))
        .collect();
    runner.prefetch(&wanted, &mut tick)?;
    let deltas = wanted
        .iter()
        .map(|(v, _)| runner.logprob(v, None).map(|f| base - f))
        .collect::<Result<Vec<f32>>>()?;
    Ok((base, deltas))
}

/// The full run of `tokens` into `obs`, that every occlusion starts from: the last position's
/// logits, and every layer's keys and values (the prefix the occlusions reuse).
fn full_run(model: &Model, tokens: &[u32], obs: &mut dyn Observer) -> Result<(Vec<f32>, KvPrefix)> {
    let full = model.forward(
        tokens,
        &RunOptions {
            logits_at: vec![tokens.len() - 1],
            keep_kv: true,
            ..Default::default()
        },
        obs,
    )?;
    let kv = full.kv.expect("keep_kv was set");
    let logits = full
        .logits
        .into_iter()
        .next()
        .expect("one row of logits was asked for");
    Ok((logits, kv))
}

/// Forward passes for token variants, memoized, reusing the longest valid KV prefix.
struct Runner<'a> {
    model: &'a Model,
    tokens: &'a [u32],
    kv: &'a KvPrefix,
    metric: Metric,
    memo: HashMap<(Vec<u32>, Option<usize>), f32>,
    passes: usize,
}

impl<'a> Runner<'a> {
    /// A runner of `tokens`' variants from the full run's keys and values `kv`, measuring
    /// `metric`; the full run counts as the first pass.
    fn new(model: &'a Model, tokens: &'a [u32], kv: &'a KvPrefix, metric: Metric) -> Self {
        Runner {
            model,
            tokens,
            kv,
            metric,
            memo: HashMap::new(),
            passes: 1,
        }
    }

    /// Positions of the full run's prefix that `variant` (with `knockout`) can reuse: those
    /// before its first change and before the knocked-out key, and at least one new position.
    fn reuse(&self, variant: &[u32], knockout: Option<usize>) -> usize {
        let mut c = variant
            .iter()
            .zip(self.tokens)
            .take_while(|(a, b)| a == b)
            .count();
        if let Some(j) = knockout {
            c = c.min(j);
        }
        c.min(variant.len() - 1)
    }

    /// Runs every variant in `wanted` not yet known, many per forward ([`Model::forward_batch`]:
    /// short variants cost about what reading the weights once does, so a batch of them costs
    /// about one), and reports `tick(done, total)` in variants, counting the full run.
    fn prefetch(
        &mut self,
        wanted: &[(Vec<u32>, Option<usize>)],
        tick: &mut impl FnMut(usize, usize),
    ) -> Result<()> {
        let mut todo: Vec<&(Vec<u32>, Option<usize>)> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for w in wanted {
            if !self.memo.contains_key(w) && seen.insert(w) {
                todo.push(w);
            }
        }
        let (first, total) = (self.passes, self.passes + todo.len());
        tick(first, total);
        let mut rest = todo.as_slice();
        while !rest.is_empty() {
            // whole variants up to BATCH_ROWS new positions (at least one variant)
            let (mut take, mut rows) = (0, 0);
            for (v, ko) in rest {
                let new = v.len() - self.reuse(v, *ko);
                if take > 0 && (rows + new > BATCH_ROWS || take == BATCH_VARIANTS) {
                    break;
                }
                take += 1;
                rows += new;
            }
            let (batch, later) = rest.split_at(take);
            let segments: Vec<Segment> = batch
                .iter()
                .map(|(v, ko)| {
                    let c = self.reuse(v, *ko);
                    Segment {
                        tokens: &v[c..],
                        reuse: c,
                        knockout: ko.iter().copied().collect(),
                        logits_at: vec![v.len() - 1],
                    }
                })
                .collect();
            let logits = self.model.forward_batch(Some(self.kv), &segments)?;
            for (&key, rows) in batch.iter().zip(logits) {
                self.memo
                    .insert(key.clone(), metric_value(self.metric, &rows[0]));
            }
            self.passes += batch.len();
            tick(self.passes, total);
            rest = later;
        }
        Ok(())
    }

    /// The metric (log p(target), or a logit difference) after `variant` (with key `knockout`
    /// hidden, if any): from the memo that
    /// [`Runner::prefetch`] fills, running it there first if it is not known yet.
    fn logprob(&mut self, variant: &[u32], knockout: Option<usize>) -> Result<f32> {
        let key = (variant.to_vec(), knockout);
        if !self.memo.contains_key(&key) {
            self.prefetch(std::slice::from_ref(&key), &mut |_, _| {})?;
        }
        Ok(self.memo[&key])
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_correlations_of_constructed_rankings() {
        let a = [1.0, 2.0, 3.0, 4.0, 5.0];
        let up = [10.0, 20.0, 30.0, 40.0, 50.0];
        let down = [5.0, 4.0, 3.0, 2.0, 1.0];
        assert!((spearman(&a, &up).unwrap() - 1.0).abs() < 1e-12);
        assert!((spearman(&a, &down).unwrap() + 1.0).abs() < 1e-12);
        assert!((kendall_tau_b(&a, &up).unwrap() - 1.0).abs() < 1e-12);
        assert!((kendall_tau_b(&a, &down).unwrap() + 1.0).abs() < 1e-12);
        assert_eq!(spearman(&a, &[1.0; 5]), None);
        // one swap of five: ρ = 1 - 6·2/(5·24) = 0.9; τ = (9 - 1)/10 = 0.8
        let swap = [1.0, 2.0, 3.0, 5.0, 4.0];
        assert!((spearman(&a, &swap).unwrap() - 0.9).abs() < 1e-12);
        assert!((kendall_tau_b(&a, &swap).unwrap() - 0.8).abs() < 1e-12);
    }

    #[test]
    fn kendall_by_merge_sort_counts_every_pair_alike() {
        // ties in a, in b, in both, -0.0 beside 0.0, and lengths 0..40: the same bits as the
        // pairwise count
        let mut rng = Rng::new(5);
        for n in 0..40usize {
            for levels in [2u64, 3, 7, 1000] {
                let draw = |rng: &mut Rng| -> Vec<f64> {
                    (0..n)
                        .map(|_| match rng.next_u64() % levels {
                            0 => -0.0,
                            1 => 0.0,
                            v => v as f64 * 0.25 - 3.0,
                        })
                        .collect()
                };
                let (a, b) = (draw(&mut rng), draw(&mut rng));
                let (fast, pairs) = (kendall_tau_b(&a, &b), kendall_tau_b_pairs(&a, &b));
                assert_eq!(
                    fast.map(f64::to_bits),
                    pairs.map(f64::to_bits),
                    "{a:?} {b:?}"
                );
            }
        }
        // by hand: a = [1, 2, 3], b = [1, 3, 3]: pairs (1,2) and (1,3) concordant, (2,3) tied
        // in b only; τ-b = 2 / √(3 · 2)
        let t = kendall_tau_b(&[1.0, 2.0, 3.0], &[1.0, 3.0, 3.0]).unwrap();
        assert!((t - 2.0 / 6f64.sqrt()).abs() < 1e-15, "{t}");
        // a NaN goes to the pairwise count
        let nan = [1.0, f64::NAN, 3.0];
        assert_eq!(
            kendall_tau_b(&nan, &[1.0, 2.0, 3.0]).map(f64::to_bits),
            kendall_tau_b_pairs(&nan, &[1.0, 2.0, 3.0]).map(f64::to_bits)
        );
    }

    #[test]
    fn ties_get_average_ranks() {
        assert_eq!(
            average_ranks(&[10.0, 20.0, 20.0, 5.0]),
            vec![2.0, 3.5, 3.5, 1.0]
        );
    }

    #[test]
    fn permutation_p_values() {
        // a perfect ranking of 5: exactly 2 of 120 orderings (this one and its reverse) reach |ρ| = 1
        let a = [1.0, 2.0, 3.0, 4.0, 5.0];
        let p = permutation_p(&a, &a, spearman).unwrap();
        assert!((p - 2.0 / 120.0).abs() < 1e-12, "{p}");
        // a constant truth has no correlation, so no p-value
        assert_eq!(permutation_p(&a, &[1.0; 5], spearman), None);
        // larger n: sampled, bounded below by 1/2001, near 1 for a shuffled truth
        let a: Vec<f64> = (0..30).map(|i| i as f64).collect();
        let p = permutation_p(&a, &a, kendall_tau_b).unwrap();
        assert!((p - 1.0 / 2001.0).abs() < 1e-12);
        let shuffled: Vec<f64> = (0..30).map(|i| ((i * 17) % 30) as f64).collect();
        assert!(permutation_p(&a, &shuffled, spearman).unwrap() > 0.05);
    }

    #[test]
    fn rollout_of_identity_attention_stays_on_the_query() {
        // every token attends only to itself: rollout keeps all weight on the query
        let n = 3;
        let eye: Vec<f32> = (0..n * n)
            .map(|i| if i / n == i % n { 1.0 } else { 0.0 })
            .collect();
        assert_eq!(rollout(&[eye.clone(), eye], n, 2), vec![0.0, 0.0, 1.0]);
    }

    #[test]
    fn rollout_by_hand_two_tokens_one_layer() {
        // P row 1 = [0.6, 0.4]: A row 1 = 0.5·[0.6, 0.4] + 0.5·[0, 1] = [0.3, 0.7] (sums to 1)
        let p = vec![1.0, 0.0, 0.6, 0.4];
        let r = rollout(std::slice::from_ref(&p), 2, 1);
        assert!((r[0] - 0.3).abs() < 1e-6 && (r[1] - 0.7).abs() < 1e-6);
        // two layers: r = [0,1]·A·A, A = [[1,0],[0.3,0.7]] → [0.3 + 0.7·0.3, 0.49] = [0.51, 0.49]
        let r = rollout(&[p.clone(), p], 2, 1);
        assert!((r[0] - 0.51).abs() < 1e-6 && (r[1] - 0.49).abs() < 1e-6);
    }

    #[test]
    fn top_positions_respect_candidates_and_ties() {
        let s = [0.9, 0.1, 0.5, 0.5];
        assert_eq!(top_positions(&s, &[0, 1, 2, 3], 2), vec![0, 2]);
        assert_eq!(top_positions(&s, &[1, 2, 3], 2), vec![2, 3]);
    }

    #[test]
    fn targets_parse() {
        assert!(matches!("next".parse::<Target>().unwrap(), Target::Next));
        assert!(matches!("42".parse::<Target>().unwrap(), Target::Id(42)));
        assert!(matches!(
            " Paris".parse::<Target>().unwrap(),
            Target::Text(_)
        ));
    }
}
