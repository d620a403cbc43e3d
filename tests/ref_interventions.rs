//! Independent references for the interventions that had none (#55): `dla` (every head's, MLP's
//! and the embedding's part of a logit and of a logit difference), `patch --hook attn-out`,
//! `mlp-out` (layer × position), `z` and `pattern` (layer × head), `ablate --mlp` with `zero` on
//! every position and `mean` on a few (`--positions`), and the KL column of head and MLP
//! ablation. The CLI's `--json` reports on SmolLM2 and the default model, every cell against
//! transformers with torch hooks (`tests/golden/<m>_ref_interventions.json`, made by
//! `tests/golden/make_interventions_golden.py`, whose header defines each number).
//!
//! Bounds: measured here, then asserted with a margin of 4x or more (`assert_cells` prints each
//! check's worst cell); the f32 forwards of both sides differ by ~1e-5 on a logit. Measured
//! worst: logits and DLA parts 2.5e-5, `recovered` 2.4e-6, a head's Δ log p or KL 1.5e-5, an
//! MLP's 6.5e-5 (of 14 nats), the final norm's scale 5.3e-7 of it.

mod common;
use common::*;
use serde_json::Value;

/// (the CLI's alias, the golden's prefix)
const SMOL: (&str, &str) = ("smollm2-135m", "smol");
const QWEN: (&str, &str) = ("qwen2.5-coder-0.5b", "qwen");

/// A logit, a logit difference or a DLA part against transformers (worst 2.5e-5).
const LOGIT: Bound = Bound::Abs(1e-4);
/// Patching's `recovered` (a fraction of the clean − corrupt gap of ~11 logits) against the
/// reference's three logit differences (worst 2.4e-6).
const RECOVERED: Bound = Bound::Abs(2e-5);
/// A head's Δ log p or KL divergence (nats) against transformers (worst 1.5e-5).
const NATS: Bound = Bound::Abs(1e-4);
/// An MLP's: its removal moves log p by up to 14 nats (Qwen's layer 0, KL 10.6), where the
/// logits' f32 rounding grows with them (measured 6.5e-5 there).
const MLP_NATS: Bound = Bound::RelMax(2e-5);

fn reference(prefix: &str) -> Value {
    golden_json(&format!("{prefix}_ref_interventions.json"))
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

fn u(v: &Value) -> usize {
    v.as_u64().unwrap_or_else(|| panic!("not an index: {v}")) as usize
}

/// The ids of a report's `tokens` (`[{"id", "text"}]`).
fn ids_of(tokens: &Value) -> Vec<u32> {
    let ids: Vec<Value> = tokens
        .as_array()
        .unwrap_or_else(|| panic!("tokens: {tokens}"))
        .iter()
        .map(|t| t["id"].clone())
        .collect();
    token_ids(&Value::Array(ids))
}

/// A golden `[rows][cols]` grid's cells keyed `(row, col)`, each cell read by `cell`.
fn grid(v: &Value, cell: impl Fn(&Value) -> f64) -> Vec<((usize, usize), f64)> {
    let rows = v.as_array().unwrap_or_else(|| panic!("not a grid: {v}"));
    rows.iter()
        .enumerate()
        .flat_map(|(r, row)| {
            let row = row.as_array().unwrap_or_else(|| panic!("not a row: {row}"));
            row.iter()
                .enumerate()
                .map(|(c, x)| ((r, c), cell(x)))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// A golden `[rows]` list's cells keyed `(row, 0)`, each read by `cell`.
fn list(v: &Value, cell: impl Fn(&Value) -> f64) -> Vec<((usize, usize), f64)> {
    let rows = v.as_array().unwrap_or_else(|| panic!("not a list: {v}"));
    rows.iter()
        .enumerate()
        .map(|(r, x)| ((r, 0), cell(x)))
        .collect()
}

/// A report's entries (`heads`, `mlp`, `results`) keyed by two of their fields (`(layer, 0)`
/// where `b` is None), each read as `field`.
fn cells(rows: &Value, a: &str, b: Option<&str>, field: &str) -> Vec<((usize, usize), f64)> {
    let rows = rows
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {rows}"));
    rows.iter()
        .map(|r| ((u(&r[a]), b.map_or(0, |b| u(&r[b]))), f(&r[field])))
        .collect()
}

/// One `dla` case (`lesson` or `ioi`) and metric (`logit`: `--answer` alone, `diff`: with
/// `--wrong`): the metric, the parts' sum, the final norm's scale and every part (the embedding,
/// each head, each MLP; W_O's and the final norm's biases, which neither model has, as 0)
/// against transformers.
fn check_dla(model: (&str, &str), g: &Value, case: &str, metric: &str) {
    let (alias, prefix) = model;
    let (c, want) = (&g["dla"][case], &g["dla"][case][metric]);
    let text = g["texts"][case_text(case)].as_str().unwrap();
    let mut args = vec!["dla", "--model", alias, "--text", text, "--json"];
    let (answer, wrong) = (c["answer_id"].to_string(), c["wrong_id"].to_string());
    // the lesson's answer is the model's top token: `dla`'s default (`--answer next`) there
    if case != "lesson" || metric != "logit" {
        args.extend(["--answer", &answer]);
    }
    if metric == "diff" {
        args.extend(["--wrong", &wrong]);
    }
    let r = run_json(&args);
    let label = format!("{prefix} dla {case} {metric}");
    let want_ids = token_ids(&g["texts"][format!("{}_ids", case_text(case))]);
    assert_eq!(ids_of(&r["tokens"]), want_ids, "{label}: token ids");
    assert_eq!(r["answer"]["id"].to_string(), answer, "{label}: answer");
    let n_layers = want["mlp"].as_array().map_or(0, |m| m.len());
    let whole = ["metric", "sum_of_parts", "embed"];
    let mut got: Vec<_> = whole.map(|k| ((k, 0, 0), f(&r[k]))).into();
    let mut exp: Vec<_> = whole.map(|k| ((k, 0, 0), f(&want[k]))).into();
    // both models' o_proj and final norm have no bias: those parts are 0
    got.push((("final_bias", 0, 0), f(&r["final_bias"])));
    exp.push((("final_bias", 0, 0), 0.0));
    for l in 0..n_layers {
        got.push((("attn_bias", l, 0), f(&r["attn_bias"][l])));
        exp.push((("attn_bias", l, 0), 0.0));
    }
    let tag = |name: &'static str, v: Vec<((usize, usize), f64)>| {
        v.into_iter().map(move |((a, b), x)| ((name, a, b), x))
    };
    got.extend(tag(
        "head",
        cells(&r["heads"], "layer", Some("head"), "dla"),
    ));
    got.extend(tag("mlp", list(&r["mlp"], f)));
    exp.extend(tag("head", grid(&want["heads"], f)));
    exp.extend(tag("mlp", list(&want["mlp"], f)));
    assert_cells(&label, got, exp, LOGIT);
    let scale = [(0, f(&r["final_scale"]))];
    assert_cells(
        &format!("{label} final scale"),
        scale,
        [(0, f(&c["final_scale"]))],
        Bound::RelMax(4e-6),
    );
}

/// The texts' key of a DLA case.
fn case_text(case: &str) -> &'static str {
    match case {
        "lesson" => "lesson",
        "ioi" => "clean",
        _ => panic!("no DLA case {case}"),
    }
}

fn dla_matches_transformers(model: (&str, &str)) {
    let g = reference(model.1);
    for case in ["lesson", "ioi"] {
        for metric in ["logit", "diff"] {
            check_dla(model, &g, case, metric);
        }
    }
}

#[test]
fn dla_matches_transformers_smollm() {
    dla_matches_transformers(SMOL);
}

#[test]
fn dla_matches_transformers_qwen() {
    dla_matches_transformers(QWEN);
}

/// `patch --hook HOOK` on the IOI-style pair: both runs' logit differences, and every cell's
/// patched logit difference and `recovered` against transformers.
fn check_patch(model: (&str, &str), g: &Value, hook: &str, key: &str) {
    let (alias, prefix) = model;
    let (t, p) = (&g["texts"], &g["patching"]);
    let (answer, wrong) = (p["answer_id"].to_string(), p["wrong_id"].to_string());
    let r = run_json([
        "patch",
        "--model",
        alias,
        "--clean",
        t["clean"].as_str().unwrap(),
        "--corrupt",
        t["corrupt"].as_str().unwrap(),
        "--answer",
        &answer,
        "--wrong",
        &wrong,
        "--hook",
        hook,
        "--json",
    ]);
    let label = format!("{prefix} patch --hook {hook}");
    assert_eq!(
        ids_of(&r["clean"]),
        token_ids(&t["clean_ids"]),
        "{label}: clean ids"
    );
    assert_eq!(
        ids_of(&r["corrupt"]),
        token_ids(&t["corrupt_ids"]),
        "{label}: corrupt ids"
    );
    let runs = |v: &Value| {
        [("clean", 0), ("corrupt", 1)].map(|(k, i)| (i, f(&v[format!("{k}_logit_diff")])))
    };
    assert_cells(
        &format!("{label}: clean, corrupt"),
        runs(&r),
        runs(p),
        LOGIT,
    );
    let by = if key == "z" || key == "pattern" {
        "head"
    } else {
        "pos"
    };
    let got = cells(&r["results"], "layer", Some(by), "logit_diff");
    assert_cells(&label, got, grid(&p[key], f), LOGIT);
    // recovered = (patched − corrupt) / (clean − corrupt), from the reference's three numbers
    let (c, x) = (f(&p["clean_logit_diff"]), f(&p["corrupt_logit_diff"]));
    let want = grid(&p[key], |v| (f(v) - x) / (c - x));
    let got = cells(&r["results"], "layer", Some(by), "recovered");
    assert_cells(&format!("{label} recovered"), got, want, RECOVERED);
}

/// Each `--hook` with the golden's key.
const HOOKS: [(&str, &str); 4] = [
    ("attn-out", "attn_out"),
    ("mlp-out", "mlp_out"),
    ("z", "z"),
    ("pattern", "pattern"),
];

fn patching_matches_transformers(model: (&str, &str), hooks: &[(&str, &str)]) {
    let g = reference(model.1);
    for &(hook, key) in hooks {
        check_patch(model, &g, hook, key);
    }
}

#[test]
fn patching_matches_transformers_smollm() {
    patching_matches_transformers(SMOL, &HOOKS);
}

/// Qwen's `--hook pattern` is left out to keep this binary near a minute: its 336 patched
/// maps run one forward each (~45 s of CPU here, a third of the binary). The golden holds its
/// grid; it agreed to 1.5e-5 when the golden was made (add `HOOKS[3]` to check it again). The
/// edited-pattern path it takes is SmolLM2's (also grouped-query).
#[test]
fn patching_matches_transformers_qwen() {
    patching_matches_transformers(QWEN, &HOOKS[..3]);
}

/// `ablate --mlp` with one of the reference's settings (`zero_all`: `--method zero`, every
/// position; `mean_subset`: `--method mean --positions`, the mean over every position): every
/// head's and MLP's Δ log p and KL against transformers.
fn check_ablate(model: (&str, &str), g: &Value, setting: &str) {
    let (alias, prefix) = model;
    let (t, a) = (&g["texts"], &g["ablation"][setting]);
    let method = a["method"].as_str().unwrap();
    let ids = token_ids(&t["lesson_ids"]);
    let positions: Vec<usize> = a["positions"].as_array().unwrap().iter().map(u).collect();
    let mut args = vec![
        "ablate",
        "--model",
        alias,
        "--text",
        t["lesson"].as_str().unwrap(),
    ];
    args.extend(["--method", method, "--mlp"]);
    // the target is the model's top token: `ablate`'s default, given as an id once
    let target = g["ablation"]["target_id"].to_string();
    if method == "mean" {
        args.extend(["--target", &target]);
    }
    // the subset as a user writes it, runs of positions as ranges (2,5-7,17)
    let spec = compress(&positions);
    if positions.len() < ids.len() {
        args.extend(["--positions", &spec]);
    }
    args.push("--json");
    let r = run_json(&args);
    let label = format!(
        "{prefix} ablate --method {method} --mlp ({} positions)",
        positions.len()
    );
    assert_eq!(ids_of(&r["tokens"]), ids, "{label}: token ids");
    assert_eq!(r["target"]["id"].to_string(), target, "{label}: target");
    let reported: Vec<usize> = match r["positions"].as_array() {
        Some(ps) => ps.iter().map(u).collect(),
        None => (0..ids.len()).collect(),
    };
    assert_eq!(reported, positions, "{label}: positions");
    for (i, what) in [(0, "delta_logprob"), (1, "kl")] {
        let heads = cells(&r["heads"], "layer", Some("head"), what);
        assert_cells(
            &format!("{label} heads {what}"),
            heads,
            grid(&a["heads"], |c| f(&c[i])),
            NATS,
        );
        let mlp = cells(&r["mlp"], "layer", None, what);
        assert_cells(
            &format!("{label} mlp {what}"),
            mlp,
            list(&a["mlp"], |c| f(&c[i])),
            MLP_NATS,
        );
    }
}

/// `2,5,6,7,17` as `2,5-7,17`.
fn compress(ps: &[usize]) -> String {
    let mut parts: Vec<(usize, usize)> = Vec::new();
    for &p in ps {
        match parts.last_mut() {
            Some((_, b)) if *b + 1 == p => *b = p,
            _ => parts.push((p, p)),
        }
    }
    let part = |&(a, b): &(usize, usize)| {
        if a == b {
            a.to_string()
        } else {
            format!("{a}-{b}")
        }
    };
    parts.iter().map(part).collect::<Vec<_>>().join(",")
}

fn ablation_matches_transformers(model: (&str, &str), settings: &[&str]) {
    let g = reference(model.1);
    for setting in settings {
        check_ablate(model, &g, setting);
    }
}

#[test]
fn ablation_mlp_positions_and_kl_match_transformers_smollm() {
    ablation_matches_transformers(SMOL, &["zero_all", "mean_subset"]);
}

/// Qwen's `zero_all` (~22 s of CPU) is left out for time: its heads' Δ log p is also
/// `tests/interventions.rs`' zero ablation against `qwen_interventions.json`; the golden holds
/// its heads' and MLPs' Δ log p and KL, which agreed to 6.5e-5 (an MLP's, of 14 nats) when it
/// was made. `mean_subset` runs the MLPs, `--positions`, the mean and the KL column on Qwen.
#[test]
fn ablation_mlp_positions_and_kl_match_transformers_qwen() {
    ablation_matches_transformers(QWEN, &["mean_subset"]);
}
