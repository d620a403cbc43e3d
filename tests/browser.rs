//! The HTML view in a real browser (Debian's chromium driven by playwright-core): no console
//! errors, no network, the head view draws exactly the lines the weights call for, and hover and
//! head toggles change them; the same page from `attnscope serve`. Screenshots are kept in
//! target/browser-artifacts/. Needs node, chromium and `npm ci` in tests/browser (`.ci/run` does
//! all three), as `tests/browser/find-browser.sh` checks. Without them build.rs marks the test
//! ignored (cargo prints the reason), unless `ATTNSCOPE_REQUIRE_BROWSER=1`, which `.ci/run` sets:
//! then a missing browser fails the test.
// index loops over (layer, head, query) read like the maths; nested test types stay inline
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

mod common;

use assert_cmd::Command;
use attnscope::model::capture::{AttnCache, CaptureSpec};
use attnscope::model::forward::RunOptions;
use attnscope::model::tiny::{tiny_model, write_gguf};
use attnscope::model::{Arch, Model, Precision};
use candle_core::quantized::GgmlDType;
use common::{browser, start_serve};
use std::path::{Path, PathBuf};

fn run_node(chromium: &str, url: &str, expected: &str, shot: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser/view.mjs");
    let out = std::process::Command::new("node")
        .env("CHROMIUM", chromium)
        .arg(script)
        .args([url, expected])
        .arg(shot)
        .output()
        .expect("node runs");
    assert!(
        out.status.success(),
        "browser check of {url} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// target/browser-artifacts (made if missing), where the screenshots and measurements go.
fn artifacts() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/browser-artifacts");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `attnscope view --model GGUF --text TEXT --out HTML`, asserted to succeed.
fn write_view(gguf: &Path, text: &str, html: &Path) {
    Command::cargo_bin("attnscope")
        .unwrap()
        .write_stdin("")
        .args([
            "view",
            "--model",
            gguf.to_str().unwrap(),
            "--text",
            text,
            "--out",
            html.to_str().unwrap(),
        ])
        .assert()
        .success();
}

#[test]
#[cfg_attr(
    browser_missing,
    ignore = "no browser here (tests/browser/find-browser.sh says what is missing); .ci/run installs one"
)]
fn view_works_in_a_real_browser() {
    let chromium = browser();
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny.gguf");
    write_gguf(
        &tiny_model(Arch::Qwen2, 4),
        Arch::Qwen2,
        GgmlDType::F32,
        &gguf,
    )
    .unwrap();
    let text = "the hat at the hat";
    let html = dir.path().join("view.html");
    write_view(&gguf, text, &html);
    // the lines the page must draw at its default threshold 0.02, from the weights themselves
    // (as embedded: quantized to 1/65535)
    let model = Model::load(gguf.to_str().unwrap(), Precision::Exact, false).unwrap();
    let tokens = model.encode(text, false).unwrap();
    let n = tokens.len();
    let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
    model
        .forward(&tokens, &RunOptions::default(), &mut cache)
        .unwrap();
    let p = cache.pattern(1).unwrap();
    let shown = |h: usize, i: usize, j: usize| {
        ((p.row_at(h, i).unwrap()[j] * 65535.0).round() / 65535.0) >= 0.02
    };
    let per_head: Vec<usize> = (0..4)
        .map(|h| {
            (0..n)
                .map(|i| (0..=i).filter(|&j| shown(h, i, j)).count())
                .sum()
        })
        .collect();
    let query = n - 2;
    let query_lines: usize = (0..4)
        .map(|h| (0..=query).filter(|&j| shown(h, query, j)).count())
        .sum();
    let expected = serde_json::json!({"layer": 1, "all": per_head.iter().sum::<usize>(), "per_head": per_head, "query": query, "query_lines": query_lines, "row": 18});
    let exp_path = dir.path().join("expected.json");
    std::fs::write(&exp_path, expected.to_string()).unwrap();
    let artifacts = artifacts();
    run_node(
        &chromium,
        &format!("file://{}", html.display()),
        exp_path.to_str().unwrap(),
        &artifacts.join("view-tiny.png"),
    );

    // the same page from the server
    let (mut child, addr) =
        start_serve(&["--model", gguf.to_str().unwrap(), "--addr", "127.0.0.1:0"]);
    let base = format!("http://{addr}");
    run_node(
        &chromium,
        &format!("{base}/view?text=the+hat+at+the+hat"),
        exp_path.to_str().unwrap(),
        &artifacts.join("serve-tiny.png"),
    );
    child.kill().unwrap();
    let _ = child.wait();
}

fn run_longview(
    chromium: &str,
    url: &str,
    expected: &str,
    out: &Path,
    shot: &Path,
) -> serde_json::Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser/longview.mjs");
    let res = std::process::Command::new("node")
        .env("CHROMIUM", chromium)
        .arg(script)
        .args([url, expected])
        .arg(out)
        .arg(shot)
        .output()
        .expect("node runs");
    assert!(
        res.status.success(),
        "text view check of {url} failed:\n{}\n{}",
        String::from_utf8_lossy(&res.stdout),
        String::from_utf8_lossy(&res.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap()
}

fn q16(w: f32) -> f32 {
    (w.clamp(0.0, 1.0) * 65535.0).round() / 65535.0
}

/// A row as the page keeps it: above 256 tokens the `k` largest weights (ties to the lower
/// position) and the first token's, rounded to 1/65535, the rest of the mass spread evenly;
/// up to 256 tokens every weight, rounded.
fn as_stored(row: &[f32], sparse: bool, k: usize) -> Vec<f32> {
    if !sparse {
        return row.iter().map(|&w| q16(w)).collect();
    }
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    let mut out = vec![f32::NAN; row.len()];
    for &j in idx.iter().take(k) {
        out[j] = q16(row[j]);
    }
    out[0] = q16(row[0]);
    let sum: f32 = out.iter().filter(|x| !x.is_nan()).sum();
    let others = out.iter().filter(|x| x.is_nan()).count();
    let each = if others > 0 {
        (1.0 - sum).max(0.0) / others as f32
    } else {
        0.0
    };
    out.iter()
        .map(|&x| if x.is_nan() { each } else { x })
        .collect()
}

/// The text view, driven in the browser on a tiny model: the values it shades by (weights per head
/// and head-averaged, norm-based, first token hidden) equal what the page promises to store, for a
/// short text (every weight) and a long one (each row's top weights).
#[test]
#[cfg_attr(
    browser_missing,
    ignore = "no browser here (tests/browser/find-browser.sh says what is missing); .ci/run installs one"
)]
fn text_view_shows_what_the_page_stores() {
    let chromium = browser();
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny.gguf");
    write_tiny_with_a_long_context(&gguf);
    let model = Model::load(gguf.to_str().unwrap(), Precision::Exact, false).unwrap();
    let artifacts = artifacts();
    for (label, text) in [
        ("short", "the hat at the hat".to_string()),
        ("long", "the cat sat at the hat. ".repeat(20)),
    ] {
        let tokens = model.encode(&text, false).unwrap();
        let n = tokens.len();
        let captured = Captured::new(&model, &tokens);
        assert_eq!(captured.sparse, label == "long", "{label}: {n} tokens");
        let mut checks = weight_checks(&captured);
        checks.extend(norm_checks(&captured));
        let exp = dir.path().join(format!("{label}.json"));
        std::fs::write(&exp, serde_json::json!({"checks": checks}).to_string()).unwrap();
        let html = dir.path().join(format!("{label}.html"));
        write_view(&gguf, &text, &html);
        let m = run_longview(
            &chromium,
            &format!("file://{}", html.display()),
            exp.to_str().unwrap(),
            &dir.path().join(format!("{label}-m.json")),
            &artifacts.join(format!("textview-tiny-{label}.png")),
        );
        assert_eq!(m["n"].as_u64().unwrap() as usize, n);
    }
}

/// The tiny model with a context of 1,024 tokens, so a text can go past 256, written to `gguf`.
fn write_tiny_with_a_long_context(gguf: &Path) {
    use attnscope::model::tiny::write_gguf_with;
    use candle_core::quantized::gguf_file::Value;
    write_gguf_with(
        &tiny_model(Arch::Qwen2, 4),
        Arch::Qwen2,
        GgmlDType::F32,
        gguf,
        &|md, _| {
            for (k, v) in md.iter_mut() {
                if k.ends_with(".context_length") {
                    *v = Value::U32(1024);
                }
            }
        },
    )
    .unwrap();
}

/// A text's patterns and values on a model, and what the page stores of them (sparse rows above
/// 256 tokens).
struct Captured<'a> {
    model: &'a Model,
    cache: AttnCache,
    n: usize,
    sparse: bool,
}

impl<'a> Captured<'a> {
    fn new(model: &'a Model, tokens: &[u32]) -> Self {
        use attnscope::model::capture::Hook;
        let n = tokens.len();
        let spec = CaptureSpec {
            hooks: vec![Hook::Pattern, Hook::V],
            ..CaptureSpec::patterns()
        };
        let mut cache = AttnCache::new(&spec, n);
        model
            .forward(tokens, &RunOptions::last_logits(n), &mut cache)
            .unwrap();
        Captured {
            model,
            cache,
            n,
            sparse: n > 256,
        }
    }

    /// Head `h`'s weights of query `q` at layer `l` (`h` = -1: their mean over the heads).
    fn row(&self, l: usize, h: isize, q: usize) -> Vec<f32> {
        let d = &self.model.dims;
        let p = self.cache.pattern(l).unwrap();
        if h >= 0 {
            p.row_at(h as usize, q).unwrap()[..=q].to_vec()
        } else {
            (0..=q)
                .map(|j| {
                    (0..d.n_heads)
                        .map(|k| p.row_at(k, q).unwrap()[j])
                        .sum::<f32>()
                        / d.n_heads as f32
                })
                .collect()
        }
    }

    /// [`Captured::row`] as the page stores it: a head's top 6 weights, the mean's top 16.
    fn stored(&self, l: usize, h: isize, q: usize) -> Vec<f32> {
        as_stored(&self.row(l, h, q), self.sparse, if h >= 0 { 6 } else { 16 })
    }

    /// Every head's ‖W_Oʰ vⱼ‖ at layer `l` (`[head, position]`), rounded as the page stores
    /// them (to 1/65535 of the largest).
    fn vnorm(&self, l: usize) -> Vec<f32> {
        use attnscope::analysis::norms::{all_value_norms, Values};
        use attnscope::model::capture::Hook;
        let d = &self.model.dims;
        let v = self.cache.get(l, Hook::V).unwrap();
        let all = all_value_norms(
            self.model,
            l,
            &Values::pos_major(&v.data, self.n, d.n_kv_heads, d.head_dim),
        );
        let max = all.iter().copied().fold(0.0f32, f32::max);
        all.iter().map(|&x| q16(x / max) * max).collect()
    }
}

/// The weights the page must shade by: per head and head-averaged at two queries, and with the
/// first token hidden (its weight 0, the rest renormalized).
fn weight_checks(c: &Captured) -> Vec<serde_json::Value> {
    let mut checks = Vec::new();
    let (q1, q2) = (c.n - 1, c.n / 2);
    for (l, h, q) in [(1usize, 2isize, q1), (0, -1, q2), (1, -1, q1), (0, 3, q2)] {
        checks.push(serde_json::json!({"layer": l, "head": h, "query": q, "measure": "weight", "values": c.stored(l, h, q), "tol": 2e-5}));
    }
    // the first token hidden: its weight 0, the rest renormalized
    let mut r = c.stored(1, 1, q1);
    let rest = 1.0 - r[0];
    r[0] = 0.0;
    r.iter_mut().skip(1).for_each(|x| *x /= rest);
    checks.push(serde_json::json!({"layer": 1, "head": 1, "query": q1, "measure": "weight", "nosink": true, "values": r, "tol": 5e-5}));
    checks
}

/// The norm-based values the page must shade by: α·‖W_Oʰ vⱼ‖ of one head, and its mean over
/// the heads.
fn norm_checks(c: &Captured) -> Vec<serde_json::Value> {
    let mut checks = Vec::new();
    let (q1, q2) = (c.n - 1, c.n / 2);
    for (l, h, q) in [(1usize, 0isize, q1), (0, -1, q2)] {
        let vn = c.vnorm(l);
        let heads: Vec<usize> = if h >= 0 {
            vec![h as usize]
        } else {
            (0..c.model.dims.n_heads).collect()
        };
        let mut vals = vec![0f32; q + 1];
        for &k in &heads {
            let a = c.stored(l, k as isize, q);
            for j in 0..=q {
                vals[j] += a[j] * vn[k * c.n + j] / heads.len() as f32;
            }
        }
        let tol = 1e-4 * vals.iter().copied().fold(1.0f32, f32::max);
        checks.push(serde_json::json!({"layer": l, "head": h, "query": q, "measure": "norm", "values": vals, "tol": tol}));
    }
    checks
}

/// The long-text view on the default model at about 512 and 4,096 tokens (texts from the built-in
/// corpus): the page stays within 50 MB; time to the drawn text view, each layer switch and a
/// query switch are measured in headless Chromium and printed (figures, not assertions: these
/// machines are noisy), and kept in target/browser-artifacts/longview-*.json.
#[test]
#[cfg_attr(
    browser_missing,
    ignore = "no browser here (tests/browser/find-browser.sh says what is missing); .ci/run installs one"
)]
fn long_text_view_is_bounded_and_measured() {
    let chromium = browser();
    let model = Model::load("qwen2.5-coder-0.5b", Precision::Exact, false).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let artifacts = artifacts();
    let sentences = attnscope::analysis::corpus::builtin();
    for target in [512usize, 4096] {
        // whole sentences, as many as fit in `target` tokens
        let mut text = String::new();
        for s in sentences.iter().cycle() {
            let longer = if text.is_empty() {
                s.clone()
            } else {
                format!("{text} {s}")
            };
            if model.encode(&longer, false).unwrap().len() > target {
                break;
            }
            text = longer;
        }
        let n = model.encode(&text, false).unwrap().len();
        assert!(n > target - 80 && n <= target, "{n} tokens for {target}");
        let file = dir.path().join(format!("t{target}.txt"));
        std::fs::write(&file, &text).unwrap();
        let html = dir.path().join(format!("v{target}.html"));
        let t0 = std::time::Instant::now();
        Command::cargo_bin("attnscope")
            .unwrap()
            .write_stdin("")
            .args([
                "view",
                "--file",
                file.to_str().unwrap(),
                "--out",
                html.to_str().unwrap(),
            ])
            .assert()
            .success();
        let write_s = t0.elapsed().as_secs_f64();
        let size = std::fs::metadata(&html).unwrap().len();
        assert!(
            size <= 50_000_000,
            "{n} tokens: the page is {size} bytes, over 50 MB"
        );
        let out = artifacts.join(format!("longview-{target}.json"));
        let m = run_longview(
            &chromium,
            &format!("file://{}", html.display()),
            "-",
            &out,
            &artifacts.join(format!("longview-{target}.png")),
        );
        let sw: Vec<f64> = m["layer_switch_ms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let mut sorted = sw.clone();
        sorted.sort_by(f64::total_cmp);
        eprintln!(
            "MEASURED view of {n} tokens: page {:.1} MB, written in {write_s:.1} s; ready (text view drawn) {:.0} ms after navigation start, first contentful paint {:?} ms; layer switch median {:.0} ms, max {:.0} ms over {} layers; query switch {:.0} ms",
            size as f64 / 1e6,
            m["ready_ms"].as_f64().unwrap(),
            m["first_contentful_paint_ms"].as_f64(),
            sorted[sorted.len() / 2],
            sorted[sorted.len() - 1],
            sw.len(),
            m["query_switch_ms"].as_f64().unwrap()
        );
        let mut doc = m.clone();
        doc["page_bytes"] = size.into();
        doc["write_s"] = write_s.into();
        std::fs::write(&out, doc.to_string()).unwrap();
    }
}

/// The `compare --html` page in the browser: both sides as prose, a click on the divergence grid
/// selects that head and shows the report's JS divergence, the head-average column and the arrow
/// keys move the selection, no console errors and no network.
#[test]
#[cfg_attr(
    browser_missing,
    ignore = "no browser here (tests/browser/find-browser.sh says what is missing); .ci/run installs one"
)]
fn compare_page_works_in_a_real_browser() {
    let chromium = browser();
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny.gguf");
    write_gguf(
        &tiny_model(Arch::Qwen2, 4),
        Arch::Qwen2,
        GgmlDType::F32,
        &gguf,
    )
    .unwrap();
    let html = dir.path().join("cmp.html");
    let out = Command::cargo_bin("attnscope")
        .unwrap()
        .write_stdin("")
        .args([
            "compare",
            "--model",
            gguf.to_str().unwrap(),
            "--text",
            "the hat at the hat",
            "--text",
            "the cat sat at the",
        ])
        .args(["--json", "--html", html.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (l, h) = (1usize, 2usize);
    let expected = serde_json::json!({
        "n_a": v["a"]["tokens"].as_array().unwrap().len(),
        "n_b": v["b"]["tokens"].as_array().unwrap().len(),
        "layer": l, "head": h, "js": v["js"][l][h],
    });
    let exp = dir.path().join("expected.json");
    std::fs::write(&exp, expected.to_string()).unwrap();
    let artifacts = artifacts();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser/compare.mjs");
    let res = std::process::Command::new("node")
        .env("CHROMIUM", &chromium)
        .arg(script)
        .arg(format!("file://{}", html.display()))
        .arg(&exp)
        .arg(artifacts.join("compare-tiny.png"))
        .output()
        .expect("node runs");
    assert!(
        res.status.success(),
        "compare page check failed:\n{}\n{}",
        String::from_utf8_lossy(&res.stdout),
        String::from_utf8_lossy(&res.stderr)
    );
}

/// The page checks' one comparison (`tests/browser/cells.mjs`) fails on what a plain
/// `Math.abs(a - b) > tol` lets through: `+undefined`, a NaN, an infinity, a missing or an
/// extra cell (`tests/browser/cells_check.mjs` runs each case; node only, no browser).
#[test]
#[cfg_attr(
    browser_missing,
    ignore = "no browser here (tests/browser/find-browser.sh says what is missing); .ci/run installs one"
)]
fn page_checks_compare_cell_by_cell() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser/cells_check.mjs");
    let out = std::process::Command::new("node")
        .arg(script)
        .output()
        .expect("node runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.trim() == "ok",
        "cells_check.mjs:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The `circuit --html` page in the browser: the slider steps through the evaluation's ladder,
/// drawing each size's top edges and naming its faithfulness as the report has it; hovering the
/// largest edge names it with its score and exact patch; clicking a head shows its attention
/// row as the page embeds it (adding up to 1, the top key its largest) and its QK split as
/// `attnscope qk --json` gives it; no console errors and no network.
#[test]
#[cfg_attr(
    browser_missing,
    ignore = "no browser here (tests/browser/find-browser.sh says what is missing); .ci/run installs one"
)]
fn circuit_page_works_in_a_real_browser() {
    let chromium = browser();
    let dir = tempfile::tempdir().unwrap();
    let gguf = common::tiny_gguf(&dir);
    let html = dir.path().join("circuit.html");
    let out = Command::cargo_bin("attnscope")
        .unwrap()
        .write_stdin("")
        .args(["circuit", "--model", gguf.to_str().unwrap()])
        .args(["--clean", "abcd", "--corrupt", "abxd", "--answer", "e"])
        .args(["--wrong", "f", "--evaluate", "--exact-edges", "3", "--json"])
        .args(["--html", html.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ladder = v["evaluation"]["ladder"].as_array().unwrap();
    let exact = &v["exact_edges"]["edges"][0];
    assert_eq!(exact["from"], v["edges"][0]["from"]);
    let expected = serde_json::json!({
        "n_edges": v["n_edges"],
        "kept": attnscope::render::circuit_page::MAX_EDGES,
        "sizes": ladder.iter().map(|p| p["edges"].clone()).collect::<Vec<_>>(),
        "faithfulness": ladder.iter().map(|p| p["faithfulness"].clone()).collect::<Vec<_>>(),
        "first": {"from": exact["from"], "to": exact["to"], "score": exact["score"],
                  "exact": exact["exact"]},
    });
    let mut expected = expected;
    expected["head"] = clicked_head_qk(&gguf, &html);
    let exp = dir.path().join("expected.json");
    std::fs::write(&exp, expected.to_string()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser/circuit.mjs");
    let res = std::process::Command::new("node")
        .env("CHROMIUM", &chromium)
        .arg(script)
        .arg(format!("file://{}", html.display()))
        .arg(&exp)
        .arg(artifacts().join("circuit-tiny.png"))
        .output()
        .expect("node runs");
    assert!(
        res.status.success(),
        "circuit page check failed:\n{}\n{}",
        String::from_utf8_lossy(&res.stdout),
        String::from_utf8_lossy(&res.stderr)
    );
}

/// The circuit page's first clickable head (from the data it embeds) and `attnscope qk --json`'s
/// split of its query and key on the page's clean text, computed apart from the page.
fn clicked_head_qk(gguf: &Path, html: &Path) -> serde_json::Value {
    let page = std::fs::read_to_string(html).unwrap();
    let start = page.find("const D = ").expect("the page embeds its data") + "const D = ".len();
    let end = start + page[start..].find(";\n").expect("the data ends");
    let data: serde_json::Value = serde_json::from_str(&page[start..end]).unwrap();
    let h = &data["head_views"]["heads"][0];
    assert!(h.is_object(), "the page has no clickable head");
    let arg = |k: &str| h[k].as_u64().expect("an index").to_string();
    let out = Command::cargo_bin("attnscope")
        .unwrap()
        .write_stdin("")
        .args(["qk", "--model", gguf.to_str().unwrap(), "--text", "abcd"])
        .args(["--layer", &arg("layer"), "--head", &arg("head")])
        .args(["--query", &arg("query"), "--key", &arg("key"), "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::stderr_of(&out));
    let qk: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    serde_json::json!({"name": h["name"], "query": qk["query"], "key": qk["key"],
        "score": qk["score"], "sum": qk["sum"], "gap": qk["gap"],
        "n_terms": qk["terms"].as_array().unwrap().len(),
        "terms": qk["terms"].as_array().unwrap().iter().take(12).collect::<Vec<_>>()})
}
