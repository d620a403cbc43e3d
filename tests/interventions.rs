//! Interventions: editing hooks on tiny models (edits whose result is known by hand), and
//! ablation and activation patching on the real models against transformers with torch hooks
//! (tests/golden/<m>_interventions.json, from ../shared/reference/scripts/interventions_ref.py).
#![allow(clippy::needless_range_loop)]

mod common;
use attnscope::analysis::edit::{Editor, Fill, Patch, Runner, Variant};
use attnscope::analysis::intervene::{
    ablate, check_logit_diff_gap, patch, AblateMethod, AblateOptions, PatchOptions,
};
use attnscope::analysis::vocab::PatchHook;
use attnscope::analysis::vocab::Target;
use attnscope::model::capture::{AttnCache, CaptureSpec, Hook, Observer, Queries};
use attnscope::model::forward::{Resume, RunOptions, Segment};
use attnscope::model::tiny::{tiny_model, write_gguf};
use attnscope::model::{Arch, Error, Model, Precision};
use candle_core::quantized::GgmlDType;
use common::*;
use std::ops::Range;

const TOKENS: [u32; 9] = [72, 101, 108, 108, 111, 32, 256, 258, 259];

fn tiny(arch: Arch) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    write_gguf(&tiny_model(arch, 11), arch, GgmlDType::F32, &path).unwrap();
    let model = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
    (dir, model)
}

fn all_of(hooks: &[Hook], n: usize) -> AttnCache {
    AttnCache::new(
        &CaptureSpec {
            hooks: hooks.to_vec(),
            layers: None,
            heads: None,
            queries: Queries::All,
        },
        n,
    )
}

fn last_logits(model: &Model, obs: &mut dyn Observer) -> Result<Vec<f32>, Error> {
    let n = TOKENS.len();
    Ok(model
        .forward(&TOKENS, &RunOptions::last_logits(n), obs)?
        .logits
        .remove(0))
}

/// What edits a run's hooks: an [`Editor`], or [`OneHook`]'s function.
trait Edits {
    fn edits(&self, l: usize, h: Hook) -> bool;
    fn edit(&mut self, l: usize, h: Hook, s: &[usize], d: &mut [f32]) -> Result<(), String>;
}

impl Edits for Editor<'_> {
    fn edits(&self, l: usize, h: Hook) -> bool {
        Observer::edits(self, l, h)
    }
    fn edit(&mut self, l: usize, h: Hook, s: &[usize], d: &mut [f32]) -> Result<(), String> {
        Observer::edit(self, l, h, s, d)
    }
}

/// Captures `watch` while `edit` edits (one observer over both).
struct EditAndWatch<E> {
    edit: E,
    watch: AttnCache,
}

impl<E: Edits> Observer for EditAndWatch<E> {
    fn wants(&self, l: usize, h: Hook) -> bool {
        self.watch.wants(l, h)
    }
    fn tensor(&mut self, l: usize, h: Hook, shape: &[usize], data: &[f32]) {
        self.watch.tensor(l, h, shape, data)
    }
    fn attention_block(&mut self, l: usize, h: Hook, q: usize, shape: [usize; 3], d: &[f32]) {
        self.watch.attention_block(l, h, q, shape, d)
    }
    fn edits(&self, l: usize, h: Hook) -> bool {
        self.edit.edits(l, h)
    }
    fn edit(&mut self, l: usize, h: Hook, s: &[usize], d: &mut [f32]) -> Result<(), String> {
        self.edit.edit(l, h, s, d)
    }
}

/// An edit that writes what was there changes no bit; resuming at a layer from the clean
/// residual gives the clean run's logits bit for bit.
#[test]
fn a_no_op_edit_and_a_resumed_run_change_no_bit() {
    let mut models: Vec<(String, Model)> = Vec::new();
    let mut dirs = Vec::new();
    for arch in [Arch::Qwen2, Arch::Llama] {
        let (d, model) = tiny(arch);
        dirs.push(d);
        models.push((format!("{arch:?}"), model));
    }
    // every other family, from the fixtures (Gemma's post-norms and scaled embeddings, Phi-3's
    // fused projections, GPT-2's biases and learned positions, Qwen3's q/k norms)
    for fam in [
        "gemma2", "gemma3", "gpt2", "llama3", "mistral", "phi3", "qwen3",
    ] {
        let dir = golden(&format!("arch/{fam}"));
        let model = Model::load(dir.to_str().unwrap(), Precision::Exact, false).unwrap();
        models.push((fam.to_string(), model));
    }
    for (arch, model) in &models {
        let model = &model;
        let n = TOKENS.len();
        let mut clean = all_of(&[Hook::ResidPre], n);
        let base = last_logits(model, &mut clean).unwrap();
        // (an edited hook_result replaces the output projection by the sum of the heads' parts:
        // the same numbers in another order, checked to 1e-5 in its own test)
        for hook in Hook::ALL
            .into_iter()
            .chain(Hook::GLOBAL)
            .filter(|&h| !h.is_attention_map() && h != Hook::Result)
        {
            for layer in 0..model.dims.n_layers {
                // a patch with no rows to write: the hook is handed over live, nothing written
                let mut e = Editor {
                    layer,
                    hook,
                    patches: vec![Patch {
                        rows: 0..n,
                        cols: 0..1,
                        at: vec![],
                        fill: Fill::Zero,
                    }],
                };
                let got = last_logits(model, &mut e).unwrap();
                assert_eq!(
                    got, base,
                    "{arch}: a no-op edit of {hook:?} at layer {layer}"
                );
            }
        }
        for layer in 0..model.dims.n_layers {
            let seg = Segment {
                tokens: &TOKENS,
                reuse: 0,
                knockout: vec![],
                logits_at: vec![n - 1],
            };
            let resid = clean.get(layer, Hook::ResidPre).unwrap().data.clone();
            let out = model
                .forward_segments(
                    None,
                    &[seg],
                    Some(Resume { layer, resid }),
                    &RunOptions::default(),
                    &mut attnscope::model::capture::NoCapture,
                )
                .unwrap();
            assert_eq!(out.logits[0], base, "{arch}: resumed at layer {layer}");
        }
    }
}

/// The models of every family: the two tiny ones the tests write and the fixtures.
fn every_family() -> (Vec<tempfile::TempDir>, Vec<(String, Model)>) {
    let mut models: Vec<(String, Model)> = Vec::new();
    let mut dirs = Vec::new();
    for arch in [Arch::Qwen2, Arch::Llama] {
        let (d, model) = tiny(arch);
        dirs.push(d);
        models.push((format!("{arch:?}"), model));
    }
    for fam in ["gemma2", "gemma3", "gpt2", "phi3", "qwen3"] {
        let dir = golden(&format!("arch/{fam}"));
        let model = Model::load(dir.to_str().unwrap(), Precision::Exact, false).unwrap();
        models.push((fam.to_string(), model));
    }
    (dirs, models)
}

/// Edits one hook with a function.
struct OneHook<'a> {
    layer: usize,
    hook: Hook,
    f: &'a dyn Fn(&mut [f32]),
}

impl Edits for OneHook<'_> {
    fn edits(&self, l: usize, h: Hook) -> bool {
        (l, h) == (self.layer, self.hook)
    }
    fn edit(&mut self, _: usize, _: Hook, _: &[usize], d: &mut [f32]) -> Result<(), String> {
        (self.f)(d);
        Ok(())
    }
}

/// An observer that edits `hook` of `layer` with `f` (and captures what `watch` asks).
fn with<'a>(
    layer: usize,
    hook: Hook,
    f: &'a dyn Fn(&mut [f32]),
    watch: AttnCache,
) -> EditAndWatch<OneHook<'a>> {
    EditAndWatch {
        edit: OneHook { layer, hook, f },
        watch,
    }
}

/// Zeroes every value a hook hands over (a function for [`with`]).
fn zero(d: &mut [f32]) {
    d.iter_mut().for_each(|v| *v = 0.0);
}

/// Whether every value `c` captured of `hook` at `layer` is 0.
fn all_zero(c: &AttnCache, layer: usize, hook: Hook) -> bool {
    c.get(layer, hook).unwrap().data.iter().all(|&v| v == 0.0)
}

/// An [`Editor`] of `hook` at `layer` over the whole of [`TOKENS`] that writes `fill` to values
/// `cols` of positions `at`.
fn edit_rows<'a>(
    layer: usize,
    hook: Hook,
    cols: Range<usize>,
    at: Vec<usize>,
    fill: Fill<'a>,
) -> Editor<'a> {
    Editor {
        layer,
        hook,
        patches: vec![Patch {
            rows: 0..TOKENS.len(),
            cols,
            at,
            fill,
        }],
    }
}

/// TransformerLens's hooks outside attention: hook_embed (+ hook_pos_embed) is resid_pre of
/// layer 0; ln1/ln2/ln_final's hook_scale is sqrt(mean(x²) + eps) (LayerNorm: of the centered
/// x) and hook_normalized · hook_scale gives x back; reading them changes no bit of the logits.
#[test]
fn embedding_and_norm_hooks_are_what_they_say() {
    let (_dirs, models) = every_family();
    let n = TOKENS.len();
    for (arch, model) in &models {
        let (dm, nl) = (model.dims.d_model, model.dims.n_layers);
        let gpt2 = model.dims.arch == Arch::Gpt2;
        let base = last_logits(model, &mut attnscope::model::capture::NoCapture).unwrap();
        let all: Vec<Hook> = Hook::ALL.into_iter().chain(Hook::GLOBAL).collect();
        let mut c = all_of(&all, n);
        assert_eq!(
            last_logits(model, &mut c).unwrap(),
            base,
            "{arch}: reading changes no bit"
        );
        let embed = &c.get(0, Hook::Embed).unwrap().data;
        let resid0 = &c.get(0, Hook::ResidPre).unwrap().data;
        match c.get(0, Hook::PosEmbed) {
            Some(pos) => {
                assert!(gpt2, "{arch}: only learned positions have hook_pos_embed");
                let sum: Vec<f32> = embed.iter().zip(&pos.data).map(|(a, b)| a + b).collect();
                assert_eq!(&sum, resid0, "{arch}");
            }
            None => {
                assert!(!gpt2, "{arch}: GPT-2 hands hook_pos_embed");
                assert_eq!(embed, resid0, "{arch}");
            }
        }
        // a global hook has its bare name, at its own layer only
        assert_eq!(c.get(0, Hook::Embed).unwrap().name, "hook_embed");
        assert!(c.get(1, Hook::Embed).is_none());
        let fin = c.get(nl - 1, Hook::LnFinalNormalized).unwrap();
        assert_eq!(
            (fin.name.as_str(), fin.shape.clone()),
            ("ln_final.hook_normalized", vec![n, dm])
        );
        let checks = (0..nl)
            .flat_map(|l| {
                [
                    (l, Hook::ResidPre, Hook::Ln1Scale, Hook::Ln1Normalized),
                    (l, Hook::ResidMid, Hook::Ln2Scale, Hook::Ln2Normalized),
                ]
            })
            .chain([(
                nl - 1,
                Hook::ResidPost,
                Hook::LnFinalScale,
                Hook::LnFinalNormalized,
            )]);
        for (l, input, scale, normalized) in checks {
            let x = &c.get(l, input).unwrap().data;
            let s = c.get(l, scale).unwrap();
            assert_eq!(s.shape, vec![n, 1], "{arch} {scale:?}");
            let y = &c.get(l, normalized).unwrap().data;
            for r in 0..n {
                let row = &x[r * dm..(r + 1) * dm];
                let mean = if gpt2 {
                    row.iter().map(|&v| v as f64).sum::<f64>() / dm as f64
                } else {
                    0.0
                };
                let ms = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / dm as f64;
                let want = (ms + model.dims.rms_eps as f64).sqrt();
                let got = s.data[r] as f64;
                assert!(
                    (got - want).abs() <= 1e-5 * want,
                    "{arch} layer {l} {scale:?} row {r}: {got} vs {want}"
                );
                for j in 0..dm {
                    let back = y[r * dm + j] as f64 * got + mean;
                    let err = (back - row[j] as f64).abs();
                    assert!(
                        err <= 1e-4 * (1.0 + row[j].abs() as f64),
                        "{arch} layer {l} {normalized:?} [{r},{j}]"
                    );
                }
            }
        }
    }
}

/// Edits at the new hooks, whose results are known by hand: ln_final.hook_normalized zeroed
/// leaves logits of 0 (no final bias, no output bias); mlp.hook_pre_linear zeroed makes the
/// gated MLP add nothing; ln1.hook_scale doubled halves ln1.hook_normalized; hook_embed zeroed
/// leaves GPT-2 its positions alone.
#[test]
fn edits_at_the_norm_embedding_and_up_projection_hooks() {
    let (_dirs, models) = every_family();
    for (arch, model) in &models {
        let gpt2 = model.dims.arch == Arch::Gpt2;
        if matches!(arch.as_str(), "Qwen2" | "Llama") {
            zeroed_final_norm_leaves_logits_of_zero(arch, model);
        }
        if !gpt2 {
            zeroed_up_projection_input_adds_no_mlp(arch, model);
        }
        doubled_ln1_scale_halves_ln1_normalized(arch, model);
        if gpt2 {
            zeroed_embedding_leaves_the_positions(model);
        }
    }
}

/// ln_final.hook_normalized zeroed leaves logits of 0 (the tiny models have no final bias and
/// no output bias).
fn zeroed_final_norm_leaves_logits_of_zero(arch: &str, model: &Model) {
    let n = TOKENS.len();
    let nl = model.dims.n_layers;
    let mut e = with(nl - 1, Hook::LnFinalNormalized, &zero, all_of(&[], n));
    let got = last_logits(model, &mut e).unwrap();
    assert!(
        got.iter().all(|&z| z == 0.0),
        "{arch}: logits of a zeroed final norm"
    );
}

/// mlp.hook_pre_linear zeroed at layer 0: the gated MLP's activation and its output are 0.
fn zeroed_up_projection_input_adds_no_mlp(arch: &str, model: &Model) {
    let n = TOKENS.len();
    let watch = all_of(&[Hook::MlpPost, Hook::MlpOut], n);
    let mut e = with(0, Hook::MlpPreLinear, &zero, watch);
    last_logits(model, &mut e).unwrap();
    assert!(all_zero(&e.watch, 0, Hook::MlpPost), "{arch}");
    // no family but GPT-2 has an MLP bias; Gemma's post-norm of zeros is zeros
    assert!(all_zero(&e.watch, 0, Hook::MlpOut), "{arch}");
}

/// ln1.hook_scale doubled at layer 1 halves ln1.hook_normalized there, and changes the logits.
fn doubled_ln1_scale_halves_ln1_normalized(arch: &str, model: &Model) {
    let n = TOKENS.len();
    let mut clean = all_of(&[Hook::Ln1Normalized], n);
    last_logits(model, &mut clean).unwrap();
    let double = |d: &mut [f32]| d.iter_mut().for_each(|v| *v *= 2.0);
    let mut e = with(
        1,
        Hook::Ln1Scale,
        &double,
        all_of(&[Hook::Ln1Normalized], n),
    );
    let edited = last_logits(model, &mut e).unwrap();
    let (a, b) = (
        &clean.get(1, Hook::Ln1Normalized).unwrap().data,
        &e.watch.get(1, Hook::Ln1Normalized).unwrap().data,
    );
    for (x, y) in a.iter().zip(b.iter()) {
        assert!(
            (x / 2.0 - y).abs() <= 1e-6 * (1.0 + x.abs()),
            "{arch}: halved"
        );
    }
    assert_ne!(
        edited,
        last_logits(model, &mut attnscope::model::capture::NoCapture).unwrap(),
        "{arch}"
    );
}

/// hook_embed zeroed leaves GPT-2 its learned positions alone: resid_pre is hook_pos_embed.
fn zeroed_embedding_leaves_the_positions(model: &Model) {
    let n = TOKENS.len();
    let dm = model.dims.d_model;
    let watch = all_of(&[Hook::PosEmbed, Hook::ResidPre], n);
    let mut e = with(0, Hook::Embed, &zero, watch);
    last_logits(model, &mut e).unwrap();
    assert_eq!(
        e.watch.get(0, Hook::PosEmbed).unwrap().data,
        e.watch.get(0, Hook::ResidPre).unwrap().data
    );
    assert_eq!(e.watch.get(0, Hook::ResidPre).unwrap().shape, vec![n, dm]);
}

/// attn.hook_result: each head's z through its slice of W_O; the heads' parts plus W_O's bias
/// are hook_attn_out (before Gemma's post-norm); zeroing one head's part equals zeroing its z.
#[test]
fn head_results_add_up_and_editing_them_ablates_the_head() {
    let (_dirs, models) = every_family();
    let n = TOKENS.len();
    for (arch, model) in &models {
        let (dm, nh, hd, nl) = (
            model.dims.d_model,
            model.dims.n_heads,
            model.dims.head_dim,
            model.dims.n_layers,
        );
        let mut c = all_of(&[Hook::Result, Hook::AttnOut, Hook::Z], n);
        let base = last_logits(model, &mut c).unwrap();
        assert_eq!(
            base,
            last_logits(model, &mut attnscope::model::capture::NoCapture).unwrap(),
            "{arch}: reading hook_result changes no bit"
        );
        for l in 0..nl {
            let r = c.get(l, Hook::Result).unwrap();
            assert_eq!(
                (r.name.clone(), r.shape.clone()),
                (format!("blocks.{l}.attn.hook_result"), vec![n, nh, dm])
            );
            if model.has_post_norms() {
                continue;
            }
            let (_, bias) = model
                .head_results(l, &c.get(l, Hook::Z).unwrap().data, n)
                .unwrap();
            let out = &c.get(l, Hook::AttnOut).unwrap().data;
            for p in 0..n {
                for j in 0..dm {
                    let sum: f32 =
                        (0..nh).map(|h| r.data[(p * nh + h) * dm + j]).sum::<f32>() + bias[j];
                    let want = out[p * dm + j];
                    assert!(
                        (sum - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{arch} layer {l} [{p},{j}]: {sum} vs {want}"
                    );
                }
            }
        }
        let (l, h) = (1, 2);
        let ablate = |hook: Hook, width: usize| {
            let mut e = Editor {
                layer: l,
                hook,
                patches: vec![Patch {
                    rows: 0..n,
                    cols: h * width..(h + 1) * width,
                    at: (0..n).collect(),
                    fill: Fill::Zero,
                }],
            };
            last_logits(model, &mut e).unwrap()
        };
        let (by_z, by_result) = (ablate(Hook::Z, hd), ablate(Hook::Result, dm));
        assert_ne!(by_z, base, "{arch}: the head matters");
        for (a, b) in by_z.iter().zip(&by_result) {
            assert!(
                (a - b).abs() <= 1e-4 * (1.0 + a.abs()),
                "{arch}: {a} vs {b}"
            );
        }
    }
}

/// Zeroing every head's output at a layer leaves nothing for W_O to add (these models have no
/// o_proj bias): hook_resid_mid equals hook_resid_pre there; and hook_resid_post is always
/// hook_resid_mid + hook_mlp_out, which is hook_resid_pre + hook_attn_out + hook_mlp_out.
#[test]
fn zeroed_heads_add_nothing_and_the_residual_adds_up() {
    let (_d, model) = tiny(Arch::Qwen2);
    let mut clean = all_of(&RESIDUAL_HOOKS, TOKENS.len());
    last_logits(&model, &mut clean).unwrap();
    resid_post_is_pre_plus_attn_plus_mlp(&model, &clean);
    let layer = 1;
    zeroed_heads_leave_resid_mid_as_resid_pre(&model, &clean, layer);
    zeroed_mlp_activation_adds_nothing(&model, layer);
    zeroed_gate_pre_activation_zeroes_mlp_post(&model, layer);
}

/// The residual stream's hooks around a block, and z.
const RESIDUAL_HOOKS: [Hook; 6] = [
    Hook::ResidPre,
    Hook::AttnOut,
    Hook::ResidMid,
    Hook::MlpOut,
    Hook::ResidPost,
    Hook::Z,
];

/// Every layer's hook_resid_post is hook_resid_pre + hook_attn_out + hook_mlp_out.
fn resid_post_is_pre_plus_attn_plus_mlp(model: &Model, clean: &AttnCache) {
    for l in 0..model.dims.n_layers {
        let get = |h| clean.get(l, h).unwrap().data.clone();
        let sum: Vec<f32> = get(Hook::ResidPre)
            .iter()
            .zip(get(Hook::AttnOut))
            .zip(get(Hook::MlpOut))
            .map(|((a, b), c)| a + b + c)
            .collect();
        assert_close(
            &get(Hook::ResidPost),
            &sum,
            1e-5,
            "resid_post = pre + attn + mlp",
        );
    }
}

/// Every head's z zeroed at `layer`: resid_mid equals resid_pre there, a watcher sees the zeroed
/// z, and layer 0 is the clean run's.
fn zeroed_heads_leave_resid_mid_as_resid_pre(model: &Model, clean: &AttnCache, layer: usize) {
    let n = TOKENS.len();
    let (nh, hd, dm) = (model.dims.n_heads, model.dims.head_dim, model.dims.d_model);
    let mut w = EditAndWatch {
        edit: edit_rows(layer, Hook::Z, 0..nh * hd, (0..n).collect(), Fill::Zero),
        watch: all_of(&RESIDUAL_HOOKS, n),
    };
    last_logits(model, &mut w).unwrap();
    let pre = &w.watch.get(layer, Hook::ResidPre).unwrap().data;
    let mid = &w.watch.get(layer, Hook::ResidMid).unwrap().data;
    assert_eq!(pre.len(), n * dm);
    assert_eq!(pre, mid, "zeroed heads: resid_mid = resid_pre");
    // the watcher sees the edited z
    assert!(all_zero(&w.watch, layer, Hook::Z));
    // and an earlier layer is untouched
    assert_eq!(
        w.watch.get(0, Hook::ResidPost).unwrap().data,
        clean.get(0, Hook::ResidPost).unwrap().data
    );
}

/// An MLP whose activation (mlp.hook_post, [pos, d_mlp]) is zeroed adds nothing.
fn zeroed_mlp_activation_adds_nothing(model: &Model, layer: usize) {
    let (n, ff) = (TOKENS.len(), model.dims.d_ff);
    let mut w = EditAndWatch {
        edit: edit_rows(layer, Hook::MlpPost, 0..ff, (0..n).collect(), Fill::Zero),
        watch: all_of(
            &[Hook::ResidMid, Hook::MlpPre, Hook::MlpPost, Hook::ResidPost],
            n,
        ),
    };
    last_logits(model, &mut w).unwrap();
    assert_eq!(w.watch.get(layer, Hook::MlpPre).unwrap().shape, vec![n, ff]);
    assert!(all_zero(&w.watch, layer, Hook::MlpPost));
    assert_eq!(
        w.watch.get(layer, Hook::ResidMid).unwrap().data,
        w.watch.get(layer, Hook::ResidPost).unwrap().data
    );
}

/// mlp.hook_post is SiLU(mlp.hook_pre) · up: where the gate's pre-activation is 0, so is it.
fn zeroed_gate_pre_activation_zeroes_mlp_post(model: &Model, layer: usize) {
    let (n, ff) = (TOKENS.len(), model.dims.d_ff);
    let mut w = EditAndWatch {
        edit: edit_rows(layer, Hook::MlpPre, 0..ff, vec![2], Fill::Zero),
        watch: all_of(&[Hook::MlpPost], n),
    };
    last_logits(model, &mut w).unwrap();
    let post = &w.watch.get(layer, Hook::MlpPost).unwrap().data;
    assert!(post[2 * ff..3 * ff].iter().all(|&x| x == 0.0));
    assert!(post[3 * ff..4 * ff].iter().any(|&x| x != 0.0));
}

/// Mean ablation writes each head's mean over positions at every position; a patch from another
/// run writes that run's values; batched variants give each one's own numbers.
#[test]
fn batched_variants_equal_single_runs() {
    let (_d, model) = tiny(Arch::Llama);
    let nh = model.dims.n_heads;
    let (mut runner, _, _) = Runner::clean(&model, &TOKENS, &[]).unwrap();
    let variants = heads_then_positions(&model);
    for layer in 0..model.dims.n_layers {
        batched_heads_equal_single_edits(&mut runner, layer, &variants[..nh]);
        batched_positions_equal_single_edits(&mut runner, layer, &variants[nh..]);
    }
    mean_fill_is_the_mean(&model);
}

/// One variant per head of z (from position 0; mean-ablated for even heads, zeroed for odd
/// ones), then one per later position, resumed from it, zeroing that position's row.
fn heads_then_positions(model: &Model) -> Vec<Variant<'static>> {
    let n = TOKENS.len();
    let hd = model.dims.head_dim;
    (0..model.dims.n_heads)
        .map(|h| Variant {
            from: 0,
            cols: h * hd..(h + 1) * hd,
            at: (0..n).collect(),
            fill: if h % 2 == 0 { Fill::Mean } else { Fill::Zero },
        })
        .chain((1..n).map(|p| Variant {
            from: p,
            cols: 0..model.dims.d_model,
            at: vec![0],
            fill: Fill::Zero,
        }))
        .collect()
}

/// Heads on hook_z (from position 0) in one batch: each one's logits are its own edited run's,
/// bit for bit.
fn batched_heads_equal_single_edits(runner: &mut Runner<'_>, layer: usize, heads: &[Variant<'_>]) {
    let model = runner.model;
    let batched = runner.run(layer, Hook::Z, heads, |_| {}).unwrap();
    for (i, v) in heads.iter().enumerate() {
        let mut e = edit_rows(layer, Hook::Z, v.cols.clone(), v.at.clone(), v.fill);
        let single = last_logits(model, &mut e).unwrap();
        assert_eq!(batched[i], single, "layer {layer} head {i}");
    }
}

/// Positions on hook_resid_pre in one batch, each resumed from its position on the clean
/// prefix: each one's logits are those of the run with that position zeroed.
fn batched_positions_equal_single_edits(
    runner: &mut Runner<'_>,
    layer: usize,
    positions: &[Variant<'_>],
) {
    let model = runner.model;
    let batched = runner
        .run(layer, Hook::ResidPre, positions, |_| {})
        .unwrap();
    for (i, v) in positions.iter().enumerate() {
        let cols = 0..model.dims.d_model;
        let mut e = edit_rows(layer, Hook::ResidPre, cols, vec![v.from], Fill::Zero);
        let single = last_logits(model, &mut e).unwrap();
        assert_close(
            &batched[i],
            &single,
            1e-5,
            &format!("layer {layer} zeroed position {}", v.from),
        );
    }
}

/// The mean fill is the mean: head 0's z at layer 1 becomes its mean over positions at every
/// position, and head 1's is untouched.
fn mean_fill_is_the_mean(model: &Model) {
    let n = TOKENS.len();
    let hd = model.dims.head_dim;
    let mut z = all_of(&[Hook::Z], n);
    last_logits(model, &mut z).unwrap();
    let clean_z = z.get(1, Hook::Z).unwrap().data.clone();
    let width = model.dims.n_heads * hd;
    let mut w = EditAndWatch {
        edit: edit_rows(1, Hook::Z, 0..hd, (0..n).collect(), Fill::Mean),
        watch: all_of(&[Hook::Z], n),
    };
    last_logits(model, &mut w).unwrap();
    let edited = &w.watch.get(1, Hook::Z).unwrap().data;
    for j in 0..hd {
        let mean = (0..n).map(|r| clean_z[r * width + j] as f64).sum::<f64>() / n as f64;
        for r in 0..n {
            assert!((edited[r * width + j] as f64 - mean).abs() < 1e-6);
            assert_eq!(
                edited[r * width + hd + j],
                clean_z[r * width + hd + j],
                "head 1 untouched"
            );
        }
    }
}

/// An edited pattern is what weighs the values: a pattern that puts all weight on the query's
/// own position makes z the query's own value vector (its KV head's); scores all 0 on the
/// visible keys give the uniform pattern 1/(i+1); a NaN written by a hook is refused by name.
#[test]
fn edited_patterns_and_scores_weigh_the_values() {
    let (_d, model) = tiny(Arch::Qwen2);
    let layer = 1;
    for scores in [false, true] {
        let mut o = EditAndWatch {
            edit: Diagonal { layer, scores },
            watch: AttnCache::new(
                &CaptureSpec {
                    hooks: vec![Hook::Z, Hook::V, Hook::Pattern],
                    layers: Some(vec![layer]),
                    heads: None,
                    queries: Queries::All,
                },
                TOKENS.len(),
            ),
        };
        last_logits(&model, &mut o).unwrap();
        pattern_is_the_edited_one(&model, &o.watch, &o.edit);
        z_weighs_the_values_by_it(&model, &o.watch, &o.edit);
    }
    a_nan_written_by_a_hook_is_refused_by_name(&model);
}

/// Edits `layer`'s pattern to the diagonal (all weight on the query's own position), or, with
/// `scores`, its attention scores to 0 on the visible keys.
struct Diagonal {
    layer: usize,
    scores: bool,
}

impl Diagonal {
    /// The weight the edit leaves on key `j` of query `i`: nothing above the diagonal; the
    /// diagonal, or the uniform 1/(i+1) with `scores`.
    fn weight(&self, i: usize, j: usize) -> f32 {
        match (self.scores, j <= i) {
            (_, false) => 0.0,
            (false, true) => (i == j) as u8 as f32,
            (true, true) => 1.0 / (i + 1) as f32,
        }
    }
}

impl Edits for Diagonal {
    fn edits(&self, l: usize, h: Hook) -> bool {
        l == self.layer
            && h == if self.scores {
                Hook::AttnScores
            } else {
                Hook::Pattern
            }
    }
    fn edit(&mut self, _: usize, _: Hook, s: &[usize], d: &mut [f32]) -> Result<(), String> {
        let (heads, q, k) = (s[0], s[1], s[2]);
        for h in 0..heads {
            for i in 0..q {
                for j in 0..k {
                    let x = &mut d[(h * q + i) * k + j];
                    if self.scores {
                        if x.is_finite() {
                            *x = 0.0;
                        }
                    } else {
                        *x = if i == j { 1.0 } else { 0.0 };
                    }
                }
            }
        }
        Ok(())
    }
}

/// Every head's captured pattern at the edited layer is the edit's.
fn pattern_is_the_edited_one(model: &Model, cache: &AttnCache, edit: &Diagonal) {
    let n = TOKENS.len();
    let scores = edit.scores;
    let p = cache.pattern(edit.layer).unwrap();
    for h in 0..model.dims.n_heads {
        for i in 0..n {
            let row = p.row_at(h, i).unwrap();
            for j in 0..n {
                let want = edit.weight(i, j);
                assert!(
                    (row[j] - want).abs() < 1e-6,
                    "scores {scores}: pattern h{h} ({i},{j}) {}",
                    row[j]
                );
            }
        }
    }
}

/// z at the edited layer is the values weighed by the edited pattern: the query's own value
/// vector (its KV head's), or the mean of the visible ones with `scores`.
fn z_weighs_the_values_by_it(model: &Model, cache: &AttnCache, edit: &Diagonal) {
    let n = TOKENS.len();
    let scores = edit.scores;
    let (nh, nkv, hd) = (
        model.dims.n_heads,
        model.dims.n_kv_heads,
        model.dims.head_dim,
    );
    let z = &cache.get(edit.layer, Hook::Z).unwrap().data;
    let v = &cache.get(edit.layer, Hook::V).unwrap().data;
    for h in 0..nh {
        let g = h / (nh / nkv);
        for i in 0..n {
            for c in 0..hd {
                let want: f32 = if scores {
                    (0..=i).map(|j| v[(j * nkv + g) * hd + c]).sum::<f32>() / (i + 1) as f32
                } else {
                    v[(i * nkv + g) * hd + c]
                };
                assert!(
                    (z[(i * nh + h) * hd + c] - want).abs() < 1e-5,
                    "scores {scores}: z h{h} row {i}"
                );
            }
        }
    }
}

/// A hook that writes a NaN is refused as bad input, naming the hook.
fn a_nan_written_by_a_hook_is_refused_by_name(model: &Model) {
    let nans = [f32::NAN; 1024];
    let mut e = edit_rows(0, Hook::ResidMid, 0..1, vec![2], Fill::From(&nans));
    let err = last_logits(model, &mut e).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, Error::Hook { .. }) && err.is_bad_input(),
        "{msg}"
    );
    assert!(
        msg.contains("blocks.0.hook_resid_mid") && msg.contains("non-finite"),
        "{msg}"
    );
}

/// Patching needs two texts of one length; the metric needs two different tokens.
#[test]
fn patching_refuses_what_it_cannot_pair() {
    let (_d, model) = tiny(Arch::Qwen2);
    let opts = PatchOptions {
        hook: PatchHook::ResidPre,
        answer: None,
        wrong: None,
        batch_rows: 64,
    };
    let err = patch(&model, &TOKENS, &TOKENS[..8], &opts, |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("8 (the clean text has 9; they first differ at position 8)"),
        "{err}"
    );
    let err = patch(&model, &TOKENS, &TOKENS, &opts, |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("pass --answer and --wrong"), "{err}");
    // both given and the same token: no advice to pass what was passed (#56)
    let same = PatchOptions {
        answer: Some(Target::Id(3)),
        wrong: Some(Target::Id(3)),
        ..opts.clone()
    };
    let err = patch(&model, &TOKENS, &TOKENS, &same, |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--answer and --wrong name the same token") && !err.contains("pass --"),
        "{err}"
    );
    // with answer/wrong given, a text patched with itself has equal clean and corrupted logit
    // differences: every recovered share would be 0/0, so it is refused (#56: a NaN grid, exit 0)
    let opts = PatchOptions {
        answer: Some(Target::Id(3)),
        wrong: Some(Target::Id(4)),
        ..opts
    };
    let err = patch(&model, &TOKENS, &TOKENS, &opts, |_, _| {}).unwrap_err();
    assert!(err.is_bad_input(), "{err}");
    let err = err.to_string();
    assert!(
        err.contains("the same logit difference") && err.contains("would divide by zero"),
        "{err}"
    );
    // a gap below 0.1 logits is warned about (recovered is then a ratio of small numbers)
    let warned = check_logit_diff_gap(2.0, 1.95).unwrap().unwrap();
    assert!(warned.contains("differ by only 0.0500"), "{warned}");
    assert!(check_logit_diff_gap(2.0, -1.0).unwrap().is_none());
    assert!(check_logit_diff_gap(2.0, 2.0).is_err());
}

/// A reference grid `[a][b]` as cells keyed `(a, b)`.
fn reference_grid(v: &serde_json::Value) -> Vec<((usize, usize), f64)> {
    json_cells(v)
        .into_iter()
        .map(|(i, w)| {
            assert_eq!(i.len(), 2, "a grid cell at {i:?}");
            ((i[0], i[1]), w)
        })
        .collect()
}

/// Every head's zero and mean ablation on the lesson's sentence, against transformers with a
/// forward pre-hook on o_proj (its slice of the input set to 0 or to its mean over positions).
fn check_ablation(alias: &str, prefix: &str) {
    let model = real_model(alias);
    let g = golden_json(&format!("{prefix}_interventions.json"));
    let a = &g["ablation"];
    let tokens = model.encode(a["text"].as_str().unwrap(), false).unwrap();
    let want_ids: Vec<u32> = a["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(tokens, want_ids, "{alias}: token ids");
    for method in [AblateMethod::Zero, AblateMethod::Mean] {
        let opts = AblateOptions {
            method,
            target: Target::Next,
            positions: None,
            mlp: false,
            batch_rows: 1024,
        };
        let r = ablate(model, &tokens, &opts, |_, _| {}).unwrap();
        assert_eq!(
            r.target.id as u64,
            a["target_id"].as_u64().unwrap(),
            "{alias}: target"
        );
        assert_cells(
            &format!("{alias} {} ablation: baseline log p", method.name()),
            [((), r.baseline_logprob as f64)],
            [((), a["baseline_logprob"].as_f64().unwrap())],
            Bound::Abs(1e-4),
        );
        let want = reference_grid(&a[method.name()]);
        assert_eq!(want.len(), model.dims.n_layers * model.dims.n_heads);
        assert_cells(
            &format!("{alias} {} ablation: Δ log p [layer, head]", method.name()),
            r.heads
                .iter()
                .map(|h| ((h.layer, h.head), h.delta_logprob as f64)),
            want.iter().copied(),
            Bound::Abs(1e-4),
        );
        assert!(
            r.heads.iter().all(|h| h.kl >= 0.0 && h.kl.is_finite()),
            "{alias}: every head's KL finite and >= 0"
        );
        let largest = want.iter().fold(0.0f64, |m, &(_, x)| m.max(x.abs()));
        assert!(largest > 0.1, "{alias}: some head must matter ({largest})");
        // the prefix reuse computes at most ~0.6 of the from-scratch rows
        assert!(
            (r.layer_rows as f64) < 0.6 * r.layer_rows_from_scratch as f64,
            "{alias}: {} of {} rows",
            r.layer_rows,
            r.layer_rows_from_scratch
        );
    }
}

/// The IOI-style pair: every layer × position of hook_resid_pre taken from the clean run,
/// against transformers with a forward pre-hook on the decoder layer.
fn check_patching(alias: &str, prefix: &str) {
    let model = real_model(alias);
    let g = golden_json(&format!("{prefix}_interventions.json"));
    let p = &g["patching"];
    let clean = model.encode(p["clean"].as_str().unwrap(), false).unwrap();
    let corrupt = model.encode(p["corrupt"].as_str().unwrap(), false).unwrap();
    let opts = PatchOptions {
        hook: PatchHook::ResidPre,
        answer: Some(Target::Id(p["answer_id"].as_u64().unwrap() as u32)),
        wrong: Some(Target::Id(p["wrong_id"].as_u64().unwrap() as u32)),
        batch_rows: 1024,
    };
    let r = patch(model, &clean, &corrupt, &opts, |_, _| {}).unwrap();
    assert_cells(
        &format!("{alias} patching: clean and corrupt logit differences"),
        [
            ("clean", r.clean_logit_diff as f64),
            ("corrupt", r.corrupt_logit_diff as f64),
        ],
        [
            ("clean", p["clean_logit_diff"].as_f64().unwrap()),
            ("corrupt", p["corrupt_logit_diff"].as_f64().unwrap()),
        ],
        Bound::Abs(1e-4),
    );
    // every layer × position of the reference, each once
    let want = reference_grid(&p["patched_logit_diff"]);
    assert_eq!(want.len(), model.dims.n_layers * clean.len());
    assert_cells(
        &format!("{alias} patching: logit difference [layer, position]"),
        r.results.iter().map(|c| {
            let pos = c.pos.expect("resid_pre patches a position");
            ((c.layer, pos), c.logit_diff as f64)
        }),
        want,
        Bound::Abs(1e-4),
    );
    assert!((r.layer_rows as f64) < 0.6 * r.layer_rows_from_scratch as f64);
}

#[test]
fn ablation_matches_transformers_qwen() {
    check_ablation("qwen2.5-coder-0.5b", "qwen");
}

#[test]
fn ablation_matches_transformers_smollm() {
    check_ablation("smollm2-135m", "smol");
}

#[test]
fn patching_matches_transformers_qwen() {
    check_patching("qwen2.5-coder-0.5b", "qwen");
}

#[test]
fn patching_matches_transformers_smollm() {
    check_patching("smollm2-135m", "smol");
}

/// Gemma 3 (post-norms, scaled embeddings, q/k norms, sliding layers, `<bos>` first): the
/// reference made with the same script (tests/golden/README.md).
#[test]
fn ablation_matches_transformers_gemma() {
    check_ablation("gemma3-270m", "gemma");
}

#[test]
fn patching_matches_transformers_gemma() {
    check_patching("gemma3-270m", "gemma");
}

/// Direct logit attribution on a tiny model, computed again here from the reference weights:
/// each head's part is scale · (W_U[answer] ⊙ γ) · W_Oʰ zʰ with the run's final RMS scale; every
/// part added up is the logit.
#[test]
fn direct_logit_attribution_adds_up_to_the_logit() {
    use attnscope::analysis::dla::dla;
    let arch = Arch::Llama;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    let m = tiny_model(arch, 5);
    write_gguf(&m, arch, GgmlDType::F32, &path).unwrap();
    let model = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
    let n = TOKENS.len();
    let (nh, hd, dm) = (model.dims.n_heads, model.dims.head_dim, model.dims.d_model);
    let r = dla(&model, &TOKENS, &Target::Id(7), Some(&Target::Id(9))).unwrap();
    assert_eq!((r.answer.id, r.wrong.as_ref().unwrap().id), (7, 9));
    assert!(
        (r.metric - r.sum_of_parts).abs() < 1e-4,
        "{} vs {}",
        r.metric,
        r.sum_of_parts
    );
    let mut cache = all_of(&[Hook::Z, Hook::ResidPost], n);
    last_logits(&model, &mut cache).unwrap();
    let x = &cache.get(1, Hook::ResidPost).unwrap().data[(n - 1) * dm..];
    let scale = 1.0
        / ((x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / dm as f64) + m.cfg.rms_eps as f64)
            .sqrt();
    let unembed = m.lm_head.as_ref().unwrap_or(&m.embed);
    let u: Vec<f64> = (0..dm)
        .map(|i| (unembed[7 * dm + i] as f64 - unembed[9 * dm + i] as f64) * m.final_norm[i] as f64)
        .collect();
    let mut want = Vec::new();
    for l in 0..2 {
        let z = &cache.get(l, Hook::Z).unwrap().data[(n - 1) * nh * hd..];
        for h in 0..nh {
            // W_O: [d_model, n_heads·head_dim]
            let part: f64 = (0..dm)
                .map(|i| {
                    let y: f64 = (0..hd)
                        .map(|c| {
                            m.layers[l].w_o[i * nh * hd + h * hd + c] as f64 * z[h * hd + c] as f64
                        })
                        .sum();
                    scale * u[i] * y
                })
                .sum();
            want.push(((l, h), part));
        }
    }
    assert_cells(
        "tiny llama: direct logit attribution [layer, head] vs by hand",
        r.heads.iter().map(|p| ((p.layer, p.head), p.dla as f64)),
        want,
        Bound::Abs(1e-4),
    );
    // the same answer twice is refused
    let err = dla(&model, &TOKENS, &Target::Id(7), Some(&Target::Id(7))).unwrap_err();
    assert!(err.is_bad_input(), "{err}");
}

/// On the real models the parts add up to the logit; Gemma, whose blocks normalize their outputs
/// before adding them, is refused with the reason.
#[test]
fn direct_logit_attribution_on_the_real_models() {
    use attnscope::analysis::dla::dla;
    for alias in ["qwen2.5-coder-0.5b", "smollm2-135m"] {
        let model = real_model(alias);
        let tokens = model
            .encode(
                "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc.",
                false,
            )
            .unwrap();
        let r = dla(model, &tokens, &Target::Next, None).unwrap();
        eprintln!("{alias}: logit {} = parts {}", r.metric, r.sum_of_parts);
        assert!(
            (r.metric - r.sum_of_parts).abs() < 2e-3 * (1.0 + r.metric.abs()),
            "{alias}: {} vs {}",
            r.metric,
            r.sum_of_parts
        );
        assert_eq!(r.heads.len(), model.dims.n_layers * model.dims.n_heads);
    }
    let gemma = real_model("gemma3-270m");
    let tokens = gemma.encode("The capital of France is", false).unwrap();
    let err = dla(gemma, &tokens, &Target::Next, None).unwrap_err();
    assert!(
        err.is_bad_input() && err.to_string().contains("post-norms"),
        "{err}"
    );
}

/// `patch --hook pattern`: head h's whole pattern taken from the clean run. Checked against one
/// edit written here by hand (the corrupted run, that head's map replaced), and a text's own
/// maps put back change nothing.
#[test]
fn pattern_patching_takes_a_heads_map_from_the_clean_run() {
    let (_d, model) = tiny(Arch::Qwen2);
    let n = TOKENS.len();
    let nh = model.dims.n_heads;
    let mut corrupt = TOKENS;
    corrupt[3] = 200;
    let opts = PatchOptions {
        hook: PatchHook::Pattern,
        answer: Some(Target::Id(3)),
        wrong: Some(Target::Id(4)),
        batch_rows: 64,
    };
    let r = patch(&model, &TOKENS, &corrupt, &opts, |_, _| {}).unwrap();
    assert_eq!(r.results.len(), model.dims.n_layers * nh);
    let mut clean = all_of(&[Hook::Pattern], n);
    last_logits(&model, &mut clean).unwrap();
    for c in &r.results {
        let (l, h) = (c.layer, c.head.unwrap());
        let src = clean.pattern(l).unwrap().data.to_vec();
        let mut e = Editor {
            layer: l,
            hook: Hook::Pattern,
            patches: vec![Patch {
                rows: 0..nh,
                cols: 0..n * n,
                at: vec![h],
                fill: Fill::From(&src),
            }],
        };
        let lg = model
            .forward(&corrupt, &RunOptions::last_logits(n), &mut e)
            .unwrap()
            .logits
            .remove(0);
        let want = lg[3] - lg[4];
        assert!(
            (c.logit_diff - want).abs() < 1e-5,
            "{l}.{h}: {} vs {want}",
            c.logit_diff
        );
    }
    // some head's pattern matters on this pair
    assert!(r
        .results
        .iter()
        .any(|c| (c.logit_diff - r.corrupt_logit_diff).abs() > 1e-4));
    a_text_patched_with_its_own_maps_is_unchanged(&model, &clean);
}

/// Each head's map of the clean text put back into the clean text's own run changes no logit
/// (`patch` itself refuses a text patched with itself: equal logit differences, #56).
fn a_text_patched_with_its_own_maps_is_unchanged(model: &Model, clean: &AttnCache) {
    let (n, nh) = (TOKENS.len(), model.dims.n_heads);
    let plain = last_logits(model, &mut all_of(&[], n)).unwrap();
    for l in 0..model.dims.n_layers {
        let src = clean.pattern(l).unwrap().data.to_vec();
        for h in 0..nh {
            let mut e = Editor {
                layer: l,
                hook: Hook::Pattern,
                patches: vec![Patch {
                    rows: 0..nh,
                    cols: 0..n * n,
                    at: vec![h],
                    fill: Fill::From(&src),
                }],
            };
            let lg = last_logits(model, &mut e).unwrap();
            let worst = lg
                .iter()
                .zip(&plain)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(worst < 1e-5, "{l}.{h}: a logit moved by {worst}");
        }
    }
}
