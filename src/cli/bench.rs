//! `attnscope bench`: where the forward's time goes, as rates next to what this machine measures:
//! the micro-kernel's in-cache peak, the f32 GEMM at the model's own shapes (attnscope's packed
//! kernel and candle's matmul), the projections and the attention inside a real forward, and the
//! wall time and peak memory of the commands a user runs.

use super::common::{emit, usage, ModelArgs};
use super::scaling::median;
use attnscope::analysis::measure::{machine, peak_rss_bytes, reset_peak_rss};
use attnscope::kernels::gemm::{self, Isa, PackedB};
use attnscope::model::capture::{AttnCache, CaptureSpec, NoCapture};
use attnscope::model::forward::RunOptions;
use attnscope::render::table::{title, Align, Table};
use serde::Serialize;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Sequence lengths (tokens of real text: the built-in corpus, repeated as needed).
    #[arg(long, value_delimiter = ',', default_value = "512,2048")]
    lengths: Vec<usize>,
    /// Timed runs per setting (after one warm-up run), 1 to 1000; the median is reported.
    #[arg(long, default_value_t = 2, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1000))]
    repeats: usize,
    /// Skip timing `capture` and `inspect` as separate processes (start to end, with loading).
    #[arg(long)]
    no_commands: bool,
    /// Skip the forward with every pattern captured where the patterns would exceed this many GiB.
    #[arg(long, default_value_t = 8.0, value_parser = attnscope::analysis::request::non_negative)]
    capture_limit_gib: f64,
    /// Also time the Python route side by side: transformers + torch (the team's hf_anchor
    /// script, built in) run by this Python, which needs torch, transformers and gguf. Next to
    /// each length's `capture` it times transformers eager with output_attentions, next to
    /// `inspect` sdpa, each between --repeats runs of attnscope's command and --repeats more (the
    /// machine's speed drifts within minutes), and prints the ratios over their median. GGUF
    /// models; exact is the comparable precision.
    #[arg(long, value_name = "PYTHON")]
    transformers: Option<std::path::PathBuf>,
    /// Time the interventions instead: a `patch --hook resid-pre` sweep against the forwards it
    /// stands for, and `ablate` of every head (with --transformers: against the same sweep
    /// through transformers with torch hooks, the built-in hf_ablate.py, between --repeats runs
    /// of attnscope's and --repeats more).
    #[arg(long)]
    interventions: bool,
    /// Time the sweeps that reuse their work instead: `faithfulness` on --sweep-tokens of the
    /// built-in corpus against its forward passes times one forward of that length, and
    /// `corpus`'s records of the 224 built-in texts many to a forward against one forward each.
    #[arg(long)]
    sweeps: bool,
    /// Time circuits instead (`attnscope circuit`): EAP of the IOI-style pair against 2
    /// forwards + 1 backward, EAP-IG (5 steps) against 6 forward + backward pairs, `--evaluate`'s
    /// ladder against 10 forwards, and EAP's time and peak memory at --circuit-tokens.
    #[arg(long)]
    circuits: bool,
    /// The longer pair's length for `--circuits`.
    #[arg(long, default_value_t = 128)]
    circuit_tokens: usize,
    /// The text length of `--sweeps`' faithfulness run.
    #[arg(long, default_value_t = 200)]
    sweep_tokens: usize,
    /// The anchor script --transformers runs, in place of the built-in copy.
    #[arg(long, value_name = "SCRIPT", requires = "transformers")]
    anchor: Option<std::path::PathBuf>,
    /// With `--precision fast`: load the model at exact precision too and time the two forwards
    /// in alternation at each length (exact, fast, exact, fast, …: one warm-up pair, then
    /// --repeats pairs), so fast's lead over exact comes from one run on the same machine state.
    #[arg(long)]
    against_exact: bool,
    /// Skip timing the backward (`Model::gradient`: a forward and backward of the last
    /// position's log-probability) against the forward.
    #[arg(long)]
    no_backward: bool,
    /// One screen of this machine instead: CPU, instruction sets, cores, caches, the measured
    /// f32 FMA peak and memory bandwidth, and each kernel's rate at the model's shapes against
    /// the limit that bounds it (the decode step against bandwidth ÷ bytes a token reads).
    #[arg(long)]
    machine: bool,
    #[arg(long)]
    json: bool,
}

/// The team's script for the transformers route (`../shared/bench/hf_anchor.py`).
const HF_ANCHOR: &str = include_str!("../../assets/hf_anchor.py");

#[derive(Serialize, Debug, Clone)]
pub(super) struct GemmRow {
    pub(super) name: &'static str,
    pub(super) m: usize,
    pub(super) k: usize,
    pub(super) n: usize,
    pub(super) attnscope_gflops: f64,
    candle_gflops: f64,
    /// the AMX tile kernel with three bf16 parts (exact's product), where the CPU has AMX
    amx_exact_gflops: Option<f64>,
    /// the AMX tile kernel with one bf16 part (fast's product)
    amx_fast_gflops: Option<f64>,
    /// exact on the AMX tiles as a quantized file's integers and scales (Q5_0-like weights:
    /// integers −16..15 times one scale per 32)
    pub(super) amx_scaled_gflops: Option<f64>,
}

#[derive(Serialize, Debug, Clone)]
struct ForwardRow {
    n: usize,
    forward_s: f64,
    projections_s: f64,
    projections_gflops: f64,
    attention_s: f64,
    attention_gflops: f64,
    with_patterns_s: Option<f64>,
    with_patterns_attention_s: Option<f64>,
    with_patterns_peak_bytes: Option<u64>,
    /// the products' floating-point operations (projections and useful attention work), and
    /// the time they take at the machine's measured f32 GEMM rate: the floor of an exact
    /// forward on the vector units
    flops: f64,
    f32_floor_s: f64,
}

/// A forward against a forward and backward (`Model::gradient`) at one length.
#[derive(Serialize, Debug, Clone)]
struct BackwardRow {
    n: usize,
    /// the engine's forward (the last position's logits), median
    forward_s: f64,
    /// `Model::gradient`: the forward that saves what the backward needs, and the backward
    forward_backward_s: f64,
    ratio: f64,
    /// the process's peak RSS during the forward and backward (the model's weights and their
    /// transposes included), where the kernel lets it be reset
    peak_rss_bytes: Option<u64>,
}

#[derive(Serialize, Debug, Clone)]
struct CommandRow {
    n: usize,
    command: String,
    wall_s: f64,
    peak_rss_bytes: u64,
    exit: i32,
    /// the command's own account of its time: loading the model, and everything after it (the
    /// forward, and for `capture` the writing), from the `(load X s, … Y s` it prints
    load_s: Option<f64>,
    after_load_s: Option<f64>,
}

/// `fast` against `exact` at one length, their forwards timed in alternation.
#[derive(Serialize, Debug, Clone)]
struct PrecisionRow {
    n: usize,
    /// medians of the timed pairs
    exact_s: f64,
    fast_s: f64,
    /// `exact_s / fast_s`
    faster_by: f64,
    /// exact over fast within each pair, in the order they ran
    pair_ratios: Vec<f64>,
}

/// What the anchor script prints (one JSON line); the fields the side-by-side table uses.
#[derive(serde::Deserialize, Serialize, Debug, Clone)]
struct AnchorOut {
    n_tokens: usize,
    attn: String,
    output_attentions: bool,
    load_s: f64,
    forward_median_s: f64,
    forward_min_s: f64,
    peak_rss_forward_mb: f64,
}

/// One attnscope command run --repeats times before the transformers route and --repeats
/// times after it.
#[derive(Serialize, Debug, Clone)]
struct SideRow {
    n: usize,
    command: &'static str,
    /// attnscope's wall times, load included, in the order they ran: the first half before
    /// transformers, the second half after
    wall_s: Vec<f64>,
    after_load_s: Vec<Option<f64>>,
    /// the medians of those runs (after the load: where every run printed its own timing)
    median_wall_s: f64,
    median_after_load_s: Option<f64>,
    transformers: AnchorOut,
    /// transformers' forward (median) over attnscope's median wall
    faster_by_median: f64,
    /// transformers' forward (median) over each of attnscope's walls: the lowest and highest
    faster_by: [f64; 2],
    faster_by_median_after_load: Option<f64>,
    faster_by_after_load: Option<[f64; 2]>,
}

/// The file `program` names: itself if it has a `/`, else the first match on `PATH`.
fn program_path(program: &std::path::Path) -> Option<std::path::PathBuf> {
    if program.components().count() > 1 || program.is_absolute() {
        return program.is_file().then(|| program.to_path_buf());
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// Floating-point operations, in GFLOP or TFLOP.
fn flops_text(flops: f64) -> String {
    if flops >= 1e11 {
        format!("{:.2} TFLOP", flops / 1e12)
    } else {
        format!("{:.2} GFLOP", flops / 1e9)
    }
}

/// The lowest and highest of `v`.
fn spread(v: &[f64]) -> [f64; 2] {
    [
        v.iter().copied().fold(f64::INFINITY, f64::min),
        v.iter().copied().fold(0.0, f64::max),
    ]
}

/// The lowest and highest of `theirs / ours` over attnscope's runs.
fn ratio_range(theirs: f64, ours: &[f64]) -> [f64; 2] {
    spread(&ours.iter().map(|&o| theirs / o).collect::<Vec<_>>())
}

/// The anchor's JSON line: the last line of `stdout` that parses as its output.
fn anchor_output(stdout: &str) -> Option<AnchorOut> {
    stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l.trim()).ok())
}

/// Runs the anchor script with `python` on `gguf` and the text in `file`; its forward timed
/// `reps` times after one warm-up.
fn run_anchor(
    python: &std::path::Path,
    script: &std::path::Path,
    gguf: &std::path::Path,
    file: &std::path::Path,
    attn: &str,
    output_attentions: bool,
    reps: usize,
) -> anyhow::Result<AnchorOut> {
    let mut cmd = std::process::Command::new(python);
    cmd.arg(script)
        .arg("--gguf")
        .arg(gguf)
        .arg("--file")
        .arg(file)
        .args(["--attn", attn, "--reps", &reps.to_string(), "--warmup", "1"])
        .args(["--threads", &rayon::current_num_threads().to_string()]);
    if output_attentions {
        cmd.arg("--output-attentions");
    }
    let out = cmd.output().map_err(|e| {
        super::common::usage(format!(
            "--transformers: cannot run {}: {e}; give the path of a Python that has torch and transformers",
            python.display()
        ))
    })?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    match anchor_output(&stdout) {
        Some(o) if out.status.success() => Ok(o),
        _ => {
            let err = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = err.lines().rev().take(6).collect();
            Err(anyhow::anyhow!(
                "the transformers route ({} {} --attn {attn}) {} and printed no result line; the end of its error output:\n{}\n(it needs torch, transformers and gguf; one way: python3 -m venv ~/.hfenv && ~/.hfenv/bin/pip install torch==2.15.0 transformers==5.24.0 accelerate gguf numpy, then --transformers ~/.hfenv/bin/python)",
                python.display(),
                script.display(),
                match out.status.code() {
                    Some(c) => format!("exited with {c}"),
                    None => "was killed".into(),
                },
                tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
            ))
        }
    }
}

/// The [`super::common::timings_opening`] (`(load X s, forward Y s`, or `forward and writing`)
/// that `inspect` and `capture` print at the end of their output, as `(X, Y)`.
fn own_timings(stdout: &str) -> Option<(f64, f64)> {
    let rest = &stdout[stdout.rfind("(load ")? + "(load ".len()..];
    let (load, rest) = rest.split_once(" s, ")?;
    let start = rest.find(|c: char| c.is_ascii_digit())?;
    let rest = &rest[start..];
    let (after, _) = rest.split_once(" s")?;
    Some((load.parse().ok()?, after.parse().ok()?))
}

/// Best of `reps` timed runs of `f` after one warm-up, in seconds.
fn best_of(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Runs this executable with `args`; returns (wall seconds, peak RSS bytes, exit code). The child
/// writes its own peak (`VmHWM`) to a file named by `ATTNSCOPE_PEAK_FILE` as it exits: `wait4`'s
/// `ru_maxrss` would report this process's own peak, which a spawned child inherits at exec.
fn run_self(
    args: &[String],
    peak_file: &std::path::Path,
) -> anyhow::Result<(f64, u64, i32, String)> {
    let exe = std::env::current_exe()?;
    let _ = std::fs::remove_file(peak_file);
    let start = Instant::now();
    let out = std::process::Command::new(exe)
        .args(args)
        .env("ATTNSCOPE_PEAK_FILE", peak_file)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .output()?;
    let wall = start.elapsed().as_secs_f64();
    let code = out.status.code().unwrap_or(-1);
    if code != 0 {
        anyhow::bail!(
            "`attnscope {}` exited with {code}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let peak = std::fs::read_to_string(peak_file)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(0);
    Ok((
        wall,
        peak,
        code,
        String::from_utf8_lossy(&out.stdout).into_owned(),
    ))
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.sweeps {
        if a.sweep_tokens < 2 {
            return Err(usage("--sweep-tokens must be at least 2"));
        }
        let model = a.model.load()?;
        return super::bench_sweeps::run(&model, a.sweep_tokens, a.json);
    }
    if a.circuits {
        if a.circuit_tokens < 2 {
            return Err(usage("--circuit-tokens must be at least 2"));
        }
        let model = a.model.load()?;
        return super::bench_circuits::run(&model, a.repeats, a.circuit_tokens, a.json);
    }
    if a.interventions {
        if a.repeats == 0 {
            return Err(usage("--repeats must be at least 1"));
        }
        let model = a.model.load()?;
        if a.transformers.is_some() && model.info.format != "gguf" {
            return Err(usage("--transformers loads the model through transformers' GGUF reader: give a .gguf file or alias"));
        }
        return super::bench_interventions::run(
            &model,
            a.repeats,
            a.transformers.as_deref(),
            a.json,
        );
    }
    if a.machine {
        let model = a.model.load()?;
        let n = 2048.min(model.dims.context_len);
        let rates = measure_gemms(&model.dims, n, a.repeats, &indicatif::ProgressBar::hidden())?;
        return super::bench_machine::run(&model, &rates, a.repeats, a.json);
    }
    check_flags(&a)?;
    let model = a.model.load()?;
    let max_n = check_model(&model, &a)?;
    let d = model.dims.clone();
    let all = attnscope::analysis::corpus::builtin_tokens(&model.tokenizer, max_n)?;
    let pb = steps_bar(&a);

    let rates = measure_gemms(&d, max_n, a.repeats, &pb)?;
    let forwards = measure_forwards(&model, &all, &a, rates.machine_rate, &pb)?;
    let backwards = if a.no_backward {
        Vec::new()
    } else {
        measure_backwards(&model, &all, &a, &pb)?
    };
    let precisions = if a.against_exact {
        fast_against_exact(&model, &all, &a, &pb)?
    } else {
        Vec::new()
    };
    let (commands, side) = if a.no_commands {
        (Vec::new(), Vec::new())
    } else {
        time_commands(&model, &all, &a, &pb)?
    };
    pb.finish_and_clear();
    let timed = Timed {
        forwards: &forwards,
        backwards: &backwards,
        precisions: &precisions,
        commands: &commands,
        side: &side,
    };
    report(&model, &a, &rates, &timed)
}

/// Refuses (exit 2) flags that contradict each other or name nothing, before the model loads.
fn check_flags(a: &Args) -> anyhow::Result<()> {
    if a.lengths.is_empty() || a.lengths.contains(&0) {
        return Err(usage("--lengths must be positive numbers, e.g. 512,2048"));
    }
    if a.repeats == 0 {
        return Err(usage("--repeats must be at least 1"));
    }
    if a.against_exact && a.model.precision != attnscope::model::Precision::Fast {
        return Err(usage(
            "--against-exact times fast next to exact: add --precision fast",
        ));
    }
    if let Some(python) = &a.transformers {
        if a.no_commands {
            return Err(usage(
                "--transformers times the Python route next to attnscope's commands: drop --no-commands",
            ));
        }
        if program_path(python).is_none() {
            return Err(usage(format!(
                "--transformers: no program {} (give the path of a Python that has torch and transformers)",
                python.display()
            )));
        }
        if let Some(p) = a.anchor.as_ref().filter(|p| !p.is_file()) {
            return Err(usage(format!("--anchor: no script at {}", p.display())));
        }
    }
    Ok(())
}

/// Refuses a model transformers cannot read, or lengths past its context; the longest length.
fn check_model(model: &attnscope::model::Model, a: &Args) -> anyhow::Result<usize> {
    if a.transformers.is_some() && model.info.format != "gguf" {
        return Err(usage(format!(
            "--transformers loads the model through transformers' GGUF reader, and {} is a {} model: give a .gguf file or alias",
            model.info.name, model.info.format
        )));
    }
    let d = &model.dims;
    let max_n = *a.lengths.iter().max().expect("non-empty");
    if max_n > d.context_len {
        return Err(anyhow::Error::new(attnscope::model::Error::TooLong {
            n_tokens: max_n,
            limit: d.context_len,
            model: model.info.name.clone(),
        }));
    }
    Ok(max_n)
}

/// The progress bar over every step the bench takes (and, off a terminal, a line saying how
/// many there are).
fn steps_bar(a: &Args) -> indicatif::ProgressBar {
    let per_length = match (a.no_commands, a.transformers.is_some()) {
        (true, _) => 1,
        (false, false) => 3,
        // each command, transformers' route, the command again
        (false, true) => 7,
    };
    let steps = 2 + a.lengths.len()
        * (per_length + usize::from(a.against_exact) + usize::from(!a.no_backward));
    let pb = super::common::progress_bar("{msg:32} [{bar:30}] {pos}/{len} ({elapsed})");
    pb.set_length(steps as u64);
    if !std::io::stderr().is_terminal() {
        eprintln!(
            "attnscope bench: {} steps (kernel, GEMM shapes, forwards{}); this takes minutes",
            steps,
            match (a.no_commands, a.transformers.is_some()) {
                (true, _) => "",
                (false, false) => ", commands",
                (false, true) => ", commands with transformers between their runs",
            }
        );
    }

    pb
}

/// What the steps measured, for the report.
struct Timed<'a> {
    forwards: &'a [ForwardRow],
    backwards: &'a [BackwardRow],
    precisions: &'a [PrecisionRow],
    commands: &'a [CommandRow],
    side: &'a [SideRow],
}

/// The forward against a forward and backward at each length, in alternation (one warm-up
/// pair, which also packs the projections' transposes, then --repeats pairs; medians).
fn measure_backwards(
    model: &attnscope::model::Model,
    all: &[u32],
    a: &Args,
    pb: &indicatif::ProgressBar,
) -> anyhow::Result<Vec<BackwardRow>> {
    use attnscope::model::backward::Metric;
    let mut rows = Vec::new();
    for &n in &a.lengths {
        let tokens = &all[..n];
        pb.set_message(format!("forward + backward, n = {n}"));
        let opts = RunOptions::last_logits(n);
        let (mut fw, mut fb) = (Vec::new(), Vec::new());
        let mut peak = None;
        for i in 0..=a.repeats {
            let t0 = Instant::now();
            model.forward(tokens, &opts, &mut NoCapture)?;
            let f = t0.elapsed().as_secs_f64();
            let resettable = i > 0 && reset_peak_rss();
            let t0 = Instant::now();
            let g = model.gradient(tokens, Metric::LogProb(None))?;
            let b = t0.elapsed().as_secs_f64();
            drop(g);
            if resettable {
                peak = peak.max(peak_rss_bytes());
            }
            if i > 0 {
                fw.push(f);
                fb.push(b);
            }
        }
        let (forward_s, forward_backward_s) = (median(fw), median(fb));
        rows.push(BackwardRow {
            n,
            forward_s,
            forward_backward_s,
            ratio: forward_backward_s / forward_s,
            peak_rss_bytes: peak,
        });
        pb.inc(1);
    }
    Ok(rows)
}

/// The machine's rates: the micro-kernel's in-cache peak and the products at the model's shapes.
pub(super) struct Rates {
    isa: Isa,
    peak: f64,
    pub(super) gemms: Vec<GemmRow>,
    /// the machine's f32 GEMM rate: the best measured at the shapes the forward runs
    machine_rate: f64,
}

/// The kernel's in-cache peak and the GEMM at the model's shapes (f32 packed, candle, AMX).
fn measure_gemms(
    d: &attnscope::model::ModelDims,
    max_n: usize,
    repeats: usize,
    pb: &indicatif::ProgressBar,
) -> anyhow::Result<Rates> {
    let isa = Isa::detect();
    pb.set_message("kernel peak");
    // a ceiling, so the best of three tries: one of this machine's read 116 GFLOP/s against
    // 220-226 in every other run (a moment when the two vCPUs shared a core, or were taken)
    let peak = (0..3)
        .map(|_| gemm::kernel_peak_gflops(isa, 0.4))
        .fold(0.0, f64::max);
    pb.inc(1);
    pb.set_message("GEMM at the model's shapes");
    let (nq, nk, dm, ff) = (
        d.n_heads * d.head_dim,
        d.n_kv_heads * d.head_dim,
        d.d_model,
        d.d_ff,
    );
    // the products as the forward runs them: q|k|v and o on every position at once, the MLP's
    // over blocks of positions
    let block = attnscope::model::forward::mlp_block_rows(ff).min(max_n);
    let shapes: [(&'static str, usize, usize, usize); 4] = [
        ("q|k|v", max_n, dm, nq + 2 * nk),
        ("o", max_n, nq, dm),
        ("gate|up (MLP block)", block, dm, 2 * ff),
        ("down (MLP block)", block, ff, dm),
    ];
    let mut rng = attnscope::reference::Rng::new(1);
    let mut gemms = Vec::new();
    for (name, m, k, n) in shapes {
        gemms.push(time_shape(
            GemmShape { name, m, k, n },
            isa,
            repeats,
            &mut rng,
        )?);
    }
    pb.inc(1);
    // the machine's f32 GEMM rate: the best measured at the shapes the forward runs
    let machine_rate = gemms
        .iter()
        .map(|g| g.attnscope_gflops.max(g.candle_gflops))
        .fold(0.0, f64::max);
    Ok(Rates {
        isa,
        peak,
        gemms,
        machine_rate,
    })
}

/// A product's shape: m rows of x (k wide) times the n rows of W.
#[derive(Clone, Copy)]
struct GemmShape {
    name: &'static str,
    m: usize,
    k: usize,
    n: usize,
}

/// One shape's rates: attnscope's packed f32 GEMM, AMX (bf16x3, bf16, Q5_0's integers and
/// scales) where the CPU has it, and candle's matmul.
fn time_shape(
    shape: GemmShape,
    isa: Isa,
    repeats: usize,
    rng: &mut attnscope::reference::Rng,
) -> anyhow::Result<GemmRow> {
    let GemmShape { name, m, k, n } = shape;
    let x = rng.normals(m * k, 1.0);
    let w = rng.normals(n * k, 0.05);
    let packed = PackedB::from_rows(&w, n, k, k, isa);
    let mut out = vec![0f32; m * n];
    let flops = 2.0 * (m * k * n) as f64;
    let ours = best_of(repeats, || {
        gemm::gemm(&x, k, m, &packed, &mut out, n, false)
    });
    let mut amx_rate = |splits: usize| {
        attnscope::kernels::amx::available().then(|| {
            let packed = attnscope::kernels::amx::PackedBf16::from_rows(&w, n, k, k, splits);
            let t = best_of(repeats, || {
                attnscope::kernels::amx::gemm(&x, k, m, &packed, &mut out, n, false)
            });
            flops / t / 1e9
        })
    };
    let (amx_exact_gflops, amx_fast_gflops) = (amx_rate(3), amx_rate(1));
    let amx_scaled_gflops = amx_scaled_rate(&x, &w, shape, repeats, &mut out);
    let xt = candle_core::Tensor::from_vec(x, (m, k), &candle_core::Device::Cpu)?;
    let wt = candle_core::Tensor::from_vec(w, (n, k), &candle_core::Device::Cpu)?;
    let candle = best_of(repeats, || {
        std::hint::black_box(xt.matmul(&wt.t().expect("2-d")).expect("matmul"));
    });
    Ok(GemmRow {
        name,
        m,
        k,
        n,
        attnscope_gflops: flops / ours / 1e9,
        candle_gflops: flops / candle / 1e9,
        amx_exact_gflops,
        amx_fast_gflops,
        amx_scaled_gflops,
    })
}

/// The AMX rate with W as Q5_0 holds it (per group of 32, a scale and integers −16..15);
/// `None` without AMX.
fn amx_scaled_rate(
    x: &[f32],
    w: &[f32],
    shape: GemmShape,
    repeats: usize,
    out: &mut [f32],
) -> Option<f64> {
    let GemmShape { m, k, n, .. } = shape;
    let flops = 2.0 * (m * k * n) as f64;
    // W as Q5_0 holds it: per group of 32, a scale and integers −16..15
    attnscope::kernels::amx::available()
        .then(|| {
            use attnscope::kernels::amx::scaled::{self, PackedScaled, GROUP};
            let packed = PackedScaled::from_row_source(n, k, false, |j, q, s, _| {
                let row = &w[j * k..(j + 1) * k];
                for (g, xs) in row.chunks(GROUP).enumerate() {
                    let top = xs.iter().fold(0f32, |m, x| m.max(x.abs()));
                    s[g] = half::f16::from_f32(top / 15.0).to_f32();
                    for (i, &x) in xs.iter().enumerate() {
                        q[g * GROUP + i] = if s[g] > 0.0 {
                            (x / s[g]).round().clamp(-16.0, 15.0)
                        } else {
                            0.0
                        };
                    }
                }
                true
            })?;
            let t = best_of(repeats, || {
                scaled::gemm(x, k, m, &packed, &mut *out, n, false)
            });
            Some(flops / t / 1e9)
        })
        .flatten()
}

/// The forward at each length: its parts' times and rates, and with every pattern kept.
fn measure_forwards(
    model: &attnscope::model::Model,
    all: &[u32],
    a: &Args,
    machine_rate: f64,
    pb: &indicatif::ProgressBar,
) -> anyhow::Result<Vec<ForwardRow>> {
    let d = &model.dims;
    let (nq, nk, dm, ff) = (
        d.n_heads * d.head_dim,
        d.n_kv_heads * d.head_dim,
        d.d_model,
        d.d_ff,
    );
    let layers = d.n_layers as f64;
    let mut forwards = Vec::new();
    for &n in &a.lengths {
        let tokens = &all[..n];
        pb.set_message(format!("forward, n = {n}"));
        let opts = RunOptions::last_logits(n);
        let mut runs = Vec::new();
        for i in 0..=a.repeats {
            let out = model.forward(tokens, &opts, &mut NoCapture)?;
            if i > 0 {
                runs.push(out.timings);
            }
        }
        let total = median(runs.iter().map(|t| t.total.as_secs_f64()).collect());
        let proj = median(runs.iter().map(|t| t.projections.as_secs_f64()).collect());
        let attn = median(runs.iter().map(|t| t.attention.as_secs_f64()).collect());
        // the products the forward runs: q|k|v on every row of every layer; o and the MLP too,
        // but on the last layer only for the one row whose logits are asked for
        let (qkv_row, tail_row) = ((dm * (nq + 2 * nk)) as f64, (nq * dm + 3 * dm * ff) as f64);
        let proj_flops =
            2.0 * (layers * n as f64 * qkv_row + ((layers - 1.0) * n as f64 + 1.0) * tail_row);
        // useful work: q·k and p·v over the n(n+1)/2 visible (query, key) pairs of every head
        let attn_flops =
            layers * d.n_heads as f64 * 4.0 * d.head_dim as f64 * (n * (n + 1) / 2) as f64;
        let pattern_bytes = 4.0 * (d.n_layers * d.n_heads) as f64 * (n as f64).powi(2);
        let (with_patterns_s, with_patterns_attention_s, with_patterns_peak_bytes) =
            if pattern_bytes <= a.capture_limit_gib * (1u64 << 30) as f64 {
                let resettable = reset_peak_rss();
                let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
                let out = model.forward(tokens, &opts, &mut cache)?;
                drop(cache);
                (
                    Some(out.timings.total.as_secs_f64()),
                    Some(out.timings.attention.as_secs_f64()),
                    if resettable { peak_rss_bytes() } else { None },
                )
            } else {
                (None, None, None)
            };
        forwards.push(ForwardRow {
            n,
            forward_s: total,
            projections_s: proj,
            projections_gflops: proj_flops / proj / 1e9,
            attention_s: attn,
            attention_gflops: attn_flops / attn / 1e9,
            with_patterns_s,
            with_patterns_attention_s,
            with_patterns_peak_bytes,
            flops: proj_flops + attn_flops,
            f32_floor_s: (proj_flops + attn_flops) / (machine_rate * 1e9),
        });
        pb.inc(1);
    }
    Ok(forwards)
}

/// fast against exact: both models held, their forwards in alternation.
fn fast_against_exact(
    model: &attnscope::model::Model,
    all: &[u32],
    a: &Args,
    pb: &indicatif::ProgressBar,
) -> anyhow::Result<Vec<PrecisionRow>> {
    let mut precisions = Vec::new();
    {
        pb.set_message("loading the exact model");
        let exact = ModelArgs {
            precision: attnscope::model::Precision::Exact,
            ..a.model.clone()
        }
        .load()?;
        if exact.info.precision != attnscope::model::Precision::Exact {
            return Err(usage(format!(
                "--against-exact: `{}` is a model loaded in this process at {} precision; load it at exact too to compare",
                a.model.model,
                exact.info.precision.name()
            )));
        }
        for &n in &a.lengths {
            pb.set_message(format!("fast against exact, n = {n}"));
            let (tokens, opts) = (&all[..n], RunOptions::last_logits(n));
            let (mut exact_s, mut fast_s) = (Vec::new(), Vec::new());
            for i in 0..=a.repeats {
                let e = exact.forward(tokens, &opts, &mut NoCapture)?.timings.total;
                let f = model.forward(tokens, &opts, &mut NoCapture)?.timings.total;
                if i > 0 {
                    exact_s.push(e.as_secs_f64());
                    fast_s.push(f.as_secs_f64());
                }
            }
            let pair_ratios = exact_s.iter().zip(&fast_s).map(|(e, f)| e / f).collect();
            let (exact_s, fast_s) = (median(exact_s), median(fast_s));
            precisions.push(PrecisionRow {
                n,
                exact_s,
                fast_s,
                faster_by: exact_s / fast_s,
                pair_ratios,
            });
            pb.inc(1);
        }
    }
    Ok(precisions)
}

/// The commands a user runs, start to end (load included), as separate processes; with
/// `--transformers`, the Python route between their runs.
fn time_commands(
    model: &attnscope::model::Model,
    all: &[u32],
    a: &Args,
    pb: &indicatif::ProgressBar,
) -> anyhow::Result<(Vec<CommandRow>, Vec<SideRow>)> {
    let mut commands = Vec::new();
    let mut side = Vec::new();
    {
        let dir = tempfile::tempdir()?;
        let anchor = anchor_script(a, dir.path())?;
        for &n in &a.lengths {
            let file = write_text(model, &all[..n], &dir.path().join(format!("text{n}.txt")))?;
            let base = model_flags(a);
            let fstr = file.to_string_lossy().into_owned();
            for (label, extra) in [
                (
                    "capture (all patterns → .safetensors)",
                    vec![
                        "--out".to_string(),
                        dir.path()
                            .join(format!("p{n}.safetensors"))
                            .to_string_lossy()
                            .into_owned(),
                        "--force".into(),
                    ],
                ),
                ("inspect", vec![]),
            ] {
                let sub = if label.starts_with("capture") {
                    "capture"
                } else {
                    "inspect"
                };
                pb.set_message(format!("{sub}, n = {n}"));
                let mut args = vec![sub.to_string()];
                args.extend(base.iter().cloned());
                args.extend(["--file".to_string(), fstr.clone()]);
                args.extend(extra);
                // the command in its own process: (wall, peak, exit, its own timings), its
                // output file removed
                let run_command = || -> anyhow::Result<_> {
                    let (wall, peak_b, exit, stdout) = run_self(&args, &dir.path().join("peak"))?;
                    let _ = std::fs::remove_file(dir.path().join(format!("p{n}.safetensors")));
                    Ok((wall, peak_b, exit, own_timings(&stdout)))
                };
                let (wall, peak_b, exit, own) = run_command()?;
                commands.push(CommandRow {
                    n,
                    command: label.to_string(),
                    wall_s: wall,
                    peak_rss_bytes: peak_b,
                    exit,
                    load_s: own.map(|t| t.0),
                    after_load_s: own.map(|t| t.1),
                });
                pb.inc(1);
                if let (Some(python), Some(script)) = (&a.transformers, &anchor) {
                    let first = (wall, own.map(|t| t.1));
                    let route = PythonRoute {
                        python,
                        script,
                        gguf: &model.info.path,
                        file: &file,
                    };
                    side.push(beside_transformers(
                        &route,
                        n,
                        sub,
                        first,
                        a.repeats,
                        pb,
                        run_command,
                    )?);
                }
            }
        }
    }
    Ok((commands, side))
}

/// The anchor script where the Python can run it: --anchor's, or the built-in one written into
/// `dir`; `None` without --transformers.
fn anchor_script(a: &Args, dir: &std::path::Path) -> anyhow::Result<Option<PathBuf>> {
    Ok(match (&a.transformers, &a.anchor) {
        (Some(_), Some(p)) => Some(p.clone()),
        (Some(_), None) => {
            let p = dir.join("hf_anchor.py");
            std::fs::write(&p, HF_ANCHOR)?;
            Some(p)
        }
        _ => None,
    })
}

/// The tokens' text written to `file` (the commands read it back).
fn write_text(
    model: &attnscope::model::Model,
    tokens: &[u32],
    file: &std::path::Path,
) -> anyhow::Result<PathBuf> {
    let bytes: Vec<u8> = tokens
        .iter()
        .flat_map(|&t| model.tokenizer.token_bytes(t))
        .collect();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    std::fs::write(file, &text)?;
    Ok(file.to_path_buf())
}

/// The model flags the timed commands get: the bench's own model, precision, memory setting
/// (`--memory low` reached the bench's own forward but not the commands it timed, which then
/// ran at the default setting) and BOS choice.
fn model_flags(a: &Args) -> Vec<String> {
    let mut base = vec![
        "-m".to_string(),
        a.model.model.clone(),
        "--precision".into(),
        a.model.precision.name().into(),
    ];
    if let Some(m) = a.model.memory {
        base.extend(["--memory".to_string(), m.name().into()]);
    }
    if a.model.bos {
        base.push("--bos".into());
    }
    if a.model.no_bos {
        base.push("--no-bos".into());
    }
    base
}

/// Where transformers runs: the Python, the anchor script, the model file and the text.
struct PythonRoute<'a> {
    python: &'a std::path::Path,
    script: &'a std::path::Path,
    gguf: &'a std::path::Path,
    file: &'a std::path::Path,
}

/// A command's runs around transformers' route: `first` (its wall time and time after the
/// load) and --repeats − 1 more before transformers, --repeats after; the medians and ratios.
fn beside_transformers(
    route: &PythonRoute,
    n: usize,
    sub: &'static str,
    first: (f64, Option<f64>),
    repeats: usize,
    pb: &indicatif::ProgressBar,
    run_command: impl Fn() -> anyhow::Result<(f64, u64, i32, Option<(f64, f64)>)>,
) -> anyhow::Result<SideRow> {
    // --repeats runs of the command before transformers (the first one above)
    // and --repeats after it: the machine's speed drifts within minutes, and a
    // median of several runs on each side says more than any one of them
    let mut walls = vec![first.0];
    let mut afters = vec![first.1];
    for _ in 1..repeats {
        let (w, _, _, o) = run_command()?;
        walls.push(w);
        afters.push(o.map(|t| t.1));
    }
    // what transformers offers for the same question: every weight (eager with
    // output_attentions) for capture, the plain forward (sdpa) for inspect
    let (attn, oa) = if sub == "capture" {
        ("eager", true)
    } else {
        ("sdpa", false)
    };
    pb.set_message(format!("transformers {attn}, n = {n}"));
    let theirs = run_anchor(
        route.python,
        route.script,
        route.gguf,
        route.file,
        attn,
        oa,
        repeats,
    )?;
    pb.inc(1);
    pb.set_message(format!("{sub} again, n = {n}"));
    for _ in 0..repeats {
        let (w, _, _, o) = run_command()?;
        walls.push(w);
        afters.push(o.map(|t| t.1));
    }
    // (a command's own timing is printed to the millisecond: a tiny model's
    // can read 0)
    let after: Option<Vec<f64>> = afters.iter().map(|x| x.filter(|&x| x > 0.0)).collect();
    let median_wall = median(walls.clone());
    let median_after = after.as_ref().map(|v| median(v.clone()));
    let t = theirs.forward_median_s;
    let row = SideRow {
        n,
        command: sub,
        faster_by: ratio_range(t, &walls),
        faster_by_median: t / median_wall,
        faster_by_after_load: after.as_ref().map(|v| ratio_range(t, v)),
        faster_by_median_after_load: median_after.map(|m| t / m),
        wall_s: walls,
        after_load_s: afters,
        median_wall_s: median_wall,
        median_after_load_s: median_after,
        transformers: theirs,
    };
    pb.inc(1);
    Ok(row)
}

/// The tables (or the JSON document) of what was measured.
fn report(
    model: &attnscope::model::Model,
    a: &Args,
    rates: &Rates,
    timed: &Timed,
) -> anyhow::Result<()> {
    let (forwards, backwards, precisions, commands, side) = (
        timed.forwards,
        timed.backwards,
        timed.precisions,
        timed.commands,
        timed.side,
    );
    let (isa, peak, gemms, machine_rate) =
        (rates.isa, rates.peak, &rates.gemms, rates.machine_rate);
    let (cpu, threads) = machine();
    if a.json {
        let doc = serde_json::json!({
            "model": model.info.name, "precision": model.info.precision.name(), "cpu": cpu, "threads": threads,
            "kernel": isa.name(), "simd": attnscope::kernels::simd::level().name(), "kernel_peak_gflops": peak, "machine_gemm_gflops": machine_rate,
            "gemm": gemms, "forward": forwards, "backward": backwards, "commands": commands, "repeats": a.repeats,
            "transformers": side, "fast_vs_exact": precisions,
        });
        return emit(&format!("{}\n", serde_json::to_string_pretty(&doc)?));
    }
    let mut s = title(&format!(
        "Where the time goes: {} ({} precision)",
        model.info.name,
        model.info.precision.name()
    ));
    s += &format!("{threads} threads on {cpu}; micro-kernel {} ({}x{} tile); element-wise loops {}; median of {} runs after 1 warm-up.\n\n", isa.name(), isa.mr(), isa.nr(), attnscope::kernels::simd::level().name(), a.repeats);
    s += &format!(
        "Micro-kernel in cache (the ceiling of any product; best of 3 tries): {peak:.0} GFLOP/s\n"
    );
    s += &format!("Machine f32 GEMM rate (best measured below, at the shapes of the forward's products): {machine_rate:.0} GFLOP/s\n\n");
    s += &gemm_table(model, gemms);
    s += &forward_table(forwards, machine_rate);
    if !backwards.is_empty() {
        s += &backward_table(backwards, a.repeats);
    }
    if !precisions.is_empty() {
        s += &precision_table(precisions, a.repeats);
    }
    if !commands.is_empty() {
        s += &command_table(model, commands);
    }
    if !side.is_empty() {
        s += &side_by_side(side, forwards, machine_rate, peak, a);
    }
    emit(&s)
}

/// The GEMM table: each of the forward's products on the packed f32 kernel, candle and the AMX
/// tiles, and which of them the forward runs.
fn gemm_table(model: &attnscope::model::Model, gemms: &[GemmRow]) -> String {
    let mut s = String::new();
    let mut t = Table::new([
        ("f32 GEMM, m tokens", Align::Left),
        ("m × k · k × n", Align::Right),
        ("attnscope packed", Align::Right),
        ("candle matmul", Align::Right),
        ("ratio", Align::Right),
        ("AMX integers (exact)", Align::Right),
        ("AMX bf16x3 (exact)", Align::Right),
        ("AMX bf16 (fast)", Align::Right),
    ]);
    let rate = |x: Option<f64>| {
        x.map(|r| format!("{r:.0} GFLOP/s"))
            .unwrap_or_else(|| "no AMX".into())
    };
    for g in gemms {
        t.row([
            g.name.to_string(),
            format!("{} × {} · {} × {}", g.m, g.k, g.k, g.n),
            format!("{:.0} GFLOP/s", g.attnscope_gflops),
            format!("{:.0} GFLOP/s", g.candle_gflops),
            format!("{:.2}x", g.attnscope_gflops / g.candle_gflops),
            rate(g.amx_scaled_gflops),
            rate(g.amx_exact_gflops),
            rate(g.amx_fast_gflops),
        ]);
    }
    s += &t.render();
    if attnscope::kernels::amx::available() {
        s += &format!(
            "AMX columns: the same product on Intel AMX tiles, f32 result: exact as a quantized file's integers (here Q5_0-like: −16..15 times a scale per 32) times three bf16 parts of the activations, or as six bf16 products; fast as one. The forward below runs its projections on {}.\n",
            match (model.info.precision, attnscope::kernels::amx::exact_on_tiles()) {
                (attnscope::model::Precision::Fast, _) => "the tiles with one part".to_string(),
                (attnscope::model::Precision::Exact, true) => {
                    "the tiles with three parts (ATTNSCOPE_AMX=exact)".to_string()
                }
                (attnscope::model::Precision::Exact, false) => match model.scaled_projections() {
                    (0, _) => "the f32 kernel".to_string(),
                    (s, all) => format!(
                        "the tiles as the file's integers ({s} of {all} projections; the others on the f32 kernel; ATTNSCOPE_AMX=f32 puts them all there)"
                    ),
                },
            }
        );
    }
    s += "\n";
    s
}

/// The forward at each length: projections and attention, their rates against the machine's,
/// and the forward with every pattern kept.
fn forward_table(forwards: &[ForwardRow], machine_rate: f64) -> String {
    let mut s = String::new();
    let mut t = Table::new([
        ("n", Align::Right),
        ("forward", Align::Right),
        ("projections", Align::Right),
        ("rate (of machine)", Align::Right),
        ("attention", Align::Right),
        ("rate (of machine)", Align::Right),
        ("all patterns (attention)", Align::Right),
        ("peak RSS", Align::Right),
    ]);
    for f in forwards {
        t.row([
            f.n.to_string(),
            format!("{:.2} s", f.forward_s),
            format!("{:.2} s", f.projections_s),
            format!(
                "{:.0} GFLOP/s ({:.0}%)",
                f.projections_gflops,
                100.0 * f.projections_gflops / machine_rate
            ),
            format!("{:.2} s", f.attention_s),
            format!(
                "{:.0} GFLOP/s ({:.0}%)",
                f.attention_gflops,
                100.0 * f.attention_gflops / machine_rate
            ),
            f.with_patterns_s
                .map(|x| {
                    format!(
                        "{x:.2} s ({:.2} s)",
                        f.with_patterns_attention_s.unwrap_or(0.0)
                    )
                })
                .unwrap_or_else(|| "skipped".into()),
            f.with_patterns_peak_bytes
                .map(|b| format!("{:.2} GB", b as f64 / 1e9))
                .unwrap_or_else(|| "—".into()),
        ]);
    }
    s += &t.render();
    s += "Attention rates count the useful work (q·k and p·v over the visible pairs of every head).\n";
    s
}

/// The forward against forward + backward at each length (medians of `repeats` pairs).
fn backward_table(backwards: &[BackwardRow], repeats: usize) -> String {
    let mut s = String::new();
    s += &format!(
        "\nForward against forward + backward (the gradient of the last position's log-probability wrt every input embedding and resid_pre; in alternation, median of {} pairs after a warm-up pair)\n",
        repeats
    );
    let mut t = Table::new([
        ("n", Align::Right),
        ("forward", Align::Right),
        ("forward + backward", Align::Right),
        ("ratio", Align::Right),
        ("peak RSS (weights included)", Align::Right),
    ]);
    for b in backwards {
        t.row([
            b.n.to_string(),
            format!("{:.2} s", b.forward_s),
            format!("{:.2} s", b.forward_backward_s),
            format!("{:.2}x", b.ratio),
            b.peak_rss_bytes
                .map(|x| format!("{:.2} GB", x as f64 / 1e9))
                .unwrap_or_else(|| "—".into()),
        ]);
    }
    s += &t.render();
    s
}

/// fast against exact at each length (medians of `repeats` pairs, and each pair's ratio).
fn precision_table(precisions: &[PrecisionRow], repeats: usize) -> String {
    let mut s = String::new();
    s += &format!(
        "\nfast ({}) against exact, their forwards in alternation (median of {} pairs after a warm-up pair)\n",
        attnscope::model::weights::fast_kernel().unwrap_or("no kernel of its own here: it runs exact's"),
        repeats
    );
    let mut t = Table::new([
        ("n", Align::Right),
        ("exact", Align::Right),
        ("fast", Align::Right),
        ("fast faster by", Align::Right),
        ("each pair", Align::Right),
    ]);
    for r in precisions {
        t.row([
            r.n.to_string(),
            format!("{:.2} s", r.exact_s),
            format!("{:.2} s", r.fast_s),
            format!("{:.2}x", r.faster_by),
            r.pair_ratios
                .iter()
                .map(|x| format!("{x:.2}x"))
                .collect::<Vec<_>>()
                .join(", "),
        ]);
    }
    s += &t.render();
    s
}

/// Each command in its own process: wall time, its load, after the load, peak memory, and
/// where its load took the packed weights from.
fn command_table(model: &attnscope::model::Model, commands: &[CommandRow]) -> String {
    let mut s = String::new();
    s += "\n";
    let mut t = Table::new([
        ("n", Align::Right),
        ("command (own process, load included)", Align::Left),
        ("wall", Align::Right),
        ("of which load", Align::Right),
        ("after the load", Align::Right),
        ("peak RSS", Align::Right),
    ]);
    let secs = |x: Option<f64>| x.map(|x| format!("{x:.2} s")).unwrap_or_else(|| "—".into());
    for c in commands {
        t.row([
            c.n.to_string(),
            c.command.clone(),
            format!("{:.2} s", c.wall_s),
            secs(c.load_s),
            secs(c.after_load_s),
            format!("{:.2} GB", c.peak_rss_bytes as f64 / 1e9),
        ]);
    }
    s += &t.render();
    s += "Load and after the load are the commands' own timings (tokenizing and printing or renaming are in neither). Compare with transformers timed in the same session on this machine (eager with output_attentions for capture, sdpa for inspect): its forward alone, or its forward plus its own load.\n";
    s += &match model.panel_file() {
        Some(p) => format!("Their loads map the packed weights from {} (this bench's own load wrote it if it was missing); ATTNSCOPE_PANEL_CACHE=off times packing them instead.\n", p.display()),
        None => "Their loads pack the weights (no packed-weight cache for this model and precision).\n".into(),
    };
    s
}

/// The side-by-side table, and for each length what a third of transformers' eager forward
/// leaves against the floor of an exact forward at the machine's f32 GEMM rate.
fn side_by_side(
    side: &[SideRow],
    forwards: &[ForwardRow],
    machine_rate: f64,
    kernel_peak: f64,
    a: &Args,
) -> String {
    let mut s = format!(
        "\nSide by side with transformers ({} by {}; its forward alone, median of {} after 1 warm-up, on the same text, between attnscope's runs of the command: {} before it, {} after)\n",
        a.anchor
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "the built-in hf_anchor.py".into()),
        a.transformers
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        a.repeats,
        a.repeats,
        a.repeats,
    );
    s += &side_table(side);
    s += &format!("faster by: transformers' forward (median) over attnscope's median wall time (its load included) and over its median time after the load; in brackets the same over each of attnscope's {} runs, lowest and highest.\n", 2 * a.repeats);
    s += &eager_budget_lines(side, forwards, machine_rate, kernel_peak);
    s
}

/// Each command's wall time against transformers' forward at each length: how much faster.
fn side_table(side: &[SideRow]) -> String {
    let mut t = Table::new([
        ("n", Align::Right),
        ("attnscope", Align::Left),
        ("wall, median (range)", Align::Right),
        ("after the load", Align::Right),
        ("transformers", Align::Left),
        ("forward (min)", Align::Right),
        ("faster by", Align::Right),
        ("after the load", Align::Right),
    ]);
    let range = |r: [f64; 2]| {
        if format!("{:.1}", r[0]) == format!("{:.1}", r[1]) {
            format!("{:.1}", r[0])
        } else {
            format!("{:.1}-{:.1}", r[0], r[1])
        }
    };
    for r in side {
        let afters: Option<Vec<f64>> = r.after_load_s.iter().copied().collect();
        let [lo, hi] = spread(&r.wall_s);
        t.row([
            r.n.to_string(),
            r.command.to_string(),
            format!("{:.2} s ({lo:.2}-{hi:.2})", r.median_wall_s),
            match (r.median_after_load_s, afters) {
                (Some(m), Some(v)) => {
                    let [lo, hi] = spread(&v);
                    format!("{m:.2} s ({lo:.2}-{hi:.2})")
                }
                _ => "—".into(),
            },
            format!(
                "{}{} ({} tokens)",
                r.transformers.attn,
                if r.transformers.output_attentions {
                    " + output_attentions"
                } else {
                    ""
                },
                r.transformers.n_tokens
            ),
            format!(
                "{:.2} s ({:.2})",
                r.transformers.forward_median_s, r.transformers.forward_min_s
            ),
            format!("{:.1}x ({})", r.faster_by_median, range(r.faster_by)),
            match (r.faster_by_median_after_load, r.faster_by_after_load) {
                (Some(m), Some(rg)) => format!("{m:.1}x ({})", range(rg)),
                _ => "—".into(),
            },
        ]);
    }
    t.render()
}

/// Where transformers' eager forward keeps every weight: what a third of its time leaves
/// against the exact forward's floor at the machine's GEMM rate and at the kernel's peak.
fn eager_budget_lines(
    side: &[SideRow],
    forwards: &[ForwardRow],
    machine_rate: f64,
    kernel_peak: f64,
) -> String {
    let mut s = String::new();
    for r in side.iter().filter(|r| r.transformers.output_attentions) {
        let Some(f) = forwards.iter().find(|f| f.n == r.n) else {
            continue;
        };
        let third = r.transformers.forward_median_s / 3.0;
        let at_peak = f.flops / (kernel_peak * 1e9);
        s += &format!(
            "n = {}: 3x transformers' eager forward leaves {:.2} s; the exact forward's {} take {:.2} s at this machine's f32 GEMM rate ({:.0} GFLOP/s), {:.2} s at the micro-kernel's in-cache rate ({:.0}){}\n",
            r.n,
            third,
            flops_text(f.flops),
            f.f32_floor_s,
            machine_rate,
            at_peak,
            kernel_peak,
            if third < at_peak.min(f.f32_floor_s) {
                ": past what the vector units can do, whatever the kernel (only the AMX tiles, where the CPU has them, go faster than that)"
            } else {
                ""
            }
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::own_timings;

    #[test]
    fn the_timed_commands_get_the_benchs_model_flags() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            bench: super::Args,
        }
        let flags = |argv: &[&str]| {
            let cli = Cli::try_parse_from(std::iter::once("bench").chain(argv.iter().copied()));
            super::model_flags(&cli.expect("bench's flags").bench).join(" ")
        };
        assert_eq!(
            flags(&["-m", "smollm2-135m", "--memory", "low", "--no-bos"]),
            "-m smollm2-135m --precision exact --memory low --no-bos"
        );
        assert_eq!(
            flags(&["--precision", "fast", "--memory", "fast"]),
            "-m qwen2.5-coder-0.5b --precision fast --memory fast"
        );
        assert_eq!(flags(&[]), "-m qwen2.5-coder-0.5b --precision exact");
    }

    #[test]
    fn the_commands_own_timings_are_read_from_their_last_line() {
        use crate::cli::common::timings_opening;
        // as inspect and capture end their output (a path may hold "(load" too)
        let inspect = format!(
            "report…\n{} of which attention 1.204 s)\n",
            timings_opening(0.95, "forward", 4.712)
        );
        assert_eq!(own_timings(&inspect), Some((0.95, 4.712)));
        let capture = format!(
            "wrote 48 tensors (5637.1 MB) for 2048 tokens of m (exact precision) to /t/p (load) 2048.safetensors {})\n",
            timings_opening(1.02, "forward and writing", 5.31)
        );
        assert_eq!(own_timings(&capture), Some((1.02, 5.31)));
        assert_eq!(own_timings("no timings here\n"), None);
        assert_eq!(own_timings("(load x s, forward 1 s)"), None);
    }
}
