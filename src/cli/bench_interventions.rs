//! `attnscope bench --interventions`: what the interventions cost, measured in one run: a patching
//! sweep against the forwards it stands for, and the ablation of every head against the same
//! sweep through transformers with torch hooks (`--transformers`, the built-in hf_ablate.py).

use super::common::LESSON_SENTENCE;
use super::scaling::{before_and_after, measurement_table, median, timed};
use attnscope::analysis::intervene::{ablate, patch, AblateMethod, AblateOptions, PatchOptions};
use attnscope::analysis::vocab::PatchHook;
use attnscope::analysis::vocab::Target;
use attnscope::model::capture::NoCapture;
use attnscope::model::forward::RunOptions;
use attnscope::model::Model;
use serde::Serialize;
use std::path::Path;

const HF_ABLATE: &str = include_str!("../../assets/hf_ablate.py");

/// The IOI-style pair of the reference (one name swapped; the same token count on the models here).
pub const CLEAN: &str = "After Alice and Bob walked to the park, Bob handed a ball to";
pub const CORRUPT: &str = "After Alice and Bob walked to the park, Alice handed a ball to";

#[derive(Debug, Serialize)]
pub struct InterventionBench {
    pub model: String,
    pub repeats: usize,
    /// one plain forward of the clean text (last position's logits), median seconds
    pub forward_s: f64,
    pub patch_tokens: usize,
    /// `patch --hook resid_pre` over every layer and position, median seconds
    pub patch_sweep_s: f64,
    /// the sweep over (layers × positions) forwards of that length
    pub patch_vs_forwards: f64,
    pub ablate_tokens: usize,
    pub ablate_heads: usize,
    /// `ablate` (zero) of every head on the lesson's sentence, every run's seconds and the median
    pub ablate_s: Vec<f64>,
    pub ablate_median_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transformers: Option<serde_json::Value>,
    /// transformers' sweep over attnscope's median sweep
    #[serde(skip_serializing_if = "Option::is_none")]
    pub faster_than_transformers: Option<f64>,
}

/// Runs hf_ablate.py with `python` on the model's GGUF; its JSON line.
fn run_hf(python: &Path, gguf: &Path, text: &str) -> anyhow::Result<serde_json::Value> {
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("hf_ablate.py");
    std::fs::write(&script, HF_ABLATE)?;
    let out = std::process::Command::new(python)
        .arg(&script)
        .arg("--gguf")
        .arg(gguf)
        .args(["--text", text, "--threads"])
        .arg(rayon::current_num_threads().to_string())
        .output()
        .map_err(|e| {
            super::common::usage(format!(
                "--transformers: cannot run {}: {e}",
                python.display()
            ))
        })?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    match stdout.lines().rev().find_map(|l| serde_json::from_str(l.trim()).ok()) {
        Some(v) if out.status.success() => Ok(v),
        _ => Err(anyhow::anyhow!(
            "the transformers ablation sweep failed ({}); the end of its error output:\n{}\n(it needs torch, transformers, accelerate and gguf)",
            out.status,
            String::from_utf8_lossy(&out.stderr).lines().rev().take(6).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
        )),
    }
}

/// `bench --interventions`: `patch`'s and `ablate`'s sweeps timed against one forward (and
/// transformers' hooks), as JSON or a table.
pub fn run(model: &Model, repeats: usize, python: Option<&Path>, json: bool) -> anyhow::Result<()> {
    let (r, n_forwards) = measure(model, repeats, python)?;
    if json {
        return super::common::emit(&format!("{}\n", serde_json::to_string_pretty(&r)?));
    }
    super::common::emit(&render(&r, n_forwards, model.dims.n_layers))
}

/// The interventions' timings: one forward, `patch`'s sweep and `ablate`'s (around
/// transformers' own sweep when `python` is given); the bench and the number of forwards timed.
fn measure(
    model: &Model,
    repeats: usize,
    python: Option<&Path>,
) -> anyhow::Result<(InterventionBench, usize)> {
    let d = &model.dims;
    let clean = model.encode(CLEAN, false)?;
    let corrupt = model.encode(CORRUPT, false)?;
    let bar = super::common::progress_bar("{msg} [{bar:30}] {pos}/{len}");
    bar.set_length((4 * repeats + usize::from(python.is_some()) + 1) as u64);
    let forwards = time_forwards(model, &clean, repeats)?;
    let forward_s = median(forwards.clone());
    bar.inc(1);
    let patch_sweep_s = time_patch_sweeps(model, &clean, &corrupt, repeats, &bar)?;
    let tokens = model.encode(LESSON_SENTENCE, false)?;
    let aopts = AblateOptions {
        method: AblateMethod::Zero,
        target: Target::Next,
        positions: None,
        mlp: false,
        batch_rows: 1024,
    };
    let mut ablate_s = Vec::new();
    // attnscope's runs before and after transformers'
    let transformers = before_and_after(
        repeats,
        || {
            bar.set_message("ablate");
            ablate_s.push(timed(|| ablate(model, &tokens, &aopts, |_, _| {}))?.0);
            bar.inc(1);
            Ok(())
        },
        || match python {
            Some(p) => {
                bar.set_message("transformers with torch hooks");
                let v = run_hf(p, &model.info.path, LESSON_SENTENCE)?;
                bar.inc(1);
                Ok(Some(v))
            }
            None => Ok(None),
        },
    )?;
    bar.finish_and_clear();
    let ablate_median_s = median(ablate_s.clone());
    let faster = transformers
        .as_ref()
        .and_then(|v| v["sweep_s"].as_f64())
        .map(|t| t / ablate_median_s);
    let r = InterventionBench {
        model: model.info.name.clone(),
        repeats,
        forward_s,
        patch_tokens: clean.len(),
        patch_sweep_s,
        patch_vs_forwards: patch_sweep_s / (d.n_layers * clean.len()) as f64 / forward_s,
        ablate_tokens: tokens.len(),
        ablate_heads: d.n_layers * d.n_heads,
        ablate_s,
        ablate_median_s,
        transformers,
        faster_than_transformers: faster,
    };
    Ok((r, forwards.len()))
}

/// One plain forward of the clean text's length, warmed up, then timed at least 3 times.
fn time_forwards(model: &Model, clean: &[u32], repeats: usize) -> anyhow::Result<Vec<f64>> {
    let opts = RunOptions::last_logits(clean.len());
    model.forward(clean, &opts, &mut NoCapture)?;
    (0..repeats.max(3))
        .map(|_| timed(|| model.forward(clean, &opts, &mut NoCapture)).map(|t| t.0))
        .collect()
}

/// `patch --hook resid-pre`'s sweep, timed `repeats` times; the median.
fn time_patch_sweeps(
    model: &Model,
    clean: &[u32],
    corrupt: &[u32],
    repeats: usize,
    bar: &indicatif::ProgressBar,
) -> anyhow::Result<f64> {
    bar.set_message("patch --hook resid-pre");
    let popts = PatchOptions {
        hook: PatchHook::ResidPre,
        answer: None,
        wrong: None,
        batch_rows: 1024,
    };
    let mut sweeps = Vec::new();
    for _ in 0..repeats {
        sweeps.push(timed(|| patch(model, clean, corrupt, &popts, |_, _| {}))?.0);
        bar.inc(1);
    }
    Ok(median(sweeps))
}

/// The table of an interventions bench whose forward is the median of `n_forwards`.
fn render(r: &InterventionBench, n_forwards: usize, n_layers: usize) -> String {
    let (mut s, mut t) = measurement_table("interventions", &r.model);
    t.row([
        format!(
            "one forward of the clean pair text ({} tokens)",
            r.patch_tokens
        ),
        format!("{:.4}", r.forward_s),
        format!("median of {n_forwards}"),
    ]);
    t.row([
        format!(
            "patch --hook resid-pre: {} layers x {} positions",
            n_layers, r.patch_tokens
        ),
        format!("{:.3}", r.patch_sweep_s),
        format!(
            "{:.2} x the {} forwards it stands for",
            r.patch_vs_forwards,
            n_layers * r.patch_tokens
        ),
    ]);
    t.row([
        format!(
            "ablate (zero) of all {} heads, {} tokens",
            r.ablate_heads, r.ablate_tokens
        ),
        format!("{:.2}", r.ablate_median_s),
        format!(
            "median of {} ({})",
            r.ablate_s.len(),
            r.ablate_s
                .iter()
                .map(|x| format!("{x:.2}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    ]);
    if let (Some(v), Some(f)) = (&r.transformers, r.faster_than_transformers) {
        t.row([
            format!(
                "transformers + torch hooks, the same sweep ({} forwards)",
                v["forwards"]
            ),
            format!("{:.2}", v["sweep_s"].as_f64().unwrap_or(f64::NAN)),
            format!(
                "attnscope {f:.1}x faster (largest |Δ log p| {:.4} there)",
                v["largest_abs_delta"].as_f64().unwrap_or(f64::NAN)
            ),
        ]);
    }
    s += &t.render();
    s
}
