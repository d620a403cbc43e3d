//! The Python package's tests (bindings/python/tests, pytest) on the real models, run by the
//! README's one test command. They need the package installed in a virtual environment:
//! `python3 -m venv target/pyenv && target/pyenv/bin/pip install ./bindings/python pytest`
//! (`.ci/run` does it; `ATTNSCOPE_PYTHON` names another interpreter). Without it build.rs marks
//! this test ignored with the reason; `ATTNSCOPE_REQUIRE_PYTHON=1` (set by `.ci/run`) never
//! ignores it, so a missing package fails.
//!
//! The comparison with real TransformerLens (bindings/python/tests/test_tl_real.py) runs in a
//! second environment with torch and TransformerLens 4.3, `target/tlenv`, which
//! `bindings/python/tests/tl_env.sh` makes (`.ci/run` runs it; `ATTNSCOPE_TL_PYTHON` names another
//! interpreter); ignored without it, never where `ATTNSCOPE_REQUIRE_TL=1` (`.ci/run`).

use std::path::Path;

/// Runs pytest with `args` under `python` from the repository root; fails unless it passed.
/// Returns its output and its closing line.
/// The two pytest runs one after the other, never side by side: the TransformerLens comparison
/// peaks near 10 GB and the package's tests near 5 GB, on CI's 24 GiB.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn pytest(python: &str, args: &[&str], env: &[(&str, &str)]) -> (String, String) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new(python)
        .args(["-m", "pytest"])
        .args(args)
        .current_dir(root)
        .env("ATTNSCOPE_BIN", assert_cmd::cargo::cargo_bin("attnscope"))
        .envs(env.iter().copied())
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run {python}: {e}; install the package as this file's header says")
        });
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    eprintln!("{so}{se}");
    assert!(out.status.success(), "the Python tests failed:\n{so}\n{se}");
    let summary = so
        .lines()
        .rev()
        .find(|l| l.contains(" passed"))
        .unwrap_or("")
        .to_string();
    assert!(
        !summary.contains("failed") && summary.contains("passed"),
        "{summary}"
    );
    (so.into_owned(), summary)
}

fn interpreter(var: &str, default: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::env::var(var).unwrap_or_else(|_| root.join(default).display().to_string())
}

#[test]
#[cfg_attr(
    python_missing,
    ignore = "no Python package here: python3 -m venv target/pyenv && target/pyenv/bin/pip install ./bindings/python pytest"
)]
fn python_package_tests_pass() {
    let python = interpreter("ATTNSCOPE_PYTHON", "target/pyenv/bin/python");
    let (_, summary) = pytest(&python, &["-q", "-rs", "bindings/python/tests"], &[]);
    // every Python test ran: where CI asks for the package (or the browser), a skip is a failure;
    // elsewhere it is said loudly, with pytest's reasons (-rs) above
    if summary.contains("skipped") {
        let required = ["ATTNSCOPE_REQUIRE_PYTHON", "ATTNSCOPE_REQUIRE_BROWSER"]
            .iter()
            .any(|v| std::env::var(v).is_ok_and(|v| v == "1"));
        assert!(!required, "a Python test was skipped: {summary}");
        eprintln!("NOTE: some Python tests were skipped (reasons above): {summary}");
    }
}

/// test_tl_real.py in target/tlenv: both models (SmolLM2, the default Qwen2.5), with and without
/// TL's processing, one (model, mode) at a time (the default model's peaks at 10.5 GB, beside
/// python_package_tests_pass); nothing may be skipped (`ATTNSCOPE_REQUIRE_TL=1` turns a
/// missing TransformerLens into a failure there). Each check prints its worst difference.
#[test]
#[cfg_attr(
    tl_missing,
    ignore = "no TransformerLens here: bash bindings/python/tests/tl_env.sh (makes target/tlenv)"
)]
fn transformer_lens_comparison_passes() {
    let python = interpreter("ATTNSCOPE_TL_PYTHON", "target/tlenv/bin/python");
    let models = ["smollm2-135m", "qwen2.5-coder-0.5b"];
    let (out, summary) = pytest(
        &python,
        &[
            "-q",
            "-rs",
            "bindings/python/tests/test_tl_real.py",
            "bindings/python/tests/test_tl_patching.py",
            "bindings/python/tests/test_patching_torch.py",
        ],
        &[
            ("ATTNSCOPE_REQUIRE_TL", "1"),
            ("ATTNSCOPE_TL_MODELS", &models.join(",")),
        ],
    );
    for bad in ["skipped", "deselected", "xfail", "error"] {
        assert!(!summary.contains(bad), "{summary}");
    }
    for m in models {
        for mode in ["no_processing", "processed"] {
            // each run's test_prompt check prints it: both models ran, both ways
            let line = format!("{m} {mode}: test_prompt's ranks equal TL's");
            assert!(out.contains(&line), "no '{line}' in the output: {summary}");
        }
    }
}
