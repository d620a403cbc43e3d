//! The weights as TransformerLens reads them (`Model::projection_weights` & co): on tiny models
//! written as GGUF (llama's q/k rows permuted by llama.cpp's converter) and as Hugging Face
//! folders, they are the Hugging Face weights the models were made from; `hook_q`/`hook_k` come in
//! Hugging Face's row order from both files; and a forward stopped before a block
//! (`Observer::stops_before`, TL's `stop_at_layer`) hands the residual a full run has there.

mod common;
use attnscope::model::capture::{AttnCache, CaptureSpec, Hook, Observer, Queries};
use attnscope::model::forward::RunOptions;
use attnscope::model::tiny::{tiny_model, write_gguf, write_hf_folder};
use attnscope::model::tl_weights::Projection;
use attnscope::model::{Arch, Model, Precision};
use candle_core::quantized::GgmlDType;
use common::assert_close;

const TOKENS: [u32; 9] = [72, 101, 108, 108, 111, 32, 256, 258, 259];

fn loads(arch: Arch) -> (tempfile::TempDir, Vec<(&'static str, Model)>) {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_model(arch, 42);
    let gguf = dir.path().join("t.gguf");
    write_gguf(&m, arch, GgmlDType::F32, &gguf).unwrap();
    let hf = dir.path().join("hf");
    write_hf_folder(&m, arch, &hf, 1).unwrap();
    let load =
        |p: &std::path::Path| Model::load(p.to_str().unwrap(), Precision::Exact, false).unwrap();
    let models = vec![("gguf", load(&gguf)), ("safetensors", load(&hf))];
    (dir, models)
}

#[test]
fn projections_are_the_hugging_face_weights_for_every_format() {
    for arch in [Arch::Llama, Arch::Qwen2] {
        let m = tiny_model(arch, 42);
        let (_dir, models) = loads(arch);
        for (label, model) in &models {
            assert_eq!(
                model.qk_interleaved(),
                *label == "gguf" && arch == Arch::Llama
            );
            for (l, r) in m.layers.iter().enumerate() {
                let what = |p: &str| format!("{arch:?} {label} layer {l} {p}");
                let (w, b, rows, cols) = model.projection_weights(l, Projection::Qkv).unwrap();
                let want: Vec<f32> = [&r.w_q, &r.w_k, &r.w_v]
                    .into_iter()
                    .flatten()
                    .copied()
                    .collect();
                assert_eq!((rows, cols), (want.len() / 32, 32));
                assert_close(&w, &want, 1e-6, &what("qkv"));
                match (&b, &r.b_q) {
                    (Some(b), Some(bq)) => {
                        let want: Vec<f32> = [bq, r.b_k.as_ref().unwrap(), r.b_v.as_ref().unwrap()]
                            .into_iter()
                            .flatten()
                            .copied()
                            .collect();
                        assert_close(b, &want, 1e-6, &what("qkv bias"));
                    }
                    (None, None) => {}
                    _ => panic!(
                        "{}: a bias where the model has none, or none where it has one",
                        what("qkv")
                    ),
                }
                let (w, _, _, _) = model.projection_weights(l, Projection::O).unwrap();
                assert_close(&w, &r.w_o, 1e-6, &what("o"));
                let (w, _, rows, _) = model.projection_weights(l, Projection::GateUp).unwrap();
                assert_eq!(rows, 128);
                let want: Vec<f32> = r.w_gate.iter().chain(&r.w_up).copied().collect();
                assert_close(&w, &want, 1e-6, &what("gate_up"));
                let (w, _, _, _) = model.projection_weights(l, Projection::Down).unwrap();
                assert_close(&w, &r.w_down, 1e-6, &what("down"));
                let ((n1, b1), (n2, _)) = model.layer_norms(l).unwrap();
                assert!(b1.is_none());
                assert_close(n1, &r.attn_norm, 1e-6, &what("ln1"));
                assert_close(n2, &r.mlp_norm, 1e-6, &what("ln2"));
            }
            assert_close(&model.embedding_matrix().unwrap(), &m.embed, 1e-6, "W_E");
            let head = m.lm_head.as_ref().unwrap_or(&m.embed);
            assert_close(&model.unembed_matrix().unwrap(), head, 1e-6, "W_U");
            assert!(model.position_embeddings().is_none());
            assert!(model.projection_weights(2, Projection::O).is_err());
        }
    }
}

#[test]
fn quantized_weights_are_read_back_as_the_forward_uses_them() {
    // fast precision keeps 8-bit blocks (no column slices): read through whole unit rows, the
    // weights are the exact ones up to the 8-bit rounding
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    write_gguf(
        &tiny_model(Arch::Qwen2, 3),
        Arch::Qwen2,
        GgmlDType::F32,
        &path,
    )
    .unwrap();
    let exact = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
    let fast = Model::load(path.to_str().unwrap(), Precision::Fast, false).unwrap();
    for part in [
        Projection::Qkv,
        Projection::O,
        Projection::GateUp,
        Projection::Down,
    ] {
        let (a, _, _, _) = exact.projection_weights(1, part).unwrap();
        let (b, _, _, _) = fast.projection_weights(1, part).unwrap();
        let top = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(worst <= top / 100.0, "{part:?}: {worst} of {top}");
    }
}

fn capture(model: &Model, hooks: Vec<Hook>) -> AttnCache {
    let spec = CaptureSpec {
        hooks,
        layers: None,
        heads: None,
        queries: Queries::All,
    };
    let mut cache = AttnCache::new(&spec, TOKENS.len());
    model
        .forward(&TOKENS, &RunOptions::last_logits(TOKENS.len()), &mut cache)
        .unwrap();
    cache
}

#[test]
fn q_and_k_hooks_come_in_hugging_faces_order_from_every_file() {
    for arch in [Arch::Llama, Arch::Qwen2] {
        let (_dir, models) = loads(arch);
        let hooks = vec![Hook::Q, Hook::K, Hook::RotQ, Hook::RotK, Hook::Pattern];
        let caches: Vec<AttnCache> = models
            .iter()
            .map(|(_, m)| capture(m, hooks.clone()))
            .collect();
        for l in 0..2 {
            for &h in &hooks {
                let a = &caches[0].get(l, h).unwrap().data;
                let b = &caches[1].get(l, h).unwrap().data;
                assert_close(
                    a,
                    b,
                    2e-5,
                    &format!("{arch:?} layer {l} {h:?}: gguf against safetensors"),
                );
            }
        }
    }
}

/// Captures like an [`AttnCache`] and stops before block `at`.
struct StopAt {
    cache: AttnCache,
    at: usize,
}

impl Observer for StopAt {
    fn wants(&self, layer: usize, hook: Hook) -> bool {
        self.cache.wants(layer, hook)
    }
    fn tensor(&mut self, layer: usize, hook: Hook, shape: &[usize], data: &[f32]) {
        self.cache.tensor(layer, hook, shape, data)
    }
    fn attention_block(
        &mut self,
        layer: usize,
        hook: Hook,
        q: usize,
        shape: [usize; 3],
        data: &[f32],
    ) {
        self.cache.attention_block(layer, hook, q, shape, data)
    }
    fn stops_before(&self, layer: usize) -> bool {
        layer == self.at
    }
}

#[test]
fn a_forward_stopped_before_a_block_hands_the_residual_there_and_no_logits() {
    let (_dir, models) = loads(Arch::Llama);
    let model = &models[0].1;
    let full = capture(model, vec![Hook::ResidPre, Hook::ResidPost]);
    for at in 0..=2 {
        let spec = CaptureSpec {
            hooks: vec![Hook::ResidPre, Hook::ResidPost],
            layers: None,
            heads: None,
            queries: Queries::All,
        };
        let mut obs = StopAt {
            cache: AttnCache::new(&spec, TOKENS.len()),
            at,
        };
        let out = model
            .forward(&TOKENS, &RunOptions::last_logits(TOKENS.len()), &mut obs)
            .unwrap();
        assert!(
            out.logits.is_empty(),
            "stopped before block {at}: no logits"
        );
        for l in 0..2 {
            // block `at` hands its resid_pre, then nothing after it runs
            assert_eq!(
                obs.cache.get(l, Hook::ResidPre).is_some(),
                l <= at,
                "resid_pre {l}, stop {at}"
            );
            assert_eq!(
                obs.cache.get(l, Hook::ResidPost).is_some(),
                l < at,
                "resid_post {l}, stop {at}"
            );
        }
        let (got, want) = if at < 2 {
            (
                obs.cache.get(at, Hook::ResidPre),
                full.get(at, Hook::ResidPre),
            )
        } else {
            (
                obs.cache.get(1, Hook::ResidPost),
                full.get(1, Hook::ResidPost),
            )
        };
        assert_eq!(got.unwrap().data, want.unwrap().data, "stop {at}");
    }
}
