//! `attnscope bench --sweeps`: what the sweeps that reuse their work cost, measured in one run:
//! `faithfulness` on a text of `--sweep-tokens` against its forward passes times one forward of
//! that length, and `corpus`'s records over the built-in texts, many to a forward, against one
//! forward per text.

use super::scaling::{before_and_after, measurement_table, median, timed};
use attnscope::analysis::corpus::{builtin, builtin_tokens, text_record, text_records};
use attnscope::analysis::faithfulness::{run as faithfulness, FaithSettings};
use attnscope::model::capture::NoCapture;
use attnscope::model::forward::RunOptions;
use attnscope::model::Model;
use serde::Serialize;

#[derive(Debug, Serialize)]
pub struct SweepBench {
    pub model: String,
    pub faith_tokens: usize,
    /// one plain forward of that length (last position's logits), median of those timed before
    /// and after the sweep
    pub forward_s: f64,
    pub faith_passes: usize,
    /// `faithfulness` (attention rankings, the three occlusions, comprehensiveness/sufficiency)
    pub faith_s: f64,
    /// faith_s / (faith_passes × forward_s)
    pub faith_vs_passes: f64,
    pub corpus_texts: usize,
    /// the texts' records, one forward per text
    pub corpus_one_at_a_time_s: f64,
    /// the same records, many texts to a forward
    pub corpus_batched_s: f64,
    pub corpus_speedup: f64,
}

pub fn run(model: &Model, n: usize, json: bool) -> anyhow::Result<()> {
    // a stretch of the built-in corpus
    let tokens = builtin_tokens(&model.tokenizer, n)?;
    let opts = RunOptions::last_logits(n);
    model.forward(&tokens, &opts, &mut NoCapture)?;
    let mut forwards = Vec::new();
    let (faith_s, r) = before_and_after(
        3,
        || {
            forwards.push(timed(|| model.forward(&tokens, &opts, &mut NoCapture))?.0);
            Ok(())
        },
        || timed(|| faithfulness(model, &tokens, &FaithSettings::attention_only(), |_, _| {})),
    )?;
    let forward_s = median(forwards.clone());
    let texts = builtin();
    let items: Vec<(usize, &str)> = texts.iter().map(String::as_str).enumerate().collect();
    let (batched_s, batched) = timed(|| text_records(model, &items, false, false, |_| {}))?;
    let (single_s, single) = timed(|| {
        items
            .iter()
            .map(|(i, t)| text_record(model, *i, t, false, false))
            .collect::<anyhow::Result<Vec<_>>>()
    })?;
    if batched != single {
        anyhow::bail!(
            "the batched corpus records differ from the one-text runs: you likely have a bug"
        );
    }
    let b = SweepBench {
        model: model.info.name.clone(),
        faith_tokens: n,
        forward_s,
        faith_passes: r.forward_passes,
        faith_s,
        faith_vs_passes: faith_s / (r.forward_passes as f64 * forward_s),
        corpus_texts: items.len(),
        corpus_one_at_a_time_s: single_s,
        corpus_batched_s: batched_s,
        corpus_speedup: single_s / batched_s,
    };
    if json {
        return super::common::emit(&format!("{}\n", serde_json::to_string_pretty(&b)?));
    }
    let (mut s, mut t) = measurement_table("sweeps", &b.model);
    t.row([
        format!("one forward of {} tokens", b.faith_tokens),
        format!("{:.3}", b.forward_s),
        format!("median of {}", forwards.len()),
    ]);
    t.row([
        format!("faithfulness, {} forward passes", b.faith_passes),
        format!("{:.2}", b.faith_s),
        format!("{:.3} x its passes' forwards", b.faith_vs_passes),
    ]);
    t.row([
        format!(
            "corpus records of {} texts, one forward each",
            b.corpus_texts
        ),
        format!("{:.2}", b.corpus_one_at_a_time_s),
        String::new(),
    ]);
    t.row([
        "the same records, many texts to a forward".into(),
        format!("{:.2}", b.corpus_batched_s),
        format!("{:.2}x faster (the same records)", b.corpus_speedup),
    ]);
    s += &t.render();
    super::common::emit(&s)
}
