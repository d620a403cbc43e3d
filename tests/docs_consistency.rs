//! The docs name the tests that check what they say: `tests/FILE.rs` · `test_name` (or
//! `FILE.rs · name, other_name` for a file under tests/, `src/.../tests.rs · name` for a unit
//! test, `bindings/python/tests/test_x.py` · `test_name` for a Python test). Every cited file must
//! exist and every cited name must be a function in it, and every path to a source file the docs
//! mention (`tests/…`, `src/…`, `benches/…`, `bindings/…`) must exist: a renamed or removed test
//! otherwise leaves the docs pointing at nothing. Scanned: docs/**/*.md, README.md,
//! tests/golden/README.md.

use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The markdown files the check reads.
fn doc_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    walk(&root().join("docs"), &mut out);
    out.push(root().join("README.md"));
    out.push(root().join("tests/golden/README.md"));
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

fn is_path(c: char) -> bool {
    is_ident(c) || matches!(c, '/' | '.' | '-')
}

/// A citation found in a doc: its line, the file as written, the names after the `·`.
#[derive(Debug, PartialEq)]
struct Citation {
    line: usize,
    file: String,
    names: Vec<String>,
}

/// The path ending just before `at` (skipping spaces and a closing backtick), if it names a
/// `.rs` or `.py` file.
fn path_before(text: &str, at: usize) -> Option<String> {
    let head = text[..at].trim_end();
    let head = head.strip_suffix('`').unwrap_or(head);
    let start = head
        .char_indices()
        .rev()
        .take_while(|&(_, c)| is_path(c))
        .last()
        .map(|(i, _)| i)?;
    let file = &head[start..];
    (file.ends_with(".rs") || file.ends_with(".py")).then(|| file.to_string())
}

/// The names listed from the start of `rest`: identifiers, backticked or not, separated by
/// commas or "and"; the list ends at anything else (a path in backticks ends it too).
fn names_from(rest: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut s = rest.trim_start();
    loop {
        let (name, after) = if let Some(inner) = s.strip_prefix('`') {
            let end = inner.find(|c: char| !is_ident(c)).unwrap_or(inner.len());
            if end == 0 || !inner[end..].starts_with('`') {
                break;
            }
            (&inner[..end], &inner[end + 1..])
        } else {
            let end = s.find(|c: char| !is_ident(c)).unwrap_or(s.len());
            if end == 0 || s[end..].starts_with(['/', '.', '`']) {
                break;
            }
            (&s[..end], &s[end..])
        };
        names.push(name.to_string());
        let next = after.trim_start();
        s = if let Some(x) = next.strip_prefix(',') {
            x.trim_start()
        } else if let Some(x) = next.strip_prefix("and ") {
            x.trim_start()
        } else {
            break;
        };
    }
    names
}

/// Every `FILE · names` citation of a doc's text.
fn citations(text: &str) -> Vec<Citation> {
    text.match_indices('·')
        .filter_map(|(at, dot)| {
            let file = path_before(text, at)?;
            let names = names_from(&text[at + dot.len()..]);
            let line = text[..at].matches('\n').count() + 1;
            Some(Citation { line, file, names })
        })
        .collect()
}

/// Every path to a source file the text mentions: starting at `tests/`, `src/`, `benches/` or
/// `bindings/` (not inside a longer path), ending in `.rs`, `.py` or `.mjs`; with its line.
fn source_paths(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for prefix in ["tests/", "src/", "benches/", "bindings/"] {
        for (at, _) in text.match_indices(prefix) {
            if text[..at].chars().next_back().is_some_and(is_path) {
                continue;
            }
            let end = text[at..]
                .find(|c: char| !is_path(c))
                .map_or(text.len(), |e| at + e);
            let p = text[at..end].trim_end_matches('.');
            if [".rs", ".py", ".mjs"].iter().any(|x| p.ends_with(x)) {
                out.push((text[..at].matches('\n').count() + 1, p.to_string()));
            }
        }
    }
    out
}

/// What is stale in one doc (`doc`, its `text`): each cited file that does not exist, each cited
/// name that is not a function of its file, each mentioned source path that does not exist.
fn stale(doc: &str, text: &str, root: &Path) -> Vec<String> {
    let mut bad = Vec::new();
    for c in citations(text) {
        let path = if c.file.contains('/') {
            root.join(&c.file)
        } else {
            root.join("tests").join(&c.file)
        };
        let Ok(source) = std::fs::read_to_string(&path) else {
            bad.push(format!(
                "{doc}:{}: cites {}, which does not exist",
                c.line, c.file
            ));
            continue;
        };
        if c.names.is_empty() {
            bad.push(format!("{doc}:{}: `{} ·` names no test", c.line, c.file));
        }
        let def = if c.file.ends_with(".py") { "def" } else { "fn" };
        for n in &c.names {
            let found = [format!("{def} {n}("), format!("{def} {n}<")]
                .iter()
                .any(|d| source.contains(d.as_str()));
            if !found {
                bad.push(format!(
                    "{doc}:{}: cites `{n}` in {}, which has no `{def} {n}`",
                    c.line, c.file
                ));
            }
        }
    }
    for (line, p) in source_paths(text) {
        if !root.join(&p).exists() {
            bad.push(format!("{doc}:{line}: mentions {p}, which does not exist"));
        }
    }
    bad
}

#[test]
fn every_test_the_docs_cite_exists() {
    let (mut bad, mut cited) = (Vec::new(), 0);
    for path in doc_files() {
        let text = std::fs::read_to_string(&path).unwrap();
        let doc = path.strip_prefix(root()).unwrap().display().to_string();
        cited += citations(&text)
            .iter()
            .map(|c| c.names.len())
            .sum::<usize>();
        bad.extend(stale(&doc, &text, root()));
    }
    eprintln!("{cited} test names cited in the docs");
    assert!(cited > 40, "the scan found only {cited} cited test names");
    assert!(bad.is_empty(), "stale citations:\n{}", bad.join("\n"));
}

/// The scan reads the docs' forms and reports a bogus name, a missing file and a missing path.
#[test]
fn a_bogus_citation_is_reported() {
    let text = "| x | y | bad_inputs.rs · a_folder_without_config_json, no_such_test |\n\
                Tests: `tests/tiny_models.rs` ·\n`cache_list_gone`, `tests/cli_corpus.rs` · \
                `cache_list_and_clear`; gone.rs · x; see `tests/nowhere.rs`.\n";
    let c = citations(text);
    assert_eq!(
        c,
        vec![
            Citation {
                line: 1,
                file: "bad_inputs.rs".into(),
                names: vec!["a_folder_without_config_json".into(), "no_such_test".into()],
            },
            Citation {
                line: 2,
                file: "tests/tiny_models.rs".into(),
                names: vec!["cache_list_gone".into()],
            },
            Citation {
                line: 3,
                file: "tests/cli_corpus.rs".into(),
                names: vec!["cache_list_and_clear".into()],
            },
            Citation {
                line: 3,
                file: "gone.rs".into(),
                names: vec!["x".into()],
            },
        ]
    );
    let bad = stale("doc.md", text, root());
    assert_eq!(bad.len(), 4, "{bad:#?}");
    assert!(
        bad[0].contains("`no_such_test` in bad_inputs.rs"),
        "{bad:#?}"
    );
    assert!(bad[1].contains("`cache_list_gone`"), "{bad:#?}");
    assert!(
        bad[2].contains("cites gone.rs, which does not exist"),
        "{bad:#?}"
    );
    assert!(bad[3].contains("tests/nowhere.rs"), "{bad:#?}");
}

/// The families docs/models.md's table lists (the first column's `name`s, each once), the ones
/// docs/errors.md's refusal names, and the refusal itself: exactly the registry's
/// (`src/model/family/`), in its order for the messages.
#[test]
fn the_docs_and_the_refusal_name_exactly_the_registrys_families() {
    use attnscope::model::family::{supported_sentence, FAMILIES};
    let registry: Vec<&str> = FAMILIES.iter().map(|f| f.name).collect();
    let models = std::fs::read_to_string(root().join("docs/models.md")).unwrap();
    let start = models
        .find("| family | formats |")
        .expect("docs/models.md has the families' table");
    let mut listed: Vec<String> = models[start..]
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| {
            l.trim_start_matches("| `")
                .split('`')
                .next()
                .map(String::from)
        })
        .collect();
    listed.dedup();
    let mut want: Vec<String> = registry.iter().map(|s| s.to_string()).collect();
    want.sort();
    let mut got = listed.clone();
    got.sort();
    got.dedup();
    assert_eq!(got, want, "docs/models.md's table lists {listed:?}");
    // the refusal names each family once, in the registry's order
    let sentence = supported_sentence();
    let named: Vec<&str> = sentence
        // a name may hold `_` (seed_oss)
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| registry.contains(w))
        .collect();
    assert_eq!(named, registry, "{sentence}");
    let e = attnscope::model::Error::unknown_arch("bloom".into(), "X".into());
    assert!(
        e.to_string().ends_with(&format!("supports: {sentence}")),
        "{e}"
    );
    let errors = std::fs::read_to_string(root().join("docs/errors.md")).unwrap();
    assert!(
        errors.contains(&format!("attnscope supports: {sentence}``")),
        "docs/errors.md's unknown architecture row does not name: {sentence}"
    );
}

/// The names `src/lib.rs` re-exports at the crate root (`pub use a::b::{C, d as e};`, the
/// `as` name where there is one), and its `#[macro_export]` macros: what docs/api.md lists at
/// `attnscope::NAME`. A `pub use` inside `pub mod fixtures { .. }` is that module's, not the root's.
fn lib_rs_exports() -> Vec<String> {
    let lib = std::fs::read_to_string(root().join("src/lib.rs")).unwrap();
    let code: String = lib
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .map(|l| format!("{l}\n"))
        .collect();
    let mut names = Vec::new();
    let (mut depth, mut rest) = (0usize, code.as_str());
    while let Some(at) = rest.find(['{', '}', 'p']) {
        let tail = &rest[at..];
        if tail.starts_with('{') {
            depth += 1;
        } else if tail.starts_with('}') {
            depth -= 1;
        } else if depth == 0 && tail.starts_with("pub use ") {
            let end = tail.find(';').expect("a pub use ends with ;");
            names.extend(use_names(&tail["pub use ".len()..end]));
            rest = &tail[end..];
            continue;
        }
        rest = &tail[1..];
    }
    names.extend(exported_macros());
    names.sort();
    names
}

/// The names one `pub use` brings in: `a::b::C`, `a::{C, d as e}`.
fn use_names(tree: &str) -> Vec<String> {
    let inner = match (tree.find('{'), tree.rfind('}')) {
        (Some(a), Some(b)) => &tree[a + 1..b],
        _ => tree.rsplit("::").next().unwrap(),
    };
    inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.rsplit(" as ")
                .next()
                .unwrap()
                .rsplit("::")
                .next()
                .unwrap()
        })
        .map(|s| s.trim().to_string())
        .collect()
}

/// The `#[macro_export]` macros under src/ (they live at the crate root).
fn exported_macros() -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![root().join("src")];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p).unwrap();
                for (i, _) in text.match_indices("#[macro_export]") {
                    let after = &text[i..];
                    let name = after
                        .split("macro_rules!")
                        .nth(1)
                        .expect("a macro after it");
                    out.push(
                        name.trim_start()
                            .split(['{', '(', ' '])
                            .next()
                            .unwrap()
                            .into(),
                    );
                }
            }
        }
    }
    out
}

/// The items docs/api.md lists at the crate root (`| `attnscope::NAME` | kind | ... |`).
fn api_md_root_items() -> Vec<String> {
    let md = std::fs::read_to_string(root().join("docs/api.md")).unwrap();
    let mut names: Vec<String> = md
        .lines()
        .filter_map(|l| l.strip_prefix("| `attnscope::"))
        .filter_map(|l| l.split('`').next())
        .filter(|p| !p.contains("::"))
        .map(str::to_string)
        .collect();
    names.sort();
    names
}

#[test]
fn api_md_lists_lib_rs_re_exports() {
    let (lib, md) = (lib_rs_exports(), api_md_root_items());
    assert!(lib.len() >= 50, "lib.rs's re-exports not found: {lib:?}");
    let missing: Vec<_> = lib.iter().filter(|n| !md.contains(n)).collect();
    let extra: Vec<_> = md.iter().filter(|n| !lib.contains(n)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "docs/api.md and src/lib.rs's re-exports disagree (regenerate docs/api.md: \
         tools/public_items.py's header says how): in lib.rs only: {missing:?}; in api.md only: \
         {extra:?}"
    );
}
