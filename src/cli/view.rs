//! `attnscope view` (the HTML page) and `attnscope heatmap` (one map as PNG or SVG).

use super::common::{emit, output_path, usage, ModelArgs, TextArgs};
use attnscope::analysis::request::unsigned_index;
use attnscope::analysis::vocab::Target;
use attnscope::commands::heatmap::{heatmap as heatmap_of, HeatmapOptions};
use attnscope::commands::view::{ablate_method, view_html_tokens, AblateMethod, ViewOptions};
use std::path::PathBuf;

/// `attnscope view`'s flags.
#[derive(clap::Args, Debug)]
pub struct ViewArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    text: TextArgs,
    /// The HTML file to write (self-contained: it opens offline).
    #[arg(long, short = 'o', default_value = "attnscope-view.html")]
    out: PathBuf,
    /// Also measure faithfulness (occlusion) and show it in a panel.
    #[arg(long)]
    faithfulness: bool,
    /// Also ablate every head (as `attnscope ablate`) and show the effects in a panel: a
    /// layers × heads grid of Δ log p and a sortable table; a click selects the head above.
    /// `zero` (the default when no value is given) or `mean`.
    #[arg(long, value_name = "METHOD", num_args = 0..=1, default_missing_value = "zero", value_parser = ablate_method)]
    ablate: Option<AblateMethod>,
    /// The token whose log-probability the ablation and faithfulness panels measure at the last
    /// position: `next` (the model's own top token), a token id, or a token's text (one token).
    #[arg(long)]
    target: Option<Target>,
    /// Replace --out if it exists.
    #[arg(long)]
    force: bool,
}

/// `attnscope view`: the page written to `--out`.
pub fn view(a: ViewArgs) -> anyhow::Result<()> {
    let mut inputs = a.model.input_paths();
    inputs.extend(a.text.input_paths());
    let output = output_path(&a.out, a.force, &inputs)?;
    let model = a.model.load()?;
    let input = a.text.encoded(&model, a.model.bos)?;
    let tokens = input.tokens;
    let opts = ViewOptions {
        faithfulness: a.faithfulness,
        ablate: a.ablate,
        target: a.target,
        progress: true,
        token_types: input.types,
        segments: input.segments,
    };
    let (html, n) = view_html_tokens(&model, &tokens, &opts)?;
    let d = &model.dims;
    output.write(html.as_bytes())?;
    emit(&format!("wrote {} ({:.1} MB, {n} tokens, {} layers × {} heads); open it in a browser, no network needed\n", a.out.display(), html.len() as f64 / 1e6, d.n_layers, d.n_heads))
}

/// `attnscope heatmap`'s flags.
#[derive(clap::Args, Debug)]
pub struct HeatmapArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    text: TextArgs,
    /// Layer to draw.
    #[arg(long, short = 'l', allow_negative_numbers = true)]
    layer: i64,
    /// Head to draw, or `mean` for the head average.
    #[arg(long, default_value = "mean", allow_negative_numbers = true)]
    head: String,
    /// Output file: .png or .svg.
    #[arg(long, short = 'o')]
    out: PathBuf,
    /// Replace --out if it exists.
    #[arg(long)]
    force: bool,
}

/// `attnscope heatmap`: one layer's map (a head or their mean) as PNG or SVG.
pub fn heatmap(a: HeatmapArgs) -> anyhow::Result<()> {
    let ext = a
        .out
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    if ext != "png" && ext != "svg" {
        return Err(usage(format!(
            "--out {} must end in .png or .svg",
            a.out.display()
        )));
    }
    let mut inputs = a.model.input_paths();
    inputs.extend(a.text.input_paths());
    let output = output_path(&a.out, a.force, &inputs)?;
    let model = a.model.load()?;
    let (tokens, token_types) = a.text.tokens_or_pair(&model, a.model.bos)?;
    let opts = HeatmapOptions {
        layer: unsigned_index(a.layer, "layer", model.dims.n_layers, "this model has")?,
        head: a.head,
        token_types,
    };
    let r = heatmap_of(&model, &tokens, &opts)?;
    let (n, title) = (r.n, &r.title);
    let bytes = if ext == "svg" {
        attnscope::render::heatmap::svg(&r.map, &r.labels, &r.labels, title).into_bytes()
    } else {
        attnscope::render::heatmap::png(&r.map, n, n)
    };
    output.write(&bytes)?;
    emit(&format!("wrote {} ({title}, {n}×{n})\n", a.out.display()))
}
