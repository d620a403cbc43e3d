//! The HTML view in a real browser (Debian's chromium driven by playwright-core): no console
//! errors, no network, the head view draws exactly the lines the weights call for, and hover and
//! head toggles change them; the same page from `attnscope serve`. Screenshots are kept in
//! target/browser-artifacts/. Needs node, chromium and `npm ci` in tests/browser (`.ci/run` does
//! all three), as `tests/browser/find-browser.sh` checks. Without them build.rs marks the test
//! ignored (cargo prints the reason), unless `ATTNSCOPE_REQUIRE_BROWSER=1`, which `.ci/run` sets:
//! then a missing browser fails the test.
// index loops over (layer, head, query) read like the maths; nested test types stay inline
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

use assert_cmd::Command;
use attnscope::model::capture::{AttnCache, CaptureSpec};
use attnscope::model::forward::RunOptions;
use attnscope::model::tiny::{tiny_model, write_gguf};
use attnscope::model::{Arch, Model, Precision};
use candle_core::quantized::GgmlDType;
use std::path::{Path, PathBuf};

/// The chromium executable, by the lookup .ci/run uses too; panics naming what is missing.
fn browser() -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser/find-browser.sh");
    let out = std::process::Command::new("sh")
        .arg(script)
        .output()
        .expect("sh runs");
    assert!(
        out.status.success(),
        "{} (ATTNSCOPE_REQUIRE_BROWSER={:?})",
        String::from_utf8_lossy(&out.stderr).trim(),
        std::env::var("ATTNSCOPE_REQUIRE_BROWSER").ok()
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

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
    let artifacts = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/browser-artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    run_node(
        &chromium,
        &format!("file://{}", html.display()),
        exp_path.to_str().unwrap(),
        &artifacts.join("view-tiny.png"),
    );

    // the same page from the server
    use std::io::BufRead;
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("attnscope"))
        .args([
            "serve",
            "--model",
            gguf.to_str().unwrap(),
            "--addr",
            "127.0.0.1:0",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap()
        .trim_end_matches('/')
        .to_string();
    run_node(
        &chromium,
        &format!("{base}/view?text=the+hat+at+the+hat"),
        exp_path.to_str().unwrap(),
        &artifacts.join("serve-tiny.png"),
    );
    child.kill().unwrap();
    let _ = child.wait();
}
