//! `attnscope scaling`'s measurements: a forward's time at one length, with and without every
//! pattern captured, and the peak memory it reached.

use crate::analysis::measure::{peak_rss_bytes, reset_peak_rss, rss_bytes};
use crate::model::capture::{AttnCache, CaptureSpec, NoCapture};
use crate::model::forward::RunOptions;
use crate::model::Model;
use serde::Serialize;

/// One setting's timed runs at one length.
#[derive(Serialize, Clone, Debug)]
pub struct Setting {
    pub median_s: f64,
    pub attention_s: f64,
    pub runs_s: Vec<f64>,
    /// peak resident memory during these runs, and the part above what was resident before
    pub peak_rss_bytes: Option<u64>,
    pub extra_bytes: Option<u64>,
}

/// The median (the mean of the middle two for an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let k = v.len();
    if k % 2 == 1 {
        v[k / 2]
    } else {
        (v[k / 2 - 1] + v[k / 2]) / 2.0
    }
}

/// One setting at one length: a warm-up forward, then `repeats` timed ones (with every pattern
/// captured when `capture`), and the peak memory they reached.
pub fn measure_setting(
    model: &Model,
    tokens: &[u32],
    capture: bool,
    repeats: usize,
) -> anyhow::Result<Setting> {
    let n = tokens.len();
    let once = |capture: bool| -> anyhow::Result<(f64, f64)> {
        let opts = RunOptions::last_logits(n);
        let out = if capture {
            let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
            model.forward(tokens, &opts, &mut cache)?
        } else {
            model.forward(tokens, &opts, &mut NoCapture)?
        };
        Ok((
            out.timings.total.as_secs_f64(),
            out.timings.attention.as_secs_f64(),
        ))
    };
    once(capture)?; // warm-up
    let before = rss_bytes();
    let resettable = reset_peak_rss();
    let mut runs = Vec::new();
    let mut attn = Vec::new();
    for _ in 0..repeats {
        let (t, at) = once(capture)?;
        runs.push(t);
        attn.push(at);
    }
    let peak = if resettable { peak_rss_bytes() } else { None };
    Ok(Setting {
        median_s: median(runs.clone()),
        attention_s: median(attn),
        runs_s: runs,
        peak_rss_bytes: peak,
        extra_bytes: peak.zip(before).map(|(p, b)| p.saturating_sub(b)),
    })
}
