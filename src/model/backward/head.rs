//! The attention per head: its forward and backward with the probabilities recomputed a block of
//! query rows at a time (no `[n, n]` matrix held), and a layer's heads of a batch.

use super::Rules;
use crate::kernels::gemm::{self, Isa, PackedB};
use crate::model::attention::{dot_f64, max_row_sq, EXACT_SCORES_ABOVE};
use crate::model::Model;
use rayon::prelude::*;

/// Query rows per block of the attention's forward and backward.
pub(super) const QB: usize = 64;

/// One head's attention inputs, `[n, hd]` each, with its layer's score rules.
pub(super) struct Head<'a> {
    q: &'a [f32],
    pub(super) v: &'a [f32],
    n: usize,
    hd: usize,
    scale: f32,
    softcap: Option<f32>,
    window: Option<usize>,
    /// AttnLRP: the soft-cap by the identity rule (`cap(s)/s` instead of its derivative)
    lrp: bool,
    /// The head's keys (`[n, hd]`) when its layer's scores can be large: a row whose scores pass
    /// [`EXACT_SCORES_ABOVE`] is then computed again in f64 and shifted by its exact maximum
    /// before it is rounded, as the forward does ([`crate::model::attention`]'s `rescore_row`), so the
    /// backward differentiates the pattern the forward produced.
    precise_k: Option<&'a [f32]>,
}

/// A kv head's keys and values packed both ways (`Q·Kᵀ`, `dS·K`, `dZ·Vᵀ`, `P·V`).
pub(super) struct Packed4 {
    k_rows: PackedB,
    k_cols: PackedB,
    v_rows: PackedB,
    v_cols: PackedB,
}

impl Packed4 {
    fn new(k: &[f32], v: &[f32], n: usize, hd: usize) -> Packed4 {
        let isa = Isa::detect();
        Packed4 {
            k_rows: PackedB::from_rows(k, n, hd, hd, isa),
            k_cols: PackedB::from_cols(k, n, hd, hd, isa),
            v_rows: PackedB::from_rows(v, n, hd, hd, isa),
            v_cols: PackedB::from_cols(v, n, hd, hd, isa),
        }
    }
}

/// `a: [rows, cols]` transposed into `t` (`[cols, rows]`, every value written), 16 × 16 at a time
/// on AVX-512 ([`gemm::transpose_into_panel`] with a panel as wide as the rows): the scalar loop's
/// strided writes took 6.5% of a backward at 512 tokens.
fn transpose_into(a: &[f32], rows: usize, cols: usize, t: &mut Vec<f32>) {
    // no zeroing: the transpose writes every value
    t.resize(rows * cols, 0.0);
    gemm::transpose_into_panel(&a[..rows * cols], rows, cols, rows, t);
}

impl Head<'_> {
    /// Query rows `i0..i1`'s probabilities over keys `0..i1` into `p` (`[rows, i1]`), with the
    /// soft-cap's factor of each score in `th`: its derivative `1 − tanh²`, or for AttnLRP's
    /// identity rule `cap(s)/s`.
    pub(super) fn probs_block(
        &self,
        kp: &Packed4,
        i0: usize,
        i1: usize,
        p: &mut Vec<f32>,
        th: &mut Vec<f32>,
    ) {
        let (hd, rows, ld) = (self.hd, i1 - i0, i1);
        // no zeroing of p: the product below writes every value
        p.resize(rows * ld, 0.0);
        // the soft-cap's factors, only where the scores are capped or can be rescored
        th.clear();
        if self.softcap.is_some() || self.precise_k.is_some() {
            th.resize(rows * ld, 0.0);
        }
        gemm::gemm_sub(
            &self.q[i0 * hd..],
            hd,
            rows,
            &kp.k_rows,
            0..hd,
            0..ld,
            p,
            ld,
            false,
            false,
        );
        let mut factors = th.chunks_mut(ld);
        for (r, row) in p.chunks_mut(ld).enumerate() {
            let trow = factors.next().unwrap_or_default();
            let i = i0 + r;
            let lo = self.window.map_or(0, |w| (i + 1).saturating_sub(w));
            row[i + 1..].iter_mut().for_each(|s| *s = 0.0);
            row[..lo].iter_mut().for_each(|s| *s = 0.0);
            let live = &mut row[lo..=i];
            let scale = self.scale;
            live.iter_mut().for_each(|s| *s *= scale);
            if let Some(k) = self.precise_k {
                if live.iter().any(|s| s.abs() > EXACT_SCORES_ABOVE) {
                    self.rescore(k, i, lo, live, &mut trow[lo..=i]);
                    let (sum, _) = crate::model::attention::exp_shift_sums_masked(live, 0.0);
                    let inv = (1.0 / sum) as f32;
                    live.iter_mut().for_each(|s| *s *= inv);
                    continue;
                }
            }
            if let Some(c) = self.softcap {
                for (s, t) in live.iter_mut().zip(&mut trow[lo..=i]) {
                    let tanh = (*s / c).tanh();
                    let capped = tanh * c;
                    *t = match (self.lrp, *s == 0.0) {
                        (false, _) => 1.0 - tanh * tanh,
                        (true, false) => capped / *s,
                        (true, true) => 1.0,
                    };
                    *s = capped;
                }
            }
            let max = live.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let (sum, _) = crate::model::attention::exp_shift_sums_masked(live, max);
            let inv = (1.0 / sum) as f32;
            live.iter_mut().for_each(|s| *s *= inv);
        }
    }

    /// Query `i`'s visible scores `live` (keys `lo..=i`) computed again in f64 from the keys `k`
    /// (scaled, soft-capped in f64, the soft-cap's factor into `t`), shifted by their exact
    /// maximum and only then rounded to f32: the shift the softmax that follows needs is 0.
    fn rescore(&self, k: &[f32], i: usize, lo: usize, live: &mut [f32], t: &mut [f32]) {
        let hd = self.hd;
        let qi = &self.q[i * hd..(i + 1) * hd];
        let scale = self.scale as f64;
        let exact: Vec<(f64, f64)> = (lo..=i)
            .map(|j| {
                let s = dot_f64(qi, &k[j * hd..(j + 1) * hd]) * scale;
                match self.softcap {
                    Some(c) => {
                        let c = c as f64;
                        let tanh = (s / c).tanh();
                        let factor = match (self.lrp, s == 0.0) {
                            (false, _) => 1.0 - tanh * tanh,
                            (true, false) => tanh * c / s,
                            (true, true) => 1.0,
                        };
                        (tanh * c, factor)
                    }
                    None => (s, 1.0),
                }
            })
            .collect();
        let m = exact.iter().map(|e| e.0).fold(f64::NEG_INFINITY, f64::max);
        for ((o, f), (s, factor)) in live.iter_mut().zip(t).zip(exact) {
            *o = (s - m) as f32;
            *f = factor as f32;
        }
    }

    /// The head's output `z`, `[n, hd]`.
    fn forward(&self, kp: &Packed4) -> Vec<f32> {
        let (n, hd) = (self.n, self.hd);
        let mut z = vec![0f32; n * hd];
        let (mut p, mut th) = (Vec::new(), Vec::new());
        for i0 in (0..n).step_by(QB) {
            let i1 = (i0 + QB).min(n);
            self.probs_block(kp, i0, i1, &mut p, &mut th);
            gemm::gemm_sub(
                &p,
                i1,
                i1 - i0,
                &kp.v_cols,
                0..i1,
                0..hd,
                &mut z[i0 * hd..],
                hd,
                false,
                false,
            );
        }
        z
    }

    /// The head's backward from `dz` (`[n, hd]`): `(dq, dk, dv)`, `[n, hd]` each, and the last
    /// query row's pattern gradient `[n]`. The probabilities are recomputed a block of query
    /// rows at a time; no `[n, n]` matrix is held.
    pub(super) fn backward(
        &self,
        kp: &Packed4,
        dz: &[f32],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let (n, hd) = (self.n, self.hd);
        let isa = Isa::detect();
        let dpat = self.last_row_pattern_grad(&dz[(n - 1) * hd..]);
        let mut dq = vec![0f32; n * hd];
        let mut dk = vec![0f32; n * hd];
        let mut dv = vec![0f32; n * hd];
        let (mut p, mut th, mut dp, mut t) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for i0 in (0..n).step_by(QB) {
            let i1 = (i0 + QB).min(n);
            let (rows, ld) = (i1 - i0, i1);
            let dzb = &dz[i0 * hd..i1 * hd];
            // a block no gradient reaches adds nothing (the last layer's, but for its last row)
            if dzb.iter().all(|&g| g == 0.0) {
                continue;
            }
            self.probs_block(kp, i0, i1, &mut p, &mut th);
            // no zeroing: the product writes every value
            dp.resize(rows * ld, 0.0);
            gemm::gemm_sub(
                dzb,
                hd,
                rows,
                &kp.v_rows,
                0..hd,
                0..ld,
                &mut dp,
                ld,
                false,
                false,
            );
            // dV[0..i1] += Pᵀ · dZ
            transpose_into(&p, rows, ld, &mut t);
            let dzp = PackedB::from_cols(dzb, rows, hd, hd, isa);
            gemm::gemm_sub(&t, rows, ld, &dzp, 0..rows, 0..hd, &mut dv, hd, true, false);
            self.scores_grad_in_place(&p, &th, &mut dp, ld);
            gemm::gemm_sub(
                &dp,
                ld,
                rows,
                &kp.k_cols,
                0..ld,
                0..hd,
                &mut dq[i0 * hd..],
                hd,
                false,
                false,
            );
            transpose_into(&dp, rows, ld, &mut t);
            let qp = PackedB::from_cols(&self.q[i0 * hd..i1 * hd], rows, hd, hd, isa);
            gemm::gemm_sub(&t, rows, ld, &qp, 0..rows, 0..hd, &mut dk, hd, true, false);
        }
        (dq, dk, dv, dpat)
    }

    /// The last query row's pattern gradient `[n]` from its `∂/∂z` row `dzl` (`[hd]`):
    /// `dzl · vⱼ` for every key `j`.
    fn last_row_pattern_grad(&self, dzl: &[f32]) -> Vec<f32> {
        self.v
            .chunks(self.hd)
            .map(|vj| dzl.iter().zip(vj).map(|(a, b)| a * b).sum())
            .collect()
    }

    /// A block's `∂/∂pattern` `dp` (`[rows, ld]`) turned into `∂/∂scores` in place:
    /// `dS = P ⊙ (dP − Σ P·dP)`, through the soft-cap (its factors `th`) and the scale.
    #[inline]
    fn scores_grad_in_place(&self, p: &[f32], th: &[f32], dp: &mut [f32], ld: usize) {
        for (r, (prow, dprow)) in p.chunks(ld).zip(dp.chunks_mut(ld)).enumerate() {
            let pdp: f64 = prow
                .iter()
                .zip(dprow.iter())
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum();
            let pdp = pdp as f32;
            let scale = self.scale;
            match self.softcap {
                Some(_) => {
                    let trow = &th[r * ld..(r + 1) * ld];
                    for ((d, &pj), &t) in dprow.iter_mut().zip(prow).zip(trow) {
                        *d = pj * (*d - pdp) * t * scale;
                    }
                }
                None => {
                    for (d, &pj) in dprow.iter_mut().zip(prow) {
                        *d = pj * (*d - pdp) * scale;
                    }
                }
            }
        }
    }
}

impl Model {
    /// One layer's heads, `(heads, packed kv heads)`, of `batch` sequences of `n` tokens each
    /// (`batch` 1: one sequence's saved q and k, v): q `[nh, batch·n, hd]`, k and v
    /// `[nkv, batch·n, hd]` (sequence `b` of head `h` at rows `b·n..(b+1)·n` of the head), the
    /// heads in the order `b·nh + h`, the packed kv heads `b·nkv + g`. Each sequence decides on
    /// its own whether its scores can be large (as its forward alone would).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn heads_batch<'a>(
        &self,
        l: usize,
        q: &'a [f32],
        k: &'a [f32],
        v: &'a [f32],
        n: usize,
        batch: usize,
        rules: Rules,
    ) -> (Vec<Head<'a>>, Vec<Packed4>) {
        let (nh, nkv, hd) = (self.dims.n_heads, self.dims.n_kv_heads, self.dims.head_dim);
        let rows = batch * n;
        let plan = self.weights.layers[l].plan;
        let group = nh / nkv;
        // the forward's test for a layer whose scores can be large: max‖q‖·max‖k‖·scale
        // ([`crate::model::attention`]'s bound, on each sequence's rows of every head)
        let scale = plan.score_scale.unwrap_or(1.0 / (hd as f32).sqrt());
        let max_sq = |xs: &[f32], heads: usize, b: usize| {
            (0..heads)
                .map(|h| max_row_sq(&xs[(h * rows + b * n) * hd..][..n * hd], hd))
                .fold(0f64, f64::max)
        };
        let precise: Vec<bool> = (0..batch)
            .map(|b| {
                (max_sq(q, nh, b) * max_sq(k, nkv, b)).sqrt() * scale as f64
                    > EXACT_SCORES_ABOVE as f64
            })
            .collect();
        let at = |h: usize, b: usize| (h * rows + b * n) * hd..(h * rows + (b + 1) * n) * hd;
        let packed: Vec<Packed4> = (0..batch * nkv)
            .into_par_iter()
            .map(|bg| {
                let (b, g) = (bg / nkv, bg % nkv);
                Packed4::new(&k[at(g, b)], &v[at(g, b)], n, hd)
            })
            .collect();
        let heads = (0..batch * nh)
            .map(|bh| {
                let (b, h) = (bh / nh, bh % nh);
                let g = h / group;
                Head {
                    q: &q[at(h, b)],
                    v: &v[at(g, b)],
                    n,
                    hd,
                    scale,
                    softcap: plan.softcap,
                    window: plan.window,
                    lrp: rules == Rules::AttnLrp,
                    precise_k: precise[b].then(|| &k[at(g, b)]),
                }
            })
            .collect();
        (heads, packed)
    }

    /// One layer's attention output `z`, `[batch·n, nh·hd]`, every head of every sequence in
    /// parallel (q, k, v as [`Model::heads_batch`] takes them).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_forward(
        &self,
        l: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n: usize,
        batch: usize,
    ) -> Vec<f32> {
        let (nh, nkv, hd) = (self.dims.n_heads, self.dims.n_kv_heads, self.dims.head_dim);
        let group = nh / nkv;
        let (heads, packed) = self.heads_batch(l, q, k, v, n, batch, Rules::Gradient);
        let zs: Vec<Vec<f32>> = heads
            .par_iter()
            .enumerate()
            .map(|(bh, head)| head.forward(&packed[bh / nh * nkv + bh % nh / group]))
            .collect();
        let mut z = vec![0f32; batch * n * nh * hd];
        for (bh, zh) in zs.iter().enumerate() {
            let (b, h) = (bh / nh, bh % nh);
            for (i, row) in zh.chunks(hd).enumerate() {
                z[((b * n + i) * nh + h) * hd..][..hd].copy_from_slice(row);
            }
        }
        z
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The backward recomputes the pattern it differentiates; where scores are large (as in
    /// Qwen2.5's first layers) it must be the forward's rescored pattern, not f32's.
    #[test]
    fn large_scores_recomputed_as_the_forward_rescores_them() {
        let (n, d) = (40usize, 128usize);
        let mut rng = crate::reference::Rng::new(5);
        // every key and query near one large direction: scores ≈ 4,000, spread of a few units
        let u: Vec<f32> = rng.normals(d, 1.0);
        let big = |rng: &mut crate::reference::Rng, c: f32| -> Vec<f32> {
            let noise = rng.normals(n * d, 0.4);
            (0..n * d).map(|i| c * u[i % d] + noise[i]).collect()
        };
        let q = big(&mut rng, 8.0);
        let k = big(&mut rng, 40.0);
        let v = rng.normals(n * d, 1.0);
        let scale = 1.0 / (d as f32).sqrt();
        for window in [None, Some(9)] {
            let mut worst = [0f64; 2];
            for (c, precise) in [false, true].into_iter().enumerate() {
                let head = Head {
                    q: &q,
                    v: &v,
                    n,
                    hd: d,
                    scale,
                    softcap: None,
                    window,
                    lrp: false,
                    precise_k: precise.then_some(&k[..]),
                };
                let z = head.forward(&Packed4::new(&k, &v, n, d));
                let sees = |i: usize, j: usize| j <= i && window.is_none_or(|w| j + w > i);
                // one head: [n, d] is the reference's [q_len, n_heads·d]
                let want =
                    crate::reference::grouped_query_attention_f64(&q, &k, &v, (1, 1, d), sees);
                for (got, want) in z.iter().zip(&want.z) {
                    worst[c] = worst[c].max((*got as f64 - want).abs());
                }
                assert_eq!(z.len(), want.z.len());
                let largest = (0..n)
                    .flat_map(|i| (0..=i).map(move |j| (i, j)))
                    .map(|(i, j)| {
                        (dot_f64(&q[i * d..][..d], &k[j * d..][..d]) * scale as f64).abs()
                    })
                    .fold(0f64, f64::max);
                assert!(largest > 1000.0, "scores not large: {largest}");
            }
            assert!(
                worst[1] < 2e-6,
                "window {window:?}: rescored output {:.2e} from float64",
                worst[1]
            );
            // the check can fail: f32 scores of this size are visibly off
            assert!(
                worst[0] > 4.0 * worst[1],
                "window {window:?}: f32 {:.2e}, rescored {:.2e}",
                worst[0],
                worst[1]
            );
        }
    }
}
