//! Gradients (issue #39): the backward pass against finite differences on the tiny models of
//! every family, and its forward against the engine's.

mod common;

use attnscope::model::backward::{Gradient, Metric};
use attnscope::model::config::Arch;
use attnscope::model::tiny::{tiny_model, write_gguf};
use attnscope::model::{Model, Precision};
use candle_core::quantized::GgmlDType;

const TOKENS: [u32; 9] = [72, 101, 108, 108, 111, 32, 256, 258, 259];

fn tiny(arch: Arch) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    write_gguf(&tiny_model(arch, 11), arch, GgmlDType::F32, &path).unwrap();
    let model = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
    (dir, model)
}

fn family(name: &str) -> Model {
    let dir = common::golden(&format!("arch/{name}"));
    Model::load(dir.to_str().unwrap(), Precision::Exact, false).unwrap()
}

/// The backward's forward equals the engine's, and the gradient wrt the input equals central
/// finite differences (along the gradient's direction and along single coordinates).
fn check(model: &Model, tokens: &[u32], label: &str) {
    let tokens: Vec<u32> = tokens
        .iter()
        .map(|&t| t % model.dims.vocab_size as u32)
        .collect();
    let g = model.gradient(&tokens, Metric::LogProb(None)).unwrap();
    let want = model.next_token_logits(&tokens).unwrap();
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    check_logits_equal_the_engines(&g, &want, scale, label);
    let fd = FiniteDifferences::new(model, &g);
    assert!(
        fd.norm > 0.0 && fd.norm.is_finite(),
        "{label}: gradient norm {}",
        fd.norm
    );
    let (fd_dir, an, rel) = fd.directional(label);
    let worst = fd.worst_coordinate_error(label);
    assert!(worst < 2e-2, "{label}: coordinate error {worst}");
    assert!(
        rel < 1e-3,
        "{label}: directional derivative {fd_dir} vs {an}"
    );
    check_logit_difference_value(model, &tokens, &g, &want, scale);
}

/// The last position's logits of the backward's forward against the engine's (`want`, whose
/// largest `|logit|` is `scale`).
fn check_logits_equal_the_engines(g: &Gradient, want: &[f32], scale: f32, label: &str) {
    let d = common::max_abs_diff(&g.logits, want, label);
    eprintln!("{label}: logits max |diff| {d:.2e} (largest {scale:.2})");
    assert!(
        d <= 1e-5 * scale.max(1.0) * 10.0,
        "{label}: logits differ by {d}"
    );
}

/// The gradient of `log p(target)` wrt the input against central finite differences of the
/// metric, with Richardson's extrapolation cancelling their h² error.
struct FiniteDifferences<'a> {
    model: &'a Model,
    g: &'a Gradient,
    metric: Metric,
    /// `|∂f/∂x|`
    norm: f64,
    /// the input's root mean square
    xrms: f64,
    /// each input row's root mean square
    row_rms: Vec<f64>,
}

impl<'a> FiniteDifferences<'a> {
    fn new(model: &'a Model, g: &'a Gradient) -> Self {
        let l2 = |v: &[f32]| v.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
        let dm = model.dims.d_model;
        FiniteDifferences {
            model,
            g,
            metric: Metric::LogProb(Some(g.target)),
            norm: l2(&g.grad_input),
            xrms: l2(&g.input) / (g.input.len() as f64).sqrt(),
            row_rms: g
                .input
                .chunks(dm)
                .map(|r| (r.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / dm as f64).sqrt())
                .collect(),
        }
    }

    fn f(&self, x: &[f32]) -> f64 {
        self.model.gradient_from(x, self.metric).unwrap().value as f64
    }

    /// `(4·cd(h/2) − cd(h)) / 3` of the central difference `cd`.
    fn richardson(h: f64, cd: impl Fn(f64) -> f64) -> f64 {
        (4.0 * cd(h / 2.0) - cd(h)) / 3.0
    }

    /// Along a fixed pseudo-random direction u of ±1 entries (scaled by each row's rms: an input
    /// row may be small, and a norm is steep there): the finite difference, the backward's
    /// `g · u`, and their difference relative to `|g||u|`.
    fn directional(&self, label: &str) -> (f64, f64, f64) {
        let (g, dm) = (self.g, self.model.dims.d_model);
        let u: Vec<f64> = (0..g.input.len())
            .map(|i| {
                let s = if (i * 2654435761usize) >> 7 & 1 == 0 {
                    1.0
                } else {
                    -1.0
                };
                s * self.row_rms[i / dm] / self.xrms
            })
            .collect();
        let step = |s: f64| -> Vec<f32> {
            g.input
                .iter()
                .zip(&u)
                .map(|(x, d)| (*x as f64 + s * d) as f32)
                .collect()
        };
        let cd = |h: f64| (self.f(&step(h)) - self.f(&step(-h))) / (2.0 * h);
        let fd = Self::richardson(1e-3 * self.xrms, cd);
        let an: f64 = g
            .grad_input
            .iter()
            .zip(&u)
            .map(|(a, b)| *a as f64 * b)
            .sum();
        let bound = self.norm * u.iter().map(|v| v * v).sum::<f64>().sqrt();
        let rel = (fd - an).abs() / bound;
        eprintln!("{label}: directional derivative fd {fd:.6e} vs backward {an:.6e} (error {rel:.1e} of |g||u|)");
        (fd, an, rel)
    }

    /// Single coordinates, the largest few and a few others: the worst error against the
    /// largest value.
    fn worst_coordinate_error(&self, label: &str) -> f64 {
        let (g, dm) = (self.g, self.model.dims.d_model);
        let gmax = g.grad_input.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        let mut idx: Vec<usize> = (0..g.grad_input.len()).collect();
        idx.sort_by(|&a, &b| g.grad_input[b].abs().total_cmp(&g.grad_input[a].abs()));
        let mut pick: Vec<usize> = idx[..4].to_vec();
        pick.extend((0..6).map(|i| (i * 7919 + 13) % g.grad_input.len()));
        let mut worst = 0f64;
        for &i in &pick {
            let cd = |hh: f64| {
                let mut a = g.input.clone();
                let mut b = g.input.clone();
                a[i] += hh as f32;
                b[i] -= hh as f32;
                (self.f(&a) - self.f(&b)) / (2.0 * hh)
            };
            let fd = Self::richardson(1e-3 * self.row_rms[i / dm], cd);
            worst = worst.max((fd - g.grad_input[i] as f64).abs() / gmax);
        }
        eprintln!("{label}: worst coordinate error {worst:.1e} of the largest gradient {gmax:.3e}");
        worst
    }
}

/// A logit difference's value equals the engine's logits' difference.
fn check_logit_difference_value(
    model: &Model,
    tokens: &[u32],
    g: &Gradient,
    want: &[f32],
    scale: f32,
) {
    let wrong = (g.target + 1) % model.dims.vocab_size as u32;
    let ld = model
        .gradient(
            tokens,
            Metric::LogitDiff {
                answer: g.target,
                wrong,
            },
        )
        .unwrap();
    assert!(
        (ld.value - (want[g.target as usize] - want[wrong as usize])).abs() < 1e-3 * scale.max(1.0)
    );
}

#[test]
fn tiny_models_against_finite_differences() {
    for arch in [Arch::Qwen2, Arch::Llama] {
        let (_d, model) = tiny(arch);
        check(&model, &TOKENS, &format!("tiny {arch:?}"));
    }
}

#[test]
fn family_fixtures_against_finite_differences() {
    for name in [
        "gpt2", "llama3", "mistral", "phi3", "qwen3", "gemma3", "gemma2",
    ] {
        let model = family(name);
        check(&model, &TOKENS, name);
    }
}

/// `max |got − want| / max |want|`, printed.
fn rel_err(got: &[f32], want: &[f64], label: &str) -> f64 {
    assert_eq!(got.len(), want.len(), "{label}: lengths");
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).abs())
        // a NaN is the largest error, never dropped
        .fold(
            0f64,
            |m, e| if e.is_nan() { f64::INFINITY } else { m.max(e) },
        );
    let rel = err / scale.max(1e-30);
    eprintln!("{label}: worst |error| {err:.3e}, {rel:.2e} of the largest value {scale:.3e}");
    rel
}

fn flat(v: &serde_json::Value) -> Vec<f64> {
    match v {
        serde_json::Value::Array(a) => a.iter().flat_map(flat).collect(),
        serde_json::Value::Number(n) => vec![n.as_f64().unwrap()],
        _ => panic!("not a number array"),
    }
}

/// The gradients of the lesson sentence against torch autograd (../shared/reference's
/// gradient_ref.py), and integrated gradients (33 backward passes) against
/// [`common::ig_reference`]'s reference within its bound.
fn against_autograd(alias: &str, short: &str) {
    let model = common::real_model(alias);
    let refj = common::golden_json(&format!("{short}_gradients.json"));
    let r = &refj["texts"]["lesson"];
    let ids: Vec<u32> = flat(&r["token_ids"]).iter().map(|&v| v as u32).collect();
    let g = timed_gradient(model, &ids, short);
    assert_eq!(
        g.target as f64,
        r["target_id"].as_f64().unwrap(),
        "{short}: target"
    );
    let lp = r["logprob"].as_f64().unwrap();
    eprintln!("{short}: logprob {} vs {lp}", g.logprob);
    let worst = worst_gradient_error(&g, model.dims.d_model, r, short);
    assert!((g.logprob as f64 - lp).abs() < 1e-2, "{short}: logprob");
    assert!(worst < 1e-3, "{short}: worst relative error {worst:.2e}");
    let (want, bound) = common::ig_reference(short, r);
    let err = integrated_gradients_error(model, &ids, &want, short);
    assert!(
        err < bound,
        "{short}: integrated gradients' relative error {err:.2e} (bound {bound:.0e})"
    );
}

/// The gradient of log p(top next token) for `ids`, its time printed next to a forward's.
fn timed_gradient(model: &Model, ids: &[u32], short: &str) -> Gradient {
    let t0 = std::time::Instant::now();
    let g = model.gradient(ids, Metric::LogProb(None)).unwrap();
    let fb = t0.elapsed();
    let t0 = std::time::Instant::now();
    model.next_token_logits(ids).unwrap();
    eprintln!(
        "{short}: {} tokens, forward + backward {:.2}s, forward {:.3}s",
        ids.len(),
        fb.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
    g
}

/// The worst relative error of the input gradient's per-token L2 norms and gradient × input, of
/// each layer's `resid_pre` gradient norms and of the last row's pattern gradients against the
/// reference `r`.
fn worst_gradient_error(g: &Gradient, dm: usize, r: &serde_json::Value, short: &str) -> f64 {
    let row_norms = |x: &[f32]| -> Vec<f32> {
        x.chunks(dm)
            .map(|r| r.iter().map(|v| v * v).sum::<f32>().sqrt())
            .collect()
    };
    let l2 = row_norms(&g.grad_input);
    let gxi: Vec<f32> = g
        .grad_input
        .chunks(dm)
        .zip(g.input.chunks(dm))
        .map(|(a, b)| a.iter().zip(b).map(|(a, b)| a * b).sum())
        .collect();
    let resid: Vec<f32> = g.grad_resid_pre.iter().flat_map(|l| row_norms(l)).collect();
    let pat: Vec<f32> = g.grad_pattern_last.concat();
    [
        (&l2, "grad_input_l2"),
        (&gxi, "grad_input_gxi"),
        (&resid, "grad_resid_pre_l2"),
        (&pat, "grad_pattern_last"),
    ]
    .iter()
    .map(|(got, key)| rel_err(got, &flat(&r[*key]), &format!("{short} {key}")))
    .fold(0f64, |a, b| a.max(b))
}

/// Integrated gradients (32 steps) against the reference's, their relative error.
fn integrated_gradients_error(
    model: &Model,
    ids: &[u32],
    r: &serde_json::Value,
    short: &str,
) -> f64 {
    let t0 = std::time::Instant::now();
    let igr = model
        .integrated_gradients(ids, Metric::LogProb(None), 32, &mut |_| {})
        .unwrap();
    eprintln!(
        "{short}: integrated gradients (32 steps) {:.1}s, gap {} vs {}",
        t0.elapsed().as_secs_f64(),
        igr.gap,
        r["ig_completeness_gap"]
    );
    rel_err(&igr.scores, &flat(&r["ig"]), &format!("{short} ig"))
}

#[test]
fn smol_against_autograd() {
    against_autograd("smollm2-135m", "smol");
}

#[test]
fn qwen_against_autograd() {
    against_autograd("qwen2.5-coder-0.5b", "qwen");
}

#[test]
fn gemma_against_autograd() {
    against_autograd("gemma3-270m", "gemma");
}

/// The batched forward and backward (`Model::gradient_batch`: several inputs of one length as
/// stacked rows) gives each input the gradient its own run gives, and integrated gradients with
/// their steps batched (7 steps, 3 at a time: a short last batch) equal the step-by-step ones
/// within 1e-5 of the largest score, on the tiny models and the family fixtures (soft-caps,
/// sliding windows, q/k norms, learned positions).
#[test]
fn batched_steps_equal_step_by_step() {
    let (_d, qwen) = tiny(Arch::Qwen2);
    let mut models = vec![("tiny qwen2".to_string(), qwen)];
    for name in ["gpt2", "gemma3", "qwen3"] {
        models.push((name.to_string(), family(name)));
    }
    for (label, model) in &models {
        let tokens: Vec<u32> = TOKENS
            .iter()
            .map(|&t| t % model.dims.vocab_size as u32)
            .collect();
        let (x, _) = model.input_embeddings(&tokens).unwrap();
        let alphas = [0.25f32, 1.0, 0.6];
        let xs: Vec<f32> = alphas
            .iter()
            .flat_map(|a| x.iter().map(move |v| v * a))
            .collect();
        let metric = Metric::LogProb(Some(7));
        let batched = model.gradient_batch(&xs, alphas.len(), metric).unwrap();
        assert_eq!(batched.len(), alphas.len());
        // stacked inputs that are not whole sequences of whole rows: an error, not a panic
        for (cut, batch) in [(1, 3), (0, 2), (0, 0)] {
            let err = model
                .gradient_batch(&xs[..xs.len() - cut], batch, metric)
                .unwrap_err();
            assert!(
                matches!(err, attnscope::model::Error::OutOfRange { .. }),
                "{label}: {err}"
            );
        }
        for (a, got) in alphas.iter().zip(&batched) {
            let xa: Vec<f32> = x.iter().map(|v| v * a).collect();
            let want = model.gradient_from(&xa, metric).unwrap();
            assert_eq!(got.target, want.target, "{label} α {a}");
            assert!(
                (got.value - want.value).abs() <= 1e-5 * want.value.abs().max(1.0),
                "{label} α {a}: value {} vs {}",
                got.value,
                want.value
            );
            let want64: Vec<f64> = want.grad_input.iter().map(|&v| v as f64).collect();
            let err = rel_err(&got.grad_input, &want64, &format!("{label} α {a} batched"));
            assert!(err < 1e-5, "{label} α {a}: batched gradient {err:.2e} off");
        }
        let one = model
            .integrated_gradients_batched(&tokens, Metric::LogProb(None), 7, 1, &mut |_| {})
            .unwrap();
        let mut seen = Vec::new();
        let three = model
            .integrated_gradients_batched(&tokens, Metric::LogProb(None), 7, 3, &mut |k| {
                seen.push(k)
            })
            .unwrap();
        assert_eq!(
            seen,
            (1..=7).collect::<Vec<_>>(),
            "{label}: progress per step"
        );
        assert_eq!(one.target, three.target);
        let want64: Vec<f64> = one.scores.iter().map(|&v| v as f64).collect();
        let err = rel_err(&three.scores, &want64, &format!("{label} IG batched"));
        assert!(err < 1e-5, "{label}: batched IG {err:.2e} off step-by-step");
        assert!((one.gap - three.gap).abs() < 1e-5 * one.gap.abs().max(1.0));
    }
}

/// GPT-2's `hook_pos_embed_grad` (and `hook_embed_grad`) on the tiny GPT-2 fixture against
/// torch autograd through transformers' GPT2LMHeadModel, the gradient of log p(top next token)
/// with respect to `wpe(positions)` and `wte(tokens)` (tests/golden/gpt2_pos_embed_grad.json,
/// make_gemma_hookgrad_golden.py).
#[test]
fn gpt2_pos_embed_gradient_matches_torch() {
    use attnscope::model::backward::GradMetric;
    let model = family("gpt2");
    let g = common::golden_json("gpt2_pos_embed_grad.json");
    let tokens = common::token_ids(&g["tokens"]);
    let h = model
        .hook_gradients(&tokens, GradMetric::Metric(Metric::LogProb(None)), &|n| {
            n == "hook_pos_embed" || n == "hook_embed"
        })
        .unwrap();
    assert_eq!(h.target as u64, g["target_id"].as_u64().unwrap());
    let lp = g["logprob"].as_f64().unwrap();
    assert!((h.value as f64 - lp).abs() < 1e-5, "{} vs {lp}", h.value);
    assert_eq!(h.grads.len(), 2, "hook_embed_grad and hook_pos_embed_grad");
    for (name, key) in [
        ("hook_pos_embed_grad", "pos_embed_grad"),
        ("hook_embed_grad", "embed_grad"),
    ] {
        let (_, shape, got) = h.grads.iter().find(|(k, _, _)| k == name).unwrap();
        assert_eq!(shape, &[tokens.len(), model.dims.d_model], "{name}");
        let err = rel_err(got, &flat(&g[key]), name);
        assert!(err < 1e-4, "{name}: {err:.2e} of the largest off torch");
    }
}
