//! `inspect`, `sinks`, `scaling`, `faithfulness` and `capture` on tiny generated models: output, JSON, exit codes and messages.
// index loops over (layer, head, query) read like the maths; nested test types stay inline
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

mod common;

use common::{
    attnscope, read_npz, read_safetensors, run_err, run_json, run_ok, stderr_of, succeeds,
    tiny_gguf, Tensors,
};

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
        let out = succeeds(&mut c);
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
    let v = run_json([
        "inspect",
        "--model",
        m.to_str().unwrap(),
        "--text",
        "the hat",
        "--json",
        "--heads",
        "all",
    ]);
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
    let missing = run_err(["inspect", "--model", "/nonexistent/model.gguf"], 2);
    assert!(missing.contains("does not exist"));
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"this is not a model at all").unwrap();
    let out = run_err(["info", "--model", junk.to_str().unwrap()], 2);
    assert!(out.contains("is not a GGUF or safetensors model"));
    let empty = attnscope()
        .args(["inspect", "--model", m.to_str().unwrap(), "--text", "   "])
        .output()
        .unwrap();
    assert_eq!(empty.status.code(), Some(2));
    assert!(stderr_of(&empty).contains("text is empty"));
    let long = "the ".repeat(300);
    let out = run_err(
        ["inspect", "--model", m.to_str().unwrap(), "--text", &long],
        2,
    );
    assert!(out.contains("has a context of 256 tokens"), "{}", out);
    let bad_utf8 = dir.path().join("bad.txt");
    std::fs::write(&bad_utf8, [b'a', 0xff, b'b']).unwrap();
    let out = run_err(
        [
            "inspect",
            "--model",
            m.to_str().unwrap(),
            "--file",
            bad_utf8.to_str().unwrap(),
        ],
        2,
    );
    assert!(out.contains("not valid UTF-8"));
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
fn faithfulness_json_has_the_promised_fields() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let v = run_json([
        "faithfulness",
        "--model",
        m.to_str().unwrap(),
        "--text",
        "the hat at the",
        "--json",
    ]);
    assert!(v["target"]["logprob"].as_f64().unwrap() < 0.0);
    let toks = v["tokens"].as_array().unwrap();
    assert_every_token_has_its_scores(toks);
    let metrics = v["metrics"].as_array().unwrap();
    assert_metrics_rank_by_everything(metrics, toks.len() as u64);
    // the table prints n/a for the query's knockout and the p-values
    let table = run_ok([
        "faithfulness",
        "--model",
        m.to_str().unwrap(),
        "--text",
        "the hat at the hat",
    ]);
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.contains("n/a (query)") && table.contains("(p "),
        "{table}"
    );
    assert!(
        metrics[0]["comprehensiveness"].get("1").is_some()
            && metrics[0]["sufficiency"].get("5").is_some()
    );
    run_err(
        [
            "faithfulness",
            "--model",
            m.to_str().unwrap(),
            "--text",
            "the hat",
            "--target",
            "99999",
        ],
        2,
    );
}

/// Every token of `faithfulness --json` has each ranking's score and each truth's: norm-based
/// attention non-negative, its layer-averaged shares and the rollout row summing to 1, and the
/// query's own knockout n/a.
fn assert_every_token_has_its_scores(toks: &[serde_json::Value]) {
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
}

/// Every ranking has metrics (with and without the first token), with n and permutation p-values
/// beside ρ and τ; knockout ranks one token fewer than the `n_tok` (no query).
fn assert_metrics_rank_by_everything(metrics: &[serde_json::Value], n_tok: u64) {
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
    let s = run_json([
        "sinks",
        "--model",
        m.to_str().unwrap(),
        "--file",
        f.to_str().unwrap(),
        "--key-block",
        "7",
        "--json",
    ]);
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
    // every layer of each report, both shares; a null (a NaN) or a missing layer fails
    let cells = |v: &serde_json::Value, all: &str, last: &str| {
        let layers = v["layers"].as_array().expect("layers");
        let mut out = Vec::new();
        for (l, row) in layers.iter().enumerate() {
            out.push(((l, "all"), row[all].as_f64().unwrap_or(f64::NAN)));
            out.push(((l, "last"), row[last].as_f64().unwrap_or(f64::NAN)));
        }
        out
    };
    common::assert_cells(
        "sinks streamed vs inspect materialized [layer, share]",
        cells(&s, "sink_all_queries", "sink_last_query"),
        cells(&i, "sink_all_queries", "sink_query"),
        common::Bound::Abs(1e-5),
    );
    assert_eq!(s["layers"][0]["heads"].as_array().unwrap().len(), 4);
    assert!(s["peak_rss_bytes"].as_u64().unwrap() > 0);
}

/// `capture --hooks ln_final --layers 0` is refused by name (the final norm is handed out at the
/// last layer: the file came without it and the run said it was written), as is `embed` without
/// layer 0; `all` keeps what the layers reach.
#[test]
fn capture_refuses_a_global_hook_its_layers_leave_out() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let out = dir.path().join("a.npz");
    let (m, o) = (m.to_str().unwrap(), out.to_str().unwrap());
    let capture = |hooks: &str, layers: &str| -> Vec<String> {
        let args = [
            "capture", "-m", m, "-t", "the hat", "--hooks", hooks, "--layers", layers,
        ];
        let tail = ["--force", "--out", o];
        args.iter().chain(&tail).map(|a| a.to_string()).collect()
    };
    let err = run_err(capture("ln_final,pattern", "0"), 2);
    assert!(
        err.contains("ln_final.hook_scale is handed out at layer 1, which --layers 0 leaves out"),
        "{err}"
    );
    let err = run_err(capture("embed", "1"), 2);
    assert!(err.contains("hook_embed is handed out at layer 0"), "{err}");
    assert!(!out.exists(), "nothing written");
    run_ok(capture("all", "0"));
    run_ok(capture("ln_final", "1"));
}

/// `sinks --key-block 0` is refused by name (the kernel took blocks of 1 while the report and
/// its JSON said 0).
#[test]
fn sinks_refuses_a_key_block_of_0() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let f = dir.path().join("t.txt");
    std::fs::write(&f, "the hat sat").unwrap();
    let (m, f) = (m.to_str().unwrap(), f.to_str().unwrap());
    let err = run_err(["sinks", "--model", m, "--file", f, "--key-block", "0"], 2);
    assert!(
        err.contains("--key-block (Python: key_block) 0 is out of range"),
        "{err}"
    );
}

#[test]
fn scaling_reports_exponents() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let v = run_json([
        "scaling",
        "--model",
        m.to_str().unwrap(),
        "--lengths",
        "16,32,64",
        "--repeats",
        "1",
        "--json",
    ]);
    assert_eq!(v["rows"].as_array().unwrap().len(), 3);
    assert!(
        v["exponents"]["attention"].as_f64().is_some()
            && v["exponents"]["projections"].as_f64().is_some()
    );
    assert!(v["rows"][2]["capture"]["median_s"].as_f64().unwrap() > 0.0);
    assert!(v["threads"].as_u64().unwrap() >= 1);
    run_err(
        [
            "scaling",
            "--model",
            m.to_str().unwrap(),
            "--lengths",
            "100000",
        ],
        2,
    );
}

/// `capture` streams each layer to the file as it is produced. Every hook of every layer, as
/// .safetensors (read with the safetensors crate) and as .npz (read with the zip crate, each
/// member parsed as .npy), equals what an in-process forward captures; for a subset of heads,
/// queries and layers too.
#[test]
fn streamed_capture_equals_the_in_memory_cache_in_both_formats() {
    use attnscope::model::{Model, Precision};
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let model = Model::load(m.to_str().unwrap(), Precision::Exact, false).unwrap();
    let text = "the hat sat on the mat";
    let tokens = model.encode(text, false).unwrap();
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
        let cache = in_memory_capture(&model, &tokens, [hooks_arg, layers, heads, queries]);
        assert!(!cache.entries.is_empty());
        for ext in ["safetensors", "npz"] {
            let out = dir.path().join(format!("c-{case}.{ext}"));
            // the same tensors when each layer waits for its writing (the default) as when the
            // writing runs on into the next layer (`--two-layers`)
            let overlapped = dir.path().join(format!("t-{case}.{ext}"));
            for (path, flag) in [(&out, None), (&overlapped, Some("--two-layers"))] {
                succeeds(
                    attnscope()
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
                        .args(flag),
                );
            }
            for (writer, path) in [("waiting", &out), ("--two-layers", &overlapped)] {
                let bytes = std::fs::read(path).unwrap();
                let ext = format!("{ext} ({writer} writer)");
                let got = if ext.starts_with("safetensors") {
                    read_safetensors(&bytes)
                } else {
                    let mut got = read_npz(&bytes);
                    let ids = got.remove("token_ids").expect("npz carries the token ids");
                    assert_eq!(ids.1, tokens.iter().map(|&t| t as f32).collect::<Vec<_>>());
                    got
                };
                assert_bit_identical(&got, &cache, &ext);
            }
        }
    }
}

/// What a forward over `tokens` captures in memory for `capture`'s `--hooks`, `--layers`,
/// `--heads` and `--queries`.
fn in_memory_capture(
    model: &attnscope::model::Model,
    tokens: &[u32],
    [hooks, layers, heads, queries]: [&str; 4],
) -> attnscope::model::capture::AttnCache {
    use attnscope::analysis::request::parse_index_list;
    use attnscope::model::capture::{AttnCache, CaptureSpec, Hook, Queries};
    let n = tokens.len();
    let spec = CaptureSpec {
        hooks: Hook::parse_list(hooks).unwrap(),
        layers: Some(parse_index_list(layers, 2, "layer").unwrap()),
        heads: Some(parse_index_list(heads, 4, "head").unwrap()),
        queries: if queries == "all" {
            Queries::All
        } else {
            Queries::List(parse_index_list(queries, n, "q").unwrap())
        },
    };
    let mut cache = AttnCache::new(&spec, n);
    model
        .forward(
            tokens,
            &attnscope::model::forward::RunOptions::default(),
            &mut cache,
        )
        .unwrap();
    cache
}

/// `got` holds exactly the cache's tensors, of the same shapes and bits.
fn assert_bit_identical(got: &Tensors, cache: &attnscope::model::capture::AttnCache, ext: &str) {
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
