//! Norm-based attention [Kobayashi et al. 2020, "Attention is not only a weight: analyzing
//! transformers with vector norms", arXiv:2004.10102].
//!
//! A weight αᵢⱼ says how much query i looks at key j, not how much key j changes query i's
//! residual stream. What head h actually adds to position i from key j is the vector
//! `αʰᵢⱼ · fₕ(xⱼ)`, with `fₕ(xⱼ) = W_Oʰ · vⱼ` (the key's value vector, bias included, through
//! head h's slice of the output projection; the output bias is the same for every key and is left
//! out). Its norm `αʰᵢⱼ · ‖fₕ(xⱼ)‖` is the per-head contribution; over a whole layer the
//! contribution of key j is `‖Σₕ αʰᵢⱼ · fₕ(xⱼ)‖` (Kobayashi's multi-head form, not an average of
//! norms: heads can cancel). A sink token usually gets a large α and has a small ‖f(x)‖.
//!
//! Every product runs through the model's own output projection (the packed GEMM the forward
//! uses), so the numbers are those of the loaded precision.

use crate::model::Model;
use crate::reference::kv_head;

/// One layer's value vectors (after the value projection and its bias), in either layout the
/// engine hands out: `hook_v`'s `[pos, kv_head, head_dim]` or the KV prefix's
/// `[kv_head, pos, head_dim]`.
#[derive(Clone, Copy, Debug)]
pub struct Values<'a> {
    data: &'a [f32],
    n: usize,
    n_kv: usize,
    head_dim: usize,
    pos_major: bool,
}

impl<'a> Values<'a> {
    /// `[pos, kv_head, head_dim]` (as `blocks.{l}.attn.hook_v`).
    pub fn pos_major(data: &'a [f32], n: usize, n_kv: usize, head_dim: usize) -> Self {
        assert_eq!(data.len(), n * n_kv * head_dim, "values: wrong length");
        Values {
            data,
            n,
            n_kv,
            head_dim,
            pos_major: true,
        }
    }

    /// `[kv_head, pos, head_dim]` (as kept for prefix reuse).
    pub fn head_major(data: &'a [f32], n: usize, n_kv: usize, head_dim: usize) -> Self {
        assert_eq!(data.len(), n * n_kv * head_dim, "values: wrong length");
        Values {
            data,
            n,
            n_kv,
            head_dim,
            pos_major: false,
        }
    }

    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The value vector of position `j` in KV set `g`.
    pub fn get(&self, j: usize, g: usize) -> &'a [f32] {
        let hd = self.head_dim;
        let at = if self.pos_major {
            (j * self.n_kv + g) * hd
        } else {
            (g * self.n + j) * hd
        };
        &self.data[at..at + hd]
    }
}

/// Rows per output-projection call: bounds the scratch at `ROWS × n_heads·head_dim` floats.
const ROWS: usize = 512;

/// `‖z_r · W_Oᵀ‖` for `m` rows `z_r` of `layer`, each written by `fill(r, row)` into a zeroed
/// `[n_heads·head_dim]` row.
fn projected_norms(
    model: &Model,
    layer: usize,
    m: usize,
    fill: impl Fn(usize, &mut [f32]),
) -> Vec<f32> {
    let d = &model.dims;
    let width = d.n_heads * d.head_dim;
    let mut out = Vec::with_capacity(m);
    let mut z = Vec::new();
    for r0 in (0..m).step_by(ROWS) {
        let rows = ROWS.min(m - r0);
        z.clear();
        z.resize(rows * width, 0.0);
        for (r, row) in z.chunks_mut(width).enumerate() {
            fill(r0 + r, row);
        }
        let y = model.output_projection(layer, &z, rows);
        out.extend(y.chunks(d.d_model).map(norm));
    }
    out
}

/// The Euclidean norm, summed in f64.
fn norm(v: &[f32]) -> f32 {
    v.iter()
        .map(|&x| (x as f64) * (x as f64))
        .sum::<f64>()
        .sqrt() as f32
}

/// `‖fₕ(xⱼ)‖ = ‖W_Oʰ vⱼ‖` for keys `0..keys` of each head in `heads` (`[heads.len()][keys]`): the
/// size of what head h would move from key j if it put all its weight there.
pub fn value_norms(
    model: &Model,
    layer: usize,
    v: &Values,
    heads: &[usize],
    keys: usize,
) -> Vec<Vec<f32>> {
    let (hd, group) = (model.dims.head_dim, model.dims.group_size());
    let keys = keys.min(v.len());
    // each head through its own columns of W_O (1/n_heads of the whole product, the same bits)
    let by_head: Option<Vec<Vec<f32>>> = heads
        .iter()
        .map(|&h| {
            let mut norms = Vec::with_capacity(keys);
            let mut z = Vec::with_capacity(ROWS.min(keys) * hd);
            for r0 in (0..keys).step_by(ROWS) {
                let rows = ROWS.min(keys - r0);
                z.clear();
                for j in r0..r0 + rows {
                    z.extend_from_slice(v.get(j, kv_head(h, group)));
                }
                let y = model.head_output_projection(layer, h, &z, rows)?;
                norms.extend(y.chunks(model.dims.d_model).map(norm));
            }
            Some(norms)
        })
        .collect();
    if let Some(v) = by_head {
        return v;
    }
    let flat = projected_norms(model, layer, heads.len() * keys, |r, row| {
        let (h, j) = (heads[r / keys], r % keys);
        row[h * hd..(h + 1) * hd].copy_from_slice(v.get(j, kv_head(h, group)));
    });
    flat.chunks(keys.max(1)).map(<[f32]>::to_vec).collect()
}

/// `‖Σₕ αʰⱼ · fₕ(xⱼ)‖` for keys `0..keys`: what key j moves into the query's residual stream
/// through the whole layer. `alphas[h]` is head h's attention row of the query (every head).
pub fn mixed_norms(
    model: &Model,
    layer: usize,
    v: &Values,
    alphas: &[&[f32]],
    keys: usize,
) -> Vec<f32> {
    let (hd, group) = (model.dims.head_dim, model.dims.group_size());
    assert_eq!(
        alphas.len(),
        model.dims.n_heads,
        "one attention row per head"
    );
    let keys = keys.min(v.len());
    projected_norms(model, layer, keys, |j, row| {
        for (h, a) in alphas.iter().enumerate() {
            let w = a[j];
            if w != 0.0 {
                let src = v.get(j, kv_head(h, group));
                row[h * hd..(h + 1) * hd]
                    .iter_mut()
                    .zip(src)
                    .for_each(|(z, &x)| *z = w * x);
            }
        }
    })
}

/// Each entry's share of the row's total (all zeros stay zeros).
pub fn shares(row: &[f32]) -> Vec<f32> {
    let total: f64 = row.iter().map(|&x| x as f64).sum();
    row.iter()
        .map(|&x| {
            if total > 0.0 {
                (x as f64 / total) as f32
            } else {
                0.0
            }
        })
        .collect()
}

/// `‖W_Oʰ vⱼ‖` for every head and every key of `layer`, `[heads, n]`, through each head's Gram
/// matrix `W_Oʰᵀ W_Oʰ` (head_dim × head_dim, read off the model's own output projection applied
/// to unit vectors): `‖W_Oʰ v‖² = vᵀ (W_Oʰᵀ W_Oʰ) v`. A long text then costs `n · heads ·
/// head_dim²` instead of one projection per (head, key). Same numbers as [`value_norms`] up to
/// rounding (and, at `--precision fast`, up to the 8-bit rounding of v that the projection does).
pub fn all_value_norms(model: &Model, layer: usize, v: &Values) -> Vec<f32> {
    use rayon::prelude::*;
    let d = &model.dims;
    let (nh, hd, dm, group) = (d.n_heads, d.head_dim, d.d_model, d.group_size());
    let width = nh * hd;
    let mut eye = vec![0f32; width * width];
    for i in 0..width {
        eye[i * width + i] = 1.0;
    }
    // row i: column i of W_O, [d_model]
    let cols = model.output_projection(layer, &eye, width);
    drop(eye);
    let n = v.len();
    let mut out = vec![0f32; nh * n];
    out.par_chunks_mut(n.max(1))
        .enumerate()
        .for_each(|(h, norms)| {
            let col = |a: usize| &cols[(h * hd + a) * dm..(h * hd + a + 1) * dm];
            let mut gram = vec![0f64; hd * hd];
            for a in 0..hd {
                for b in a..hd {
                    let g: f64 = col(a)
                        .iter()
                        .zip(col(b))
                        .map(|(&x, &y)| x as f64 * y as f64)
                        .sum();
                    gram[a * hd + b] = g;
                    gram[b * hd + a] = g;
                }
            }
            for (j, slot) in norms.iter_mut().enumerate() {
                let x = v.get(j, kv_head(h, group));
                let mut s = 0f64;
                for a in 0..hd {
                    let row = &gram[a * hd..(a + 1) * hd];
                    let gx: f64 = row.iter().zip(x).map(|(&g, &xb)| g * xb as f64).sum();
                    s += x[a] as f64 * gx;
                }
                *slot = s.max(0.0).sqrt() as f32;
            }
        });
    out
}
