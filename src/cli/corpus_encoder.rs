//! `attnscope corpus` on an encoder: per text, the [CLS]/[SEP]/punctuation shares per layer and
//! per head ([`crate::analysis::corpus_encoder`]), aggregated over texts; shards, `--out` (resume)
//! and `corpus merge` work as for a decoder's records.

use super::common::{emit, usage};
use crate::analysis::corpus_encoder::{
    aggregate_encoder, encoder_record, read_encoder_records, EncoderAggregate, EncoderRecord,
    SEP_HEAD_SHARE,
};
use crate::model::Model;
use crate::render::table::{bar, sparkline, title, Align, Table};
use anyhow::Context;
use std::io::Write;
use std::path::Path;

/// Runs the `selected` texts on the encoder, appending each record to `out` (skipping those it
/// already holds), and prints the aggregate.
pub fn run(
    model: &Model,
    texts: &[String],
    selected: &[usize],
    out: Option<&Path>,
    source: &str,
    json: bool,
) -> anyhow::Result<()> {
    let (mut records, mut out_file) = super::corpus::resume::<EncoderRecord>(
        out,
        &model.info.name,
        texts,
        source,
        &|t, name| {
            if t.trim().is_empty() {
                Ok(Vec::new())
            } else {
                read_encoder_records(&[(t, name)])
            }
        },
        &|r| (r.model.as_str(), r.id, r.text.as_str()),
    )?;
    let mut skipped = Vec::new();
    for &i in selected {
        if records.iter().any(|r| r.id == i) {
            continue;
        }
        let rec = match encoder_record(model, i, &texts[i])? {
            Ok(r) => r,
            Err(e) => {
                skipped.push(format!("text {i}: {e}"));
                continue;
            }
        };
        if let Some(f) = out_file.as_mut() {
            writeln!(f, "{}", serde_json::to_string(&rec)?).context("appending to --out")?;
            f.flush()?;
        }
        records.push(rec);
    }
    for s in &skipped {
        eprintln!("attnscope: skipped {s}");
    }
    let agg = aggregate_encoder(&records).map_err(usage)?;
    print(&agg, source, json)
}

/// `corpus merge` of encoder record files.
pub fn merge(files: &[(String, String)], json: bool) -> anyhow::Result<()> {
    let records = read_encoder_records(files).map_err(usage)?;
    let agg = aggregate_encoder(&records).map_err(usage)?;
    print(&agg, &format!("{} record files", files.len()), json)
}

fn print(a: &EncoderAggregate, source: &str, json: bool) -> anyhow::Result<()> {
    if json {
        return emit(&format!("{}\n", serde_json::to_string_pretty(a)?));
    }
    let mut s = title(&format!(
        "Attention over {} texts ({} tokens) of {source}, model {} (an encoder)",
        a.sentences, a.tokens, a.model
    ));
    s += "No next token and no causal sink: per layer, the share of attention on [CLS], [SEP] and punctuation (mean over heads and queries, then over texts; Clark et al. 2019).\n\n";
    let mut t = Table::new([
        ("layer", Align::Right),
        ("[CLS]", Align::Right),
        ("[SEP]", Align::Right),
        ("± std", Align::Right),
        ("95% CI", Align::Left),
        ("", Align::Left),
        ("punct", Align::Right),
        (
            format!("heads ≥{SEP_HEAD_SHARE} on [SEP]").as_str(),
            Align::Right,
        ),
        (
            format!("heads ≥{SEP_HEAD_SHARE} on [CLS]").as_str(),
            Align::Right,
        ),
    ]);
    for l in &a.layers {
        t.row([
            l.layer.to_string(),
            format!("{:.4}", l.cls.mean),
            format!("{:.4}", l.sep.mean),
            format!("{:.4}", l.sep.std),
            format!("[{:.4}, {:.4}]", l.sep.ci95.0, l.sep.ci95.1),
            bar(l.sep.mean as f32, 20)
                + if l.layer == a.peak_sep_layer {
                    " ▲ peak"
                } else {
                    ""
                },
            format!("{:.4}", l.punct.mean),
            format!("{:.1}%", 100.0 * l.sep_heads_fraction),
            format!("{:.1}%", 100.0 * l.cls_heads_fraction),
        ]);
    }
    s += &t.render();
    let sep: Vec<f32> = a.layers.iter().map(|l| l.sep.mean as f32).collect();
    s += &format!(
        "[SEP] share  {}   peak: layer {} ({:.3})\n",
        sparkline(&sep),
        a.peak_sep_layer,
        a.layers[a.peak_sep_layer].sep.mean
    );
    emit(&s)
}
