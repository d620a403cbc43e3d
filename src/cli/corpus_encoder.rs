//! `attnscope corpus` on an encoder, as tables: per layer the [CLS]/[SEP]/punctuation shares
//! aggregated over texts ([`attnscope::analysis::corpus_encoder`]; run, shards, `--out` and `corpus
//! merge` in [`attnscope::analysis::corpus_run`], as for a decoder's records).

use attnscope::analysis::corpus_encoder::{EncoderAggregate, SEP_HEAD_SHARE};
use attnscope::render::table::{sparkline, title, Align, Table};

/// An encoder's aggregate as tables.
pub fn render(a: &EncoderAggregate, source: &str) -> String {
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
            super::corpus::ci95_text(&l.sep),
            super::corpus::mean_bar(&l.sep, l.layer == a.peak_sep_layer),
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
    s
}
