//! `attnscope scaling`: how the cost of attention grows with the length, measured.

use super::common::{emit, progress_bar, usage, ModelArgs};
use attnscope::analysis::measure::{loglog_slope, machine};
use attnscope::commands::scaling::{measure_setting, Setting};
use attnscope::render::table::{bar, title, Align, Table};
use serde::Serialize;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Sequence lengths (tokens of real text: the built-in corpus, repeated as needed).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "128,256,512,1024,2048,4096"
    )]
    lengths: Vec<usize>,
    /// Timed runs per setting (after one warm-up run), 1 to 1000; the median is reported.
    #[arg(long, default_value_t = 3, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1000))]
    repeats: usize,
    /// Skip pattern capture where the patterns alone would exceed this many GiB.
    #[arg(long, default_value_t = 6.0, value_parser = attnscope::analysis::request::non_negative)]
    capture_limit_gib: f64,
    #[arg(long)]
    json: bool,
}

#[derive(Serialize, Clone, Debug)]
struct Row {
    n: usize,
    no_capture: Setting,
    capture: Option<Setting>,
    pattern_bytes: f64,
}

pub(super) use attnscope::commands::scaling::median;

/// `f`'s result and the seconds it took.
pub(super) fn timed<T, E: Into<anyhow::Error>>(
    f: impl FnOnce() -> Result<T, E>,
) -> anyhow::Result<(f64, T)> {
    let t = std::time::Instant::now();
    let r = f().map_err(Into::into)?;
    Ok((t.elapsed().as_secs_f64(), r))
}

/// `repeat` runs of `each` before `middle` and as many after it (the machine's speed drifts, so
/// what `middle` is set against is timed on both sides of it); `middle`'s result.
pub(super) fn before_and_after<T>(
    repeat: usize,
    mut each: impl FnMut() -> anyhow::Result<()>,
    middle: impl FnOnce() -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    (0..repeat).try_for_each(|_| each())?;
    let r = middle()?;
    (0..repeat).try_for_each(|_| each())?;
    Ok(r)
}

/// A bench section's title (`what, model (threads)`) and its table of measurements: what was
/// measured, the seconds, a note.
pub(super) fn measurement_table(what: &str, model: &str) -> (String, Table) {
    let s = title(&format!(
        "{what}, {model} ({} threads)",
        rayon::current_num_threads()
    ));
    let t = Table::new([
        ("measurement", Align::Left),
        ("seconds", Align::Right),
        ("", Align::Left),
    ]);
    (s, t)
}

/// `attnscope scaling`: the settings measured at each length, the fitted exponents, as JSON or
/// a table and a log-scale chart.
pub fn run(a: Args) -> anyhow::Result<()> {
    if a.lengths.is_empty() || a.lengths.contains(&0) {
        return Err(usage(
            "--lengths must be positive numbers, e.g. 128,256,512",
        ));
    }
    if a.repeats == 0 {
        return Err(usage("--repeats must be at least 1"));
    }
    let model = a.model.load()?;
    let d = &model.dims;
    let max_n = *a.lengths.iter().max().expect("non-empty");
    if max_n > d.context_len {
        return Err(anyhow::Error::new(attnscope::model::Error::TooLong {
            n_tokens: max_n,
            limit: d.context_len,
            model: model.info.name.clone(),
        }));
    }
    let rows = measure_rows(&model, &a)?;
    let fits = Fits::of(&rows);
    let (cpu, threads) = machine();
    // layers that attend through a sliding window cost O(n · window), not O(n²)
    let windowed = d.windowed_layers();
    if a.json {
        let doc = serde_json::json!({
            "model": model.info.name, "precision": model.info.precision.name(), "cpu": cpu, "threads": threads,
            "repeats": a.repeats, "warmup_runs": 1, "rows": rows,
            "sliding_window": d.sliding_window, "windowed_layers": windowed,
            "exponents": {"attention": fits.attention.0, "attention_long_half": fits.attention.1, "projections": fits.projections.0, "projections_long_half": fits.projections.1,
                          "forward": fits.forward.0, "forward_long_half": fits.forward.1, "forward_with_capture": fits.capture},
        });
        return emit(&format!("{}\n", serde_json::to_string_pretty(&doc)?));
    }
    let mut s = title(&format!(
        "Scaling of {} ({} precision) with the sequence length",
        model.info.name,
        model.info.precision.name()
    ));
    s += &format!("{threads} threads on {cpu}; median of {} runs after 1 warm-up per setting; text from the built-in corpus.\n", a.repeats);
    if let (Some(w), false) = (d.sliding_window, windowed.is_empty()) {
        let list: Vec<String> = windowed.iter().map(|l| l.to_string()).collect();
        s += &format!(
            "{} of {} layers ({}) attend through a sliding window of {w} tokens: their scores grow as n · {w}, not n², once n > {w}; the others' as n².\n",
            windowed.len(),
            d.n_layers,
            list.join(", ")
        );
    }
    s += "\n";
    s += &rows_table(&rows);
    s += &log_chart(&rows, &fits);
    let f = |x: Option<f64>| x.map(|v| format!("{v:.2}")).unwrap_or_else(|| "—".into());
    s += &format!(
        "\nfitted exponents (time ~ n^k, all lengths / longer half): attention {} / {}, projections+MLP {} / {}, whole forward {} / {}; with capture {}\n",
        f(fits.attention.0), f(fits.attention.1), f(fits.projections.0), f(fits.projections.1), f(fits.forward.0), f(fits.forward.1), f(fits.capture)
    );
    s += "Attention should approach 2 (every query against every key) and the projections 1 (each token on its own).\n";
    emit(&s)
}

/// Each length of `--lengths` on the built-in corpus's text: without capture, and with every
/// pattern captured where the patterns fit `--capture-limit-gib`.
fn measure_rows(model: &attnscope::model::Model, a: &Args) -> anyhow::Result<Vec<Row>> {
    let d = &model.dims;
    let max_n = *a.lengths.iter().max().expect("non-empty");
    let all = attnscope::analysis::corpus::builtin_tokens(&model.tokenizer, max_n)?;
    let bar_ = progress_bar("{msg:24} [{bar:30}] {pos}/{len} ({elapsed})");
    bar_.set_length((a.lengths.len() * 2) as u64);
    let mut rows = Vec::new();
    for &n in &a.lengths {
        let tokens = &all[..n];
        bar_.set_message(format!("n = {n}, no capture"));
        let no_capture = measure_setting(model, tokens, false, a.repeats)?;
        bar_.inc(1);
        let pattern_bytes = 4.0 * (d.n_layers * d.n_heads) as f64 * (n as f64).powi(2);
        let capture = if pattern_bytes <= a.capture_limit_gib * (1u64 << 30) as f64 {
            bar_.set_message(format!("n = {n}, capture"));
            Some(measure_setting(model, tokens, true, a.repeats)?)
        } else {
            None
        };
        bar_.inc(1);
        rows.push(Row {
            n,
            no_capture,
            capture,
            pattern_bytes,
        });
    }
    bar_.finish_and_clear();
    Ok(rows)
}

/// The measured times per length and their fitted exponents (time ~ n^k): over all lengths and
/// over the longer half, where fixed costs no longer dominate.
struct Fits {
    /// the attention's seconds per length, without capture
    attn: Vec<f64>,
    /// the projections' and MLP's seconds per length (the forward less the attention)
    proj: Vec<f64>,
    attention: (Option<f64>, Option<f64>),
    projections: (Option<f64>, Option<f64>),
    forward: (Option<f64>, Option<f64>),
    /// the forward with capture, over the lengths where it ran
    capture: Option<f64>,
}

impl Fits {
    /// The fits of `rows`.
    fn of(rows: &[Row]) -> Fits {
        let ns: Vec<f64> = rows.iter().map(|r| r.n as f64).collect();
        let attn: Vec<f64> = rows.iter().map(|r| r.no_capture.attention_s).collect();
        let total: Vec<f64> = rows.iter().map(|r| r.no_capture.median_s).collect();
        let proj: Vec<f64> = rows
            .iter()
            .map(|r| (r.no_capture.median_s - r.no_capture.attention_s).max(1e-9))
            .collect();
        let cap: Vec<(f64, f64)> = rows
            .iter()
            .filter_map(|r| r.capture.as_ref().map(|c| (r.n as f64, c.median_s)))
            .collect();
        // the exponent over the longer half, where fixed costs no longer dominate
        let half = ns.len() / 2;
        let fit = |ys: &[f64]| {
            (
                loglog_slope(&ns, ys),
                loglog_slope(&ns[half..], &ys[half..]),
            )
        };
        Fits {
            attention: fit(&attn),
            projections: fit(&proj),
            forward: fit(&total),
            capture: loglog_slope(
                &cap.iter().map(|c| c.0).collect::<Vec<_>>(),
                &cap.iter().map(|c| c.1).collect::<Vec<_>>(),
            ),
            attn,
            proj,
        }
    }
}

/// The table of every length: attention, projections+MLP, forward, peak memory, with capture.
fn rows_table(rows: &[Row]) -> String {
    let mb = |b: Option<u64>| {
        b.map(|x| format!("{:.0} MB", x as f64 / 1e6))
            .unwrap_or_else(|| "—".into())
    };
    let mut t = Table::new([
        ("n", Align::Right),
        ("attention", Align::Right),
        ("projections+MLP", Align::Right),
        ("forward", Align::Right),
        ("peak RSS", Align::Right),
        ("with capture", Align::Right),
        ("peak RSS", Align::Right),
        ("patterns", Align::Right),
    ]);
    for r in rows {
        t.row([
            r.n.to_string(),
            format!("{:.3} s", r.no_capture.attention_s),
            format!("{:.3} s", r.no_capture.median_s - r.no_capture.attention_s),
            format!("{:.3} s", r.no_capture.median_s),
            mb(r.no_capture.peak_rss_bytes),
            r.capture
                .as_ref()
                .map(|c| format!("{:.3} s", c.median_s))
                .unwrap_or_else(|| "skipped".into()),
            r.capture
                .as_ref()
                .map(|c| mb(c.peak_rss_bytes))
                .unwrap_or_else(|| "—".into()),
            format!("{:.0} MB", r.pattern_bytes / 1e6),
        ]);
    }
    t.render()
}

/// A log-scale chart: each bar spans log10(time) from the fastest to the slowest figure.
fn log_chart(rows: &[Row], fits: &Fits) -> String {
    let (attn, proj) = (&fits.attn, &fits.proj);
    let lo = attn
        .iter()
        .chain(proj)
        .copied()
        .fold(f64::INFINITY, f64::min)
        .max(1e-6)
        .log10();
    let hi = attn
        .iter()
        .chain(proj)
        .copied()
        .fold(0.0f64, f64::max)
        .max(1e-6)
        .log10();
    let scale = |v: f64| {
        if hi > lo {
            ((v.max(1e-6).log10() - lo) / (hi - lo)) as f32
        } else {
            1.0
        }
    };
    let mut s = "\nlog-scale time per length (A = attention, P = projections + MLP):\n".to_string();
    for (i, r) in rows.iter().enumerate() {
        s += &format!(
            "{:>6} A {:<40} {:.3} s\n       P {:<40} {:.3} s\n",
            r.n,
            bar(scale(attn[i]), 40),
            attn[i],
            bar(scale(proj[i]), 40),
            proj[i]
        );
    }
    s
}
