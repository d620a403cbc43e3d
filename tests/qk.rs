//! `attnscope qk` (issue #58): a head's score split into (query-side component × key-side
//! component) terms. On SmolLM2 and the default model against torch's float64 split on
//! transformers (tests/golden/qk_circuits.json, the `qk` part of
//! ../shared/reference/{smol,qwen}_circuits.json from its scripts/circuits_ref.py); on tiny models
//! of every family the terms add up to the engine's own `hook_attn_scores`; the command line and
//! bad input.

mod common;

use attnscope::analysis::qk::{qk, Against, QkOptions, QkReport};
use attnscope::model::tiny::{tiny_model, write_gguf};
use attnscope::model::{Arch, Model, Precision};
use candle_core::quantized::GgmlDType;
use common::*;
use serde_json::Value;
use std::collections::BTreeMap;

fn opts(tokens: &[u32], layer: usize, head: usize, query: usize, key: Option<usize>) -> QkOptions {
    QkOptions {
        tokens: tokens.to_vec(),
        layer,
        head,
        query: Some(query),
        key,
        against: Against::Second,
    }
}

fn terms_by_pair(r: &QkReport) -> BTreeMap<(String, String), f64> {
    r.terms
        .iter()
        .map(|t| ((t.query_side.clone(), t.key_side.clone()), t.value))
        .collect()
}

/// One reference case: the row's scores, the split of the top key's score into its 50 largest
/// terms, their sum.
fn check_case(model: &Model, ids: &[u32], case: &Value, label: &str) {
    let u = |k: &str| case[k].as_u64().unwrap() as usize;
    let (layer, head, query, key) = (u("layer"), u("head"), u("query"), u("key"));
    let label = format!("{label} layer {layer} head {head} query {query} key {key}");
    let r = qk(model, &opts(ids, layer, head, query, Some(key))).unwrap();
    check_row(&r, case, &label);
    let worst = check_terms(&r, case, &label);
    // the sum against the score, and against the reference's
    let want_sum = case["terms_sum"].as_f64().unwrap();
    eprintln!(
        "{label}: score {:.6} sum {:.6} gap {:.2e}; torch's sum {want_sum:.6}; worst term {worst:.2e}",
        r.score, r.sum, r.gap
    );
    assert!(
        r.gap.abs() <= 1e-4 * r.score.abs().max(1.0),
        "{label}: the terms add up to {} but the score is {}",
        r.sum,
        r.score
    );
    assert!(
        (r.sum - want_sum).abs() <= 1e-4 * want_sum.abs().max(1.0),
        "{label}: the sum {} against torch's {want_sum}",
        r.sum
    );
    assert_eq!(
        r.terms.len(),
        (r.components.len() + 1).pow(2),
        "{label}: every term"
    );
}

/// The forward's scores of the row against transformers', their softmax against transformers'
/// attention, and the reference's key its row's top.
fn check_row(r: &QkReport, case: &Value, label: &str) {
    let cells = |v: &Value| -> Vec<(usize, f64)> {
        let row = v.as_array().unwrap().iter().enumerate();
        row.filter_map(|(j, s)| s.as_f64().map(|s| (j, s)))
            .collect()
    };
    let want = cells(&case["row_scores"]);
    let got: Vec<(usize, f64)> = r
        .row_scores
        .iter()
        .enumerate()
        .filter_map(|(j, s)| s.map(|s| (j, s)))
        .collect();
    assert_cells(
        &format!("{label}: row scores"),
        got.clone(),
        want.clone(),
        Bound::RelMax(1e-4),
    );
    let top = want.iter().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap().0;
    assert_eq!(top, r.key, "{label}: the reference's key is its row's top");
    let max = got.iter().map(|x| x.1).fold(f64::MIN, f64::max);
    let z: f64 = got.iter().map(|(_, s)| (s - max).exp()).sum();
    let probs = got.iter().map(|&(j, s)| (j, (s - max).exp() / z));
    let want = cells(&case["row_probs_transformers"]);
    assert_cells(
        &format!("{label}: softmax of the row against transformers' attention"),
        probs,
        want,
        Bound::Abs(1e-5),
    );
}

/// The 50 largest terms, each against torch's, and no other term larger than the 50th; the
/// worst difference.
fn check_terms(r: &QkReport, case: &Value, label: &str) -> f64 {
    let mine = terms_by_pair(r);
    let want: Vec<((String, String), f64)> = case["terms_top"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let s = |k: &str| t[k].as_str().unwrap().to_string();
            (
                (s("query_side"), s("key_side")),
                t["value"].as_f64().unwrap(),
            )
        })
        .collect();
    let got = want.iter().map(|(k, _)| {
        let v = *mine
            .get(k)
            .unwrap_or_else(|| panic!("{label}: no term {k:?}"));
        (k.clone(), v)
    });
    let worst = assert_cells(
        &format!("{label}: 50 largest terms"),
        got,
        want.clone(),
        Bound::RelMax(1e-3),
    );
    let (largest, fiftieth) = (want[0].1.abs(), want[49].1.abs());
    let outside = r.terms[50..]
        .iter()
        .map(|t| t.value.abs())
        .fold(0.0, f64::max);
    assert!(
        outside <= fiftieth + 1e-3 * largest,
        "{label}: a term outside the reference's top 50 is {outside} > {fiftieth}"
    );
    worst
}

/// Every reference case of `g` (`{"clean", "clean_ids", "qk": [...]}`) on `alias`.
fn check_model(alias: &str, g: &Value) {
    let model = real_model(alias);
    let ids = token_ids(&g["clean_ids"]);
    assert_eq!(
        model.encode(g["clean"].as_str().unwrap(), false).unwrap(),
        ids,
        "{alias}: the tokens"
    );
    let cases = g["qk"].as_array().unwrap();
    assert_eq!(cases.len(), 3);
    for case in cases {
        check_case(model, &ids, case, alias);
    }
}

#[test]
fn smollm2_split_matches_torch() {
    check_model("smollm2-135m", &golden_json("qk_circuits.json")["smol"]);
}

#[test]
fn qwen_split_matches_torch() {
    check_model(
        "qwen2.5-coder-0.5b",
        &golden_json("qk_circuits.json")["qwen"],
    );
}

/// Gemma 3: its post-attention norms, per-head q/k norms (each scale frozen), √d_model embedding
/// scale, query_pre_attn_scalar and sliding layers' own rotary base, against
/// tests/golden/make_qk_gemma_golden.py's float64 split on transformers.
#[test]
fn gemma3_split_matches_torch() {
    check_model("gemma3-270m", &golden_json("gemma_qk.json"));
}

const TOKENS: [u32; 12] = [72, 101, 108, 108, 111, 32, 256, 258, 259, 44, 32, 119];

/// The generated tiny models (Qwen2, Llama: GGUF files in `dir`) and the Hugging Face fixtures
/// of the other families.
fn every_family(dir: &tempfile::TempDir) -> Vec<(String, Model)> {
    let mut out = Vec::new();
    for arch in [Arch::Qwen2, Arch::Llama] {
        let path = dir.path().join(format!("{arch:?}.gguf"));
        write_gguf(&tiny_model(arch, 7), arch, GgmlDType::F32, &path).unwrap();
        let model = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
        out.push((format!("{arch:?}"), model));
    }
    for fam in [
        "llama3", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "gpt2",
    ] {
        let path = golden(&format!("arch/{fam}"));
        let model = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
        out.push((fam.to_string(), model));
    }
    out
}

/// `|sum − score|` relative to the largest of |score|, the scores it is the difference of, and
/// the largest |term| (the forward rounds each score on its own scale); under a soft-cap,
/// divided by the cap's inverse's slope at the row's scores, cosh²(s/c) (the forward's score is
/// after the cap: its rounding, taken back through atanh, grows by that much).
fn relative_gap(r: &QkReport) -> f64 {
    let largest = r.terms.first().map_or(0.0, |t| t.value.abs());
    let slope = r.softcap.map_or(1.0, |c| {
        r.row_scores
            .iter()
            .flatten()
            .map(|s| (s / c).cosh().powi(2))
            .fold(1.0, f64::max)
    });
    let scale = [
        r.score,
        r.key_score,
        r.against_score.unwrap_or(0.0),
        largest,
    ]
    .iter()
    .fold(1e-30, |m: f64, x| m.max(x.abs()));
    r.gap.abs() / scale / slope
}

/// On every family, every layer, the first and last head, two queries, a named key and the
/// attended key against the second and against the mean: the terms add up to the engine's own
/// `hook_attn_scores` (before a soft-cap) to 1e-5 relative, and name the graph's nodes.
#[test]
fn terms_add_up_to_the_engines_score_on_every_family() {
    let dir = tempfile::tempdir().unwrap();
    let mut worst = (0.0f64, String::new());
    for (label, model) in every_family(&dir) {
        let d = &model.dims;
        let ids: Vec<u32> = TOKENS.iter().map(|&t| t % d.vocab_size as u32).collect();
        let n = ids.len();
        for layer in 0..d.n_layers {
            for head in [0, d.n_heads - 1] {
                for query in [n - 1, 5] {
                    let lo = d
                        .window_of(layer)
                        .map_or(0, |w| (query + 1).saturating_sub(w));
                    for (key, against) in [
                        (Some(lo), Against::Second),
                        (None, Against::Second),
                        (None, Against::Mean),
                    ] {
                        let mut o = opts(&ids, layer, head, query, key);
                        o.against = against;
                        let r = qk(&model, &o).unwrap();
                        let case = format!("{label} layer {layer} head {head} query {query} key {key:?} {against:?}");
                        check_tiny_report(&model, &r, &case);
                        let g = relative_gap(&r);
                        if g > worst.0 {
                            worst = (g, case.clone());
                        }
                        assert!(g <= 1e-5, "{case}: the terms add up to {} against the score {} (relative gap {g:.2e})", r.sum, r.score);
                    }
                }
            }
        }
    }
    eprintln!("largest relative gap {:.2e} ({})", worst.0, worst.1);
}

/// A report's shape: every term once, the components the graph's upstream nodes of the layers
/// before, the keys chosen as the row's scores say.
fn check_tiny_report(model: &Model, r: &QkReport, case: &str) {
    let d = &model.dims;
    let ob = usize::from(d.arch == Arch::Gpt2);
    assert_eq!(
        r.components.len(),
        1 + r.layer * (d.n_heads + ob + 1),
        "{case}"
    );
    assert_eq!(r.components[0], "input", "{case}");
    if r.layer > 0 {
        assert!(
            r.components
                .contains(&format!("a{}.h{}", r.layer - 1, d.n_heads - 1)),
            "{case}"
        );
        assert!(
            r.components.contains(&format!("m{}", r.layer - 1)),
            "{case}"
        );
        assert_eq!(
            r.components.contains(&"a0.bias".to_string()),
            ob == 1,
            "{case}"
        );
    }
    assert_eq!(r.terms.len(), (r.components.len() + 1).pow(2), "{case}");
    assert_eq!(r.kv_head, r.head / d.group_size(), "{case}");
    let visible: Vec<(usize, f64)> = r
        .row_scores
        .iter()
        .enumerate()
        .filter_map(|(j, s)| s.map(|s| (j, s)))
        .collect();
    if r.against.is_some() {
        let top = visible
            .iter()
            .fold(visible[0], |b, &x| if x.1 > b.1 { x } else { b });
        assert_eq!(r.key, top.0, "{case}: the attended key");
        let lead = r.key_score - r.against_score.unwrap();
        assert!(
            (r.score - lead).abs() <= 1e-12 * lead.abs().max(1.0),
            "{case}"
        );
    }
    if let Some(j) = r.against_key {
        let second = visible.iter().filter(|x| x.0 != r.key).fold(
            None,
            |b: Option<(usize, f64)>, &x| match b {
                Some(b) if b.1 >= x.1 => Some(b),
                _ => Some(x),
            },
        );
        assert_eq!(Some(j), second.map(|s| s.0), "{case}: the second key");
    }
}

/// Bad requests: a clear message each, exit 2 from the command line (below), never a number.
#[test]
fn bad_requests_are_refused_with_the_reason() {
    use attnscope::analysis::request::is_bad_input;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q.gguf");
    write_gguf(
        &tiny_model(Arch::Qwen2, 7),
        Arch::Qwen2,
        GgmlDType::F32,
        &path,
    )
    .unwrap();
    let model = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
    let (nl, nh) = (model.dims.n_layers, model.dims.n_heads);
    let n = TOKENS.len();
    let refused = |o: QkOptions, want: &str| {
        let e = qk(&model, &o).unwrap_err();
        assert!(is_bad_input(&e), "{e:#}");
        assert!(format!("{e:#}").contains(want), "{e:#} lacks {want:?}");
    };
    refused(opts(&TOKENS, nl, 0, n - 1, None), "layer");
    refused(opts(&TOKENS, 0, nh, n - 1, None), "head");
    refused(opts(&TOKENS, 0, 0, n, None), "query position");
    refused(opts(&TOKENS, 0, 0, n - 1, Some(n)), "key position");
    refused(opts(&TOKENS, 0, 0, 3, Some(4)), "causal mask");
    refused(opts(&TOKENS, 0, 0, 0, None), "--key 0");
    refused(opts(&[], 0, 0, 0, None), "at least one token");
    // a key outside a sliding window names the window
    let mistral = Model::load(
        golden("arch/mistral").to_str().unwrap(),
        Precision::Exact,
        false,
    )
    .unwrap();
    let w = mistral.dims.window_of(0).expect("the fixture has a window");
    let e = qk(&mistral, &opts(&TOKENS, 0, 0, n - 1, Some(n - 1 - w))).unwrap_err();
    assert!(
        is_bad_input(&e) && format!("{e}").contains(&format!("sliding window of {w}")),
        "{e}"
    );
    // an encoder is refused with the reason
    let bert = Model::load(
        golden("arch/bert").to_str().unwrap(),
        Precision::Exact,
        false,
    )
    .unwrap();
    let e = qk(&bert, &opts(&[101, 2000, 102], 0, 0, 2, None)).unwrap_err();
    assert!(
        is_bad_input(&e) && format!("{e}").contains("encoder"),
        "{e}"
    );
}

/// The command: the table with the score, the sum and the gap; `--json` with every term; exit 2
/// on bad input.
#[test]
fn command_line() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let m = m.to_str().unwrap();
    let base = [
        "qk",
        "--model",
        m,
        "--text",
        "hello world, again",
        "--layer",
        "1",
        "--head",
        "2",
    ];
    let out = run_ok(base.iter().chain(&["--top", "4"]));
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "QK split of head 1.2",
        "second key",
        "gap",
        "query side",
        "key side",
        "share",
        "By key side component",
    ] {
        assert!(text.contains(want), "{want:?} not in\n{text}");
    }
    let j = run_json(base.iter().chain(&["--key", "1", "--json"]));
    for k in [
        "layer", "head", "query", "key", "score", "terms", "sum", "gap",
    ] {
        assert!(!j[k].is_null(), "{k} missing from {j}");
    }
    assert_eq!(j["key"], 1);
    assert!(j["against"].is_null());
    let comps = j["components"].as_array().unwrap().len();
    assert_eq!(
        j["terms"].as_array().unwrap().len(),
        (comps + 1) * (comps + 1)
    );
    let t0 = &j["terms"][0];
    assert!(t0["query_side"].is_string() && t0["key_side"].is_string() && t0["value"].is_f64());
    let sum: f64 = j["terms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["value"].as_f64().unwrap())
        .sum();
    assert!((sum - j["sum"].as_f64().unwrap()).abs() < 1e-9);
    let mean = run_json(base.iter().chain(&["--against", "mean", "--json"]));
    assert_eq!(mean["against"], "mean");
    for (extra, want) in [
        (vec!["--key", "9", "--query", "2"], "causal mask"),
        (vec!["--head", "99"], "head 99"),
        (vec!["--top", "0"], "--top 0"),
        (vec!["--against", "top"], "second, mean"),
    ] {
        let mut args: Vec<&str> = base.to_vec();
        if extra[0] == "--head" {
            args.truncate(args.len() - 2);
        }
        args.extend(&extra);
        let err = run_err(&args, 2);
        assert!(err.contains(want), "{extra:?}: {err}");
    }
}
