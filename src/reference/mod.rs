//! Attention from scratch, on plain `&[f32]` slices: no tensor library, written to be read.
//!
//! This is the oracle of attnscope. Every faster path in the crate (the candle forward in
//! [`crate::model`], the streaming statistics) is tested against these loops, and
//! `attnscope explain` prints their intermediate values so a student can redo them on paper.
//!
//! Layout conventions (row-major everywhere):
//! - a sequence of vectors `[len, d]` is `len` rows of `d` numbers;
//! - a weight `W` of shape `[out, in]` maps `x` (in) to `W x` (out), as in PyTorch's `nn.Linear`.
//!
//! References: Vaswani et al. 2017, "Attention Is All You Need" (scaled dot-product attention,
//! eq. 1; multi-head attention, §3.2.2); Ainslie et al. 2023, "GQA" (grouped-query attention).

// the `explain` lesson's toys and the tests' whole-model oracle: used by the binary and the
// tests, outside the documented surface
#[doc(hidden)]
pub mod rnn;
#[doc(hidden)]
pub mod transformer;
#[doc(hidden)]
pub mod walkthrough;

/// Which keys a query may look at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mask {
    /// Every query sees every key (an encoder).
    None,
    /// Query `i` sees keys `j <= i + offset` (a decoder; `offset` = number of cached keys before
    /// the first query, 0 for a whole sentence at once).
    Causal {
        /// the number of cached keys before the first query
        offset: usize,
    },
    /// Causal, and query `i` sees only the `window` keys up to itself: `i + offset - window < j`
    /// (Mistral's and Gemma's sliding window, transformers' rule).
    Sliding {
        /// the number of cached keys before the first query
        offset: usize,
        /// how many keys, up to and including its own position, a query sees
        window: usize,
    },
}

impl Mask {
    /// Whether query `i` may attend to key `j`.
    pub fn allows(&self, i: usize, j: usize) -> bool {
        match *self {
            Mask::None => true,
            Mask::Causal { offset } => j <= i + offset,
            Mask::Sliding { offset, window } => j <= i + offset && j + window > i + offset,
        }
    }
}

/// The query head → key/value head rule of grouped-query attention: query heads are split into
/// `n_kv_heads` consecutive groups of `group_size = n_heads / n_kv_heads` heads, and group `g`
/// reads key/value set `g`. Same as llama2.c `h / kv_mul` and candle's `repeat_kv`.
pub fn kv_head(head: usize, group_size: usize) -> usize {
    head / group_size
}

/// `a · b`.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `y += alpha * x`.
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

/// Softmax over one row, in place. Subtracting the row maximum first keeps `exp` from
/// overflowing and changes nothing mathematically; `-inf` entries become exactly 0.
/// A row that is entirely `-inf` (a query that may see no key) becomes all zeros.
pub fn softmax_in_place(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        row.iter_mut().for_each(|x| *x = 0.0);
        return;
    }
    let mut sum = 0.0f32;
    for x in row.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    for x in row.iter_mut() {
        *x /= sum;
    }
}

/// `y = W x` for `W: [out, in]` (row-major) and `x: [in]`.
pub fn matvec(w: &[f32], x: &[f32], out: usize) -> Vec<f32> {
    let inp = x.len();
    debug_assert_eq!(w.len(), out * inp);
    (0..out).map(|o| dot(&w[o * inp..][..inp], x)).collect()
}

/// Applies `W: [out, in]` to every row of `xs: [len, in]`, giving `[len, out]`.
pub fn linear(xs: &[f32], w: &[f32], inp: usize, out: usize) -> Vec<f32> {
    xs.chunks(inp).flat_map(|x| matvec(w, x, out)).collect()
}

/// Everything one head computes, kept so it can be shown step by step.
#[derive(Clone, Debug)]
pub struct HeadSteps {
    /// `Q Kᵀ`, `[q_len, k_len]`.
    pub raw_scores: Vec<f32>,
    /// `Q Kᵀ / √d`.
    pub scaled_scores: Vec<f32>,
    /// scaled scores with masked keys set to `-inf` (TransformerLens `hook_attn_scores`).
    pub masked_scores: Vec<f32>,
    /// softmax of each row (TransformerLens `hook_pattern`); rows sum to 1.
    pub pattern: Vec<f32>,
    /// `pattern · V`, `[q_len, d]` (TransformerLens `hook_z` for this head).
    pub out: Vec<f32>,
}

/// Attention for one head, written to be read. `q: [q_len, d]`, `k, v: [k_len, d]`.
/// Returns every intermediate (see [`HeadSteps`]).
pub fn attend_head_steps(q: &[f32], k: &[f32], v: &[f32], d: usize, mask: Mask) -> HeadSteps {
    let (q_len, k_len) = (q.len() / d, k.len() / d);
    let scale = 1.0 / (d as f32).sqrt();
    let mut raw = vec![0.0; q_len * k_len];
    let mut scaled = vec![0.0; q_len * k_len];
    let mut masked = vec![0.0; q_len * k_len];
    let mut pattern = vec![0.0; q_len * k_len];
    let mut out = vec![0.0; q_len * d];
    for i in 0..q_len {
        let qi = &q[i * d..][..d];
        for j in 0..k_len {
            // pass 1: the score of key j for query i is q_i·k_j, scaled by 1/√d so its spread
            // does not grow with d (the dot of two d-dim unit-variance vectors has variance d)
            let s = dot(qi, &k[j * d..][..d]);
            raw[i * k_len + j] = s;
            scaled[i * k_len + j] = s * scale;
            // pass 2: the causal mask hides future keys with -inf, so softmax gives them 0
            masked[i * k_len + j] = if mask.allows(i, j) {
                s * scale
            } else {
                f32::NEG_INFINITY
            };
        }
        // pass 3: softmax turns the row of scores into weights that sum to 1
        let row = &mut pattern[i * k_len..][..k_len];
        row.copy_from_slice(&masked[i * k_len..][..k_len]);
        softmax_in_place(row);
        // pass 4: the output is the weighted sum of the value vectors
        for j in 0..k_len {
            axpy(row[j], &v[j * d..][..d], &mut out[i * d..][..d]);
        }
    }
    HeadSteps {
        raw_scores: raw,
        scaled_scores: scaled,
        masked_scores: masked,
        pattern,
        out,
    }
}

/// Attention for one head: `(out [q_len, d], pattern [q_len, k_len])`.
pub fn attend_head(q: &[f32], k: &[f32], v: &[f32], d: usize, mask: Mask) -> (Vec<f32>, Vec<f32>) {
    let s = attend_head_steps(q, k, v, d, mask);
    (s.out, s.pattern)
}

/// Takes the columns of head `h` out of `[len, n_heads * d]` into `[len, d]`.
pub fn head_slice(xs: &[f32], h: usize, n_heads: usize, d: usize) -> Vec<f32> {
    xs.chunks(n_heads * d)
        .flat_map(|row| row[h * d..][..d].iter().copied())
        .collect()
}

/// Result of a multi-head / grouped-query attention layer.
#[derive(Clone, Debug)]
pub struct MultiHeadOut {
    /// concatenated head outputs `[q_len, n_heads * d]` (before the output projection).
    pub z: Vec<f32>,
    /// `[n_heads, q_len, k_len]`.
    pub pattern: Vec<f32>,
}

/// Grouped-query attention on already projected `q: [q_len, n_heads*d]`,
/// `k, v: [k_len, n_kv_heads*d]`. Query head `h` reads K/V set [`kv_head`]`(h, n_heads/n_kv_heads)`.
/// With `n_kv_heads == n_heads` this is plain multi-head attention.
pub fn grouped_query_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_heads: usize,
    n_kv_heads: usize,
    d: usize,
    mask: Mask,
) -> MultiHeadOut {
    assert!(
        n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads),
        "n_heads must be a multiple of n_kv_heads"
    );
    let group_size = n_heads / n_kv_heads;
    let (q_len, k_len) = (q.len() / (n_heads * d), k.len() / (n_kv_heads * d));
    let mut z = vec![0.0; q_len * n_heads * d];
    let mut pattern = Vec::with_capacity(n_heads * q_len * k_len);
    for h in 0..n_heads {
        let g = kv_head(h, group_size);
        let (out, p) = attend_head(
            &head_slice(q, h, n_heads, d),
            &head_slice(k, g, n_kv_heads, d),
            &head_slice(v, g, n_kv_heads, d),
            d,
            mask,
        );
        // concatenate: head h's output fills columns h*d..(h+1)*d
        for i in 0..q_len {
            z[i * n_heads * d + h * d..][..d].copy_from_slice(&out[i * d..][..d]);
        }
        pattern.extend(p);
    }
    MultiHeadOut { z, pattern }
}

/// [`grouped_query_attention`] in f64, the oracle where f32 itself is too coarse (scores in the
/// thousands that differ by a few units): every product of two f32 is exact in f64, the scores
/// are `q·k / √d` summed in f64, and the softmax and `pattern · V` stay in f64, so what is left
/// is f64's own rounding (~1e-16 relative). Same layout (`q: [q_len, n_heads*d]`,
/// `k, v: [k_len, n_kv_heads*d]`); `allows(i, j)` says whether query `i` sees key `j` (a
/// [`Mask`]'s [`Mask::allows`], or a rule that also knocks keys out). A query that sees no key
/// gets a row of zeros, as in [`softmax_in_place`].
pub fn grouped_query_attention_f64(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (n_heads, n_kv_heads, d): (usize, usize, usize),
    allows: impl Fn(usize, usize) -> bool,
) -> MultiHeadOut64 {
    assert!(
        n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads),
        "n_heads must be a multiple of n_kv_heads"
    );
    let group_size = n_heads / n_kv_heads;
    let (q_len, k_len) = (q.len() / (n_heads * d), k.len() / (n_kv_heads * d));
    let scale = 1.0 / (d as f64).sqrt();
    let mut z = vec![0.0; q_len * n_heads * d];
    let mut pattern = vec![0.0; n_heads * q_len * k_len];
    for h in 0..n_heads {
        let g = kv_head(h, group_size);
        for i in 0..q_len {
            let qi = &q[(i * n_heads + h) * d..][..d];
            // pass 1: the scaled scores in f64, -inf where the query may not look
            let scores: Vec<f64> = (0..k_len)
                .map(|j| {
                    if !allows(i, j) {
                        return f64::NEG_INFINITY;
                    }
                    let kj = &k[(j * n_kv_heads + g) * d..][..d];
                    qi.iter()
                        .zip(kj)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                        * scale
                })
                .collect();
            // pass 2: softmax, shifted by the row's maximum
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            if max == f64::NEG_INFINITY {
                continue;
            }
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            let row = &mut pattern[(h * q_len + i) * k_len..][..k_len];
            // pass 3: the weights, and the weighted sum of the value vectors
            let out = &mut z[(i * n_heads + h) * d..][..d];
            for (j, (p, e)) in row.iter_mut().zip(&e).enumerate() {
                *p = e / sum;
                let vj = &v[(j * n_kv_heads + g) * d..][..d];
                out.iter_mut()
                    .zip(vj)
                    .for_each(|(o, &x)| *o += *p * x as f64);
            }
        }
    }
    MultiHeadOut64 { z, pattern }
}

/// [`grouped_query_attention_f64`]'s result: [`MultiHeadOut`]'s shapes, in f64.
#[derive(Clone, Debug)]
pub struct MultiHeadOut64 {
    /// `[q_len, n_heads * d]`
    pub z: Vec<f64>,
    /// `[n_heads, q_len, k_len]`
    pub pattern: Vec<f64>,
}

/// `[n_heads, len, d]` (the fast kernel's heads-first layout) as `[len, n_heads * d]` (the
/// reference's).
pub fn heads_to_rows(xs: &[f32], n_heads: usize, d: usize) -> Vec<f32> {
    let len = xs.len() / (n_heads * d);
    (0..len)
        .flat_map(|i| (0..n_heads).flat_map(move |h| &xs[(h * len + i) * d..][..d]))
        .copied()
        .collect()
}

/// Repeats every K/V head `group_size` times: `[len, n_kv*d]` → `[len, n_kv*group_size*d]`,
/// so that grouped-query attention can be run as ordinary multi-head attention.
pub fn repeat_kv(xs: &[f32], n_kv_heads: usize, group_size: usize, d: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(xs.len() * group_size);
    for row in xs.chunks(n_kv_heads * d) {
        for g in 0..n_kv_heads {
            for _ in 0..group_size {
                out.extend_from_slice(&row[g * d..][..d]);
            }
        }
    }
    out
}

/// Weights of one multi-head attention layer, `[out, in]` each.
#[derive(Clone, Debug)]
pub struct AttnWeights {
    /// the query projection, `[n_heads·head_dim, d_model]`
    pub w_q: Vec<f32>,
    /// the key projection, `[n_kv_heads·head_dim, d_model]`
    pub w_k: Vec<f32>,
    /// the value projection, `[n_kv_heads·head_dim, d_model]`
    pub w_v: Vec<f32>,
    /// the output projection, `[d_model, n_heads·head_dim]`
    pub w_o: Vec<f32>,
    /// the width of the residual stream
    pub d_model: usize,
    /// the number of query heads
    pub n_heads: usize,
    /// the number of key/value heads (`n_heads` for multi-head attention, fewer for GQA)
    pub n_kv_heads: usize,
    /// the width of one head
    pub head_dim: usize,
}

/// A whole attention layer on `x: [len, d_model]`: project to Q, K, V, split the width into heads,
/// attend per head (sharing K/V sets for GQA), concatenate, output projection.
pub fn multi_head_attention(x: &[f32], w: &AttnWeights, mask: Mask) -> (Vec<f32>, MultiHeadOut) {
    let (dm, hd) = (w.d_model, w.head_dim);
    let q = linear(x, &w.w_q, dm, w.n_heads * hd);
    let k = linear(x, &w.w_k, dm, w.n_kv_heads * hd);
    let v = linear(x, &w.w_v, dm, w.n_kv_heads * hd);
    let mh = grouped_query_attention(&q, &k, &v, w.n_heads, w.n_kv_heads, hd, mask);
    let y = linear(&mh.z, &w.w_o, w.n_heads * hd, dm);
    (y, mh)
}

/// Shannon entropy of a probability row, in nats (`0·ln 0 = 0`).
pub fn entropy(row: &[f32]) -> f32 {
    -row.iter()
        .filter(|&&p| p > 0.0)
        .map(|&p| p * p.ln())
        .sum::<f32>()
}

/// A small, seeded, dependency-free random number generator (SplitMix64), so that `explain`,
/// the tests, the tiny models and `generate`'s sampling (`--seed`) are identical on every machine.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator whose sequence `seed` fixes.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
    /// Integer uniform in `lo..=hi`.
    pub fn int(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as i64
    }
    /// `n` normals scaled by `std`.
    pub fn normals(&mut self, n: usize, std: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * std).collect()
    }
}

/// Max weight and entropy of attention over `n_keys` random keys, averaged over `trials`
/// queries, for head dimension `d`, with (`scaled = true`) or without the `1/√d`.
/// q and k entries are independent N(0, 1), as after a normalised projection.
pub fn saturation(d: usize, n_keys: usize, trials: usize, scaled: bool, seed: u64) -> (f32, f32) {
    let mut rng = Rng::new(seed);
    let (mut max_sum, mut ent_sum) = (0.0f64, 0.0f64);
    for _ in 0..trials {
        let q = rng.normals(d, 1.0);
        let k = rng.normals(n_keys * d, 1.0);
        let scale = if scaled { 1.0 / (d as f32).sqrt() } else { 1.0 };
        let mut row: Vec<f32> = k.chunks(d).map(|kj| dot(&q, kj) * scale).collect();
        softmax_in_place(&mut row);
        max_sum += row.iter().copied().fold(0.0, f32::max) as f64;
        ent_sum += entropy(&row) as f64;
    }
    (
        (max_sum / trials as f64) as f32,
        (ent_sum / trials as f64) as f32,
    )
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn assert_close(got: &[f32], want: &[f32], tol: f32, label: &str) {
        assert_eq!(
            got.len(),
            want.len(),
            "{label}: length {} != {}",
            got.len(),
            want.len()
        );
        let (mut worst, mut at) = (0.0f32, 0);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let diff = if g == w { 0.0 } else { (g - w).abs() };
            if diff.is_nan() || diff > worst {
                worst = if diff.is_nan() { f32::INFINITY } else { diff };
                at = i;
            }
        }
        assert!(
            worst <= tol,
            "{label}: max diff {worst:.6e} > tol {tol:.6e} at index {at} (got {}, want {})",
            got[at],
            want[at]
        );
    }

    /// A 3-token, d = 2 example worked by hand (the numbers are in the comments).
    #[test]
    fn hand_worked_three_tokens() {
        // q = k: [1,0], [0,1], [1,1]; v: [1,2], [3,4], [5,6]; d = 2, scale 1/√2.
        let q = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        let k = q;
        let v = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let s = attend_head_steps(&q, &k, &v, 2, Mask::Causal { offset: 0 });
        // raw QKᵀ = [[1,0,1],[0,1,1],[1,1,2]]
        assert_eq!(
            s.raw_scores,
            vec![1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 2.0]
        );
        // row 0 sees only key 0 → weight 1; output = v0
        assert_eq!(&s.pattern[0..3], &[1.0, 0.0, 0.0]);
        // row 1: scores [0, 1/√2] → softmax = [1/(1+e^0.7071), e^0.7071/(1+e^0.7071)] = [0.33024, 0.66976]
        assert_close(
            &s.pattern[3..6],
            &[0.330_238, 0.669_762, 0.0],
            1e-6,
            "row 1",
        );
        // row 2: scores [1,1,2]/√2 = [0.7071, 0.7071, 1.4142] → e^x = [2.0281, 2.0281, 4.1133]
        // sum 8.1695 → [0.24825, 0.24825, 0.50350]
        assert_close(
            &s.pattern[6..9],
            &[0.248_256, 0.248_256, 0.503_488],
            1e-5,
            "row 2",
        );
        // out row 1 = 0.33024·[1,2] + 0.66976·[3,4] = [2.33952, 3.33952]
        assert_close(&s.out[2..4], &[2.339_524, 3.339_524], 1e-5, "out row 1");
        // out row 2 = 0.24826·[1,2] + 0.24826·[3,4] + 0.50349·[5,6]
        assert_close(&s.out[4..6], &[3.510_464, 4.510_464], 1e-4, "out row 2");
        // masked future scores are -inf and their weights exactly 0
        assert_eq!(s.masked_scores[1], f32::NEG_INFINITY);
        assert_eq!(s.pattern[5], 0.0);
    }

    fn random_case(
        rng: &mut Rng,
        q_len: usize,
        k_len: usize,
        n_heads: usize,
        n_kv: usize,
        d: usize,
    ) -> [Vec<f32>; 3] {
        [
            rng.normals(q_len * n_heads * d, 1.0),
            rng.normals(k_len * n_kv * d, 1.0),
            rng.normals(k_len * n_kv * d, 1.0),
        ]
    }

    #[test]
    fn rows_sum_to_one_and_mask_is_exactly_zero() {
        let mut rng = Rng::new(7);
        for &(q_len, offset) in &[(1usize, 0usize), (5, 0), (4, 3), (9, 0)] {
            let k_len = q_len + offset;
            let [q, k, v] = random_case(&mut rng, q_len, k_len, 4, 2, 8);
            let out = grouped_query_attention(&q, &k, &v, 4, 2, 8, Mask::Causal { offset });
            for (r, row) in out.pattern.chunks(k_len).enumerate() {
                let i = r % q_len;
                let sum: f32 = row.iter().sum();
                assert!((sum - 1.0).abs() < 1e-6, "row {r} sums to {sum}");
                for (j, &w) in row.iter().enumerate() {
                    if j > i + offset {
                        assert_eq!(w, 0.0, "masked weight at ({i},{j})");
                    } else {
                        assert!(w > 0.0);
                    }
                }
            }
        }
    }

    #[test]
    fn gqa_equals_mha_with_repeated_kv() {
        let mut rng = Rng::new(11);
        for &(n_heads, n_kv) in &[(4usize, 2usize), (14, 2), (9, 3), (6, 1), (4, 4)] {
            let (len, d) = (6, 8);
            let [q, k, v] = random_case(&mut rng, len, len, n_heads, n_kv, d);
            let gqa =
                grouped_query_attention(&q, &k, &v, n_heads, n_kv, d, Mask::Causal { offset: 0 });
            let group = n_heads / n_kv;
            let (kr, vr) = (repeat_kv(&k, n_kv, group, d), repeat_kv(&v, n_kv, group, d));
            let mha = grouped_query_attention(
                &q,
                &kr,
                &vr,
                n_heads,
                n_heads,
                d,
                Mask::Causal { offset: 0 },
            );
            assert_eq!(gqa.pattern, mha.pattern, "pattern {n_heads}/{n_kv}");
            assert_eq!(gqa.z, mha.z, "z {n_heads}/{n_kv}");
        }
    }

    /// The f64 mode against the f32 reference (GQA, a prefix, a sliding window, an all-masked
    /// row) and the hand-worked row 1 of [`hand_worked_three_tokens`] to f64's precision.
    #[test]
    fn f64_mode_agrees_with_the_f32_reference() {
        let mut rng = Rng::new(13);
        let masks = [
            Mask::Causal { offset: 0 },
            Mask::Causal { offset: 3 },
            Mask::Sliding {
                offset: 2,
                window: 3,
            },
            Mask::None,
        ];
        for mask in masks {
            let (q_len, n_heads, n_kv, d) = (5, 6, 2, 8);
            let k_len = q_len + 3;
            let [q, k, v] = random_case(&mut rng, q_len, k_len, n_heads, n_kv, d);
            let f32s = grouped_query_attention(&q, &k, &v, n_heads, n_kv, d, mask);
            let f64s = grouped_query_attention_f64(&q, &k, &v, (n_heads, n_kv, d), |i, j| {
                mask.allows(i, j)
            });
            let narrow = |xs: &[f64]| xs.iter().map(|&x| x as f32).collect::<Vec<_>>();
            assert_close(&narrow(&f64s.pattern), &f32s.pattern, 1e-6, "pattern");
            assert_close(&narrow(&f64s.z), &f32s.z, 1e-5, "z");
        }
        // a query that may see nothing: zeros, as softmax_in_place gives
        let [q, k, v] = random_case(&mut rng, 2, 2, 1, 1, 4);
        let none = grouped_query_attention_f64(&q, &k, &v, (1, 1, 4), |_, _| false);
        assert!(none.pattern.iter().chain(&none.z).all(|&x| x == 0.0));
        // hand-worked: row 1 sees scores [0, 1/√2] → [1/(1+e^{1/√2}), e^{1/√2}/(1+e^{1/√2})]
        let q = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        let v = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let r = grouped_query_attention_f64(&q, &q, &v, (1, 1, 2), |i, j| j <= i);
        let e = std::f64::consts::FRAC_1_SQRT_2.exp();
        let (p0, p1) = (1.0 / (1.0 + e), e / (1.0 + e));
        assert!((r.pattern[3] - p0).abs() < 1e-15 && (r.pattern[4] - p1).abs() < 1e-15);
        assert!((r.z[2] - (p0 + 3.0 * p1)).abs() < 1e-14);
        assert!((r.z[3] - (2.0 * p0 + 4.0 * p1)).abs() < 1e-14);
        // the kernel's heads-first layout as rows
        assert_eq!(
            heads_to_rows(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], 2, 2),
            vec![1.0, 2.0, 5.0, 6.0, 3.0, 4.0, 7.0, 8.0]
        );
    }

    #[test]
    fn kv_head_rule_for_qwen() {
        // Qwen2.5-0.5B: 14 query heads, 2 KV sets → heads 0..=6 use set 0, 7..=13 set 1.
        let sets: Vec<usize> = (0..14).map(|h| kv_head(h, 7)).collect();
        assert_eq!(sets, vec![0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]);
    }

    #[test]
    fn softmax_is_stable_and_handles_all_masked_rows() {
        let mut row = [1000.0, 1000.0, f32::NEG_INFINITY];
        softmax_in_place(&mut row);
        assert_eq!(row, [0.5, 0.5, 0.0]);
        let mut dead = [f32::NEG_INFINITY; 3];
        softmax_in_place(&mut dead);
        assert_eq!(dead, [0.0; 3]);
    }

    #[test]
    fn entropy_of_uniform_is_ln_n() {
        let row = vec![0.25f32; 4];
        assert!((entropy(&row) - 4f32.ln()).abs() < 1e-6);
        assert_eq!(entropy(&[1.0, 0.0]), 0.0);
    }

    /// Without 1/√d the scores' spread grows like √d, so softmax saturates (one key takes
    /// nearly all the weight, entropy collapses); with it the distribution stays the same.
    #[test]
    fn scaling_prevents_saturation() {
        let n = 16;
        let scaled: Vec<(f32, f32)> = [4, 64, 1024]
            .iter()
            .map(|&d| saturation(d, n, 200, true, 1))
            .collect();
        let unscaled: Vec<(f32, f32)> = [4, 64, 1024]
            .iter()
            .map(|&d| saturation(d, n, 200, false, 1))
            .collect();
        // unscaled: max weight climbs toward 1 and entropy toward 0 as d grows
        assert!(
            unscaled[2].0 > 0.95,
            "unscaled d=1024 max weight {}",
            unscaled[2].0
        );
        assert!(
            unscaled[2].1 < 0.15,
            "unscaled d=1024 entropy {}",
            unscaled[2].1
        );
        assert!(unscaled[0].0 < unscaled[1].0 && unscaled[1].0 < unscaled[2].0);
        // scaled: statistics barely move with d (same distribution of scores, N(0,1))
        for (m, e) in &scaled {
            assert!(
                (m - scaled[0].0).abs() < 0.08,
                "scaled max weights {scaled:?}"
            );
            assert!(
                (e - scaled[0].1).abs() < 0.15,
                "scaled entropies {scaled:?}"
            );
            assert!(*e > 1.5, "scaled entropy should stay high, got {e}");
        }
    }

    #[test]
    fn multi_head_layer_splits_and_concatenates() {
        // d_model 8, 2 heads of 4: the layer equals doing each head by hand and concatenating.
        let mut rng = Rng::new(3);
        let (dm, nh, hd, len) = (8, 2, 4, 3);
        let w = AttnWeights {
            w_q: rng.normals(dm * dm, 0.3),
            w_k: rng.normals(dm * dm, 0.3),
            w_v: rng.normals(dm * dm, 0.3),
            w_o: rng.normals(dm * dm, 0.3),
            d_model: dm,
            n_heads: nh,
            n_kv_heads: nh,
            head_dim: hd,
        };
        let x = rng.normals(len * dm, 1.0);
        let (y, mh) = multi_head_attention(&x, &w, Mask::Causal { offset: 0 });
        let q = linear(&x, &w.w_q, dm, dm);
        let k = linear(&x, &w.w_k, dm, dm);
        let v = linear(&x, &w.w_v, dm, dm);
        let (o1, _) = attend_head(
            &head_slice(&q, 1, nh, hd),
            &head_slice(&k, 1, nh, hd),
            &head_slice(&v, 1, nh, hd),
            hd,
            Mask::Causal { offset: 0 },
        );
        assert_close(&head_slice(&mh.z, 1, nh, hd), &o1, 0.0, "head 1 of z");
        assert_close(&y, &linear(&mh.z, &w.w_o, dm, dm), 0.0, "output projection");
    }
}
