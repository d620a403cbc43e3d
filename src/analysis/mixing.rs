//! Context mixing without gradients (issue #39): value zeroing [Mohebbi et al. 2023,
//! arXiv:2301.12971] and ALTI-Logit [Ferrando et al. 2023, arXiv:2305.12535], for the decoders the
//! engine runs (RMSNorm or LayerNorm, GQA, gated MLPs, Gemma's post-norms and soft-caps).
//!
//! **Value zeroing**: in layer `l`, token `j`'s value vectors (every kv head) are set to zero,
//! the layer runs from its original input, and each position `i`'s block output
//! (`hook_resid_post`) is compared with the original: `C[l]_{i,j}` = the cosine distance, each row
//! normalized to sum 1. The whole-model score is the rollout `R[0] = C[0]`, `R[l] = C[l]·R[l−1]`
//! (the authors' `compute_joint_attention` with `res=False`: the residual is inside `C`), read at
//! the last position. Every zeroed variant of a layer goes through one forward of the engine as a
//! stacked segment resumed at that layer ([`crate::model::forward::Resume`]), reusing the clean
//! run's keys and values before `j` and stopping after the layer.
//!
//! **ALTI-Logit**: each attention block's output at position `t` is split by source token:
//! `T_t(x_j) = Σ_h A^h_{t,j} W_O^h v^{g(h)}_j` (the value with its bias: the affine part the
//! authors use), through Gemma's post-attention norm with its scale held. ALTI [Ferrando et al.
//! 2022] turns it into token-to-token contributions, `c_{t,j} = max(0, ‖y_t‖₁ − ‖y_t − T_t(x_j) −
//! [t = j] x_t‖₁)` with `y_t` the residual after attention, rows normalized, rolled out across
//! layers as above. The logit update of source `j` in layer `l` is `T_last(x_j)` through the final
//! norm with its scale held (the paper's linear approximation) onto the target's unembedding row;
//! ALTI-Logit adds, over layers, each layer's updates carried back to the input tokens by the
//! rollout of the layers before it: `Σ_l Δlogit^l · R[l−1]` (`R[−1] = I`), as the authors'
//! `track2input_tokens` does. The MLPs' updates are not attributed (they do not mix tokens).

use crate::model::backward::Metric;
use crate::model::capture::{AttnCache, CaptureSpec, Hook, Observer, Queries};
use crate::model::forward::{RunOptions, Segment};
use crate::model::{Error, Model, Result};
use rayon::prelude::*;

/// The longest text value zeroing and ALTI-Logit take (value zeroing runs `n²/2` rows per
/// layer; ALTI-Logit holds a layer's `n × n` maps and `n² · d_model` work per layer).
pub const MAX_MIXING_TOKENS: usize = 2048;

fn check_len(n: usize, what: &str) -> Result<()> {
    if n == 0 || n > MAX_MIXING_TOKENS {
        return Err(Error::OutOfRange {
            what: format!("the text's length for {what}"),
            value: format!("{n} tokens"),
            range: format!(
                "1..={MAX_MIXING_TOKENS} tokens (the work grows with the square of the length)"
            ),
        });
    }
    Ok(())
}

/// Value zeroing's context mixing.
#[derive(Clone, Debug)]
pub struct ValueZeroing {
    /// Per layer, `C[l]` `[n, n]` (row `i`: how much each token `j` shapes `i`'s output), rows
    /// summing to 1.
    pub layers: Vec<Vec<f32>>,
    /// The rollout's last row, `[n]`: the whole model's mixing into the last position.
    pub rollout_last: Vec<f32>,
    /// Forwards run (the clean one included).
    pub passes: usize,
}

/// An observer that zeroes rows of one layer's `hook_v`, keeps that layer's `hook_resid_post` and
/// stops after the layer.
struct ZeroValues {
    layer: usize,
    /// stacked rows whose values are zeroed
    rows: Vec<usize>,
    out: Vec<f32>,
}

impl Observer for ZeroValues {
    fn wants(&self, layer: usize, hook: Hook) -> bool {
        layer == self.layer && hook == Hook::ResidPost
    }
    fn tensor(&mut self, _: usize, _: Hook, _: &[usize], data: &[f32]) {
        self.out = data.to_vec();
    }
    fn attention_block(&mut self, _: usize, _: Hook, _: usize, _: [usize; 3], _: &[f32]) {}
    fn stops_before(&self, layer: usize) -> bool {
        layer > self.layer
    }
    fn edits(&self, layer: usize, hook: Hook) -> bool {
        layer == self.layer && hook == Hook::V
    }
    fn edit(
        &mut self,
        _: usize,
        _: Hook,
        shape: &[usize],
        data: &mut [f32],
    ) -> std::result::Result<(), String> {
        let width: usize = shape[1..].iter().product();
        for &r in &self.rows {
            data[r * width..(r + 1) * width].fill(0.0);
        }
        Ok(())
    }
}

/// `1 − cos(a, b)`, in f64, at least 0.
fn cosine_distance(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (x as f64, y as f64);
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    if aa == 0.0 || bb == 0.0 {
        return if aa == bb { 0.0 } else { 1.0 };
    }
    // ≥ 0: identical vectors (a key outside a query's window) may round to 1 − (1 + ε)
    (1.0 - ab / (aa.sqrt() * bb.sqrt())).max(0.0)
}

/// Each row of the `[n, n]` matrix `c` divided by its sum (a row summing to 0 stays 0).
fn normalize_rows(c: &mut [f64], n: usize) {
    for row in c.chunks_mut(n) {
        let s: f64 = row.iter().sum();
        if s > 0.0 {
            row.iter_mut().for_each(|v| *v /= s);
        }
    }
}

/// The row vector `v · C[k] · C[k−1] ⋯ C[0]` for `k = upto − 1` (`v` itself when `upto` is 0):
/// a row of the rollout, carried back to the input tokens.
fn carry_back(v: &[f64], c: &[Vec<f64>], upto: usize, n: usize) -> Vec<f64> {
    let mut v = v.to_vec();
    for k in (0..upto).rev() {
        let mut next = vec![0f64; n];
        for (j, &w) in v.iter().enumerate() {
            if w != 0.0 {
                next.iter_mut()
                    .zip(&c[k][j * n..(j + 1) * n])
                    .for_each(|(o, &x)| *o += w * x);
            }
        }
        v = next;
    }
    v
}

/// Value zeroing [Mohebbi et al. 2023] of every layer for `tokens`; `progress(done, total)`
/// after each forward.
pub fn value_zeroing(
    model: &Model,
    tokens: &[u32],
    progress: &mut dyn FnMut(usize, usize),
) -> Result<ValueZeroing> {
    let n = tokens.len();
    check_len(n, "value zeroing")?;
    let nl = model.dims.n_layers;
    let (runner, _, mut cache) = super::edit::Runner::clean(model, tokens, &[Hook::ResidPost])?;
    let post: Vec<Vec<f32>> = (0..nl)
        .map(|l| {
            cache
                .take(l, Hook::ResidPost)
                .expect("every layer's hook_resid_post was captured")
                .data
        })
        .collect();
    let run = ZeroingRun {
        model,
        tokens,
        runner: &runner,
        chunks: variant_batches(n),
    };
    let total = nl * run.chunks.len();
    let mut passes = 1;
    let mut layers = Vec::with_capacity(nl);
    let mut c_all: Vec<Vec<f64>> = Vec::with_capacity(nl);
    for (l, post_l) in post.iter().enumerate() {
        let mut c = vec![0f64; n * n];
        for chunk in &run.chunks {
            run.chunk_distances(l, chunk.clone(), post_l, &mut c)?;
            passes += 1;
            progress(passes - 1, total);
        }
        if let Some(i) = c.iter().position(|v| !v.is_finite()) {
            return Err(Error::NonFinite {
                what: format!("the value-zeroing distance of position {}", i / n),
                layer: Some(l),
            });
        }
        normalize_rows(&mut c, n);
        layers.push(c.iter().map(|&v| v as f32).collect());
        c_all.push(c);
    }
    let mut last = vec![0f64; n];
    last[n - 1] = 1.0;
    let roll = carry_back(&last, &c_all, nl, n);
    Ok(ValueZeroing {
        layers,
        rollout_last: roll.iter().map(|&v| v as f32).collect(),
        passes,
    })
}

/// The variants `j = 0..n` of one layer (`n − j` rows each), grouped into ranges of `j` stacked
/// into forwards of at most 1,024 rows.
fn variant_batches(n: usize) -> Vec<std::ops::Range<usize>> {
    const BATCH_ROWS: usize = 1024;
    let mut chunks: Vec<std::ops::Range<usize>> = Vec::new();
    let mut start = 0;
    while start < n {
        let (mut end, mut rows) = (start + 1, n - start);
        while end < n && rows + n - end <= BATCH_ROWS {
            rows += n - end;
            end += 1;
        }
        chunks.push(start..end);
        start = end;
    }
    chunks
}

/// Value zeroing's zeroed variants, run from the clean run's residuals and keys and values.
struct ZeroingRun<'a> {
    model: &'a Model,
    tokens: &'a [u32],
    runner: &'a super::edit::Runner<'a>,
    chunks: Vec<std::ops::Range<usize>>,
}

impl ZeroingRun<'_> {
    /// Runs layer `l` once per `j` in `chunk` with token `j`'s values zeroed (one stacked
    /// forward) and writes the cosine distances to the clean output `post_l` into `c[i, j]`.
    fn chunk_distances(
        &self,
        l: usize,
        chunk: std::ops::Range<usize>,
        post_l: &[f32],
        c: &mut [f64],
    ) -> Result<()> {
        let (n, dm) = (self.tokens.len(), self.model.dims.d_model);
        let tokens = self.tokens;
        let kv = self
            .runner
            .kv
            .as_ref()
            .expect("the clean run keeps its keys and values");
        let segs: Vec<Segment> = chunk
            .clone()
            .map(|j| Segment {
                tokens: &tokens[j..],
                reuse: j,
                knockout: Vec::new(),
                logits_at: Vec::new(),
            })
            .collect();
        let mut resid = Vec::new();
        let mut rows = Vec::new();
        for j in chunk.clone() {
            rows.push(resid.len() / dm);
            resid.extend_from_slice(&self.runner.resid_pre[l][j * dm..]);
        }
        let mut obs = ZeroValues {
            layer: l,
            rows: rows.clone(),
            out: Vec::new(),
        };
        let prefix = (chunk.end > 1).then_some(kv);
        self.model.forward_segments(
            prefix,
            &segs,
            Some(crate::model::forward::Resume { layer: l, resid }),
            &RunOptions::default(),
            &mut obs,
        )?;
        let want: usize = chunk.clone().map(|j| n - j).sum();
        if obs.out.len() != want * dm {
            return Err(Error::Bug(format!(
                "value zeroing got {} values of layer {l}'s output: you likely have a bug",
                obs.out.len()
            )));
        }
        for (k, j) in chunk.enumerate() {
            let base = rows[k];
            for i in j..n {
                let got = &obs.out[(base + i - j) * dm..][..dm];
                c[i * n + j] = cosine_distance(got, &post_l[i * dm..][..dm]);
            }
        }
        Ok(())
    }
}

/// ALTI-Logit's decomposition of the last position's logit.
#[derive(Clone, Debug)]
pub struct AltiLogit {
    /// The explained token (the answer of a logit difference).
    pub target: u32,
    /// `log p(target | text)`.
    pub logprob: f32,
    /// The explained scalar: `logit(target)` or `logit(answer) − logit(wrong)`.
    pub value: f32,
    /// Per input token, `Σ_l Δlogit^l · R[l−1]`.
    pub scores: Vec<f32>,
    /// Per layer, its attention block's logit updates carried back to the input tokens, `[L][n]`
    /// (they add up to `scores`).
    pub layers: Vec<Vec<f32>>,
    /// Per layer, ALTI's contributions to the last position (the last row of `C[l]`), `[L][n]`.
    pub alti_last: Vec<Vec<f32>>,
    /// The largest difference between a layer's residual after attention as the decomposition
    /// rebuilds it (`x_t + Σ_j T_t(x_j) + bias`) and the forward's, relative to its largest value.
    pub rebuild_error: f32,
}

/// One layer's attention, split per source token: what a wrapped [`AttnCache`] hands over as
/// each layer finishes.
struct AltiLayer {
    /// `C[l]` `[n, n]`, rows normalized
    c: Vec<f64>,
    /// `T_last(x_j)` `[n, d_model]` (after Gemma's post-norm, linearized)
    t_last: Vec<f64>,
    rebuild: f64,
}

/// Keeps each layer's `hook_resid_pre`, `hook_v`, `hook_pattern` and `hook_attn_out` and turns
/// them into [`AltiLayer`] when the layer is done, so only one layer's maps are held.
struct AltiObserver<'a> {
    model: &'a Model,
    cache: AttnCache,
    n: usize,
    layers: Vec<AltiLayer>,
    err: Option<Error>,
}

impl Observer for AltiObserver<'_> {
    crate::delegate_observer!(cache: wants, tensor, attention_block, pattern_rows);
    fn layer_done(&mut self, l: usize) {
        if self.err.is_some() {
            return;
        }
        let cache = &mut self.cache;
        let (Some(x), Some(v), Some(p), Some(out)) = (
            cache.take(l, Hook::ResidPre),
            cache.take(l, Hook::V),
            cache.take(l, Hook::Pattern),
            cache.take(l, Hook::AttnOut),
        ) else {
            self.err = Some(Error::Bug(format!(
                "ALTI: layer {l}'s activations were not captured: you likely have a bug"
            )));
            return;
        };
        match alti_layer(self.model, l, self.n, &x.data, &v.data, &p.data, &out.data) {
            Ok(a) => self.layers.push(a),
            Err(e) => self.err = Some(e),
        }
        // the next layer's pattern reuses this one's buffer
        self.cache.recycle_entry(p);
    }
}

/// One layer's ALTI quantities from its input `x` `[n, dm]`, values `v` `[n, nkv, hd]`, pattern
/// `p` `[nh, n, n]` and attention output `attn_out` `[n, dm]` (what is added to the residual).
fn alti_layer(
    model: &Model,
    l: usize,
    n: usize,
    x: &[f32],
    v: &[f32],
    p: &[f32],
    attn_out: &[f32],
) -> Result<AltiLayer> {
    let d = &model.dims;
    let (nh, nkv, hd) = (d.n_heads, d.n_kv_heads, d.head_dim);
    let group = nh / nkv;
    // u[j, h] = W_O^h v_j^{g(h)}: the head results of a z holding each head's value
    let mut z = vec![0f32; n * nh * hd];
    for j in 0..n {
        for h in 0..nh {
            z[(j * nh + h) * hd..][..hd].copy_from_slice(&v[(j * nkv + h / group) * hd..][..hd]);
        }
    }
    let (u, bias) = model.head_results(l, &z, n)?;
    let split = SourceSplit {
        n,
        nh,
        dm: d.d_model,
        x,
        p,
        attn_out,
        u: &u,
        bias: &bias,
        post: model.post_norms(l)?.map(|(pa, _)| pa),
        eps: d.rms_eps as f64,
    };
    let per_t: Vec<(Vec<f64>, Vec<f64>, f64)> =
        (0..n).into_par_iter().map(|t| split.row(t)).collect();
    let mut c = Vec::with_capacity(n * n);
    let mut t_last = Vec::new();
    let mut rebuild = 0f64;
    for (row, keep, r) in per_t {
        c.extend(row);
        if !keep.is_empty() {
            t_last = keep;
        }
        rebuild = rebuild.max(r);
    }
    if let Some(i) = c.iter().chain(&t_last).position(|v| !v.is_finite()) {
        return Err(Error::NonFinite {
            what: format!("an ALTI contribution ({i})"),
            layer: Some(l),
        });
    }
    Ok(AltiLayer { c, t_last, rebuild })
}

/// One layer's attention output split by source token, position by position.
struct SourceSplit<'a> {
    n: usize,
    nh: usize,
    dm: usize,
    /// the layer's input `[n, dm]`
    x: &'a [f32],
    /// the pattern `[nh, n, n]`
    p: &'a [f32],
    /// the attention block's output `[n, dm]`
    attn_out: &'a [f32],
    /// each head's result of each source's value `[n, nh, dm]`
    u: &'a [f32],
    /// the output projection's bias `[dm]`
    bias: &'a [f32],
    /// Gemma's post-attention norm
    post: Option<&'a [f32]>,
    eps: f64,
}

impl SourceSplit<'_> {
    /// Position `t`'s ALTI row (normalized), its `T_t(x_j)` when `t` is the last position (empty
    /// otherwise) and the relative error of rebuilding its residual.
    fn row(&self, t: usize) -> (Vec<f64>, Vec<f64>, f64) {
        let (mut tt, mut proj) = self.by_source(t);
        self.hold_post_norm(&mut tt, &mut proj);
        // y_t: the residual after attention as the decomposition rebuilds it
        let dm = self.dm;
        let xt = &self.x[t * dm..(t + 1) * dm];
        let y: Vec<f64> = proj.iter().zip(xt).map(|(&a, &b)| a + b as f64).collect();
        let rebuild = self.rebuild_error(t, &y);
        let c = self.contributions(t, &tt, &y);
        let keep = if t == self.n - 1 { tt } else { Vec::new() };
        (c, keep, rebuild)
    }

    /// `T_t(x_j)` for `j ≤ t`, `[n, dm]` (0 past `t`), and their sum with the bias.
    fn by_source(&self, t: usize) -> (Vec<f64>, Vec<f64>) {
        let (n, nh, dm) = (self.n, self.nh, self.dm);
        let mut tt = vec![0f64; n * dm];
        for j in 0..=t {
            let row = &mut tt[j * dm..(j + 1) * dm];
            for h in 0..nh {
                let a = self.p[(h * n + t) * n + j] as f64;
                if a != 0.0 {
                    let uh = &self.u[(j * nh + h) * dm..][..dm];
                    row.iter_mut()
                        .zip(uh)
                        .for_each(|(o, &w)| *o += a * w as f64);
                }
            }
        }
        let mut proj: Vec<f64> = self.bias.iter().map(|&b| b as f64).collect();
        for j in 0..=t {
            proj.iter_mut()
                .zip(&tt[j * dm..(j + 1) * dm])
                .for_each(|(o, &w)| *o += w);
        }
        (tt, proj)
    }

    /// Gemma's post-attention norm, its scale held: γ ⊙ (·) / rms(attn_proj_t).
    fn hold_post_norm(&self, tt: &mut [f64], proj: &mut [f64]) {
        let Some(g) = self.post else { return };
        let dm = self.dm;
        let ms = proj.iter().map(|v| v * v).sum::<f64>() / dm as f64;
        let inv = 1.0 / ((ms as f32 as f64) + self.eps).sqrt();
        let scale: Vec<f64> = g.iter().map(|&w| w as f64 * inv).collect();
        for row in tt.chunks_mut(dm).chain(std::iter::once(proj)) {
            row.iter_mut().zip(&scale).for_each(|(o, s)| *o *= s);
        }
    }

    /// The largest gap between the rebuilt residual `y` and the real one, relative to the latter.
    fn rebuild_error(&self, t: usize, y: &[f64]) -> f64 {
        let dm = self.dm;
        let real: Vec<f64> = self.x[t * dm..(t + 1) * dm]
            .iter()
            .zip(&self.attn_out[t * dm..(t + 1) * dm])
            .map(|(&a, &b)| a as f64 + b as f64)
            .collect();
        let top = real.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
        y.iter()
            .zip(&real)
            .fold(0f64, |m, (a, b)| m.max((a - b).abs()))
            / top
    }

    /// ALTI's `c_{t,j} = max(0, ‖y_t‖₁ − ‖y_t − T_t(x_j) − [t = j] x_t‖₁)`, normalized.
    fn contributions(&self, t: usize, tt: &[f64], y: &[f64]) -> Vec<f64> {
        let dm = self.dm;
        let xt = &self.x[t * dm..(t + 1) * dm];
        let ynorm: f64 = y.iter().map(|v| v.abs()).sum();
        let mut c = vec![0f64; self.n];
        for j in 0..=t {
            let tj = &tt[j * dm..(j + 1) * dm];
            let dist: f64 = (0..dm)
                .map(|k| {
                    let own = tj[k] + if j == t { xt[k] as f64 } else { 0.0 };
                    (y[k] - own).abs()
                })
                .sum();
            c[j] = (ynorm - dist).max(0.0);
        }
        let s: f64 = c.iter().sum();
        if s > 0.0 {
            c.iter_mut().for_each(|v| *v /= s);
        }
        c
    }
}

/// ALTI-Logit [Ferrando et al. 2023] of the last position's `metric` for `tokens`:
/// [`Metric::LogProb`] explains the target's logit (`None`: the top next token),
/// [`Metric::LogitDiff`] the logit difference.
pub fn alti_logit(model: &Model, tokens: &[u32], metric: Metric) -> Result<AltiLogit> {
    let n = tokens.len();
    check_len(n, "ALTI-Logit")?;
    let (mut obs, logits) = run_alti_forward(model, tokens)?;
    let lsm = crate::model::forward::log_softmax(&logits);
    let goal = MetricDirection::new(model, &logits, metric)?;
    let direction = through_final_norm(model, &mut obs, &goal.u)?;
    let (scores, layers) = carry_updates_to_inputs(&obs.layers, &direction, model.dims.d_model, n);
    let rebuild = obs.layers.iter().fold(0f64, |m, a| m.max(a.rebuild)) as f32;
    if let Some(i) = scores.iter().position(|v| !v.is_finite()) {
        return Err(Error::NonFinite {
            what: format!("the ALTI-Logit score of position {i}"),
            layer: None,
        });
    }
    Ok(AltiLogit {
        target: goal.target,
        logprob: lsm[goal.target as usize],
        value: goal.value,
        scores: scores.iter().map(|&v| v as f32).collect(),
        layers,
        alti_last: obs
            .layers
            .iter()
            .map(|a| a.c[(n - 1) * n..].iter().map(|&v| v as f32).collect())
            .collect(),
        rebuild_error: rebuild,
    })
}

/// The forward that records every layer's ALTI maps; returns the observer (its layers and the
/// cache holding the final residual) and the last position's logits.
fn run_alti_forward<'a>(model: &'a Model, tokens: &[u32]) -> Result<(AltiObserver<'a>, Vec<f32>)> {
    let n = tokens.len();
    let spec = CaptureSpec {
        hooks: vec![
            Hook::ResidPre,
            Hook::V,
            Hook::Pattern,
            Hook::AttnOut,
            Hook::ResidPost,
        ],
        layers: None,
        heads: None,
        queries: Queries::All,
    };
    let mut obs = AltiObserver {
        model,
        cache: AttnCache::new(&spec, n),
        n,
        layers: Vec::with_capacity(model.dims.n_layers),
        err: None,
    };
    let mut out = model.forward(
        tokens,
        &RunOptions {
            logits_at: vec![n - 1],
            ..Default::default()
        },
        &mut obs,
    )?;
    if let Some(e) = obs.err.take() {
        return Err(e);
    }
    let logits = out.logits.pop().expect("one row of logits was asked for");
    Ok((obs, logits))
}

/// The metric's target token, its value and its direction `u` in the unembedding space.
struct MetricDirection {
    target: u32,
    value: f32,
    u: Vec<f64>,
}

impl MetricDirection {
    fn new(model: &Model, logits: &[f32], metric: Metric) -> Result<Self> {
        let argmax = logits
            .iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |b, (i, &v)| {
                if v > b.1 {
                    (i, v)
                } else {
                    b
                }
            })
            .0 as u32;
        let (target, weights): (u32, Vec<(u32, f64)>) = match metric {
            Metric::LogProb(t) => {
                let t = t.unwrap_or(argmax);
                (t, vec![(t, 1.0)])
            }
            Metric::LogitDiff { answer, wrong } => (answer, vec![(answer, 1.0), (wrong, -1.0)]),
        };
        let mut u = vec![0f64; model.dims.d_model];
        for &(id, w) in &weights {
            let row = model.unembed_row(id)?;
            u.iter_mut()
                .zip(&row)
                .for_each(|(o, &r)| *o += w * r as f64);
        }
        let value = weights
            .iter()
            .map(|&(id, w)| w * logits[id as usize] as f64)
            .sum::<f64>() as f32;
        Ok(Self { target, value, u })
    }
}

/// The unembedding direction `u` through the final norm, its scale held at the last position's.
fn through_final_norm(model: &Model, obs: &mut AltiObserver, u: &[f64]) -> Result<Vec<f64>> {
    let (nl, dm, n) = (model.dims.n_layers, model.dims.d_model, obs.n);
    let last = obs
        .cache
        .take(nl - 1, Hook::ResidPost)
        .ok_or_else(|| Error::Bug("no final residual".into()))?
        .data;
    let xf = &last[(n - 1) * dm..];
    let (gf, bf, eps) = model.final_norm();
    let c: Vec<f64> = u.iter().zip(gf).map(|(&a, &g)| a * g as f64).collect();
    Ok(if bf.is_some() {
        let mean = xf.iter().map(|&v| v as f64).sum::<f64>() / dm as f64;
        let var = xf.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / dm as f64;
        let inv = 1.0 / ((var as f32 + eps) as f64).sqrt();
        let mc = c.iter().sum::<f64>() / dm as f64;
        c.iter().map(|&v| (v - mc) * inv).collect()
    } else {
        let ms = xf.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dm as f64;
        let inv = 1.0 / ((ms as f32 + eps) as f64).sqrt();
        c.iter().map(|&v| v * inv).collect()
    })
}

/// Each layer's logit updates by source token, carried back to the input tokens by the rollout
/// of the layers before it: the summed scores `[n]` and each layer's share.
fn carry_updates_to_inputs(
    alti: &[AltiLayer],
    direction: &[f64],
    dm: usize,
    n: usize,
) -> (Vec<f64>, Vec<Vec<f32>>) {
    let cs: Vec<Vec<f64>> = alti.iter().map(|a| a.c.clone()).collect();
    let mut layers = Vec::with_capacity(alti.len());
    let mut scores = vec![0f64; n];
    for (l, a) in alti.iter().enumerate() {
        let dlogit: Vec<f64> = a
            .t_last
            .chunks(dm)
            .map(|row| row.iter().zip(direction).map(|(a, b)| a * b).sum())
            .collect();
        let carried = carry_back(&dlogit, &cs, l, n);
        scores.iter_mut().zip(&carried).for_each(|(s, c)| *s += c);
        layers.push(carried.iter().map(|&v| v as f32).collect());
    }
    (scores, layers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cosine_distance_by_hand() {
        assert!((cosine_distance(&[1.0, 0.0], &[0.0, 2.0]) - 1.0).abs() < 1e-12);
        assert!(cosine_distance(&[1.0, 2.0], &[2.0, 4.0]).abs() < 1e-12);
        assert!((cosine_distance(&[1.0, 0.0], &[-3.0, 0.0]) - 2.0).abs() < 1e-12);
        // (1, 1) against (1, 0): 1 − 1/√2
        let want = 1.0 - std::f64::consts::FRAC_1_SQRT_2;
        assert!((cosine_distance(&[1.0, 1.0], &[1.0, 0.0]) - want).abs() < 1e-12);
    }

    #[test]
    fn rollout_by_hand() {
        // two tokens, two layers: C0 = [[1, 0], [0.5, 0.5]], C1 = [[1, 0], [0.25, 0.75]]
        // R1 = C1·C0 = [[1, 0], [0.25 + 0.375, 0.375]] → last row (0.625, 0.375)
        let c = vec![vec![1.0, 0.0, 0.5, 0.5], vec![1.0, 0.0, 0.25, 0.75]];
        let r = carry_back(&[0.0, 1.0], &c, 2, 2);
        assert!((r[0] - 0.625).abs() < 1e-12 && (r[1] - 0.375).abs() < 1e-12);
        // carried through layer 0 only: (0.5, 0.5); through none: itself
        assert_eq!(carry_back(&[0.0, 1.0], &c, 1, 2), vec![0.5, 0.5]);
        assert_eq!(carry_back(&[0.3, 0.7], &c, 0, 2), vec![0.3, 0.7]);
        let mut m = vec![1.0, 3.0, 0.0, 0.0];
        normalize_rows(&mut m, 2);
        assert_eq!(m, vec![0.25, 0.75, 0.0, 0.0]);
    }
}

/// The scores of `attribute`'s context-mixing and LRP methods ([`super::scores::decoder_scores`]).
#[derive(Clone, Debug)]
pub struct MethodScores {
    pub scores: Vec<f32>,
    pub logprob: f32,
    /// The explained scalar (value zeroing: `log p(target)`, which it does not explain).
    pub value: f32,
    pub conservation_error: Option<f32>,
    pub layers: Option<Vec<Vec<f32>>>,
}

/// AttnLRP, value zeroing or ALTI-Logit for `attribute` ([`super::scores::decoder_scores`]).
pub fn scores_of(
    model: &Model,
    tokens: &[u32],
    method: super::vocab::Method,
    metric: Metric,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<MethodScores> {
    use super::vocab::Method;
    Ok(match method {
        Method::AttnLrp => {
            let r = model.attnlrp(tokens, metric)?;
            MethodScores {
                scores: r.scores,
                logprob: r.logprob,
                value: r.value,
                conservation_error: Some(r.conservation_error),
                layers: None,
            }
        }
        Method::ValueZeroing => {
            let v = value_zeroing(model, tokens, progress)?;
            let n = tokens.len();
            let logits = model.next_token_logits(tokens)?;
            let target = match metric {
                Metric::LogProb(t) => t.expect("resolved"),
                Metric::LogitDiff { answer, .. } => answer,
            };
            let lp = crate::model::forward::log_softmax(&logits)[target as usize];
            MethodScores {
                scores: v.rollout_last,
                logprob: lp,
                value: lp,
                conservation_error: None,
                layers: Some(v.layers.iter().map(|c| c[(n - 1) * n..].to_vec()).collect()),
            }
        }
        _ => {
            let a = alti_logit(model, tokens, metric)?;
            MethodScores {
                scores: a.scores,
                logprob: a.logprob,
                value: a.value,
                conservation_error: None,
                layers: Some(a.layers),
            }
        }
    })
}

/// `faithfulness`'s rankings for `target`: AttnLRP (its relevance and conservation error),
/// value zeroing's rollout, ALTI-Logit's scores.
pub fn rankings(
    model: &Model,
    tokens: &[u32],
    target: u32,
) -> Result<(crate::model::lrp::Relevance, Vec<f32>, Vec<f32>)> {
    let metric = Metric::LogProb(Some(target));
    let lrp = model.attnlrp(tokens, metric)?;
    let vz = value_zeroing(model, tokens, &mut |_, _| {})?;
    let alti = alti_logit(model, tokens, metric)?;
    Ok((lrp, vz.rollout_last, alti.scores))
}
