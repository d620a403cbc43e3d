//! Interventions on the pages: `view --ablate` (the ablation panel: a layers × heads grid of
//! Δ log p and a table, a click selecting the head in the attention views) and `patch --html`
//! (the patching heatmap, a click showing a cell's numbers). The numbers on a page are the ones
//! `ablate --json` and `patch --json` print, on a tiny model and on the real SmolLM2; the clicks
//! are driven in a real browser (tests/browser/ablation.mjs, as tests/browser.rs runs its pages).

mod common;
use assert_cmd::Command;
use attnscope::model::tiny::{tiny_model, write_gguf};
use attnscope::model::Arch;
use candle_core::quantized::GgmlDType;
use common::{browser, run_ok as ok, succeeds};
use serde_json::Value;
use std::path::{Path, PathBuf};

const TEXT: &str = "the hat at the hat";

fn tiny() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_gguf(
        &tiny_model(Arch::Qwen2, 4),
        Arch::Qwen2,
        GgmlDType::F32,
        &path,
    )
    .unwrap();
    let p = path.to_str().unwrap().to_string();
    (dir, p)
}

fn attnscope(args: &[&str]) -> std::process::Output {
    common::attnscope().args(args).output().unwrap()
}

/// The data a view page embeds (`const D = {...}`), read back as JSON.
fn page_data(html: &str) -> Value {
    let at = html.find("const D = ").expect("the page embeds its data") + "const D = ".len();
    serde_json::Deserializer::from_str(&html[at..])
        .into_iter::<Value>()
        .next()
        .unwrap()
        .unwrap()
}

/// The report a patch page embeds.
fn patch_data(html: &str) -> Value {
    let start = "<script type=\"application/json\" id=\"report\">";
    let at = html.find(start).expect("the patch page embeds its report") + start.len();
    let end = at + html[at..].find("</script>").unwrap();
    serde_json::from_str(&html[at..end]).unwrap()
}

/// `view --ablate ...` and `ablate --json ...` on the same model and text: the page's panel holds
/// the report `ablate` prints, number for number.
fn view_and_ablate(model: &str, text: &str, view_extra: &[&str], ablate_extra: &[&str]) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let html = dir.path().join("view.html");
    let mut args = vec![
        "view",
        "--model",
        model,
        "--text",
        text,
        "--out",
        html.to_str().unwrap(),
    ];
    args.extend(view_extra);
    ok(&args);
    let page = std::fs::read_to_string(&html).unwrap();
    let d = page_data(&page);
    let mut args = vec!["ablate", "--model", model, "--text", text, "--json"];
    args.extend(ablate_extra);
    let want: Value = serde_json::from_slice(&ok(&args).stdout).unwrap();
    let got = &d["ablation"];
    assert!(got.is_object(), "the page has no ablation report");
    let heads = got["heads"].as_array().unwrap();
    let (nl, nh) = (
        d["n_layers"].as_u64().unwrap() as usize,
        d["n_heads"].as_u64().unwrap() as usize,
    );
    assert_eq!(heads.len(), nl * nh);
    assert_eq!(heads.len(), want["heads"].as_array().unwrap().len());
    for (g, w) in heads.iter().zip(want["heads"].as_array().unwrap()) {
        for k in [
            "layer",
            "head",
            "delta_logprob",
            "kl",
            "max_weight",
            "argmax",
            "sink",
            "entropy",
        ] {
            assert_eq!(g[k], w[k], "{k} of head {}.{}", w["layer"], w["head"]);
        }
    }
    // every (layer, head) once: what a click on the grid or the table selects
    let mut seen = vec![false; nl * nh];
    for h in heads {
        let (l, k) = (
            h["layer"].as_u64().unwrap() as usize,
            h["head"].as_u64().unwrap() as usize,
        );
        assert!(l < nl && k < nh && !seen[l * nh + k], "{l}.{k}");
        seen[l * nh + k] = true;
    }
    for k in [
        "correlations",
        "target",
        "baseline_logprob",
        "method",
        "query",
        "positions",
        "forward_passes",
        "layer_rows",
        "layer_rows_from_scratch",
    ] {
        assert_eq!(got[k], want[k], "{k}");
    }
    assert!(
        page.contains("async function selectHead(l, h)")
            && page.contains("selectHead(+tr.dataset.l, +tr.dataset.h)")
            && page.contains("selectHead(+td.dataset.l, +td.dataset.h)"),
        "the grid and the table select the head"
    );
    want
}

#[test]
fn view_ablation_panel_holds_what_ablate_prints() {
    let (_dir, model) = tiny();
    let r = view_and_ablate(&model, TEXT, &["--ablate"], &[]);
    assert_eq!(r["method"], "zero");
    let r = view_and_ablate(&model, TEXT, &["--ablate", "mean"], &["--method", "mean"]);
    assert_eq!(r["method"], "mean");
    // a chosen target, beside the faithfulness panel (which measures the same token)
    let r = view_and_ablate(
        &model,
        TEXT,
        &["--ablate=zero", "--target", "104", "--faithfulness"],
        &["--target", "104"],
    );
    assert_eq!(r["target"]["id"], 104);
}

#[test]
fn view_ablation_refuses_what_it_cannot_do() {
    let (dir, model) = tiny();
    let out_path = dir.path().join("v.html");
    let out = out_path.to_str().unwrap();
    let r = attnscope(&[
        "view", "--model", &model, "--text", TEXT, "--out", out, "--ablate", "half",
    ]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    assert!(
        err.contains("half") && err.contains("zero") && err.contains("mean"),
        "{err}"
    );
    let r = attnscope(&[
        "view", "--model", &model, "--text", TEXT, "--out", out, "--target", "104",
    ]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--ablate") && err.contains("--faithfulness"),
        "{err}"
    );
    assert!(!out_path.exists());
    // without --ablate the page has no panel data
    ok(["view", "--model", &model, "--text", TEXT, "--out", out]);
    let d = page_data(&std::fs::read_to_string(&out_path).unwrap());
    assert!(d["ablation"].is_null());
    // the API: ablate_method names the valid values
    let e = attnscope::commands::view::ablate_method("Zero").unwrap_err();
    assert!(format!("{e}").contains("`zero`") && attnscope::analysis::request::is_bad_input(&e));
}

/// `patch` of the clean text against the corrupted one at `hook`, writing its page to `html`.
fn patch_to_page(model: &str, hook: &str, html: &Path) -> Command {
    let mut c = common::attnscope();
    c.args([
        "patch",
        "--model",
        model,
        "--clean",
        "the hat at the hat",
        "--corrupt",
        "the cat at the hat",
        "--answer",
        "104",
        "--wrong",
        "99",
        "--hook",
        hook,
        "--html",
    ])
    .arg(html);
    c
}

/// Runs `patch --json --html` and checks the page holds every result's numbers.
fn patch_page_holds_the_report(model: &str, hook: &str, html: &Path) -> (Value, String) {
    let out = succeeds(patch_to_page(model, hook, html).arg("--json"));
    let want: Value = serde_json::from_slice(&out.stdout).unwrap();
    let page = std::fs::read_to_string(html).unwrap();
    assert_eq!(patch_data(&page), want, "the page embeds the report");
    let results = want["results"].as_array().unwrap();
    assert!(!results.is_empty());
    for (i, c) in results.iter().enumerate() {
        // the cell as written in the table: data-recovered holds the f32 itself
        let key = format!("data-i=\"{i}\" data-l=\"{}\"", c["layer"]);
        let at = page.find(&key).unwrap_or_else(|| panic!("no cell {i}"));
        let cell = &page[at..at + page[at..].find('>').unwrap()];
        let col = if hook == "z" || hook == "pattern" {
            format!("data-h=\"{}\"", c["head"])
        } else {
            format!("data-p=\"{}\"", c["pos"])
        };
        assert!(cell.contains(&col), "{cell}");
        let v: f32 = cell
            .split("data-recovered=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(v, c["recovered"].as_f64().unwrap() as f32, "cell {i}");
        assert!(
            cell.contains(&format!("recovered {:.4}", v)),
            "the hover names it: {cell}"
        );
    }
    for k in ["clean_logit_diff", "corrupt_logit_diff"] {
        assert!(page.contains(&format!("{:+.4}", want[k].as_f64().unwrap() as f32)));
    }
    (want, page)
}

#[test]
fn patch_page_holds_every_result_and_refuses_to_overwrite() {
    let (dir, model) = tiny();
    for hook in ["resid-pre", "attn-out", "mlp-out", "z", "pattern"] {
        let html = dir.path().join(format!("{hook}.html"));
        let (r, page) = patch_page_holds_the_report(&model, hook, &html);
        let per_head = hook == "z" || hook == "pattern";
        assert_eq!(page.contains(">h3</th>"), per_head, "{hook}");
        if !per_head {
            // the token labels, and the corrupted token where it differs
            assert!(page.contains("<span class=\"tok\">hat</span>") || page.contains("hat"));
            assert!(page.contains("class=\"diff\""));
        }
        assert!(r["results"].as_array().unwrap().len() > 1);
        // a second run refuses to overwrite the page, before running anything
        let before = std::fs::read(&html).unwrap();
        let out = patch_to_page(&model, hook, &html).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("already exists"), "{err}");
        assert!(out.stdout.is_empty(), "nothing printed after a refusal");
        assert_eq!(std::fs::read(&html).unwrap(), before);
    }
}

/// On the real SmolLM2: the view's ablation panel holds `ablate --json`'s numbers.
#[test]
fn view_ablation_on_smollm_equals_ablate() {
    common::real_model("smollm2-135m"); // fetched if it is not in the cache
    let r = view_and_ablate(
        "smollm2-135m",
        "The capital of France is",
        &["--ablate"],
        &[],
    );
    assert_eq!(r["heads"].as_array().unwrap().len(), 30 * 9);
    // the effects are not all zero: removing some head moves log p(target)
    assert!(r["heads"]
        .as_array()
        .unwrap()
        .iter()
        .any(|h| h["delta_logprob"].as_f64().unwrap().abs() > 1e-3));
}

/// In headless Chromium: a click on the top row of the ablation table selects that head in the
/// text view, the head view and the large map, a click on a grid cell another one, a click on a
/// column sorts by it; a click on a patch page's cell shows that cell's numbers.
#[test]
#[cfg_attr(
    browser_missing,
    ignore = "no browser here (tests/browser/find-browser.sh says what is missing); .ci/run installs one"
)]
fn ablation_and_patch_pages_click_through_in_a_real_browser() {
    let chromium = browser();
    let (dir, model) = tiny();
    let view = dir.path().join("view.html");
    ok([
        "view",
        "--model",
        &model,
        "--text",
        TEXT,
        "--ablate",
        "--out",
        view.to_str().unwrap(),
    ]);
    let d = page_data(&std::fs::read_to_string(&view).unwrap());
    let heads = d["ablation"]["heads"].as_array().unwrap().clone();
    let f = |h: &Value, k: &str| h[k].as_f64().unwrap();
    // the table's order: |Δ log p| largest first, ties to the earlier head (as `ablate` prints)
    let mut order: Vec<usize> = (0..heads.len()).collect();
    order.sort_by(|&a, &b| {
        f(&heads[b], "delta_logprob")
            .abs()
            .total_cmp(&f(&heads[a], "delta_logprob").abs())
            .then(a.cmp(&b))
    });
    let lh = |i: usize| serde_json::json!({"layer": heads[i]["layer"], "head": heads[i]["head"], "delta": heads[i]["delta_logprob"]});
    let mut by_kl: Vec<usize> = (0..heads.len()).collect();
    by_kl.sort_by(|&a, &b| {
        f(&heads[b], "kl")
            .total_cmp(&f(&heads[a], "kl"))
            .then(a.cmp(&b))
    });
    // a grid cell other than the top row's
    let other = order[heads.len() - 1];
    let mut patches = Vec::new();
    for hook in ["resid-pre", "z"] {
        let html = dir.path().join(format!("patch-{hook}.html"));
        let (r, _) = patch_page_holds_the_report(&model, hook, &html);
        let results = r["results"].as_array().unwrap();
        let i = results.len() / 2 + 1;
        patches.push(serde_json::json!({
            "url": format!("file://{}", html.display()),
            "i": i,
            "cell": results[i],
            "cells": results.len(),
        }));
    }
    let expected = serde_json::json!({
        "view": format!("file://{}", view.display()),
        "layers": d["n_layers"], "heads": d["n_heads"],
        "top": lh(order[0]), "other": lh(other), "top_kl": lh(by_kl[0]),
        "patches": patches,
    });
    let exp = dir.path().join("expected.json");
    std::fs::write(&exp, expected.to_string()).unwrap();
    let artifacts = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/browser-artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser/ablation.mjs");
    let res = std::process::Command::new("node")
        .env("CHROMIUM", &chromium)
        .arg(script)
        .arg(&exp)
        .arg(&artifacts)
        .output()
        .expect("node runs");
    assert!(
        res.status.success(),
        "ablation and patch page check failed:\n{}\n{}",
        String::from_utf8_lossy(&res.stdout),
        String::from_utf8_lossy(&res.stderr)
    );
}
