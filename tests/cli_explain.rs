//! `explain`, `cost` and `--help`: the lesson's chapters, the quiz, the RNN chapter, the cost table.
// index loops over (layer, head, query) read like the maths; nested test types stay inline
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

mod common;

use common::{attnscope, run_err, run_json, run_ok, succeeds, tiny_gguf};

#[test]
fn explain_prints_every_step_and_is_deterministic() {
    let a = succeeds(attnscope().arg("explain"));
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
    let v = run_json(["explain", "--json", "--d", "3", "--text", "a b c d"]);
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
    let out = run_err(["explain", "--heads", "14", "--kv-heads", "3"], 2);
    assert!(out.contains("not a multiple of --kv-heads 3"));
}

#[test]
fn cost_shows_sixteen_times_for_four_times_the_length() {
    let out = run_ok(["cost", "4096", "16384"]);
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

/// `explain --rnn`: the lesson's last chapter as numbers; the linear RNN's gradient equals its
/// closed form ρ^(n-1)‖U‖ in every row, the tanh RNN's vanishes, attention's path stays 1.
#[test]
fn explain_rnn_measures_the_last_chapter() {
    let rnn = [
        "explain",
        "--rnn",
        "--lengths",
        "4,32,128",
        "--d",
        "6",
        "--json",
    ];
    let out = run_ok(rnn);
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
    let again = run_ok(rnn);
    assert_eq!(again.stdout, out.stdout);
    run_err(["explain", "--rnn", "--lengths", "1,x"], 2);
}

/// `explain --quiz`: the lesson's self-check, every answer computed on the model and the text.
#[test]
fn explain_quiz_answers_with_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let quiz = [
        "explain",
        "--quiz",
        "--model",
        m.to_str().unwrap(),
        "--text",
        "the hat at the hat",
    ];
    let v = run_json([&quiz[..], &["--json"]].concat());
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
    let text = run_ok(quiz);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("6. Is a high attention weight an explanation?") && text.contains("16x"));
}
