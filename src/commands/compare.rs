//! `attnscope compare` (and Python's `compare`): two texts, two models or two precisions side
//! by side, each side one forward ([`crate::analysis::compare`] compares them).

use super::load::{load, ModelSpec};
use crate::analysis::compare::compare_runs;
pub use crate::analysis::compare::{text_label, CompareOptions, CompareReport, Mode, SideInput};
use crate::analysis::request::usage;
use crate::model::{Model, Precision};
use std::sync::Arc;

/// What to compare: exactly two of one thing (two texts, two models or two precisions), the
/// others one each.
#[derive(Clone, Debug)]
pub struct CompareCommand {
    /// the texts
    pub texts: Vec<String>,
    /// the models (aliases, files, folders or hub ids)
    pub models: Vec<String>,
    /// the precisions
    pub precisions: Vec<Precision>,
    /// leave out the BOS token the models' metadata asks for
    pub no_bos: bool,
    /// progress bars for the loads on standard error
    pub progress: bool,
    /// the query, the heads listed, BOS forced
    pub options: CompareOptions,
}

/// The comparison `c` asks for: the two sides loaded and run, then compared.
pub fn run(c: &CompareCommand) -> anyhow::Result<CompareReport> {
    check_two_of_one(&c.texts, &c.models, &c.precisions)?;
    let (mode, sides) = load_sides(c)?;
    let input = |i: usize| {
        let (m, name, text, label) = &sides[i];
        SideInput {
            model: m,
            name,
            text,
            label: label.clone(),
        }
    };
    compare_sides(mode, [input(0), input(1)], &c.options)
}

/// Two sides already loaded (Python's models), run and compared as `mode` says.
pub fn compare_sides(
    mode: Mode,
    sides: [SideInput<'_>; 2],
    opts: &CompareOptions,
) -> anyhow::Result<CompareReport> {
    compare_runs(mode, sides, opts)
}

/// The model `spec` at precision `p`, loaded as `c` asks.
fn spec_of(spec: &str, p: Precision, c: &CompareCommand) -> ModelSpec {
    ModelSpec {
        model: spec.to_string(),
        precision: p,
        memory: None,
        no_bos: c.no_bos,
        progress: c.progress,
    }
}

/// Refuses (exit 2) anything but exactly two of one thing: texts, models or precisions.
fn check_two_of_one(
    texts: &[String],
    models: &[String],
    precisions: &[Precision],
) -> anyhow::Result<()> {
    let twos = [texts.len(), models.len(), precisions.len()];
    if twos.iter().any(|&c| c > 2) || twos.iter().filter(|&&c| c == 2).count() != 1 {
        return Err(usage(format!(
            "compare needs exactly two of one thing: two texts (--text A --text B), two models (--model M1 --model M2) or two precisions (--precision exact --precision fast); got {} text(s), {} model(s), {} precision(s)",
            texts.len(),
            models.len(),
            precisions.len()
        )));
    }
    Ok(())
}

/// One side of the comparison: its model, the model's name, its text and its label.
type Side = (Arc<Model>, String, String, String);

/// The two sides, loaded: one model on two texts, two models on one text, or one model at two
/// precisions.
fn load_sides(c: &CompareCommand) -> anyhow::Result<(Mode, Vec<Side>)> {
    let (texts, models, precisions) = (&c.texts, &c.models, &c.precisions);
    let side = |spec: &String, p: Precision, text: &String, label: String| -> anyhow::Result<_> {
        Ok((
            load(&spec_of(spec, p, c))?,
            spec.clone(),
            text.clone(),
            label,
        ))
    };
    Ok(if texts.len() == 2 {
        let m = load(&spec_of(&models[0], precisions[0], c))?;
        let side = |t: &String| (m.clone(), models[0].clone(), t.clone(), text_label(t));
        (Mode::Texts, vec![side(&texts[0]), side(&texts[1])])
    } else if models.len() == 2 {
        let label = |s: &String| format!("model {s}");
        let (m0, m1) = (&models[0], &models[1]);
        let first = side(m0, precisions[0], &texts[0], label(m0))?;
        (
            Mode::Models,
            vec![first, side(m1, precisions[0], &texts[0], label(m1))?],
        )
    } else {
        let label = |p: Precision| format!("precision {}", p.name());
        let (p0, p1) = (precisions[0], precisions[1]);
        let first = side(&models[0], p0, &texts[0], label(p0))?;
        (
            Mode::Precisions,
            vec![first, side(&models[0], p1, &texts[0], label(p1))?],
        )
    })
}
