//! `attnscope patch`: activation patching between a clean and a corrupted text.

use super::common::{emit, on_bar, output_path, progress_bar, usage, ModelArgs};
use attnscope::analysis::vocab::PatchHook;
use attnscope::analysis::vocab::Target;
use attnscope::commands::patch::{
    self as command, Agreement, ApproxKind, PatchInput, PatchOptions, PatchReport,
};
use attnscope::model::tokenize::visible;
use attnscope::render::patch_page::patch_page;
use attnscope::render::table::title;
use std::io::IsTerminal;
use std::path::PathBuf;

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum HookArg {
    /// a decoder layer's input (`blocks.L.hook_resid_pre`), one position at a time
    #[value(alias = "resid_pre", alias = "hook_resid_pre")]
    ResidPre,
    /// the attention block's output (`hook_attn_out`), one position at a time
    #[value(alias = "attn_out", alias = "hook_attn_out")]
    AttnOut,
    /// the MLP's output (`hook_mlp_out`), one position at a time
    #[value(alias = "mlp_out", alias = "hook_mlp_out")]
    MlpOut,
    /// one head's output before W_O (`attn.hook_z`), every position
    #[value(alias = "hook_z", alias = "attn.hook_z")]
    Z,
    /// one head's whole attention pattern (`attn.hook_pattern`): where it looks, from the clean run
    #[value(alias = "hook_pattern", alias = "attn.hook_pattern", alias = "attn")]
    Pattern,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The clean text (the model gets it right).
    #[arg(long, value_parser = some_text)]
    clean: String,
    /// The corrupted text: the same number of tokens, one detail changed.
    #[arg(long, value_parser = some_text)]
    corrupt: String,
    /// The token the clean text should predict: a token id or its text (e.g. " Alice").
    /// Default: the clean run's top next token.
    #[arg(long)]
    answer: Option<Target>,
    /// The token the corrupted text should predict. Default: the corrupted run's top next token.
    #[arg(long)]
    wrong: Option<Target>,
    /// Which activation is taken from the clean run.
    #[arg(long, value_enum, default_value_t = HookArg::ResidPre)]
    hook: HookArg,
    /// Also write the heatmap as a self-contained HTML page: hover a cell for its numbers, click
    /// it to show them.
    #[arg(long)]
    html: Option<PathBuf>,
    /// Replace the --html file if it exists.
    #[arg(long)]
    force: bool,
    /// Also attribution patching: each cell estimated to first order, (clean − corrupt) ·
    /// ∂(logit diff)/∂activation at the corrupted run, from two forwards and one backward; printed
    /// beside the exact grid with their Pearson and Spearman correlations (resid-pre, attn-out,
    /// mlp-out, z).
    #[arg(long)]
    approx: bool,
    /// Most positions stacked into one forward.
    #[arg(long, default_value_t = attnscope::analysis::intervene::DEFAULT_BATCH_ROWS, hide = true)]
    batch_rows: usize,
    #[arg(long)]
    json: bool,
}

/// `--clean`'s and `--corrupt`'s parser: an empty text is refused under the flag's own name
/// (the model's message would say to use --text).
fn some_text(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err("the text is empty (or only whitespace)".into());
    }
    Ok(s.to_string())
}

pub fn run(a: Args) -> anyhow::Result<()> {
    // refused before the runs, not after them (the rename checks again)
    let output = a
        .html
        .as_deref()
        .map(|h| output_path(h, a.force, &a.model.input_paths()))
        .transpose()?;
    let model = a.model.load()?;
    let input = PatchInput {
        clean: model.encode(&a.clean, a.model.bos)?,
        corrupt: model.encode(&a.corrupt, a.model.bos)?,
    };
    for (t, what) in [(&a.answer, "--answer"), (&a.wrong, "--wrong")] {
        if matches!(t, Some(Target::Next)) {
            return Err(usage(format!(
                "{what} next: give a token id or a token's text (the default is already the run's top token)"
            )));
        }
    }
    if a.approx && matches!(a.hook, HookArg::Pattern) {
        return Err(usage(
            "--approx estimates resid-pre, attn-out, mlp-out and z; not the pattern (choose another --hook)",
        ));
    }
    let opts = PatchOptions {
        hook: match a.hook {
            HookArg::ResidPre => PatchHook::ResidPre,
            HookArg::AttnOut => PatchHook::AttnOut,
            HookArg::MlpOut => PatchHook::MlpOut,
            HookArg::Z => PatchHook::Z,
            HookArg::Pattern => PatchHook::Pattern,
        },
        answer: a.answer,
        wrong: a.wrong,
        batch_rows: a.batch_rows,
    };
    let bar = progress_bar("patched runs [{bar:30}] {pos}/{len} ({eta})");
    let report = command::run(&model, &input, &opts, on_bar(&bar))?;
    bar.finish_and_clear();
    for w in &report.warnings {
        eprintln!("attnscope: warning: {w}");
    }
    let approx = if a.approx {
        let x = command::approx(&model, &input, &opts, &report)?;
        Some((x.report, x.kind, x.agreement))
    } else {
        None
    };
    if let Some(out) = &output {
        out.write(patch_page(&report).as_bytes())?;
    }
    if a.json {
        // serialized straight from the structs (no `serde_json::Value` on the way, which would
        // widen each f32 to the f64 nearest it): the numbers read as the report holds them
        let out = JsonOut {
            report: &report,
            approx: approx.as_ref().map(|(r, kind, agree)| ApproxJson {
                method: "attribution patching: (clean − corrupt) · ∂(logit diff)/∂activation at the corrupted run",
                hook: &kind.hook,
                results: &kind.results,
                pearson: agree.pearson,
                spearman: agree.spearman,
                n: agree.n,
                max_abs_error: agree.max_abs_error,
                forward_passes: r.forward_passes,
                backward_passes: r.backward_passes,
            }),
        };
        return emit(&format!("{}\n", serde_json::to_string_pretty(&out)?));
    }
    let colour = std::io::stdout().is_terminal();
    let mut out = render(&report, colour);
    if let Some((_, kind, agree)) = &approx {
        out += &render_approx(&report, kind, agree, colour);
    }
    emit(&out)
}

/// Attribution patching's grid beside the exact one, and how they agree.
/// `patch --json`: the report, with `approx` beside it under `--approx`.
#[derive(serde::Serialize)]
struct JsonOut<'a> {
    #[serde(flatten)]
    report: &'a PatchReport,
    #[serde(skip_serializing_if = "Option::is_none")]
    approx: Option<ApproxJson<'a>>,
}

/// `patch --approx --json`'s `approx` block.
#[derive(serde::Serialize)]
struct ApproxJson<'a> {
    method: &'static str,
    hook: &'a str,
    results: &'a [attnscope::analysis::attrpatch::ApproxCell],
    pearson: Option<f64>,
    spearman: Option<f64>,
    n: usize,
    max_abs_error: f32,
    forward_passes: usize,
    backward_passes: usize,
}

pub fn render_approx(
    r: &PatchReport,
    kind: &ApproxKind,
    agree: &Agreement,
    colour: bool,
) -> String {
    let mut s = format!(
        "\nattribution patching of {} (2 forward passes, 1 backward): each cell the first-order \
         estimate of the share restored, (clean − corrupt) · ∂(logit diff)/∂activation at the \
         corrupted run / (clean − corrupt)\n\n",
        kind.hook
    );
    let (rows, cols, _) = grid(r);
    let nc = cols.len();
    s += &format!("{:>4} {}\n", "", column_numbers(nc));
    for (l, name) in rows.iter().enumerate() {
        let cells: Vec<String> = kind
            .results
            .iter()
            .filter(|c| c.layer == l)
            .map(|c| shade(c.recovered, colour))
            .collect();
        s += &format!("{name:>4} {}\n", cells.join(" "));
    }
    let f = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:+.3}"));
    s += &format!(
        "\nagreement with the exact patching over {} cells: Pearson r {}, Spearman ρ {}; largest |estimate − exact| {:.3}\n",
        agree.n,
        f(agree.pearson),
        f(agree.spearman),
        agree.max_abs_error
    );
    s
}

/// The grid: layers as rows, positions (or heads) as columns, values = recovered.
pub fn grid(r: &PatchReport) -> (Vec<String>, Vec<String>, Vec<f32>) {
    let layers = r.results.iter().map(|c| c.layer).max().map_or(0, |l| l + 1);
    let cols: Vec<String> = if r.results.iter().any(|c| c.head.is_some()) {
        let heads = r.results.len() / layers.max(1);
        (0..heads).map(|h| format!("h{h}")).collect()
    } else {
        r.clean
            .iter()
            .zip(&r.corrupt)
            .enumerate()
            .map(|(p, (c, x))| {
                if c.id == x.id {
                    format!("{p} {}", visible(&c.text))
                } else {
                    format!("{p} {}/{}", visible(&c.text), visible(&x.text))
                }
            })
            .collect()
    };
    let rows = (0..layers).map(|l| format!("L{l}")).collect();
    (rows, cols, r.results.iter().map(|c| c.recovered).collect())
}

/// A shade for a recovered share: blue for 1 (fully restored), red for negative, blank for 0.
fn shade(v: f32, colour: bool) -> String {
    let cell = format!("{v:>5.2}");
    if !colour {
        return cell;
    }
    let t = v.clamp(-1.0, 1.0).abs();
    let level = (255.0 - 200.0 * t) as u8;
    let bg = if v >= 0.0 {
        (level, level, 255)
    } else {
        (255, level, level)
    };
    format!(
        "\x1b[48;2;{};{};{}m\x1b[38;2;0;0;0m{cell}\x1b[0m",
        bg.0, bg.1, bg.2
    )
}

pub fn render(r: &PatchReport, colour: bool) -> String {
    let mut s = title(&format!("activation patching of {}, {}", r.hook, r.model));
    s += &format!(
        "logit difference {:?} − {:?} at the last position: clean {:+.4}, corrupt {:+.4}\n",
        visible(&r.answer.text),
        visible(&r.wrong.text),
        r.clean_logit_diff,
        r.corrupt_logit_diff
    );
    s += "each cell: the share of the difference restored when that activation of the corrupted run \
          is taken from the clean run ((patched − corrupt) / (clean − corrupt))\n\n";
    let (rows, cols, values) = grid(r);
    let nc = cols.len();
    // columns as a numbered legend, then the grid
    for (i, c) in cols.iter().enumerate() {
        s += &format!("  c{i:<3} {c}\n");
    }
    s += &format!("\n{:>4} {}\n", "", column_numbers(nc));
    for (l, name) in rows.iter().enumerate() {
        let cells: Vec<String> = values[l * nc..(l + 1) * nc]
            .iter()
            .map(|&v| shade(v, colour))
            .collect();
        s += &format!("{name:>4} {}\n", cells.join(" "));
    }
    let best = r
        .results
        .iter()
        .max_by(|a, b| a.recovered.total_cmp(&b.recovered));
    if let Some(b) = best {
        let at = match (b.pos, b.head) {
            (Some(p), _) => format!("position {p} ({:?})", visible(&r.clean[p].text)),
            (_, Some(h)) => format!("head {h}"),
            _ => String::new(),
        };
        s += &format!(
            "\nmost restored: layer {}, {at}: {:.2} (logit difference {:+.4})\n",
            b.layer, b.recovered, b.logit_diff
        );
    }
    s += &format!(
        "{} forward passes; {} layer-position rows computed ({:.0}% of running each patch from scratch)\n",
        r.forward_passes,
        r.layer_rows,
        100.0 * r.layer_rows as f64 / r.layer_rows_from_scratch.max(1) as f64
    );
    s
}
/// The grid's column heads: c0, c1, … right-aligned to the cells' width.
fn column_numbers(nc: usize) -> String {
    (0..nc)
        .map(|i| format!("{:>5}", format!("c{i}")))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::HookArg;
    use clap::ValueEnum;

    /// #59: `--hook` takes TransformerLens's spellings as well as its own.
    #[test]
    fn hook_takes_transformer_lens_spellings() {
        let of = |s: &str| HookArg::from_str(s, false).map(|h| format!("{h:?}"));
        for (tl, ours) in [
            ("resid_pre", "ResidPre"),
            ("hook_resid_pre", "ResidPre"),
            ("resid-pre", "ResidPre"),
            ("hook_attn_out", "AttnOut"),
            ("mlp_out", "MlpOut"),
            ("attn.hook_z", "Z"),
            ("attn.hook_pattern", "Pattern"),
            ("attn", "Pattern"),
        ] {
            assert_eq!(of(tl).as_deref(), Ok(ours), "{tl}");
        }
        assert!(of("hook_q").is_err());
    }
}
