//! The layering rule of `src/commands/mod.rs`:
//! - `render/` formats reports and arrays and runs no model. No file under `src/render/` may name
//!   the `Model` type (nothing that runs the model can be called without one), call a forward or
//!   a backward, load a model, call an analysis that runs one, or import `commands/` (which calls
//!   `render/`).
//! - `cli/` parses and prints: no file under `src/cli/` may load a model (`Model::load*`), call a
//!   forward or a backward, or call an analysis that runs the model; it calls `commands/`, which
//!   do (the benchmarks excepted: [`CLI_ALLOWED`] says why).
//!
//! Checked on the code with comments and string literals blanked out; a break is named by its
//! file, line and what it calls.

use std::path::{Path, PathBuf};

/// What `render/` may not contain, and why: words (matched whole, not inside a longer name)
/// and calls (a name directly followed by `(`).
const FORBIDDEN_WORDS: [(&str, &str); 3] = [
    ("Model", "the model type: render/ takes reports and arrays"),
    (
        "commands",
        "render/ never imports commands/: they call render/",
    ),
    ("branch_run", "the circuit's branch runs"),
];

/// Calls that run a model: the forward and backward entry points, and the analyses that run one
/// or read its weights (`crate::analysis`'s features; `commands/` calls them). `Model::load` is
/// caught by the word `Model`.
const FORBIDDEN_CALLS: [&str; 30] = [
    "forward",
    "forward_from",
    "forward_batch",
    "forward_segments",
    "forward_many",
    "forward_encoder",
    "gradient",
    "gradient_batch",
    "integrated_gradients",
    "attnlrp",
    "hook_gradients",
    "activation_gradients",
    "encoder_states",
    "embed_tokens",
    "generate",
    "run_faith",
    "faithfulness",
    "ablate",
    "patch",
    "attribute",
    "decoder_scores",
    "ranked_scores",
    "dla",
    "inspect",
    "compare_runs",
    "run_corpus",
    "circuit",
    "all_value_norms",
    "shares_of_patterns",
    "last_query_attention",
];

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// `line` with its `//` comment removed and the insides of its string and char literals
/// blanked (a string may run over several lines: `in_string` carries it).
fn code_of(line: &str, in_string: &mut bool) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if *in_string {
            match c {
                '\\' => {
                    chars.next();
                }
                '"' => {
                    *in_string = false;
                    out.push('"');
                }
                _ => {}
            }
            continue;
        }
        match c {
            '/' if chars.peek() == Some(&'/') => break,
            '"' => {
                *in_string = true;
                out.push('"');
            }
            _ => out.push(c),
        }
    }
    out
}

/// Where `word` occurs in `code` as a whole identifier, followed by `(` when `call`.
fn finds(code: &str, word: &str, call: bool) -> bool {
    code.match_indices(word).any(|(at, _)| {
        let before = code[..at].chars().next_back();
        let after = code[at + word.len()..].chars().next();
        before.is_none_or(|c| !is_ident(c))
            && if call {
                after == Some('(') || code[at + word.len()..].starts_with("::<")
            } else {
                after.is_none_or(|c| !is_ident(c))
            }
    })
}

/// What `cli/` may not call beyond [`FORBIDDEN_CALLS`]: the loaders, and the analyses and model
/// methods that run the model which `render/` never had a reason to name.
const CLI_FORBIDDEN_CALLS: [&str; 12] = [
    "load_memory",
    "load_with",
    "load_full",
    "embed_texts",
    "roles_of",
    "roles_of_typed",
    "sinks",
    "qk",
    "head_views",
    "attribution_patch",
    "attribute_generation",
    "text_records",
];

/// The files under `src/cli/` still allowed to run the model themselves, and why. A shrinking
/// list: a file that no longer breaks the rule must leave it (`cli_runs_no_model` says so).
const CLI_ALLOWED: [(&str, &str); 5] = [
    (
        "src/cli/bench.rs",
        "times the forward, the backward and the capture themselves: the building blocks are what it measures",
    ),
    (
        "src/cli/bench_circuits.rs",
        "times EAP, EAP-IG and the exact edge patching against the forwards they cost",
    ),
    (
        "src/cli/bench_interventions.rs",
        "times ablate and patch against running each intervention from scratch",
    ),
    (
        "src/cli/bench_machine.rs",
        "times a generation's prefill and decode, the machine's own figures",
    ),
    (
        "src/cli/bench_sweeps.rs",
        "times the faithfulness sweep against the forwards it costs",
    ),
];

/// Every break of the `render/` rule in `text` (the file `name`): `name:line: what (why)`.
fn breaks(name: &str, text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_string = false;
    for (i, line) in text.lines().enumerate() {
        let code = code_of(line, &mut in_string);
        for (word, why) in FORBIDDEN_WORDS {
            if finds(&code, word, false) {
                out.push(format!(
                    "{name}:{}: `{word}` ({why}): {}",
                    i + 1,
                    line.trim()
                ));
            }
        }
        for call in FORBIDDEN_CALLS {
            if finds(&code, call, true) {
                out.push(format!(
                    "{name}:{}: `{call}(` (runs the model; commands/ does that): {}",
                    i + 1,
                    line.trim()
                ));
            }
        }
    }
    out
}

/// The `.rs` files under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out
}

/// Every break of the `cli/` rule in `text` (the file `name`): `name:line: what (why)`.
fn cli_breaks(name: &str, text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_string = false;
    let why = "loads or runs the model; commands/ does that";
    for (i, line) in text.lines().enumerate() {
        let code = code_of(line, &mut in_string);
        if code.contains("Model::load") {
            out.push(format!(
                "{name}:{}: `Model::load` ({why}: commands::load::load): {}",
                i + 1,
                line.trim()
            ));
        }
        for call in FORBIDDEN_CALLS.iter().chain(&CLI_FORBIDDEN_CALLS) {
            if finds(&code, call, true) {
                out.push(format!(
                    "{name}:{}: `{call}(` ({why}): {}",
                    i + 1,
                    line.trim()
                ));
            }
        }
    }
    out
}

#[test]
fn cli_runs_no_model() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = rust_files(&root.join("src/cli"));
    assert!(
        files.len() >= 20,
        "only {} files under src/cli",
        files.len()
    );
    let (mut all, mut stale) = (Vec::new(), Vec::new());
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let name = f.strip_prefix(root).unwrap().display().to_string();
        let found = cli_breaks(&name, &text);
        match CLI_ALLOWED.iter().find(|(n, _)| *n == name) {
            Some(_) if found.is_empty() => stale.push(name),
            Some(_) => {}
            None => all.extend(found),
        }
    }
    assert!(
        all.is_empty(),
        "cli/ parses and prints, and runs no model (src/commands/mod.rs); move these to src/commands/:\n{}",
        all.join("\n")
    );
    assert!(
        stale.is_empty(),
        "these files run no model any more: take them off CLI_ALLOWED in tests/layering.rs: {stale:?}"
    );
    for (name, _) in CLI_ALLOWED {
        assert!(
            root.join(name).is_file(),
            "CLI_ALLOWED names {name}, which is gone"
        );
    }
}

#[test]
fn a_load_or_forward_in_cli_is_named_by_file_and_line() {
    let text = "let m = Model::load_memory(spec, p, None, false)?;\n\
                let model = a.model.load()?;\n\
                let r = crate::commands::dla::run(&model, &tokens, &opts)?;\n\
                model.forward(tokens, &opts, &mut obs)?;\n\
                let r = command::run(&model, &input, &opts, on_bar(&bar))?;\n\
                let g = model.generate(prompt, o, |_| {})?;\n\
                // model.forward(x) in a comment is fine\n\
                let roles = roles_of(&model, t)?;\n";
    let got = cli_breaks("src/cli/x.rs", text);
    let lines: Vec<&str> = got.iter().map(|b| b.split(": ").next().unwrap()).collect();
    assert_eq!(
        lines,
        [
            "src/cli/x.rs:1",
            "src/cli/x.rs:1",
            "src/cli/x.rs:4",
            "src/cli/x.rs:6",
            "src/cli/x.rs:8"
        ],
        "{got:#?}"
    );
    assert!(got[0].contains("`Model::load`"), "{}", got[0]);
    assert!(got[2].contains("`forward(`"), "{}", got[2]);
}

#[test]
fn render_runs_no_model() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = rust_files(&root.join("src/render"));
    assert!(
        files.len() >= 10,
        "only {} files under src/render",
        files.len()
    );
    let mut all = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let name = f.strip_prefix(root).unwrap().display().to_string();
        all.extend(breaks(&name, &text));
    }
    assert!(
        all.is_empty(),
        "render/ formats and runs no model (src/commands/mod.rs); move these to src/commands/:\n{}",
        all.join("\n")
    );
}

#[test]
fn a_forward_in_render_is_named_by_file_and_line() {
    let text = "use crate::model::Model;\n\
                // model.forward(x) in a comment is fine\n\
                let s = \"model.forward( in a string is fine\";\n\
                fn f(m: &ModelFacts) {}\n\
                model.forward(tokens, &opts, &mut obs)?;\n\
                let r = crate::analysis::intervene::ablate(model, t, o, |_, _| {});\n\
                fn patch_page(r: &PatchReport) {}\n\
                let x = branch_run;\n\
                use crate::commands::view::ViewOptions;\n\
                if failed.load(Ordering::Relaxed) {}\n";
    let got = breaks("src/render/x.rs", text);
    let lines: Vec<&str> = got.iter().map(|b| b.split(": ").next().unwrap()).collect();
    assert_eq!(
        lines,
        [
            "src/render/x.rs:1",
            "src/render/x.rs:5",
            "src/render/x.rs:6",
            "src/render/x.rs:8",
            "src/render/x.rs:9"
        ],
        "{got:#?}"
    );
    assert!(got[1].contains("`forward(`"), "{}", got[1]);
    assert!(got[2].contains("`ablate(`"), "{}", got[2]);
}
