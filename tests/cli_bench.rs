//! `bench` on tiny generated models: its rates, the fast/exact alternation, transformers run between its commands.
// index loops over (layer, head, query) read like the maths; nested test types stay inline
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

mod common;

use common::{attnscope, run_err, run_json, run_ok, stderr_of, succeeds, tiny_gguf};

/// `bench` on a tiny model: every part is measured and reported as positive rates and times,
/// the child processes (`capture`, `inspect`) run and report their own peak memory.
#[test]
fn bench_reports_rates_forwards_and_commands() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let v = run_json([
        "bench",
        "-m",
        m.to_str().unwrap(),
        "--lengths",
        "8,16",
        "--repeats",
        "1",
        "--json",
    ]);
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
    run_err(["bench", "-m", m.to_str().unwrap(), "--lengths", "0"], 2);
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
        let out = run_ok(args);
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
    let plain = succeeds(
        attnscope()
            .args([
                "bench",
                "-m",
                m.to_str().unwrap(),
                "--no-commands",
                "--lengths",
                "8",
            ])
            .args(["--repeats", "1", "--json"]),
    );
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
    let bad = run_err(["bench", "-m", m.to_str().unwrap(), "--against-exact"], 2);
    assert!(bad.contains("add --precision fast"), "{}", bad);
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
    let fake = fake_python(dir.path(), &log);
    let out = succeeds(
        attnscope()
            .args(["bench", "-m", m.to_str().unwrap(), "--lengths", "8,16"])
            .args(["--repeats", "2", "--json", "--transformers"])
            .arg(&fake),
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let side = v["transformers"].as_array().unwrap();
    assert_eq!(side.len(), 4, "capture and inspect at both lengths");
    let calls = std::fs::read_to_string(&log).unwrap();
    let calls: Vec<&str> = calls.lines().collect();
    assert_eq!(calls.len(), 4, "{calls:?}");
    for (r, call) in side.iter().zip(&calls) {
        assert_row_times_both_routes(r, call, m.to_str().unwrap());
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

/// A stand-in for Python that appends its arguments to `log` and prints what hf_anchor.py
/// prints (eager forwards of 7.5 s, sdpa of 4.5 s), after checking it was given the anchor
/// script and a text file.
fn fake_python(dir: &std::path::Path, log: &std::path::Path) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let fake = dir.join("python");
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
    fake
}

fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// One row of `bench --transformers`: the anchor ran the command's comparable route (`call`, on
/// the bench's text and the `model` file) and the ratios are its forward over each of the
/// command's times, their median's, and those after the load.
fn assert_row_times_both_routes(r: &serde_json::Value, call: &str, model: &str) {
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
    assert!(call.contains(model), "the model's file: {call}");
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
