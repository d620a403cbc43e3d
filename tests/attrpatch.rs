//! Attribution patching (issue #39 item 4) against torch autograd through transformers, and the
//! gradients at the hook points (item 6) against the backward's own outputs that
//! `tests/gradients.rs` checks against transformers (the Python tests check every hook's
//! gradient against transformers, `bindings/python/tests/test_hook_grads.py`).

mod common;

use attnscope::analysis::attrpatch::{agreement, attribution_patch, APPROX_HOOKS};
use attnscope::analysis::intervene::{patch, PatchOptions};
use attnscope::analysis::vocab::PatchHook;
use attnscope::analysis::vocab::Target;
use attnscope::model::backward::{GradMetric, Metric};
use attnscope::model::Error;
use common::*;

/// Every layer × position (resid_pre, attn_out, mlp_out) and layer × head (z) estimate within
/// 3e-5 of the largest (measured: 4.1e-6, Qwen2.5's mlp_out), against
/// `tests/golden/<prefix>_attrpatch.json` (make_hookgrad_golden.py).
fn check_attribution_patching(alias: &str, prefix: &str) {
    let model = real_model(alias);
    let g = golden_json(&format!("{prefix}_attrpatch.json"));
    let clean = model.encode(g["clean"].as_str().unwrap(), false).unwrap();
    let corrupt = model.encode(g["corrupt"].as_str().unwrap(), false).unwrap();
    let (answer, wrong) = (
        g["answer_id"].as_u64().unwrap() as u32,
        g["wrong_id"].as_u64().unwrap() as u32,
    );
    let r = attribution_patch(model, &clean, &corrupt, answer, wrong).unwrap();
    assert_cells(
        &format!("{alias}: clean and corrupt logit differences"),
        [
            ("clean", r.clean_logit_diff as f64),
            ("corrupt", r.corrupt_logit_diff as f64),
        ],
        [
            ("clean", g["clean_logit_diff"].as_f64().unwrap()),
            ("corrupt", g["corrupt_logit_diff"].as_f64().unwrap()),
        ],
        Bound::Abs(1e-4),
    );
    assert_eq!(r.kinds.len(), 4);
    let span = (r.clean_logit_diff - r.corrupt_logit_diff) as f64;
    for (kind, name) in r.kinds.iter().zip(APPROX_HOOKS) {
        assert_eq!(kind.hook, name);
        let key = name.rsplit('.').next().unwrap();
        let want: Vec<((usize, usize), f64)> = json_cells(&g[key])
            .into_iter()
            .map(|(i, w)| ((i[0], i[1]), w))
            .collect();
        let largest = want.iter().fold(0f64, |m, &(_, v)| m.max(v.abs()));
        assert!(largest > 0.1, "{name}: some estimate must matter");
        // every layer × position (× head for z) of the reference, each once
        assert_cells(
            &format!("{alias} {name}: estimate [layer, position | head] vs torch"),
            kind.results.iter().map(|c| {
                let j = c.pos.or(c.head).expect("a position or a head");
                ((c.layer, j), c.estimate as f64)
            }),
            want,
            Bound::RelMax(3e-5),
        );
        assert_cells(
            &format!("{alias} {name}: recovered = estimate / (clean - corrupt)"),
            kind.results
                .iter()
                .map(|c| ((c.layer, c.pos, c.head), c.recovered as f64)),
            kind.results
                .iter()
                .map(|c| ((c.layer, c.pos, c.head), c.estimate as f64 / span)),
            Bound::Abs(1e-6),
        );
    }
    // beside the exact patching: resid_pre at position 0 changes nothing (the same token), and
    // the estimates correlate with the exact grid
    let exact = patch(
        model,
        &clean,
        &corrupt,
        &PatchOptions {
            hook: PatchHook::ResidPre,
            answer: Some(Target::Id(answer)),
            wrong: Some(Target::Id(wrong)),
            batch_rows: 1024,
        },
        |_, _| {},
    )
    .unwrap();
    let kind = r.kind(PatchHook::ResidPre).unwrap();
    let a = agreement(&exact.results, kind);
    eprintln!("{alias} resid_pre: {a:?}");
    assert_eq!(a.n, exact.results.len());
    assert!(a.pearson.unwrap() > 0.5, "{a:?}");
    assert!(r.kind(PatchHook::Pattern).is_none());
}

#[test]
fn attribution_patching_matches_torch_smollm() {
    check_attribution_patching("smollm2-135m", "smol");
}

#[test]
fn attribution_patching_matches_torch_qwen() {
    check_attribution_patching("qwen2.5-coder-0.5b", "qwen");
}

#[test]
fn attribution_patching_refuses_unpaired_texts() {
    let model = real_model("smollm2-135m");
    let clean = model.encode("After Alice and Bob walked", false).unwrap();
    let err = attribution_patch(model, &clean, &clean[..2], 8590, 8363).unwrap_err();
    assert!(matches!(err, Error::OutOfRange { .. }), "{err}");
}

/// The scores' gradient (`[heads, n, n]`) is 0 at masked keys and each row sums to 0
/// (softmax's invariance to a shift of its inputs).
fn assert_scores_grad_masked_and_centred(sc: &[f32], heads: usize, n: usize) {
    for hh in 0..heads {
        for i in 0..n {
            let row = &sc[(hh * n + i) * n..(hh * n + i + 1) * n];
            assert!(row[i + 1..].iter().all(|&v| v == 0.0));
            let sum: f32 = row.iter().sum();
            let big = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(sum.abs() <= 1e-4 * big.max(1e-6), "row {i} sums to {sum}");
        }
    }
}

/// `hook_gradients` gives what `Model::gradient` gives (checked against transformers in
/// tests/gradients.rs) at resid_pre and the pattern's last row, in TransformerLens's shapes, and
/// only the hooks asked for.
#[test]
fn hook_gradients_agree_with_the_backward() {
    let model = real_model("smollm2-135m");
    let tokens = model
        .encode(
            "After Alice and Bob walked to the park, Bob handed a ball to",
            false,
        )
        .unwrap();
    let n = tokens.len();
    let d = &model.dims;
    let g = model.gradient(&tokens, Metric::LogProb(None)).unwrap();
    let want = |name: &str| {
        name == "hook_embed" || name.starts_with("blocks.3.") || name == "blocks.7.hook_resid_pre"
    };
    let h = model
        .hook_gradients(&tokens, GradMetric::Metric(Metric::LogProb(None)), &want)
        .unwrap();
    assert_eq!(h.target, g.target);
    assert!((h.value - g.value).abs() < 1e-6);
    let get = |name: &str| {
        h.grads
            .iter()
            .find(|(k, _, _)| k == name)
            .unwrap_or_else(|| panic!("{name} missing"))
    };
    assert!(h.grads.iter().all(|(k, _, _)| k.ends_with("_grad")
        && (k == "hook_embed_grad"
            || k.starts_with("blocks.3.")
            || k == "blocks.7.hook_resid_pre_grad")));
    assert_eq!(h.grads.len(), 1 + 20 + 1);
    // the norms' and the MLP's hook points (their values: norm_and_mlp_hook_gradients_match_torch)
    assert_eq!(get("blocks.3.ln1.hook_scale_grad").1, vec![n, 1]);
    assert_eq!(
        get("blocks.3.ln2.hook_normalized_grad").1,
        vec![n, d.d_model]
    );
    for hook in ["hook_pre", "hook_pre_linear", "hook_post"] {
        assert_eq!(get(&format!("blocks.3.mlp.{hook}_grad")).1, vec![n, d.d_ff]);
    }
    let (_, s, v) = get("hook_embed_grad");
    assert_eq!(s, &[n, d.d_model]);
    assert_eq!(v, &g.grad_input);
    for l in [3, 7] {
        let (_, s, v) = get(&format!("blocks.{l}.hook_resid_pre_grad"));
        assert_eq!(s, &[n, d.d_model]);
        assert_eq!(v, &g.grad_resid_pre[l]);
    }
    // resid_post of layer 3 is resid_pre of layer 4; mlp_out shares it, attn_out shares resid_mid
    let (_, _, post) = get("blocks.3.hook_resid_post_grad");
    assert_eq!(post, &g.grad_resid_pre[4]);
    assert_eq!(get("blocks.3.hook_mlp_out_grad").2, *post);
    assert_eq!(
        get("blocks.3.hook_attn_out_grad").2,
        get("blocks.3.hook_resid_mid_grad").2
    );
    let (_, s, pat) = get("blocks.3.attn.hook_pattern_grad");
    assert_eq!(s, &[d.n_heads, n, n]);
    for hh in 0..d.n_heads {
        let last = &pat[(hh * n + n - 1) * n..(hh * n + n) * n];
        let want = &g.grad_pattern_last[3][hh * n..(hh + 1) * n];
        assert_close(last, want, 1e-6, "pattern grad last row");
    }
    assert_eq!(
        get("blocks.3.attn.hook_z_grad").1,
        vec![n, d.n_heads, d.head_dim]
    );
    assert_eq!(
        get("blocks.3.attn.hook_v_grad").1,
        vec![n, d.n_kv_heads, d.head_dim]
    );
    assert_eq!(
        get("blocks.3.attn.hook_rot_k_grad").1,
        vec![n, d.n_kv_heads, d.head_dim]
    );
    let (_, _, sc) = get("blocks.3.attn.hook_attn_scores_grad");
    assert_scores_grad_masked_and_centred(sc, d.n_heads, n);
    // the loss needs two tokens
    let err = model
        .hook_gradients(&tokens[..1], GradMetric::Loss, &want)
        .unwrap_err();
    assert!(matches!(err, Error::OutOfRange { .. }), "{err}");
}

/// `patch --approx --json` on the tiny model: the estimates beside the exact grid with their
/// agreement; `--hook pattern --approx` is refused with exit 2.
#[test]
fn patch_approx_json_and_refusal() {
    use attnscope::model::tiny::{tiny_model, write_gguf};
    use attnscope::model::Arch;
    use candle_core::quantized::GgmlDType;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_gguf(
        &tiny_model(Arch::Llama, 3),
        Arch::Llama,
        GgmlDType::F32,
        &path,
    )
    .unwrap();
    let model = path.to_str().unwrap();
    let run = |hook: &str| {
        assert_cmd::Command::cargo_bin("attnscope")
            .unwrap()
            .write_stdin("")
            .args([
                "patch",
                "--model",
                model,
                "--clean",
                "the hat at the hat",
                "--corrupt",
                "the cat at the hat",
                "--answer",
                "104",
                "--wrong",
                "99",
                "--hook",
                hook,
                "--approx",
                "--json",
            ])
            .output()
            .unwrap()
    };
    for (hook, name, per_head) in [
        ("resid-pre", "hook_resid_pre", false),
        ("z", "attn.hook_z", true),
    ] {
        let out = run(hook);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let a = &v["approx"];
        assert_eq!(a["hook"], name);
        assert_eq!(a["forward_passes"], 2);
        assert_eq!(a["backward_passes"], 1);
        let exact = v["results"].as_array().unwrap();
        let est = a["results"].as_array().unwrap();
        assert_eq!(exact.len(), est.len());
        assert_eq!(a["n"].as_u64().unwrap() as usize, exact.len());
        let key = if per_head { "head" } else { "pos" };
        for (e, x) in exact.iter().zip(est) {
            assert_eq!(e["layer"], x["layer"]);
            assert_eq!(e[key], x[key]);
        }
        let r = a["pearson"].as_f64().unwrap();
        assert!((-1.0..=1.0).contains(&r));
        // the estimate's scale: recovered = estimate / (clean − corrupt)
        let span =
            v["clean_logit_diff"].as_f64().unwrap() - v["corrupt_logit_diff"].as_f64().unwrap();
        for x in est {
            let (e, rec) = (
                x["estimate"].as_f64().unwrap(),
                x["recovered"].as_f64().unwrap(),
            );
            assert!((e / span - rec).abs() < 1e-4 * rec.abs().max(1.0));
        }
    }
    let out = run("pattern");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--approx"));
}

/// Gemma 3's gradients at the hook points (`hook_gradients`, what Python's
/// `run_with_cache(incl_bwd=True)` returns) against torch autograd through transformers
/// (`tests/golden/gemma_hook_grads/`, make_gemma_hookgrad_golden.py): the scaled embedding, a
/// resid_pre, a sliding-window and a global layer's pattern, z, v, rot_q and rot_k after the q/k
/// norms and RoPE, attn_out and mlp_out after the post-norms; for log p(top token), the loss and
/// a logit difference. Each within 1e-4 of its largest value (measured: at most 1.8e-5, the lp
/// gradient at blocks.17.hook_resid_pre), in TransformerLens's shapes.
#[test]
fn gemma_hook_gradients_match_torch() {
    let model = real_model("gemma3-270m");
    let v = golden_json("gemma_hook_grads/values.json");
    let tokens = token_ids(&v["token_ids"]);
    let clean = "After Alice and Bob walked to the park, Bob handed a ball to";
    assert_eq!(
        model.encode(clean, false).unwrap(),
        tokens,
        "Gemma's <bos> first"
    );
    let (answer, wrong) = (
        v["answer_id"].as_u64().unwrap() as u32,
        v["wrong_id"].as_u64().unwrap() as u32,
    );
    let dir = golden("gemma_hook_grads");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|f| f.ends_with("_grad.npy"))
        .collect();
    files.sort();
    assert_eq!(files.len(), 12, "{files:?}");
    let mut checked = 0;
    for (scalar, metric, value_key) in [
        ("lp", GradMetric::Metric(Metric::LogProb(None)), "logprob"),
        ("loss", GradMetric::Loss, "loss"),
        (
            "ld",
            GradMetric::Metric(Metric::LogitDiff { answer, wrong }),
            "logit_diff",
        ),
    ] {
        let mine: Vec<(String, String)> = files
            .iter()
            .filter_map(|f| {
                let (s, rest) = f.split_once("__")?;
                (s == scalar).then(|| (f.clone(), rest.trim_end_matches(".npy").to_string()))
            })
            .collect();
        assert!(!mine.is_empty(), "{scalar}");
        let names: Vec<String> = mine
            .iter()
            .map(|(_, g)| g.trim_end_matches("_grad").to_string())
            .collect();
        let h = model
            .hook_gradients(&tokens, metric, &|n: &str| names.iter().any(|x| x == n))
            .unwrap();
        let want_value = v[value_key].as_f64().unwrap();
        assert_cells(
            &format!("gemma {scalar}: value vs torch (1e-4 of max(|value|, 1))"),
            [((), h.value as f64 / want_value.abs().max(1.0))],
            [((), want_value / want_value.abs().max(1.0))],
            Bound::Abs(1e-4),
        );
        if scalar == "lp" {
            assert_eq!(h.target as u64, v["target_id"].as_u64().unwrap());
        }
        for (file, grad_name) in &mine {
            gemma_hook_gradient_matches(&h, scalar, file, grad_name);
            checked += 1;
        }
    }
    assert_eq!(checked, files.len());
}

/// One of `h`'s gradients (`grad_name`) against the golden `file`: the same shape, every cell
/// within 1e-4 of the largest value.
fn gemma_hook_gradient_matches(
    h: &attnscope::model::backward::HookGradients,
    scalar: &str,
    file: &str,
    grad_name: &str,
) {
    let (shape, want) = golden_npy(&format!("gemma_hook_grads/{file}"));
    let (_, got_shape, got) = h
        .grads
        .iter()
        .find(|(k, _, _)| k == grad_name)
        .unwrap_or_else(|| panic!("{grad_name} missing"));
    assert_eq!(got_shape, &shape, "{scalar} {grad_name}: shape");
    assert!(
        want.iter().any(|&v| v != 0.0),
        "{scalar} {grad_name}: all zero"
    );
    assert_array(
        &format!("gemma {scalar} {grad_name} vs torch"),
        &shape,
        got,
        &want,
        Bound::RelMax(1e-4),
    );
}

/// The gradients at the norms' and the MLP's hook points (`ln1`/`ln2` `hook_scale` and
/// `hook_normalized`, `mlp.hook_pre`, `hook_pre_linear`, `hook_post`: what TL's attribution demo
/// reads from a gradient cache) against torch autograd through transformers with the norms and
/// the MLP written as TransformerLens writes them (`tests/golden/inner_hook_grads/`,
/// make_inner_hookgrad_golden.py), log p(top token), on SmolLM2, Qwen2.5 (its layer 3) and
/// Gemma 3 (its (1 + w) norms, GeGLU, layer 5). The `[n, width]` ones at three rows (the files'
/// size); each within 1e-4 of its largest value.
#[test]
fn norm_and_mlp_hook_gradients_match_torch() {
    let v = golden_json("inner_hook_grads/values.json");
    let dir = golden("inner_hook_grads");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|f| f.ends_with("_grad.npy"))
        .collect();
    files.sort();
    assert_eq!(files.len(), 16, "{files:?}");
    let mut checked = 0;
    for key in ["smol", "qwen", "gemma"] {
        let m = &v[key];
        let model = real_model(m["model"].as_str().unwrap());
        let tokens = token_ids(&m["token_ids"]);
        let clean = "After Alice and Bob walked to the park, Bob handed a ball to";
        assert_eq!(model.encode(clean, false).unwrap(), tokens, "{key}");
        let rows: Vec<usize> = m["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_u64().unwrap() as usize)
            .collect();
        let mine: Vec<(String, String)> = files
            .iter()
            .filter_map(|f| {
                let (s, rest) = f.split_once("__")?;
                (s == key).then(|| (f.clone(), rest.trim_end_matches(".npy").to_string()))
            })
            .collect();
        let names: Vec<String> = mine
            .iter()
            .map(|(_, g)| g.trim_end_matches("_grad").to_string())
            .collect();
        let metric = GradMetric::Metric(Metric::LogProb(None));
        let h = model
            .hook_gradients(&tokens, metric, &|n: &str| names.iter().any(|x| x == n))
            .unwrap();
        assert_eq!(h.target as u64, m["target_id"].as_u64().unwrap(), "{key}");
        let want = m["logprob"].as_f64().unwrap();
        assert!(
            (h.value as f64 - want).abs() < 1e-4,
            "{key}: {} vs {want}",
            h.value
        );
        assert_eq!(h.grads.len(), mine.len(), "{key}: only the hooks asked for");
        for (file, grad_name) in &mine {
            inner_gradient_matches(&h, key, file, grad_name, &rows);
            checked += 1;
        }
    }
    assert_eq!(checked, files.len());
}

/// One of `h`'s gradients (`grad_name`) against the golden `file`: `[n, 1]` whole, wider ones at
/// `rows`; every cell within 1e-4 of the largest value.
fn inner_gradient_matches(
    h: &attnscope::model::backward::HookGradients,
    key: &str,
    file: &str,
    grad_name: &str,
    rows: &[usize],
) {
    let (shape, want) = golden_npy(&format!("inner_hook_grads/{file}"));
    let (_, got_shape, got) = h
        .grads
        .iter()
        .find(|(k, _, _)| k == grad_name)
        .unwrap_or_else(|| panic!("{key} {grad_name} missing"));
    let width = got_shape[1];
    let got: Vec<f32> = if width == 1 {
        assert_eq!(got_shape, &shape, "{key} {grad_name}: shape");
        got.clone()
    } else {
        assert_eq!(shape, vec![rows.len(), width], "{key} {grad_name}: shape");
        rows.iter()
            .flat_map(|&r| got[r * width..(r + 1) * width].iter().copied())
            .collect()
    };
    assert!(
        want.iter().any(|&v| v != 0.0),
        "{key} {grad_name}: all zero"
    );
    let worst = assert_array(
        &format!("{key} {grad_name} vs torch"),
        &shape,
        &got,
        &want,
        Bound::RelMax(1e-4),
    );
    eprintln!("{key} {grad_name}: worst {worst:.2e} of the largest");
}
