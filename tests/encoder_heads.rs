//! An encoder's head roles (issue #41: previous/next token, [CLS], [SEP], broad; Clark et al. 2019)
//! against an independent computation from transformers' attentions (tests/golden/encoder_heads.json,
//! made by tests/golden/make_encoder_heads_golden.py: BertModel, eager, float32), on
//! all-MiniLM-L6-v2 and the tiny BERT, single texts and pairs; a RoBERTa pair's segments (which
//! text a token belongs to, though the model runs no token types); the Python view's pair page.

mod common;
use attnscope::analysis::heads::{roles_of_typed, ENCODER_ROLES};
use attnscope::model::{Model, Precision};
use common::{attnscope, golden, golden_json, real_model, run_json, succeeds, token_ids};

/// The bound on every role score against the golden's (README.md: "within 1e-6 of
/// transformers"; docs/commands/inspect.md gives the measured figure).
const ROLES: f64 = 2e-6;

/// Every role of every (layer, head) of `roles` (`{role: [[score per head] per layer]}`) against
/// the golden case's, cell by cell (`(role, layer, head)`; a role the report lacks or adds
/// fails); returns the worst difference.
fn compare_roles(roles: &serde_json::Value, case: &serde_json::Value, label: &str) -> f64 {
    let cells = |v: &serde_json::Value| -> Vec<((String, usize, usize), f64)> {
        let v = v
            .as_object()
            .unwrap_or_else(|| panic!("{label}: roles {v}"));
        v.iter()
            .flat_map(|(role, grid)| {
                common::json_cells(grid)
                    .into_iter()
                    .map(move |(at, x)| ((role.clone(), at[0], at[1]), x))
            })
            .collect()
    };
    let want = cells(&case["roles"]);
    assert_eq!(
        case["roles"].as_object().unwrap().len(),
        ENCODER_ROLES.len(),
        "{label}: the golden's roles"
    );
    common::assert_cells(
        &format!("{label}: role scores [role, layer, head]"),
        cells(roles),
        want,
        common::Bound::Abs(ROLES),
    )
}

/// The case's tokens and types as attnscope makes them, checked against the tokenizer's.
fn tokens_of(model: &Model, case: &serde_json::Value) -> (Vec<u32>, Option<Vec<u32>>) {
    let text = case["text"].as_str().unwrap();
    let (ids, types) = match case["pair"].as_str() {
        Some(b) => {
            let (ids, types) = model.encode_pair(text, b).unwrap();
            (ids, Some(types))
        }
        None => (model.encode(text, false).unwrap(), None),
    };
    assert_eq!(ids, token_ids(&case["token_ids"]), "token ids");
    if let Some(t) = &types {
        assert_eq!(t, &token_ids(&case["token_types"]), "token types");
    }
    (ids, types)
}

fn check_model(model: &Model, prefix: &str) {
    let g = golden_json("encoder_heads.json");
    let mut seen = 0;
    for (name, case) in g["cases"].as_object().unwrap() {
        if !name.starts_with(prefix) {
            continue;
        }
        let (ids, types) = tokens_of(model, case);
        let r = roles_of_typed(model, &ids, types.as_deref()).unwrap();
        let v = serde_json::to_value(&r).unwrap();
        compare_roles(&v["roles"], case, name);
        common::assert_cells(
            &format!("{name}: a uniform head's scores [role]"),
            ENCODER_ROLES.iter().map(|&role| (role, r.uniform[role])),
            ENCODER_ROLES
                .iter()
                .map(|&role| (role, case["uniform"][role].as_f64().unwrap_or(f64::NAN))),
            common::Bound::Abs(1e-12),
        );
        seen += 1;
    }
    assert_eq!(seen, 2, "{prefix}: a text and a pair");
}

#[test]
fn minilm_head_roles_match_transformers() {
    let model = real_model("all-minilm-l6-v2");
    check_model(model, "minilm_");
    // what the lesson's sentence shows: a previous-token head and a next-token head (Clark et
    // al. find both in BERT's early layers), far above the uniform head
    let g = golden_json("encoder_heads.json");
    let c = &g["cases"]["minilm_lesson"];
    for role in ["previous_token", "next_token"] {
        let best = c["roles"][role]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|l| l.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()))
            .fold(0f64, f64::max);
        assert!(best > 0.5, "{role}: {best}");
    }
}

#[test]
fn tiny_bert_head_roles_match_transformers() {
    let model = Model::load(
        golden("arch/bert").to_str().unwrap(),
        Precision::Exact,
        false,
    )
    .unwrap();
    check_model(&model, "tiny_");
}

#[test]
fn cli_heads_on_an_encoder_text_and_pair() {
    let m = golden("arch/bert");
    let m = m.to_str().unwrap();
    let g = golden_json("encoder_heads.json");
    for name in ["tiny_single", "tiny_pair"] {
        let case = &g["cases"][name];
        let mut cmd = attnscope();
        cmd.args(["heads", "--model", m, "--json", "--text"])
            .arg(case["text"].as_str().unwrap());
        if let Some(b) = case["pair"].as_str() {
            cmd.args(["--pair", b]);
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["tokens"], case["token_ids"], "{name}");
        compare_roles(&v["roles"], case, name);
        assert_eq!(
            v["roles"].as_object().unwrap().len(),
            ENCODER_ROLES.len(),
            "{name}: the encoder's roles only"
        );
    }
    // the table lists the encoder's roles
    let out = attnscope()
        .args(["heads", "--model", m, "--text", "the cat sat on the mat."])
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    for role in ENCODER_ROLES {
        assert!(s.contains(role), "{role}: {s}");
    }
    assert!(s.contains("encoder") && !s.contains("induction"), "{s}");
    // the induction test is a causal model's; a pair needs a text
    for args in [
        vec!["--random-repeat", "5"],
        vec!["--random-repeat", "5", "--pair", "a dog"],
    ] {
        let out = attnscope()
            .args(["heads", "--model", m])
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked") && !err.is_empty(), "{err}");
    }
    // --each-line averages the texts, each once: the mean of the single runs
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("lines.txt");
    std::fs::write(&f, "the cat sat.\nwhat is it?\n").unwrap();
    let each = |args: &[&str]| -> serde_json::Value {
        let out = attnscope()
            .args(["heads", "--model", m, "--json"])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}");
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let both = each(&["--file", f.to_str().unwrap(), "--each-line"]);
    let (a, b) = (
        each(&["--text", "the cat sat."]),
        each(&["--text", "what is it?"]),
    );
    for role in ENCODER_ROLES {
        for l in 0..2 {
            for h in 0..4 {
                let x = |v: &serde_json::Value| v["roles"][role][l][h].as_f64().unwrap();
                assert!((x(&both) - (x(&a) + x(&b)) / 2.0).abs() < 1e-9, "{role}");
            }
        }
    }
}

/// RoBERTa runs no token types (all 0), but a pair still has two texts: `<s> A </s>` then
/// `</s> B </s>`, which `inspect` marks and the view's selector splits at.
#[test]
fn roberta_pair_segments_come_from_the_pair_structure() {
    let dir = golden("arch/roberta");
    let m = dir.to_str().unwrap();
    let model = Model::load(m, Precision::Exact, false).unwrap();
    let (_, sep) = model.special_ids();
    let sep = sep.unwrap();
    let (ids, types, seg) = model.encode_pair_segments("it sat", "the cat").unwrap();
    assert!(types.iter().all(|&t| t == 0), "the model runs type 0 only");
    let k = ids.windows(2).position(|w| w == [sep, sep]).unwrap() + 1;
    let want: Vec<u32> = (0..ids.len()).map(|i| u32::from(i >= k)).collect();
    assert_eq!(seg, want, "{ids:?}");
    assert_eq!(ids[k], sep, "B's part starts at the second separator");
    // a literal separator inside the first text does not move the split
    let (ids2, _, seg2) = model
        .encode_pair_segments("it </s> sat", "the cat")
        .unwrap();
    let first_alone = model.encode("it </s> sat", false).unwrap().len();
    assert_eq!(seg2.iter().position(|&s| s == 1), Some(first_alone));
    assert!(
        ids2[..first_alone].iter().filter(|&&t| t == sep).count() >= 2,
        "{ids2:?}: the literal is a separator too"
    );
    // BERT's segments are its types; DistilBERT's are its tokenizer's types (the model runs none)
    let bert = Model::load(
        golden("arch/bert").to_str().unwrap(),
        Precision::Exact,
        false,
    )
    .unwrap();
    let (_, t, s) = bert.encode_pair_segments("what is it?", "the dog").unwrap();
    assert_eq!(t, s);
    let distil = Model::load(
        golden("arch/distilbert").to_str().unwrap(),
        Precision::Exact,
        false,
    )
    .unwrap();
    let (_, t, s) = distil
        .encode_pair_segments("what is it?", "the dog")
        .unwrap();
    assert!(t.iter().all(|&x| x == 0));
    assert_eq!(
        s,
        bert.encode_pair_segments("what is it?", "the dog")
            .unwrap()
            .2
    );

    // inspect: token_types as the model ran them, segments 0/1 and the B marks in the text
    let v = run_json([
        "inspect", "--model", m, "--text", "it sat", "--pair", "the cat", "--json",
    ]);
    assert_eq!(token_ids(&v["segments"]), want);
    assert!(token_ids(&v["token_types"]).iter().all(|&t| t == 0));
    let out = attnscope()
        .args([
            "inspect", "--model", m, "--text", "it sat", "--pair", "the cat",
        ])
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    let marked = s
        .lines()
        .find(|l| l.starts_with("tokens"))
        .and_then(|l| l.split_once("): "))
        .unwrap()
        .1
        .matches('ᴮ')
        .count();
    assert_eq!(marked, ids.len() - k, "{s}");
    // the view's selector splits at the same place
    let page = dir_page(m, &["--text", "it sat", "--pair", "the cat"]);
    assert!(
        page.contains(&format!("\"sentence_b_start\":{k}")),
        "the page's pair start"
    );
}

/// `attnscope view`'s page for `args` on model `m`.
fn dir_page(m: &str, args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("v.html");
    succeeds(
        attnscope()
            .args(["view", "--model", m, "--out", out_path.to_str().unwrap()])
            .args(args),
    );
    std::fs::read_to_string(out_path).unwrap()
}

/// Python's `viz.attention_heads(..., sentence_b_start=, pair=)` page: the selector on, the
/// selection shown first; bad selections refused with the reason.
#[test]
fn pattern_page_of_a_pair_has_the_selector() {
    use attnscope::render::view::{pair_selection, pattern_page_pair};
    let n = 5;
    let uniform = vec![1.0 / n as f32; 2 * n * n];
    let texts: Vec<String> = ["[CLS]", "a", "[SEP]", "b", "[SEP]"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let page = pattern_page_pair(&uniform, [1, 2, n, n], &texts, "t", Some(3), "a->b").unwrap();
    assert!(page.contains("\"sentence_b_start\":3"), "b start");
    assert!(page.contains("\"pair\":\"AB\""), "the first selection");
    assert!(page.contains("\"token_types\":[0,0,0,1,1]"));
    for (name, value) in [
        ("A→B", "AB"),
        ("b->a", "BA"),
        ("BB", "BB"),
        (" all ", "all"),
    ] {
        assert_eq!(pair_selection(name).unwrap(), value, "{name}");
    }
    let plain = pattern_page_pair(&uniform, [1, 2, n, n], &texts, "t", None, "all").unwrap();
    assert!(plain.contains("\"sentence_b_start\":null"));
    let causal: Vec<f32> = (0..n * n)
        .map(|k| {
            let (i, j) = (k / n, k % n);
            if j <= i {
                1.0 / (i + 1) as f32
            } else {
                0.0
            }
        })
        .collect();
    for (p, shape, b, sel, why) in [
        (&uniform, [1, 2, n, n], None, "a->b", "sentence_b_start"),
        (&uniform, [1, 2, n, n], Some(0), "all", "out of range"),
        (&uniform, [1, 2, n, n], Some(5), "all", "out of range"),
        (&uniform, [1, 2, n, n], Some(2), "c->d", "not a selection"),
        (&causal, [1, 1, n, n], Some(2), "all", "decoder"),
    ] {
        let err = pattern_page_pair(p, shape, &texts, "t", b, sel)
            .unwrap_err()
            .to_string();
        assert!(err.contains(why), "{sel} {b:?}: {err}");
    }
}
