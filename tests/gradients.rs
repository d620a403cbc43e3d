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
    fd.worst_coordinate_error(label);
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
        // |g · u| <= |g restricted to u's support| |u| (a row of zeros has u = 0 there, and its
        // gradient, 1/√ε large, would otherwise loosen the check)
        let g_on_u = g
            .grad_input
            .iter()
            .zip(&u)
            .filter(|(_, d)| **d != 0.0)
            .map(|(a, _)| (*a as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        let bound = g_on_u * u.iter().map(|v| v * v).sum::<f64>().sqrt();
        let rel = (fd - an).abs() / bound;
        eprintln!("{label}: directional derivative fd {fd:.6e} vs backward {an:.6e} (error {rel:.1e} of |g||u|)");
        (fd, an, rel)
    }

    /// Single coordinates, the largest few and a few others: the worst error against the
    /// largest value (both outside rows of zeros).
    fn worst_coordinate_error(&self, label: &str) -> f64 {
        let (g, dm) = (self.g, self.model.dims.d_model);
        // not in a row of zeros (the fixtures' padding token 256): the norm of x at x = 0 has
        // the slope 1/√ε but is linear only within ~√ε of it, so a finite difference there
        // measures the saturated norm, not the slope (and a step of the row's scale is 0)
        let mut idx: Vec<usize> = (0..g.grad_input.len())
            .filter(|&i| self.row_rms[i / dm] > 0.0)
            .collect();
        idx.sort_by(|&a, &b| g.grad_input[b].abs().total_cmp(&g.grad_input[a].abs()));
        let gmax = g.grad_input[idx[0]].abs() as f64;
        let mut pick: Vec<usize> = idx[..4].to_vec();
        pick.extend((0..6).map(|i| idx[(i * 7919 + 13) % idx.len()]));
        // a pseudo-random pick may be one of the largest (mistral's coordinate 440): once each
        pick.sort_unstable();
        pick.dedup();
        let (mut got, mut want) = (Vec::new(), Vec::new());
        for &i in &pick {
            let cd = |hh: f64| {
                let mut a = g.input.clone();
                let mut b = g.input.clone();
                a[i] += hh as f32;
                b[i] -= hh as f32;
                (self.f(&a) - self.f(&b)) / (2.0 * hh)
            };
            // a step of 1% of the row's scale: at 0.1% the f32 forward's rounding of log p (an
            // ulp of logits near 10) is ~7% of the gemma3 fixture's smaller gradients (its target
            // is near certain), while Richardson keeps the truncation error under 1.5e-4 of the
            // largest gradient at 1% (measured in float64 with torch)
            let fd = Self::richardson(1e-2 * self.row_rms[i / dm], cd);
            // relative to the largest gradient, on both sides
            got.push((i, g.grad_input[i] as f64 / gmax));
            want.push((i, fd / gmax));
        }
        common::assert_cells(
            &format!("{label}: ∂ log p/∂x [coordinate] / max |∂ log p/∂x|, vs finite differences"),
            got,
            want,
            common::Bound::Abs(2e-2),
        )
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

/// The bound against torch autograd, relative to the largest value of each score list
/// (docs/commands/attribute.md gives the measured figures; the worst, Qwen2.5's gradient ×
/// input, 5.9e-5).
const AUTOGRAD: f64 = 3e-4;

/// `got` against a JSON reference cell by cell, within `rel` of the reference's largest value.
fn assert_rel(label: &str, got: &[f32], want: &serde_json::Value, rel: f64) {
    common::assert_json(label, got, want, common::Bound::RelMax(rel));
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
    common::assert_cells(
        &format!("{short}: log p of the target"),
        [((), g.logprob as f64)],
        [((), r["logprob"].as_f64().unwrap())],
        common::Bound::Abs(1e-4),
    );
    check_gradients(&g, model.dims.d_model, r, short);
    let (want, bound) = common::ig_reference(short, r);
    check_integrated_gradients(model, &ids, &want, short, bound);
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

/// The input gradient's per-token L2 norms and gradient × input, each layer's `resid_pre`
/// gradient norms and the last row's pattern gradients against the reference `r`, within
/// [`AUTOGRAD`] of each one's largest value.
fn check_gradients(g: &Gradient, dm: usize, r: &serde_json::Value, short: &str) {
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
    for (got, key) in [
        (&l2, "grad_input_l2"),
        (&gxi, "grad_input_gxi"),
        (&resid, "grad_resid_pre_l2"),
        (&pat, "grad_pattern_last"),
    ] {
        assert_rel(
            &format!("{short} {key} vs autograd"),
            got,
            &r[key],
            AUTOGRAD,
        );
    }
}

/// Integrated gradients (32 steps) against the reference's, within `bound` of the largest score
/// ([`common::ig_reference`]: torch autograd's f32, or float64 autograd's for Qwen2.5).
fn check_integrated_gradients(
    model: &Model,
    ids: &[u32],
    r: &serde_json::Value,
    short: &str,
    bound: f64,
) {
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
    assert_rel(
        &format!("{short} ig vs autograd"),
        &igr.scores,
        &r["ig"],
        bound,
    );
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
            let n = want.grad_input.len();
            common::assert_array(
                &format!("{label} α {a}: batched gradient vs its own run"),
                &[n],
                &got.grad_input,
                &want.grad_input,
                common::Bound::RelMax(1e-5),
            );
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
        common::assert_array(
            &format!("{label}: IG batched vs step by step"),
            &[one.scores.len()],
            &three.scores,
            &one.scores,
            common::Bound::RelMax(1e-5),
        );
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
        assert_rel(&format!("gpt2 {name} vs torch"), got, &g[key], 1e-4);
    }
}
