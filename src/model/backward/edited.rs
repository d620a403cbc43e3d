//! A forward in which every reader of the residual stream (each query head's q, each key/value
//! head's k and v, each MLP, the logits) can read its own input: what exact edge patching
//! (path patching, Wang et al. 2022; a circuit's evaluation, Hanna et al. 2024's
//! `evaluate_graph`) needs (issue #58). The forward is the backward's (`batch.rs`: plain f32
//! buffers, several sequences of one length stacked, the attention per sequence and head, the
//! engine's kernels), with the q|k|v projection computed per reader: each reader's input through
//! the layer's input norm and its own columns of `W_q|k|v` (held here as f32 panels, so a
//! slice of output columns is one product). A [`ReaderEdit`] sees the upstream nodes' outputs
//! as they are computed ([`super::branches`]) and says what each reader reads.

use super::layout::Shape;
use super::profile::Profile;
use super::readers::Reader;
use super::rowwise::norm_fwd;
use super::{Metric, Rules};
use crate::kernels::gemm::{self, Isa, PackedB};
use crate::model::error::{Error, Result};
use crate::model::Model;
use std::ops::Range;

/// What an edited forward asks and tells ([`EditedForward::run`]). Rows are every sequence's
/// rows stacked, `[batch·n, d_model]`.
pub trait ReaderEdit {
    /// The input to the first layer run.
    fn input(&mut self, x: &[f32]) -> Result<()>;
    /// Layer `layer`'s heads' outputs, `[n_heads][rows, d_model]` flat
    /// (`Model::head_outputs`).
    fn heads(&mut self, layer: usize, outs: &[f32]) -> Result<()>;
    /// Layer `layer`'s MLP output, `[rows, d_model]`.
    fn mlp(&mut self, layer: usize, out: &[f32]) -> Result<()>;
    /// What `reader` reads, given the residual stream `resid` there (the sum of the run's own
    /// upstream outputs): `false` to read `resid` itself, or `true` with its input written to
    /// `out` (every row: a row left as `resid` must be copied). Called for every reader in the
    /// forward's order (a layer's q heads, then its k and v heads, then its MLP; the logits
    /// last).
    fn read(&mut self, reader: Reader, resid: &[f32], out: &mut [f32]) -> Result<bool>;
    /// Layer `layer`'s q|k|v projection as the run computed it (`[rows, width]`, bias added, before
    /// the q/k norms and RoPE): what a later run's [`Prefix`] is made of.
    fn projected(&mut self, _layer: usize, _qkv: &[f32]) {}
}

/// The first `rows` positions of every sequence of a run, the same in all of them and computed
/// before: each layer's q|k|v projection there (`[rows, width]`, as [`ReaderEdit::projected`]
/// gave it). A run with a prefix computes only the later rows (the residual stream, the readers,
/// the projections, the MLPs), and the attention of those rows reads the prefix's keys and
/// values: exact edge patching where the clean and corrupted texts agree before their first
/// differing token.
pub struct Prefix<'a> {
    pub rows: usize,
    pub qkv: &'a [Vec<f32>],
}

/// The forward with a reader's own input ([`Model::edited_forward`]).
pub struct EditedForward<'m> {
    model: &'m Model,
    /// Each layer's `W_q|k|v` as f32 panels for `x · Wᵀ` (`[d_model, width]`), read back through
    /// the engine's kernel ([`crate::model::weights::Linear::weight_f32`]): the values it
    /// multiplies by.
    qkv: Vec<PackedB>,
}

impl Model {
    /// The edited forward of this model: packs each layer's `W_q|k|v` as f32 panels (the
    /// default model: 99 MB).
    pub fn edited_forward(&self) -> Result<EditedForward<'_>> {
        self.require_decoder("a forward with edited readers")?;
        let isa = Isa::detect();
        let qkv = self
            .weights
            .layers
            .iter()
            .map(|l| {
                let (w, k) = (l.qkv.weight_f32(), l.qkv.k);
                // the rows transposed 16 × 16 at a time into the panels
                match PackedB::try_from_row_source(
                    l.qkv.n,
                    k,
                    isa,
                    crate::kernels::rows_of(&w, k, k),
                ) {
                    Ok(p) => p,
                    Err(never) => match never {},
                }
            })
            .collect();
        Ok(EditedForward { model: self, qkv })
    }
}

impl<'m> EditedForward<'m> {
    /// The model it runs.
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// `batch` sequences of `n` rows each, from the residual stream entering layer `from` (`x`,
    /// `[batch·n, d_model]`; layer 0's input is [`Model::input_embeddings`]) to `metric` at each
    /// sequence's last row, every reader's input as `edit` says. The metric of each sequence.
    /// With a `prefix`, `x` and everything `edit` sees are each sequence's rows after it
    /// (`[batch·(n − prefix.rows), d_model]`).
    pub fn run(
        &self,
        x: &[f32],
        (n, batch): (usize, usize),
        (from, prefix): (usize, Option<&Prefix>),
        metric: Metric,
        edit: &mut dyn ReaderEdit,
    ) -> Result<Vec<f32>> {
        let model = self.model;
        let dm = model.dims.d_model;
        let p = prefix.map_or(0, |p| p.rows);
        let sized = prefix.is_none_or(|p| p.qkv.len() == model.dims.n_layers);
        if p >= n || !sized || batch == 0 || x.len() != (n - p) * batch * dm {
            return Err(super::bug(format!(
                "an edited forward of {} values as {batch} × {n} rows ({p} before) from layer {from}",
                x.len()
            )));
        }
        if from > model.dims.n_layers {
            return Err(super::bug(format!("an edited forward from layer {from}")));
        }
        let shape = Shape::of(model, (n, batch));
        let mut prof = Profile::default();
        let mut x = x.to_vec();
        edit.input(&x)?;
        for l in from..model.dims.n_layers {
            let prefix = prefix.map(|p| (p.rows, &p.qkv[l][..]));
            self.layer(l, &mut x, (shape, prefix), edit, &mut prof)?;
        }
        let mut buf = vec![0f32; x.len()];
        let last = if edit.read(Reader::Logits, &x, &mut buf)? {
            buf
        } else {
            x
        };
        let (_, seeds) =
            model.seeds_at_last_rows(&last, (n - p, batch), metric, Rules::Gradient, &mut prof)?;
        Ok(seeds.iter().map(|s| s.value).collect())
    }

    /// Layer `l` on the residual stream `x` (updated in place; the rows after the prefix, if
    /// any: its row count and this layer's q|k|v there): the readers' inputs, the attention, the
    /// heads' outputs, the MLP's input and output.
    fn layer(
        &self,
        l: usize,
        x: &mut Vec<f32>,
        (shape, prefix): (Shape, Option<(usize, &[f32])>),
        edit: &mut dyn ReaderEdit,
        prof: &mut Profile,
    ) -> Result<()> {
        let model = self.model;
        let layer = &model.weights.layers[l];
        let (n, batch) = (shape.n, shape.rows / shape.n);
        let p = prefix.map_or(0, |(p, _)| p);
        let later = Shape::of(model, (n - p, batch));
        let qkv = self.readers_qkv(l, x, later, edit)?;
        edit.projected(l, &qkv);
        let z = match prefix {
            None => {
                let (q, k, v) = model.split_qkv(layer, &qkv, shape);
                model.attention_forward(l, &q, &k, &v, n, batch)
            }
            Some((p, before)) => {
                // every sequence whole (the prefix's rows, then its own), its later rows kept
                let w = shape.width;
                let whole: Vec<f32> = qkv
                    .chunks(later.n * w)
                    .flat_map(|own| before[..p * w].iter().chain(own).copied())
                    .collect();
                let (q, k, v) = model.split_qkv(layer, &whole, shape);
                let z = model.attention_forward(l, &q, &k, &v, n, batch);
                let zw = z.len() / shape.rows;
                z.chunks(n * zw)
                    .flat_map(|seq| seq[p * zw..].iter().copied())
                    .collect()
            }
        };
        let (attn_proj, attn_out) = model.o_forward(layer, &z, later.rows, prof)?;
        edit.heads(l, &model.head_outputs(l, &z, &attn_proj))?;
        x.iter_mut().zip(&attn_out).for_each(|(a, b)| *a += b);
        let mut buf = vec![0f32; x.len()];
        let input = if edit.read(Reader::Mlp { layer: l }, x, &mut buf)? {
            &buf
        } else {
            &*x
        };
        let (_, _, mlp_out) = model.mlp_forward(layer, input, later.rows, prof)?;
        edit.mlp(l, &mlp_out)?;
        x.iter_mut().zip(&mlp_out).for_each(|(a, b)| *a += b);
        if !x.iter().all(|v| v.is_finite()) {
            return Err(Error::NonFinite {
                what: "the residual stream after the layer's MLP (edited readers)".into(),
                layer: Some(l),
            });
        }
        Ok(())
    }

    /// Layer `l`'s q|k|v projection (`[rows, width]`, bias added), each reader's columns from
    /// its own input through the layer's input norm: the columns of the readers that read the
    /// residual stream `x` as it is, from `x`'s norm in one product per run of them.
    fn readers_qkv(
        &self,
        l: usize,
        x: &[f32],
        shape: Shape,
        edit: &mut dyn ReaderEdit,
    ) -> Result<Vec<f32>> {
        let model = self.model;
        let layer = &model.weights.layers[l];
        let (dm, eps, width, rows) = (
            model.dims.d_model,
            model.dims.rms_eps,
            shape.width,
            shape.rows,
        );
        let b1 = layer.norm_biases.as_ref().map(|b| b.0.as_slice());
        let norm = |x: &[f32]| norm_fwd(layer.plan.norm, x, &layer.attn_norm, b1, eps);
        let w = &self.qkv[l];
        let mut out = vec![0f32; rows * width];
        let product = |h: &[f32], cols: Range<usize>, out: &mut [f32]| {
            let c = &mut out[cols.start..];
            gemm::gemm_sub(h, dm, rows, w, 0..dm, cols, c, width, false, true);
        };
        let mut plain: Vec<Range<usize>> = Vec::new();
        let mut buf = vec![0f32; x.len()];
        for (reader, cols) in reader_columns(model, l, shape) {
            if edit.read(reader, x, &mut buf)? {
                product(&norm(&buf), cols, &mut out);
            } else {
                match plain.last_mut() {
                    Some(run) if run.end == cols.start => run.end = cols.end,
                    _ => plain.push(cols),
                }
            }
        }
        if !plain.is_empty() {
            let h = norm(x);
            for cols in plain {
                product(&h, cols, &mut out);
            }
        }
        if let Some(b) = layer.qkv.bias() {
            for row in out.chunks_mut(width) {
                row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
            }
        }
        Ok(out)
    }
}

/// Layer `l`'s q|k|v readers in the forward's order, with their columns of a q|k|v row: each
/// query head's q, then each key/value head's k, then each one's v.
fn reader_columns(model: &Model, l: usize, shape: Shape) -> Vec<(Reader, Range<usize>)> {
    let (nh, nkv) = (model.dims.n_heads, model.dims.n_kv_heads);
    let Shape { hd, nq, nk, .. } = shape;
    let q = (0..nh).map(|h| (Reader::Q { layer: l, head: h }, h * hd..(h + 1) * hd));
    let k = (0..nkv).map(|g| {
        (
            Reader::K { layer: l, group: g },
            nq + g * hd..nq + (g + 1) * hd,
        )
    });
    let v = (0..nkv).map(|g| {
        let c0 = nq + nk + g * hd;
        (Reader::V { layer: l, group: g }, c0..c0 + hd)
    });
    q.chain(k).chain(v).collect()
}
