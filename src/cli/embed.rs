//! `attnscope embed`: sentence embeddings of an encoder (sentence-transformers' mean pooling,
//! L2-normalized when the model folder's `modules.json` says so), written as a `.npy`.

use super::common::{emit, output_path, usage, ModelArgs, ReadLimit};
use attnscope::commands::embed::{self as command, EmbedInput, EmbedOptions};
use serde_json::json;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// A UTF-8 file with one text per line (blank lines are skipped).
    #[arg(long, short = 'f')]
    file: Option<PathBuf>,
    /// A text to embed (repeatable; after the file's texts).
    #[arg(long, short = 't')]
    text: Vec<String>,
    /// Write the embeddings, float32 [n_texts, d_model], to this .npy file.
    #[arg(long, short = 'o')]
    out: Option<PathBuf>,
    /// Replace --out if it exists.
    #[arg(long)]
    force: bool,
    /// L2-normalize the embeddings (default: as the model folder's modules.json says).
    #[arg(long, conflicts_with = "no_normalize")]
    normalize: bool,
    /// Leave the embeddings unnormalized.
    #[arg(long)]
    no_normalize: bool,
    /// Print a JSON summary (and the embeddings themselves when there is no --out).
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let mut texts: Vec<String> = Vec::new();
    if let Some(f) = &a.file {
        // each line up to what a text of the longest context may take; the model checks its own
        let s = attnscope::analysis::files::read_lines_file(f, &ReadLimit::any_model())?;
        texts.extend(
            s.lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_string),
        );
    }
    texts.extend(a.text.iter().cloned());
    if texts.is_empty() {
        return Err(usage("no texts: give --file (one text per line) or --text"));
    }
    if a.out.is_none() && !a.json {
        return Err(usage(
            "say where the embeddings go: --out FILE.npy, or --json",
        ));
    }
    let mut inputs = a.model.input_paths();
    inputs.extend(a.file.clone());
    let output = a
        .out
        .as_deref()
        .map(|o| output_path(o, a.force, &inputs))
        .transpose()?;
    let model = a.model.load()?;
    let normalize = match (a.normalize, a.no_normalize) {
        (true, _) => Some(true),
        (_, true) => Some(false),
        _ => None,
    };
    let pb = super::common::progress_bar("embedding [{bar:30}] {pos}/{len} ({elapsed})");
    pb.set_length(texts.len() as u64);
    let inputs = texts
        .into_iter()
        .map(|text| EmbedInput { text, pair: None })
        .collect();
    let r = command::run(&model, &EmbedOptions { inputs, normalize }, &|| pb.inc(1))?;
    pb.finish_and_clear();
    let (n, dm, normalized, secs, emb) =
        (r.n_texts, r.d_model, r.normalized, r.seconds, r.embeddings);
    if let Some(out) = &output {
        out.write(&attnscope::render::npy::to_npy(&[n, dm], &emb))?;
    }
    if a.json {
        let mut v = json!({
            "model": model.info.name,
            "n_texts": n,
            "d_model": dm,
            "normalized": normalized,
            "seconds": secs,
            "out": a.out.as_ref().map(|p| p.display().to_string()),
        });
        if a.out.is_none() {
            v["embeddings"] = json!(emb.chunks(dm).collect::<Vec<_>>());
        }
        emit(&format!("{v}\n"))
    } else {
        emit(&format!(
            "{n} embeddings of {dm} ({}) from {} in {secs:.2} s -> {}\n",
            if normalized {
                "L2-normalized"
            } else {
                "not normalized"
            },
            model.info.name,
            a.out
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        ))
    }
}
