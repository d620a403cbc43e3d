//! What `attribute` and `faithfulness` share: both score every input token of one text, so both
//! take the model and the text, integrated gradients' `--steps` and `--json`, check the steps
//! before loading, show a progress bar over their forwards, and print the report as JSON or
//! as text.

use super::common::{emit, on_bar, progress_bar, ModelArgs, TextArgs};
use attnscope::model::Model;

/// The flags `attribute` and `faithfulness` end with.
#[derive(clap::Args, Debug)]
pub struct ScoringArgs {
    /// Integrated gradients' midpoints (1..=4096; each a forward and a backward).
    #[arg(long, default_value_t = 32)]
    pub steps: usize,
    #[arg(long)]
    pub json: bool,
}

/// Checks `--steps`, loads the model, reads the text's tokens, runs `score(model, tokens,
/// tick)` under a progress bar (`label [bar] done/total`), and prints the report: as JSON with
/// `--json`, else as `render` writes it.
pub fn run_scored<R: serde::Serialize>(
    model: &ModelArgs,
    text: &TextArgs,
    a: &ScoringArgs,
    label: &str,
    score: impl FnOnce(&Model, &[u32], &mut dyn FnMut(usize, usize)) -> anyhow::Result<R>,
    render: impl FnOnce(&R) -> String,
) -> anyhow::Result<()> {
    attnscope::analysis::scores::check_steps(a.steps)?;
    let m = model.load()?;
    let tokens = text.tokens(&m, model.bos)?;
    let bar = progress_bar(&format!("{label} [{{bar:30}}] {{pos}}/{{len}} ({{eta}})"));
    let report = score(&m, &tokens, &mut on_bar(&bar))?;
    bar.finish_and_clear();
    if a.json {
        return emit(&format!("{}\n", serde_json::to_string_pretty(&report)?));
    }
    emit(&render(&report))
}
