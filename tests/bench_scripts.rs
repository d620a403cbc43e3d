//! The Python bench scripts (`benches/*.py`) in their smoke mode (`--smoke`: one short run on tiny
//! inputs), each checked to print its table: the header, and a row of numbers for attnscope's
//! side. They compare attnscope with transformers, sentence-transformers, inseq and Captum; CI's
//! Python (`target/pyenv`, or `$ATTNSCOPE_PYTHON`) has none of them, so there each script says
//! so ("NOT RUN: ...", checked here) and runs attnscope's side alone, which still catches a
//! script that no longer fits the CLI. `ATTNSCOPE_BENCH_PYTHON=~/.hfenv/bin/python` (with inseq and
//! Captum on its path, as the scripts' headers say) runs both sides and checks both rows.

use std::path::Path;

/// The interpreter, and whether it is the reference one (both sides must then run).
fn python() -> (String, bool) {
    if let Ok(p) = std::env::var("ATTNSCOPE_BENCH_PYTHON") {
        return (p, true);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let p = std::env::var("ATTNSCOPE_PYTHON")
        .unwrap_or_else(|_| root.join("target/pyenv/bin/python").display().to_string());
    (p, false)
}

/// The rows of the Markdown table the script printed last (`| side | ... |`), as cells.
fn table_rows(stdout: &str) -> Vec<Vec<String>> {
    let lines: Vec<&str> = stdout.lines().collect();
    let header = lines
        .iter()
        .rposition(|l| l.starts_with("| side |"))
        .unwrap_or_else(|| panic!("no table (a `| side |` header) in:\n{stdout}"));
    assert!(
        lines
            .get(header + 1)
            .is_some_and(|l| l.starts_with("|---|")),
        "{stdout}"
    );
    lines[header + 2..]
        .iter()
        .take_while(|l| l.starts_with("| "))
        .map(|l| {
            l.trim_matches('|')
                .split(" | ")
                .map(|c| c.trim().to_string())
                .collect()
        })
        .collect()
}

/// Runs `benches/{script} --smoke`; checks its table has a row of numbers for attnscope and, with
/// the reference interpreter, for `theirs` (else the script's "NOT RUN" note).
fn smoke(script: &str, theirs: &str) {
    let (python, reference) = python();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new(&python)
        .arg(root.join("benches").join(script))
        .args(["--smoke", "--bin", env!("CARGO_BIN_EXE_attnscope")])
        .current_dir(root)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{script} failed:\n{so}\n{se}");
    let rows = table_rows(&so);
    let numbers = |row: &Vec<String>| row[1..].iter().any(|c| c.parse::<f64>().is_ok());
    let has = |side: &str| rows.iter().any(|r| r[0].starts_with(side) && numbers(r));
    assert!(has("attnscope"), "no attnscope row of numbers:\n{so}");
    if reference {
        assert!(has(theirs), "no {theirs} row of numbers:\n{so}\n{se}");
    } else {
        assert!(se.contains("NOT RUN: "), "{se}");
        eprintln!("NOTE: {script}: attnscope's side only ({python} has no {theirs})");
    }
    eprintln!("{script} --smoke:\n{so}");
}

#[test]
#[cfg_attr(
    python_missing,
    ignore = "no Python here: python3 -m venv target/pyenv (tests/python.rs says how)"
)]
fn corpus_vs_hf() {
    smoke("corpus_vs_hf.py", "transformers");
}

#[test]
#[cfg_attr(
    python_missing,
    ignore = "no Python here: python3 -m venv target/pyenv (tests/python.rs says how)"
)]
fn embed_vs_st() {
    smoke("embed_vs_st.py", "sentence-transformers");
}

#[test]
#[cfg_attr(
    python_missing,
    ignore = "no Python here: python3 -m venv target/pyenv (tests/python.rs says how)"
)]
fn generate_vs_hf() {
    smoke("generate_vs_hf.py", "transformers");
}

#[test]
#[cfg_attr(
    python_missing,
    ignore = "no Python here: python3 -m venv target/pyenv (tests/python.rs says how)"
)]
fn gen_attribute_vs_inseq() {
    smoke("gen_attribute_vs_inseq.py", "inseq");
}

#[test]
#[cfg_attr(
    python_missing,
    ignore = "no Python here: python3 -m venv target/pyenv (tests/python.rs says how)"
)]
fn ig_vs_captum() {
    smoke("ig_vs_captum.py", "Captum");
}
