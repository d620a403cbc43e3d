//! The lesson's last chapter, measured: why attention replaced recurrent networks.
//!
//! Over n tokens x_1..x_n (width d), a toy RNN h_t = f(W h_{t-1} + U x_t) with y = h_n, against a
//! toy attention layer y = Σ_j α_nj W_V x_j with α_n = softmax(q_n · W_K x_j / √d), q_n = W_Q x_n.
//! For each n: the sequential steps (the RNN's n recurrences against one attention matmul), the path
//! between the first and the last token (n - 1 steps against 1), and ‖∂y/∂x_1‖_F, the gradient of
//! the last output with respect to the first input, computed exactly by the chain rule (f64):
//! - RNN: ∂h_n/∂x_1 = D_n W D_(n-1) W ... D_2 W D_1 U, D_t = diag(f'(a_t)); for a linear RNN
//!   (f = identity) with W = ρ·Q (Q orthogonal) this is ρ^(n-1) ‖U‖_F, the closed form it is tested
//!   against: the gradient decays geometrically through the recurrence;
//! - attention: ∂y/∂x_1 = α_n1 W_V + α_n1 (v_1 - y)(W_Kᵀ q_n)ᵀ / √d (x_1 ≠ x_n): one step, no
//!   product of n Jacobians.

use serde::Serialize;

/// Row-major d × d.
type Mat = Vec<f64>;

fn matmul(a: &[f64], b: &[f64], d: usize) -> Mat {
    let mut c = vec![0.0; d * d];
    for i in 0..d {
        for k in 0..d {
            let aik = a[i * d + k];
            for j in 0..d {
                c[i * d + j] += aik * b[k * d + j];
            }
        }
    }
    c
}

fn matvec(a: &[f64], x: &[f64], d: usize) -> Vec<f64> {
    (0..d)
        .map(|i| (0..d).map(|k| a[i * d + k] * x[k]).sum())
        .collect()
}

fn frobenius(a: &[f64]) -> f64 {
    a.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// An orthogonal d × d matrix (Gram-Schmidt on seeded normals).
fn orthogonal(d: usize, rng: &mut super::Rng) -> Mat {
    let mut q: Vec<Vec<f64>> = Vec::new();
    while q.len() < d {
        let mut v: Vec<f64> = (0..d).map(|_| rng.normal() as f64).collect();
        for u in &q {
            let dot: f64 = v.iter().zip(u).map(|(a, b)| a * b).sum();
            v.iter_mut().zip(u).for_each(|(a, b)| *a -= dot * b);
        }
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        if norm > 1e-6 {
            q.push(v.iter().map(|x| x / norm).collect());
        }
    }
    q.into_iter().flatten().collect()
}

/// The toy networks: width d, inputs for up to `max_n` tokens, all from one seed.
pub struct Toys {
    pub d: usize,
    pub rho: f64,
    w: Mat,
    u: Mat,
    wq: Mat,
    wk: Mat,
    wv: Mat,
    x: Vec<Vec<f64>>,
}

impl Toys {
    /// W = ρ·Q (Q orthogonal), U, W_Q, W_K, W_V with N(0, 1/d) entries, inputs N(0, 1).
    pub fn new(d: usize, rho: f64, max_n: usize, seed: u64) -> Self {
        let mut rng = super::Rng::new(seed);
        let w: Mat = orthogonal(d, &mut rng)
            .into_iter()
            .map(|x| x * rho)
            .collect();
        let mut m = || -> Mat {
            (0..d * d)
                .map(|_| rng.normal() as f64 / (d as f64).sqrt())
                .collect()
        };
        let (u, wq, wk, wv) = (m(), m(), m(), m());
        let x = (0..max_n)
            .map(|_| (0..d).map(|_| rng.normal() as f64).collect())
            .collect();
        Toys {
            d,
            rho,
            w,
            u,
            wq,
            wk,
            wv,
            x,
        }
    }

    /// ‖∂h_n/∂x_1‖_F of the RNN over the first n inputs, tanh (`linear` = false) or identity.
    pub fn rnn_gradient(&self, n: usize, linear: bool) -> f64 {
        let d = self.d;
        let mut h = vec![0.0; d];
        // J = ∂h_t/∂x_1, carried forward: J_1 = D_1 U, J_t = D_t W J_(t-1)
        let mut j: Mat = vec![0.0; d * d];
        for t in 0..n {
            let wh = matvec(&self.w, &h, d);
            let ux = matvec(&self.u, &self.x[t], d);
            let a: Vec<f64> = wh.iter().zip(&ux).map(|(p, q)| p + q).collect();
            h = if linear {
                a.clone()
            } else {
                a.iter().map(|v| v.tanh()).collect()
            };
            let deriv: Vec<f64> = if linear {
                vec![1.0; d]
            } else {
                h.iter().map(|v| 1.0 - v * v).collect()
            };
            let pre = if t == 0 {
                self.u.clone()
            } else {
                matmul(&self.w, &j, d)
            };
            j = (0..d * d).map(|k| deriv[k / d] * pre[k]).collect();
        }
        frobenius(&j)
    }

    /// The attention output at position n over the first n inputs, and ‖∂y/∂x_1‖_F.
    pub fn attention_gradient(&self, n: usize) -> (Vec<f64>, f64) {
        let d = self.d;
        let q = matvec(&self.wq, &self.x[n - 1], d);
        let ks: Vec<Vec<f64>> = (0..n).map(|j| matvec(&self.wk, &self.x[j], d)).collect();
        let vs: Vec<Vec<f64>> = (0..n).map(|j| matvec(&self.wv, &self.x[j], d)).collect();
        let s: Vec<f64> = ks
            .iter()
            .map(|k| q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt())
            .collect();
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = e.iter().sum();
        let alpha: Vec<f64> = e.iter().map(|x| x / z).collect();
        let y: Vec<f64> = (0..d)
            .map(|i| (0..n).map(|j| alpha[j] * vs[j][i]).sum())
            .collect();
        if n == 1 {
            // x_1 is also the query: not the question asked here
            return (y, f64::NAN);
        }
        // W_Kᵀ q / √d
        let g: Vec<f64> = (0..d)
            .map(|c| (0..d).map(|r| self.wk[r * d + c] * q[r]).sum::<f64>() / (d as f64).sqrt())
            .collect();
        let a1 = alpha[0];
        let jac: Mat = (0..d * d)
            .map(|k| a1 * self.wv[k] + a1 * (vs[0][k / d] - y[k / d]) * g[k % d])
            .collect();
        (y, frobenius(&jac))
    }

    /// The attention output at n with x_1 replaced (for the finite-difference check).
    pub fn attention_with_first(&self, n: usize, x1: &[f64]) -> Vec<f64> {
        let mut t = Toys {
            d: self.d,
            rho: self.rho,
            w: self.w.clone(),
            u: self.u.clone(),
            wq: self.wq.clone(),
            wk: self.wk.clone(),
            wv: self.wv.clone(),
            x: self.x.clone(),
        };
        t.x[0] = x1.to_vec();
        t.attention_gradient(n).0
    }

    /// ‖U‖_F, for the linear RNN's closed form ρ^(n-1)‖U‖_F.
    pub fn u_norm(&self) -> f64 {
        frobenius(&self.u)
    }
}

/// One row of the comparison.
#[derive(Clone, Debug, Serialize)]
pub struct RnnRow {
    pub n: usize,
    pub rnn_sequential_steps: usize,
    pub attention_sequential_steps: usize,
    pub rnn_path_length: usize,
    pub attention_path_length: usize,
    pub rnn_tanh_gradient: f64,
    pub rnn_linear_gradient: f64,
    pub rnn_linear_closed_form: f64,
    pub attention_gradient: f64,
}

/// The comparison for each n in `ns` (each ≥ 2).
pub fn compare(ns: &[usize], d: usize, rho: f64, seed: u64) -> Vec<RnnRow> {
    let toys = Toys::new(d, rho, ns.iter().copied().max().unwrap_or(2), seed);
    ns.iter()
        .map(|&n| RnnRow {
            n,
            rnn_sequential_steps: n,
            attention_sequential_steps: 1,
            rnn_path_length: n - 1,
            attention_path_length: 1,
            rnn_tanh_gradient: toys.rnn_gradient(n, false),
            rnn_linear_gradient: toys.rnn_gradient(n, true),
            rnn_linear_closed_form: rho.powi(n as i32 - 1) * toys.u_norm(),
            attention_gradient: toys.attention_gradient(n).1,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_rnn_gradient_is_the_closed_form() {
        for &(rho, n) in &[(0.9, 2usize), (0.9, 17), (0.5, 9), (1.0, 30)] {
            let t = Toys::new(6, rho, 40, 11);
            let got = t.rnn_gradient(n, true);
            let want = rho.powi(n as i32 - 1) * t.u_norm();
            assert!(
                (got / want - 1.0).abs() < 1e-9,
                "rho {rho} n {n}: {got} vs {want}"
            );
        }
        // and it really decays: 0.9^63 ≈ 1e-3
        let t = Toys::new(6, 0.9, 64, 11);
        assert!(t.rnn_gradient(64, true) < 2e-3 * t.u_norm());
    }

    #[test]
    fn attention_gradient_matches_finite_differences() {
        let t = Toys::new(5, 0.9, 12, 4);
        for n in [2, 7, 12] {
            let (y0, norm) = t.attention_gradient(n);
            // central differences of every input coordinate of x_1
            let mut fd = 0.0;
            for c in 0..5 {
                let (mut p, mut m) = (t.x[0].clone(), t.x[0].clone());
                p[c] += 1e-6;
                m[c] -= 1e-6;
                let (yp, ym) = (t.attention_with_first(n, &p), t.attention_with_first(n, &m));
                for i in 0..5 {
                    fd += ((yp[i] - ym[i]) / 2e-6).powi(2);
                }
            }
            assert!(
                (fd.sqrt() / norm - 1.0).abs() < 1e-5,
                "n {n}: finite differences {} vs {norm}",
                fd.sqrt()
            );
            assert_eq!(y0.len(), 5);
        }
    }

    #[test]
    fn the_tanh_rnn_gradient_vanishes_and_attention_does_not_decay_geometrically() {
        let rows = compare(&[4, 16, 64, 256], 8, 0.9, 7);
        assert!(rows[3].rnn_tanh_gradient < 1e-6 * rows[0].rnn_tanh_gradient);
        // attention's gradient shrinks at most like the 1/n of a spread-out softmax
        assert!(rows[3].attention_gradient > rows[0].attention_gradient / 256.0);
        assert_eq!(
            (rows[2].rnn_path_length, rows[2].attention_path_length),
            (63, 1)
        );
    }
}
