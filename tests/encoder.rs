//! Encoders (issue #41): BERT from a Hugging Face folder against transformers (BertModel, eager,
//! float32). The real model is all-MiniLM-L6-v2 (`all-minilm-l6-v2`, fetched by the alias); the
//! tiny random BERT in tests/golden/arch/bert is checked the same way. Goldens:
//! tests/golden/minilm_encoder.json, minilm_encoder_attn_*.npy and arch/bert, made by
//! tests/golden/make_encoder_golden.py (see tests/golden/README.md).
#![allow(clippy::needless_range_loop)]

mod common;
use attnscope::analysis::attribute::{attribute, AttributeOptions};
use attnscope::analysis::enc_target::EncoderTarget;
use attnscope::analysis::encoder::{inspect, is_punctuation};
use attnscope::analysis::vocab::Method;
use attnscope::analysis::vocab::Target;
use attnscope::model::attention::{attention, AttnDims};
use attnscope::model::capture::{AttnCache, CaptureSpec, NoCapture};
use attnscope::model::forward::RunOptions;
use attnscope::model::{Error, Model, Precision};
use attnscope::reference::{grouped_query_attention_f64, heads_to_rows};
use common::{
    assert_array, assert_close, attnscope, fails_with, golden, golden_json, golden_npy, real_model,
    run_err, run_json, succeeds, Bound,
};

/// Sentence embeddings against sentence-transformers' (measured at most 8.9e-7).
const EMBED: f32 = 5e-6;
/// Occlusion scores (1 − cosine) against sentence-transformers' deletions (measured 1.2e-7).
const OCCLUSION: f32 = 1e-6;

fn ids_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// The case's tokens as attnscope makes them, and their types: a pair, or one text (types all 0).
fn tokens_of(model: &Model, case: &serde_json::Value) -> (Vec<u32>, Vec<u32>) {
    let text = case["text"].as_str().unwrap();
    match case["pair"].as_str() {
        Some(b) => model.encode_pair(text, b).unwrap(),
        None => {
            let ids = model.encode(text, false).unwrap();
            let n = ids.len();
            (ids, vec![0; n])
        }
    }
}

/// How close an encoder's numbers must be to transformers': every attention weight, and the
/// hidden states (the mean-pooled last hidden state, the pooler output, the first token's).
/// The special-token shares are within [`SHARES`] on every model.
#[derive(Clone, Copy)]
struct Bounds {
    attention: f64,
    states: f64,
}

/// README.md, docs/models.md: all-MiniLM-L6-v2's every weight "within 1.6e-6", its states
/// measured at most 7.2e-7 here.
const MINILM: Bounds = Bounds {
    attention: 5e-6,
    states: 5e-6,
};
/// The tiny random fixtures (weights of N(0, 0.3²) make sharper scores and larger states):
/// measured at most 7.1e-6 (attention) and 5.4e-5 (the tiny BERT's pooler).
const TINY: Bounds = Bounds {
    attention: 2e-5,
    states: 2e-4,
};
/// The [CLS]/[SEP]/punctuation shares per layer (measured at most 2.7e-7).
const SHARES: f32 = 2e-6;

/// Every golden layer's attention, the token ids and types, the special-token shares, the
/// mean-pooled last hidden state and the pooler output of each case, within `bounds`; returns
/// the worst attention difference.
fn check_cases(
    model: &Model,
    cases: &serde_json::Value,
    npy: &dyn Fn(&str) -> String,
    bounds: Bounds,
) -> f64 {
    let mut worst = 0f64;
    for (name, case) in cases.as_object().unwrap() {
        let label = |what: &str| format!("{name}: {what}");
        let (tokens, types) = tokens_of(model, case);
        assert_eq!(tokens, ids_of(&case["token_ids"]), "{}", label("token ids"));
        assert_eq!(
            types,
            ids_of(&case["token_types"]),
            "{}",
            label("token types")
        );
        let n = tokens.len();
        let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
        let opts = RunOptions {
            token_types: case["pair"].is_string().then(|| types.clone()),
            ..Default::default()
        };
        let out = model.forward(&tokens, &opts, &mut cache).unwrap();
        assert!(out.logits.is_empty(), "an encoder has no logits");
        let layers = ids_of(&case["attn_layers"]);
        let (shape, want) = golden_npy(&npy(name));
        assert_eq!(
            shape,
            vec![layers.len(), model.dims.n_heads, n, n],
            "{}",
            label("golden shape")
        );
        let got: Vec<f32> = layers
            .iter()
            .flat_map(|&l| cache.pattern(l as usize).unwrap().data.to_vec())
            .collect();
        let d = assert_array(
            &label("attention [listed layer, head, query, key]"),
            &shape,
            &got,
            &want,
            Bound::Abs(bounds.attention),
        );
        worst = worst.max(d);
        let typed = case["pair"].is_string().then_some(types.as_slice());
        inspect_has_the_shares_and_the_rows(model, (&tokens, &types), typed, case, &cache, name);
        let emb = model.embed_tokens_typed(&tokens, typed).unwrap();
        assert_close(
            &emb,
            &floats(&case["mean_pooled"]),
            bounds.states as f32,
            &label("mean pooled"),
        );
        if let Some(p) = case["pooler_output"].as_array() {
            let got = model
                .pooler_output(&tokens, typed)
                .unwrap()
                .expect("a pooler");
            let want: Vec<f32> = p.iter().map(|x| x.as_f64().unwrap() as f32).collect();
            assert_close(&got, &want, bounds.states as f32, &label("pooler"));
        }
    }
    worst
}

/// `inspect`'s report of a case: the tokenizer's types, the special-token shares within
/// [`SHARES`] of the golden's, and each last-layer head's top weight from the captured [CLS] row.
fn inspect_has_the_shares_and_the_rows(
    model: &Model,
    (tokens, types): (&[u32], &[u32]),
    typed: Option<&[u32]>,
    case: &serde_json::Value,
    cache: &AttnCache,
    name: &str,
) {
    let label = |what: &str| format!("{name}: {what}");
    let heads: Vec<usize> = (0..model.dims.n_heads).collect();
    let r = inspect(model, tokens, typed, 0, model.dims.n_layers - 1, &heads, 3).unwrap();
    assert_eq!(
        r.token_types,
        types,
        "{}",
        label("the report's token types")
    );
    for (key, got) in [
        ("cls_share", &r.special_shares.cls),
        ("sep_share", &r.special_shares.sep),
        ("punct_share", &r.special_shares.punct),
    ] {
        assert_close(got, &floats(&case[key]), SHARES, &label(key));
    }
    // the per-head row of [CLS] in the last layer is the captured pattern's
    let last = cache.pattern(model.dims.n_layers - 1).unwrap();
    for h in &r.heads {
        let row = last.row_at(h.head, 0).expect("the [CLS] row");
        assert_eq!(h.top[0].weight, analysis_max(row), "{}", label("head top"));
    }
}

fn analysis_max(row: &[f32]) -> f32 {
    row.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

#[test]
fn minilm_matches_transformers_on_texts_and_a_pair() {
    let model = real_model("all-minilm-l6-v2");
    assert!(model.is_encoder());
    let g = golden_json("minilm_encoder.json");
    let worst = check_cases(
        model,
        &g["cases"],
        &|name| format!("minilm_encoder_attn_{name}.npy"),
        MINILM,
    );
    eprintln!("all-MiniLM-L6-v2: largest attention difference from transformers {worst:.2e}");
}

#[test]
fn tiny_bert_fixture_matches_transformers() {
    let dir = golden("arch/bert");
    let model = Model::load(dir.to_str().unwrap(), Precision::Exact, false).unwrap();
    assert_eq!(model.dims.n_layers, 2);
    let r = golden_json("arch/bert/reference.json");
    let worst = check_cases(
        &model,
        &r["cases"],
        &|name| format!("arch/bert/attn_{name}.npy"),
        TINY,
    );
    // the last hidden state's [CLS] row
    for (name, case) in r["cases"].as_object().unwrap() {
        let (tokens, types) = tokens_of(&model, case);
        let h = model.encoder_states_typed(&tokens, Some(&types)).unwrap();
        assert_close(
            &h[..model.dims.d_model],
            &floats(&case["cls_hidden"]),
            TINY.states as f32,
            &format!("{name}: [CLS] hidden"),
        );
    }
    eprintln!("tiny BERT: largest attention difference {worst:.2e}");
}

/// The tiny RoBERTa (saved from `RobertaForMaskedLM`: `roberta.` prefix and an `lm_head`) and
/// DistilBERT (`DistilBertForSequenceClassification`: `distilbert.` prefix, classifier) against
/// transformers' base models, single texts and pairs.
#[test]
fn tiny_roberta_and_distilbert_fixtures_match_transformers() {
    for (name, arch, pair_len) in [("roberta", "roberta", 17), ("distilbert", "distilbert", 18)] {
        let dir = golden(&format!("arch/{name}"));
        let model = Model::load(dir.to_str().unwrap(), Precision::Exact, false).unwrap();
        assert_eq!(model.dims.arch.name(), arch);
        assert!(model.is_encoder());
        let r = golden_json(&format!("arch/{name}/reference.json"));
        assert_eq!(
            r["cases"]["pair"]["token_ids"].as_array().unwrap().len(),
            pair_len
        );
        let worst = check_cases(
            &model,
            &r["cases"],
            &|case| format!("arch/{name}/attn_{case}.npy"),
            TINY,
        );
        for (case_name, case) in r["cases"].as_object().unwrap() {
            let (tokens, types) = tokens_of(&model, case);
            assert!(types.iter().all(|&t| t == 0), "{name}: no type 1");
            let h = model.encoder_states_typed(&tokens, Some(&types)).unwrap();
            assert_close(
                &h[..model.dims.d_model],
                &floats(&case["cls_hidden"]),
                TINY.states as f32,
                &format!("{name} {case_name}: first hidden"),
            );
            assert!(model.pooler_output(&tokens, None).unwrap().is_none());
        }
        eprintln!("tiny {name}: largest attention difference {worst:.2e}");
    }
    // RoBERTa: 40 positions after padding_idx 1 + 1; its pair is <s> A </s></s> B </s>
    let rob = Model::load(
        golden("arch/roberta").to_str().unwrap(),
        Precision::Exact,
        false,
    )
    .unwrap();
    assert_eq!(rob.dims.context_len, 40);
    assert_eq!(rob.position_rows(&[0, 5, 1, 7, 2]), vec![2, 3, 1, 4, 5]);
    let (ids, types) = rob.encode_pair("it", "sat").unwrap();
    assert!(
        types.iter().all(|&t| t == 0),
        "RoBERTa has one token type: {types:?}"
    );
    let (s, e) = (ids[0], *ids.last().unwrap());
    assert_eq!((Some(s), Some(e)), rob.special_ids());
    assert_eq!(ids.iter().filter(|&&t| t == e).count(), 3, "{ids:?}");
    let long = "the cat sat on the mat. ".repeat(20);
    let err = rob.encode(&long, false).expect_err("past 40 positions");
    assert!(err.to_string().contains("40"), "{err}");
}

/// A base model's tensor the forward does not read is refused under a prefix too; a task head
/// outside the prefix is ignored only under a known head's name.
#[test]
fn prefixed_checkpoints_ignore_task_heads_but_refuse_unknown_tensors() {
    use std::collections::HashMap;
    let src = golden("arch/roberta");
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for (extra, refused) in [
        ("roberta.encoder.layer.0.attention.self.extra.weight", true),
        ("mystery.weight", true),
        ("classifier.dense.weight", false),
    ] {
        let dir = tempfile::tempdir().unwrap();
        for f in ["config.json", "tokenizer.json"] {
            std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
        }
        let mut tensors: HashMap<String, safetensors::tensor::TensorView> =
            st.tensors().into_iter().collect();
        let one = [0u8; 4];
        tensors.insert(
            extra.into(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1], &one).unwrap(),
        );
        safetensors::serialize_to_file(tensors, None, &dir.path().join("model.safetensors"))
            .unwrap();
        let got = Model::load(dir.path().to_str().unwrap(), Precision::Exact, false);
        match (got, refused) {
            (Err(e), true) => {
                let base = extra.strip_prefix("roberta.").unwrap_or(extra);
                assert!(e.to_string().contains(base), "{extra}: {e}");
                assert!(e.is_bad_input());
            }
            (Ok(_), false) => {}
            (Err(e), false) => panic!("{extra} refused: {e}"),
            (Ok(_), true) => panic!("{extra} accepted"),
        }
    }
}

/// Bidirectional attention in the kernel, streamed in small key blocks and whole, against
/// softmax(q·kᵀ/√d)·v computed plainly (every key visible to every query, one knocked out).
#[test]
fn bidirectional_kernel_sees_every_key() {
    let (nh, nkv, d, n) = (4, 2, 8, 11);
    let mut seed = 7u64;
    let mut rnd = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    };
    let q: Vec<f32> = (0..nh * n * d).map(|_| rnd()).collect();
    let k: Vec<f32> = (0..nkv * n * d).map(|_| rnd()).collect();
    let v: Vec<f32> = (0..nkv * n * d).map(|_| rnd()).collect();
    let dims = AttnDims {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: d,
        q_len: n,
        k_len: n,
        window: None,
        scale: None,
        softcap: None,
        causal: false,
    };
    for knock in [None, Some(3usize)] {
        let mut knockout = vec![false; n];
        if let Some(p) = knock {
            knockout[p] = true;
        }
        // the reference in f64: every key visible but the knocked-out one (to other queries)
        let want = grouped_query_attention_f64(
            &heads_to_rows(&q, nh, d),
            &heads_to_rows(&k, nkv, d),
            &heads_to_rows(&v, nkv, d),
            (nh, nkv, d),
            |i, j| j == i || !knockout[j],
        );
        let want_p: Vec<f32> = want.pattern.iter().map(|&p| p as f32).collect();
        let want_z: Vec<f32> = want.z.iter().map(|&z| z as f32).collect();
        for key_block in [3, 1024] {
            let z = attention(
                0,
                &q,
                &k,
                &v,
                dims,
                &knockout,
                8 << 20,
                key_block,
                &mut NoCapture,
            )
            .unwrap();
            assert_close(
                &z,
                &want_z,
                1e-5,
                &format!("knockout {knock:?}, key block {key_block}: z vs f64"),
            );
        }
        let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
        attention(0, &q, &k, &v, dims, &knockout, 8 << 20, 3, &mut cache).unwrap();
        let got = cache.pattern(0).unwrap().data.to_vec();
        assert_array(
            &format!("knockout {knock:?}: pattern [head, query, key] vs f64"),
            &[nh, n, n],
            &got,
            &want_p,
            Bound::Abs(1e-6),
        );
        // a key after the query carries weight: the mask is not causal
        assert!(got[1] > 0.0);
    }
    // a window or a reused prefix has no meaning without the causal order: refused
    let windowed = AttnDims {
        window: Some(2),
        ..dims
    };
    assert!(attention(0, &q, &k, &v, windowed, &[], 8 << 20, 3, &mut NoCapture).is_err());
}

#[test]
fn what_needs_a_decoder_is_refused_on_an_encoder() {
    let dir = golden("arch/bert");
    let model = Model::load(dir.to_str().unwrap(), Precision::Exact, false).unwrap();
    let tokens = model.encode("the cat sat", false).unwrap();
    let e = model
        .forward(
            &tokens,
            &RunOptions::last_logits(tokens.len()),
            &mut NoCapture,
        )
        .err()
        .expect("logits refused");
    assert!(
        matches!(e, Error::NotApplicable(_)) && e.to_string().contains("encoder"),
        "{e}"
    );
    assert!(model.require_decoder("generate").is_err());
    // past its 64 positions: refused, naming the limit
    let long = "the cat sat on the mat. ".repeat(20);
    let e = model.encode(&long, false).expect_err("too long");
    assert!(e.to_string().contains("64"), "{e}");
    let e = model.encode_pair(&long, "the dog").expect_err("too long");
    assert!(matches!(e, Error::TooLong { limit: 64, .. }), "{e}");
    // a pair is refused on a decoder, and on an encoder with a single token type
    let llama = Model::load(
        golden("arch/llama3").to_str().unwrap(),
        Precision::Exact,
        false,
    )
    .unwrap();
    assert!(llama.encode_pair("a", "b").is_err());
    let one_type = copy_with(&|c| c["type_vocab_size"] = 1.into());
    let e = Model::load(one_type.path().to_str().unwrap(), Precision::Exact, false)
        .err()
        .expect("the token-type table has 2 rows, the config says 1");
    assert!(e.to_string().contains("token_type_embeddings"), "{e}");
}

/// A copy of the tiny BERT whose config.json `edit` changes.
fn copy_with(edit: &dyn Fn(&mut serde_json::Value)) -> tempfile::TempDir {
    let src = golden("arch/bert");
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

#[test]
fn settings_attnscope_does_not_implement_are_refused_by_name() {
    for (key, value, says) in [
        ("hidden_act", serde_json::json!("relu"), "hidden_act"),
        (
            "position_embedding_type",
            serde_json::json!("relative_key"),
            "position_embedding_type",
        ),
        ("is_decoder", serde_json::json!(true), "is_decoder"),
        // an unknown family: named, with the supported list
        ("model_type", serde_json::json!("electra"), "electra"),
        (
            "model_type",
            serde_json::json!("electra"),
            "bert, roberta and distilbert",
        ),
    ] {
        let dir = copy_with(&|c| c[key] = value.clone());
        let e = Model::load(dir.path().to_str().unwrap(), Precision::Exact, false)
            .err()
            .unwrap_or_else(|| panic!("{key} = {value} accepted"));
        assert!(e.to_string().contains(says), "{key}: {e}");
        assert!(e.is_bad_input());
    }
    // a tokenizer.json without the [CLS] … [SEP] post-processor
    let dir = copy_with(&|_| {});
    let tok = dir.path().join("tokenizer.json");
    let mut t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tok).unwrap()).unwrap();
    t["post_processor"] = serde_json::Value::Null;
    std::fs::write(&tok, t.to_string()).unwrap();
    let e = Model::load(dir.path().to_str().unwrap(), Precision::Exact, false)
        .err()
        .expect("no [CLS] … [SEP]");
    assert!(e.to_string().contains("[CLS] first"), "{e}");
}

#[test]
fn punctuation_follows_unicode() {
    assert!(is_punctuation("?") && is_punctuation("«") && !is_punctuation("$"));
}

#[test]
fn cli_inspects_a_pair_and_refuses_generate() {
    let dir = golden("arch/bert");
    let m = dir.to_str().unwrap();
    let out = succeeds(
        attnscope()
            .args(["inspect", "--model", m, "--text", "What is it?"])
            .args(["--pair", "The dog was happy, and it sat!", "--json"]),
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let r = golden_json("arch/bert/reference.json");
    let case = &r["cases"]["pair"];
    assert_eq!(v["kind"], "encoder (bidirectional)");
    assert_eq!(v["token_types"], case["token_types"]);
    for (k, g) in [
        ("cls", "cls_share"),
        ("sep", "sep_share"),
        ("punct", "punct_share"),
    ] {
        common::assert_json(
            &format!("inspect --json: {k} share [layer]"),
            &floats(&case[g]),
            &v["special_shares"][k],
            Bound::Abs(SHARES as f64),
        );
    }
    assert!(v.get("next_token").is_none(), "no next-token prediction");
    let text = attnscope()
        .args(["inspect", "--model", m, "--text", "the cat sat."])
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&text.stdout);
    assert!(
        s.contains("encoder (bidirectional)") && s.contains("[SEP]"),
        "{s}"
    );
    let info = attnscope().args(["info", "--model", m]).output().unwrap();
    assert!(String::from_utf8_lossy(&info.stdout).contains("encoder (bidirectional)"));
    for args in [
        vec!["generate", "--text", "the cat"],
        vec!["dla", "--text", "the cat"],
        vec!["inspect", "--text", "the cat", "--pair", ""],
    ] {
        let out = attnscope()
            .args(&args)
            .args(["--model", m])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    let out = attnscope()
        .args(["generate", "--model", m, "--text", "the cat"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs a decoder"));
    // the head detector's causal roles are not scored on an encoder: its own are
    // (tests/encoder_heads.rs checks their numbers)
    let v = run_json(["heads", "--model", m, "--text", "the cat sat", "--json"]);
    assert!(v["roles"].get("induction").is_none() && v["roles"].get("next_token").is_some());
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum();
    let na: f64 = a.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// `Model::embed_texts` against sentence-transformers' `encode` (tests/golden/st_embeddings.py):
/// normalized (as modules.json says), unnormalized, a sentence pair, and a text holding a literal
/// [SEP] (against transformers' mean pooling); bad input is refused.
#[test]
fn embed_matches_sentence_transformers() {
    use attnscope::model::forward::EmbedInput;
    let model = real_model("all-minilm-l6-v2");
    assert!(model.embeds_normalized());
    let g = golden_json("minilm_st_embeddings.json");
    let inputs: Vec<EmbedInput> = g["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| EmbedInput {
            text: t.as_str().unwrap().into(),
            pair: None,
        })
        .collect();
    let dm = model.dims.d_model;
    let count = std::sync::atomic::AtomicUsize::new(0);
    let tick = || {
        count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    };
    for (key, normalize) in [("normalized", None), ("mean_pooled", Some(false))] {
        let got = model.embed_texts(&inputs, normalize, &tick).unwrap();
        let want: Vec<Vec<f32>> = g[key].as_array().unwrap().iter().map(floats).collect();
        assert_eq!(got.len(), want.len() * dm);
        for (i, w) in want.iter().enumerate() {
            let row = &got[i * dm..(i + 1) * dm];
            let c = cosine(row, w);
            assert!(c >= 0.99999, "{key} text {i}: cosine {c}");
            assert_close(row, w, EMBED, &format!("{key} text {i} [dim]"));
        }
    }
    assert_eq!(
        count.load(std::sync::atomic::Ordering::Relaxed),
        2 * inputs.len()
    );
    // explicit normalization of the unnormalized rows gives unit norms
    let on = model.embed_texts(&inputs[..1], Some(true), &|| {}).unwrap();
    let norm: f64 = on.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
    assert!((norm - 1.0).abs() < 1e-6, "norm {norm}");
    // a pair
    let p = &g["pair"];
    let pair = EmbedInput {
        text: p[0].as_str().unwrap().into(),
        pair: Some(p[1].as_str().unwrap().into()),
    };
    let got = model.embed_texts(&[pair], None, &|| {}).unwrap();
    let want = floats(&g["pair_normalized"]);
    let c = cosine(&got, &want);
    assert!(c >= 0.99999, "pair: cosine {c}");
    assert_close(&got, &want, EMBED, "pair [dim]");
    // a literal "[SEP]" inside one text: every token type 0, as the tokenizer gives it; the
    // mean-pooled state equals transformers' (minilm_encoder.json)
    let case = &golden_json("minilm_encoder.json")["cases"]["literal_sep"];
    let sep = EmbedInput {
        text: case["text"].as_str().unwrap().into(),
        pair: None,
    };
    let got = model.embed_texts(&[sep], Some(false), &|| {}).unwrap();
    assert_close(
        &got,
        &floats(&case["mean_pooled"]),
        EMBED,
        "a text holding [SEP] [dim]",
    );
    // refusals
    let empty = EmbedInput {
        text: "  ".into(),
        pair: None,
    };
    assert!(model.embed_texts(&[empty], None, &|| {}).is_err());
    assert_eq!(model.embed_max_seq_length(), Some(256));
    let long = EmbedInput {
        text: "word ".repeat(300),
        pair: None,
    };
    let e = model.embed_texts(&[long], None, &|| {}).unwrap_err();
    assert!(e.to_string().contains("max_seq_length 256"), "{e}");
}

#[test]
fn cli_embed_writes_npy_and_refuses_a_decoder() {
    let dir = tempfile::tempdir().unwrap();
    let g = golden_json("minilm_st_embeddings.json");
    let texts: Vec<&str> = g["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let file = dir.path().join("texts.txt");
    std::fs::write(&file, texts.join("\n\n") + "\n").unwrap();
    let out = dir.path().join("emb.npy");
    succeeds(
        attnscope()
            .args(["embed", "-m", "all-minilm-l6-v2", "--file"])
            .arg(&file)
            .arg("--out")
            .arg(&out),
    );
    let (shape, data) = attnscope::render::npy::from_npy(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(shape, vec![texts.len(), 384]);
    for (i, w) in g["normalized"].as_array().unwrap().iter().enumerate() {
        let w = floats(w);
        assert_close(
            &data[i * 384..(i + 1) * 384],
            &w,
            EMBED,
            &format!("embed --format npy: text {i} [dim]"),
        );
    }
    let o = run_err(["embed", "-m", "smollm2-135m", "--text", "hi", "--json"], 2);
    assert!(o.contains("encoder"));
    let o = attnscope()
        .args(["embed", "-m", "all-minilm-l6-v2", "--text", "hi"])
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(2),
        "no --out and no --json is a usage error"
    );
}

/// Occlusion on an encoder: 1 − the cosine similarity of the sentence embedding (and of the
/// [CLS] vector) without each token, against sentence-transformers (minilm_occlusion.json, made
/// by make_encoder_targets_golden.py).
#[test]
fn minilm_occlusion_matches_sentence_transformers() {
    let model = real_model("all-minilm-l6-v2");
    let g = golden_json("minilm_occlusion.json");
    for case in g["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let tokens = model.encode(text, false).unwrap();
        assert_eq!(tokens, ids_of(&case["token_ids"]), "{text}: ids");
        for (target, key, want_target) in [
            (Target::Next, "cos_embedding", EncoderTarget::Embedding),
            (
                Target::Text("embedding".into()),
                "cos_embedding",
                EncoderTarget::Embedding,
            ),
            (Target::Text("cls".into()), "cos_cls", EncoderTarget::Cls),
        ] {
            let opts = AttributeOptions {
                method: Method::Occlusion,
                target,
                wrong: None,
                steps: 32,
            };
            let mut calls = 0;
            let r = attribute(model, &tokens, &opts, &mut |_, _| calls += 1).unwrap();
            assert_eq!(calls, tokens.len(), "one forward per deletion");
            assert_eq!(r.encoder_target, Some(want_target));
            assert_eq!((r.metric, r.value), ("cosine", 1.0));
            assert!(r.target.is_none() && r.logprob.is_none());
            let got: Vec<f32> = r.tokens.iter().map(|t| t.score).collect();
            let want: Vec<f32> = floats(&case[key]).iter().map(|c| 1.0 - c).collect();
            assert_close(&got, &want, OCCLUSION, &format!("{text} {key} [position]"));
        }
    }
}

#[test]
fn encoder_targets_refuse_what_needs_a_decoder() {
    let dir = golden("arch/bert");
    let model = Model::load(dir.to_str().unwrap(), Precision::Exact, false).unwrap();
    let tokens = model.encode("the cat sat", false).unwrap();
    let run = |method: Method, target: Target, wrong: Option<Target>| {
        let opts = AttributeOptions {
            method,
            target,
            wrong,
            steps: 4,
        };
        attribute(&model, &tokens, &opts, &mut |_, _| {})
    };
    for m in [
        Method::Gradient,
        Method::GradXInput,
        Method::IntegratedGradients,
        Method::AttentionXGradient,
    ] {
        let e = run(m, Target::Next, None).expect_err("a gradient method on an encoder");
        assert!(e.to_string().contains("decoder-only"), "{e}");
        assert!(e.is_bad_input());
    }
    for m in [Method::AttnLrp, Method::AltiLogit, Method::ValueZeroing] {
        let e = run(m, Target::Next, None).expect_err("a next-token method");
        assert!(e.to_string().contains("occlusion"), "{e}");
    }
    for t in [Target::Id(5), Target::Text(" cat".into())] {
        let e = run(Method::Occlusion, t, None).expect_err("a token target");
        assert!(
            e.to_string().contains("`embedding`") && e.to_string().contains("`cls`"),
            "{e}"
        );
    }
    let e = run(Method::Occlusion, Target::Next, Some(Target::Id(3))).expect_err("--wrong");
    assert!(e.to_string().contains("--wrong"), "{e}");
    // on the tiny fixture, by hand: deleting token i, then 1 − cos to the full text's embedding
    let r = run(Method::Occlusion, Target::Text("embedding".into()), None).unwrap();
    let full = model.embed_tokens(&tokens).unwrap();
    for (i, t) in r.tokens.iter().enumerate() {
        let mut v = tokens.clone();
        v.remove(i);
        let want = 1.0 - cosine(&model.embed_tokens(&v).unwrap(), &full);
        assert!(
            (t.score as f64 - want).abs() < 1e-6,
            "{i}: {} vs {want}",
            t.score
        );
    }
    let one = model.encode("a", false).unwrap();
    assert!(attribute(
        &model,
        &one[..1],
        &AttributeOptions {
            method: Method::Occlusion,
            target: Target::Next,
            wrong: None,
            steps: 1
        },
        &mut |_, _| {}
    )
    .is_err());
}

/// The encoder's `attribute`, `faithfulness` and `compare` on the command line, against
/// sentence-transformers (minilm_occlusion.json, minilm_st_embeddings.json), and what they refuse.
#[test]
fn cli_attribute_faithfulness_and_compare_on_an_encoder() {
    let m = "all-minilm-l6-v2";
    let g = golden_json("minilm_occlusion.json");
    cli_attribute_cls_is_sentence_transformers_occlusion(m, &g);
    cli_attribute_refuses_gradients(m);
    cli_faithfulness_deletion_and_forward_only_rankings(m, &g);
    cli_faithfulness_refuses_gradients_and_token_targets(m);
    cli_compare_adds_the_embeddings_cosine(m);
}

/// 1 − each golden cosine (`case[key]` of minilm_occlusion.json): occlusion's scores.
fn one_minus(cosines: &serde_json::Value) -> Vec<f32> {
    floats(cosines).iter().map(|c| 1.0 - c).collect()
}

/// Each token's `key` in a command's `--json` report.
fn token_column(v: &serde_json::Value, key: &str) -> Vec<f32> {
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t[key].as_f64().unwrap() as f32)
        .collect()
}

/// `attribute --method occlusion --target cls`: cosine scores against sentence-transformers,
/// and no decoder's target or log p in the report.
fn cli_attribute_cls_is_sentence_transformers_occlusion(m: &str, g: &serde_json::Value) {
    let o = succeeds(
        attnscope()
            .args(["attribute", "-m", m, "--text", "The cat sat on the mat."])
            .args(["--method", "occlusion", "--target", "cls", "--json"]),
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["encoder_target"], "cls");
    assert_eq!(v["metric"], "cosine");
    assert!(v.get("target").is_none() && v.get("logprob").is_none());
    let want = one_minus(&g["cases"][0]["cos_cls"]);
    let got = token_column(&v, "score");
    assert_close(&got, &want, OCCLUSION, "attribute --target cls [position]");
}

/// `attribute --method gradient` on an encoder exits 2: gradients are decoder-only.
fn cli_attribute_refuses_gradients(m: &str) {
    let o = fails_with(
        attnscope()
            .args(["attribute", "-m", m, "--text", "The cat sat."])
            .args(["--method", "gradient"]),
        2,
    );
    assert!(o.contains("decoder-only"));
}

/// `faithfulness`: deletion against sentence-transformers' embedding, and only the
/// forward-only rankings.
fn cli_faithfulness_deletion_and_forward_only_rankings(m: &str, g: &serde_json::Value) {
    let v = run_json([
        "faithfulness",
        "-m",
        m,
        "--text",
        "The cat sat on the mat.",
        "--json",
    ]);
    assert_eq!(v["encoder_target"], "embedding");
    let del = token_column(&v, "deletion");
    let want = one_minus(&g["cases"][0]["cos_embedding"]);
    assert_close(
        &del,
        &want,
        OCCLUSION,
        "faithfulness deletion on an encoder [position]",
    );
    let rankings: Vec<&str> = v["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["ranking"].as_str().unwrap())
        .collect();
    assert_eq!(
        rankings,
        [
            "attention_last",
            "attention_mean",
            "rollout",
            "norm_last",
            "norm_mean",
            "random"
        ]
    );
}

/// `faithfulness --gradients fast` and a token target exit 2, each with its reason.
fn cli_faithfulness_refuses_gradients_and_token_targets(m: &str) {
    for (extra, want) in [
        (["--gradients", "fast"], "decoder-only"),
        (["--target", " Paris"], "`cls`"),
    ] {
        let o = run_err(
            ["faithfulness", "-m", m, "--text", "The cat sat."]
                .into_iter()
                .chain(extra),
            2,
        );
        assert!(o.contains(want), "{extra:?}: {o}");
    }
}

/// `compare` of two texts: their embeddings' cosine (sentence-transformers') beside the
/// attention comparison.
fn cli_compare_adds_the_embeddings_cosine(m: &str) {
    let st = golden_json("minilm_st_embeddings.json");
    let (a, b) = (
        st["texts"][0].as_str().unwrap(),
        st["texts"][3].as_str().unwrap(),
    );
    let v = run_json(["compare", "-m", m, "--text", a, "--text", b, "--json"]);
    let want = cosine(&floats(&st["normalized"][0]), &floats(&st["normalized"][3]));
    let got = v["embedding_cosine"].as_f64().expect("embedding_cosine");
    common::assert_cells(
        "compare: the embeddings' cosine vs sentence-transformers'",
        [((), got)],
        [((), want)],
        Bound::Abs(OCCLUSION as f64),
    );
    assert!(
        v["js"].as_array().is_some(),
        "the attention comparison is still there"
    );
}

/// The encoder's faithfulness on the tiny BERT, by hand: [CLS]'s rows for `cls`, every query's
/// mean for `embedding`; deletion is 1 − cos of the vectors without each token.
#[test]
fn encoder_faithfulness_by_hand() {
    use attnscope::analysis::enc_faith;
    use attnscope::analysis::enc_target::cosine as cos;
    let dir = golden("arch/bert");
    let model = Model::load(dir.to_str().unwrap(), Precision::Exact, false).unwrap();
    let tokens = model.encode("the cat sat on the mat.", false).unwrap();
    let n = tokens.len();
    let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
    model
        .forward(&tokens, &RunOptions::default(), &mut cache)
        .unwrap();
    let last = cache.pattern(model.dims.n_layers - 1).unwrap();
    let nh = model.dims.n_heads;
    for target in [EncoderTarget::Cls, EncoderTarget::Embedding] {
        let r = enc_faith::run(&model, &tokens, target, 7, &mut |_, _| {}).unwrap();
        assert_eq!(r.encoder_target, target);
        let base = target.vector(&model, &tokens).unwrap();
        let queries: Vec<usize> = match target {
            EncoderTarget::Cls => vec![0],
            EncoderTarget::Embedding => (0..n).collect(),
        };
        for (j, row) in r.tokens.iter().enumerate() {
            let mut v = tokens.clone();
            v.remove(j);
            let want = 1.0 - cos(&target.vector(&model, &v).unwrap(), &base);
            assert!((row.deletion as f64 - want).abs() < 1e-6, "{j}");
            let mut a = 0f64;
            for &q in &queries {
                for h in 0..nh {
                    a += last.row_at(h, q).unwrap()[j] as f64;
                }
            }
            let a = a / (nh * queries.len()) as f64;
            assert!(
                (row.attention_last as f64 - a).abs() < 1e-5,
                "{j}: attention"
            );
        }
        let roll: f32 = r.tokens.iter().map(|t| t.rollout).sum();
        assert!((roll - 1.0).abs() < 1e-4, "rollout rows sum to 1: {roll}");
        assert_eq!(r.metrics.len(), 6);
        assert!(r.metrics.iter().all(|m| m.truth == "deletion" && m.n == n));
        assert!(r.most_faithful.is_some());
    }
}
