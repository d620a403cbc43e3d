//! `attnscope qk`: why a head attends where it does (issue #58). A head's pre-softmax score of
//! query i and key j is `s = scale · rot_i(q_i) · rot_j(k_j)`, with `q_i = W_Q ln1(x_i) + b_Q`
//! (`k_j` likewise, from the head's key/value group) and the residual `x_i` the sum of its
//! components: the embedding (`input`), every earlier head's output through its columns of W_O
//! (`a{l}.h{h}`), W_O's bias where there is one (`a{l}.bias`, GPT-2) and every earlier MLP's
//! output (`m{l}`), the upstream nodes of the circuit graph. With each position's norm scale
//! frozen at its value in the run (and, where the family has them, each position's per-head
//! q/k norm scale and each earlier layer's post-attention norm scale), the norm, the projection
//! and the rotation are linear maps, so
//! `s = Σ_{a,b} scale · rot_i(Q_a(i)) · rot_j(K_b(j))` over the components and `bias` (the
//! projection's bias, and a LayerNorm's bias through it) on each side: (C + 1)² terms that add up
//! to the score the forward computed, up to rounding; the report gives the gap. This is
//! Anthropic's QK attribution ("Tracing attention computation through feature interactions",
//! 2025) on the model's own components, no dictionary; the OV side is `dla`.
//!
//! Without a key, the split is of the attended key's lead: score(i, top) − score(i, second)
//! (or − the mean score over the keys the query sees): the query side is shared, the key side is
//! the difference of the keys' parts. Everything after the forward is in f64.

use super::request::{check_index, usage};
use super::vocab::TokenRef;
use crate::model::block::{LayerPlan, NormKind};
use crate::model::capture::{Hook, Observer};
use crate::model::forward::RunOptions;
use crate::model::tl_weights::Projection;
use crate::model::{Error, Model};
use rayon::prelude::*;
use serde::Serialize;
use std::ops::RangeInclusive;

/// What the attended key's score is set against when no key is named.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Against {
    /// score(i, top key) − score(i, second key)
    Second,
    /// score(i, top key) − the mean score over the keys query i sees
    Mean,
}

impl std::str::FromStr for Against {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "second" => Ok(Against::Second),
            "mean" => Ok(Against::Mean),
            o => Err(format!("`{o}` is not one of: second, mean")),
        }
    }
}

/// What to split: the CLI's flags, Python's arguments.
#[derive(Clone, Debug)]
pub struct QkOptions {
    /// the token ids
    pub tokens: Vec<u32>,
    /// the layer
    pub layer: usize,
    /// the head
    pub head: usize,
    /// the query position (default: the last)
    pub query: Option<usize>,
    /// the key position; `None`: the key the head attends to most, set against `against`
    pub key: Option<usize>,
    /// what the score is set against (nothing, the second key, the mean)
    pub against: Against,
}

/// One term: a query-side component's part of the query times a key-side component's part of
/// the key (both rotated, the score's scale included).
#[derive(Clone, Debug, Serialize)]
pub struct QkTerm {
    pub query_side: String,
    pub key_side: String,
    pub value: f64,
}

/// `qk`'s report: one head's attention score split into its query-side and key-side terms.
#[derive(Clone, Debug, Serialize)]
pub struct QkReport {
    /// the model's name
    pub model: String,
    /// the input tokens
    pub tokens: Vec<TokenRef>,
    /// the layer
    pub layer: usize,
    /// the head
    pub head: usize,
    /// the key/value head the key side comes from (GQA: `head / group_size`)
    pub kv_head: usize,
    /// the query position
    pub query: usize,
    /// the key position
    pub key: usize,
    /// `null`: the score of (query, key) is split; `second` / `mean`: its lead over the second
    /// key's score / over the mean score of the keys the query sees
    pub against: Option<Against>,
    /// the key the score is set against (`second`)
    pub against_key: Option<usize>,
    /// the quantity split, from the forward's `hook_attn_scores` (before a soft-cap):
    /// `key_score` (− `against_score`)
    pub score: f64,
    /// the score of (query, key)
    pub key_score: f64,
    /// the score set against it (`second`, `mean`)
    pub against_score: Option<f64>,
    /// the forward's score of every key up to the query (`null` outside a sliding window),
    /// before a soft-cap
    pub row_scores: Vec<Option<f64>>,
    /// every term, largest |value| first
    pub terms: Vec<QkTerm>,
    /// the terms added up, and `sum − score`
    pub sum: f64,
    /// `sum − score`
    pub gap: f64,
    /// the residual stream's components at the layer's input (each side's terms name them, and
    /// `bias`)
    pub components: Vec<String>,
    /// the score's scale: 1/√head_dim, or the family's (Gemma's `query_pre_attn_scalar^-½`)
    pub scale: f64,
    /// Gemma 2's attention soft-cap: the terms split the score before it; the softmax sees
    /// `cap · tanh(score / cap)`
    pub softcap: Option<f64>,
    /// the sliding window of the layer, if it has one
    pub window: Option<usize>,
    /// the nonlinear steps whose scales were frozen at their values in the run
    pub frozen: Vec<String>,
}

/// The split of `o.key`'s score (or of the attended key's lead) for query `o.query` of head
/// `o.head` at layer `o.layer`.
pub fn qk(model: &Model, o: &QkOptions) -> anyhow::Result<QkReport> {
    let t = resolve(model, o)?;
    let kept: Vec<usize> = match t.key {
        Some(j) if j != t.query => vec![j, t.query],
        Some(_) => vec![t.query],
        None => t.visible.clone().collect(),
    };
    let run = capture(model, &o.tokens, &t, kept)?;
    let scores = Scores::of(&run.scores, &t);
    let choice = choose(&t, o.against, &scores);
    let parts = parts_of(model, t.layer)?;
    let (q_side, k_side) = sides(model, &t)?;
    let rope = Rope::of(model, t.layer, o.tokens.len());
    let scale = t
        .plan
        .score_scale
        .map_or(1.0 / (model.dims.head_dim as f64).sqrt(), |s| s as f64);
    let at = |side: &Side, rows: &[usize], factor: f64| {
        finished_parts(
            model,
            &run,
            &t,
            (&parts, side),
            (rows, rope.as_ref()),
            factor,
        )
    };
    let q = at(&q_side, &[t.query], scale)?
        .pop()
        .expect("one query row");
    let k = key_side(at(&k_side, &choice.rows, 1.0)?, &choice);
    let mut names: Vec<String> = parts.iter().map(Part::name).collect();
    names.push("bias".into());
    let terms = terms(&q, &k, &names, model.dims.head_dim);
    let sum: f64 = terms.iter().map(|t| t.value).sum();
    let score = choice.key_score - choice.against_score.unwrap_or(0.0);
    names.pop();
    Ok(QkReport {
        model: model.info.name.clone(),
        tokens: TokenRef::all(model, &o.tokens),
        layer: t.layer,
        head: t.head,
        kv_head: t.kv_head,
        query: t.query,
        key: choice.key,
        against: choice.against,
        against_key: choice.against_key,
        score,
        key_score: choice.key_score,
        against_score: choice.against_score,
        row_scores: scores.row,
        terms,
        sum,
        gap: sum - score,
        components: names,
        scale,
        softcap: t.plan.softcap.map(|c| c as f64),
        window: t.plan.window,
        frozen: frozen_notes(model, t.layer),
    })
}

/// The request checked against the model and the text.
struct Target {
    layer: usize,
    head: usize,
    kv_head: usize,
    query: usize,
    key: Option<usize>,
    /// the keys the query sees (its sliding window's, or every one before it)
    visible: RangeInclusive<usize>,
    plan: LayerPlan,
}

fn resolve(model: &Model, o: &QkOptions) -> anyhow::Result<Target> {
    let d = &model.dims;
    refuse_model(model)?;
    let n = o.tokens.len();
    if n == 0 {
        return Err(usage("qk needs a text of at least one token"));
    }
    let layer = check_index(o.layer, d.n_layers, "layer")?;
    let head = check_index(o.head, d.n_heads, "head")?;
    let query = check_index(o.query.unwrap_or(n - 1), n, "query position")?;
    let plan = LayerPlan::of(d, layer);
    let lo = plan.window.map_or(0, |w| (query + 1).saturating_sub(w));
    match o.key {
        Some(j) => check_key(j, n, query, lo, (layer, plan.window))?,
        None if lo == query => {
            return Err(usage(format!(
                "query {query} sees one key only (itself), so no key leads another: name it with --key {query}"
            )))
        }
        None => {}
    }
    Ok(Target {
        layer,
        head,
        kv_head: head / d.group_size(),
        query,
        key: o.key,
        visible: lo..=query,
        plan,
    })
}

/// Key `j` must be one that query `query` sees: not after it (causal), not before its sliding
/// window (`lo`, the window's first key).
fn check_key(
    j: usize,
    n: usize,
    query: usize,
    lo: usize,
    (layer, window): (usize, Option<usize>),
) -> anyhow::Result<()> {
    check_index(j, n, "key position")?;
    if j > query {
        return Err(usage(format!(
            "key {j} comes after query {query}: the causal mask hides it (its score is −∞, its weight 0); query {query} sees keys 0..={query}"
        )));
    }
    if let (true, Some(w)) = (j < lo, window) {
        return Err(usage(format!(
            "key {j} lies outside layer {layer}'s sliding window of {w} tokens: query {query} sees keys {lo}..={query} only (the others' scores are −∞)"
        )));
    }
    Ok(())
}

/// Refuses an encoder (post-LN: its residual stream is not a sum of the blocks' outputs), and a
/// partial rotation in llama.cpp's interleaved row order (no family has one).
fn refuse_model(model: &Model) -> crate::model::Result<()> {
    let d = &model.dims;
    if d.arch.is_encoder() {
        return Err(Error::NotApplicable(format!(
            "qk splits a decoder's attention score over the components of its residual stream; {} is an encoder ({:?}), whose blocks normalize after each residual add (post-LN), so its residual stream is not a sum of the earlier blocks' outputs: use `attnscope inspect` for its attention",
            model.info.name, d.arch
        )));
    }
    if model.qk_interleaved() && d.rotary_dim != d.head_dim {
        return Err(Error::NotApplicable(format!(
            "qk does not split {}: its file rotates {} of {} dimensions of each head in llama.cpp's interleaved order, which attnscope cannot map back to Hugging Face's",
            model.info.name, d.rotary_dim, d.head_dim
        )));
    }
    Ok(())
}

/// What the split needs from one forward, at the kept positions `rows` (sorted): the embedding
/// (layer 0's `hook_resid_pre`), every earlier layer's `hook_z` and `hook_mlp_out`, the layer's
/// `ln1.hook_scale`; and the query's row of the head's `hook_attn_scores` (every key, −∞ where
/// masked). The forward stops after the layer.
struct Tap {
    layer: usize,
    head: usize,
    query: usize,
    rows: Vec<usize>,
    embed: Vec<f32>,
    z: Vec<Vec<f32>>,
    mlp: Vec<Vec<f32>>,
    ln_scale: Vec<f32>,
    scores: Vec<f32>,
}

impl Observer for Tap {
    fn wants(&self, l: usize, hook: Hook) -> bool {
        match hook {
            Hook::ResidPre => l == 0,
            Hook::Z | Hook::MlpOut => l < self.layer,
            Hook::Ln1Scale | Hook::AttnScores => l == self.layer,
            _ => false,
        }
    }

    fn tensor(&mut self, l: usize, hook: Hook, shape: &[usize], data: &[f32]) {
        let w: usize = shape[1..].iter().product();
        let kept: Vec<f32> = self
            .rows
            .iter()
            .flat_map(|&r| data[r * w..(r + 1) * w].iter().copied())
            .collect();
        match hook {
            Hook::ResidPre => self.embed = kept,
            Hook::Z => self.z[l] = kept,
            Hook::MlpOut => self.mlp[l] = kept,
            Hook::Ln1Scale => self.ln_scale = kept,
            _ => {}
        }
    }

    fn attention_block(
        &mut self,
        l: usize,
        hook: Hook,
        q_start: usize,
        [_, rows, k_width]: [usize; 3],
        data: &[f32],
    ) {
        let wanted = hook == Hook::AttnScores && l == self.layer;
        if wanted && (q_start..q_start + rows).contains(&self.query) {
            let r = self.query - q_start;
            let src = &data[(self.head * rows + r) * k_width..][..k_width];
            self.scores[..k_width].copy_from_slice(src);
        }
    }

    fn stops_before(&self, l: usize) -> bool {
        l > self.layer
    }
}

/// The forward over `tokens`, keeping positions `rows` (sorted).
fn capture(model: &Model, tokens: &[u32], t: &Target, rows: Vec<usize>) -> anyhow::Result<Tap> {
    let mut tap = Tap {
        layer: t.layer,
        head: t.head,
        query: t.query,
        rows,
        embed: Vec::new(),
        z: vec![Vec::new(); t.layer],
        mlp: vec![Vec::new(); t.layer],
        ln_scale: Vec::new(),
        scores: vec![f32::NEG_INFINITY; tokens.len()],
    };
    model.forward(tokens, &RunOptions::default(), &mut tap)?;
    let m = tap.rows.len();
    let (dm, zw) = (model.dims.d_model, model.dims.n_heads * model.dims.head_dim);
    let whole = tap.embed.len() == m * dm
        && tap.ln_scale.len() == m
        && tap.z.iter().all(|z| z.len() == m * zw)
        && tap.mlp.iter().all(|x| x.len() == m * dm);
    if !whole {
        anyhow::bail!("the forward handed qk fewer hooks than it asked for: you likely have a bug");
    }
    Ok(tap)
}

/// The forward's scores of the query's row, before a soft-cap.
struct Scores {
    /// every key up to the query; `None` outside the window
    row: Vec<Option<f64>>,
}

impl Scores {
    fn of(raw: &[f32], t: &Target) -> Scores {
        let uncap = |s: f32| match t.plan.softcap {
            // the cap is `c · tanh(s / c)`: its inverse, as close to ±c as f64 allows
            Some(c) => {
                let (c, s) = (c as f64, s as f64);
                c * (s / c).clamp(-1.0 + 1e-15, 1.0 - 1e-15).atanh()
            }
            None => s as f64,
        };
        let row = (0..=t.query)
            .map(|j| t.visible.contains(&j).then(|| uncap(raw[j])))
            .collect();
        Scores { row }
    }

    fn at(&self, j: usize) -> f64 {
        self.row[j].expect("a key the query sees")
    }
}

/// The key whose score is split and what it is set against, with the key positions whose parts
/// the key side needs (the key first).
struct Choice {
    key: usize,
    key_score: f64,
    against: Option<Against>,
    against_key: Option<usize>,
    against_score: Option<f64>,
    rows: Vec<usize>,
}

fn choose(t: &Target, against: Against, s: &Scores) -> Choice {
    if let Some(j) = t.key {
        return Choice {
            key: j,
            key_score: s.at(j),
            against: None,
            against_key: None,
            against_score: None,
            rows: vec![j],
        };
    }
    // ties go to the lower position, as `inspect`'s top keys
    let mut order: Vec<usize> = t.visible.clone().collect();
    order.sort_by(|&a, &b| s.at(b).total_cmp(&s.at(a)).then(a.cmp(&b)));
    let (top, second) = (order[0], order[1]);
    let (against_key, against_score, rows) = match against {
        Against::Second => (Some(second), s.at(second), vec![top, second]),
        Against::Mean => {
            let keys: Vec<usize> = t.visible.clone().collect();
            let mean = keys.iter().map(|&j| s.at(j)).sum::<f64>() / keys.len() as f64;
            let rows = std::iter::once(top).chain(keys).collect();
            (None, mean, rows)
        }
    };
    Choice {
        key: top,
        key_score: s.at(top),
        against: Some(against),
        against_key,
        against_score: Some(against_score),
        rows,
    }
}

/// One component of the residual stream at a layer's input.
#[derive(Clone, Copy, Debug)]
enum Part {
    Input,
    Head(usize, usize),
    OutBias(usize),
    Mlp(usize),
}

impl Part {
    /// Its name as the circuit graph's upstream node.
    fn name(&self) -> String {
        match *self {
            Part::Input => "input".into(),
            Part::Head(l, h) => format!("a{l}.h{h}"),
            Part::OutBias(l) => format!("a{l}.bias"),
            Part::Mlp(l) => format!("m{l}"),
        }
    }
}

/// The components of layer `layer`'s input, in the order the forward adds them.
fn parts_of(model: &Model, layer: usize) -> anyhow::Result<Vec<Part>> {
    let mut parts = vec![Part::Input];
    for l in 0..layer {
        parts.extend((0..model.dims.n_heads).map(|h| Part::Head(l, h)));
        if model.output_bias(l)?.is_some() {
            parts.push(Part::OutBias(l));
        }
        parts.push(Part::Mlp(l));
    }
    Ok(parts)
}

/// What was frozen for the split of layer `layer`'s scores, in words.
fn frozen_notes(model: &Model, layer: usize) -> Vec<String> {
    let plan = LayerPlan::of(&model.dims, layer);
    let mut notes = vec![match plan.norm {
        NormKind::Rms => "ln1's scale (RMS) of each position".to_string(),
        NormKind::Layer => {
            "ln1's scale (σ) of each position (its centring is linear and applied to each component)"
                .to_string()
        }
    }];
    if matches!(model.qk_norms(layer), Ok(Some(_))) {
        notes.push(
            "the per-head q and k RMSNorm's scale of each position (the q side's at the query, the k side's at each key)"
                .into(),
        );
    }
    if (0..layer).any(|l| matches!(model.post_norms(l), Ok(Some(_)))) {
        notes.push(
            "each earlier layer's post-attention norm scale of each position (its heads' parts; the MLP's post-norm is inside m{l})"
                .into(),
        );
    }
    notes
}

/// One side of the score: the head's query, or its key/value group's key.
struct Side {
    /// `W ⊙ γ`: the side's rows of the q|k|v projection with ln1's weight folded into the
    /// columns, `[head_dim, d_model]`
    w: Vec<f64>,
    /// the constant part `W·β + b` (the projection's bias; a LayerNorm's bias through it)
    bias: Vec<f64>,
    /// LayerNorm: each component is centred (the mean is linear)
    centre: bool,
    /// the per-head q/k RMSNorm's weight (Qwen3, Gemma 3)
    norm: Option<Vec<f64>>,
}

/// The query side (head `t.head`) and the key side (its group `t.kv_head`).
fn sides(model: &Model, t: &Target) -> anyhow::Result<(Side, Side)> {
    let d = &model.dims;
    let hd = d.head_dim;
    let (w, b, rows, cols) = model.projection_weights(t.layer, Projection::Qkv)?;
    debug_assert_eq!(
        (rows, cols),
        ((d.n_heads + 2 * d.n_kv_heads) * hd, d.d_model)
    );
    let ((gamma, beta), _) = model.layer_norms(t.layer)?;
    let centre = t.plan.norm == NormKind::Layer;
    let norms = model.qk_norms(t.layer)?;
    let side = |row0: usize, norm: Option<&Vec<f32>>| {
        let mut ws = vec![0f64; hd * cols];
        let mut bias = vec![0f64; hd];
        for r in 0..hd {
            let src = &w[(row0 + r) * cols..][..cols];
            let dst = &mut ws[r * cols..][..cols];
            for ((d, &x), &g) in dst.iter_mut().zip(src).zip(gamma) {
                *d = x as f64 * g as f64;
            }
            let through_beta = beta.map_or(0.0, |be| {
                src.iter().zip(be).map(|(&x, &y)| x as f64 * y as f64).sum()
            });
            bias[r] = through_beta + b.as_ref().map_or(0.0, |b| b[row0 + r] as f64);
        }
        Side {
            w: ws,
            bias,
            centre,
            norm: norm.map(|n| n.iter().map(|&x| x as f64).collect()),
        }
    };
    let q_row0 = t.head * hd;
    let k_row0 = d.n_heads * hd + t.kv_head * hd;
    Ok((
        side(q_row0, norms.as_ref().map(|n| &n.0)),
        side(k_row0, norms.as_ref().map(|n| &n.1)),
    ))
}

impl Side {
    /// `(W ⊙ γ) · x · inv` (`x` centred first for a LayerNorm) into `out` (`[head_dim]`).
    fn project(&self, x: &[f64], inv: f64, out: &mut [f64]) {
        let dm = x.len();
        let centred;
        let x = if self.centre {
            let mean = x.iter().sum::<f64>() / dm as f64;
            centred = x.iter().map(|v| v - mean).collect::<Vec<f64>>();
            &centred
        } else {
            x
        };
        for (o, row) in out.iter_mut().zip(self.w.chunks_exact(dm)) {
            *o = dot(row, x) * inv;
        }
    }
}

/// `a · b` in eight running sums (a single one is one dependent add after another, 8x slower:
/// the mean's split of 481 keys took 15 s).
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0f64; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f64 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for ((s, x), y) in acc.iter_mut().zip(x).zip(y) {
            *s += x * y;
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// Layer `layer`'s RoPE tables in f64 (HF's row order: pairs `(i, i + half)`).
struct Rope {
    cos: Vec<f64>,
    sin: Vec<f64>,
    half: usize,
}

impl Rope {
    fn of(model: &Model, layer: usize, n: usize) -> Option<Rope> {
        let (cos, sin) = model.rope_tables(layer, n)?;
        Some(Rope {
            cos: cos.iter().map(|&x| x as f64).collect(),
            sin: sin.iter().map(|&x| x as f64).collect(),
            half: model.dims.rotary_dim / 2,
        })
    }

    /// Rotates the head vector `v` as at position `p` (its first `2·half` values).
    fn rotate(&self, v: &mut [f64], p: usize) {
        let h = self.half;
        let (cos, sin) = (&self.cos[p * h..][..h], &self.sin[p * h..][..h]);
        let (a, b) = v[..2 * h].split_at_mut(h);
        for i in 0..h {
            let (x1, x2) = (a[i], b[i]);
            a[i] = x1 * cos[i] - x2 * sin[i];
            b[i] = x1 * sin[i] + x2 * cos[i];
        }
    }
}

/// Each component's part of the side's vector at each of `rows` (positions among the run's
/// kept ones): `[rows][C + 1][head_dim]` flattened per row, `bias` last; the projection of each
/// part with the row's frozen ln1 scale, then the q/k norm's frozen scale of the whole vector,
/// the rotation of the row's position, and `factor`.
fn finished_parts(
    model: &Model,
    run: &Tap,
    t: &Target,
    (parts, side): (&[Part], &Side),
    (rows, rope): (&[usize], Option<&Rope>),
    factor: f64,
) -> anyhow::Result<Vec<Vec<f64>>> {
    let hd = model.dims.head_dim;
    let idx: Vec<usize> = rows
        .iter()
        .map(|p| run.rows.binary_search(p).expect("a kept row"))
        .collect();
    let mut out = raw_parts(model, run, t.layer, (parts, side), &idx)?;
    let eps = model.dims.rms_eps as f64;
    out.par_iter_mut().zip(rows).for_each(|(v, &p)| {
        if let Some(w) = &side.norm {
            // the per-head RMSNorm of the whole vector, its scale frozen
            let mut whole = vec![0f64; hd];
            for part in v.chunks_exact(hd) {
                whole.iter_mut().zip(part).for_each(|(a, b)| *a += b);
            }
            let ms = whole.iter().map(|x| x * x).sum::<f64>() / hd as f64;
            let inv = 1.0 / (ms + eps).sqrt();
            for part in v.chunks_exact_mut(hd) {
                part.iter_mut().zip(w).for_each(|(x, g)| *x *= g * inv);
            }
        }
        for part in v.chunks_exact_mut(hd) {
            if let Some(r) = rope {
                r.rotate(part, p);
            }
            part.iter_mut().for_each(|x| *x *= factor);
        }
    });
    Ok(out)
}

/// Each component's projection onto `side` at the kept rows `idx` (indices into `run.rows`),
/// with each row's ln1 scale frozen: `[rows][C + 1][head_dim]`, the constant part last.
fn raw_parts(
    model: &Model,
    run: &Tap,
    layer: usize,
    (parts, side): (&[Part], &Side),
    idx: &[usize],
) -> anyhow::Result<Vec<Vec<f64>>> {
    let (hd, dm) = (model.dims.head_dim, model.dims.d_model);
    let c = parts.len();
    let mut out = vec![vec![0f64; (c + 1) * hd]; idx.len()];
    let inv: Vec<f64> = idx.iter().map(|&r| 1.0 / run.ln_scale[r] as f64).collect();
    let project = |out: &mut [Vec<f64>], first: usize, vectors: &[Vec<f64>]| {
        out.par_iter_mut()
            .zip(vectors)
            .zip(&inv)
            .for_each(|((o, v), &inv)| {
                for (k, x) in v.chunks_exact(dm).enumerate() {
                    side.project(x, inv, &mut o[(first + k) * hd..][..hd]);
                }
            });
    };
    let embed: Vec<Vec<f64>> = idx
        .iter()
        .map(|&r| f64s(&run.embed[r * dm..][..dm]))
        .collect();
    project(&mut out, 0, &embed);
    let mut first = 1;
    for l in 0..layer {
        let vectors = layer_vectors(model, run, l, idx)?;
        let count = vectors[0].len() / dm;
        project(&mut out, first, &vectors);
        first += count;
    }
    debug_assert_eq!(first, c);
    for o in &mut out {
        o[c * hd..].copy_from_slice(&side.bias);
    }
    Ok(out)
}

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// Layer `l`'s components at the kept rows `idx`, as they enter the residual stream: per row
/// `[parts of l][d_model]` flattened, in [`parts_of`]'s order (each head, W_O's bias, the MLP).
/// Gemma's post-attention norm scales the heads' sum: each head's part is its share of it at
/// the row's frozen scale.
fn layer_vectors(
    model: &Model,
    run: &Tap,
    l: usize,
    idx: &[usize],
) -> anyhow::Result<Vec<Vec<f64>>> {
    let d = &model.dims;
    let (nh, dm, zw) = (d.n_heads, d.d_model, d.n_heads * d.head_dim);
    let m = idx.len();
    let z: Vec<f32> = idx
        .iter()
        .flat_map(|&r| run.z[l][r * zw..(r + 1) * zw].iter().copied())
        .collect();
    let heads = head_vectors(model, l, &z, m)?; // [m, nh, dm]
    let ob = model.output_bias(l)?;
    let post = model.post_norms(l)?.map(|(a, _)| a);
    let out = idx
        .iter()
        .enumerate()
        .map(|(k, &r)| {
            let mut v = f64s(&heads[k * nh * dm..(k + 1) * nh * dm]);
            if let Some(b) = ob {
                v.extend(b.iter().map(|&x| x as f64));
            }
            if let Some(w) = post {
                post_scale(&mut v, w, d.rms_eps as f64);
            }
            v.extend(run.mlp[l][r * dm..(r + 1) * dm].iter().map(|&x| x as f64));
            v
        })
        .collect();
    Ok(out)
}

/// Gemma's post-attention RMSNorm on the heads' parts `v` (`[parts][d_model]`, W_O's bias
/// included): each part times `w / rms(Σ parts)`, the scale of their sum frozen.
fn post_scale(v: &mut [f64], w: &[f32], eps: f64) {
    let dm = w.len();
    let mut whole = vec![0f64; dm];
    for part in v.chunks_exact(dm) {
        whole.iter_mut().zip(part).for_each(|(a, b)| *a += b);
    }
    let inv = 1.0 / (whole.iter().map(|x| x * x).sum::<f64>() / dm as f64 + eps).sqrt();
    for part in v.chunks_exact_mut(dm) {
        part.iter_mut()
            .zip(w)
            .for_each(|(x, &g)| *x *= g as f64 * inv);
    }
}

/// Each head's output of layer `l` through its columns of W_O, without the bias, for `m` rows of
/// `z` (`[m, n_heads·head_dim]`): `[m, n_heads, d_model]`. One product per head on W_O's own
/// columns where the projection allows it, else [`Model::head_results`].
fn head_vectors(model: &Model, l: usize, z: &[f32], m: usize) -> anyhow::Result<Vec<f32>> {
    let d = &model.dims;
    let (nh, hd, dm) = (d.n_heads, d.head_dim, d.d_model);
    let mut out = vec![0f32; m * nh * dm];
    for h in 0..nh {
        let zh: Vec<f32> = (0..m)
            .flat_map(|r| z[(r * nh + h) * hd..][..hd].iter().copied())
            .collect();
        let Some(y) = model.head_output_projection(l, h, &zh, m) else {
            return Ok(model.head_results(l, z, m)?.0);
        };
        for r in 0..m {
            out[(r * nh + h) * dm..][..dm].copy_from_slice(&y[r * dm..(r + 1) * dm]);
        }
    }
    Ok(out)
}

/// The key side: the key's parts, less the second key's or the mean of the visible keys' parts
/// (`rows[1..]`, in [`choose`]'s order).
fn key_side(mut rows: Vec<Vec<f64>>, c: &Choice) -> Vec<f64> {
    let rest = rows.split_off(1);
    let mut k = rows.pop().expect("the key's row");
    if c.against.is_none() {
        return k;
    }
    let n = rest.len() as f64;
    let mut mean = vec![0f64; k.len()];
    for r in &rest {
        mean.iter_mut().zip(r).for_each(|(m, x)| *m += x / n);
    }
    k.iter_mut().zip(&mean).for_each(|(k, m)| *k -= m);
    k
}

/// Every (query part · key part) term, largest |value| first (ties in component order).
fn terms(q: &[f64], k: &[f64], names: &[String], hd: usize) -> Vec<QkTerm> {
    let mut out: Vec<QkTerm> = q
        .chunks_exact(hd)
        .zip(names)
        .flat_map(|(qa, na)| {
            k.chunks_exact(hd).zip(names).map(move |(kb, nb)| QkTerm {
                query_side: na.clone(),
                key_side: nb.clone(),
                value: qa.iter().zip(kb).map(|(a, b)| a * b).sum(),
            })
        })
        .collect();
    out.sort_by(|a, b| b.value.abs().total_cmp(&a.value.abs()));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_side_against_the_mean_or_the_second_key() {
        let rows = vec![vec![3.0, 1.0], vec![1.0, 1.0], vec![2.0, 4.0]];
        let mut c = Choice {
            key: 0,
            key_score: 0.0,
            against: Some(Against::Mean),
            against_key: None,
            against_score: None,
            rows: vec![],
        };
        assert_eq!(key_side(rows.clone(), &c), vec![1.5, -1.5]);
        c.against = Some(Against::Second);
        assert_eq!(key_side(rows[..2].to_vec(), &c), vec![2.0, 0.0]);
        c.against = None;
        assert_eq!(key_side(rows[..1].to_vec(), &c), vec![3.0, 1.0]);
    }

    #[test]
    fn terms_are_every_pair_largest_first() {
        let names = vec!["a".to_string(), "b".to_string()];
        // q parts a = (1, 0), b = (0, 2); k parts a = (1, 1), b = (-3, 0)
        let t = terms(&[1.0, 0.0, 0.0, 2.0], &[1.0, 1.0, -3.0, 0.0], &names, 2);
        let got: Vec<(&str, &str, f64)> = t
            .iter()
            .map(|t| (t.query_side.as_str(), t.key_side.as_str(), t.value))
            .collect();
        assert_eq!(
            got,
            vec![
                ("a", "b", -3.0),
                ("b", "a", 2.0),
                ("a", "a", 1.0),
                ("b", "b", 0.0)
            ]
        );
    }

    #[test]
    fn against_parses() {
        assert_eq!("mean".parse::<Against>().unwrap(), Against::Mean);
        assert!("top"
            .parse::<Against>()
            .unwrap_err()
            .contains("second, mean"));
    }
}
