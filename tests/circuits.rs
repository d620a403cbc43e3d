//! Circuits (issue #58) against torch on SmolLM2, the default model and Gemma 3: EAP and EAP-IG
//! edge scores within 1e-3 of the largest |score| of autograd through transformers, and exact
//! edge patching within 1e-4 of a float64 torch forward whose readers read their own inputs
//! (`tests/golden/<m>_circuits.json`, made by `make_circuits_golden.py`); the readers' gradients
//! add up to each branch's; the empty and the full circuits are the corrupted and the clean runs
//! exactly; bad input is refused (exit 2).

mod common;

use attnscope::analysis::circuit::evaluate::{patch_edges, run_circuits};
use attnscope::analysis::circuit::graph::Graph;
use attnscope::analysis::circuit::{
    read_pairs, scores, tokenize_pairs, Method, MetricKind, PairTokens,
};
use attnscope::model::backward::{BranchSink, GradMetric, Metric, ReaderGrads};
use attnscope::model::{Model, Precision};
use common::*;
use std::collections::HashMap;

/// The golden's pair as token ids.
fn pair_of(g: &serde_json::Value) -> PairTokens {
    PairTokens {
        clean: token_ids(&g["clean_ids"]),
        corrupt: token_ids(&g["corrupt_ids"]),
        answer: g["answer_id"].as_u64().unwrap() as u32,
        wrong: g["wrong_id"].as_u64().unwrap() as u32,
    }
}

/// Every edge's index by its (from, to) names.
fn edge_names(g: &Graph) -> HashMap<(String, String), usize> {
    (0..g.n_edges())
        .map(|e| {
            let (u, r) = g.edge(e);
            ((g.node_name(u), g.reader_name(r)), e)
        })
        .collect()
}

fn edge_of(names: &HashMap<(String, String), usize>, from: &str, to: &str) -> usize {
    *names
        .get(&(from.to_string(), to.to_string()))
        .unwrap_or_else(|| panic!("no edge {from} -> {to} in the graph"))
}

/// EAP and EAP-IG (5 steps) on the golden's pair: every kept edge within 1e-3 of the largest
/// |score|, and the two runs' metrics within 1e-4.
fn check_scores(model: &Model, g: &serde_json::Value, label: &str) {
    let pair = pair_of(g);
    for (method, key) in [(Method::Eap, "eap"), (Method::EapIg { steps: 5 }, "eap_ig")] {
        let s = scores(
            model,
            std::slice::from_ref(&pair),
            method,
            MetricKind::LogitDiff,
        )
        .unwrap();
        assert_eq!(s.graph.n_edges() as u64, g["n_edges"].as_u64().unwrap());
        for (got, want) in [
            (s.clean_metric, &g["clean_metric"]),
            (s.corrupt_metric, &g["corrupt_metric"]),
        ] {
            let want = want.as_f64().unwrap();
            assert!(
                (got as f64 - want).abs() < 1e-4,
                "{label}: metric {got} vs {want}"
            );
        }
        let names = edge_names(&s.graph);
        let kept = g[key].as_array().unwrap();
        let want = kept.iter().map(|e| {
            let (f, t) = (e[0].as_str().unwrap(), e[1].as_str().unwrap());
            ((f.to_string(), t.to_string()), e[2].as_f64().unwrap())
        });
        let got = kept.iter().map(|e| {
            let (f, t) = (e[0].as_str().unwrap(), e[1].as_str().unwrap());
            let at = edge_of(&names, f, t);
            ((f.to_string(), t.to_string()), s.scores[at] as f64)
        });
        let largest = g[&format!("max_abs_{key}")].as_f64().unwrap();
        let kept_largest = kept
            .iter()
            .map(|e| e[2].as_f64().unwrap().abs())
            .fold(0.0, f64::max);
        assert_eq!(
            kept_largest, largest,
            "the kept edges hold the largest score"
        );
        assert_cells(
            &format!("{label} {key} scores"),
            got,
            want,
            Bound::RelMax(1e-3),
        );
    }
}

/// The golden's circuits (empty, full, the top 0.1%, 1% and 5% by |EAP-IG|) and single edges by
/// exact edge patching, within 1e-4 of torch's float64 forward; the empty and full circuits give
/// the corrupted and clean runs' metrics to the bit.
fn check_patching(model: &Model, g: &serde_json::Value, label: &str) {
    let pair = pair_of(g);
    let graph = Graph::new(&model.dims);
    let names = edge_names(&graph);
    let p = &g["patching"];
    let circuits: Vec<(String, Vec<usize>, f64)> = p["circuits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let edges = c["edges"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| edge_of(&names, e[0].as_str().unwrap(), e[1].as_str().unwrap()));
            let name = format!("top {}", c["fraction"]);
            (name, edges.collect(), c["metric"].as_f64().unwrap())
        })
        .chain([
            ("empty".into(), Vec::new(), p["empty"].as_f64().unwrap()),
            (
                "full".into(),
                (0..graph.n_edges()).collect(),
                p["full"].as_f64().unwrap(),
            ),
        ])
        .collect();
    let lists: Vec<Vec<usize>> = circuits.iter().map(|c| c.1.clone()).collect();
    let (clean, corrupt, vals) =
        run_circuits(model, &pair, MetricKind::LogitDiff, &graph, &lists).unwrap();
    let n = circuits.len();
    assert_eq!(
        vals[n - 2].to_bits(),
        corrupt.to_bits(),
        "{label}: the empty circuit"
    );
    assert_eq!(
        vals[n - 1].to_bits(),
        clean.to_bits(),
        "{label}: the full circuit"
    );
    let got = circuits
        .iter()
        .zip(&vals)
        .map(|(c, v)| (c.0.clone(), *v as f64))
        .chain([
            ("clean".into(), clean as f64),
            ("corrupt".into(), corrupt as f64),
        ]);
    let want = circuits.iter().map(|c| (c.0.clone(), c.2)).chain([
        ("clean".into(), p["clean_metric"].as_f64().unwrap()),
        ("corrupt".into(), p["corrupt_metric"].as_f64().unwrap()),
    ]);
    assert_cells(&format!("{label} circuits"), got, want, Bound::Abs(1e-4));
    let singles = p["single_edges"].as_array().unwrap();
    let key = |e: &serde_json::Value| format!("{} -> {}", e["from"], e["to"]);
    let edges: Vec<usize> = singles
        .iter()
        .map(|e| {
            edge_of(
                &names,
                e["from"].as_str().unwrap(),
                e["to"].as_str().unwrap(),
            )
        })
        .collect();
    let deltas = patch_edges(model, &pair, MetricKind::LogitDiff, &graph, &edges).unwrap();
    assert_cells(
        &format!("{label} single edges"),
        singles
            .iter()
            .zip(&deltas)
            .map(|(e, d)| (key(e), *d as f64)),
        singles
            .iter()
            .map(|e| (key(e), e["delta"].as_f64().unwrap())),
        Bound::Abs(1e-4),
    );
}

#[test]
fn smollm2_scores_and_patching_against_torch() {
    let model = real_model("smollm2-135m");
    let g = golden_json("smol_circuits.json");
    check_scores(model, &g, "smollm2");
    check_patching(model, &g, "smollm2");
}

#[test]
fn qwen_scores_and_patching_against_torch() {
    let model = real_model("qwen2.5-coder-0.5b");
    let g = golden_json("qwen_circuits.json");
    check_scores(model, &g, "qwen");
    check_patching(model, &g, "qwen");
}

/// examples/ioi_pairs.jsonl (docs/commands/circuits.md's IOI study): 20 pairs, ABBA and BABA
/// alike, each clean and corrupted text of one token count and each name one token on both
/// models, the answer the clean text's first name mention (the indirect object) and the wrong
/// token the subject, repeated.
#[test]
fn the_ioi_pairs_fit_both_models() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/ioi_pairs.jsonl");
    let text = std::fs::read_to_string(&path).expect("examples/ioi_pairs.jsonl");
    let pairs = read_pairs(&text, "ioi_pairs.jsonl").expect("the pairs parse");
    assert_eq!(pairs.len(), 20);
    for name in ["smollm2-135m", "qwen2.5-coder-0.5b"] {
        let model = real_model(name);
        let toks = tokenize_pairs(model, &pairs, MetricKind::LogitDiff, false)
            .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        for (i, t) in toks.iter().enumerate() {
            let at = |id: u32| t.clean.iter().filter(|&&x| x == id).count();
            // the indirect object once, the subject twice in the clean text; once each corrupted
            assert_eq!((at(t.answer), at(t.wrong)), (1, 2), "{name} pair {}", i + 1);
            let diff = t
                .clean
                .iter()
                .zip(&t.corrupt)
                .filter(|(a, b)| a != b)
                .count();
            assert_eq!(diff, 1, "{name} pair {}: one token changed", i + 1);
        }
    }
}

/// Gemma 3: its post-norms at the run's scale (a head's node output is its share of the
/// post-normed attention output; each patched run recomputes its own post-norms, as torch does).
#[test]
fn gemma3_scores_and_patching_against_torch() {
    let model = real_model("gemma3-270m");
    let g = golden_json("gemma_circuits.json");
    check_scores(model, &g, "gemma3");
    check_patching(model, &g, "gemma3");
}

/// Keeps each layer's reader gradients.
#[derive(Default)]
struct KeepGrads {
    layers: Vec<Option<ReaderGrads>>,
    logits: Vec<f32>,
}

impl BranchSink for KeepGrads {
    fn wants_nodes(&self) -> bool {
        false
    }
    fn input(&mut self, _: &[f32]) -> attnscope::model::Result<()> {
        Ok(())
    }
    fn heads(
        &mut self,
        _: usize,
        _: &attnscope::model::backward::LayerHeads,
    ) -> attnscope::model::Result<()> {
        Ok(())
    }
    fn mlp(&mut self, _: usize, _: &[f32]) -> attnscope::model::Result<()> {
        Ok(())
    }
    fn logits_gradient(&mut self, g: &[f32]) -> attnscope::model::Result<()> {
        self.logits = g.to_vec();
        Ok(())
    }
    fn layer_gradients(&mut self, l: usize, g: &ReaderGrads) -> attnscope::model::Result<()> {
        if self.layers.len() <= l {
            self.layers.resize_with(l + 1, || None);
        }
        self.layers[l] = Some(ReaderGrads {
            q: g.q.clone(),
            k: g.k.clone(),
            v: g.v.clone(),
            mlp: g.mlp.clone(),
        });
        Ok(())
    }
}

/// Each layer's q, k and v readers' gradients add up to the attention branch's (∂/∂resid_pre −
/// ∂/∂resid_mid), its MLP reader's is the MLP branch's (∂/∂resid_mid − ∂/∂resid_post), and the
/// logits reader's is ∂/∂ the last residual stream: on the tiny model and on SmolLM2.
#[test]
fn the_readers_gradients_add_up_to_the_branches() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = Model::load(tiny_gguf(&dir).to_str().unwrap(), Precision::Exact, false).unwrap();
    for (model, tokens) in [
        (&tiny, vec![5u32, 70, 71, 72, 73, 9]),
        (
            real_model("smollm2-135m"),
            vec![4582, 8590, 284, 8363, 13197, 288],
        ),
    ] {
        let metric = Metric::LogitDiff {
            answer: 3,
            wrong: 7,
        };
        let mut keep = KeepGrads::default();
        let (x0, _) = model.input_embeddings(&tokens).unwrap();
        model.branch_run(&x0, metric, true, &mut keep).unwrap();
        let hooks = model
            .hook_gradients(&tokens, GradMetric::Metric(metric), &|name: &str| {
                name.ends_with("hook_resid_pre")
                    || name.ends_with("hook_resid_mid")
                    || name.ends_with("hook_resid_post")
            })
            .unwrap();
        let grad = |name: String| -> Vec<f32> {
            let full = format!("{name}_grad");
            hooks.grads.iter().find(|g| g.0 == full).unwrap().2.clone()
        };
        let nl = model.dims.n_layers;
        // every layer of the tiny model; SmolLM2's first, middle and last
        for l in [0, nl / 2, nl - 1] {
            let g = keep.layers[l].as_ref().unwrap();
            let (pre, mid, post) = (
                grad(format!("blocks.{l}.hook_resid_pre")),
                grad(format!("blocks.{l}.hook_resid_mid")),
                grad(format!("blocks.{l}.hook_resid_post")),
            );
            let w = pre.len();
            let mut parts = vec![0f32; w];
            for chunk in g.q.chunks(w).chain(g.k.chunks(w)).chain(g.v.chunks(w)) {
                parts.iter_mut().zip(chunk).for_each(|(p, c)| *p += c);
            }
            let attn: Vec<f32> = pre.iter().zip(&mid).map(|(a, b)| a - b).collect();
            let mlp: Vec<f32> = mid.iter().zip(&post).map(|(a, b)| a - b).collect();
            let shape = [w];
            for (what, got, want) in [("attention", &parts, &attn), ("mlp", &g.mlp, &mlp)] {
                assert_cells(
                    &format!("{} layer {l} {what} readers", model.info.name),
                    array_cells(&shape, got),
                    array_cells(&shape, want),
                    Bound::RelMax(1e-4),
                );
            }
        }
        let last = grad(format!("blocks.{}.hook_resid_post", nl - 1));
        assert_cells(
            &format!("{} logits reader", model.info.name),
            array_cells(&[last.len()], &keep.logits),
            array_cells(&[last.len()], &last),
            Bound::RelMax(1e-6),
        );
    }
}

/// `circuit --json` on the tiny model: every edge once, sorted by |score|, the nodes, both runs'
/// metrics; `--evaluate`'s ladder ends at faithfulness 1 and starts from the corrupted run;
/// `--exact-edges` gives one exact change per edge; `--pairs` averages (two copies of one pair
/// give that pair's scores); `info` prints the graph's counts.
#[test]
fn the_command_on_the_tiny_model() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let m = m.to_str().unwrap();
    let pair = [
        "--clean",
        "abcd",
        "--corrupt",
        "abxd",
        "--answer",
        "e",
        "--wrong",
        "f",
    ];
    let mut args = vec![
        "circuit",
        "-m",
        m,
        "--json",
        "--evaluate",
        "--exact-edges",
        "5",
    ];
    args.extend(pair);
    let r = run_json(&args);
    let edges = r["edges"].as_array().unwrap();
    // 2 layers, 4 heads, 2 KV heads: readers read 1, then 6 (attention), 5 and 10 (MLPs), 11
    assert_eq!(r["n_edges"], 8 + 5 + 8 * 6 + 10 + 11);
    assert_eq!(edges.len(), r["n_edges"].as_u64().unwrap() as usize);
    let abs: Vec<f64> = edges
        .iter()
        .map(|e| e["score"].as_f64().unwrap().abs())
        .collect();
    assert!(abs.windows(2).all(|w| w[0] >= w[1]), "sorted by |score|");
    assert_eq!(r["nodes"].as_array().unwrap().len(), 11 + 19);
    assert_eq!(r["nodes"][0]["name"], "input");
    for k in ["metric", "clean_metric", "corrupt_metric", "seconds"] {
        assert!(!r[k].is_null(), "{k}");
    }
    let ev = &r["evaluation"];
    let ladder = ev["ladder"].as_array().unwrap();
    assert_eq!(ladder.len(), 10);
    assert_eq!(ladder[9]["faithfulness"], 1.0);
    assert_eq!(ladder[9]["metric"], ev["clean_metric"]);
    // 0.1% of 82 edges is none: the corrupted run
    assert_eq!(ladder[0]["edges"], 0);
    assert_eq!(ladder[0]["metric"], ev["corrupt_metric"]);
    assert!(ev["cpr"].is_f64() && ev["cmd"].is_f64());
    assert_eq!(r["exact_edges"]["edges"].as_array().unwrap().len(), 5);
    // two copies of the pair average to the pair itself
    let line = r#"{"clean": "abcd", "corrupt": "abxd", "answer": "e", "wrong": "f"}"#;
    let file = dir.path().join("pairs.jsonl");
    std::fs::write(&file, format!("{line}\n{line}\n")).unwrap();
    let two = run_json([
        "circuit",
        "-m",
        m,
        "--json",
        "--pairs",
        file.to_str().unwrap(),
    ]);
    assert_eq!(two["pairs"], 2);
    let one = run_json(["circuit", "-m", m, "--json"].into_iter().chain(pair));
    for (a, b) in one["edges"]
        .as_array()
        .unwrap()
        .iter()
        .zip(two["edges"].as_array().unwrap())
    {
        let (a, b) = (a["score"].as_f64().unwrap(), b["score"].as_f64().unwrap());
        assert!((a - b).abs() <= 1e-6 * a.abs().max(1e-3), "{a} vs {b}");
    }
    let info = run_json(["info", "-m", m, "--json"]);
    assert_eq!(info["circuit_graph"]["edges"], 82);
    let text = String::from_utf8(run_ok(["info", "-m", m]).stdout).unwrap();
    assert!(
        text.contains("11 nodes") && text.contains("82 edges"),
        "{text}"
    );
}

/// Bad input exits 2 with the cause named, before any run: texts of different token counts
/// (the first differing position), a multi-token answer, a JSONL line without a field (its
/// line), `--steps 0`, `--steps` without EAP-IG, a missing flag, the same answer and wrong token,
/// an encoder.
#[test]
fn bad_input_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let m = m.to_str().unwrap();
    let run = |extra: &[&str]| -> String {
        let mut args = vec!["circuit", "-m", m];
        args.extend(extra);
        run_err(args, 2)
    };
    let e = run(&[
        "--clean",
        "abcd",
        "--corrupt",
        "abxde",
        "--answer",
        "e",
        "--wrong",
        "f",
    ]);
    assert!(
        e.contains("4 tokens and the corrupted text 5") && e.contains("position 2"),
        "{e}"
    );
    let e = run(&[
        "--clean",
        "abcd",
        "--corrupt",
        "abxd",
        "--answer",
        "ef",
        "--wrong",
        "f",
    ]);
    assert!(
        e.contains("--answer \"ef\"") && e.contains("exactly one token"),
        "{e}"
    );
    let file = dir.path().join("p.jsonl");
    let ok = r#"{"clean": "abcd", "corrupt": "abxd", "answer": "e", "wrong": "f"}"#;
    std::fs::write(
        &file,
        format!("{ok}\n{{\"clean\": \"ab\", \"corrupt\": \"ax\", \"answer\": \"e\"}}\n"),
    )
    .unwrap();
    let e = run(&["--pairs", file.to_str().unwrap()]);
    assert!(e.contains("line 2: no \"wrong\" field"), "{e}");
    let pair = [
        "--clean",
        "abcd",
        "--corrupt",
        "abxd",
        "--answer",
        "e",
        "--wrong",
        "f",
    ];
    for (extra, says) in [
        (&["--method", "eap-ig", "--steps", "0"][..], "--steps 0"),
        (&["--steps", "3"][..], "--steps is EAP-IG's"),
    ] {
        let e = run(&[&pair[..], extra].concat());
        assert!(e.contains(says), "{e}");
    }
    let e = run(&["--clean", "abcd", "--corrupt", "abxd", "--answer", "e"]);
    assert!(e.contains("--wrong is missing"), "{e}");
    let e = run(&[
        "--clean",
        "abcd",
        "--corrupt",
        "abxd",
        "--answer",
        "e",
        "--wrong",
        "e",
    ]);
    assert!(e.contains("the same token"), "{e}");
    let e = run_err(
        [&["circuit", "-m", "all-minilm-l6-v2"][..], &pair[..]].concat(),
        2,
    );
    assert!(e.contains("needs a decoder"), "{e}");
    // --html never writes over a file without --force, nor over an input even with it; the
    // refusal comes before any run, and the files stay as they were
    let page = dir.path().join("page.html");
    std::fs::write(&page, "mine").unwrap();
    let e = run(&[&pair[..], &["--html", page.to_str().unwrap()]].concat());
    assert!(e.contains("already exists; pass --force"), "{e}");
    assert_eq!(std::fs::read_to_string(&page).unwrap(), "mine");
    let pairs_text = std::fs::read_to_string(&file).unwrap();
    let e = run(&["--pairs", file.to_str().unwrap()]
        .into_iter()
        .chain(["--html", file.to_str().unwrap(), "--force"])
        .collect::<Vec<_>>());
    assert!(e.contains(file.to_str().unwrap()), "{e}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), pairs_text);
    let e = run(&[&pair[..], &["--html", m, "--force"]].concat());
    assert!(e.contains(m), "{e}");
}
