//! The `attnscope` command on tiny generated models: output, JSON, exit codes and messages.
// index loops over (layer, head, query) read like the maths; nested test types stay inline
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

use assert_cmd::Command;
use attnscope::model::tiny::{tiny_model, write_gguf};
use attnscope::model::Arch;
use candle_core::quantized::GgmlDType;
use std::path::PathBuf;

fn attnscope() -> Command {
    let mut c = Command::cargo_bin("attnscope").unwrap();
    c.write_stdin("");
    c
}

fn tiny_gguf(dir: &tempfile::TempDir) -> PathBuf {
    let p = dir.path().join("tiny.gguf");
    write_gguf(&tiny_model(Arch::Qwen2, 1), Arch::Qwen2, GgmlDType::F32, &p).unwrap();
    p
}

fn stderr_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn explain_prints_every_step_and_is_deterministic() {
    let a = attnscope().arg("explain").output().unwrap();
    assert!(a.status.success());
    let s = String::from_utf8(a.stdout.clone()).unwrap();
    for part in [
        "X (5 × 4)",
        "W_Q",
        "W_K",
        "W_V",
        "Q (5 × 4)",
        "K (5 × 4)",
        "V (5 × 4)",
        "Scores Q·Kᵀ",
        "Scaled scores",
        "Masked scores",
        "-inf",
        "Weights = softmax",
        "Y = weights · V",
        "Causal mask",
        "✓",
        "✗",
        "Why divide by √d",
        "head dim 64; query heads 0-6 share KV set 0, 7-13 share KV set 1",
    ] {
        assert!(s.contains(part), "explain output lacks {part:?}");
    }
    let b = attnscope().arg("explain").output().unwrap();
    assert_eq!(a.stdout, b.stdout, "explain must be deterministic");
    let other = attnscope()
        .args(["explain", "--seed", "2"])
        .output()
        .unwrap();
    assert_ne!(a.stdout, other.stdout);
}

#[test]
fn explain_json_rows_sum_to_one() {
    let out = attnscope()
        .args(["explain", "--json", "--d", "3", "--text", "a b c d"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for row in v["weights"].as_array().unwrap() {
        let s: f64 = row
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .sum();
        assert!((s - 1.0).abs() < 1e-5);
    }
    assert_eq!(v["masked_scores"][0][1], "-inf");
    assert_eq!(v["X"].as_array().unwrap().len(), 4);
    assert_eq!(v["heads"]["kv_set_of_head"][7], 1);
}

#[test]
fn explain_rejects_bad_shapes() {
    let out = attnscope()
        .args(["explain", "--heads", "14", "--kv-heads", "3"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr_of(&out).contains("not a multiple of --kv-heads 3"));
}

#[test]
fn cost_shows_sixteen_times_for_four_times_the_length() {
    let out = attnscope()
        .args(["cost", "4096", "16384"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let s = String::from_utf8(out.stdout).unwrap();
    assert!(s.contains("16.0x"), "{s}");
    let v: serde_json::Value = serde_json::from_slice(
        &attnscope()
            .args(["cost", "4096", "16384", "--json"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    assert_eq!(v["lengths"][1]["growth_vs_previous"], 16.0);
    assert_eq!(v["lengths"][0]["bytes_per_head"], 4.0 * 4096.0 * 4096.0);
    assert_eq!(v["lengths"][0]["causal_pairs"], 4096.0 * 4097.0 / 2.0);
}

/// The element-wise loops run at the widest vector width the CPU has, chosen at run time
/// (`ATTNSCOPE_SIMD` caps it): every width prints the same report, bit for bit.
#[test]
fn every_vector_width_prints_the_same_report() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    // long enough for rows of many 16-wide lanes plus a remainder
    let text = "the cat sat on the mat and the hat sat on the cat ".repeat(6);
    let run = |simd: Option<&str>| {
        let mut c = attnscope();
        c.args([
            "inspect",
            "--model",
            m.to_str().unwrap(),
            "--text",
            &text,
            "--json",
            "--heads",
            "all",
        ]);
        c.env_remove("ATTNSCOPE_SIMD");
        if let Some(l) = simd {
            c.env("ATTNSCOPE_SIMD", l);
        }
        let out = c.output().unwrap();
        assert!(out.status.success(), "{}", stderr_of(&out));
        let mut v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        // everything but the wall times
        assert!(v.as_object_mut().unwrap().remove("timings").is_some());
        v
    };
    let widest = run(None);
    assert_eq!(widest["heads"].as_array().unwrap().len(), 4);
    for l in ["avx2", "base"] {
        assert!(
            run(Some(l)) == widest,
            "ATTNSCOPE_SIMD={l} changed the report"
        );
    }
}

#[test]
fn inspect_json_on_tiny_model() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let out = attnscope()
        .args([
            "inspect",
            "--model",
            m.to_str().unwrap(),
            "--text",
            "the hat",
            "--json",
            "--heads",
            "all",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["model"]["n_heads"], 4);
    assert_eq!(v["model"]["n_kv_heads"], 2);
    let n = v["tokens"].as_array().unwrap().len();
    assert_eq!(v["query"], n - 1);
    assert_eq!(v["heads"].as_array().unwrap().len(), 4);
    assert_eq!(v["heads"][3]["kv_head"], 1);
    assert_eq!(v["layers"].as_array().unwrap().len(), 2);
    assert!(v["layers"][0]["top"].is_array());
    assert_eq!(v["next_token"].as_array().unwrap().len(), 5);
    let text = attnscope()
        .args([
            "inspect",
            "--model",
            m.to_str().unwrap(),
            "--text",
            "the hat",
        ])
        .output()
        .unwrap();
    let s = String::from_utf8(text.stdout).unwrap();
    for part in [
        "1. Model",
        "2. Tokens",
        "3. Causal mask",
        "4. Layer 1",
        "5. Head-averaged",
        "6. What each key moves",
        "7. Attention sink",
        "8. The model's answer",
        "9. Caution",
    ] {
        assert!(s.contains(part), "inspect output lacks {part:?}");
    }
}

#[test]
fn inspect_out_of_range_values_name_the_valid_range() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let m = m.to_str().unwrap();
    for (args, msg) in [
        (
            vec!["--layer", "2"],
            "layer 2 is out of range: valid layers are 0..=1",
        ),
        (vec!["--query", "50"], "query position 50 is out of range"),
        (
            vec!["--heads", "0-4"],
            "head 4 is out of range: head must be in 0..=3",
        ),
        (vec!["--top", "0"], "--top 0 is out of range"),
        (vec!["--layers", "x"], "not a valid layer list"),
    ] {
        let out = attnscope()
            .args(["inspect", "--model", m, "--text", "the hat"])
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            stderr_of(&out).contains(msg),
            "{args:?}: {}",
            stderr_of(&out)
        );
    }
}

#[test]
fn bad_models_and_texts_get_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let missing = attnscope()
        .args(["inspect", "--model", "/nonexistent/model.gguf"])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(stderr_of(&missing).contains("does not exist"));
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"this is not a model at all").unwrap();
    let out = attnscope()
        .args(["info", "--model", junk.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr_of(&out).contains("is not a GGUF or safetensors model"));
    let empty = attnscope()
        .args(["inspect", "--model", m.to_str().unwrap(), "--text", "   "])
        .output()
        .unwrap();
    assert_eq!(empty.status.code(), Some(2));
    assert!(stderr_of(&empty).contains("text is empty"));
    let long = "the ".repeat(300);
    let out = attnscope()
        .args(["inspect", "--model", m.to_str().unwrap(), "--text", &long])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr_of(&out).contains("has a context of 256 tokens"),
        "{}",
        stderr_of(&out)
    );
    let bad_utf8 = dir.path().join("bad.txt");
    std::fs::write(&bad_utf8, [b'a', 0xff, b'b']).unwrap();
    let out = attnscope()
        .args([
            "inspect",
            "--model",
            m.to_str().unwrap(),
            "--file",
            bad_utf8.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr_of(&out).contains("not valid UTF-8"));
}

#[test]
fn capture_writes_safetensors_and_refuses_to_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let out_path = dir.path().join("a.safetensors");
    let run = |force: bool| {
        let mut c = attnscope();
        c.args([
            "capture",
            "--model",
            m.to_str().unwrap(),
            "--text",
            "the hat",
            "--hooks",
            "pattern,k",
            "--out",
            out_path.to_str().unwrap(),
        ]);
        if force {
            c.arg("--force");
        }
        c.output().unwrap()
    };
    assert!(run(false).status.success());
    let bytes = std::fs::read(&out_path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let p = st.tensor("blocks.1.attn.hook_pattern").unwrap();
    assert_eq!(p.shape()[0], 4);
    assert_eq!(st.tensor("blocks.0.attn.hook_k").unwrap().shape()[1], 2);
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let md = meta.metadata().clone().unwrap();
    let ids: Vec<u32> = serde_json::from_str(&md["token_ids"]).unwrap();
    assert_eq!(ids.len(), p.shape()[1]);
    assert_eq!(md["precision"], "exact");
    // a second run without --force keeps the first file untouched
    std::fs::write(&out_path, b"precious").unwrap();
    let again = run(false);
    assert_eq!(again.status.code(), Some(2));
    assert!(stderr_of(&again).contains("--force"));
    assert_eq!(std::fs::read(&out_path).unwrap(), b"precious");
    assert!(run(true).status.success());
}

#[test]
fn help_explains_every_subcommand() {
    let out = attnscope().arg("--help").output().unwrap();
    let s = String::from_utf8(out.stdout).unwrap();
    for sub in [
        "explain",
        "cost",
        "inspect",
        "faithfulness",
        "corpus",
        "sinks",
        "scaling",
        "bench",
        "view",
        "heatmap",
        "serve",
        "info",
        "capture",
        "fetch",
        "compare",
        "heads",
    ] {
        assert!(s.contains(sub), "--help lacks {sub}");
        let h = attnscope().args([sub, "--help"]).output().unwrap();
        assert!(h.status.success() && h.stdout.len() > 200, "{sub} --help");
    }
}

#[test]
fn faithfulness_json_has_the_promised_fields() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let out = attnscope()
        .args([
            "faithfulness",
            "--model",
            m.to_str().unwrap(),
            "--text",
            "the hat at the",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["target"]["logprob"].as_f64().unwrap() < 0.0);
    let toks = v["tokens"].as_array().unwrap();
    for key in [
        "pos",
        "id",
        "text",
        "attention_last",
        "attention_mean",
        "rollout",
        "norm_last",
        "norm_mean",
        "loo",
        "replace",
        "knockout",
    ] {
        assert!(toks[0].get(key).is_some(), "tokens[] lacks {key}");
    }
    // norm-based attention: non-negative, and the layer-averaged shares sum to 1
    assert!(toks.iter().all(|t| t["norm_last"].as_f64().unwrap() >= 0.0));
    let shares: f64 = toks.iter().map(|t| t["norm_mean"].as_f64().unwrap()).sum();
    assert!((shares - 1.0).abs() < 1e-4, "norm_mean sums to {shares}");
    // the query's own position cannot be knocked out (a token always sees itself): n/a, not 0
    assert!(toks.last().unwrap()["knockout"].is_null());
    assert!(toks[..toks.len() - 1]
        .iter()
        .all(|t| t["knockout"].as_f64().is_some()));
    let rollout: f64 = toks.iter().map(|t| t["rollout"].as_f64().unwrap()).sum();
    assert!((rollout - 1.0).abs() < 1e-4, "rollout row sums to 1");
    let metrics = v["metrics"].as_array().unwrap();
    let rankings: std::collections::BTreeSet<&str> = metrics
        .iter()
        .map(|m| m["ranking"].as_str().unwrap())
        .collect();
    for r in [
        "attention_last",
        "attention_mean",
        "rollout",
        "norm_last",
        "norm_mean",
        "random",
        "head_0",
        "head_3",
    ] {
        assert!(rankings.contains(r), "metrics lack ranking {r}");
    }
    assert!(metrics.iter().any(|m| m["without_first"] == true));
    // n and permutation p-values beside ρ and τ; knockout ranks one token fewer (no query)
    let n_tok = toks.len() as u64;
    for m in metrics
        .iter()
        .filter(|m| m["without_first"] == false && m["ranking"] == "attention_last")
    {
        let want = if m["truth"] == "knockout" {
            n_tok - 1
        } else {
            n_tok
        };
        assert_eq!(m["n"].as_u64().unwrap(), want, "{m}");
        if m["spearman"].is_f64() {
            let p = m["spearman_p"].as_f64().unwrap();
            assert!(p > 0.0 && p <= 1.0, "{m}");
        }
    }
    // the table prints n/a for the query's knockout and the p-values
    let table = attnscope()
        .args([
            "faithfulness",
            "--model",
            m.to_str().unwrap(),
            "--text",
            "the hat at the hat",
        ])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.contains("n/a (query)") && table.contains("(p "),
        "{table}"
    );
    assert!(
        metrics[0]["comprehensiveness"].get("1").is_some()
            && metrics[0]["sufficiency"].get("5").is_some()
    );
    let bad = attnscope()
        .args([
            "faithfulness",
            "--model",
            m.to_str().unwrap(),
            "--text",
            "the hat",
            "--target",
            "99999",
        ])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
}

#[test]
fn corpus_shards_merge_to_the_single_run_and_resume() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let m = m.to_str().unwrap();
    let texts = dir.path().join("texts.txt");
    std::fs::write(
        &texts,
        "the hat\nat the the\nhe sat\n\nthe the the at\nhat\n",
    )
    .unwrap();
    let run = |extra: &[&str]| {
        let out = attnscope()
            .args([
                "corpus",
                "--model",
                m,
                "--file",
                texts.to_str().unwrap(),
                "--json",
            ])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr_of(&out));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let single = run(&[]);
    assert_eq!(single["sentences"], 5);
    let (a, b) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    run(&["--shard", "0/2", "--out", a.to_str().unwrap()]);
    let b_first = run(&["--shard", "1/2", "--out", b.to_str().unwrap()]);
    assert_eq!(b_first["sentences"], 2);
    // resume: a second run with the same --out adds nothing
    run(&["--shard", "1/2", "--out", b.to_str().unwrap()]);
    assert_eq!(std::fs::read_to_string(&b).unwrap().lines().count(), 2);
    // a run killed in the middle of a line: the torn line is dropped (and said), the complete
    // one kept, and the resumed file equals the uninterrupted one
    let whole = std::fs::read_to_string(&b).unwrap();
    let cut = whole.find('\n').unwrap() + 1 + 40;
    std::fs::write(&b, &whole[..cut]).unwrap();
    let out = attnscope()
        .args([
            "corpus",
            "--model",
            m,
            "--file",
            texts.to_str().unwrap(),
            "--json",
            "--shard",
            "1/2",
            "--out",
            b.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("torn line"), "{}", stderr_of(&out));
    assert_eq!(std::fs::read_to_string(&b).unwrap(), whole);
    // a last record whose newline was lost is kept, and the next record starts on its own line
    std::fs::write(
        &b,
        whole
            .trim_end_matches('\n')
            .split_inclusive('\n')
            .next()
            .unwrap()
            .trim_end(),
    )
    .unwrap();
    run(&["--shard", "1/2", "--out", b.to_str().unwrap()]);
    assert_eq!(std::fs::read_to_string(&b).unwrap(), whole);
    // a file that is not ours is refused, not cut
    let other = dir.path().join("other.jsonl");
    std::fs::write(&other, "{\"hello\": 1}\n{\"id\": 3, \"te").unwrap();
    let out = attnscope()
        .args([
            "corpus",
            "--model",
            m,
            "--file",
            texts.to_str().unwrap(),
            "--out",
            other.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        std::fs::read_to_string(&other).unwrap(),
        "{\"hello\": 1}\n{\"id\": 3, \"te"
    );
    let merged = attnscope()
        .args([
            "corpus",
            "merge",
            a.to_str().unwrap(),
            b.to_str().unwrap(),
            "--json",
        ])
        .output()
        .unwrap();
    assert!(merged.status.success(), "{}", stderr_of(&merged));
    let merged: serde_json::Value = serde_json::from_slice(&merged.stdout).unwrap();
    assert_eq!(merged, single, "merged shards must equal the single run");
    let bad = attnscope()
        .args(["corpus", "--model", m, "--shard", "2/2"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
}

/// A panic in attnscope's own loading (here the packing, made to panic with ATTNSCOPE_FAULT) is
/// reported as attnscope's bug with exit code 70 (EX_SOFTWARE), never as the user's corrupt
/// file (exit 2, "fetch it again"), which is what the loader boundary said before it wrapped
/// only the third-party readers; a truly corrupt file still gets exit 2 and its message.
#[test]
fn an_internal_panic_is_reported_as_a_bug_not_as_a_bad_file() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let run = |fault: Option<&str>, model: &std::path::Path| {
        let mut c = attnscope();
        c.args(["inspect", "--model"])
            .arg(model)
            .args(["--text", "the hat"]);
        c.env("ATTNSCOPE_PANEL_CACHE", "off");
        match fault {
            Some(f) => c.env("ATTNSCOPE_FAULT", f),
            None => c.env_remove("ATTNSCOPE_FAULT"),
        };
        c.output().unwrap()
    };
    let ok = run(None, &m);
    assert_eq!(ok.status.code(), Some(0), "{}", stderr_of(&ok));
    let bug = run(Some("pack"), &m);
    let err = stderr_of(&bug);
    assert_eq!(bug.status.code(), Some(70), "{err}");
    assert!(
        err.contains("internal error: fault injected at `pack`")
            && err.contains("this is a bug in attnscope")
            && err.contains("not a problem with your input or your model file"),
        "{err}"
    );
    for blame in ["corrupt", "fetch it again", "truncated", "panicked at"] {
        assert!(
            !err.contains(blame),
            "the bug is blamed on the file ({blame}): {err}"
        );
    }
    assert!(bug.stdout.is_empty());
    // a damaged file is still the file's: exit 2, the file named
    let bytes = std::fs::read(&m).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let bad = run(None, &cut);
    assert_eq!(bad.status.code(), Some(2), "{}", stderr_of(&bad));
    assert!(stderr_of(&bad).contains("cut.gguf"), "{}", stderr_of(&bad));
}

/// `attnscope cache list --json` names each packed-weight cache file's model, layout and size
/// (with the total and the cap, ATTNSCOPE_PANEL_CACHE_MAX_GB), and `cache clear` removes one
/// model's files (by a path to it) or all of them; ATTNSCOPE_CACHE points at a temporary folder.
#[test]
fn cache_list_and_clear() {
    use attnscope::model::panels::Settings;
    let dir = tempfile::tempdir().unwrap();
    // the cache writes no file that would leave less than SPARE_BYTES free: the test needs
    // that much and the tiny models' few MB
    let free = attnscope::model::panels::free_bytes(dir.path());
    assert!(
        free.is_none_or(|f| f > attnscope::model::panels::SPARE_BYTES + (64 << 20)),
        "cache_list_and_clear needs 1 GiB + 64 MiB free on the disk holding {} for the packed-weight cache to write its files; it has {} MiB",
        dir.path().display(),
        free.unwrap_or(0) >> 20
    );
    let (a, b) = (dir.path().join("a.gguf"), dir.path().join("b.gguf"));
    write_gguf(&tiny_model(Arch::Qwen2, 1), Arch::Qwen2, GgmlDType::F32, &a).unwrap();
    write_gguf(&tiny_model(Arch::Llama, 2), Arch::Llama, GgmlDType::F32, &b).unwrap();
    // the tiny models are under the command line's 64 MB floor: written through the library
    let settings = Settings {
        dir: dir.path().join("panels"),
        min_bytes: 0,
        max_bytes: u64::MAX,
    };
    let mut written = Vec::new();
    for m in [&a, &b] {
        let model = attnscope::model::Model::load_with(
            m.to_str().unwrap(),
            attnscope::model::Precision::Exact,
            false,
            Some(&settings),
        )
        .unwrap();
        let file = model.panel_file().unwrap_or_else(|| {
            panic!(
                "{} was loaded but no packed-weight file was written (its note on stderr says why)",
                m.display()
            )
        });
        written.push(file.to_path_buf());
    }
    let cache = |args: &[&str]| {
        let out = attnscope()
            .arg("cache")
            .args(args)
            .env("ATTNSCOPE_CACHE", dir.path())
            .env("ATTNSCOPE_PANEL_CACHE_MAX_GB", "0.5")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr_of(&out));
        String::from_utf8(out.stdout).unwrap()
    };
    let listed: serde_json::Value = serde_json::from_str(&cache(&["list", "--json"])).unwrap();
    assert_eq!(listed["max_bytes"], 1u64 << 29);
    let files = listed["files"].as_array().unwrap();
    assert_eq!(files.len(), 2, "{listed}");
    let mut models: Vec<&str> = files.iter().map(|f| f["model"].as_str().unwrap()).collect();
    models.sort();
    assert_eq!(models, ["a.gguf", "b.gguf"]);
    let layout =
        attnscope::model::weights::PanelLayout::of(attnscope::model::Precision::Exact).name();
    let mut total = 0;
    for f in files {
        assert_eq!(f["layout"], layout.as_str());
        let path = std::path::PathBuf::from(f["path"].as_str().unwrap());
        assert_eq!(f["bytes"], std::fs::metadata(&path).unwrap().len());
        assert_eq!(f["usable"], true);
        total += f["bytes"].as_u64().unwrap();
    }
    assert_eq!(listed["total_bytes"], total);
    let text = cache(&["list"]);
    assert!(
        text.contains("a.gguf") && text.contains("2 files"),
        "{text}"
    );
    // one model's, by another path to it
    let link = dir.path().join("link-to-a.gguf");
    std::fs::hard_link(&a, &link).unwrap();
    let out = cache(&["clear", "--model", link.to_str().unwrap()]);
    assert!(out.starts_with("removed 1 files"), "{out}");
    assert!(!written[0].exists() && written[1].exists());
    let out = cache(&["clear"]);
    assert!(out.starts_with("removed 1 files"), "{out}");
    assert!(!written[1].exists());
    let listed: serde_json::Value = serde_json::from_str(&cache(&["list", "--json"])).unwrap();
    assert_eq!(listed["files"].as_array().unwrap().len(), 0);
}

/// A corpus record (what `corpus --out` writes) with `layers` layers of `heads` heads.
fn corpus_record(
    id: usize,
    text: &str,
    model: &str,
    layers: usize,
    heads: usize,
) -> serde_json::Value {
    let per_head = vec![vec![0.5f32; heads]; layers];
    serde_json::json!({
        "id": id, "text": text, "model": model, "n_tokens": 3,
        "sink_query": vec![0.4f32; layers], "sink_all": vec![0.6f32; layers],
        "head_alpha1": per_head, "head_max_last": per_head, "head_mean_max": per_head,
        "head_mean_entropy": per_head,
        "next_token_id": 1, "next_token": "x", "next_token_prob": 0.5,
    })
}

/// `corpus merge` checks every record and refuses (exit 2, naming the file and line) a record
/// whose arrays disagree with its layer count or with the other records (it used to panic, exit
/// 101), an empty profile, another model, and an id that names two different texts (it used to
/// merge them silently); a repeated record of the same text is merged once.
#[test]
fn corpus_merge_refuses_records_that_do_not_agree() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("a.jsonl");
    let lines = |rs: &[serde_json::Value]| rs.iter().map(|r| format!("{r}\n")).collect::<String>();
    std::fs::write(
        &good,
        lines(&[
            corpus_record(0, "the hat", "m", 2, 3),
            corpus_record(1, "he sat", "m", 2, 3),
        ]),
    )
    .unwrap();
    let merge = |second: &str| {
        let b = dir.path().join("b.jsonl");
        std::fs::write(&b, second).unwrap();
        attnscope()
            .args(["corpus", "merge", "--json"])
            .arg(&good)
            .arg(&b)
            .output()
            .unwrap()
    };
    // the same record again (a resumed shard) and a new one: merged, the repeat once
    let ok = merge(&lines(&[
        corpus_record(1, "he sat", "m", 2, 3),
        corpus_record(2, "at", "m", 2, 3),
    ]));
    assert_eq!(ok.status.code(), Some(0), "{}", stderr_of(&ok));
    let agg: serde_json::Value = serde_json::from_slice(&ok.stdout).unwrap();
    assert_eq!(agg["sentences"], 3);
    let mut short_query = corpus_record(3, "hat", "m", 2, 3);
    short_query["sink_query"] = serde_json::json!([0.4]);
    let mut ragged_heads = corpus_record(3, "hat", "m", 2, 3);
    ragged_heads["head_max_last"][1] = serde_json::json!([0.5, 0.5]);
    let empty = corpus_record(3, "hat", "m", 0, 3);
    let cases: [(serde_json::Value, &str); 6] = [
        (
            short_query,
            "`sink_query` has 1 layers but `sink_all` has 2",
        ),
        (ragged_heads, "layer 1 of `head_max_last` has 2 heads"),
        (empty, "its profile is empty"),
        // every array one layer shorter than the other records'
        (
            corpus_record(3, "hat", "m", 1, 3),
            "(1 layers, 3 heads), but",
        ),
        (
            corpus_record(3, "hat", "m", 2, 2),
            "(2 layers, 2 heads), but",
        ),
        (corpus_record(3, "hat", "other", 2, 3), "from model `other`"),
    ];
    for (bad, want) in cases {
        let out = merge(&lines(&[corpus_record(2, "at", "m", 2, 3), bad]));
        let err = stderr_of(&out);
        assert_eq!(out.status.code(), Some(2), "{want}: {err}");
        assert!(
            err.contains("b.jsonl:2:"),
            "{want}: the file and line: {err}"
        );
        assert!(err.contains(want), "{want}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // one id, two texts: both places are named
    let out = merge(&lines(&[corpus_record(1, "a different text", "m", 2, 3)]));
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("b.jsonl:1: record 1 is for the text \"a different text\"")
            && err.contains("a.jsonl:2 has record 1 for \"he sat\""),
        "{err}"
    );
    // no records at all
    let out = merge("\n");
    assert_eq!(
        out.status.code(),
        Some(0),
        "a.jsonl still holds records: {}",
        stderr_of(&out)
    );
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let out = attnscope()
        .args(["corpus", "merge"])
        .arg(&empty)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    assert!(
        stderr_of(&out).contains("hold no records"),
        "{}",
        stderr_of(&out)
    );
}

fn http_get(addr: &str, target: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    write!(s, "GET {target} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    (
        head.lines().next().unwrap_or("").to_string(),
        body.to_string(),
    )
}

fn start_serve(args: &[&str]) -> (std::process::Child, String) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("attnscope"))
        .arg("serve")
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .split("http://")
        .nth(1)
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_string();
    (child, addr)
}

fn raw_request(addr: &str, request: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.lines().next().unwrap_or("").to_string()
}

/// The whole answer to a request (status line, headers and body), read to the end.
fn raw_answer(addr: &str, request: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// The hardened server, without sleeps or timings: past its queue (here --max-concurrent 1 and
/// --queue 0, held by a client that has not finished its request) a request gets 503 with
/// Retry-After and the reason, and the place comes back once that client is answered; a client
/// that dribbles its request is cut off by the overall deadline (408) however often it sends;
/// a Host that is not this server (DNS rebinding) is refused; --bos reaches the page;
/// faithfulness is capped in tokens.
#[test]
fn serve_limits_slow_clients_hosts_and_load() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let (mut child, addr) = start_serve(&[
        "--model",
        m.to_str().unwrap(),
        "--addr",
        "127.0.0.1:0",
        "--max-concurrent",
        "1",
        "--queue",
        "0",
        "--request-timeout",
        "600",
        "--bos",
        "--max-faithfulness-tokens",
        "8",
    ]);
    // a client that has sent half its request holds the only place (the server accepts in
    // order, and this connection was made first) ...
    let mut holder = std::net::TcpStream::connect(&addr).unwrap();
    holder
        .write_all(b"GET /view?text=the+hat HTTP/1.1\r\nHost: localhost\r\n")
        .unwrap();
    // ... so the next request is refused at once, with when to come back and why
    let busy = raw_answer(&addr, &format!("GET / HTTP/1.1\r\nHost: {addr}\r\n\r\n"));
    assert!(busy.starts_with("HTTP/1.1 503"), "{busy}");
    assert!(busy.contains("\r\nRetry-After: "), "{busy}");
    assert!(
        busy.contains("its queue is full") && busy.contains("--queue 0"),
        "{busy}"
    );
    // the holder finishes its request and is answered; then the place is free again
    holder.write_all(b"\r\n").unwrap();
    let mut answer = String::new();
    holder.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let (status, body) = http_get(&addr, "/view?text=the+hat");
    assert!(status.contains("200"), "the place came back: {status}");
    // --bos: the page has one token more than the text
    let plain = attnscope()
        .args([
            "inspect",
            "--model",
            m.to_str().unwrap(),
            "--text",
            "the hat",
            "--json",
        ])
        .output()
        .unwrap();
    let n: usize = serde_json::from_slice::<serde_json::Value>(&plain.stdout).unwrap()["tokens"]
        .as_array()
        .unwrap()
        .len();
    assert!(
        body.contains(&format!("· {} tokens", n + 1)),
        "--bos did not reach the page (text has {n} tokens)"
    );
    // hosts
    for host in ["evil.example", "evil.example:80", "localhost.evil.example"] {
        let status = raw_request(&addr, &format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n"));
        assert!(status.contains("421"), "{host}: {status}");
    }
    assert!(
        raw_request(&addr, "GET / HTTP/1.1\r\n\r\n").contains("400"),
        "no Host"
    );
    assert!(raw_request(&addr, "GET / HTTP/1.1\r\nHost: localhost\r\n\r\n").contains("200"));
    // faithfulness beyond the cap is refused with the reason; below it, it runs
    let (status, body) = http_get(
        &addr,
        "/view?text=the+hat+at+the+hat+at+the+hat+at+the+hat&faithfulness=1",
    );
    assert!(
        status.contains("413") && body.contains("--max-faithfulness-tokens"),
        "{status}"
    );
    let (status, _) = http_get(&addr, "/view?text=the&faithfulness=1");
    assert!(status.contains("200"), "{status}");
    child.kill().unwrap();
    let _ = child.wait();

    // a client that dribbles a byte at a time: each byte comes well within any read timeout,
    // but the overall deadline (1 s) cuts it off with 408. The dribbling stops when the answer
    // arrives (an event); the cap on bytes (~100 s of dribbling) only turns a server that
    // never cuts it off into a failure instead of a hang.
    let (mut child, addr) = start_serve(&[
        "--model",
        m.to_str().unwrap(),
        "--addr",
        "127.0.0.1:0",
        "--request-timeout",
        "1",
    ]);
    let mut slow = std::net::TcpStream::connect(&addr).unwrap();
    let mut reader = slow.try_clone().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut out = String::new();
        let _ = reader.read_to_string(&mut out);
        let _ = tx.send(out);
    });
    slow.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        .unwrap();
    let mut sent = 0;
    let answer = loop {
        match rx.recv_timeout(std::time::Duration::from_millis(50)) {
            Ok(a) => break a,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(e) => panic!("{e}"),
        }
        // the server may close first; the answer is then on its way to the reader
        let _ = slow.write_all(b"a");
        sent += 1;
        assert!(sent < 2000, "a dribbling client was never cut off");
    };
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("--request-timeout"), "{answer}");
    // its place came back
    let (status, _) = http_get(&addr, "/view?text=the+hat");
    assert!(status.contains("200"), "{status}");
    child.kill().unwrap();
    let _ = child.wait();
}

/// The server under load: 16 clients on loopback each send 8 requests, one after another,
/// to a server that computes 2 pages at a time: every request is answered (none lost), and
/// each with its page (the queue holds them all, and a page of the tiny model takes
/// milliseconds against the 30 s deadline) or, were the machine too slow, a 503 that says why
/// and when to come back. The server's peak memory stays bounded (Linux: VmHWM).
#[test]
fn serve_queues_concurrent_clients_and_answers_every_request() {
    const CLIENTS: usize = 16;
    const REQUESTS: usize = 8;
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let (mut child, addr) = start_serve(&[
        "--model",
        m.to_str().unwrap(),
        "--addr",
        "127.0.0.1:0",
        "--max-concurrent",
        "2",
    ]);
    let t = std::time::Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let a = addr.clone();
            std::thread::spawn(move || {
                (0..REQUESTS)
                    .map(|r| {
                        raw_answer(
                            &a,
                            &format!("GET /view?text=the+hat+{c}+at+{r} HTTP/1.1\r\nHost: localhost\r\n\r\n"),
                        )
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let answers: Vec<String> = clients
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    let took = t.elapsed();
    assert_eq!(answers.len(), CLIENTS * REQUESTS);
    let (mut ok, mut refused) = (0, 0);
    for a in &answers {
        if a.starts_with("HTTP/1.1 200") {
            assert!(a.contains("Head view"), "a 200 without its page");
            ok += 1;
        } else {
            assert!(
                a.starts_with("HTTP/1.1 503")
                    && a.contains("Retry-After: ")
                    && a.contains("the server is busy"),
                "an answer that is neither a page nor a refusal with a reason: {:?}",
                a.lines().next()
            );
            refused += 1;
        }
    }
    let peak_kb = std::fs::read_to_string(format!("/proc/{}/status", child.id()))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        });
    eprintln!(
        "serve load: {} requests from {CLIENTS} clients: {ok} pages, {refused} refused, in {took:?}; server peak memory {peak_kb:?} kB",
        answers.len()
    );
    assert_eq!(
        ok,
        CLIENTS * REQUESTS,
        "{refused} refused although the queue holds every client"
    );
    if let Some(kb) = peak_kb {
        assert!(kb < 1 << 20, "the server's peak memory is {kb} kB");
    }
    child.kill().unwrap();
    let _ = child.wait();
}

/// `serve` answers on loopback, survives 100 sequential requests and 8 concurrent ones, and
/// answers bad requests with a page that says what is wrong.
#[test]
fn serve_survives_sequential_and_concurrent_requests() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("attnscope"))
        .args([
            "serve",
            "--model",
            m.to_str().unwrap(),
            "--addr",
            "127.0.0.1:0",
            "--max-concurrent",
            "16",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .split("http://")
        .nth(1)
        .unwrap()
        .trim()
        .trim_end_matches('/')
        .trim_end_matches(" (Ctrl-C to stop)")
        .trim_end_matches('/')
        .to_string();
    let addr = addr.split('/').next().unwrap().to_string();
    let (status, body) = http_get(&addr, "/");
    assert!(status.contains("200") && body.contains("<form"), "{status}");
    for i in 0..100 {
        let (status, body) = http_get(&addr, &format!("/view?text=the+hat+{i}"));
        assert!(status.contains("200"), "request {i}: {status}");
        assert!(body.contains("Head view") && body.contains("\"n_heads\":4"));
    }
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let a = addr.clone();
            std::thread::spawn(move || http_get(&a, &format!("/view?text=at+the+{i}")))
        })
        .collect();
    for h in handles {
        let (status, body) = h.join().unwrap();
        assert!(
            status.contains("200") && body.contains("Head view"),
            "a concurrent request failed: {status}"
        );
    }
    let (status, body) = http_get(&addr, "/view?text=%20%20");
    assert!(
        status.contains("400") && body.contains("text is empty"),
        "{status}"
    );
    let (status, body) = http_get(&addr, &format!("/view?text={}", "a".repeat(3000)));
    assert!(
        status.contains("413") && body.contains("at most 2000"),
        "{status}"
    );
    let (status, _) = http_get(&addr, "/nothing");
    assert!(status.contains("404"));
    let (status, _) = http_get(&addr, "/");
    assert!(status.contains("200"), "still serving after all that");
    child.kill().unwrap();
    let _ = child.wait();
}

/// The streamed sink profile (`sinks`, online softmax over key blocks of 7) equals the one
/// `inspect` computes from materialized weights, on the same text.
#[test]
fn sinks_streamed_equal_inspect_materialized() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let text = "the hat at the the hat he sat at the hat the at he the hat sat";
    let f = dir.path().join("long.txt");
    std::fs::write(&f, text).unwrap();
    let s = attnscope()
        .args([
            "sinks",
            "--model",
            m.to_str().unwrap(),
            "--file",
            f.to_str().unwrap(),
            "--key-block",
            "7",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(s.status.success(), "{}", stderr_of(&s));
    let s: serde_json::Value = serde_json::from_slice(&s.stdout).unwrap();
    let i = attnscope()
        .args([
            "inspect",
            "--model",
            m.to_str().unwrap(),
            "--file",
            f.to_str().unwrap(),
            "--json",
        ])
        .output()
        .unwrap();
    let i: serde_json::Value = serde_json::from_slice(&i.stdout).unwrap();
    for l in 0..2 {
        let a = s["layers"][l]["sink_all_queries"].as_f64().unwrap();
        let b = i["layers"][l]["sink_all_queries"].as_f64().unwrap();
        assert!(
            (a - b).abs() < 1e-5,
            "layer {l}: streamed {a} vs materialized {b}"
        );
        let a = s["layers"][l]["sink_last_query"].as_f64().unwrap();
        let b = i["layers"][l]["sink_query"].as_f64().unwrap();
        assert!((a - b).abs() < 1e-5, "layer {l} last query: {a} vs {b}");
    }
    assert_eq!(s["layers"][0]["heads"].as_array().unwrap().len(), 4);
    assert!(s["peak_rss_bytes"].as_u64().unwrap() > 0);
}

#[test]
fn scaling_reports_exponents() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let out = attnscope()
        .args([
            "scaling",
            "--model",
            m.to_str().unwrap(),
            "--lengths",
            "16,32,64",
            "--repeats",
            "1",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["rows"].as_array().unwrap().len(), 3);
    assert!(
        v["exponents"]["attention"].as_f64().is_some()
            && v["exponents"]["projections"].as_f64().is_some()
    );
    assert!(v["rows"][2]["capture"]["median_s"].as_f64().unwrap() > 0.0);
    assert!(v["threads"].as_u64().unwrap() >= 1);
    let bad = attnscope()
        .args([
            "scaling",
            "--model",
            m.to_str().unwrap(),
            "--lengths",
            "100000",
        ])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
}

#[test]
fn view_and_heatmap_write_their_files() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let html = dir.path().join("v.html");
    let out = attnscope()
        .args([
            "view",
            "--model",
            m.to_str().unwrap(),
            "--text",
            "the hat",
            "--out",
            html.to_str().unwrap(),
            "--faithfulness",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(
        page.contains("\"n_heads\":4")
            && page.contains("\"faithfulness\":{")
            && page.contains("Head view")
    );
    assert!(
        !page.contains("src=\"http") && !page.contains("<link"),
        "self-contained"
    );
    let png = dir.path().join("h.png");
    let out = attnscope()
        .args([
            "heatmap",
            "--model",
            m.to_str().unwrap(),
            "--text",
            "the hat",
            "--layer",
            "1",
            "--head",
            "2",
            "--out",
            png.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert_eq!(&std::fs::read(&png).unwrap()[..4], b"\x89PNG");
    let svg = dir.path().join("h.svg");
    assert!(attnscope()
        .args([
            "heatmap",
            "--model",
            m.to_str().unwrap(),
            "--text",
            "the hat",
            "--layer",
            "0",
            "--out",
            svg.to_str().unwrap()
        ])
        .output()
        .unwrap()
        .status
        .success());
    assert!(std::fs::read_to_string(&svg)
        .unwrap()
        .contains("mean of heads"));
    let bad = attnscope()
        .args([
            "heatmap",
            "--model",
            m.to_str().unwrap(),
            "--layer",
            "0",
            "--out",
            "x.jpg",
        ])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let bad = attnscope()
        .args([
            "heatmap",
            "--model",
            m.to_str().unwrap(),
            "--layer",
            "0",
            "--head",
            "9",
            "--out",
            dir.path().join("y.png").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(stderr_of(&bad).contains("head 9 is out of range"));
}

/// `capture` streams each layer to the file as it is produced. Every hook of every layer, as
/// .safetensors (read with the safetensors crate) and as .npz (read with the zip crate, each
/// member parsed as .npy), equals what an in-process forward captures; for a subset of heads,
/// queries and layers too.
#[test]
fn streamed_capture_equals_the_in_memory_cache_in_both_formats() {
    use attnscope::model::capture::{AttnCache, CaptureSpec, Hook, Queries};
    use attnscope::model::forward::RunOptions;
    use attnscope::model::{Model, Precision};
    use std::io::Read;
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let model = Model::load(m.to_str().unwrap(), Precision::Exact, false).unwrap();
    let text = "the hat sat on the mat";
    let tokens = model.encode(text, false).unwrap();
    let n = tokens.len();
    for (case, (hooks_arg, layers, heads, queries)) in [
        ("all", "all", "all", "all"),
        ("pattern,scores,z", "1", "1,3", "0,2"),
        // hook_embed belongs to layer 0 and ln_final to the last (written after it)
        ("embed,ln_final,result,ln1", "0,1", "2", "all"),
        ("all", "1", "all", "1,3"),
    ]
    .into_iter()
    .enumerate()
    {
        let hooks = Hook::parse_list(hooks_arg).unwrap();
        let spec = CaptureSpec {
            hooks: hooks.clone(),
            layers: Some(attnscope::analysis::request::parse_index_list(layers, 2, "layer").unwrap()),
            heads: Some(attnscope::analysis::request::parse_index_list(heads, 4, "head").unwrap()),
            queries: if queries == "all" {
                Queries::All
            } else {
                Queries::List(attnscope::analysis::request::parse_index_list(queries, n, "q").unwrap())
            },
        };
        let mut cache = AttnCache::new(&spec, n);
        model
            .forward(&tokens, &RunOptions::default(), &mut cache)
            .unwrap();
        assert!(!cache.entries.is_empty());
        for ext in ["safetensors", "npz"] {
            let out = dir.path().join(format!("c-{case}.{ext}"));
            // the same tensors when each layer waits for its writing (the default) as when the
            // writing runs on into the next layer (`--two-layers`)
            let overlapped = dir.path().join(format!("t-{case}.{ext}"));
            for (path, flag) in [(&out, None), (&overlapped, Some("--two-layers"))] {
                let r = attnscope()
                    .args([
                        "capture",
                        "-m",
                        m.to_str().unwrap(),
                        "--text",
                        text,
                        "--hooks",
                        hooks_arg,
                        "--layers",
                        layers,
                        "--heads",
                        heads,
                        "--queries",
                        queries,
                        "--out",
                        path.to_str().unwrap(),
                    ])
                    .args(flag)
                    .output()
                    .unwrap();
                assert!(r.status.success(), "{}", stderr_of(&r));
            }
            for (writer, path) in [("waiting", &out), ("--two-layers", &overlapped)] {
                let bytes = std::fs::read(path).unwrap();
                let ext = format!("{ext} ({writer} writer)");
                let mut got: std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)> =
                    Default::default();
                if ext.starts_with("safetensors") {
                    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
                    for (name, t) in st.tensors() {
                        let data = t
                            .data()
                            .chunks(4)
                            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                            .collect();
                        got.insert(name, (t.shape().to_vec(), data));
                    }
                } else {
                    let mut z = zip::ZipArchive::new(std::io::Cursor::new(&bytes)).unwrap();
                    for i in 0..z.len() {
                        let mut f = z.by_index(i).unwrap();
                        let name = f.name().unwrap().trim_end_matches(".npy").to_string();
                        let mut body = Vec::new();
                        f.read_to_end(&mut body).unwrap(); // the zip crate checks each member's CRC-32
                        got.insert(name, attnscope::render::npy::from_npy(&body).unwrap());
                    }
                    let ids = got.remove("token_ids").expect("npz carries the token ids");
                    assert_eq!(ids.1, tokens.iter().map(|&t| t as f32).collect::<Vec<_>>());
                }
                assert_eq!(
                    got.len(),
                    cache.entries.len(),
                    "{ext}: tensors {:?}",
                    got.keys().collect::<Vec<_>>()
                );
                for c in cache.iter() {
                    let (shape, data) = got
                        .get(&c.name)
                        .unwrap_or_else(|| panic!("{ext}: {} missing", c.name));
                    assert_eq!(shape, &c.shape, "{ext}: {} shape", c.name);
                    assert_eq!(data.len(), c.data.len());
                    // bit-identical: the same forward, the same numbers
                    assert!(
                        data.iter()
                            .zip(&c.data)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{ext}: {} differs",
                        c.name
                    );
                }
            }
        }
    }
}

/// `bench` on a tiny model: every part is measured and reported as positive rates and times,
/// the child processes (`capture`, `inspect`) run and report their own peak memory.
#[test]
fn bench_reports_rates_forwards_and_commands() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let out = attnscope()
        .args([
            "bench",
            "-m",
            m.to_str().unwrap(),
            "--lengths",
            "8,16",
            "--repeats",
            "1",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["kernel_peak_gflops"].as_f64().unwrap() > 0.0);
    assert!(
        ["avx512", "avx2+fma", "baseline"].contains(&v["simd"].as_str().unwrap()),
        "{}",
        v["simd"]
    );
    assert_eq!(v["gemm"].as_array().unwrap().len(), 4);
    for g in v["gemm"].as_array().unwrap() {
        assert!(
            g["attnscope_gflops"].as_f64().unwrap() > 0.0
                && g["candle_gflops"].as_f64().unwrap() > 0.0
        );
    }
    let f = v["forward"].as_array().unwrap();
    assert_eq!(
        f.iter()
            .map(|r| r["n"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        vec![8, 16]
    );
    for r in f {
        assert!(
            r["forward_s"].as_f64().unwrap() > 0.0
                && r["projections_gflops"].as_f64().unwrap() > 0.0
                && r["attention_gflops"].as_f64().unwrap() > 0.0
        );
        assert!(r["with_patterns_s"].as_f64().unwrap() > 0.0);
    }
    let b = v["backward"].as_array().unwrap();
    assert_eq!(
        b.iter()
            .map(|r| r["n"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        vec![8, 16]
    );
    for r in b {
        let (f, fb) = (
            r["forward_s"].as_f64().unwrap(),
            r["forward_backward_s"].as_f64().unwrap(),
        );
        assert!(f > 0.0 && fb > 0.0, "{r}");
        assert!(
            (r["ratio"].as_f64().unwrap() - fb / f).abs() < 1e-9 * (fb / f),
            "{r}"
        );
    }
    let c = v["commands"].as_array().unwrap();
    assert_eq!(c.len(), 4, "capture and inspect at both lengths");
    for r in c {
        assert!(r["wall_s"].as_f64().unwrap() > 0.0);
        // the child's own peak (a few MB for a tiny model), not this test's or the parent's
        assert!(r["peak_rss_bytes"].as_u64().unwrap() > 1 << 20, "{r}");
        assert_eq!(r["exit"].as_i64().unwrap(), 0);
    }
    let bad = attnscope()
        .args(["bench", "-m", m.to_str().unwrap(), "--lengths", "0"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
}

/// `bench --precision fast --against-exact`: both precisions' forwards at each length, a row per
/// length whose ratio is the medians' (exact over fast) and whose pairs are each pair's own; the
/// table says which kernel fast ran; without `--precision fast` the flag is refused.
#[test]
fn bench_times_fast_against_exact_in_alternation() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let run = |json: bool| {
        let mut args = vec![
            "bench",
            "-m",
            m.to_str().unwrap(),
            "--precision",
            "fast",
            "--against-exact",
            "--no-commands",
            "--lengths",
            "8,16",
            "--repeats",
            "3",
        ];
        if json {
            args.push("--json");
        }
        let out = attnscope().args(args).output().unwrap();
        assert!(out.status.success(), "{}", stderr_of(&out));
        String::from_utf8(out.stdout).unwrap()
    };
    let v: serde_json::Value = serde_json::from_str(&run(true)).unwrap();
    assert_eq!(v["precision"], "fast");
    let rows = v["fast_vs_exact"].as_array().unwrap();
    assert_eq!(
        rows.iter()
            .map(|r| r["n"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        vec![8, 16]
    );
    for r in rows {
        let (e, f) = (
            r["exact_s"].as_f64().unwrap(),
            r["fast_s"].as_f64().unwrap(),
        );
        assert!(e > 0.0 && f > 0.0, "{r}");
        assert!(
            (r["faster_by"].as_f64().unwrap() - e / f).abs() < 1e-9,
            "{r}"
        );
        let pairs: Vec<f64> = r["pair_ratios"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(pairs.len(), 3, "{r}");
        assert!(pairs.iter().all(|&x| x > 0.0 && x.is_finite()), "{r}");
    }
    // without the flag the JSON says so with an empty list
    let plain = attnscope()
        .args([
            "bench",
            "-m",
            m.to_str().unwrap(),
            "--no-commands",
            "--lengths",
            "8",
        ])
        .args(["--repeats", "1", "--json"])
        .output()
        .unwrap();
    assert!(plain.status.success(), "{}", stderr_of(&plain));
    let p: serde_json::Value = serde_json::from_slice(&plain.stdout).unwrap();
    assert_eq!(p["fast_vs_exact"].as_array().map(Vec::len), Some(0));
    let text = run(false);
    let kernel = attnscope::model::weights::fast_kernel()
        .unwrap_or("no kernel of its own here: it runs exact's");
    assert!(
        text.contains(&format!("fast ({kernel}) against exact")),
        "{text}"
    );
    assert!(text.contains("fast faster by"), "{text}");
    let bad = attnscope()
        .args(["bench", "-m", m.to_str().unwrap(), "--against-exact"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        stderr_of(&bad).contains("add --precision fast"),
        "{}",
        stderr_of(&bad)
    );
}

/// `bench --transformers`: the anchor script runs between --repeats runs of each command and
/// --repeats more, with the arguments of the comparable route (eager with output_attentions next
/// to capture, sdpa next to inspect, the same text file), and the ratios are its forward over
/// attnscope's times (their median, and each run's). A stand-in for Python records its arguments
/// and prints what hf_anchor.py prints; one that fails names its error; `--no-commands` and a
/// missing Python are refused.
#[test]
fn bench_runs_transformers_between_its_commands_and_reports_ratios() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let log = dir.path().join("calls.log");
    let fake = dir.path().join("python");
    std::fs::write(
        &fake,
        format!(
            r#"#!/bin/sh
echo "$@" >> {log}
script="$1"; shift
attn=sdpa; oa=false; file=""
while [ $# -gt 0 ]; do
  case "$1" in
    --attn) attn="$2"; shift;;
    --file) file="$2"; shift;;
    --output-attentions) oa=true;;
  esac
  shift
done
[ -f "$script" ] && [ -f "$file" ] || {{ echo "no script or text" >&2; exit 3; }}
grep -q "forward_median_s" "$script" || {{ echo "not the anchor script" >&2; exit 4; }}
echo "loading the model"
if [ $attn = eager ]; then t=7.5; else t=4.5; fi
echo "{{\"gguf\": \"m.gguf\", \"n_tokens\": 12, \"attn\": \"$attn\", \"output_attentions\": $oa, \"threads\": 2, \"import_s\": 1.0, \"tokenizer_s\": 1.0, \"load_s\": 2.0, \"forward_median_s\": $t, \"forward_min_s\": 4.0, \"peak_rss_load_mb\": 100, \"peak_rss_forward_mb\": 200, \"cpu\": \"AVX2\"}}"
"#,
            log = log.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = attnscope()
        .args(["bench", "-m", m.to_str().unwrap(), "--lengths", "8,16"])
        .args(["--repeats", "2", "--json", "--transformers"])
        .arg(&fake)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let side = v["transformers"].as_array().unwrap();
    assert_eq!(side.len(), 4, "capture and inspect at both lengths");
    let calls = std::fs::read_to_string(&log).unwrap();
    let calls: Vec<&str> = calls.lines().collect();
    assert_eq!(calls.len(), 4, "{calls:?}");
    let floats = |v: &serde_json::Value| -> Vec<f64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    for (r, call) in side.iter().zip(&calls) {
        let n = r["n"].as_u64().unwrap();
        let capture = r["command"] == "capture";
        let t = r["transformers"].clone();
        assert_eq!(t["attn"], if capture { "eager" } else { "sdpa" }, "{r}");
        assert_eq!(t["output_attentions"], capture, "{r}");
        assert!(
            call.contains(&format!("--attn {}", t["attn"].as_str().unwrap())),
            "{call}"
        );
        assert_eq!(call.contains("--output-attentions"), capture, "{call}");
        assert!(
            call.contains(&format!("text{n}.txt")),
            "the bench's own text: {call}"
        );
        assert!(
            call.contains(m.to_str().unwrap()),
            "the model's file: {call}"
        );
        let theirs = t["forward_median_s"].as_f64().unwrap();
        let walls = floats(&r["wall_s"]);
        assert_eq!(
            walls.len(),
            4,
            "--repeats runs before transformers and after: {r}"
        );
        assert!(walls.iter().all(|&w| w > 0.0), "{r}");
        let mut sorted = walls.clone();
        sorted.sort_by(f64::total_cmp);
        let median = (sorted[1] + sorted[2]) / 2.0;
        assert!(
            (r["median_wall_s"].as_f64().unwrap() - median).abs() < 1e-9,
            "{r}"
        );
        assert!(
            (r["faster_by_median"].as_f64().unwrap() - theirs / median).abs() < 1e-9,
            "{r}"
        );
        let ratios: Vec<f64> = walls.iter().map(|w| theirs / w).collect();
        let by = floats(&r["faster_by"]);
        let (lo, hi) = (
            ratios.iter().copied().fold(f64::INFINITY, f64::min),
            ratios.iter().copied().fold(0.0, f64::max),
        );
        assert!(
            (by[0] - lo).abs() < 1e-9 && (by[1] - hi).abs() < 1e-9,
            "{r}"
        );
        // after the load: the same ratio over the commands' own timings (none where one of
        // them reads 0 s, as a tiny model's can)
        let own = floats(&r["after_load_s"]);
        if own.iter().all(|&x| x > 0.0) {
            let after = r["faster_by_after_load"].as_array().unwrap();
            let lo = own.iter().map(|x| theirs / x).fold(f64::INFINITY, f64::min);
            assert!((after[0].as_f64().unwrap() - lo).abs() < 1e-9, "{r}");
            let mut sorted = own.clone();
            sorted.sort_by(f64::total_cmp);
            let median = (sorted[1] + sorted[2]) / 2.0;
            assert!(
                (r["faster_by_median_after_load"].as_f64().unwrap() - theirs / median).abs() < 1e-9,
                "{r}"
            );
        } else {
            assert!(r["faster_by_after_load"].is_null(), "{r}");
            assert!(r["faster_by_median_after_load"].is_null(), "{r}");
        }
    }
    // `bench` at 8 tokens with this Python
    let bench_8 = |python: &std::path::Path| {
        attnscope()
            .args(["bench", "-m", m.to_str().unwrap(), "--lengths", "8"])
            .args(["--repeats", "1", "--transformers"])
            .arg(python)
            .output()
            .unwrap()
    };
    // the table names each route, and for capture the floor of an exact forward
    let out = bench_8(&fake);
    assert!(out.status.success(), "{}", stderr_of(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("Side by side with transformers"), "{text}");
    assert!(
        text.contains("eager + output_attentions (12 tokens)"),
        "{text}"
    );
    assert!(text.contains("7.50 s (4.00)"), "{text}");
    assert!(
        text.contains("n = 8: 3x transformers' eager forward leaves 2.50 s"),
        "{text}"
    );
    // a Python without torch: its own error, and how to set one up
    let bad = dir.path().join("bad-python");
    std::fs::write(
        &bad,
        "#!/bin/sh\necho Traceback >&2\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&bad, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = bench_8(&bad);
    assert_eq!(out.status.code(), Some(1), "{}", stderr_of(&out));
    let err = stderr_of(&out);
    assert!(
        err.contains("exited with 1")
            && err.contains("No module named 'torch'")
            && err.contains("pip install"),
        "{err}"
    );
    for args in [
        vec!["--no-commands", "--transformers", fake.to_str().unwrap()],
        vec!["--transformers", "/no/such/python"],
    ] {
        let out = attnscope()
            .args(["bench", "-m", m.to_str().unwrap()])
            .args(["--lengths", "8", "--repeats", "1"])
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr_of(&out));
        assert!(stderr_of(&out).contains("--transformers"), "{args:?}");
    }
}

/// examples/slurm: the array job's body run as Slurm would (3 tasks, one of them twice, as after a
/// requeue), then the dependent merge: the aggregate equals one process over all texts.
#[test]
fn slurm_array_shards_merge_to_the_single_run() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let texts = dir.path().join("texts.txt");
    std::fs::write(
        &texts,
        "the hat\nat the the\nhe sat\n\nthe the the at\nhat\nsat at the hat he\n",
    )
    .unwrap();
    let out = dir.path().join("out");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/slurm");
    let bin = assert_cmd::cargo::cargo_bin("attnscope");
    let sh = |script: &str, task: Option<usize>| {
        let mut c = std::process::Command::new("bash");
        c.arg(root.join(script))
            .env("TEXTS", &texts)
            .env("MODEL", &m)
            .env("OUT", &out)
            .env("ATTNSCOPE", &bin)
            .env_remove("SLURM_CPUS_PER_TASK");
        if let Some(t) = task {
            c.env("SLURM_ARRAY_TASK_ID", t.to_string())
                .env("SLURM_ARRAY_TASK_COUNT", "3");
        }
        let o = c.output().unwrap();
        assert!(
            o.status.success(),
            "{script} {task:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    for t in [0, 1, 2, 1] {
        sh("corpus.sbatch", Some(t));
    }
    sh("merge.sbatch", None);
    let merged: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("aggregate.json")).unwrap())
            .unwrap();
    let single = attnscope()
        .args([
            "corpus",
            "--model",
            m.to_str().unwrap(),
            "--file",
            texts.to_str().unwrap(),
            "--json",
        ])
        .output()
        .unwrap();
    assert!(single.status.success(), "{}", stderr_of(&single));
    let single: serde_json::Value = serde_json::from_slice(&single.stdout).unwrap();
    assert_eq!(single["sentences"], 6);
    assert_eq!(
        merged, single,
        "the merged shards must equal the single run"
    );
    // the requeued task added nothing: 6 records in all
    let records: usize = (0..3)
        .map(|t| {
            std::fs::read_to_string(out.join(format!("shard_{t}.jsonl")))
                .unwrap()
                .lines()
                .count()
        })
        .sum();
    assert_eq!(records, 6);
    // without TEXTS the script says what is missing
    let o = std::process::Command::new("bash")
        .arg(root.join("corpus.sbatch"))
        .env_remove("TEXTS")
        .output()
        .unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("set TEXTS"));
}

/// `explain --rnn`: the lesson's last chapter as numbers; the linear RNN's gradient equals its
/// closed form ρ^(n-1)‖U‖ in every row, the tanh RNN's vanishes, attention's path stays 1.
#[test]
fn explain_rnn_measures_the_last_chapter() {
    let out = attnscope()
        .args([
            "explain",
            "--rnn",
            "--lengths",
            "4,32,128",
            "--d",
            "6",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    for r in rows {
        let (lin, closed) = (
            r["rnn_linear_gradient"].as_f64().unwrap(),
            r["rnn_linear_closed_form"].as_f64().unwrap(),
        );
        assert!((lin / closed - 1.0).abs() < 1e-9, "{r}");
        assert_eq!(r["attention_path_length"], 1);
        assert_eq!(
            r["rnn_path_length"].as_u64().unwrap(),
            r["n"].as_u64().unwrap() - 1
        );
    }
    assert!(
        rows[2]["rnn_tanh_gradient"].as_f64().unwrap()
            < 1e-6 * rows[0]["rnn_tanh_gradient"].as_f64().unwrap()
    );
    assert!(
        rows[2]["attention_gradient"].as_f64().unwrap()
            > rows[0]["attention_gradient"].as_f64().unwrap() / 128.0
    );
    // the same seed gives the same numbers
    let again = attnscope()
        .args([
            "explain",
            "--rnn",
            "--lengths",
            "4,32,128",
            "--d",
            "6",
            "--json",
        ])
        .output()
        .unwrap();
    assert_eq!(again.stdout, out.stdout);
    let bad = attnscope()
        .args(["explain", "--rnn", "--lengths", "1,x"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
}

/// `explain --quiz`: the lesson's self-check, every answer computed on the model and the text.
#[test]
fn explain_quiz_answers_with_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let out = attnscope()
        .args([
            "explain",
            "--quiz",
            "--model",
            m.to_str().unwrap(),
            "--text",
            "the hat at the hat",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let q = v["questions"].as_array().unwrap();
    assert_eq!(q.len(), 6);
    assert_eq!(q[0]["numbers"]["ratio"], 16.0);
    let model = attnscope::model::Model::load(
        m.to_str().unwrap(),
        attnscope::model::Precision::Exact,
        false,
    )
    .unwrap();
    let d = &model.dims;
    assert_eq!(
        q[1]["numbers"]["head_dim"].as_u64().unwrap() as usize,
        d.head_dim
    );
    assert_eq!(
        q[2]["numbers"]["group"].as_u64().unwrap() as usize,
        d.n_heads / d.n_kv_heads
    );
    let n = model.encode("the hat at the hat", false).unwrap().len();
    assert_eq!(
        q[3]["numbers"]["masked"].as_u64().unwrap() as usize,
        n * (n - 1) / 2
    );
    assert_eq!(q[4]["numbers"]["max_masked_weight"], 0.0);
    assert!(q[4]["numbers"]["max_row_sum_error"].as_f64().unwrap() < 1e-5);
    let p = q[5]["numbers"]["spearman_p"].as_f64().unwrap();
    assert!(p > 0.0 && p <= 1.0);
    assert!(q[5]["answer"]
        .as_str()
        .unwrap()
        .starts_with("Not by itself"));
    let text = attnscope()
        .args([
            "explain",
            "--quiz",
            "--model",
            m.to_str().unwrap(),
            "--text",
            "the hat at the hat",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("6. Is a high attention weight an explanation?") && text.contains("16x"));
}

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
    // two texts on one model
    let out = attnscope()
        .args(["compare", "--model", m1.to_str().unwrap()])
        .args(["--text", "the hat at the", "--text", "the cat at the hat"])
        .args(["--json", "--html", html.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["mode"], "texts");
    assert_eq!(v["same_tokens"], false);
    let (ra, rb) = (rows_of(&v["a"]), rows_of(&v["b"]));
    let js: Vec<Vec<f64>> = serde_json::from_value(v["js"].clone()).unwrap();
    for l in 0..ra.len() {
        for h in 0..ra[l].len() {
            let s: f64 = ra[l][h].iter().sum();
            assert!((s - 1.0).abs() < 1e-4, "A row sums to {s}");
            let want = js_bits(&ra[l][h], &rb[l][h]);
            assert!(
                (js[l][h] - want).abs() < 1e-6,
                "JS {l}.{h}: {} vs {want}",
                js[l][h]
            );
        }
    }
    // the most changed head is listed first, and its JS is the largest
    let top = &v["top_changed"][0];
    let max = js.iter().flatten().fold(0.0f64, |a, &b| a.max(b));
    assert_eq!(top["js"].as_f64().unwrap(), max);
    for l in v["layers"].as_array().unwrap() {
        let d = l["sink_all_b"].as_f64().unwrap() - l["sink_all_a"].as_f64().unwrap();
        assert!((l["sink_all_diff"].as_f64().unwrap() - d).abs() < 1e-6);
    }
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.contains("\"mode\":\"texts\"") && !page.contains("/*ATTNSCOPE_DATA*/"));
    assert!(!page.contains("src=\"http") && !page.contains("href=\"http"));
    // the page is not overwritten without --force
    let again = attnscope()
        .args(["compare", "--model", m1.to_str().unwrap()])
        .args([
            "--text",
            "a",
            "--text",
            "b",
            "--html",
            html.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(2), "{}", stderr_of(&again));
    assert!(stderr_of(&again).contains("--force"));
    assert_eq!(std::fs::read_to_string(&html).unwrap(), page);
    // one model twice: nothing differs
    let out = attnscope()
        .args([
            "compare",
            "--model",
            m1.to_str().unwrap(),
            "--model",
            m1.to_str().unwrap(),
        ])
        .args(["--text", "the hat at the", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["mode"], "models");
    assert!(v["js"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|l| l.as_array().unwrap())
        .all(|x| x.as_f64().unwrap() == 0.0));
    // two models with one tokenizer: rows differ, the table names the mode
    let out = attnscope()
        .args([
            "compare",
            "--model",
            m1.to_str().unwrap(),
            "--model",
            m2.to_str().unwrap(),
        ])
        .args(["--text", "the hat at the"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
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
    // two precisions
    let out = attnscope()
        .args(["compare", "--model", m1.to_str().unwrap()])
        .args([
            "--precision",
            "exact",
            "--precision",
            "fast",
            "--text",
            "the hat at the",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (
            v["mode"].as_str(),
            v["a"]["precision"].as_str(),
            v["b"]["precision"].as_str()
        ),
        (Some("precisions"), Some("exact"), Some("fast"))
    );
    // what compare refuses, with exit 2 and the reason
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

/// `view` above 4,096 tokens, or `--faithfulness` above 256, is refused with the limit named
/// (exit 2); the bounded page of 257..=4,096 tokens is written.
#[test]
fn view_limits_are_named() {
    use attnscope::model::tiny::write_gguf_with;
    use candle_core::quantized::gguf_file::Value;
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("tiny.gguf");
    write_gguf_with(
        &tiny_model(Arch::Qwen2, 1),
        Arch::Qwen2,
        GgmlDType::F32,
        &m,
        &|md, _| {
            for (k, v) in md.iter_mut() {
                if k.ends_with(".context_length") {
                    *v = Value::U32(8192);
                }
            }
        },
    )
    .unwrap();
    let out_path = dir.path().join("v.html");
    let view = |text: String, extra: &[&str]| {
        attnscope()
            .args([
                "view",
                "--model",
                m.to_str().unwrap(),
                "--force",
                "--out",
                out_path.to_str().unwrap(),
                "--text",
                &text,
            ])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = view("the cat at the hat ".repeat(500), &[]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    assert!(
        stderr_of(&out).contains("at most 4096") && stderr_of(&out).contains("sinks"),
        "{}",
        stderr_of(&out)
    );
    let out = view("the cat at the hat ".repeat(40), &["--faithfulness"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    assert!(
        stderr_of(&out).contains("at most 256"),
        "{}",
        stderr_of(&out)
    );
    let out = view("the cat at the hat ".repeat(40), &[]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    let page = std::fs::read_to_string(&out_path).unwrap();
    assert!(page.contains("\"encoding\":\"topk\"") && page.contains("\"k_head\":6"));
}
