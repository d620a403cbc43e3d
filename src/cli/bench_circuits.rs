//! `attnscope bench --circuits`: what circuits cost (issue #58), measured in one run beside a
//! plain forward and a forward + backward of the same text: EAP of the IOI-style pair on the whole
//! graph against 2 forwards + 1 backward, EAP-IG with 5 steps against 6 forward + backward pairs,
//! `--evaluate`'s ladder (MIB's 10 sizes, both rankings) against 10 forwards; and at
//! `--circuit-tokens` tokens, EAP's time and the peak memory its edge scores and node
//! activations add to the loaded model. EAP and the ladder compute only the rows from the texts'
//! first difference on (before it every node's difference is zero), so the longer pair is timed
//! twice: with one token changed in the middle and, the worst case, at the second position.

use super::bench_interventions::{CLEAN, CORRUPT};
use super::scaling::{before_and_after, measurement_table, median, timed};
use attnscope::analysis::circuit::{
    evaluate::evaluate, scores, tokenize_pairs, Method, MetricKind, Pair, PairTokens,
};
use attnscope::analysis::measure::{peak_rss_bytes, reset_peak_rss, rss_bytes};
use attnscope::model::backward::Metric;
use attnscope::model::capture::NoCapture;
use attnscope::model::forward::RunOptions;
use attnscope::model::Model;
use serde::Serialize;

/// One text length's timings.
#[derive(Debug, Serialize)]
pub struct CircuitTimes {
    pub tokens: usize,
    /// the first position at which the clean and corrupted texts differ
    pub differ_from: usize,
    /// one plain forward (last position's logits), median
    pub forward_s: f64,
    /// one forward and backward (`Model::gradient`), median
    pub forward_backward_s: f64,
    /// EAP of one pair, every edge, median
    pub eap_s: f64,
    /// eap_s / (2 forwards + 1 backward); the goal is at most 1.5
    pub eap_vs_goal_unit: f64,
}

#[derive(Debug, Serialize)]
pub struct CircuitBench {
    pub model: String,
    pub repeats: usize,
    pub edges: usize,
    /// the IOI-style pair
    pub pair: CircuitTimes,
    /// EAP-IG with 5 steps, median
    pub eap_ig_s: f64,
    /// eap_ig_s / (6 forward + backward pairs); the goal is at most 1.5
    pub eap_ig_vs_goal_unit: f64,
    /// packing the edited forward's q|k|v panels (once per `circuit` run)
    pub pack_s: f64,
    /// `--evaluate`'s ladders (MIB's 10 sizes by |score| and by −score: 20 circuits, those of
    /// every edge the clean run; with the corrupted run), median
    pub ladder_s: f64,
    /// ladder_s / (10 forwards); the goal is at most 1
    pub ladder_vs_goal_unit: f64,
    /// the longer pair, one token changed in the middle
    pub long: CircuitTimes,
    /// the longer pair with its second token changed instead (EAP's worst case)
    pub long_early: CircuitTimes,
    /// the peak resident memory EAP adds at the longer pair's length (edge scores, node
    /// activations and the backward's own buffers), over the loaded and warmed-up model
    pub long_eap_peak_bytes: Option<u64>,
}

/// `bench --circuits`.
pub fn run(model: &Model, repeats: usize, long_tokens: usize, json: bool) -> anyhow::Result<()> {
    let r = measure(model, repeats, long_tokens)?;
    if json {
        return super::common::emit(&format!("{}\n", serde_json::to_string_pretty(&r)?));
    }
    super::common::emit(&render(&r))
}

/// A pair of `n` tokens of the built-in corpus: the corrupted text has one token changed, at
/// position `mid`; the answer and the wrong token are the clean text's two top next tokens.
fn long_pair(model: &Model, n: usize, mid: usize) -> anyhow::Result<PairTokens> {
    let clean = attnscope::analysis::corpus::builtin_tokens(&model.tokenizer, n)?;
    let mut corrupt = clean.clone();
    // another token of the text
    corrupt[mid] = clean
        .iter()
        .copied()
        .find(|&t| t != clean[mid])
        .unwrap_or(clean[mid] ^ 1);
    let logits = model.next_token_logits(&clean)?;
    let top = attnscope::analysis::vocab::top_k(&logits, 2);
    Ok(PairTokens {
        clean,
        corrupt,
        answer: top[0].pos as u32,
        wrong: top[1].pos as u32,
    })
}

/// Medians of a forward and a forward + backward of `tokens`, `repeats` each before and after
/// `middle` (the machine's speed drifts), and `middle`'s result.
fn around<T>(
    model: &Model,
    tokens: &[u32],
    repeats: usize,
    middle: impl FnOnce() -> anyhow::Result<T>,
) -> anyhow::Result<(f64, f64, T)> {
    let opts = RunOptions::last_logits(tokens.len());
    let (mut f, mut fb) = (Vec::new(), Vec::new());
    let r = before_and_after(
        repeats,
        || {
            f.push(timed(|| model.forward(tokens, &opts, &mut NoCapture))?.0);
            fb.push(timed(|| model.gradient(tokens, Metric::LogProb(None)))?.0);
            Ok(())
        },
        middle,
    )?;
    Ok((median(f), median(fb), r))
}

/// `f` run `repeats` times; the median seconds.
fn median_of(repeats: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let mut t = Vec::new();
    for _ in 0..repeats {
        t.push(timed(&mut f)?.0);
    }
    Ok(median(t))
}

/// EAP's peak memory over the memory before it (the model loaded and warmed up).
fn eap_peak(model: &Model, pairs: &[PairTokens]) -> anyhow::Result<Option<u64>> {
    let before = rss_bytes();
    if !reset_peak_rss() {
        return Ok(None);
    }
    scores(model, pairs, Method::Eap, MetricKind::LogitDiff)?;
    Ok(peak_rss_bytes()
        .zip(before)
        .map(|(p, b)| p.saturating_sub(b)))
}

/// The timings of one pair: EAP (and with `all`, EAP-IG, the edited forward's packing and the
/// evaluation ladder) between the forwards and backwards they are set against; with `peak`,
/// EAP's peak memory.
fn pair_times(
    model: &Model,
    pair: &PairTokens,
    repeats: usize,
    (all, peak): (bool, bool),
) -> anyhow::Result<(CircuitTimes, [f64; 3], Option<u64>)> {
    let pairs = std::slice::from_ref(pair);
    let eap = || scores(model, pairs, Method::Eap, MetricKind::LogitDiff).map(|_| ());
    let ig = Method::EapIg { steps: 5 };
    // warm-up: the backward's transposes, the pages of the buffers
    let s = scores(model, pairs, ig, MetricKind::LogitDiff)?;
    let (f, fb, (eap_s, more, bytes)) = around(model, &pair.clean, repeats, || {
        let bytes = if peak { eap_peak(model, pairs)? } else { None };
        let eap_s = median_of(repeats, eap)?;
        let mut more = [0f64; 3];
        if all {
            more[0] = median_of(repeats, || {
                scores(model, pairs, ig, MetricKind::LogitDiff).map(|_| ())
            })?;
            let (pack_s, fwd) = timed(|| model.edited_forward())?;
            more[1] = pack_s;
            more[2] = median_of(repeats, || {
                evaluate(&fwd, pairs, MetricKind::LogitDiff, &s).map(|_| ())
            })?;
        }
        Ok((eap_s, more, bytes))
    })?;
    let backward = (fb - f).max(0.0);
    let times = CircuitTimes {
        tokens: pair.clean.len(),
        differ_from: attnscope::analysis::circuit::first_difference(pair),
        forward_s: f,
        forward_backward_s: fb,
        eap_s,
        eap_vs_goal_unit: eap_s / (2.0 * f + backward),
    };
    Ok((times, more, bytes))
}

/// The circuit timings of the IOI-style pair and a pair of `long_tokens` tokens.
fn measure(model: &Model, repeats: usize, long_tokens: usize) -> anyhow::Result<CircuitBench> {
    let repeats = repeats.max(3);
    let pair = tokenize_pairs(
        model,
        &[Pair::new(CLEAN, CORRUPT, " Alice", " Bob")],
        MetricKind::LogitDiff,
        false,
    )?
    .remove(0);
    let bar = super::common::progress_bar("{msg} [{bar:30}] {pos}/{len}");
    bar.set_length(3);
    bar.set_message("EAP, EAP-IG and the evaluation ladder, the IOI-style pair");
    let (short, [eap_ig_s, pack_s, ladder_s], _) =
        pair_times(model, &pair, repeats, (true, false))?;
    bar.inc(1);
    bar.set_message(format!("EAP and its memory, {long_tokens} tokens"));
    let long = long_pair(model, long_tokens, long_tokens / 2)?;
    let (long, _, peak) = pair_times(model, &long, repeats, (false, true))?;
    bar.inc(1);
    bar.set_message(format!(
        "EAP, {long_tokens} tokens differing from the second on"
    ));
    let early = long_pair(model, long_tokens, 1)?;
    let (long_early, _, _) = pair_times(model, &early, repeats, (false, false))?;
    bar.finish_and_clear();
    Ok(CircuitBench {
        model: model.info.name.clone(),
        repeats,
        edges: attnscope::analysis::circuit::graph::Graph::new(&model.dims).n_edges(),
        eap_ig_s,
        eap_ig_vs_goal_unit: eap_ig_s / (6.0 * short.forward_backward_s),
        pack_s,
        ladder_s,
        ladder_vs_goal_unit: ladder_s / (10.0 * short.forward_s),
        pair: short,
        long,
        long_early,
        long_eap_peak_bytes: peak,
    })
}

/// The bench as a table.
fn render(r: &CircuitBench) -> String {
    let (mut s, mut t) = measurement_table("circuits", &r.model);
    for c in [&r.pair, &r.long, &r.long_early] {
        let n = c.tokens;
        t.row([
            format!("one forward, {n} tokens"),
            format!("{:.3}", c.forward_s),
            format!("median of {}", 2 * r.repeats),
        ]);
        t.row([
            format!("one forward + backward, {n} tokens"),
            format!("{:.3}", c.forward_backward_s),
            format!("median of {}", 2 * r.repeats),
        ]);
        t.row([
            format!(
                "EAP, every edge ({}), {n} tokens differing from #{}",
                r.edges, c.differ_from
            ),
            format!("{:.3}", c.eap_s),
            format!(
                "{:.2} x (2 forwards + 1 backward); goal ≤ 1.5",
                c.eap_vs_goal_unit
            ),
        ]);
    }
    t.row([
        format!("EAP-IG, 5 steps, {} tokens", r.pair.tokens),
        format!("{:.3}", r.eap_ig_s),
        format!(
            "{:.2} x (6 forward + backward pairs); goal ≤ 1.5",
            r.eap_ig_vs_goal_unit
        ),
    ]);
    t.row([
        "--evaluate's f32 q|k|v panels (packed once per run)".to_string(),
        format!("{:.3}", r.pack_s),
        String::new(),
    ]);
    t.row([
        format!(
            "--evaluate: MIB's two ladders (20 circuits) by exact edge patching, {} tokens",
            r.pair.tokens
        ),
        format!("{:.3}", r.ladder_s),
        format!("{:.2} x (10 forwards); goal ≤ 1", r.ladder_vs_goal_unit),
    ]);
    s += &t.render();
    if let Some(b) = r.long_eap_peak_bytes {
        s += &format!(
            "EAP at {} tokens adds {:.0} MB to the loaded model's memory at its peak (edge scores, node activations, the backward's buffers; goal < 1 GB)\n",
            r.long.tokens,
            b as f64 / 1e6
        );
    }
    s
}
