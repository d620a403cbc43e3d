//! `compare` on tiny generated models: texts, models and precisions side by side.
// index loops over (layer, head, query) read like the maths; nested test types stay inline
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

mod common;

use attnscope::model::tiny::{tiny_model, write_gguf};
use attnscope::model::Arch;
use candle_core::quantized::GgmlDType;
use common::{attnscope, fails_with, stderr_of, succeeds, tiny_gguf};
use std::path::Path;

/// Jensen–Shannon divergence in bits, written again here from the definition.
fn js_bits(p: &[f64], q: &[f64]) -> f64 {
    let n = p.len().max(q.len());
    let at = |r: &[f64], i: usize| r.get(i).copied().unwrap_or(0.0);
    let kl = |a: &dyn Fn(usize) -> f64, m: &dyn Fn(usize) -> f64| {
        (0..n)
            .filter(|&i| a(i) > 0.0)
            .map(|i| a(i) * (a(i) / m(i)).log2())
            .sum::<f64>()
    };
    let m = |i: usize| 0.5 * (at(p, i) + at(q, i));
    0.5 * kl(&|i| at(p, i), &m) + 0.5 * kl(&|i| at(q, i), &m)
}

fn rows_of(side: &serde_json::Value) -> Vec<Vec<Vec<f64>>> {
    serde_json::from_value(side["rows"].clone()).unwrap()
}

/// `compare --model a --model b` with `args` after, asserted to succeed.
fn compare_models(a: &Path, b: &Path, args: &[&str]) -> std::process::Output {
    succeeds(
        attnscope()
            .args(["compare", "--model"])
            .arg(a)
            .arg("--model")
            .arg(b)
            .args(args),
    )
}

#[test]
fn compare_texts_models_and_precisions_on_tiny_models() {
    let dir = tempfile::tempdir().unwrap();
    let m1 = tiny_gguf(&dir);
    let m2 = dir.path().join("other.gguf");
    write_gguf(
        &tiny_model(Arch::Qwen2, 2),
        Arch::Qwen2,
        GgmlDType::F32,
        &m2,
    )
    .unwrap();
    let html = dir.path().join("cmp.html");
    two_texts_on_one_model_and_their_page(&m1, &html);
    one_model_twice_differs_nowhere(&m1);
    two_models_name_the_mode(&m1, &m2);
    two_precisions_of_one_model(&m1);
    what_compare_refuses(&m1);
}

/// Two texts on one model: the JS divergence of each head's rows, the most changed head first, the
/// sink differences; the page `html` is self-contained and not overwritten without --force.
fn two_texts_on_one_model_and_their_page(m1: &Path, html: &Path) {
    let out = succeeds(
        attnscope()
            .args(["compare", "--model", m1.to_str().unwrap()])
            .args(["--text", "the hat at the", "--text", "the cat at the hat"])
            .args(["--json", "--html", html.to_str().unwrap()]),
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["mode"], "texts");
    assert_eq!(v["same_tokens"], false);
    let (ra, rb) = (rows_of(&v["a"]), rows_of(&v["b"]));
    let js: Vec<Vec<f64>> = serde_json::from_value(v["js"].clone()).unwrap();
    let mut want = Vec::new();
    for l in 0..ra.len() {
        for h in 0..ra[l].len() {
            let s: f64 = ra[l][h].iter().sum();
            assert!((s - 1.0).abs() < 1e-4, "A row sums to {s}");
            want.push((vec![l, h], js_bits(&ra[l][h], &rb[l][h])));
        }
    }
    // every (layer, head) of the report against the definition, once each
    common::assert_cells(
        "compare: JS divergence [layer, head] vs by hand",
        common::json_cells(&v["js"]),
        want,
        common::Bound::Abs(1e-6),
    );
    // the most changed head is listed first, and its JS is the largest
    let top = &v["top_changed"][0];
    let max = js.iter().flatten().fold(0.0f64, |a, &b| a.max(b));
    assert_eq!(top["js"].as_f64().unwrap(), max);
    for l in v["layers"].as_array().unwrap() {
        let d = l["sink_all_b"].as_f64().unwrap() - l["sink_all_a"].as_f64().unwrap();
        assert!((l["sink_all_diff"].as_f64().unwrap() - d).abs() < 1e-6);
    }
    let page = std::fs::read_to_string(html).unwrap();
    assert!(page.contains("\"mode\":\"texts\"") && !page.contains("/*ATTNSCOPE_DATA*/"));
    assert!(!page.contains("src=\"http") && !page.contains("href=\"http"));
    // the page is not overwritten without --force
    let again = fails_with(
        attnscope()
            .args(["compare", "--model", m1.to_str().unwrap()])
            .args([
                "--text",
                "a",
                "--text",
                "b",
                "--html",
                html.to_str().unwrap(),
            ]),
        2,
    );
    assert!(again.contains("--force"));
    assert_eq!(std::fs::read_to_string(html).unwrap(), page);
}

/// One model twice: nothing differs.
fn one_model_twice_differs_nowhere(m1: &Path) {
    let out = compare_models(m1, m1, &["--text", "the hat at the", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["mode"], "models");
    assert!(v["js"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|l| l.as_array().unwrap())
        .all(|x| x.as_f64().unwrap() == 0.0));
}

/// Two models with one tokenizer: rows differ, the table names the mode.
fn two_models_name_the_mode(m1: &Path, m2: &Path) {
    let out = compare_models(m1, m2, &["--text", "the hat at the"]);
    let text = String::from_utf8(out.stdout).unwrap();
    for want in [
        "Compare two models",
        "Sink profile per layer",
        "heads whose query rows changed most",
        "Next token",
        "Summary",
    ] {
        assert!(text.contains(want), "compare output lacks {want}:\n{text}");
    }
}

/// Two precisions of one model.
fn two_precisions_of_one_model(m1: &Path) {
    let out = succeeds(
        attnscope()
            .args(["compare", "--model", m1.to_str().unwrap()])
            .args([
                "--precision",
                "exact",
                "--precision",
                "fast",
                "--text",
                "the hat at the",
                "--json",
            ]),
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (
            v["mode"].as_str(),
            v["a"]["precision"].as_str(),
            v["b"]["precision"].as_str()
        ),
        (Some("precisions"), Some("exact"), Some("fast"))
    );
}

/// What compare refuses, with exit 2 and the reason.
fn what_compare_refuses(m1: &Path) {
    for (args, want) in [
        (vec!["--text", "a"], "exactly two of one thing"),
        (
            vec!["--text", "a", "--text", "b", "--text", "c"],
            "exactly two of one thing",
        ),
        (
            vec![
                "--text",
                "a",
                "--text",
                "b",
                "--precision",
                "exact",
                "--precision",
                "fast",
            ],
            "exactly two of one thing",
        ),
        (
            vec!["--text", "a b", "--text", "c d e f", "--query", "3"],
            "query position 3 is out of range",
        ),
    ] {
        let out = attnscope()
            .args(["compare", "--model", m1.to_str().unwrap()])
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr_of(&out));
        assert!(
            stderr_of(&out).contains(want),
            "{args:?}: {}",
            stderr_of(&out)
        );
    }
}
