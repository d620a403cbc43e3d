//! An encoder's view page (issue #41) in a real browser (Debian's chromium driven by
//! playwright-core, as tests/browser.rs): the tiny random BERT (tests/golden/arch/bert), one text
//! and a sentence pair, from the file `view` writes and from `serve`. What the page must show is
//! computed here from the weights: the head view's lines (whole squares: keys after the query
//! too), the pair selector's A→B / B→A / A→A / B→B lines, the text view's row of [CLS] (every
//! token shaded, none greyed out as "after the query"), the note that says why there is no
//! prediction panel. Ignored without a browser unless `ATTNSCOPE_REQUIRE_BROWSER=1`.
#![allow(clippy::needless_range_loop)]

mod common;

use attnscope::model::capture::{AttnCache, CaptureSpec};
use attnscope::model::forward::RunOptions;
use attnscope::model::{Model, Precision};
use common::{browser, start_serve};
use std::path::{Path, PathBuf};

fn run_node(chromium: &str, url: &str, expected: &Path, shot: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser/encoder.mjs");
    let out = std::process::Command::new("node")
        .env("CHROMIUM", chromium)
        .arg(script)
        .arg(url)
        .arg(expected)
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

fn q16(w: f32) -> f32 {
    (w.clamp(0.0, 1.0) * 65535.0).round() / 65535.0
}

/// What the page must show for `text` (and `pair`), from the model's own weights as the page
/// stores them (rounded to 1/65535), in the last layer at the default threshold 0.02.
fn expected(model: &Model, text: &str, pair: Option<&str>) -> serde_json::Value {
    let (tokens, types) = match pair {
        Some(b) => model.encode_pair(text, b).unwrap(),
        None => {
            let t = model.encode(text, false).unwrap();
            let n = t.len();
            (t, vec![0; n])
        }
    };
    let n = tokens.len();
    let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
    let opts = RunOptions {
        token_types: Some(types.clone()),
        ..Default::default()
    };
    model.forward(&tokens, &opts, &mut cache).unwrap();
    let (nl, nh) = (model.dims.n_layers, model.dims.n_heads);
    let p = cache.pattern(nl - 1).unwrap();
    let shown = |h: usize, i: usize, j: usize| q16(p.row_at(h, i).unwrap()[j]) >= 0.02;
    let count = |qs: std::ops::Range<usize>, ks: std::ops::Range<usize>| -> usize {
        (0..nh)
            .map(|h| {
                qs.clone()
                    .map(|i| ks.clone().filter(|&j| shown(h, i, j)).count())
                    .sum::<usize>()
            })
            .sum()
    };
    let b0 = types.iter().position(|&t| t == 1);
    let pair_lines = b0.map(|b| {
        serde_json::json!({
            "AB": count(0..b, b..n), "BA": count(b..n, 0..b),
            "AA": count(0..b, 0..b), "BB": count(b..n, b..n),
        })
    });
    // the text view's default: query 0 ([CLS]), head average of the stored weights
    let text_row: Vec<f32> = (0..n)
        .map(|j| {
            (0..nh)
                .map(|h| q16(p.row_at(h, 0).unwrap()[j]))
                .sum::<f32>()
                / nh as f32
        })
        .collect();
    // the keys after the query are drawn: a causal page would draw none of [CLS]'s lines but one
    let cls_lines = count(0..1, 0..n);
    assert!(
        cls_lines > nh,
        "the check needs [CLS] to attend past itself"
    );
    serde_json::json!({
        "all": count(0..n, 0..n), "row": 18, "pair": pair_lines, "cls_lines": cls_lines,
        "text_row": text_row, "sentence_b_start": b0,
    })
}

#[test]
#[cfg_attr(
    browser_missing,
    ignore = "no browser here (tests/browser/find-browser.sh says what is missing); .ci/run installs one"
)]
fn encoder_view_and_pair_selector_work_in_a_real_browser() {
    let chromium = browser();
    let bert = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/arch/bert");
    let m = bert.to_str().unwrap();
    let model = Model::load(m, Precision::Exact, false).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let artifacts = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/browser-artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let (a, b) = ("What is it?", "The dog was happy, and it sat!");
    for (name, pair) in [("single", None), ("pair", Some(b))] {
        let html = dir.path().join(format!("{name}.html"));
        let mut cmd = assert_cmd::Command::cargo_bin("attnscope").unwrap();
        cmd.write_stdin("")
            .args(["view", "--model", m, "--text", a, "--out"])
            .arg(&html);
        if let Some(p) = pair {
            cmd.args(["--pair", p]);
        }
        cmd.assert().success();
        let exp = dir.path().join(format!("{name}.json"));
        std::fs::write(&exp, expected(&model, a, pair).to_string()).unwrap();
        run_node(
            &chromium,
            &format!("file://{}", html.display()),
            &exp,
            &artifacts.join(format!("view-encoder-{name}.png")),
        );
    }
    // the pair's page from the server
    let (mut child, addr) = start_serve(&["--model", m, "--addr", "127.0.0.1:0"]);
    let base = format!("http://{addr}");
    let exp = dir.path().join("serve.json");
    std::fs::write(&exp, expected(&model, a, Some(b)).to_string()).unwrap();
    let q: String = form_urlencoded::Serializer::new(String::new())
        .append_pair("text", a)
        .append_pair("pair", b)
        .finish();
    run_node(
        &chromium,
        &format!("{base}/view?{q}"),
        &exp,
        &artifacts.join("serve-encoder-pair.png"),
    );
    child.kill().unwrap();
    let _ = child.wait();
}
