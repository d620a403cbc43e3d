//! `attnscope heatmap`: one layer's attention map (a head's, or the mean of the heads) with its
//! labels and title, which [`crate::render::heatmap`] draws as PNG or SVG.

use crate::analysis::request::{check_index, usage};
use crate::model::capture::{AttnCache, CaptureSpec, Hook, Queries};
use crate::model::forward::RunOptions;
use crate::model::Model;
use serde::Serialize;

/// Which map to draw.
#[derive(Clone, Debug)]
pub struct HeatmapOptions {
    /// the layer
    pub layer: usize,
    /// a head's number, or `mean` for the mean of the heads
    pub head: String,
    /// an encoder's token types (a pair's 0/1); `None`: all 0
    pub token_types: Option<Vec<u32>>,
}

/// One layer's `[n, n]` map, its axis labels (`i text`) and its title.
#[derive(Clone, Debug, Serialize)]
pub struct HeatmapReport {
    /// the layer
    pub layer: usize,
    /// `None`: the mean of the heads
    pub head: Option<usize>,
    /// the number of tokens (the map is `[n, n]`)
    pub n: usize,
    /// row-major `[n, n]` weights
    pub map: Vec<f32>,
    /// the axis labels (`i text`)
    pub labels: Vec<String>,
    /// the map's title
    pub title: String,
}

/// The map `opts` names on `tokens`: the layer and head checked against the model, one forward
/// capturing that layer's pattern (that head's, or every head's, then averaged).
pub fn heatmap(
    model: &Model,
    tokens: &[u32],
    opts: &HeatmapOptions,
) -> anyhow::Result<HeatmapReport> {
    let (n, d) = (tokens.len(), &model.dims);
    let layer = check_index(opts.layer, d.n_layers, "layer")?;
    let head = match opts.head.as_str() {
        "mean" => None,
        h => Some(check_index(
            crate::analysis::request::unsigned_index(
                h.parse()
                    .map_err(|_| usage(format!("--head {h} is not a number or `mean`")))?,
                "head",
                d.n_heads,
                "this model has",
            )?,
            d.n_heads,
            "head",
        )?),
    };
    let spec = CaptureSpec {
        hooks: vec![Hook::Pattern],
        layers: Some(vec![layer]),
        heads: head.map(|h| vec![h]),
        queries: Queries::All,
    };
    let mut cache = AttnCache::new(&spec, n);
    let run = RunOptions {
        token_types: opts.token_types.clone(),
        ..Default::default()
    };
    model.forward(tokens, &run, &mut cache)?;
    let p = cache.pattern(layer).expect("captured");
    let map: Vec<f32> = if head.is_some() {
        p.data.to_vec()
    } else {
        crate::analysis::vocab::mean_rows(p.data.chunks(n * n))
    };
    let labels: Vec<String> = model
        .token_texts(tokens)
        .iter()
        .enumerate()
        .map(|(i, t)| format!("{i} {}", crate::model::tokenize::visible(t)))
        .collect();
    let title = format!(
        "{} · layer {layer} · {}",
        model.info.name,
        head.map(|h| format!("head {h}"))
            .unwrap_or_else(|| "mean of heads".into())
    );
    Ok(HeatmapReport {
        layer,
        head,
        n,
        map,
        labels,
        title,
    })
}
