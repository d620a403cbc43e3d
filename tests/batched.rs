//! Many texts through one forward (`Model::forward_many`, `corpus::text_records`) against each
//! text's own forward: the same logits, hooks and records, bit for bit on the exact kernels, on
//! tiny generated models and on a real one.

mod common;
use attnscope::analysis::corpus::{builtin, text_record, text_records};
use attnscope::model::capture::{AttnCache, CaptureSpec, Hook, Queries};
use attnscope::model::forward::RunOptions;
use attnscope::model::tiny::{tiny_model, write_gguf};
use attnscope::model::{Arch, Model, Precision};
use candle_core::quantized::GgmlDType;
use common::{assert_close, real_model};

fn tiny(arch: Arch, seed: u64, precision: Precision) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    write_gguf(&tiny_model(arch, seed), arch, GgmlDType::F32, &path).unwrap();
    let model = Model::load(path.to_str().unwrap(), precision, false).unwrap();
    (dir, model)
}

/// What a capture of patterns, values and every layer's output holds, per layer.
fn spec() -> CaptureSpec {
    CaptureSpec {
        hooks: vec![Hook::Pattern, Hook::V, Hook::ResidPost],
        layers: None,
        heads: None,
        queries: Queries::All,
    }
}

fn captured(model: &Model, cache: &AttnCache) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    for l in 0..model.dims.n_layers {
        for hook in [Hook::Pattern, Hook::V, Hook::ResidPost] {
            out.push(cache.get(l, hook).unwrap().data.to_vec());
        }
    }
    out
}

/// Whether this precision's kernels give a row the same bits wherever it falls in a product (the
/// 8-bit VNNI kernel's edge tiles sum in another order: within 1e-4, as `forward_batch`'s test says).
fn bitwise(precision: Precision) -> bool {
    precision == Precision::Exact || !attnscope::model::weights::fast_uses_int8()
}

#[test]
fn many_texts_in_one_forward_equal_their_own_forwards() {
    let texts: Vec<Vec<u32>> = vec![
        vec![72, 101, 108, 108, 111, 32, 256, 258, 259],
        vec![7],
        vec![200, 12, 99, 99, 4],
        (0..23).map(|i| (i * 37 % 260) as u32).collect(),
        vec![72, 101],
    ];
    for (arch, precision) in [
        (Arch::Llama, Precision::Exact),
        (Arch::Qwen2, Precision::Exact),
        (Arch::Qwen2, Precision::Fast),
    ] {
        let (_d, model) = tiny(arch, 21, precision);
        let refs: Vec<&[u32]> = texts.iter().map(Vec::as_slice).collect();
        let mut caches: Vec<AttnCache> = texts
            .iter()
            .map(|t| AttnCache::new(&spec(), t.len()))
            .collect();
        let logits = model.forward_many(&refs, &mut caches).unwrap();
        assert_eq!(logits.len(), texts.len());
        for (i, t) in texts.iter().enumerate() {
            let mut alone = AttnCache::new(&spec(), t.len());
            let out = model
                .forward(t, &RunOptions::last_logits(t.len()), &mut alone)
                .unwrap();
            let (got, want) = (captured(&model, &caches[i]), captured(&model, &alone));
            let label = format!("{arch:?} {precision:?} text {i}");
            assert_eq!(
                got[0].len(),
                model.dims.n_heads * t.len() * t.len(),
                "{label}"
            );
            if bitwise(precision) {
                assert_eq!(logits[i], out.logits[0], "{label}: logits");
                assert_eq!(got, want, "{label}: patterns, values, layer outputs");
            } else {
                assert_close(&logits[i], &out.logits[0], 1e-4, &label);
                assert_eq!(got.len(), want.len(), "{label}: captured tensors");
                for (g, w) in got.iter().zip(&want) {
                    assert_close(g, w, 1e-4, &label);
                }
            }
        }
        // distinct texts, distinct numbers: nothing leaked from one text into another
        assert_ne!(logits[0], logits[4]);
        // one observer per text, or an error
        let mut one = vec![AttnCache::new(&spec(), 1)];
        assert!(model.forward_many(&refs, &mut one).is_err());
        assert!(model
            .forward_many::<AttnCache>(&[], &mut [])
            .unwrap()
            .is_empty());
    }
}

#[test]
fn corpus_records_of_a_batch_equal_one_text_runs_tiny() {
    let (_d, model) = tiny(Arch::Qwen2, 5, Precision::Exact);
    let texts = [
        "Hello there",
        "",
        "ab",
        "the quick brown fox jumps over the lazy dog",
        "x",
    ];
    let items: Vec<(usize, &str)> = texts.iter().copied().enumerate().collect();
    let mut done = 0;
    let batch = text_records(&model, &items, false, true, |k| done += k).unwrap();
    assert_eq!(done, texts.len() - 1, "the empty text is not run");
    for (i, t) in texts.iter().enumerate() {
        let alone = text_record(&model, i, t, false, true).unwrap();
        assert_eq!(batch[i], alone, "text {i} {t:?}");
    }
    assert!(batch[1].is_err(), "an empty text is its own error");
    assert!(batch[3].as_ref().unwrap().faithfulness.is_some());
}

#[test]
fn corpus_records_of_a_batch_equal_one_text_runs_qwen() {
    let model = real_model("qwen2.5-coder-0.5b");
    // 70 built-in texts of every kind: two forwards (64 texts, then 6)
    let all = builtin();
    let items: Vec<(usize, &str)> = all
        .iter()
        .take(70)
        .map(String::as_str)
        .enumerate()
        .collect();
    let batch = text_records(model, &items, false, false, |_| {}).unwrap();
    for (i, t) in items.iter() {
        let alone = text_record(model, *i, t, false, false).unwrap();
        assert_eq!(
            batch[*i].as_ref().unwrap(),
            alone.as_ref().unwrap(),
            "text {i}"
        );
    }
}
