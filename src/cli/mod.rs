//! The `attnscope` command. Each subcommand parses its flags, calls the library, and renders;
//! errors print their cause chain, and the exit code says whose fault it was:
//! 0 success, 2 bad input or usage, 1 anything else. A closed pipe (`| head`) exits 0.

mod ablate;
mod attribute;
mod bench;
mod bench_circuits;
mod bench_interventions;
mod bench_machine;
mod bench_sweeps;
mod cache;
mod capture;
mod circuit;
mod common;
mod compare;
mod corpus;
mod corpus_encoder;
mod cost;
mod dla;
mod embed;
mod explain;
mod faithfulness;
mod generate;
mod heads;
mod info;
mod inspect;
mod options;
mod patch;
mod qk;
mod scaling;
mod scoring;
mod serve;
mod sinks;
mod view;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

use attnscope::analysis::request::is_bad_input;

/// attnscope: compute, see and measure the attention inside real language models.
///
/// Start with `attnscope inspect` (the default model, fetched on first use, on the lesson's
/// sentence), or `attnscope explain` to follow one attention step by hand.
#[derive(Parser, Debug)]
#[command(name = "attnscope", version, about, long_about, max_term_width = 100)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Follow one attention step number by number: Q, K, V, scores, mask, softmax, output; the
    /// causal-mask grid; why scores are divided by √d; how heads split and share K/V.
    Explain(explain::Args),
    /// The lesson's arithmetic of cost: how the n×n score matrix grows with the length n.
    Cost(cost::Args),
    /// The lesson's tables on a real model: per-head and head-averaged top tokens for a query,
    /// the attention-sink profile, head concentration, and the model's next-token prediction.
    Inspect(inspect::Args),
    /// Chat with the model (its own chat template) or continue a text, token by token on a KV
    /// cache, streamed; per answer token, what the query that produced it attended to: the sink
    /// profile, the top prompt tokens, the concentrated heads.
    Generate(generate::Args),
    /// Does attention explain the prediction? Occlude each token (delete, replace, knock out)
    /// and compare the change in the target's log-probability with attention, rollout and heads.
    Faithfulness(faithfulness::Args),
    /// Which input tokens drive the prediction? A score per token by gradient, gradient × input,
    /// integrated gradients, attention × gradient (Chefer et al.) or occlusion, for log p(target)
    /// or a logit difference at the last position; the text shaded by score.
    Attribute(attribute::Args),
    /// Does a head matter? Remove each head (zero or mean ablation of its output) and measure the
    /// change in the target's log-probability and the KL of the prediction, beside the head's
    /// attention: concentrated against important, with a rank correlation.
    Ablate(ablate::Args),
    /// Activation patching: run a corrupted text with one activation taken from a clean text
    /// (per layer × position, or per layer × head) and measure how much of the logit difference
    /// between the answer and the wrong token comes back.
    Patch(patch::Args),
    /// Circuits: which edges between the input, the heads and the MLPs carry the answer, scored
    /// by edge attribution patching (EAP) or EAP with integrated gradients on a clean/corrupted
    /// pair (or many, --pairs), and with --evaluate how faithful the circuits of the top edges
    /// are by exact edge patching (MIB's CPR and CMD).
    Circuit(circuit::Args),
    /// Direct logit attribution: each head's, MLP's and the embedding's direct contribution to
    /// the answer's logit (or a logit difference) at the last position, beside each head's
    /// attention; the parts add up to the logit.
    Dla(dla::Args),
    /// Why a head attends where it does: its pre-softmax score of a query and a key split
    /// exactly into (query-side component × key-side component) terms over the residual
    /// stream's components (the embedding, each earlier head and MLP) and the biases, each
    /// position's norm scale frozen and its rotation applied; the terms add up to the score.
    Qk(qk::Args),
    /// How often do sinks and concentrated heads occur? Statistics over many texts (built-in
    /// corpus of 224, or your file), with confidence intervals; shardable, resumable, mergeable.
    Corpus(corpus::Args),
    /// The attention-sink profile and per-head statistics of a long text (up to the model's
    /// context), streamed with an online softmax: memory grows with n, not n².
    Sinks(sinks::Args),
    /// Two runs side by side: two texts (--text A --text B), two models with one tokenizer
    /// (--model M1 --model M2) or two precisions: sink-profile differences per layer, the
    /// Jensen–Shannon divergence of every head's query row, the heads that changed most; JSON
    /// and an HTML page with both sides.
    Compare(compare::Args),
    /// Which heads do what: previous-token, duplicate-token, induction, sink and local scores for
    /// every layer and head (TransformerLens's head detector), on a text or on random repeated
    /// tokens (--random-repeat 50: the induction test). Streamed, so long inputs fit.
    Heads(heads::Args),
    /// Measure the cost against the length: time of the attention part and of the whole
    /// forward, peak memory, with and without pattern capture; fitted exponents.
    Scaling(scaling::Args),
    /// Write a self-contained HTML page (no network): head view, model view (layers × heads),
    /// sink chart, sink-hiding toggle, KV groups, top-k tables, PNG/SVG export.
    View(view::ViewArgs),
    /// Draw one attention map (a head, or the mean of a layer's heads) as PNG or SVG.
    Heatmap(view::HeatmapArgs),
    /// A local web page to type a sentence and explore the views (model loaded once; loopback).
    Serve(serve::Args),
    /// Describe a model: architecture, heads and KV sharing, sizes, tensor types, tokenizer.
    Info(info::Args),
    /// Run a model on a text and save captured tensors (attention patterns, scores, q/k/v, ...)
    /// under their hook names to .safetensors or .npz for notebooks.
    Capture(capture::Args),
    /// Where the forward's time goes: the f32 GEMM at the model's shapes against the machine's
    /// measured rate, projections and attention inside a real forward, and the wall time and peak
    /// memory of `capture` and `inspect`.
    Bench(bench::Args),
    /// Sentence embeddings of an encoder (all-minilm-l6-v2): mean-pooled last hidden states,
    /// L2-normalized when the model's modules.json says so, as sentence-transformers computes
    /// them; one text per line of --file, written as a float32 .npy [n_texts, d_model].
    Embed(embed::Args),
    /// Fetch a model alias into the cache (what every command does on first use).
    Fetch(info::FetchArgs),
    /// The packed-weight cache: list its files (model, layout, size) or clear them.
    Cache(cache::Args),
    /// Every subcommand's options, from clap's own tree, as JSON (for tests/option_sweep.rs).
    #[command(name = "__options", hide = true)]
    Options(options::Args),
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Explain(a) => explain::run(a),
        Command::Cost(a) => cost::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Info(a) => info::run(a),
        Command::Serve(a) => serve::run(a),
        Command::View(a) => view::view(a),
        Command::Heatmap(a) => view::heatmap(a),
        Command::Scaling(a) => scaling::run(a),
        Command::Sinks(a) => sinks::run(a),
        Command::Embed(a) => embed::run(a),
        Command::Compare(a) => compare::run(a),
        Command::Heads(a) => heads::run(a),
        Command::Corpus(a) => corpus::run(a),
        Command::Faithfulness(a) => faithfulness::run(a),
        Command::Ablate(a) => ablate::run(a),
        Command::Attribute(a) => attribute::run(a),
        Command::Patch(a) => patch::run(a),
        Command::Dla(a) => dla::run(a),
        Command::Circuit(a) => circuit::run(a),
        Command::Qk(a) => qk::run(a),
        Command::Capture(a) => capture::run(a),
        Command::Fetch(a) => info::fetch(a),
        Command::Bench(a) => bench::run(a),
        Command::Cache(a) => cache::run(a),
        Command::Options(a) => options::run(a),
    }
}

fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    // ATTNSCOPE_ISA / ATTNSCOPE_AMX asking for a kernel this CPU cannot run: refused before any
    // command starts (never an illegal instruction, never silently another kernel)
    if let Err(e) = attnscope::kernels::select::check() {
        eprintln!("attnscope: error: {e}");
        return ExitCode::from(2);
    }
    attnscope::commands::load::keep_models_to_exit();
    // Ctrl-C while a file is written removes its temporary file (a capture's is hundreds of MB)
    attnscope::analysis::files::remove_temp_files_on_signal();
    let result = run(cli);
    // `attnscope bench` times commands as child processes and asks each for its own peak memory
    // (VmHWM of this process's address space; rusage would include the parent's, inherited)
    if let Some(path) = std::env::var_os("ATTNSCOPE_PEAK_FILE") {
        if let Some(peak) = attnscope::analysis::measure::peak_rss_bytes() {
            let _ = std::fs::write(path, peak.to_string());
        }
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("attnscope: error: {e:#}");
            ExitCode::from(if is_bad_input(&e) { 2 } else { 1 })
        }
    }
}
