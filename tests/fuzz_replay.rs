//! Every saved fuzz input, replayed by an ordinary `cargo test` (stable toolchain): the crafted
//! files in tests/fuzz_corpus/ (one per bad-input bug found so far), the generated seeds, and
//! fuzz/corpus/ when a local fuzzing run left one. Each input may give an error, never a panic.
// index loops over (layer, head, query) read like the maths; nested test types stay inline
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

use std::path::Path;

fn target(name: &str) -> fn(&[u8]) {
    match name {
        "gguf" => attnscope::fuzzing::gguf,
        "safetensors" => attnscope::fuzzing::safetensors,
        "tokenizer" => attnscope::fuzzing::tokenizer,
        other => panic!("no fuzz target {other}"),
    }
}

fn replay(target_name: &str, name: &str, bytes: &[u8]) {
    replay_with(target(target_name), target_name, name, bytes)
}

fn replay_with(f: fn(&[u8]), target_name: &str, name: &str, bytes: &[u8]) {
    if std::panic::catch_unwind(|| f(bytes)).is_err() {
        panic!(
            "fuzz target {target_name} panicked on {name} ({} bytes)",
            bytes.len()
        );
    }
}

#[test]
fn every_saved_fuzz_input_runs_without_a_panic() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut counts = std::collections::BTreeMap::<&str, usize>::new();
    for t in ["gguf", "safetensors", "tokenizer"] {
        for dir in [
            root.join("tests/fuzz_corpus").join(t),
            root.join("fuzz/corpus").join(t),
        ] {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for e in entries.flatten() {
                replay(
                    t,
                    &e.path().display().to_string(),
                    &std::fs::read(e.path()).unwrap(),
                );
                *counts.entry(t).or_default() += 1;
            }
        }
    }
    for (t, name, bytes) in attnscope::fuzzing::seeds() {
        replay(t, &name, &bytes);
        *counts.entry(t).or_default() += 1;
    }
    eprintln!("replayed {counts:?}");
    // the committed crafted files are there (a moved folder must not make this test pass empty)
    assert!(
        counts["gguf"] >= 6 + 6 && counts["safetensors"] >= 2 + 3 && counts["tokenizer"] > 5,
        "{counts:?}"
    );
}

/// The replay can fail: a target that panics on an input is reported.
#[test]
#[should_panic(expected = "panicked on crafted")]
fn a_panicking_input_fails_the_replay() {
    fn boom(data: &[u8]) {
        if data.len() > 1 {
            panic!("boom")
        }
    }
    replay_with(boom, "test", "crafted-short", b"x");
    replay_with(boom, "test", "crafted", b"xy");
}
