//! Marks the browser test `#[ignore]` (cfg `browser_missing`) when what it needs is not here,
//! by the one lookup `tests/browser/find-browser.sh` shares with `.ci/run` and the test, so a
//! skipped browser test shows as "ignored" with its reason, never as a pass.
//! `ATTNSCOPE_REQUIRE_BROWSER=1` (set by `.ci/run`) never ignores it: a missing browser fails.

fn main() {
    python();
    transformer_lens();
    println!("cargo::rustc-check-cfg=cfg(browser_missing)");
    println!("cargo::rerun-if-changed=tests/browser/find-browser.sh");
    println!("cargo::rerun-if-changed=tests/browser/package-lock.json");
    println!("cargo::rerun-if-env-changed=CHROMIUM");
    println!("cargo::rerun-if-env-changed=ATTNSCOPE_REQUIRE_BROWSER");
    let found = std::process::Command::new("sh")
        .arg("tests/browser/find-browser.sh")
        .stderr(std::process::Stdio::piped())
        .output();
    let (ok, why) = match found {
        Ok(o) => (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).trim().to_string(),
        ),
        Err(e) => (false, format!("cannot run sh: {e}")),
    };
    let required = std::env::var("ATTNSCOPE_REQUIRE_BROWSER").is_ok_and(|v| v == "1");
    if !ok && !required {
        println!("cargo::rustc-cfg=browser_missing");
        println!("cargo::warning=the browser test will be ignored: {why}");
    }
}

/// Marks the Python package's test ignored (cfg `python_missing`) when no interpreter with the
/// package is here: `target/pyenv/bin/python` or `$ATTNSCOPE_PYTHON`. `ATTNSCOPE_REQUIRE_PYTHON=1`
/// (set by `.ci/run`) never ignores it.
fn python() {
    println!("cargo::rustc-check-cfg=cfg(python_missing)");
    println!("cargo::rerun-if-env-changed=ATTNSCOPE_PYTHON");
    println!("cargo::rerun-if-env-changed=ATTNSCOPE_REQUIRE_PYTHON");
    println!("cargo::rerun-if-changed=bindings/python/pyproject.toml");
    let root = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    let python = std::env::var("ATTNSCOPE_PYTHON")
        .unwrap_or_else(|_| format!("{root}/target/pyenv/bin/python"));
    let probe = std::process::Command::new(&python)
        .args(["-c", "import attnscope, pytest"])
        .output();
    let ok = probe.as_ref().is_ok_and(|o| o.status.success());
    let why = match &probe {
        Ok(o) => String::from_utf8_lossy(&o.stderr)
            .lines()
            .last()
            .unwrap_or("")
            .to_string(),
        Err(e) => e.to_string(),
    };
    let required = std::env::var("ATTNSCOPE_REQUIRE_PYTHON").is_ok_and(|v| v == "1");
    if !ok && !required {
        println!("cargo::rustc-cfg=python_missing");
        println!("cargo::warning=the Python package test will be ignored: {python} cannot import attnscope and pytest ({why}; see tests/python.rs)");
    }
}

/// Marks the comparison with real TransformerLens ignored (cfg `tl_missing`) when no interpreter
/// with TransformerLens, torch and the package is here: `target/tlenv/bin/python` (made by
/// `bindings/python/tests/tl_env.sh`) or `$ATTNSCOPE_TL_PYTHON`; the modules are looked up, not
/// imported (torch takes seconds). `ATTNSCOPE_REQUIRE_TL=1` (set by `.ci/run`) never ignores it.
fn transformer_lens() {
    println!("cargo::rustc-check-cfg=cfg(tl_missing)");
    println!("cargo::rerun-if-env-changed=ATTNSCOPE_TL_PYTHON");
    println!("cargo::rerun-if-env-changed=ATTNSCOPE_REQUIRE_TL");
    let root = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    let python = std::env::var("ATTNSCOPE_TL_PYTHON")
        .unwrap_or_else(|_| format!("{root}/target/tlenv/bin/python"));
    let probe = std::process::Command::new(&python)
        .args([
            "-c",
            "import importlib.util as u, sys; missing = [m for m in ('attnscope', 'pytest', 'torch', \
             'transformer_lens') if u.find_spec(m) is None]; sys.exit(f'missing: {missing}' if missing else 0)",
        ])
        .output();
    let ok = probe.as_ref().is_ok_and(|o| o.status.success());
    let why = match &probe {
        Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_string(),
        Err(e) => e.to_string(),
    };
    let required = std::env::var("ATTNSCOPE_REQUIRE_TL").is_ok_and(|v| v == "1");
    if !ok && !required {
        println!("cargo::rustc-cfg=tl_missing");
        println!("cargo::warning=the comparison with real TransformerLens will be ignored: {python} ({why}; see tests/python.rs)");
    }
}
