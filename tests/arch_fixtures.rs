//! Tiny checkpoints of more families (tests/golden/arch, from ../shared/reference/arch: Hugging
//! Face folders written by transformers 5.24 with every attention weight it computes on two texts
//! and the last logits): each supported family matches within 2e-5 (attention) and 5e-5 (logits),
//! in both config styles; what attnscope does not implement is refused by name.
#![allow(clippy::needless_range_loop)]

mod common;
use attnscope::model::capture::{AttnCache, CaptureSpec};
use attnscope::model::forward::RunOptions;
use attnscope::model::{Model, Precision};
use common::{
    array_cells, assert_array, assert_cells, golden, golden_json, golden_npy, run_err, run_json,
    run_ok, token_ids, Bound,
};

/// The bounds every fixture is asserted at against transformers: (attention weights, logits);
/// docs/models.md gives each family's measured figures (at most 5.9e-6 and 9.1e-6).
const TRANSFORMERS: (f64, f64) = (2e-5, 5e-5);
/// No bound: the comparison only measures (a NaN or a missing cell still fails), for the checks
/// that a wrong setting moves the numbers.
const MEASURE: (f64, f64) = (f64::INFINITY, f64::INFINITY);
use std::path::Path;

/// A copy of fixture `name` whose config.json `edit` may change.
fn fixture_copy(name: &str, edit: &dyn Fn(&mut serde_json::Value)) -> tempfile::TempDir {
    let src = golden(&format!("arch/{name}"));
    let dir = tempfile::tempdir().unwrap();
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    dir
}

/// Largest difference of every attention weight of both texts, and of the last logits, each
/// cell compared with [`assert_cells`] within `bounds` (attention, logits).
fn deviation(dir: &Path, name: &str, bounds: (f64, f64)) -> (f64, f64, Vec<(u64, u64)>) {
    let model = Model::load(dir.to_str().unwrap(), Precision::Exact, false)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    model_deviation(&model, name, true, bounds)
}

/// As [`deviation`], for a loaded model; `tokenize` also checks the text's token ids.
fn model_deviation(
    model: &Model,
    name: &str,
    tokenize: bool,
    bounds: (f64, f64),
) -> (f64, f64, Vec<(u64, u64)>) {
    let r = golden_json(&format!("arch/{name}/reference.json"));
    let (mut attn, mut logits, mut next) = (0f64, 0f64, Vec::new());
    for which in ["short", "long"] {
        let t = &r["texts"][which];
        let ids: Vec<u32> = token_ids(&t["token_ids"]);
        let text = t["text"].as_str().unwrap();
        if tokenize {
            assert_eq!(
                model.encode(text, false).unwrap(),
                ids,
                "{name} {which}: token ids"
            );
        }
        let n = ids.len();
        let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
        let out = model
            .forward(&ids, &RunOptions::last_logits(n), &mut cache)
            .unwrap();
        let (shape, want) = golden_npy(&format!("arch/{name}/attn_{which}.npy"));
        assert_eq!(shape, vec![model.dims.n_layers, model.dims.n_heads, n, n]);
        let got: Vec<f32> = (0..model.dims.n_layers)
            .flat_map(|l| cache.pattern(l).unwrap().data.to_vec())
            .collect();
        attn = attn.max(assert_array(
            &format!("{name} {which}: attention [layer, head, query, key]"),
            &shape,
            &got,
            &want,
            Bound::Abs(bounds.0),
        ));
        let (shape, want_logits) = golden_npy(&format!("arch/{name}/logits_{which}.npy"));
        logits = logits.max(assert_cells(
            &format!("{name} {which}: last logits [token id]"),
            array_cells(&[out.logits[0].len()], &out.logits[0]),
            array_cells(&shape, &want_logits),
            Bound::Abs(bounds.1),
        ));
        let argmax = attnscope::analysis::max_argmax(&out.logits[0]).1 as u64;
        next.push((argmax, t["next_token_argmax"].as_u64().unwrap()));
    }
    (attn, logits, next)
}

fn check(name: &str, edit: &dyn Fn(&mut serde_json::Value)) {
    let dir = fixture_copy(name, edit);
    let (attn, logits, next) = deviation(dir.path(), name, TRANSFORMERS);
    eprintln!("{name}: max |attention - transformers| {attn:.2e}, max |logit - transformers| {logits:.2e}");
    assert!(
        attn <= TRANSFORMERS.0,
        "{name}: attention off by {attn:.2e}"
    );
    assert!(
        logits <= TRANSFORMERS.1,
        "{name}: logits off by {logits:.2e}"
    );
    for (got, want) in next {
        assert_eq!(got, want, "{name}: next token");
    }
}

fn load_err(dir: &Path) -> String {
    match Model::load(dir.to_str().unwrap(), Precision::Exact, false) {
        Ok(_) => panic!("{} loaded, but must be refused", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// Llama 3 rope scaling, in transformers 5's `rope_parameters` and in the hub's `rope_theta` +
/// `rope_scaling` (with `rope_type`, and the older `type`).
#[test]
fn llama3_rope_scaling_matches_transformers_in_both_config_styles() {
    check("llama3", &|_| {});
    check("llama3", &|c| {
        let p = c["rope_parameters"].take();
        c.as_object_mut().unwrap().remove("rope_parameters");
        c["rope_theta"] = p["rope_theta"].clone();
        let mut s = p.clone();
        s.as_object_mut().unwrap().remove("rope_theta");
        c["rope_scaling"] = s;
    });
    check("llama3", &|c| {
        let p = c["rope_parameters"].take();
        c.as_object_mut().unwrap().remove("rope_parameters");
        c["rope_theta"] = p["rope_theta"].clone();
        let mut s = p.clone();
        let o = s.as_object_mut().unwrap();
        o.remove("rope_theta");
        let t = o.remove("rope_type").unwrap();
        o.insert("type".into(), t);
        c["rope_scaling"] = s;
    });
    // the scaling bites: without it the attention is far off (what main printed before)
    let plain = fixture_copy("llama3", &|c| {
        c["rope_parameters"]["rope_type"] = "default".into()
    });
    let (attn, _, _) = deviation(plain.path(), "llama3", MEASURE);
    assert!(
        attn > 0.1,
        "ignoring rope scaling moved the attention by only {attn}"
    );
}

/// Every rope type, config key or tensor the forward does not implement is refused by name.
#[test]
fn what_is_not_implemented_is_refused_by_name() {
    for (what, edit, want) in [
        (
            "yarn",
            Box::new(|c: &mut serde_json::Value| c["rope_parameters"]["rope_type"] = "yarn".into())
                as Box<dyn Fn(&mut serde_json::Value)>,
            "rope_parameters.rope_type",
        ),
        (
            "dynamic (hub style)",
            Box::new(|c: &mut serde_json::Value| {
                c.as_object_mut().unwrap().remove("rope_parameters");
                c["rope_theta"] = 10000.0.into();
                c["rope_scaling"] = serde_json::json!({"type": "dynamic", "factor": 2.0});
            }),
            "rope_scaling.rope_type",
        ),
        (
            "longrope",
            Box::new(|c: &mut serde_json::Value| {
                c["rope_parameters"]["rope_type"] = "longrope".into()
            }),
            "\"longrope\"",
        ),
        (
            "softcapping",
            Box::new(|c: &mut serde_json::Value| c["attn_logit_softcapping"] = 50.0.into()),
            "attn_logit_softcapping",
        ),
        (
            "final softcapping",
            Box::new(|c: &mut serde_json::Value| c["final_logit_softcapping"] = 30.0.into()),
            "final_logit_softcapping",
        ),
        (
            "sliding window",
            Box::new(|c: &mut serde_json::Value| c["sliding_window"] = 8.into()),
            "sliding_window",
        ),
        (
            "gelu",
            Box::new(|c: &mut serde_json::Value| c["hidden_act"] = "gelu".into()),
            "hidden_act",
        ),
        (
            "partial rotary of a fraction of a dimension",
            Box::new(|c: &mut serde_json::Value| c["partial_rotary_factor"] = 0.3.into()),
            "partial_rotary_factor",
        ),
        (
            "layer types",
            Box::new(|c: &mut serde_json::Value| {
                c["layer_types"] =
                    serde_json::json!(["sliding_attention", "full_attention", "full_attention"])
            }),
            "layer_types",
        ),
        (
            "llama3 without its factor",
            Box::new(|c: &mut serde_json::Value| {
                c["rope_parameters"]
                    .as_object_mut()
                    .unwrap()
                    .remove("factor");
            }),
            "rope_parameters.factor",
        ),
    ] {
        let dir = fixture_copy("llama3", &*edit);
        let e = load_err(dir.path());
        assert!(e.contains(want), "{what}: {e}");
    }
    an_unread_tensor_is_refused_by_name();
    the_binary_exits_2_naming_the_key();
}

/// A tensor the forward would not read (an output bias): refused, named.
fn an_unread_tensor_is_refused_by_name() {
    let dir = fixture_copy("llama3", &|_| {});
    let st = dir.path().join("model.safetensors");
    let mut tensors: Vec<(String, candle_core::Tensor)> =
        candle_core::safetensors::load(&st, &candle_core::Device::Cpu)
            .unwrap()
            .into_iter()
            .collect();
    tensors.push((
        "model.layers.0.self_attn.o_proj.bias".into(),
        candle_core::Tensor::zeros(64, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap(),
    ));
    let map: std::collections::HashMap<String, candle_core::Tensor> = tensors.into_iter().collect();
    candle_core::safetensors::save(&map, &st).unwrap();
    let e = load_err(dir.path());
    assert!(
        e.contains("model.layers.0.self_attn.o_proj.bias") && e.contains("does not use"),
        "{e}"
    );
}

/// Through the binary: exit 2, the key named.
fn the_binary_exits_2_naming_the_key() {
    let dir = fixture_copy("llama3", &|c| {
        c["rope_parameters"]["rope_type"] = "yarn".into()
    });
    let e = run_err(
        [
            "inspect",
            "--model",
            dir.path().to_str().unwrap(),
            "--text",
            "The cat",
        ],
        2,
    );
    assert!(
        e.contains("rope_parameters.rope_type") && e.contains("\"yarn\""),
        "{e}"
    );
}

/// Gives a GGUF written by `write_gguf_with` the fixtures' vocabulary size (the ids are passed
/// directly, so the pieces are placeholders).
fn byte_vocab(md: &mut [(String, candle_core::quantized::gguf_file::Value)], vocab: usize) {
    use candle_core::quantized::gguf_file::Value;
    for (k, v) in md.iter_mut() {
        match k.as_str() {
            "tokenizer.ggml.tokens" => {
                *v = Value::Array((0..vocab).map(|i| Value::String(format!("t{i}"))).collect())
            }
            "tokenizer.ggml.token_type" => {
                *v = Value::Array((0..vocab).map(|_| Value::I32(1)).collect())
            }
            "tokenizer.ggml.merges" => *v = Value::Array(Vec::new()),
            "tokenizer.ggml.bos_token_id" => *v = Value::U32(256),
            _ => {}
        }
    }
}

/// The fixture's weights as the reference module's model (Hugging Face layout).
fn fixture_ref(name: &str) -> attnscope::reference::transformer::RefModel {
    use attnscope::reference::transformer::{RefConfig, RefLayer, RefModel};
    let dir = golden(&format!("arch/{name}"));
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let t =
        candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    let get = |n: &str| -> Vec<f32> { t[n].flatten_all().unwrap().to_vec1::<f32>().unwrap() };
    let u = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let layers = (0..u("num_hidden_layers"))
        .map(|i| {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            RefLayer {
                attn_norm: get(&p("input_layernorm.weight")),
                w_q: get(&p("self_attn.q_proj.weight")),
                b_q: None,
                w_k: get(&p("self_attn.k_proj.weight")),
                b_k: None,
                w_v: get(&p("self_attn.v_proj.weight")),
                b_v: None,
                w_o: get(&p("self_attn.o_proj.weight")),
                mlp_norm: get(&p("post_attention_layernorm.weight")),
                w_gate: get(&p("mlp.gate_proj.weight")),
                w_up: get(&p("mlp.up_proj.weight")),
                w_down: get(&p("mlp.down_proj.weight")),
            }
        })
        .collect();
    RefModel {
        cfg: RefConfig {
            n_layers: u("num_hidden_layers"),
            d_model: u("hidden_size"),
            n_heads: u("num_attention_heads"),
            n_kv_heads: u("num_key_value_heads"),
            head_dim: u("head_dim"),
            d_ff: u("intermediate_size"),
            vocab: u("vocab_size"),
            rope_base: cfg["rope_parameters"]["rope_theta"].as_f64().unwrap() as f32,
            rms_eps: cfg["rms_norm_eps"].as_f64().unwrap() as f32,
        },
        embed: get("model.embed_tokens.weight"),
        layers,
        final_norm: get("model.norm.weight"),
        lm_head: t.get("lm_head.weight").map(|_| get("lm_head.weight")),
    }
}

/// Llama 3.1+ GGUF files carry `rope_freqs.weight` (llama.cpp's per-frequency divisors): a GGUF
/// written from the llama3 fixture with the factors llama.cpp's converter computes matches
/// transformers; without the tensor it does not (so the tensor is really applied).
#[test]
fn llama3_gguf_rope_freqs_are_applied() {
    use attnscope::model::config::RopeScaling;
    use attnscope::model::tiny::write_gguf_with;
    use attnscope::model::Arch;
    use candle_core::quantized::{GgmlDType, QTensor};
    let m = fixture_ref("llama3");
    let hd = m.cfg.head_dim;
    let plain = RopeScaling::Default.inv_freq(hd, m.cfg.rope_base);
    let scaled = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_context: 16.0,
    }
    .inv_freq(hd, m.cfg.rope_base);
    let factors: Vec<f32> = plain.iter().zip(&scaled).map(|(p, s)| p / s).collect();
    let dir = tempfile::tempdir().unwrap();
    for (with, want_close) in [(true, true), (false, false)] {
        let path = dir.path().join(format!("l3-{with}.gguf"));
        let f2 = factors.clone();
        let vocab = m.cfg.vocab;
        write_gguf_with(
            &m,
            Arch::Llama,
            GgmlDType::F32,
            &path,
            &move |md, tensors| {
                byte_vocab(md, vocab);
                if with {
                    let t = candle_core::Tensor::from_vec(
                        f2.clone(),
                        f2.len(),
                        &candle_core::Device::Cpu,
                    )
                    .unwrap();
                    tensors.push((
                        "rope_freqs.weight".into(),
                        QTensor::quantize(&t, GgmlDType::F32).unwrap(),
                    ));
                }
            },
        )
        .unwrap();
        let model = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
        let bounds = if want_close { TRANSFORMERS } else { MEASURE };
        let (attn, logits, _) = model_deviation(&model, "llama3", false, bounds);
        eprintln!("llama3 GGUF, rope_freqs {with}: attention {attn:.2e}, logits {logits:.2e}");
        if want_close {
            assert!(
                attn <= TRANSFORMERS.0 && logits <= TRANSFORMERS.1,
                "with rope_freqs: {attn:.2e} / {logits:.2e}"
            );
        } else {
            assert!(
                attn > 0.1,
                "without rope_freqs the attention should be far off: {attn}"
            );
        }
    }
}

/// GGUF metadata that changes the numbers and that the forward does not implement is refused by
/// its key: a rope scaling type, a sliding window, soft-capping, a partial rotary dimension.
#[test]
fn gguf_metadata_the_forward_does_not_implement_is_refused() {
    use attnscope::model::tiny::{tiny_model, write_gguf_with};
    use attnscope::model::Arch;
    use candle_core::quantized::{gguf_file::Value, GgmlDType};
    let dir = tempfile::tempdir().unwrap();
    for (key, value) in [
        ("llama.rope.scaling.type", Value::String("yarn".into())),
        ("llama.rope.scaling.factor", Value::F32(4.0)),
        ("llama.attention.sliding_window", Value::U32(4096)),
        ("llama.attn_logit_softcapping", Value::F32(50.0)),
        ("llama.rope.dimension_count", Value::U32(4)),
    ] {
        let path = dir.path().join("t.gguf");
        let v = value.clone();
        write_gguf_with(
            &tiny_model(Arch::Llama, 3),
            Arch::Llama,
            GgmlDType::F32,
            &path,
            &move |md, _| {
                md.push((key.to_string(), v.clone()));
            },
        )
        .unwrap();
        let e = match Model::load(path.to_str().unwrap(), Precision::Exact, false) {
            Ok(_) => panic!("{key} was ignored"),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains(key) && e.contains("does not implement"),
            "{key}: {e}"
        );
    }
    // `none` scaling is the plain RoPE, and loads
    let path = dir.path().join("none.gguf");
    write_gguf_with(
        &tiny_model(Arch::Llama, 3),
        Arch::Llama,
        GgmlDType::F32,
        &path,
        &|md, _| {
            md.push((
                "llama.rope.scaling.type".into(),
                Value::String("none".into()),
            ));
        },
    )
    .unwrap();
    Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
}

/// Qwen3: RMSNorm on each head's query and key before RoPE, head_dim 24 ≠ hidden / heads.
#[test]
fn qwen3_matches_transformers() {
    check("qwen3", &|_| {});
    // the hub's older style: rope_theta at the top level
    check("qwen3", &|c| {
        let p = c["rope_parameters"].take();
        c.as_object_mut().unwrap().remove("rope_parameters");
        c["rope_theta"] = p["rope_theta"].clone();
    });
}

/// Qwen3 in llama.cpp's GGUF layout (`qwen3.*` keys, `attn_q_norm`/`attn_k_norm`, NEOX RoPE), written
/// by the test from the same fixture: the same numbers as transformers.
#[test]
fn qwen3_gguf_matches_transformers() {
    use attnscope::model::tiny::write_gguf_with;
    use attnscope::model::Arch;
    use candle_core::quantized::{gguf_file::Value, GgmlDType, QTensor};
    let m = fixture_ref("qwen3");
    let dir = golden("arch/qwen3");
    let t =
        candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    let path = tempfile::tempdir().unwrap();
    let gguf = path.path().join("qwen3.gguf");
    let (vocab, hd, layers) = (m.cfg.vocab, m.cfg.head_dim, m.cfg.n_layers);
    write_gguf_with(
        &m,
        Arch::Qwen3,
        GgmlDType::F32,
        &gguf,
        &move |md, tensors| {
            byte_vocab(md, vocab);
            md.push(("qwen3.attention.key_length".into(), Value::U32(hd as u32)));
            md.push(("qwen3.attention.value_length".into(), Value::U32(hd as u32)));
            for i in 0..layers {
                for (hf, gg) in [("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")] {
                    let w = &t[&format!("model.layers.{i}.self_attn.{hf}.weight")];
                    tensors.push((
                        format!("blk.{i}.{gg}.weight"),
                        QTensor::quantize(w, GgmlDType::F32).unwrap(),
                    ));
                }
            }
        },
    )
    .unwrap();
    let model = Model::load(gguf.to_str().unwrap(), Precision::Exact, false).unwrap();
    assert_eq!(model.dims.arch, Arch::Qwen3);
    let (attn, logits, next) = model_deviation(&model, "qwen3", false, TRANSFORMERS);
    eprintln!("qwen3 GGUF: attention {attn:.2e}, logits {logits:.2e}");
    assert!(
        attn <= TRANSFORMERS.0 && logits <= TRANSFORMERS.1,
        "{attn:.2e} / {logits:.2e}"
    );
    assert!(next.iter().all(|(a, b)| a == b));
}

/// The commands run on the new families (through the binary): inspect, faithfulness, heads,
/// capture, view and compare.
#[test]
fn commands_run_on_every_fixture() {
    let dir = tempfile::tempdir().unwrap();
    for name in [
        "llama3", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "gpt2",
    ] {
        let m = golden(&format!("arch/{name}"));
        let m = m.to_str().unwrap();
        let v = every_command_runs(name, m, dir.path());
        if name == "mistral" {
            mistral_says_its_window_hides_the_first_token(m);
        }
        if name == "gemma2" {
            gemma2_windows_every_other_layer(m);
        }
        let arch = if name == "llama3" { "llama" } else { name };
        assert_eq!(v["model"]["arch"], arch);
        assert_eq!(
            v["model"]["head_dim"],
            if name == "qwen3" { 24 } else { 16 }
        );
    }
}

/// Runs every command on the fixture `m` (writing its files in `dir`), each to exit 0 and each
/// `--json` to print an object; returns `inspect`'s JSON.
fn every_command_runs(name: &str, m: &str, dir: &Path) -> serde_json::Value {
    let npz = dir.join(format!("{name}.npz"));
    let html = dir.join(format!("{name}.html"));
    let mut inspected = None;
    for args in [
        vec![
            "inspect",
            "-m",
            m,
            "--text",
            "The cat sat on the mat.",
            "--json",
        ],
        vec!["faithfulness", "-m", m, "--text", "The cat sat", "--json"],
        vec!["heads", "-m", m, "--random-repeat", "10", "--json"],
        vec![
            "capture",
            "-m",
            m,
            "--text",
            "The cat",
            "--out",
            npz.to_str().unwrap(),
        ],
        vec![
            "view",
            "-m",
            m,
            "--text",
            "The cat",
            "--out",
            html.to_str().unwrap(),
        ],
        vec![
            "compare", "-m", m, "--text", "The cat", "--text", "The dog", "--json",
        ],
        vec!["info", "-m", m],
    ] {
        let out = run_ok(&args);
        if args.contains(&"--json") {
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert!(v.is_object(), "{name}: {args:?}");
            if args[0] == "inspect" {
                inspected = Some(v);
            }
        }
    }
    inspected.unwrap()
}

/// The sink section says the window hides the first token from late queries.
fn mistral_says_its_window_hides_the_first_token(m: &str) {
    let out = run_ok([
        "inspect",
        "-m",
        m,
        "--text",
        "The cat sat on the mat again and again.",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("sliding window of 8 tokens") && text.contains("cannot see the first token"),
        "{text}"
    );
}

/// Alternating windows: layer 0 slides, so query ≥ 8 cannot see the first token there; and
/// scaling says which layers grow as n · window.
fn gemma2_windows_every_other_layer(m: &str) {
    let v = run_json([
        "inspect",
        "-m",
        m,
        "--text",
        "The cat sat on the mat again and again.",
        "--json",
    ]);
    assert_eq!(v["layers"][0]["sink_query"], 0.0, "layer 0 is windowed");
    let out = run_ok(["scaling", "-m", m, "--lengths", "16,64", "--repeats", "1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("2 of 3 layers (0, 2) attend through a sliding window of 8"),
        "{text}"
    );
    assert!(
        v["layers"][1]["sink_query"].as_f64().unwrap() > 0.0,
        "layer 1 is full"
    );
}

/// Mistral: a sliding window of 8 on every layer (a query sees itself and the 7 keys before it),
/// in the materialized path (capture) and the streamed one (inspect's rows, sinks' statistics).
#[test]
fn mistral_sliding_window_matches_transformers() {
    use attnscope::analysis::collect::Collector;
    check("mistral", &|_| {});
    check("mistral", &|c| {
        let p = c["rope_parameters"].take();
        c.as_object_mut().unwrap().remove("rope_parameters");
        c["rope_theta"] = p["rope_theta"].clone();
    });
    // streamed, keys in blocks of 3 (so whole blocks before the window are skipped): the rows
    // of every query equal transformers'
    let dir = fixture_copy("mistral", &|_| {});
    let model = Model::load(dir.path().to_str().unwrap(), Precision::Exact, false).unwrap();
    assert_eq!(model.dims.sliding_window, Some(8));
    let r = golden_json("arch/mistral/reference.json");
    let ids: Vec<u32> = token_ids(&r["texts"]["long"]["token_ids"]);
    let n = ids.len();
    let (shape, want) = golden_npy("arch/mistral/attn_long.npy");
    let d = &model.dims;
    assert_eq!(shape, vec![d.n_layers, d.n_heads, n, n]);
    for q in [n - 1, 40, 5] {
        let mut c = Collector::new(d.n_layers, d.n_heads, n, q);
        let opts = RunOptions {
            logits_at: vec![q],
            key_block: 3,
            ..Default::default()
        };
        model.forward(&ids, &opts, &mut c).unwrap();
        let (mut got, mut reference) = (Vec::new(), Vec::new());
        for l in 0..d.n_layers {
            for h in 0..d.n_heads {
                let w = &want[((l * d.n_heads + h) * n + q) * n..][..n];
                got.extend(
                    c.row(l, h)
                        .iter()
                        .enumerate()
                        .map(|(j, &x)| ((l, h, j), x as f64)),
                );
                reference.extend(w.iter().enumerate().map(|(j, &x)| ((l, h, j), x as f64)));
            }
        }
        assert_cells(
            &format!("mistral streamed, query {q} [layer, head, key]"),
            got,
            reference,
            Bound::Abs(TRANSFORMERS.0),
        );
        for l in 0..d.n_layers {
            for h in 0..d.n_heads {
                let got = c.row(l, h);
                for j in 0..n {
                    if j + 8 <= q || j > q {
                        assert_eq!(got[j], 0.0, "key {j} is outside query {q}'s window");
                    }
                }
            }
        }
        // the first token is out of late queries' windows: their sink share is 0
        if q >= 8 {
            assert_eq!(c.sink_query(0), 0.0);
        }
    }
}

/// Phi-3: fused `qkv_proj` and `gate_up_proj`, and partial rotary (only the first half of each
/// head's dimensions rotate), from `rope_parameters` or a top-level `partial_rotary_factor`.
#[test]
fn phi3_matches_transformers() {
    check("phi3", &|_| {});
    check("phi3", &|c| {
        let p = c["rope_parameters"].take();
        c.as_object_mut().unwrap().remove("rope_parameters");
        c["rope_theta"] = p["rope_theta"].clone();
        c["partial_rotary_factor"] = 0.5.into();
    });
    // a factor that does not split a head into whole dimensions is refused
    let dir = fixture_copy("phi3", &|c| {
        c["rope_parameters"]["partial_rotary_factor"] = 0.3.into()
    });
    let e = load_err(dir.path());
    assert!(e.contains("partial_rotary_factor"), "{e}");
}

/// Gemma 2: (1 + w) norms before and after attention and MLP, √d embedding scale, GeLU(tanh),
/// `query_pre_attn_scalar`, attention (3.0) and final-logit (5.0) soft-capping, a window of 8 on
/// layers 0 and 2; in transformers 5's config and the hub's (no `layer_types`: alternating).
#[test]
fn gemma2_matches_transformers() {
    check("gemma2", &|_| {});
    check("gemma2", &|c| {
        let p = c["rope_parameters"].take();
        let o = c.as_object_mut().unwrap();
        o.remove("rope_parameters");
        o.remove("layer_types");
        c["rope_theta"] = p["rope_theta"].clone();
    });
}

/// Gemma 3: q/k (1 + w) norms, layers 0-1 sliding with rope base 1e4, layer 2 full with 1e6; in
/// transformers 5's nested `rope_parameters` and the hub's `rope_theta` + `rope_local_base_freq` +
/// `sliding_window_pattern`.
#[test]
fn gemma3_matches_transformers() {
    check("gemma3", &|_| {});
    check("gemma3", &|c| {
        let p = c["rope_parameters"].take();
        let o = c.as_object_mut().unwrap();
        o.remove("rope_parameters");
        o.remove("layer_types");
        o.remove("_sliding_window_pattern");
        c["rope_theta"] = p["full_attention"]["rope_theta"].clone();
        c["rope_local_base_freq"] = p["sliding_attention"]["rope_theta"].clone();
        c["sliding_window_pattern"] = 3.into();
    });
    // a sliding layer's own rope base matters: with the full layers' base everywhere it is off
    let dir = fixture_copy("gemma3", &|c| {
        c["rope_parameters"]["sliding_attention"]["rope_theta"] = 1_000_000.0.into();
    });
    let (attn, _, _) = deviation(dir.path(), "gemma3", MEASURE);
    assert!(
        attn > 1e-3,
        "the sliding layers' rope base changed nothing: {attn}"
    );
}

/// GPT-2: learned absolute positions, LayerNorm with biases, Conv1D weights stored `[in, out]`
/// (q|k|v fused in `c_attn`), biases on every projection, gelu_new MLP without gate, no RoPE.
#[test]
fn gpt2_matches_transformers() {
    check("gpt2", &|_| {});
    // another activation, or scores scaled by the layer index, are refused by name
    for (key, value) in [
        ("activation_function", serde_json::json!("relu")),
        ("scale_attn_by_inverse_layer_idx", serde_json::json!(true)),
    ] {
        let dir = fixture_copy("gpt2", &|c| c[key] = value.clone());
        let e = load_err(dir.path());
        assert!(e.contains(key), "{key}: {e}");
    }
}

/// Writes fixture `name` as llama.cpp's converter lays it out for GGUF architecture `arch`:
/// its tensor names, Gemma's norms with the `+ 1` folded in, GPT-2's Conv1D weights transposed
/// to `[out, in]` (and the tied embedding written again as `output.weight`), Phi-3's fused
/// `attn_qkv` and `ffn_up` kept fused; the config as `{arch}.*` keys. The vocabulary is a
/// placeholder (the tests pass ids).
fn fixture_gguf(
    name: &str,
    arch: &str,
    extra: &[(&str, candle_core::quantized::gguf_file::Value)],
) -> (tempfile::TempDir, std::path::PathBuf) {
    use candle_core::quantized::gguf_file::{self, Value};
    use candle_core::quantized::{GgmlDType, QTensor};
    let src = golden(&format!("arch/{name}"));
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let t =
        candle_core::safetensors::load(src.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    let gemma = arch.starts_with("gemma");
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut push = |n: String, mut w: candle_core::Tensor, norm: bool, transpose: bool| {
        if norm && gemma {
            w = (w + 1.0).unwrap();
        }
        if transpose {
            w = w.t().unwrap().contiguous().unwrap();
        }
        tensors.push((n, QTensor::quantize(&w, GgmlDType::F32).unwrap()));
    };
    for (hf, w) in &t {
        let (gg, norm, transpose) = gguf_tensor_name(name, arch, hf);
        push(gg, w.clone(), norm, transpose);
        // llama.cpp's GPT-2 converter writes the tied embedding again as the output
        if arch == "gpt2" && hf == "transformer.wte.weight" {
            push("output.weight".into(), w.clone(), false, false);
        }
    }
    let mut md = gguf_metadata(arch, &cfg);
    for (k, v) in extra {
        md.push((k.to_string(), v.clone()));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{name}.gguf"));
    let mut f = std::fs::File::create(&path).unwrap();
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
    (dir, path)
}

/// The GGUF name of the fixture's tensor `hf` for GGUF architecture `arch`, whether it is a
/// norm (Gemma's get the `+ 1`), and whether it is a Conv1D weight to transpose.
fn gguf_tensor_name(name: &str, arch: &str, hf: &str) -> (String, bool, bool) {
    let parts: Vec<&str> = hf.split('.').collect();
    match parts.as_slice() {
        ["model", "embed_tokens", "weight"] | ["transformer", "wte", "weight"] => {
            ("token_embd.weight".to_string(), false, false)
        }
        ["lm_head", "weight"] => ("output.weight".into(), false, false),
        ["model", "norm", "weight"] => ("output_norm.weight".into(), true, false),
        ["transformer", "ln_f", p] => (format!("output_norm.{p}"), false, false),
        ["transformer", "wpe", "weight"] => ("position_embd.weight".into(), false, false),
        ["model", "layers", i, rest @ ..] => {
            let (g, norm) = match (rest.join(".").as_str(), arch) {
                ("input_layernorm.weight", _) => ("attn_norm.weight", true),
                ("post_attention_layernorm.weight", "phi3") => ("ffn_norm.weight", false),
                ("post_attention_layernorm.weight", _) => ("post_attention_norm.weight", true),
                ("pre_feedforward_layernorm.weight", _) => ("ffn_norm.weight", true),
                ("post_feedforward_layernorm.weight", _) => ("post_ffw_norm.weight", true),
                ("self_attn.q_norm.weight", _) => ("attn_q_norm.weight", true),
                ("self_attn.k_norm.weight", _) => ("attn_k_norm.weight", true),
                ("self_attn.q_proj.weight", _) => ("attn_q.weight", false),
                ("self_attn.k_proj.weight", _) => ("attn_k.weight", false),
                ("self_attn.v_proj.weight", _) => ("attn_v.weight", false),
                ("self_attn.qkv_proj.weight", _) => ("attn_qkv.weight", false),
                ("self_attn.o_proj.weight", _) => ("attn_output.weight", false),
                ("mlp.gate_proj.weight", _) => ("ffn_gate.weight", false),
                ("mlp.up_proj.weight", _) => ("ffn_up.weight", false),
                ("mlp.gate_up_proj.weight", _) => ("ffn_up.weight", false),
                ("mlp.down_proj.weight", _) => ("ffn_down.weight", false),
                (other, _) => panic!("{name}: no GGUF name for {other}"),
            };
            (format!("blk.{i}.{g}"), norm, false)
        }
        ["transformer", "h", i, ln @ ("ln_1" | "ln_2"), p] => {
            let g = if *ln == "ln_1" {
                "attn_norm"
            } else {
                "ffn_norm"
            };
            (format!("blk.{i}.{g}.{p}"), false, false)
        }
        ["transformer", "h", i, a, b, p] => {
            let g = match (*a, *b) {
                ("attn", "c_attn") => "attn_qkv",
                ("attn", "c_proj") => "attn_output",
                ("mlp", "c_fc") => "ffn_up",
                ("mlp", "c_proj") => "ffn_down",
                _ => panic!("{name}: no GGUF name for {hf}"),
            };
            (format!("blk.{i}.{g}.{p}"), false, *p == "weight")
        }
        _ => panic!("{name}: no GGUF name for {hf}"),
    }
}

/// The config's `k` (or `alt`) as a GGUF u32.
fn config_u32(
    cfg: &serde_json::Value,
    k: &str,
    alt: &str,
) -> candle_core::quantized::gguf_file::Value {
    candle_core::quantized::gguf_file::Value::U32(
        cfg.get(k)
            .or(cfg.get(alt))
            .and_then(|v| v.as_u64())
            .unwrap() as u32,
    )
}

/// The fixture's config as `{arch}.*` keys, and a placeholder vocabulary.
fn gguf_metadata(
    arch: &str,
    cfg: &serde_json::Value,
) -> Vec<(String, candle_core::quantized::gguf_file::Value)> {
    use candle_core::quantized::gguf_file::Value;
    let u = |k: &str, alt: &str| config_u32(cfg, k, alt);
    let vocab = cfg["vocab_size"].as_u64().unwrap() as usize;
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (
            format!("{arch}.block_count"),
            u("num_hidden_layers", "n_layer"),
        ),
        (
            format!("{arch}.context_length"),
            u("max_position_embeddings", "n_positions"),
        ),
        (
            format!("{arch}.embedding_length"),
            u("hidden_size", "n_embd"),
        ),
        (
            format!("{arch}.attention.head_count"),
            u("num_attention_heads", "n_head"),
        ),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("gpt2".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array((0..vocab).map(|i| Value::String(format!("t{i}"))).collect()),
        ),
        ("tokenizer.ggml.merges".into(), Value::Array(Vec::new())),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(256)),
    ];
    if arch == "gpt2" {
        md.push((
            format!("{arch}.feed_forward_length"),
            Value::U32(4 * cfg["n_embd"].as_u64().unwrap() as u32),
        ));
        md.push((
            format!("{arch}.attention.layer_norm_epsilon"),
            Value::F32(cfg["layer_norm_epsilon"].as_f64().unwrap() as f32),
        ));
    } else {
        md.extend(rms_norm_family_keys(arch, cfg));
    }
    if let Some(w) = cfg.get("sliding_window").and_then(|v| v.as_u64()) {
        md.push((
            format!("{arch}.attention.sliding_window"),
            Value::U32(w as u32),
        ));
    }
    for k in ["attn_logit_softcapping", "final_logit_softcapping"] {
        if let Some(x) = cfg.get(k).and_then(|v| v.as_f64()) {
            md.push((format!("{arch}.{k}"), Value::F32(x as f32)));
        }
    }
    md
}

/// The keys of the families with RMS norms (all but GPT-2): the MLP's width, the key/value heads
/// and their widths, the norms' epsilon and RoPE's base.
fn rms_norm_family_keys(
    arch: &str,
    cfg: &serde_json::Value,
) -> Vec<(String, candle_core::quantized::gguf_file::Value)> {
    use candle_core::quantized::gguf_file::Value;
    let u = |k: &str, alt: &str| config_u32(cfg, k, alt);
    let mut keys = Vec::new();
    keys.push((
        format!("{arch}.feed_forward_length"),
        u("intermediate_size", ""),
    ));
    keys.push((
        format!("{arch}.attention.head_count_kv"),
        u("num_key_value_heads", ""),
    ));
    let hd = cfg["head_dim"].as_u64().unwrap_or(
        cfg["hidden_size"].as_u64().unwrap() / cfg["num_attention_heads"].as_u64().unwrap(),
    ) as u32;
    keys.push((format!("{arch}.attention.key_length"), Value::U32(hd)));
    keys.push((format!("{arch}.attention.value_length"), Value::U32(hd)));
    keys.push((
        format!("{arch}.attention.layer_norm_rms_epsilon"),
        Value::F32(cfg["rms_norm_eps"].as_f64().unwrap() as f32),
    ));
    let theta = cfg["rope_parameters"]["rope_theta"]
        .as_f64()
        .or(cfg["rope_parameters"]["full_attention"]["rope_theta"].as_f64())
        .unwrap();
    keys.push((format!("{arch}.rope.freq_base"), Value::F32(theta as f32)));
    keys
}

fn check_gguf(
    name: &str,
    arch: &str,
    extra: &[(&str, candle_core::quantized::gguf_file::Value)],
) -> Model {
    let (_dir, path) = fixture_gguf(name, arch, extra);
    let model = Model::load(path.to_str().unwrap(), Precision::Exact, false)
        .unwrap_or_else(|e| panic!("{name} GGUF: {e}"));
    assert_eq!(model.info.format, "gguf");
    let (attn, logits, next) = model_deviation(&model, name, false, TRANSFORMERS);
    eprintln!("{name} GGUF ({arch} layout): max |attention - transformers| {attn:.2e}, max |logit - transformers| {logits:.2e}");
    assert!(
        attn <= TRANSFORMERS.0 && logits <= TRANSFORMERS.1,
        "{name} GGUF: {attn:.2e} / {logits:.2e}"
    );
    assert!(next.iter().all(|(a, b)| a == b), "{name} GGUF: next token");
    model
}

/// Gemma 2 and 3, Phi-3 and GPT-2 in llama.cpp's GGUF layouts, written by the test from the same
/// fixtures: the same numbers as transformers. Gemma's norms carry the `+ 1` in the file; the
/// gemma2 fixture's query_pre_attn_scalar (24 ≠ head_dim) is given as `attention.scale`, and the
/// gemma3 fixture's 3-layer pattern as `attention.sliding_window_pattern`; without them the
/// numbers move (so both keys are read).
#[test]
fn gemma_phi3_gpt2_ggufs_match_transformers() {
    use candle_core::quantized::gguf_file::Value;
    let scale = Value::F32((24f64).powf(-0.5) as f32);
    let m = check_gguf("gemma2", "gemma2", &[("gemma2.attention.scale", scale)]);
    let g = m.dims.gemma.as_ref().unwrap();
    assert_eq!(g.sliding_layers, vec![true, false, true]);
    assert_eq!((g.attn_softcap, g.final_softcap), (Some(3.0), Some(5.0)));
    let m = check_gguf(
        "gemma3",
        "gemma3",
        &[("gemma3.attention.sliding_window_pattern", Value::U32(3))],
    );
    assert_eq!(
        m.dims.gemma.as_ref().unwrap().sliding_layers,
        vec![true, true, false]
    );
    // the same as one flag per layer
    check_gguf(
        "gemma3",
        "gemma3",
        &[(
            "gemma3.attention.sliding_window_pattern",
            Value::Array(vec![
                Value::Bool(true),
                Value::Bool(true),
                Value::Bool(false),
            ]),
        )],
    );
    let m = check_gguf(
        "phi3",
        "phi3",
        &[("phi3.rope.dimension_count", Value::U32(8))],
    );
    assert_eq!(m.dims.rotary_dim, 8);
    check_gguf("gpt2", "gpt2", &[]);
    numbers_move_without_the_keys_the_fixtures_need();
    a_bad_fused_qkv_or_a_missing_window_is_refused_by_key();
}

/// Without the keys the fixtures need, the numbers move: they are really read.
fn numbers_move_without_the_keys_the_fixtures_need() {
    for (name, arch, extra) in [
        ("gemma2", "gemma2", vec![]),
        ("gemma3", "gemma3", vec![]),
        ("phi3", "phi3", vec![]),
    ] {
        let (_d, path) = fixture_gguf(name, arch, &extra);
        match Model::load(path.to_str().unwrap(), Precision::Exact, false) {
            Ok(model) => {
                let (attn, _, _) = model_deviation(&model, name, false, MEASURE);
                assert!(
                    attn > 1e-3,
                    "{name}: without the key the numbers did not move ({attn:.2e})"
                );
            }
            Err(e) => panic!("{name}: {e}"),
        }
    }
}

/// A fused q|k|v whose rows do not add up to what the heads say is refused, naming it; a Gemma
/// GGUF without its window is refused by key.
fn a_bad_fused_qkv_or_a_missing_window_is_refused_by_key() {
    let (_d, path) = fixture_gguf("phi3", "phi3", &[]);
    let mut bytes = std::fs::read(&path).unwrap();
    let key = b"phi3.attention.head_count_kv";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    assert_eq!(bytes[at..at + 8], [4, 0, 0, 0, 2, 0, 0, 0], "a u32 of 2");
    bytes[at + 4] = 1;
    let e = match Model::from_gguf_bytes("phi3.gguf", bytes, Precision::Exact) {
        Ok(_) => panic!("a fused tensor of the wrong size loaded"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("blk.0.attn_qkv.weight") && e.contains("[96, 64]"),
        "{e}"
    );
    // a Gemma GGUF without its window, and a llama GGUF with a pattern, are refused by key
    let (_d, path) = fixture_gguf("gemma2", "gemma2", &[]);
    let mut bytes = std::fs::read(&path).unwrap();
    let key = b"gemma2.attention.sliding_window";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap();
    bytes[at..at + key.len()].copy_from_slice(b"gemma2.attention.sliding_wXndow");
    let e = match Model::from_gguf_bytes("nowindow.gguf", bytes, Precision::Exact) {
        Ok(_) => panic!("a Gemma 2 GGUF without a window loaded"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("gemma2.attention.sliding_window"), "{e}");
}
