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

/// A forward resumed on a prefix's keys and values (one new token, or a few), read as they are
/// or grown in place (`Model::forward_grow`, as `generate` runs), gives the same logits, bit for
/// bit, as the same rows of one whole forward: what `compare`'s shared prefix,
/// the patching sweeps' resumed rows (`test_patching.py`) and `faithfulness`'s occlusions rely on.
/// Only `generate`'s own steps may compute a one-row attention another way (within the bounds
/// `generate.rs` tests); a resume anywhere else must not.
#[test]
fn a_resumed_forward_gives_the_whole_forwards_rows_bit_for_bit() {
    use attnscope::model::capture::NoCapture;
    use attnscope::model::forward::RunOptions;
    let text = "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc.";
    for alias in ["qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"] {
        let model = real_model(alias);
        let ids = model.encode(text, false).unwrap();
        let n = ids.len();
        assert!(n >= 12, "{alias}: {n} tokens");
        for new in [1, 3] {
            let p = n - new;
            let rows: Vec<usize> = (p..n).collect();
            let whole = model
                .forward(
                    &ids,
                    &RunOptions {
                        logits_at: rows.clone(),
                        ..Default::default()
                    },
                    &mut NoCapture,
                )
                .unwrap();
            let prefix = model
                .forward(
                    &ids[..p],
                    &RunOptions {
                        keep_kv: true,
                        ..RunOptions::last_logits(p)
                    },
                    &mut NoCapture,
                )
                .unwrap()
                .kv
                .expect("keep_kv returns the keys and values");
            let resumed = model
                .forward_from(
                    Some(&prefix),
                    &ids[p..],
                    &RunOptions {
                        logits_at: rows.clone(),
                        ..Default::default()
                    },
                    &mut NoCapture,
                )
                .unwrap();
            // the same rows on a cache grown in place (generate's steps: the new keys and values
            // written into room kept after the cache's own), with and without room kept before
            let mut grown = Vec::new();
            for room in [0, 40] {
                let mut cache = prefix.clone();
                cache.reserve(room);
                let opts = RunOptions {
                    logits_at: rows.clone(),
                    ..Default::default()
                };
                let out = model
                    .forward_grow(&mut cache, &ids[p..], &opts, &mut NoCapture)
                    .unwrap();
                assert!(out.kv.is_none(), "{alias}: the cache grew in place");
                assert_eq!(cache.len, n, "{alias}: the cache's length moved on");
                // the grown cache's values are the whole run's, and a truncation of it is the
                // prefix again
                let kept = model
                    .forward(
                        &ids,
                        &RunOptions {
                            keep_kv: true,
                            ..RunOptions::last_logits(n)
                        },
                        &mut NoCapture,
                    )
                    .unwrap()
                    .kv
                    .unwrap();
                for l in [0, model.dims.n_layers - 1] {
                    assert_eq!(&*cache.values(l), &*kept.values(l), "{alias} layer {l}");
                    let cut = cache.truncate(p).unwrap();
                    assert_eq!(&*cut.values(l), &*prefix.values(l), "{alias} layer {l}");
                }
                grown.push(out);
            }
            // an observer that edits the attention (head 0's pattern zeroed in layer 1): the
            // grown cache's keys and values read through the edited path give the same bits
            let edited = |cache: Option<&mut attnscope::model::forward::KvPrefix>| {
                use attnscope::analysis::edit::{Editor, Fill, Patch};
                let mut ed = Editor {
                    layer: 1,
                    hook: attnscope::model::capture::Hook::Pattern,
                    patches: vec![Patch {
                        rows: 0..model.dims.n_heads,
                        cols: 0..new * n,
                        at: vec![0],
                        fill: Fill::Zero,
                    }],
                };
                let opts = RunOptions::last_logits(n);
                let out = match cache {
                    Some(c) => model.forward_grow(c, &ids[p..], &opts, &mut ed),
                    None => model.forward_from(Some(&prefix), &ids[p..], &opts, &mut ed),
                };
                out.unwrap().logits.remove(0)
            };
            let (read, grew) = (edited(None), edited(Some(&mut prefix.clone())));
            assert!(
                read.iter().all(|x| x.is_finite()),
                "{alias}: an edited logit"
            );
            assert!(
                read.iter()
                    .map(|x| x.to_bits())
                    .eq(grew.iter().map(|x| x.to_bits())),
                "{alias}: the edited run on a grown cache differs from the one on the prefix"
            );
            assert_ne!(
                read,
                resumed.logits[new - 1],
                "{alias}: the edit changed nothing"
            );
            assert_eq!(whole.logits.len(), new, "{alias}");
            assert_eq!(resumed.logits.len(), new, "{alias}");
            let ways = std::iter::once(&resumed).chain(&grown);
            for (i, (w, r)) in ways
                .flat_map(|o| whole.logits.iter().zip(&o.logits).enumerate())
                .map(|(i, wr)| (i % new, wr))
            {
                assert_eq!(w.len(), model.dims.vocab_size, "{alias}");
                assert!(
                    w.iter().all(|x| x.is_finite()),
                    "{alias}: a logit is not finite"
                );
                let differ = w
                    .iter()
                    .zip(r)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert!(
                    differ == 0 && w.len() == r.len(),
                    "{alias}: {new} new token(s), row {}: {differ} of {} logits differ from the whole forward's",
                    p + i,
                    w.len()
                );
            }
        }
    }
}
