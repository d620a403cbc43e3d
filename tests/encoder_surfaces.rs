//! Encoders on the CLI's surfaces (issue #41): `capture` of a text holding a literal "[SEP]"
//! against transformers (every token type 0, as the tokenizer gives it), `view`'s refusals of
//! the next-token panels, `serve`'s pair page, and `corpus` / `corpus merge` on
//! all-MiniLM-L6-v2 (records against `inspect`'s shares, shards merged against one run).
//! Goldens: tests/golden/minilm_encoder.json and minilm_encoder_attn_*.npy
//! (tests/golden/make_encoder_golden.py).

mod common;
use attnscope::analysis::encoder::inspect;
use common::{
    assert_array, assert_close, attnscope, fails_with, golden, golden_json, golden_npy, read_npz,
    read_safetensors, real_model, run_err, start_serve, stderr_of,
};

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// `capture --hooks embed` of an encoder writes `hook_pos_embed` (position + token type, handed
/// by the encoder's forward; the file's plan left it out for every family but GPT-2, so the write
/// stopped with "you likely have a bug"), to NPZ and safetensors: the same rows at the same
/// positions for two different texts (position embeddings do not depend on the tokens), the
/// rows of different positions different.
#[test]
fn capture_of_an_encoder_writes_its_position_embeddings() {
    let dir = tempfile::tempdir().unwrap();
    let capture = |text: &str, out: &std::path::Path| {
        let o = attnscope()
            .args(["capture", "-m", "all-minilm-l6-v2", "--hooks", "embed"])
            .args(["--text", text])
            .arg("--out")
            .arg(out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{text} ({out:?}): {}", stderr_of(&o));
        std::fs::read(out).unwrap()
    };
    let mut rows = Vec::new();
    for (i, text) in ["The cat sat on the mat.", "Paris is lovely in spring."]
        .iter()
        .enumerate()
    {
        let st = read_safetensors(&capture(
            text,
            &dir.path().join(format!("all{i}.safetensors")),
        ));
        let npz = read_npz(&capture(text, &dir.path().join(format!("all{i}.npz"))));
        let (shape, p) = &st["hook_pos_embed"];
        assert_eq!(shape[1], 384, "{text}: [positions, d_model]");
        assert_eq!(&npz["hook_pos_embed"], &st["hook_pos_embed"], "{text}: npz");
        rows.push(p.clone());
    }
    // the first 5 positions ([CLS] and four tokens) of both texts: type 0, the same positions
    let k = 5 * 384;
    assert_eq!(
        rows[0][..k],
        rows[1][..k],
        "position + type rows differ between texts"
    );
    assert_ne!(rows[0][..384], rows[0][384..768], "positions 0 and 1 alike");
    assert!(rows[0].iter().all(|v| v.is_finite()));
}

/// `capture --hooks all` of an encoder (post-norm: its `ln1` comes after `hook_attn_out`, it has
/// no `rot_q`, gate or final norm) writes every hook the forward hands out, to safetensors and
/// NPZ (it stopped with "came where ... was declared: you likely have a bug"): each tensor in
/// the plan's order, of the plan's shape, bit for bit what a forward capturing that hook alone
/// keeps. A hook it lacks, named alone, is refused by name.
#[test]
fn capture_hooks_all_of_an_encoder_equals_each_hook_alone() {
    use attnscope::model::capture::{AttnCache, CaptureSpec, Hook, Queries};
    use attnscope::model::forward::RunOptions;
    let model = real_model("all-minilm-l6-v2");
    let dir = tempfile::tempdir().unwrap();
    let text = "The cat sat on the mat.";
    let mut files = Vec::new();
    for ext in ["safetensors", "npz"] {
        let out = dir.path().join(format!("all.{ext}"));
        let o = attnscope()
            .args(["capture", "-m", "all-minilm-l6-v2", "--hooks", "all"])
            .args(["--text", text])
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{ext}: {}", stderr_of(&o));
        let bytes = std::fs::read(&out).unwrap();
        files.push((
            ext,
            if ext == "npz" {
                read_npz(&bytes)
            } else {
                read_safetensors(&bytes)
            },
        ));
    }
    let ids = &files[1].1["token_ids"].1;
    let tokens: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
    let spec = |hooks| CaptureSpec {
        hooks,
        layers: None,
        heads: None,
        queries: Queries::All,
    };
    let all = spec(Hook::parse_list("all").unwrap()).tensors(&model.dims, tokens.len());
    assert_eq!(
        all.len(),
        6 * 18 + 2,
        "every block's 18 hooks and the 2 embeddings"
    );
    for hook in Hook::in_forward_order(model.dims.arch) {
        let mut cache = AttnCache::new(&spec(vec![hook]), tokens.len());
        model
            .forward(&tokens, &RunOptions::default(), &mut cache)
            .unwrap();
        assert!(!cache.entries.is_empty(), "{hook:?}: nothing captured");
        for c in cache.iter() {
            for (ext, got) in &files {
                let (shape, data) = got
                    .get(&c.name)
                    .unwrap_or_else(|| panic!("{ext}: {} missing", c.name));
                assert_eq!(shape, &c.shape, "{ext}: {}", c.name);
                let same = data
                    .iter()
                    .zip(&c.data)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same && data.len() == c.data.len(),
                    "{ext}: {} differs",
                    c.name
                );
            }
        }
    }
    for (ext, got) in &files {
        let names: Vec<&String> = got.keys().filter(|n| *n != "token_ids").collect();
        let mut want: Vec<&String> = all.iter().map(|(n, _)| n).collect();
        want.sort();
        assert_eq!(names, want, "{ext}: the file holds the plan's tensors");
    }
    let err = run_err(
        [
            "capture",
            "-m",
            "all-minilm-l6-v2",
            "--hooks",
            "rot_q,ln_final",
            "--text",
            text,
            "--out",
            dir.path().join("r.npz").to_str().unwrap(),
        ],
        2,
    );
    assert!(
        err.contains("has no attn.hook_rot_q, ln_final.hook_scale"),
        "{err}"
    );
    assert!(!dir.path().join("r.npz").exists());
}

/// `capture` of "Is this a [SEP] token? …" and of a pair whose texts hold "[SEP]" give
/// transformers' attention (last layer), and the file's metadata holds the tokenizer's types.
#[test]
fn capture_of_a_literal_sep_matches_transformers() {
    let g = golden_json("minilm_encoder.json");
    let dir = tempfile::tempdir().unwrap();
    for name in ["literal_sep", "literal_sep_pair"] {
        let case = &g["cases"][name];
        let out = dir.path().join(format!("{name}.safetensors"));
        let mut c = attnscope();
        c.args(["capture", "-m", "all-minilm-l6-v2", "--hooks", "pattern"])
            .args(["--layers", "5", "--text", case["text"].as_str().unwrap()])
            .arg("--out")
            .arg(&out);
        if let Some(b) = case["pair"].as_str() {
            c.args(["--pair", b]);
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{name}: {}", stderr_of(&o));
        let bytes = std::fs::read(&out).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let p = st.tensor("blocks.5.attn.hook_pattern").unwrap();
        let got: Vec<f32> = p
            .data()
            .chunks(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let (shape, want) = golden_npy(&format!("minilm_encoder_attn_{name}.npy"));
        assert_eq!(p.shape(), &shape[1..], "{name}");
        // every weight within README.md's 1.6e-6 of transformers, as tests/encoder.rs asserts
        assert_array(
            &format!("capture {name}: layer 5 [head, query, key] vs transformers"),
            &shape,
            &got,
            &want,
            common::Bound::Abs(5e-6),
        );
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let md = meta.metadata().clone().unwrap();
        let types: serde_json::Value = serde_json::from_str(&md["token_types"]).unwrap();
        assert_eq!(types, case["token_types"], "{name}: token types");
        // inspect's token types are the tokenizer's too ("[SEP]" inside the text stays type 0)
        let mut c = attnscope();
        c.args(["inspect", "-m", "all-minilm-l6-v2", "--json", "--text"])
            .arg(case["text"].as_str().unwrap());
        if let Some(b) = case["pair"].as_str() {
            c.args(["--pair", b]);
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{name}: {}", stderr_of(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["token_types"], case["token_types"], "{name}: inspect");
        for (k, g) in [("cls", "cls_share"), ("sep", "sep_share")] {
            common::assert_json(
                &format!("inspect {name}: {k} share [layer] vs transformers"),
                &floats(&case[g]),
                &v["special_shares"][k],
                common::Bound::Abs(2e-6),
            );
        }
    }
}

#[test]
fn view_of_an_encoder_refuses_the_next_token_panels() {
    let dir = tempfile::tempdir().unwrap();
    let bert = golden("arch/bert");
    for extra in [
        vec!["--ablate"],
        vec!["--faithfulness"],
        vec!["--target", "the"],
    ] {
        let o = attnscope()
            .args([
                "view",
                "-m",
                bert.to_str().unwrap(),
                "--text",
                "the cat sat",
            ])
            .args(&extra)
            .arg("--out")
            .arg(dir.path().join("v.html"))
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{extra:?}");
        let e = stderr_of(&o);
        assert!(e.contains("encoder") && !e.contains("panicked"), "{e}");
    }
    // a pair on a decoder's view is refused too
    let o = fails_with(
        attnscope()
            .args(["view", "-m", "smollm2-135m", "--text", "a", "--pair", "b"])
            .arg("--out")
            .arg(dir.path().join("d.html")),
        2,
    );
    assert!(o.contains("encoder"), "{o}");
    // the page holds the pair's sentence_b_start and the shares inspect reports
    let page = dir.path().join("pair.html");
    let o = attnscope()
        .args([
            "view",
            "-m",
            bert.to_str().unwrap(),
            "--text",
            "What is it?",
        ])
        .args(["--pair", "The dog was happy, and it sat!", "--out"])
        .arg(&page)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr_of(&o));
    let html = std::fs::read_to_string(&page).unwrap();
    let at = html.find("{\"title\"").unwrap();
    let v: serde_json::Value = serde_json::Deserializer::from_str(&html[at..])
        .into_iter()
        .next()
        .unwrap()
        .unwrap();
    let r = golden_json("arch/bert/reference.json");
    let case = &r["cases"]["pair"];
    assert_eq!(v["kind"], "encoder");
    assert_eq!(v["token_types"], case["token_types"]);
    assert_eq!(v["sentence_b_start"], 6);
    common::assert_json(
        "the page's [SEP] share [layer] vs transformers",
        &floats(&case["sep_share"]),
        &v["special_shares"]["sep"],
        common::Bound::Abs(2e-6),
    );
}

/// One GET to a running `serve`; the status line and the body.
fn get(base: &str, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    let addr = base.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.lines().next().unwrap_or("").to_string();
    let body = out.split_once("\r\n\r\n").map_or("", |x| x.1).to_string();
    (status, body)
}

#[test]
fn serve_takes_a_pair_on_an_encoder() {
    let bert = golden("arch/bert");
    let (mut child, addr) = start_serve(&["-m", bert.to_str().unwrap(), "--addr", "127.0.0.1:0"]);
    let base = format!("http://{addr}");
    let (status, form) = get(&base, "/");
    assert!(status.contains("200"), "{status}");
    assert!(form.contains("name=\"pair\"") && !form.contains("name=\"faithfulness\""));
    let (status, page) = get(
        &base,
        "/view?text=What+is+it%3F&pair=The+dog+was+happy%2C+and+it+sat%21",
    );
    assert!(status.contains("200"), "{status}");
    assert!(page.contains("\"sentence_b_start\":6"), "the pair's page");
    // an empty pair field (the form left blank) is one text
    let (status, page) = get(&base, "/view?text=the+cat+sat&pair=");
    assert!(status.contains("200"), "{status}");
    assert!(page.contains("\"sentence_b_start\":null"));
    let (status, page) = get(&base, "/view?text=the+cat&faithfulness=1");
    assert!(status.contains("400"), "{status}");
    assert!(page.contains("encoder"));
    child.kill().unwrap();
    let _ = child.wait();
}

/// `corpus` on MiniLM: each record's per-layer shares are `inspect`'s, the per-head shares
/// average to them, and two shards merged give the single run's aggregate; mixing an encoder's
/// and a decoder's record files is refused.
#[test]
fn corpus_on_an_encoder_reports_special_token_shares_and_merges() {
    let model = real_model("all-minilm-l6-v2");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let single = corpus_json(dir, &[], "all.jsonl");
    a_torn_record_file_resumes_to_the_same_aggregate(dir, &single);
    corpus_json(dir, &["--shard", "0/2"], "s0.jsonl");
    corpus_json(dir, &["--shard", "1/2"], "s1.jsonl");
    assert_eq!(single["kind"], "encoder");
    assert_eq!(single["sentences"], 6);
    let records = std::fs::read_to_string(dir.join("all.jsonl")).unwrap();
    records_hold_inspects_shares_and_make_the_aggregate(model, &records, &single);
    two_shards_merged_equal_one_run(dir, &single);
    // resuming skips the texts already in the file: the same aggregate
    assert_eq!(corpus_json(dir, &[], "all.jsonl"), single);
    a_decoders_records_beside_an_encoders_are_refused(dir);
    run_err(
        [
            "corpus",
            "-m",
            "all-minilm-l6-v2",
            "--limit",
            "1",
            "--faithfulness",
        ],
        2,
    );
}

/// Runs `cmd` (an `attnscope corpus` command), asserts that it succeeded (showing its standard
/// error if not) and returns its standard output.
fn corpus_ok(cmd: &mut assert_cmd::Command) -> Vec<u8> {
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", stderr_of(&o));
    o.stdout
}

/// `corpus` on MiniLM (6 texts, or a shard of them with `args`), its records in `dir`/`out`:
/// the aggregate it prints.
fn corpus_json(dir: &std::path::Path, args: &[&str], out: &str) -> serde_json::Value {
    let stdout = corpus_ok(
        attnscope()
            .args(["corpus", "-m", "all-minilm-l6-v2", "--limit", "6", "--json"])
            .args(args)
            .arg("--out")
            .arg(dir.join(out)),
    );
    serde_json::from_slice(&stdout).unwrap()
}

/// Resumed after a run killed mid-line: the torn line goes, its text runs again, and the
/// aggregate is the same (the resume logic the decoder's records use).
fn a_torn_record_file_resumes_to_the_same_aggregate(
    dir: &std::path::Path,
    single: &serde_json::Value,
) {
    let whole = std::fs::read_to_string(dir.join("all.jsonl")).unwrap();
    let kept: String = whole.lines().take(4).map(|l| format!("{l}\n")).collect();
    std::fs::write(dir.join("torn.jsonl"), format!("{kept}{{\"id\":4,\"mod")).unwrap();
    let resumed = corpus_json(dir, &[], "torn.jsonl");
    assert_eq!(resumed["layers"], single["layers"]);
    assert_eq!(
        std::fs::read_to_string(dir.join("torn.jsonl"))
            .unwrap()
            .lines()
            .count(),
        6
    );
}

/// Each record's per-layer shares are `inspect`'s on its text and its per-head shares average
/// to them; the aggregate's per-layer [CLS] mean is the records' mean.
fn records_hold_inspects_shares_and_make_the_aggregate(
    model: &attnscope::model::Model,
    records: &str,
    single: &serde_json::Value,
) {
    let (mut cls_sum, mut n) = (vec![0f64; 6], 0usize);
    for line in records.lines() {
        let r: serde_json::Value = serde_json::from_str(line).unwrap();
        record_has_inspects_shares(model, &r);
        for l in 0..6 {
            cls_sum[l] += r["cls"][l].as_f64().unwrap() as f32 as f64;
        }
        n += 1;
    }
    for l in 0..6 {
        let mean = single["layers"][l]["cls"]["mean"].as_f64().unwrap();
        assert!(
            (mean - cls_sum[l] / n as f64).abs() < 1e-9,
            "layer {l} mean {mean}"
        );
    }
}

/// One record's [CLS]/[SEP]/punctuation shares are `inspect`'s (all layers, all 12 heads), and
/// its per-head [CLS] and [SEP] shares average to the per-layer ones.
fn record_has_inspects_shares(model: &attnscope::model::Model, r: &serde_json::Value) {
    let tokens = model.encode(r["text"].as_str().unwrap(), false).unwrap();
    let heads: Vec<usize> = (0..12).collect();
    let want = inspect(model, &tokens, None, 0, 5, &heads, 1).unwrap();
    for (k, w) in [
        ("cls", &want.special_shares.cls),
        ("sep", &want.special_shares.sep),
        ("punct", &want.special_shares.punct),
    ] {
        assert_close(
            &floats(&r[k]),
            w,
            1e-6,
            &format!("record {}: {k} [layer] vs inspect", r["id"]),
        );
    }
    for (k, per) in [("cls", "head_cls"), ("sep", "head_sep")] {
        for l in 0..6 {
            let mean = floats(&r[per][l]).iter().sum::<f32>() / 12.0;
            let want = r[k][l].as_f64().unwrap() as f32;
            assert!(
                (mean - want).abs() < 1e-5,
                "{per} layer {l}: {mean} vs {want}"
            );
        }
    }
}

/// `corpus merge` of the two shards' records gives the single run's aggregate.
fn two_shards_merged_equal_one_run(dir: &std::path::Path, single: &serde_json::Value) {
    let stdout = corpus_ok(
        attnscope()
            .args(["corpus", "merge", "--json"])
            .arg(dir.join("s0.jsonl"))
            .arg(dir.join("s1.jsonl")),
    );
    let merged: serde_json::Value = serde_json::from_slice(&stdout).unwrap();
    assert_eq!(&merged, single, "two shards merged equal one run");
}

/// A decoder's records (smollm2-135m) merged with an encoder's: refused by name.
fn a_decoders_records_beside_an_encoders_are_refused(dir: &std::path::Path) {
    corpus_ok(
        attnscope()
            .args([
                "corpus",
                "-m",
                "smollm2-135m",
                "--limit",
                "1",
                "--json",
                "--out",
            ])
            .arg(dir.join("dec.jsonl")),
    );
    let o = fails_with(
        attnscope()
            .args(["corpus", "merge"])
            .arg(dir.join("s0.jsonl"))
            .arg(dir.join("dec.jsonl")),
        2,
    );
    assert!(o.contains("encoder"), "{o}");
}

/// Patterns computed elsewhere (Python's `viz.attention_heads`) that put weight above the
/// diagonal get the encoder's page: every weight stored (not the lower triangle), and the
/// [CLS]/[SEP]/punctuation shares `inspect` reports for the same text.
#[test]
fn bidirectional_patterns_from_elsewhere_get_the_encoder_page() {
    use attnscope::model::capture::{AttnCache, CaptureSpec};
    use attnscope::model::forward::RunOptions;
    use attnscope::model::{Model, Precision};
    let model = Model::load(
        golden("arch/bert").to_str().unwrap(),
        Precision::Exact,
        false,
    )
    .unwrap();
    let tokens = model.encode("What is it? The dog sat.", false).unwrap();
    let (n, nl, nh) = (tokens.len(), model.dims.n_layers, model.dims.n_heads);
    let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
    model
        .forward(&tokens, &RunOptions::default(), &mut cache)
        .unwrap();
    let all: Vec<f32> = (0..nl)
        .flat_map(|l| cache.pattern(l).unwrap().data.to_vec())
        .collect();
    let texts = model.token_texts(&tokens);
    let html = attnscope::render::view::pattern_page(&all, [nl, nh, n, n], &texts, "t").unwrap();
    let at = html.find("{\"title\"").unwrap();
    let v: serde_json::Value = serde_json::Deserializer::from_str(&html[at..])
        .into_iter()
        .next()
        .unwrap()
        .unwrap();
    assert_eq!(v["kind"], "encoder");
    let (_, full) = attnscope::render::html::encode_layer_full(&all[..nh * n * n], nh, n);
    assert_eq!(
        v["patterns"][0],
        full.as_str(),
        "every weight of layer 0, not a triangle"
    );
    let heads: Vec<usize> = (0..nh).collect();
    let r = inspect(&model, &tokens, None, 0, nl - 1, &heads, 1).unwrap();
    for (k, want) in [
        ("cls", &r.special_shares.cls),
        ("sep", &r.special_shares.sep),
        ("punct", &r.special_shares.punct),
    ] {
        assert_close(
            &floats(&v["special_shares"][k]),
            want,
            1e-6,
            &format!("the page's {k} share [layer] vs inspect"),
        );
    }
    // a causal map (nothing above the diagonal) keeps the decoder's page
    let causal = [1.0f32, 0.0, 0.5, 0.5];
    let html = attnscope::render::view::pattern_page(
        &causal,
        [1, 1, 2, 2],
        &["a".into(), "b".into()],
        "c",
    )
    .unwrap();
    assert!(!html.contains("\"kind\":\"encoder\""));
}
