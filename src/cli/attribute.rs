//! `attnscope attribute`: a score per input token for the last position's prediction, by
//! gradient, gradient × input, integrated gradients, attention × gradient, AttnLRP, value
//! zeroing, ALTI-Logit or occlusion.

use super::common::ModelText;
use super::scoring::{run_scored, ScoringArgs};
use attnscope::analysis::vocab::Method;
use attnscope::analysis::vocab::Target;
use attnscope::commands::attribute::{self as command, AttributeOptions, AttributeReport};
use attnscope::model::tokenize::visible;
use attnscope::render::table::{title, Align, Table};
use std::io::IsTerminal;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    input: ModelText,
    /// gradient: ‖∂f/∂x_i‖₂ over the embedding width (x_i: token i's input to layer 0).
    /// grad-x-input: Σ_d ∂f/∂x_i,d · x_i,d. integrated-gradients: Σ_d x_i,d · the mean of
    /// ∂f/∂x_i,d at (k+½)/steps · x for k < steps, from the zero embedding; the completeness gap
    /// Σ scores − (f(x) − f(0)) is printed. attention-x-gradient (Chefer et al. 2021): per layer
    /// and head, ∂f/∂A ⊙ A on the last query's row of the pattern A, negative parts clipped to
    /// 0, averaged over the heads and summed over the layers. attnlrp (Achtibat et al. 2024):
    /// LRP of f = the target's logit with the rules for softmax, the bilinear products (uniform),
    /// norms and activations (identity), as input × modified gradient; the conservation error
    /// Σ scores − f is printed. value-zeroing (Mohebbi et al. 2023): per layer, the cosine
    /// distance of each position's block output when token j's values are zeroed, rows
    /// normalized, rolled out across layers, read at the last position (no target).
    /// alti-logit (Ferrando et al. 2023): f = the target's logit split over each layer's
    /// attention by source token, carried to the input tokens by ALTI's rollout. occlusion:
    /// f(text) − f(text without token i).
    #[arg(long, value_parser = parse_method)]
    method: Method,
    /// The token explained: f = log p(target) at the last position. `next` (the model's top
    /// token), a token id, or a token's text (one token, e.g. " Paris"). On an encoder (no next
    /// token): `embedding` (the mean-pooled sentence embedding, the default) or `cls` (the
    /// [CLS] vector), with f = the cosine similarity to the text's vector (occlusion only).
    #[arg(long, visible_alias = "answer", default_value = "next")]
    target: Target,
    /// Explain the logit difference f = logit(target) − logit(wrong) instead.
    #[arg(long)]
    wrong: Option<Target>,
    #[command(flatten)]
    scoring: ScoringArgs,
}

fn parse_method(s: &str) -> Result<Method, String> {
    s.parse()
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let opts = AttributeOptions {
        method: a.method,
        target: a.target,
        wrong: a.wrong,
        steps: a.scoring.steps,
    };
    run_scored(
        &a.input.model,
        &a.input.text,
        &a.scoring,
        "attribution",
        |model, tokens, tick| command::run(model, tokens, &opts, tick),
        |r| {
            let colour = std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none();
            render(r, colour)
        },
    )
}

/// A token's text on a background shaded by its score relative to the largest |score|: blue for
/// positive, red for negative, white for 0 (or, without colour, the text in brackets with a
/// number of `+`/`−` marks, 0 to 5).
fn shade(piece: &str, v: f32, max: f32, colour: bool) -> String {
    let t = if max > 0.0 {
        (v / max).clamp(-1.0, 1.0)
    } else {
        0.0
    };
    if !colour {
        let marks = (t.abs() * 5.0).round() as usize;
        let m = if t >= 0.0 { "+" } else { "−" }.repeat(marks);
        return format!("[{piece}]{m}");
    }
    let level = (255.0 - 200.0 * t.abs()) as u8;
    let bg = if t >= 0.0 {
        (level, level, 255)
    } else {
        (255, level, level)
    };
    format!(
        "\x1b[48;2;{};{};{}m\x1b[38;2;0;0;0m{piece}\x1b[0m",
        bg.0, bg.1, bg.2
    )
}

/// The report as the terminal shows it: the text shaded by score, then a table.
pub fn render(r: &AttributeReport, colour: bool) -> String {
    let target = r
        .target
        .clone()
        .unwrap_or(attnscope::analysis::vocab::TokenRef {
            id: 0,
            text: String::new(),
        });
    let f = measured_quantity(r, &target);
    let mut s = title(&format!(
        "attribution by {} of f = {f}, {} ({} precision)",
        r.method.name(),
        r.model,
        r.precision
    ));
    match r.logprob {
        Some(lp) => {
            s += &format!(
            "at the last position (target id {}): f = {:.4}, log p(target) = {lp:.4}\nscore: {}\n",
            target.id, r.value, r.definition
        )
        }
        None => {
            s += &format!(
                "an encoder, occlusion by deletion\nscore: {}\n",
                r.definition
            )
        }
    }
    if r.metric == "none" {
        s += "(value zeroing measures how the context mixes into the last position: f is shown, not explained)\n";
    }
    if let Some(e) = r.conservation_error {
        let sum: f32 = r.tokens.iter().map(|t| t.score).sum();
        s += &format!("Σ relevances = {sum:.4}; conservation error Σ − f = {e:+.4}\n");
    }
    if let (Some(gap), Some(steps)) = (r.completeness_gap, r.steps) {
        let sum: f32 = r.tokens.iter().map(|t| t.score).sum();
        s += &format!(
            "{steps} steps; Σ scores = {sum:.4}; completeness gap Σ scores − (f(x) − f(0)) = {gap:+.4}\n"
        );
    }
    s += &shaded_text(r, colour);
    s += &ranking_table(r);
    s
}

/// What f is: a logit difference, a logit, an encoder's cosine or a log-probability.
fn measured_quantity(r: &AttributeReport, target: &attnscope::analysis::vocab::TokenRef) -> String {
    match &r.wrong {
        Some(w) => format!(
            "logit({:?}) − logit({:?})",
            visible(&target.text),
            visible(&w.text)
        ),
        None if r.metric == "logit" => format!("logit({:?})", visible(&target.text)),
        None if r.metric == "cosine" => format!(
            "cos(v(variant), v(text)) of the {} vector",
            r.encoder_target.map_or("", |t| t.name())
        ),
        None => format!("log p({:?})", visible(&target.text)),
    }
}

/// The text with each token shaded (or marked) by its score, and the legend.
fn shaded_text(r: &AttributeReport, colour: bool) -> String {
    let mut s = String::new();
    let max = r.tokens.iter().fold(0f32, |m, t| m.max(t.score.abs()));
    s += "\n";
    s += &r
        .tokens
        .iter()
        .map(|t| shade(&visible(&t.text), t.score, max, colour))
        .collect::<String>();
    s += if colour {
        "\n(blue: raises f, red: lowers it; the deeper, the larger |score|)\n\n"
    } else {
        "\n(+: raises f, −: lowers it; one mark per fifth of the largest |score|)\n\n"
    };
    s
}

/// Every token ranked by score, largest first.
fn ranking_table(r: &AttributeReport) -> String {
    let mut order: Vec<&_> = r.tokens.iter().collect();
    order.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.pos.cmp(&b.pos)));
    let mut t = Table::new([
        ("rank", Align::Right),
        ("pos", Align::Right),
        ("token", Align::Left),
        ("id", Align::Right),
        ("score", Align::Right),
    ]);
    for (i, x) in order.iter().enumerate() {
        t.row([
            (i + 1).to_string(),
            x.pos.to_string(),
            visible(&x.text),
            x.id.to_string(),
            format!("{:+.5}", x.score),
        ]);
    }
    t.render()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shades_without_colour_are_marks() {
        assert_eq!(shade("a", 1.0, 1.0, false), "[a]+++++");
        assert_eq!(shade("a", -0.4, 1.0, false), "[a]−−");
        assert_eq!(shade("a", 0.0, 0.0, false), "[a]");
        assert!(shade("a", 1.0, 1.0, true).starts_with("\x1b[48;2;55;55;255m"));
    }
}
