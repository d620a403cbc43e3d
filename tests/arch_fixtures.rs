//! Tiny checkpoints of more families (tests/golden/arch, from ../shared/reference/arch: Hugging
//! Face folders written by transformers 5.24 with every attention weight it computes on two texts
//! and the last logits): each supported family matches within 2e-5 (attention) and 5e-5 (logits),
//! in both config styles; what attnscope does not implement is refused by name. The same
//! fixtures as GGUF files (tests/golden/arch/gguf) were written by gguf-py, llama.cpp's writer, as
//! llama.cpp's converter lays each family out (tests/golden/arch/make_gguf_fixtures.py), and
//! match transformers the same way.
#![allow(clippy::needless_range_loop)]

mod common;
use attnscope::model::capture::{AttnCache, CaptureSpec, Hook, Observer, PatternRows, Queries};
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
        let argmax = attnscope::analysis::vocab::max_argmax(&out.logits[0]).1 as u64;
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

/// The commands run on the new families (through the binary): inspect, faithfulness, heads,
/// capture, view and compare.
#[test]
fn commands_run_on_every_fixture() {
    let dir = tempfile::tempdir().unwrap();
    for name in [
        "llama3", "qwen3", "mistral", "phi3", "gemma", "gemma2", "gemma3", "gpt2", "seed_oss",
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
            if ["qwen3", "gemma", "seed_oss"].contains(&name) {
                24
            } else {
                16
            }
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

/// Gemma (v1): (1 + w) norms before attention and MLP only, √d embedding scale, GeLU(tanh),
/// multi-query attention (4 heads, 1 key/value head) of head_dim 24 (4 × 24 ≠ d_model 64),
/// weights N(0, 0.1²) (at 0.25, without Gemma 2's soft-caps, transformers' own float32 is 6e-5
/// from its float64),
/// scaled by head_dim^-½, no soft-caps, no window; in transformers 5's config and the hub's
/// (`rope_theta`, the first releases' legacy `hidden_act: gelu`, read as gelu_pytorch_tanh).
/// Another activation and a window are refused by name.
#[test]
fn gemma_matches_transformers() {
    check("gemma", &|_| {});
    check("gemma", &|c| {
        let p = c["rope_parameters"].take();
        c.as_object_mut().unwrap().remove("rope_parameters");
        c["rope_theta"] = p["rope_theta"].clone();
        c["hidden_act"] = "gelu".into();
        c["hidden_activation"] = "gelu_pytorch_tanh".into();
    });
    for (key, value) in [
        ("hidden_act", serde_json::json!("silu")),
        ("hidden_activation", serde_json::json!("gelu")),
        ("sliding_window", serde_json::json!(8)),
        ("use_bidirectional_attention", serde_json::json!(true)),
    ] {
        let dir = fixture_copy("gemma", &|c| c[key] = value.clone());
        let e = load_err(dir.path());
        assert!(e.contains(key), "{key}: {e}");
    }
    // Gemma's conventions matter on this fixture: the same tensors read as Llama's (w norms,
    // no √d scale, SwiGLU) are far off
    let dir = fixture_copy("gemma", &|c| {
        c["model_type"] = "llama".into();
        c["hidden_act"] = "silu".into();
    });
    let (attn, _, _) = deviation(dir.path(), "gemma", MEASURE);
    assert!(attn > 1e-2, "Gemma's conventions changed nothing: {attn}");
}

/// Seed-OSS: Llama's blocks with q/k/v biases (N(0, 0.1²) here), grouped-query attention (4
/// heads, 2 key/value heads) of head_dim 24 (4 × 24 ≠ d_model 64), an untied output head, the
/// released model's dropouts (0.1: nothing at inference); in transformers 5's config and the
/// hub's (`rope_theta` + `rope_scaling: {"rope_type": "default"}`, as Seed-OSS-36B's). An o_proj
/// or MLP bias, another activation and a window are refused by name (the binary exits 2).
#[test]
fn seed_oss_matches_transformers() {
    check("seed_oss", &|_| {});
    check("seed_oss", &|c| {
        let p = c["rope_parameters"].take();
        c.as_object_mut().unwrap().remove("rope_parameters");
        c["rope_theta"] = p["rope_theta"].clone();
        c["rope_scaling"] = serde_json::json!({"rope_type": "default"});
    });
    for (key, value) in [
        ("attention_out_bias", serde_json::json!(true)),
        ("mlp_bias", serde_json::json!(true)),
        ("hidden_act", serde_json::json!("gelu")),
        ("sliding_window", serde_json::json!(8)),
    ] {
        let dir = fixture_copy("seed_oss", &|c| c[key] = value.clone());
        let e = load_err(dir.path());
        assert!(
            e.contains(key) && e.contains("does not implement"),
            "{key}: {e}"
        );
    }
    let dir = fixture_copy("seed_oss", &|c| c["mlp_bias"] = true.into());
    let m = dir.path().to_str().unwrap();
    let e = run_err(["inspect", "--model", m, "--text", "The cat"], 2);
    assert!(e.contains("`mlp_bias`"), "{e}");
    // q/k/v biases in the file that transformers would not apply (attention_bias false; a
    // Llama's default; Mistral never): refused by name, never added silently
    for edit in [
        &(|c: &mut serde_json::Value| c["attention_bias"] = false.into()) as &dyn Fn(&mut _),
        &|c: &mut serde_json::Value| {
            c.as_object_mut().unwrap().remove("attention_bias");
            c["model_type"] = "llama".into();
            c["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
        },
        &|c: &mut serde_json::Value| {
            c["model_type"] = "mistral".into();
            c["architectures"] = serde_json::json!(["MistralForCausalLM"]);
        },
    ] {
        let dir = fixture_copy("seed_oss", edit);
        let e = load_err(dir.path());
        assert!(
            e.contains("attention_bias") && e.contains("q_proj.bias"),
            "{e}"
        );
    }
    // Seed-OSS's default is true (SeedOssConfig): without the key, its biases are read
    check("seed_oss", &|c| {
        c.as_object_mut().unwrap().remove("attention_bias");
    });
    seed_oss_reads_its_qkv_biases();
}

/// The q/k/v biases are read: the same folder without them is far off.
fn seed_oss_reads_its_qkv_biases() {
    let dir = fixture_copy("seed_oss", &|_| {});
    let st = dir.path().join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&st, &candle_core::Device::Cpu).unwrap();
    let before = tensors.len();
    tensors.retain(|n, _| !n.ends_with("_proj.bias"));
    assert_eq!(before - tensors.len(), 9, "3 layers' q, k and v biases");
    candle_core::safetensors::save(&tensors, &st).unwrap();
    let (attn, _, _) = deviation(dir.path(), "seed_oss", MEASURE);
    eprintln!("seed_oss without its q/k/v biases: attention off by {attn:.2e}");
    assert!(attn > 1e-2, "the q/k/v biases changed nothing: {attn}");
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

/// The committed GGUF of fixture `name` (`tests/golden/arch/gguf`): written by
/// `tests/golden/arch/make_gguf_fixtures.py` with gguf-py, llama.cpp's own writer, its tensor
/// names from gguf-py's `TensorNameMap` and its metadata and tensor steps those of llama.cpp's
/// converter, so nothing in the file is attnscope's idea of the layout.
fn gguf_fixture(name: &str) -> std::path::PathBuf {
    golden(&format!("arch/gguf/{name}.gguf"))
}

/// A GGUF's metadata and tensors, as an edit of [`edited_gguf`] sees them.
type GgufParts = (
    Vec<(String, candle_core::quantized::gguf_file::Value)>,
    Vec<(String, candle_core::quantized::QTensor)>,
);

/// An edit of a GGUF's parts, for [`edited_gguf`].
type GgufEdit = Box<dyn Fn(&mut GgufParts)>;

/// A copy of fixture `name`'s GGUF after `edit` (read and written back by candle's GGUF reader
/// and writer, which keep every key and tensor as they are: the layout stays gguf-py's).
fn edited_gguf(
    name: &str,
    edit: &dyn Fn(&mut GgufParts),
) -> (tempfile::TempDir, std::path::PathBuf) {
    use candle_core::quantized::gguf_file::{self, Content, Value};
    let mut f = std::fs::File::open(gguf_fixture(name)).unwrap();
    let content = Content::read(&mut f).unwrap();
    let mut md: Vec<(String, Value)> = content.metadata.clone().into_iter().collect();
    md.sort_by(|a, b| a.0.cmp(&b.0));
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let tensors = names
        .into_iter()
        .map(|n| {
            let t = content.tensor(&mut f, n, &candle_core::Device::Cpu);
            (n.clone(), t.unwrap())
        })
        .collect();
    let mut parts = (md, tensors);
    edit(&mut parts);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{name}.gguf"));
    let mut out = std::fs::File::create(&path).unwrap();
    let md_refs: Vec<(&str, &Value)> = parts.0.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<_> = parts.1.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut out, &md_refs, &t_refs).unwrap();
    (dir, path)
}

/// `edited_gguf`'s edit that drops metadata key `key` (which must be there).
fn without_key(key: &'static str) -> impl Fn(&mut GgufParts) {
    move |(md, _)| {
        let before = md.len();
        md.retain(|(k, _)| k != key);
        assert_eq!(md.len() + 1, before, "{key} is in the fixture");
    }
}

/// `edited_gguf`'s edit that sets metadata key `key` to `value`.
fn with_key(
    key: &'static str,
    value: candle_core::quantized::gguf_file::Value,
) -> impl Fn(&mut GgufParts) {
    move |(md, _)| {
        md.retain(|(k, _)| k != key);
        md.push((key.to_string(), value.clone()));
    }
}

fn gguf_load(path: &Path) -> std::result::Result<Model, String> {
    Model::load(path.to_str().unwrap(), Precision::Exact, false).map_err(|e| e.to_string())
}

/// Loads the GGUF at `path` and compares it with transformers on fixture `name`'s texts: the
/// token ids its vocabulary gives, every attention weight (2e-5), the logits (5e-5), the next token.
fn check_gguf(name: &str, path: &Path) -> Model {
    let model = gguf_load(path).unwrap_or_else(|e| panic!("{name} GGUF: {e}"));
    assert_eq!(model.info.format, "gguf");
    let (attn, logits, next) = model_deviation(&model, name, true, TRANSFORMERS);
    eprintln!("{name} GGUF (gguf-py): max |attention - transformers| {attn:.2e}, max |logit - transformers| {logits:.2e}");
    assert!(
        attn <= TRANSFORMERS.0 && logits <= TRANSFORMERS.1,
        "{name} GGUF: {attn:.2e} / {logits:.2e}"
    );
    assert!(next.iter().all(|(a, b)| a == b), "{name} GGUF: next token");
    model
}

/// Every decoder family in llama.cpp's GGUF layout as gguf-py writes it: Llama 3 (q/k rows
/// permuted to interleaved pairs, `rope_freqs.weight`), Qwen3 (`attn_q_norm`/`attn_k_norm`),
/// Gemma 2 and 3 (norms holding the `+ 1`, soft-caps, windows, `attention.scale`, a per-layer
/// `sliding_window_pattern`), Phi-3 (fused `attn_qkv` and `ffn_up`, 8 of 16 dimensions rotating,
/// the converter's window 0 for none), GPT-2 (Conv1D weights transposed, `position_embd`, no
/// output tensor), Seed-OSS (q/k/v biases, the MLP's norm as `post_attention_norm`): the token ids, every attention weight and the logits of transformers.
#[test]
fn ggufs_written_by_gguf_py_match_transformers() {
    use attnscope::model::Arch;
    for (name, arch) in [
        ("llama3", Arch::Llama),
        ("qwen3", Arch::Qwen3),
        ("gemma2", Arch::Gemma2),
        ("gemma3", Arch::Gemma3),
        ("phi3", Arch::Phi3),
        ("gpt2", Arch::Gpt2),
        ("seed_oss", Arch::SeedOss),
    ] {
        let m = check_gguf(name, &gguf_fixture(name));
        assert_eq!(m.dims.arch, arch, "{name}");
        match name {
            "qwen3" | "seed_oss" => assert_eq!(m.dims.head_dim, 24),
            "gemma2" | "gemma3" => {
                let g = m.dims.gemma.as_ref().unwrap();
                let (layers, caps) = if name == "gemma2" {
                    (vec![true, false, true], (Some(3.0), Some(5.0)))
                } else {
                    (vec![true, true, false], (None, None))
                };
                assert_eq!(g.sliding_layers, layers, "{name}");
                assert_eq!((g.attn_softcap, g.final_softcap), caps, "{name}");
            }
            "phi3" => {
                assert_eq!(m.dims.rotary_dim, 8);
                assert_eq!(m.dims.sliding_window, None, "window 0 is none");
            }
            _ => {}
        }
    }
}

/// What the fixtures' files hold is really read: without Llama 3's `rope_freqs.weight`, Gemma 2's
/// `attention.scale`, Gemma 3's pattern or Phi-3's `rope.dimension_count` the attention moves;
/// Gemma 3's pattern as a number (every 3rd layer full) gives the flags' numbers.
#[test]
fn gguf_keys_and_tensors_are_read() {
    use candle_core::quantized::gguf_file::Value;
    let drop_rope_freqs = |(_, t): &mut GgufParts| t.retain(|(n, _)| n != "rope_freqs.weight");
    for (name, far) in [
        ("llama3", 0.1),
        ("gemma2", 1e-3),
        ("gemma3", 1e-3),
        ("phi3", 1e-3),
    ] {
        let edit: GgufEdit = match name {
            "llama3" => Box::new(drop_rope_freqs),
            "gemma2" => Box::new(without_key("gemma2.attention.scale")),
            "gemma3" => Box::new(without_key("gemma3.attention.sliding_window_pattern")),
            _ => Box::new(without_key("phi3.rope.dimension_count")),
        };
        let (_d, path) = edited_gguf(name, &*edit);
        let model = gguf_load(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
        let (attn, _, _) = model_deviation(&model, name, false, MEASURE);
        eprintln!("{name} GGUF without what it needs: attention off by {attn:.2e}");
        assert!(
            attn > far,
            "{name}: the edit did not move the numbers ({attn:.2e})"
        );
    }
    let pattern = with_key("gemma3.attention.sliding_window_pattern", Value::U32(3));
    let (_d, path) = edited_gguf("gemma3", &pattern);
    check_gguf("gemma3", &path);
}

/// A fused q|k|v whose rows do not add up to what the heads say, a Gemma GGUF without its window
/// or with a window of 0 keys, and a byte-level vocabulary with longer tokens but no merges are
/// refused, each naming the tensor or key.
#[test]
fn gguf_fixtures_with_a_wrong_key_are_refused_by_name() {
    use candle_core::quantized::gguf_file::Value;
    let cases: [(&str, GgufEdit, &[&str]); 4] = [
        (
            "phi3",
            Box::new(with_key("phi3.attention.head_count_kv", Value::U32(1))),
            &["blk.0.attn_qkv.weight", "[96, 64]"],
        ),
        (
            "gemma2",
            Box::new(without_key("gemma2.attention.sliding_window")),
            &["gemma2.attention.sliding_window"],
        ),
        (
            "gemma2",
            Box::new(with_key("gemma2.attention.sliding_window", Value::U32(0))),
            &["gemma2.attention.sliding_window", "a window of 0 keys"],
        ),
        (
            "gpt2",
            Box::new(two_symbol_token),
            &["tokenizer.ggml.merges"],
        ),
    ];
    for (name, edit, want) in cases {
        let (_d, path) = edited_gguf(name, &*edit);
        let e = match gguf_load(&path) {
            Ok(_) => panic!("{name}: the edited GGUF loaded"),
            Err(e) => e,
        };
        assert!(want.iter().all(|w| e.contains(w)), "{name}: {e}");
    }
}

/// Token 65 (`A`) spelled `AB`: a vocabulary that would need merges, without the key.
fn two_symbol_token((md, _): &mut GgufParts) {
    use candle_core::quantized::gguf_file::Value;
    let (_, tokens) = md
        .iter_mut()
        .find(|(k, _)| k == "tokenizer.ggml.tokens")
        .unwrap();
    let Value::Array(tokens) = tokens else {
        panic!("tokenizer.ggml.tokens is an array")
    };
    tokens[65] = Value::String("AB".into());
}

/// The fixtures (`tests/golden/arch/NAME`) whose hooks
/// [`hooks_come_in_the_forwards_order_and_capture_all_writes_them`] checks, beside a tiny Qwen2.
const HOOKED: [&str; 12] = [
    "llama3",
    "qwen3",
    "mistral",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3",
    "gpt2",
    "seed_oss",
    "bert",
    "roberta",
    "distilbert",
];

/// An observer that keeps everything and notes the order the forward hands each tensor out in
/// (its first block of rows).
struct HandOrder {
    cache: AttnCache,
    seen: Vec<(usize, Hook)>,
}

impl HandOrder {
    fn saw(&mut self, layer: usize, hook: Hook) {
        if !self.seen.contains(&(layer, hook)) {
            self.seen.push((layer, hook));
        }
    }
}

impl Observer for HandOrder {
    attnscope::delegate_observer!(cache: wants);
    fn tensor(&mut self, layer: usize, hook: Hook, shape: &[usize], data: &[f32]) {
        self.saw(layer, hook);
        self.cache.tensor(layer, hook, shape, data)
    }
    fn attention_block(&mut self, l: usize, h: Hook, q0: usize, shape: [usize; 3], d: &[f32]) {
        self.saw(l, h);
        self.cache.attention_block(l, h, q0, shape, d)
    }
    fn pattern_rows(
        &mut self,
        layer: usize,
        q_start: usize,
        rows: usize,
        n_heads: usize,
        k_len: usize,
    ) -> Option<PatternRows<'_>> {
        self.saw(layer, Hook::Pattern);
        self.cache
            .pattern_rows(layer, q_start, rows, n_heads, k_len)
    }
}

/// Every family's forward hands its hooks out in [`Hook::in_forward_order`]'s order, the order
/// `capture` declares a file's tensors in; and `capture --hooks all` to safetensors writes every
/// one of them (a post-norm encoder's order stopped the write with "you likely have a bug"),
/// each of the plan's shape and bit for bit the forward's. A new family whose forward hands its
/// hooks out otherwise fails here.
#[test]
fn hooks_come_in_the_forwards_order_and_capture_all_writes_them() {
    let dir = tempfile::tempdir().unwrap();
    let qwen2 = common::tiny_gguf(&dir);
    let mut names: Vec<String> = HOOKED
        .iter()
        .map(|n| golden(&format!("arch/{n}")).to_str().unwrap().to_string())
        .collect();
    names.push(qwen2.to_str().unwrap().to_string());
    let spec = CaptureSpec {
        hooks: Hook::parse_list("all").unwrap(),
        layers: None,
        heads: None,
        queries: Queries::All,
    };
    for m in &names {
        let model = Model::load(m, Precision::Exact, false).unwrap();
        let tokens = model.encode("The cat sat", false).unwrap();
        let mut obs = HandOrder {
            cache: AttnCache::new(&spec, tokens.len()),
            seen: Vec::new(),
        };
        model
            .forward(&tokens, &RunOptions::default(), &mut obs)
            .unwrap();
        // the two attention maps come together, both final when the attention is done (the
        // kernel asks for the pattern's rows before it hands the scores): either order streams
        let mut seen = obs.seen.clone();
        for i in 1..seen.len() {
            if seen[i].1 == Hook::AttnScores && seen[i - 1] == (seen[i].0, Hook::Pattern) {
                seen.swap(i - 1, i);
            }
        }
        assert_eq!(seen, spec.keys(&model.dims), "{m}: the forward's order");
        let out = dir.path().join("all.safetensors");
        let o = run_ok([
            "capture",
            "-m",
            m,
            "--hooks",
            "all",
            "--text",
            "The cat sat",
            "--force",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success());
        let got = common::read_safetensors(&std::fs::read(&out).unwrap());
        let plan = spec.tensors(&model.dims, tokens.len());
        assert_eq!(
            got.len(),
            plan.len(),
            "{m}: {:?}",
            got.keys().collect::<Vec<_>>()
        );
        for (name, shape) in plan {
            let (s, data) = got
                .get(&name)
                .unwrap_or_else(|| panic!("{m}: {name} missing"));
            assert_eq!(s, &shape, "{m}: {name}");
            assert!(data.iter().all(|v| !v.is_nan()), "{m}: {name} has NaN");
        }
        for c in obs.cache.iter() {
            let same = got[&c.name]
                .1
                .iter()
                .zip(&c.data)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{m}: {} differs from the forward's", c.name);
        }
    }
}
