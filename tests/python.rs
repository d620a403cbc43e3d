//! The Python package's tests (bindings/python/tests, pytest) on the real models, run by the
//! README's one test command. They need the package installed in a virtual environment:
//! `python3 -m venv target/pyenv && target/pyenv/bin/pip install ./bindings/python pytest`
//! (`.ci/run` does it; `ATTNSCOPE_PYTHON` names another interpreter). Without it build.rs marks
//! this test ignored with the reason; `ATTNSCOPE_REQUIRE_PYTHON=1` (set by `.ci/run`) never
//! ignores it, so a missing package fails.

use std::path::Path;

#[test]
#[cfg_attr(
    python_missing,
    ignore = "no Python package here: python3 -m venv target/pyenv && target/pyenv/bin/pip install ./bindings/python pytest"
)]
fn python_package_tests_pass() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = std::env::var("ATTNSCOPE_PYTHON")
        .unwrap_or_else(|_| root.join("target/pyenv/bin/python").display().to_string());
    let out = std::process::Command::new(&python)
        .args(["-m", "pytest", "-q", "-rs", "bindings/python/tests"])
        .current_dir(root)
        .env("ATTNSCOPE_BIN", assert_cmd::cargo::cargo_bin("attnscope"))
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
    // every Python test ran: where CI asks for the package (or the browser), a skip is a failure;
    // elsewhere it is said loudly, with pytest's reasons (-rs) above
    let summary = so
        .lines()
        .rev()
        .find(|l| l.contains(" passed"))
        .unwrap_or("");
    assert!(
        !summary.contains("failed") && summary.contains("passed"),
        "{summary}"
    );
    if summary.contains("skipped") {
        let required = ["ATTNSCOPE_REQUIRE_PYTHON", "ATTNSCOPE_REQUIRE_BROWSER"]
            .iter()
            .any(|v| std::env::var(v).is_ok_and(|v| v == "1"));
        assert!(!required, "a Python test was skipped: {summary}");
        eprintln!("NOTE: some Python tests were skipped (reasons above): {summary}");
    }
}
