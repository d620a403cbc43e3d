//! `attnscope attribute` (issue #39): the scores through the command's JSON against torch
//! autograd (tests/golden/*_gradients.json), occlusion against transformers'
//! (smol_faithfulness.json), the methods on a tiny model against the library and by hand, and
//! bad input.

mod common;

use attnscope::model::backward::{Gradient, Metric};
use attnscope::model::config::Arch;
use attnscope::model::tiny::{tiny_model, write_gguf};
use attnscope::model::{Model, Precision};
use candle_core::quantized::GgmlDType;
use std::process::Output;

fn attnscope(args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_attnscope"))
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .unwrap()
}

fn json(args: &[&str]) -> serde_json::Value {
    let out = attnscope(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn scores(v: &serde_json::Value) -> Vec<f64> {
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["score"].as_f64().unwrap())
        .collect()
}

fn flat(v: &serde_json::Value) -> Vec<f64> {
    match v {
        serde_json::Value::Array(a) => a.iter().flat_map(flat).collect(),
        serde_json::Value::Number(n) => vec![n.as_f64().unwrap()],
        _ => panic!("not a number array"),
    }
}

/// The bound against torch autograd, relative to the largest score (as tests/gradients.rs).
const AUTOGRAD: f64 = 3e-4;

/// A command's per-token scores (`tokens[i].score`, a `null` a NaN cell) against a reference's,
/// cell by cell, within `rel` of the reference's largest value.
fn assert_scores(label: &str, v: &serde_json::Value, want: &[f64], rel: f64) -> f64 {
    let got = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, t)| (i, t["score"].as_f64().unwrap_or(f64::NAN)));
    common::assert_cells(
        label,
        got,
        want.iter().copied().enumerate(),
        common::Bound::RelMax(rel),
    )
}

/// A command's log p against a reference's, within 1e-4.
fn assert_logprob(label: &str, got: &serde_json::Value, want: &serde_json::Value) {
    common::assert_cells(
        label,
        [((), got.as_f64().unwrap_or(f64::NAN))],
        [((), want.as_f64().unwrap())],
        common::Bound::Abs(1e-4),
    );
}

/// The lesson sentence's scores from `attribute --json` against torch autograd: gradient norms,
/// gradient × input, attention × gradient (from transformers' patterns and pattern gradients), and
/// integrated gradients (32 midpoints) with the completeness gap against [`common::ig_reference`]'s
/// reference within its bound.
fn against_autograd(alias: &str, short: &str) {
    let refj = common::golden_json(&format!("{short}_gradients.json"));
    let r = &refj["texts"]["lesson"];
    let run = |method: &str| json(&["attribute", "-m", alias, "--method", method, "--json"]);
    let g = run("gradient");
    check_target_logprob_and_tokens(&g, r, short);
    assert_scores(
        &format!("{short} gradient [token] vs autograd"),
        &g,
        &flat(&r["grad_input_l2"]),
        AUTOGRAD,
    );
    assert_scores(
        &format!("{short} grad-x-input [token] vs autograd"),
        &run("grad-x-input"),
        &flat(&r["grad_input_gxi"]),
        AUTOGRAD,
    );
    assert_scores(
        &format!("{short} attention-x-gradient [token] vs autograd"),
        &run("attention-x-gradient"),
        &attention_x_gradient_from_autograd(short, r),
        AUTOGRAD,
    );
    let (want, bound) = common::ig_reference(short, r);
    check_ig_against_reference(alias, short, &want, bound);
}

/// `attribute --method gradient --json` (`g`) explains the reference's target, with its log p,
/// over the lesson's tokens.
fn check_target_logprob_and_tokens(g: &serde_json::Value, r: &serde_json::Value, short: &str) {
    let ids: Vec<u64> = flat(&r["token_ids"]).iter().map(|&v| v as u64).collect();
    assert_eq!(g["method"], "gradient");
    assert_eq!(
        g["target"]["id"].as_f64(),
        r["target_id"].as_f64(),
        "{short}"
    );
    assert_logprob(
        &format!("{short}: log p of the target"),
        &g["logprob"],
        &r["logprob"],
    );
    let got_ids: Vec<u64> = g["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_u64().unwrap())
        .collect();
    assert_eq!(got_ids, ids, "{short}: the lesson's tokens");
}

/// Attention × gradient from transformers' last rows and autograd's pattern gradients: per key,
/// the sum over layers of the mean over heads of `max(0, pattern · ∂f/∂pattern)`.
fn attention_x_gradient_from_autograd(short: &str, r: &serde_json::Value) -> Vec<f64> {
    let (shape, pattern) = common::golden_npy(&format!("{short}_transformers_attn_lastrow.npy"));
    let (layers, heads, n) = (shape[0], shape[1], shape[2]);
    let gp = flat(&r["grad_pattern_last"]);
    assert_eq!(gp.len(), layers * heads * n);
    (0..n)
        .map(|j| {
            (0..layers)
                .map(|l| {
                    (0..heads)
                        .map(|h| {
                            let i = (l * heads + h) * n + j;
                            (gp[i] * pattern[i] as f64).max(0.0)
                        })
                        .sum::<f64>()
                        / heads as f64
                })
                .sum()
        })
        .collect()
}

/// Integrated gradients (32 midpoints) against the reference `r`'s ([`common::ig_reference`]):
/// the scores and the completeness gap within `bound` of the largest score, and of max(|gap|, 1).
fn check_ig_against_reference(alias: &str, short: &str, r: &serde_json::Value, bound: f64) {
    let v = json(&[
        "attribute",
        "-m",
        alias,
        "--method",
        "integrated-gradients",
        "--steps",
        "32",
        "--json",
    ]);
    assert_eq!(v["steps"], 32);
    assert_scores(
        &format!("{short} ig [token] vs the reference"),
        &v,
        &flat(&r["ig"]),
        bound,
    );
    let (gap, want) = (
        v["completeness_gap"].as_f64().unwrap_or(f64::NAN),
        r["ig_completeness_gap"].as_f64().unwrap(),
    );
    let scale = want.abs().max(1.0);
    common::assert_cells(
        &format!("{short}: completeness gap / max(|gap|, 1) vs the reference"),
        [((), gap / scale)],
        [((), want / scale)],
        common::Bound::Abs(bound),
    );
}

#[test]
fn smol_scores_against_autograd() {
    against_autograd("smollm2-135m", "smol");
}

#[test]
fn qwen_scores_against_autograd() {
    against_autograd("qwen2.5-coder-0.5b", "qwen");
}

/// Occlusion = −(transformers' Δ log p when the token is deleted).
#[test]
fn smol_occlusion_against_transformers() {
    let g = common::golden_json("smol_faithfulness.json");
    let v = json(&[
        "attribute",
        "-m",
        "smollm2-135m",
        "--text",
        g["text"].as_str().unwrap(),
        "--target",
        g["target"].as_str().unwrap(),
        "--method",
        "occlusion",
        "--json",
    ]);
    assert_eq!(v["target"]["id"].as_u64(), g["target_id"].as_u64());
    let want: Vec<f64> = flat(&g["loo_delta"]).iter().map(|d| -d).collect();
    assert_scores("smol occlusion [token] vs transformers", &v, &want, 1e-5);
    assert_logprob(
        "smol occlusion: log p of the target",
        &v["logprob"],
        &g["target_logprob"],
    );
}

fn tiny(dir: &tempfile::TempDir) -> (String, Model) {
    let p = dir.path().join("tiny.gguf");
    write_gguf(&tiny_model(Arch::Qwen2, 1), Arch::Qwen2, GgmlDType::F32, &p).unwrap();
    let s = p.to_str().unwrap().to_string();
    let m = Model::load(&s, Precision::Exact, false).unwrap();
    (s, m)
}

const TEXT: &str = "the hat at the cat";

/// Every method on a tiny model: the promised JSON, gradient scores equal to the library's
/// backward, occlusion equal to fresh forwards of the shortened texts, integrated gradients and
/// their gap equal to the midpoint sum recomputed here, for log p and for a logit difference.
#[test]
fn tiny_model_methods() {
    let dir = tempfile::tempdir().unwrap();
    let (m, model) = tiny(&dir);
    let tokens = model.encode(TEXT, false).unwrap();
    let g = model.gradient(&tokens, Metric::LogProb(None)).unwrap();
    let t = Tiny {
        m: &m,
        model: &model,
        tokens,
        g,
    };
    check_gradient_json(&t);
    check_grad_x_input(&t);
    check_attention_x_gradient(&t);
    check_occlusion_equals_fresh_forwards(&t);
    check_integrated_gradients(&t);
    // a logit difference: f = logit(a) − logit(w)
    let (a, w) = (t.g.target, (t.g.target + 1) % model.dims.vocab_size as u32);
    check_logit_difference_integrated_gradients(&t, a, w);
    check_logit_difference_grad_x_input(&t, a, w);
    check_terminal_table(&t);
}

/// The tiny model (`m`, its file), [`TEXT`]'s tokens and the library's gradient of log p(top
/// token) over them.
struct Tiny<'a> {
    m: &'a str,
    model: &'a Model,
    tokens: Vec<u32>,
    g: Gradient,
}

impl Tiny<'_> {
    /// `attribute -m M --text TEXT --json EXTRA`, parsed.
    fn run(&self, extra: &[&str]) -> serde_json::Value {
        let mut a = vec!["attribute", "-m", self.m, "--text", TEXT, "--json"];
        a.extend_from_slice(extra);
        json(&a)
    }

    fn dm(&self) -> usize {
        self.model.dims.d_model
    }
}

/// Per token, `Σ_d ∂f/∂x · x` of the library's gradient.
fn grad_x_input(g: &Gradient, dm: usize) -> Vec<f64> {
    g.grad_input
        .chunks(dm)
        .zip(g.input.chunks(dm))
        .map(|(a, b)| a.iter().zip(b).map(|(a, b)| *a as f64 * *b as f64).sum())
        .collect()
}

/// `--method gradient`: the promised keys, and the scores are the gradient rows' L2 norms.
fn check_gradient_json(t: &Tiny) {
    let v = t.run(&["--method", "gradient"]);
    for key in ["target", "logprob", "method", "tokens", "metric", "value"] {
        assert!(v.get(key).is_some(), "no {key}");
    }
    assert_eq!(v["target"]["id"], t.g.target);
    assert!(v["target"]["text"].is_string());
    let t0 = &v["tokens"][0];
    for key in ["pos", "id", "text", "score"] {
        assert!(t0.get(key).is_some(), "tokens[] lacks {key}");
    }
    assert_eq!(v["tokens"].as_array().unwrap().len(), t.tokens.len());
    let norms: Vec<f64> =
        t.g.grad_input
            .chunks(t.dm())
            .map(|r| r.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt())
            .collect();
    assert_scores("tiny gradient", &v, &norms, 1e-6);
}

fn check_grad_x_input(t: &Tiny) {
    let gxi = grad_x_input(&t.g, t.dm());
    let v = t.run(&["--method", "grad-x-input"]);
    assert_scores("tiny grad-x-input", &v, &gxi, 1e-5);
}

/// Attention × gradient: non-negative, and 0 wherever every layer's pattern is 0 (none here:
/// causal rows of the last query see every key), finite.
fn check_attention_x_gradient(t: &Tiny) {
    let v = t.run(&["--method", "attention-x-gradient"]);
    assert!(scores(&v).iter().all(|s| *s >= 0.0 && s.is_finite()));
    assert!(scores(&v).iter().any(|s| *s > 0.0));
}

/// Occlusion: log p(target | full) − log p(target | without token i), fresh forwards.
fn check_occlusion_equals_fresh_forwards(t: &Tiny) {
    let v = t.run(&["--method", "occlusion"]);
    let lp = |toks: &[u32]| {
        let l = t.model.next_token_logits(toks).unwrap();
        attnscope::model::forward::log_softmax(&l)[t.g.target as usize] as f64
    };
    let (tokens, n) = (&t.tokens, t.tokens.len());
    let full = lp(tokens);
    let want: Vec<f64> = (0..n)
        .map(|i| {
            let shorter: Vec<u32> = (0..n).filter(|&j| j != i).map(|j| tokens[j]).collect();
            full - lp(&shorter)
        })
        .collect();
    assert_scores("tiny occlusion", &v, &want, 1e-4);
}

/// Integrated gradients by hand: the midpoint sum and its completeness gap, recomputed here from
/// the library's gradients at (k + ½)/steps · x (the gap does not vanish as the steps grow: a
/// pre-norm model's f changes mostly near x = 0, where the norm's ε dominates).
fn ig_by_hand(t: &Tiny, metric: Metric, steps: usize) -> (Vec<f64>, f64) {
    let (model, dm) = (t.model, t.dm());
    let (x, _) = model.input_embeddings(&t.tokens).unwrap();
    let mut total = vec![0f64; x.len()];
    for k in 0..steps {
        let a = (k as f32 + 0.5) / steps as f32;
        let xa: Vec<f32> = x.iter().map(|v| v * a).collect();
        let g = model.gradient_from(&xa, metric).unwrap();
        total
            .iter_mut()
            .zip(&g.grad_input)
            .for_each(|(t, g)| *t += *g as f64);
    }
    let s: Vec<f64> = total
        .chunks(dm)
        .zip(x.chunks(dm))
        .map(|(t, x)| t.iter().zip(x).map(|(t, x)| t * *x as f64).sum::<f64>() / steps as f64)
        .collect();
    let fx = model.gradient_from(&x, metric).unwrap().value as f64;
    let f0 = model
        .gradient_from(&vec![0.0; x.len()], metric)
        .unwrap()
        .value as f64;
    let gap = s.iter().sum::<f64>() - (fx - f0);
    (s, gap)
}

/// A command's `completeness_gap` against the one recomputed by hand.
fn assert_gap(v: &serde_json::Value, want_gap: f64) {
    let gap = v["completeness_gap"].as_f64().unwrap();
    assert!(
        (gap - want_gap).abs() < 1e-4 * want_gap.abs().max(1.0),
        "gap {gap} vs {want_gap}"
    );
}

/// Integrated gradients of log p (8 steps) equal the midpoint sum by hand; 1 step is taken too.
fn check_integrated_gradients(t: &Tiny) {
    let v = t.run(&["--method", "integrated-gradients", "--steps", "8"]);
    assert_eq!(v["steps"], 8);
    let (want, want_gap) = ig_by_hand(t, Metric::LogProb(Some(t.g.target)), 8);
    assert_scores("tiny IG", &v, &want, 1e-5);
    assert_gap(&v, want_gap);
    let coarse = t.run(&["--method", "integrated-gradients", "--steps", "1"]);
    assert_eq!(coarse["steps"], 1);
}

/// `--answer a --wrong w`: f = logit(a) − logit(w), its IG by the same midpoints.
fn check_logit_difference_integrated_gradients(t: &Tiny, a: u32, w: u32) {
    let logits = t.model.next_token_logits(&t.tokens).unwrap();
    let (a_s, w_s) = (a.to_string(), w.to_string());
    let v = t.run(&[
        "--method",
        "integrated-gradients",
        "--steps",
        "8",
        "--answer",
        &a_s,
        "--wrong",
        &w_s,
    ]);
    assert_eq!(v["metric"], "logit_diff");
    assert_eq!(v["wrong"]["id"], w);
    let f = (logits[a as usize] - logits[w as usize]) as f64;
    assert!((v["value"].as_f64().unwrap() - f).abs() < 1e-4 * f.abs().max(1.0));
    let (want, want_gap) = ig_by_hand(
        t,
        Metric::LogitDiff {
            answer: a,
            wrong: w,
        },
        8,
    );
    assert_scores("tiny logit-diff IG", &v, &want, 1e-5);
    assert_gap(&v, want_gap);
}

/// `--answer a --wrong w` with gradient × input equals the library's gradient of the difference.
fn check_logit_difference_grad_x_input(t: &Tiny, a: u32, w: u32) {
    let (a_s, w_s) = (a.to_string(), w.to_string());
    let v = t.run(&[
        "--method",
        "grad-x-input",
        "--answer",
        &a_s,
        "--wrong",
        &w_s,
    ]);
    let gd = t
        .model
        .gradient(
            &t.tokens,
            Metric::LogitDiff {
                answer: a,
                wrong: w,
            },
        )
        .unwrap();
    let want = grad_x_input(&gd, t.dm());
    assert_scores("tiny logit-diff grad-x-input", &v, &want, 1e-5);
}

/// The terminal: a table and the shaded text (marks without colour), the gap for IG.
fn check_terminal_table(t: &Tiny) {
    let out = attnscope(&[
        "attribute",
        "-m",
        t.m,
        "--text",
        TEXT,
        "--method",
        "integrated-gradients",
        "--steps",
        "4",
    ]);
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        s.contains("completeness gap") && s.contains("rank") && s.contains("[at]+"),
        "{s}"
    );
    assert!(!s.contains('\x1b'), "NO_COLOR is respected");
}

/// Bad input: a clear error and exit 2.
#[test]
fn bad_input_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (m, _) = tiny(&dir);
    let check = |extra: &[&str], needle: &str| {
        let mut a = vec!["attribute", "-m", &m, "--text", TEXT];
        a.extend_from_slice(extra);
        let out = attnscope(&a);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains(needle), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    };
    check(&["--method", "saliency"], "unknown attribution method");
    check(&["--method", "gradient", "--target", "the hat"], "--target");
    check(
        &["--method", "integrated-gradients", "--steps", "0"],
        "--steps",
    );
    check(
        &["--method", "integrated-gradients", "--steps", "100000"],
        "--steps",
    );
    check(
        &["--method", "gradient", "--target", "5", "--wrong", "5"],
        "--wrong",
    );
    check(&["--method", "gradient", "--wrong", "the hat"], "--wrong");
    check(
        &["--method", "gradient", "--target", "99999999"],
        "--target",
    );
    let out = attnscope(&[
        "attribute",
        "-m",
        &m,
        "--text",
        "x",
        "--method",
        "occlusion",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 2 tokens"));
}

/// `faithfulness` ranks by the gradient methods too, scored like the others.
#[test]
fn faithfulness_has_the_gradient_rankings() {
    let dir = tempfile::tempdir().unwrap();
    let (m, model) = tiny(&dir);
    let v = faithfulness_json(&m, &["--steps", "8"]);
    let tokens = model.encode(TEXT, false).unwrap();
    check_tokens_have_the_gradient_scores(&m, &v, tokens.len());
    check_metrics_rank_by_the_gradients(&v);
    check_gradients_fast_and_none(&m);
    check_steps_refused_and_table(&m);
}

/// `faithfulness -m M --text TEXT EXTRA --json`, parsed.
fn faithfulness_json(m: &str, extra: &[&str]) -> serde_json::Value {
    let head = ["faithfulness", "-m", m, "--text", TEXT];
    let args: [&[&str]; 3] = [&head, extra, &["--json"]];
    json(&args.concat())
}

/// Each of `faithfulness`'s `n` tokens (`v`) has the gradient methods' scores, gradient × input
/// equal to `attribute`'s.
fn check_tokens_have_the_gradient_scores(m: &str, v: &serde_json::Value, n: usize) {
    let a = json(&[
        "attribute",
        "-m",
        m,
        "--text",
        TEXT,
        "--method",
        "grad-x-input",
        "--json",
    ]);
    let toks = v["tokens"].as_array().unwrap();
    assert_eq!(toks.len(), n);
    for (t, s) in toks.iter().zip(scores(&a)) {
        assert!((t["grad_x_input"].as_f64().unwrap() - s).abs() < 1e-6 * s.abs().max(1.0));
        for key in ["gradient", "integrated_gradients", "attention_x_gradient"] {
            assert!(t[key].as_f64().is_some(), "tokens[] lacks {key}");
        }
    }
}

/// Every gradient ranking is scored against the 3 truths, with and without the first token, and
/// the most faithful one is named.
fn check_metrics_rank_by_the_gradients(v: &serde_json::Value) {
    assert!(v["ig_completeness_gap"].as_f64().is_some());
    for r in [
        "gradient",
        "grad_x_input",
        "integrated_gradients",
        "attention_x_gradient",
    ] {
        let rows: Vec<_> = v["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|x| x["ranking"] == r)
            .collect();
        assert_eq!(
            rows.len(),
            6,
            "{r}: 3 truths × with/without the first token"
        );
        assert!(rows.iter().all(|x| x.get("spearman").is_some()));
    }
    let best = &v["most_faithful"];
    assert!(best["ranking"].is_string() && best["spearman"].is_f64());
}

/// `--gradients fast` leaves integrated gradients out, `--gradients none` every gradient.
fn check_gradients_fast_and_none(m: &str) {
    let fast = faithfulness_json(m, &["--gradients", "fast"]);
    assert!(fast["tokens"][0].get("integrated_gradients").is_none());
    assert!(fast["tokens"][0]["gradient"].is_f64());
    let none = faithfulness_json(m, &["--gradients", "none"]);
    assert!(none["tokens"][0].get("gradient").is_none());
}

/// `--steps 0` is refused; the terminal table has the gradient columns.
fn check_steps_refused_and_table(m: &str) {
    common::run_err(["faithfulness", "-m", m, "--text", TEXT, "--steps", "0"], 2);
    let table = common::run_ok(["faithfulness", "-m", m, "--text", TEXT, "--steps", "2"]);
    let s = String::from_utf8_lossy(&table.stdout);
    assert!(
        s.contains("attn×grad") && s.contains("integrated_gradients"),
        "{s}"
    );
}
