//! `attnscope capture`: run a model and save the captured hook tensors to a file
//! ([`attnscope::commands::capture`] does it).

use super::common::{emit, ModelText};
use attnscope::commands::capture::{capture, CaptureRequest};
use attnscope::render::tensorfile::TensorFormat;
use std::io::IsTerminal;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Format {
    Safetensors,
    Npz,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    input: ModelText,
    /// Output file (.safetensors or .npz).
    #[arg(long, short = 'o')]
    out: PathBuf,
    /// Hooks to capture: pattern, scores, q, k, v, rot_q, rot_k, z, attn_out, resid (pre and
    /// post), resid_pre, resid_post, all.
    #[arg(long, default_value = "pattern")]
    hooks: String,
    /// Layers: all, 0-3, 0,12,23.
    #[arg(long, default_value = "all", allow_negative_numbers = true)]
    layers: String,
    /// Query heads (for pattern, scores, q, rot_q, z): all, 0-3, 1,5.
    #[arg(long, default_value = "all", allow_negative_numbers = true)]
    heads: String,
    /// Query positions kept: all, last, or a list such as 0,5,17.
    #[arg(long, default_value = "all", allow_negative_numbers = true)]
    queries: String,
    /// File format; by default from the extension of --out (safetensors otherwise).
    #[arg(long, value_enum)]
    format: Option<Format>,
    /// Replace --out if it exists.
    #[arg(long)]
    force: bool,
    /// Let a layer's writing run on while the next layer computes, holding two layers' capture
    /// in memory instead of one. By default the writing of a layer's patterns starts when its
    /// attention is done and runs beside its MLP, and the next layer waits for it: on this
    /// project's machine it never had to (2,048 tokens of the default model, 235 MB a layer);
    /// for a disk slower than that.
    #[arg(long)]
    two_layers: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let req = CaptureRequest {
        out: a.out.clone(),
        hooks: a.hooks.clone(),
        layers: a.layers.clone(),
        heads: a.heads.clone(),
        queries: a.queries.clone(),
        format: a.format.map(|f| match f {
            Format::Safetensors => TensorFormat::Safetensors,
            Format::Npz => TensorFormat::Npz,
        }),
        force: a.force,
        two_layers: a.two_layers,
        inputs: a.input.input_paths(),
    };
    req.check()?;
    let start = std::time::Instant::now();
    let model = a.input.model.load()?;
    let loaded = start.elapsed();
    let (tokens, token_types) = a.input.text.tokens_or_pair(&model, a.input.model.bos)?;
    let n = tokens.len();
    let plan = req.plan(&model, n)?;
    let (n_tensors, total_bytes) = (plan.n_tensors(), plan.total_bytes());
    let n_layers = model.dims.n_layers;
    let terminal = std::io::stderr().is_terminal();
    let bar = if terminal {
        indicatif::ProgressBar::new(n_layers as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "capture {msg} [{bar:30}] layer {pos}/{len} ({elapsed})",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(format!("{n} tokens, {:.1} GB", total_bytes / 1e9));
    if !terminal && total_bytes > 100e6 {
        eprintln!("attnscope: capturing {n_tensors} tensors ({:.1} GB) over {n_layers} layers of {n} tokens into {}", total_bytes / 1e9, a.out.display());
    }
    let report = capture(&model, &tokens, token_types, &req, plan, &mut |_| {
        bar.inc(1)
    });
    bar.finish_and_clear();
    let report = report?;
    emit(&report.message(
        loaded.as_secs_f64(),
        (start.elapsed() - loaded).as_secs_f64(),
    ))
}
