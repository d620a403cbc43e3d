//! `attnscope explain`'s quiz on a real model: what it measures (the rows' sums and the masked
//! weights on every layer and head, the last position's logits, attention against deletion).

use crate::analysis::faithfulness::{run as run_faith, FaithReport, FaithSettings};
use crate::model::capture::{AttnCache, CaptureSpec};
use crate::model::forward::RunOptions;
use crate::model::Model;

/// The rows after the softmax, measured on every layer, head and query.
#[derive(Clone, Debug)]
pub struct RowsCheck {
    /// the largest |Σ row − 1|, summed in f64
    pub max_row_sum_error: f64,
    /// the largest |weight| above the diagonal (a masked key)
    pub max_masked_weight: f32,
    /// the last position's logits
    pub logits: Vec<f32>,
}

/// One forward of `tokens` with every pattern captured: [`RowsCheck`].
pub fn rows(model: &Model, tokens: &[u32]) -> anyhow::Result<RowsCheck> {
    let (d, n) = (&model.dims, tokens.len());
    let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
    let out = model.forward(tokens, &RunOptions::last_logits(n), &mut cache)?;
    let (mut worst_sum, mut worst_masked) = (0f64, 0f32);
    for l in 0..d.n_layers {
        let p = cache.pattern(l).expect("captured");
        for h in 0..d.n_heads {
            for i in 0..n {
                let row = p.row_at(h, i).expect("row");
                worst_sum = worst_sum.max((row.iter().map(|&x| x as f64).sum::<f64>() - 1.0).abs());
                worst_masked =
                    worst_masked.max(row[i + 1..].iter().fold(0f32, |m, &x| m.max(x.abs())));
            }
        }
    }
    Ok(RowsCheck {
        max_row_sum_error: worst_sum,
        max_masked_weight: worst_masked,
        logits: out.logits.into_iter().next().unwrap_or_default(),
    })
}

/// The last layer's attention (head mean) against deleting each token: the faithfulness
/// report's attention-only rows.
pub fn attention_against_deletion(model: &Model, tokens: &[u32]) -> anyhow::Result<FaithReport> {
    Ok(run_faith(
        model,
        tokens,
        &FaithSettings::attention_only(),
        |_, _| {},
    )?)
}
