//! AttnLRP, value zeroing and ALTI-Logit (issue #39) against independent torch references
//! (tests/golden/mixing/*.json, made by tests/golden/make_mixing_golden.py: transformers' eager
//! f32 forward with hooks, and the authors' lxt package for AttnLRP) on the real models and the
//! tiny Hugging Face fixtures of five families; their invariants on the generated tiny models of
//! every family; the command line and bad input.

mod common;

use attnscope::analysis::mixing::{alti_logit, value_zeroing, MAX_MIXING_TOKENS};
use attnscope::model::backward::Metric;
use attnscope::model::config::Arch;
use attnscope::model::lrp::Relevance;
use attnscope::model::tiny::{tiny_model, write_gguf};
use attnscope::model::{Model, Precision};
use candle_core::quantized::GgmlDType;
use serde_json::Value;

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// The cells of a list of rows, keyed `[row, column]` (rows of any lengths).
fn nested<R: AsRef<[f32]>>(rows: &[R]) -> Vec<(Vec<usize>, f64)> {
    rows.iter()
        .enumerate()
        .flat_map(|(i, r)| {
            r.as_ref()
                .iter()
                .enumerate()
                .map(move |(j, &x)| (vec![i, j], x as f64))
        })
        .collect()
}

/// A scalar against a reference, within `bound` of max(|reference|, 1).
fn assert_scalar(label: &str, got: f64, want: f64, bound: f64) {
    let scale = want.abs().max(1.0);
    common::assert_cells(
        label,
        [((), got / scale)],
        [((), want / scale)],
        common::Bound::Abs(bound),
    );
}

/// The bound on every number of the three methods against the references (docs/commands/
/// attribute.md: the worst measured, value zeroing's rows on Qwen2.5, 4.0e-6).
const MIXING: f64 = 2e-5;

/// Every number of the three methods against the reference `g` for `model` on `ids`: each within
/// [`MIXING`] (the relevances and ALTI-Logit's scores and layers of the largest value; the logit
/// and the conservation error of max(|logit|, 1)), as docs/commands/attribute.md says.
fn against_reference(model: &Model, g: &Value, label: &str) {
    use common::{assert_cells, json_cells, Bound};
    let ids: Vec<u32> = floats(&g["token_ids"]).iter().map(|&v| v as u32).collect();
    let target = g["target_id"].as_u64().unwrap() as u32;
    let metric = Metric::LogProb(Some(target));
    // AttnLRP against lxt
    if !g["attnlrp"].is_null() {
        let r = model.attnlrp(&ids, metric).unwrap();
        let want = floats(&g["attnlrp"]);
        common::assert_json(
            &format!("{label}: AttnLRP [token] vs lxt"),
            &r.scores,
            &g["attnlrp"],
            Bound::RelMax(MIXING),
        );
        let logit = g["attnlrp_logit"].as_f64().unwrap();
        assert_scalar(
            &format!("{label}: AttnLRP's logit vs lxt's"),
            r.value as f64,
            logit,
            MIXING,
        );
        let sum: f64 = want.iter().map(|&x| x as f64).sum();
        // relative to the logit, not to the error: the error is a difference of the two
        let scale = logit.abs().max(1.0);
        assert_cells(
            &format!("{label}: AttnLRP's conservation error / max(|logit|, 1) vs lxt's"),
            [((), r.conservation_error as f64 / scale)],
            [((), (sum - logit) / scale)],
            Bound::Abs(MIXING),
        );
    }
    // value zeroing: every layer's last row, and the rollout's
    let v = value_zeroing(model, &ids, &mut |_, _| {}).unwrap();
    let n = ids.len();
    let last_rows: Vec<&[f32]> = v.layers.iter().map(|c| &c[(n - 1) * n..]).collect();
    assert_cells(
        &format!("{label}: value zeroing's last rows [layer, key]"),
        nested(&last_rows),
        json_cells(&g["value_zeroing_last_rows"]),
        Bound::Abs(MIXING),
    );
    common::assert_json(
        &format!("{label}: value zeroing's rollout [key]"),
        &v.rollout_last,
        &g["value_zeroing_rollout_last"],
        Bound::Abs(MIXING),
    );
    // ALTI-Logit: ALTI's last rows, each layer's carried-back updates, the scores
    let a = alti_logit(model, &ids, metric).unwrap();
    assert_cells(
        &format!("{label}: ALTI's last rows [layer, key]"),
        nested(&a.alti_last),
        json_cells(&g["alti_last_rows"]),
        Bound::Abs(MIXING),
    );
    assert_cells(
        &format!("{label}: ALTI-Logit per layer [layer, token]"),
        nested(&a.layers),
        json_cells(&g["alti_logit_layers"]),
        Bound::RelMax(MIXING),
    );
    common::assert_json(
        &format!("{label}: ALTI-Logit [token]"),
        &a.scores,
        &g["alti_logit"],
        Bound::RelMax(MIXING),
    );
    assert!(a.rebuild_error < 1e-5, "{label}: {}", a.rebuild_error);
}

#[test]
fn tiny_families_against_torch_and_lxt() {
    for fam in ["llama3", "qwen3", "mistral", "gemma2", "gemma3"] {
        let dir = common::golden(&format!("arch/{fam}"));
        let model = Model::load(dir.to_str().unwrap(), Precision::Exact, false).unwrap();
        let g = common::golden_json(&format!("mixing/{fam}.json"));
        against_reference(&model, &g, fam);
    }
}

#[test]
fn smol_against_torch_and_lxt() {
    let g = common::golden_json("mixing/smol.json");
    against_reference(common::real_model("smollm2-135m"), &g, "smollm2-135m");
}

#[test]
fn qwen_against_torch_and_lxt() {
    let g = common::golden_json("mixing/qwen.json");
    against_reference(
        common::real_model("qwen2.5-coder-0.5b"),
        &g,
        "qwen2.5-coder-0.5b",
    );
}

const TOKENS: [u32; 9] = [72, 101, 108, 108, 111, 32, 256, 258, 259];

fn tiny(arch: Arch, dir: &tempfile::TempDir) -> (String, Model) {
    let path = dir.path().join(format!("{arch:?}.gguf"));
    write_gguf(&tiny_model(arch, 5), arch, GgmlDType::F32, &path).unwrap();
    let s = path.to_str().unwrap().to_string();
    let model = Model::load(&s, Precision::Exact, false).unwrap();
    (s, model)
}

/// The generated tiny models (Qwen2, Llama) and the Hugging Face fixtures of the other families.
fn every_family(dir: &tempfile::TempDir) -> Vec<(String, Model)> {
    let mut out: Vec<(String, Model)> = [Arch::Qwen2, Arch::Llama]
        .into_iter()
        .map(|a| (format!("{a:?}"), tiny(a, dir).1))
        .collect();
    for fam in ["qwen3", "mistral", "phi3", "gemma2", "gemma3", "gpt2"] {
        let path = common::golden(&format!("arch/{fam}"));
        let model = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
        out.push((fam.to_string(), model));
    }
    out
}

/// On every family: value zeroing's rows are distributions over the keys a query sees (token 0
/// only itself), so is the rollout; ALTI's decomposition rebuilds each layer's residual after
/// attention, its rows are distributions, its layers add up to its scores; AttnLRP is linear in
/// the explained logits (a difference's relevance is the difference of relevances) and reports
/// its conservation error as `Σ scores − f`.
#[test]
fn invariants_on_every_family() {
    let dir = tempfile::tempdir().unwrap();
    for (label, model) in every_family(&dir) {
        let ids: Vec<u32> = TOKENS
            .iter()
            .map(|&t| t % model.dims.vocab_size as u32)
            .collect();
        check_value_zeroing_rows_are_distributions(&model, &ids, &label);
        check_alti_rebuilds_and_adds_up(&model, &ids, &label);
        let lrp = check_attnlrp_conserves(&model, &ids);
        let (logit_diff, diff) = check_attnlrp_is_linear_in_the_logits(&model, &ids, &lrp, &label);
        check_attnlrp_is_not_gradient_x_input(&model, &ids, logit_diff, &diff, &label);
    }
}

/// Value zeroing's rows (every layer's) and its rollout are distributions over the keys a query
/// sees, token 0 only itself.
fn check_value_zeroing_rows_are_distributions(model: &Model, ids: &[u32], label: &str) {
    let n = ids.len();
    let v = value_zeroing(model, ids, &mut |_, _| {}).unwrap();
    assert_eq!(v.layers.len(), model.dims.n_layers);
    for c in &v.layers {
        for i in 0..n {
            let row = &c[i * n..(i + 1) * n];
            let s: f32 = row.iter().sum();
            assert!((s - 1.0).abs() < 1e-5, "{label}: row {i} sums to {s}");
            assert!(row[i + 1..].iter().all(|&x| x == 0.0), "{label}: causal");
            assert!(row.iter().all(|&x| x >= 0.0), "{label}: a distance < 0");
        }
        assert!(
            (c[0] - 1.0).abs() < 1e-6,
            "{label}: token 0 sees itself only"
        );
    }
    let s: f32 = v.rollout_last.iter().sum();
    assert!((s - 1.0).abs() < 1e-4, "{label}: rollout sums to {s}");
}

/// ALTI's decomposition rebuilds each layer's residual after attention, its rows are
/// distributions, its layers add up to its scores.
fn check_alti_rebuilds_and_adds_up(model: &Model, ids: &[u32], label: &str) {
    let a = alti_logit(model, ids, Metric::LogProb(None)).unwrap();
    assert!(a.rebuild_error < 1e-5, "{label}: {}", a.rebuild_error);
    for row in &a.alti_last {
        let s: f32 = row.iter().sum();
        assert!((s - 1.0).abs() < 1e-5, "{label}: ALTI row sums to {s}");
    }
    for (j, &sc) in a.scores.iter().enumerate() {
        let by_layer: f32 = a.layers.iter().map(|l| l[j]).sum();
        assert!((by_layer - sc).abs() < 1e-4 * sc.abs().max(1.0), "{label}");
    }
}

/// AttnLRP of the top token's logit: its value is that logit, its conservation error is
/// `Σ scores − f`; returned for the next steps.
fn check_attnlrp_conserves(model: &Model, ids: &[u32]) -> Relevance {
    let logits = model.next_token_logits(ids).unwrap();
    let lrp = model.attnlrp(ids, Metric::LogProb(None)).unwrap();
    assert!((lrp.value - logits[lrp.target as usize]).abs() < 1e-4 * lrp.value.abs().max(1.0));
    let sum: f32 = lrp.scores.iter().sum();
    assert!((lrp.conservation_error - (sum - lrp.value)).abs() < 1e-4 * sum.abs().max(1.0));
    lrp
}

/// AttnLRP of the logit difference between `lrp`'s target and the next token id is the
/// difference of the two logits' relevances, position by position; returns that metric and its
/// relevances.
fn check_attnlrp_is_linear_in_the_logits(
    model: &Model,
    ids: &[u32],
    lrp: &Relevance,
    label: &str,
) -> (Metric, Relevance) {
    let other = (lrp.target + 1) % model.dims.vocab_size as u32;
    let b = model.attnlrp(ids, Metric::LogProb(Some(other))).unwrap();
    let logit_diff = Metric::LogitDiff {
        answer: lrp.target,
        wrong: other,
    };
    let diff = model.attnlrp(ids, logit_diff).unwrap();
    assert!((diff.value - (lrp.value - b.value)).abs() < 1e-4 * lrp.value.abs().max(1.0));
    let top = lrp.scores.iter().fold(0f32, |m, v| m.max(v.abs()));
    for j in 0..ids.len() {
        let want = lrp.scores[j] - b.scores[j];
        assert!(
            (diff.scores[j] - want).abs() < 1e-4 * top.max(1e-3),
            "{label}: position {j}: {} vs {want}",
            diff.scores[j]
        );
    }
    (logit_diff, diff)
}

/// The rules change the backward: AttnLRP of a logit difference (`diff`) is not gradient × input
/// of it.
fn check_attnlrp_is_not_gradient_x_input(
    model: &Model,
    ids: &[u32],
    logit_diff: Metric,
    diff: &Relevance,
    label: &str,
) {
    let g = model.gradient(ids, logit_diff).unwrap();
    let gxi: Vec<f32> = g
        .grad_input
        .chunks(model.dims.d_model)
        .zip(g.input.chunks(model.dims.d_model))
        .map(|(a, b)| a.iter().zip(b).map(|(x, y)| x * y).sum())
        .collect();
    assert!(
        common::max_abs_diff(&gxi, &diff.scores, label) > 1e-6,
        "{label}: AttnLRP equals gradient × input"
    );
}

fn attnscope(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_attnscope"))
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .unwrap()
}

fn json(args: &[&str]) -> Value {
    let out = attnscope(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The command line: each method's JSON has the library's numbers and its extras, the terminal
/// shows the conservation error; `faithfulness` ranks by all three.
#[test]
fn command_line() {
    let dir = tempfile::tempdir().unwrap();
    let (m, model) = tiny(Arch::Qwen2, &dir);
    let ids = model.encode(CLI_TEXT, false).unwrap();
    let cli = Cli { m, model, ids };
    check_attnlrp_json(&cli);
    check_value_zeroing_json(&cli);
    check_alti_logit_json(&cli);
    check_alti_logit_of_a_logit_difference(&cli);
    check_terminal_shows_the_conservation_error(&cli);
    check_faithfulness_ranks_by_all_three(&cli);
}

const CLI_TEXT: &str = "the hat at the cat";

/// The tiny model the command line runs (`m`, its file) and [`CLI_TEXT`]'s tokens.
struct Cli {
    m: String,
    model: Model,
    ids: Vec<u32>,
}

impl Cli {
    /// `attribute -m M --text CLI_TEXT EXTRA --json`, parsed.
    fn attribute(&self, extra: &[&str]) -> Value {
        let head = ["attribute", "-m", &self.m, "--text", CLI_TEXT];
        let args: [&[&str]; 3] = [&head, extra, &["--json"]];
        json(&args.concat())
    }

    fn method(&self, method: &str) -> Value {
        self.attribute(&["--method", method])
    }
}

/// The `score` of each of a command's `tokens[]`.
fn scores(v: &Value) -> Vec<f32> {
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["score"].as_f64().unwrap() as f32)
        .collect()
}

fn check_attnlrp_json(cli: &Cli) {
    let lrp = cli.method("attnlrp");
    assert_eq!(lrp["method"], "attnlrp");
    assert_eq!(lrp["metric"], "logit");
    let want = cli.model.attnlrp(&cli.ids, Metric::LogProb(None)).unwrap();
    assert_eq!(scores(&lrp), want.scores);
    assert!(
        (lrp["conservation_error"].as_f64().unwrap() as f32 - want.conservation_error).abs() < 1e-6
    );
}

fn check_value_zeroing_json(cli: &Cli) {
    let n = cli.ids.len();
    let vz = cli.method("value-zeroing");
    assert_eq!(vz["metric"], "none");
    let want = value_zeroing(&cli.model, &cli.ids, &mut |_, _| {}).unwrap();
    assert_eq!(scores(&vz), want.rollout_last);
    assert_eq!(
        vz["layers"].as_array().unwrap().len(),
        cli.model.dims.n_layers
    );
    assert_eq!(
        floats(&vz["layers"][0]),
        want.layers[0][(n - 1) * n..].to_vec()
    );
}

fn check_alti_logit_json(cli: &Cli) {
    let al = cli.method("alti-logit");
    assert_eq!(al["metric"], "logit");
    let want = alti_logit(&cli.model, &cli.ids, Metric::LogProb(None)).unwrap();
    assert_eq!(scores(&al), want.scores);
    assert_eq!(
        al["layers"].as_array().unwrap().len(),
        cli.model.dims.n_layers
    );
}

fn check_alti_logit_of_a_logit_difference(cli: &Cli) {
    let d = cli.attribute(&["--method", "alti-logit", "--target", "5", "--wrong", "7"]);
    assert_eq!(d["metric"], "logit_diff");
    let want = alti_logit(
        &cli.model,
        &cli.ids,
        Metric::LogitDiff {
            answer: 5,
            wrong: 7,
        },
    )
    .unwrap();
    assert_eq!(scores(&d), want.scores);
}

fn check_terminal_shows_the_conservation_error(cli: &Cli) {
    let out = attnscope(&[
        "attribute",
        "-m",
        &cli.m,
        "--text",
        CLI_TEXT,
        "--method",
        "attnlrp",
    ]);
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.contains("conservation error") && s.contains("f = logit("),
        "{s}"
    );
}

/// `faithfulness` scores every token by the three methods and ranks by each (JSON and
/// terminal), and leaves them out with `--gradients none`.
fn check_faithfulness_ranks_by_all_three(cli: &Cli) {
    let faithfulness: [&str; 7] = [
        "faithfulness",
        "-m",
        &cli.m,
        "--text",
        CLI_TEXT,
        "--gradients",
        "fast",
    ];
    let f = json(&[&faithfulness[..], &["--json"]].concat());
    for key in ["attnlrp", "value_zeroing", "alti_logit"] {
        assert!(
            f["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .all(|t| t[key].as_f64().is_some()),
            "tokens[] lack {key}"
        );
        let rows = f["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|x| x["ranking"] == key)
            .count();
        assert_eq!(rows, 6, "{key}: 3 truths × with/without the first token");
    }
    assert!(f["attnlrp_conservation_error"].as_f64().is_some());
    let t = attnscope(&faithfulness);
    let s = String::from_utf8_lossy(&t.stdout);
    assert!(
        s.contains("AttnLRP") && s.contains("ALTI-logit") && s.contains("VZ"),
        "{s}"
    );
    let none = json(&[
        "faithfulness",
        "-m",
        &cli.m,
        "--text",
        CLI_TEXT,
        "--gradients",
        "none",
        "--json",
    ]);
    assert!(none["tokens"][0].get("attnlrp").is_none());
}

/// Bad input: a clear error (exit 2 from the command), never a panic.
#[test]
fn bad_input_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (m, model) = tiny(Arch::Llama, &dir);
    for method in ["attnlrp", "value-zeroing", "alti-logit"] {
        for (extra, needle) in [
            (&["--text", ""][..], "empty"),
            (&["--text", "a b", "--target", "99999999"][..], "--target"),
            (
                &["--text", "a b", "--target", "5", "--wrong", "5"][..],
                "--wrong",
            ),
        ] {
            let mut a = vec!["attribute", "-m", &m, "--method", method];
            a.extend_from_slice(extra);
            let out = attnscope(&a);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{method} {extra:?}: {err}");
            assert!(err.contains(needle), "{method} {extra:?}: {err}");
            assert!(!err.contains("panicked"), "{err}");
        }
    }
    // the library: an empty text, a text past the length these methods take, a bad token id
    assert!(value_zeroing(&model, &[], &mut |_, _| {}).is_err());
    assert!(alti_logit(&model, &[], Metric::LogProb(None)).is_err());
    assert!(model.attnlrp(&[], Metric::LogProb(None)).is_err());
    let long = vec![1u32; MAX_MIXING_TOKENS + 1];
    let e = value_zeroing(&model, &long, &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("value zeroing"), "{e}");
    let e = alti_logit(&model, &long, Metric::LogProb(None)).unwrap_err();
    assert!(e.to_string().contains("ALTI-Logit"), "{e}");
    let bad = model.dims.vocab_size as u32;
    assert!(model.attnlrp(&[1, bad], Metric::LogProb(None)).is_err());
    assert!(alti_logit(&model, &[1, 2], Metric::LogProb(Some(bad))).is_err());
    assert!(value_zeroing(&model, &[1, bad], &mut |_, _| {}).is_err());
}
