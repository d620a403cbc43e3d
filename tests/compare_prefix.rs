//! `compare` of two texts that start with the same tokens runs their common prefix once: side B
//! runs from the first token that differs, on side A's keys and values. The report is the one
//! of two whole runs, byte for byte as JSON, on the real models.

mod common;
use attnscope::analysis::compare::{
    compare, compare_runs, run_side, shared_prefix, text_label, CompareOptions, Mode, SideInput,
};
use common::real_model;

/// The report of `compare_runs` (sharing the prefix) and of two whole runs, as JSON.
/// Also: how many tokens the texts share, and how many of them side B reused.
fn both(
    alias: &str,
    a: &str,
    b: &str,
    query: Option<usize>,
) -> (String, String, usize, Option<usize>) {
    let model = real_model(alias);
    let side = |text: &'static str| SideInput {
        model,
        name: alias,
        text,
        label: text_label(text),
    };
    let (a, b): (&'static str, &'static str) = (
        Box::leak(a.to_string().into_boxed_str()),
        Box::leak(b.to_string().into_boxed_str()),
    );
    let opts = CompareOptions {
        query,
        ..Default::default()
    };
    let shared = compare_runs(Mode::Texts, [side(a), side(b)], &opts).unwrap();
    let (ta, tb) = (
        model.encode(a, false).unwrap(),
        model.encode(b, false).unwrap(),
    );
    let common = ta.iter().zip(&tb).take_while(|(x, y)| x == y).count();
    let q = |t: &[u32]| query.unwrap_or(t.len() - 1);
    let reused = shared_prefix(model, &ta, &tb, q(&tb));
    let whole = compare(
        Mode::Texts.name(),
        run_side(model, &ta, q(&ta), text_label(a)).unwrap(),
        run_side(model, &tb, q(&tb), text_label(b)).unwrap(),
        opts.top,
    );
    (
        serde_json::to_string(&shared).unwrap(),
        serde_json::to_string(&whole).unwrap(),
        common,
        reused,
    )
}

#[test]
fn two_texts_sharing_a_prefix_give_the_whole_runs_report() {
    for alias in ["qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"] {
        for (a, b, query, reuses) in [
            // B shares A's first tokens and goes on differently: B runs from the difference
            (
                "The capital of France is Paris, and the capital of Germany is",
                "The capital of France is Paris, and the capital of Italy is",
                None,
                true,
            ),
            // B longer than A
            (
                "def add(a, b):\n    return a + b",
                "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
                None,
                true,
            ),
            // a query inside the common prefix: B runs whole
            (
                "The cat sat on the mat because it was warm",
                "The cat sat on the mat because it was tired",
                Some(3),
                false,
            ),
        ] {
            let (shared, whole, common, reused) = both(alias, a, b, query);
            assert!(common >= 4, "{alias}: the texts share {common} tokens");
            assert_eq!(reused, reuses.then_some(common), "{alias}: {a:?} / {b:?}");
            assert!(shared == whole, "{alias} {a:?} / {b:?}: the reports differ");
        }
    }
}
