//! `generate`'s sampler against the distribution it should draw from (issue #55). The draws come
//! from `model::generate::pick`, the function `Model::generate` picks every token with (seeded by
//! `Rng::new(seed)`, so seed s's first generated token is `pick(logits, o, Rng::new(s))`: checked
//! below on the model). The distribution is transformers': the logits through its
//! TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper, in that order, then softmax
//! (`tests/golden/sampling_ref.json`, `make_sampling_golden.py`), and the same written again here
//! from the warpers' definitions ([`warped`]) for the model's own logits (which are checked
//! against transformers' in `tests/real_models.rs`). Each distribution is compared with the counts
//! of the first sampled token over 2,000 seeds by a chi-square goodness-of-fit test
//! (bins with an expected count under 5 merged), whose p-value must exceed 1e-3; the same counts
//! against the distribution at 1.5 times the temperature must give a p-value under 1e-3.

mod common;

use attnscope::model::generate::{pick, GenOptions};
use attnscope::reference::Rng;
use common::{assert_cells, Bound};
use rayon::prelude::*;
use std::collections::BTreeMap;

/// Seeds drawn per distribution.
const DRAWS: u64 = 2000;

/// The smallest p-value a right distribution may get, and the largest a wrong one may.
const ALPHA: f64 = 1e-3;

/// `ln Γ(x)` for x > 0 (Lanczos, g = 7, 9 terms; relative error ~1e-15).
fn ln_gamma(x: f64) -> f64 {
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // reflection: Γ(x) Γ(1 − x) = π / sin(πx)
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let t = x + 7.5;
    let s = C[1..]
        .iter()
        .enumerate()
        .fold(C[0], |s, (i, c)| s + c / (x + i as f64 + 1.0));
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + s.ln()
}

/// The regularized upper incomplete gamma function Q(a, x) = Γ(a, x) / Γ(a): its series below
/// x = a + 1, its continued fraction (modified Lentz) above (Numerical Recipes §6.2).
fn gamma_q(a: f64, x: f64) -> f64 {
    assert!(a > 0.0 && x >= 0.0, "Q({a}, {x})");
    if x == 0.0 {
        return 1.0;
    }
    let front = (-x + a * x.ln() - ln_gamma(a)).exp();
    if x < a + 1.0 {
        // P(a, x) = e^-x x^a / Γ(a) · Σ_n x^n / (a (a+1) … (a+n))
        let (mut term, mut sum, mut ap) = (1.0 / a, 1.0 / a, a);
        while term.abs() > sum.abs() * 1e-16 {
            ap += 1.0;
            term *= x / ap;
            sum += term;
        }
        return 1.0 - sum * front;
    }
    let tiny = 1e-300;
    let mut b = x + 1.0 - a;
    let (mut c, mut d) = (1.0 / tiny, 1.0 / b);
    let mut h = d;
    for i in 1..10_000 {
        let an = -(i as f64) * (i as f64 - a);
        b += 2.0;
        d = an * d + b;
        d = if d.abs() < tiny { tiny } else { d };
        c = b + an / c;
        c = if c.abs() < tiny { tiny } else { c };
        d = 1.0 / d;
        let delta = d * c;
        h *= delta;
        if (delta - 1.0).abs() < 1e-16 {
            break;
        }
    }
    front * h
}

/// The chi-square statistic of `counts` (draws per token) against the probabilities `want` (per
/// token id), its degrees of freedom and its p-value. Tokens expected at least 5 times are bins of
/// their own; the others are merged into one bin (itself merged into the smallest bin when it is
/// expected under 5 times). A token drawn that `want` gives probability 0 makes the p-value 0.
fn chi_square(counts: &BTreeMap<u32, u64>, want: &[f64]) -> (f64, usize, f64) {
    let n = counts.values().sum::<u64>() as f64;
    if let Some((t, c)) = counts.iter().find(|(&t, _)| want[t as usize] <= 0.0) {
        eprintln!("token {t} drawn {c} times has probability 0");
        return (f64::INFINITY, 0, 0.0);
    }
    let (mut bins, mut rest) = (Vec::new(), (0.0, 0.0));
    for (t, &p) in want.iter().enumerate() {
        let observed = counts.get(&(t as u32)).copied().unwrap_or(0) as f64;
        if n * p >= 5.0 {
            bins.push((n * p, observed));
        } else {
            rest = (rest.0 + n * p, rest.1 + observed);
        }
    }
    if rest.0 >= 5.0 {
        bins.push(rest);
    } else if rest.0 > 0.0 || rest.1 > 0.0 {
        let smallest = (0..bins.len())
            .min_by(|&a, &b| bins[a].0.total_cmp(&bins[b].0))
            .expect("a bin expected 5 times or more");
        bins[smallest] = (bins[smallest].0 + rest.0, bins[smallest].1 + rest.1);
    }
    assert!(bins.len() >= 2, "one bin: nothing to test");
    let stat: f64 = bins.iter().map(|(e, o)| (o - e) * (o - e) / e).sum();
    let df = bins.len() - 1;
    (stat, df, gamma_q(df as f64 / 2.0, stat / 2.0))
}

/// The distribution transformers samples from after its warpers, written from their definitions
/// (transformers' generation/logits_process.py), not from `pick`: the logits divided by `t`; with
/// `k > 0`, every token whose scaled logit is below the k-th largest removed (ties with it kept);
/// with `p < 1`, the kept tokens sorted by probability ascending and each removed whose cumulative
/// probability is at most 1 − p, the most likely always kept; the softmax of what is left.
fn warped(logits: &[f32], t: f64, k: usize, p: f64) -> Vec<f64> {
    let z: Vec<f64> = logits.iter().map(|&x| x as f64 / t).collect();
    let mut keep = vec![true; z.len()];
    if k > 0 && k < z.len() {
        let mut sorted = z.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let kth = sorted[k - 1];
        keep.iter_mut().zip(&z).for_each(|(k, &x)| *k = x >= kth);
    }
    if p < 1.0 {
        let probs = softmax_kept(&z, &keep);
        let mut order: Vec<usize> = (0..z.len()).filter(|&i| keep[i]).collect();
        order.sort_by(|&a, &b| probs[a].total_cmp(&probs[b]));
        let mut cum = 0.0;
        for (j, &i) in order.iter().enumerate() {
            cum += probs[i];
            if cum <= 1.0 - p && j + 1 < order.len() {
                keep[i] = false;
            }
        }
    }
    softmax_kept(&z, &keep)
}

/// The softmax of `z` over the kept entries, 0 elsewhere, in f64.
fn softmax_kept(z: &[f64], keep: &[bool]) -> Vec<f64> {
    let max = z
        .iter()
        .zip(keep)
        .filter(|(_, &k)| k)
        .fold(f64::NEG_INFINITY, |m, (&x, _)| m.max(x));
    let e: Vec<f64> = z
        .iter()
        .zip(keep)
        .map(|(&x, &k)| if k { (x - max).exp() } else { 0.0 })
        .collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

fn options(t: f64, k: usize, p: f64) -> GenOptions {
    GenOptions {
        temperature: t as f32,
        top_k: k,
        top_p: p as f32,
        max_new_tokens: 1,
        ..Default::default()
    }
}

/// The first token `pick` draws with seeds `0..DRAWS`, counted per token id.
fn draws(logits: &[f32], o: &GenOptions) -> BTreeMap<u32, u64> {
    let ids: Vec<u32> = (0..DRAWS)
        .into_par_iter()
        .map(|seed| pick(logits, o, &mut Rng::new(seed)))
        .collect();
    let mut counts = BTreeMap::new();
    for id in ids {
        *counts.entry(id).or_insert(0) += 1;
    }
    counts
}

/// The chi-square p-value of `counts` against `want`, printed.
fn p_value(label: &str, counts: &BTreeMap<u32, u64>, want: &[f64]) -> f64 {
    let (stat, df, pv) = chi_square(counts, want);
    eprintln!(
        "{label}: {} tokens drawn, chi-square {stat:.2} on {df} df, p = {pv:.3e}",
        counts.len()
    );
    pv
}

/// `pick`'s draws with temperature `t`, top-k `k` and top-p `p` fit `want` (p-value > 1e-3);
/// returns them.
fn draws_fit(
    label: &str,
    logits: &[f32],
    (t, k, p): (f64, usize, f64),
    want: &[f64],
) -> BTreeMap<u32, u64> {
    let counts = draws(logits, &options(t, k, p));
    let pv = p_value(label, &counts, want);
    assert!(pv > ALPHA, "{label}: p = {pv:.3e} ≤ {ALPHA:.0e}");
    counts
}

/// The draws `counts` do not fit the distribution at 1.5 times the temperature (p < 1e-3).
fn misfit_at_wrong_temperature(
    label: &str,
    counts: &BTreeMap<u32, u64>,
    logits: &[f32],
    (t, k, p): (f64, usize, f64),
) {
    let label = format!("{label} against 1.5 × T");
    let pv = p_value(&label, counts, &warped(logits, t * 1.5, k, p));
    assert!(
        pv < ALPHA,
        "{label}: the draws fit the wrong temperature's distribution (p = {pv:.3e})"
    );
}

/// A golden distribution as cells: token id → probability (listed tokens), the number of tokens
/// kept and the summed probability of the kept tokens not listed.
fn golden_cells(probs: &serde_json::Value) -> Vec<(String, f64)> {
    let mut cells: Vec<(String, f64)> = probs["listed"]
        .as_object()
        .expect("listed")
        .iter()
        .map(|(id, p)| (format!("token {id:>6}"), p.as_f64().unwrap()))
        .collect();
    cells.push(("kept".into(), probs["kept"].as_f64().unwrap()));
    cells.push(("rest".into(), probs["rest"].as_f64().unwrap()));
    cells
}

/// `dist` in [`golden_cells`]' form, listing the tokens the golden lists.
fn cells_like(dist: &[f64], golden: &serde_json::Value) -> Vec<(String, f64)> {
    let listed: Vec<usize> = golden["listed"]
        .as_object()
        .unwrap()
        .keys()
        .map(|id| id.parse().unwrap())
        .collect();
    let mut cells: Vec<(String, f64)> = listed
        .iter()
        .map(|&i| (format!("token {i:>6}"), dist[i]))
        .collect();
    let kept = dist.iter().filter(|&&p| p > 0.0).count();
    cells.push(("kept".into(), kept as f64));
    let rest = 1.0 - listed.iter().map(|&i| dist[i]).sum::<f64>();
    cells.push(("rest".into(), rest));
    cells
}

/// [`gamma_q`] gives scipy's chi-square survival function to 1e-10 of each value.
#[test]
fn chi_square_p_values_equal_scipys() {
    // scipy.stats.chi2.sf(x, df), scipy 1.x
    let want = [
        (3.841458820694124, 1, 0.04999999999999989),
        (18.307038053275146, 10, 0.05000000000000005),
        (1.0, 3, 0.8012519569012009),
        (100.0, 50, 3.454931382984871e-05),
        (40.0, 2, 2.0611536224385566e-09),
        (0.5, 7, 0.9994464813904249),
        (250.0, 200, 0.009379131668826098),
        (12.0, 30, 0.9985996461666381),
    ];
    let cell = |x: f64, df: usize| format!("chi2.sf({x}, {df})");
    assert_cells(
        "chi-square p-value / scipy's",
        want.iter()
            .map(|&(x, df, p)| (cell(x, df), gamma_q(df as f64 / 2.0, x / 2.0) / p)),
        want.iter().map(|&(x, df, _)| (cell(x, df), 1.0)),
        Bound::Abs(1e-10),
    );
}

/// Synthetic logits (`sampling_ref.json`'s cases): [`warped`] equals transformers' warpers, and
/// `pick`'s draws fit them: top-p keeps the token whose cumulative probability crosses p, top-k
/// keeps the tokens tied with the k-th.
#[test]
fn synthetic_logits_are_sampled_as_transformers_warps_them() {
    let g = common::golden_json("sampling_ref.json");
    for case in g["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let logits: Vec<f32> = case["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        let (t, k, p) = (
            case["temperature"].as_f64().unwrap(),
            case["top_k"].as_u64().unwrap() as usize,
            case["top_p"].as_f64().unwrap(),
        );
        let mine = warped(&logits, t, k, p);
        assert_cells(
            &format!("{name}: warped vs transformers"),
            cells_like(&mine, &case["probs"]),
            golden_cells(&case["probs"]),
            Bound::Abs(1e-7),
        );
        let counts = draws_fit(name, &logits, (t, k, p), &mine);
        if name == "mixed" {
            misfit_at_wrong_temperature(name, &counts, &logits, (t, k, p));
        }
    }
}

/// SmolLM2's next-token logits after the golden's prompt, for each of its configurations: the
/// distribution [`warped`] makes of attnscope's logits equals transformers' warpers on
/// transformers' logits (every token of probability ≥ 1e-4, the number kept, the rest's sum), and
/// `pick`'s first token over the seeds fits it, not the one at 1.5 times the temperature.
#[test]
fn smol_first_sampled_token_follows_transformers_distribution() {
    let g = common::golden_json("sampling_ref.json");
    let s = &g["smol"];
    let model = common::real_model("smollm2-135m");
    let ids = common::token_ids(&s["token_ids"]);
    assert_eq!(
        model.encode(s["prompt"].as_str().unwrap(), false).unwrap(),
        ids,
        "the prompt's tokens"
    );
    let logits = model.next_token_logits(&ids).unwrap();
    for c in s["configs"].as_array().unwrap() {
        let (t, k, p) = (
            c["temperature"].as_f64().unwrap(),
            c["top_k"].as_u64().unwrap() as usize,
            c["top_p"].as_f64().unwrap(),
        );
        let label = format!("smol T {t} top-k {k} top-p {p}");
        if let Some(m) = c["top_p_margin"].as_object() {
            // top-p's cut is decided by more than the logits' rounding could move
            let (before, with) = (m["before"].as_f64().unwrap(), m["with"].as_f64().unwrap());
            assert!(before < p - 1e-3 && with > p + 1e-3, "{label}: {m:?}");
        }
        let mine = warped(&logits, t, k, p);
        assert_cells(
            &format!("{label}: warped attnscope logits vs transformers'"),
            cells_like(&mine, &c["probs"]),
            golden_cells(&c["probs"]),
            Bound::Abs(1e-4),
        );
        let counts = draws_fit(&label, &logits, (t, k, p), &mine);
        misfit_at_wrong_temperature(&label, &counts, &logits, (t, k, p));
    }
    generate_draws_what_pick_draws(model, &ids, &logits);
}

/// `Model::generate`'s first token with seed s is `pick(logits, o, Rng::new(s))` on the prompt's
/// logits: the draws above are generate's.
fn generate_draws_what_pick_draws(model: &attnscope::model::Model, ids: &[u32], logits: &[f32]) {
    for seed in 0..4 {
        let o = GenOptions {
            seed,
            ..options(1.0, 0, 1.0)
        };
        let g = model.generate(ids, &o, |_| {}).unwrap();
        assert_eq!(g.generated.len(), 1);
        assert_eq!(
            g.generated[0].id,
            pick(logits, &o, &mut Rng::new(seed)),
            "seed {seed}"
        );
    }
}
