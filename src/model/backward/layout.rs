//! The layout of one layer's rows in the forward that keeps what the backward needs and in the
//! backward itself (`Shape`, the q|k|v row walk, the gathered and scattered rows) and its RoPE
//! tables (`Rope`): what the batched forward (`batch`), the block backward (`block`), the
//! readers (`branches`) and the edited forward (`edited`) share, below them all.

use crate::model::config::RopeStyle;
use crate::model::ops::rotate;
use crate::model::weights::Layer;
use crate::model::Model;

/// The sizes of one layer's forward on `batch` stacked sequences of `n` rows.
#[derive(Clone, Copy)]
pub(super) struct Shape {
    pub(super) n: usize,
    pub(super) rows: usize,
    pub(super) hd: usize,
    /// the q columns (`n_heads·head_dim`) and the k (and v) columns of a row of q|k|v
    pub(super) nq: usize,
    pub(super) nk: usize,
    /// a row of q|k|v: `nq + 2·nk`
    pub(super) width: usize,
}

impl Shape {
    pub(super) fn of(model: &Model, (n, batch): (usize, usize)) -> Self {
        let dims = &model.dims;
        let hd = dims.head_dim;
        let (nq, nk) = (dims.n_heads * hd, dims.n_kv_heads * hd);
        Shape {
            n,
            rows: n * batch,
            hd,
            nq,
            nk,
            width: nq + 2 * nk,
        }
    }
}

/// One layer's RoPE tables for `n` positions (its base, the model's scaling and frequency
/// factors): the forward rotates by them, the backward by the opposite angles.
pub(super) struct Rope {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
    style: RopeStyle,
}

impl Rope {
    /// The tables of `layer` (`None` where it has no rotary positions).
    pub(super) fn of(model: &Model, layer: &Layer, n: usize) -> Option<Self> {
        let dims = &model.dims;
        layer.plan.rope_base().map(|base| {
            let mut inv = dims.rope_scaling.inv_freq(dims.rotary_dim, base);
            if let Some(f) = &model.weights.rope_freqs {
                inv.iter_mut().zip(f).for_each(|(x, f)| *x /= f);
            }
            let (cos, sin) = crate::model::ops::rope_tables_of(&inv, n);
            Rope {
                cos,
                sin,
                half: dims.rotary_dim / 2,
                style: model.weights.rope_style,
            }
        })
    }

    /// The rotation by the opposite angles (the backward's).
    pub(super) fn inverse(mut self) -> Self {
        self.sin.iter_mut().for_each(|v| *v = -*v);
        self
    }

    /// Rotates the head vector `v` as at position `pos`.
    #[inline]
    pub(super) fn rotate(&self, v: &mut [f32], pos: usize) {
        let half = self.half;
        rotate(
            &mut v[..2 * half],
            &self.cos[pos * half..][..half],
            &self.sin[pos * half..][..half],
            self.style,
        );
    }
}

/// Calls `f(at, head_at, pos)` for each of `heads` heads (from column `c0` of a q|k|v row) and
/// each row: `at`, where that head's values of the row start in the `[rows, width]` q|k|v
/// layout, `head_at` where in the `[heads, rows, hd]` one, and `pos` the row's position in its
/// sequence (RoPE's angle).
#[inline]
pub(super) fn for_each_head_row(
    shape: Shape,
    c0: usize,
    heads: usize,
    mut f: impl FnMut(usize, usize, usize),
) {
    let Shape {
        n, rows, hd, width, ..
    } = shape;
    for h in 0..heads {
        for r in 0..rows {
            f(r * width + c0 + h * hd, (h * rows + r) * hd, r % n);
        }
    }
}

/// Each sequence's last row among `batch` sequences of `n` rows, stacked.
pub(super) fn last_rows(n: usize, batch: usize) -> Vec<usize> {
    (0..batch).map(|b| b * n + n - 1).collect()
}

/// Rows `rows` of `a` (rows of `width` values), in that order.
pub(super) fn gather(a: &[f32], width: usize, rows: &[usize]) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * width);
    for &r in rows {
        out.extend_from_slice(&a[r * width..(r + 1) * width]);
    }
    out
}

/// `a`'s rows (of `width` values) written to rows `rows` of `into`.
pub(super) fn scatter(a: &[f32], width: usize, rows: &[usize], into: &mut [f32]) {
    for (src, &r) in a.chunks_exact(width).zip(rows) {
        into[r * width..(r + 1) * width].copy_from_slice(src);
    }
}
