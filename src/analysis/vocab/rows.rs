//! Statistics of one attention row or logits row: the top entries, the maximum, the entropy, a
//! mean over heads, attention rollout, a per-layer profile's marks, the next-token candidates.

use serde::Serialize;

/// One attended position.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Ranked {
    pub pos: usize,
    pub weight: f32,
}

/// The `k` largest entries of `row`, largest first; ties go to the lower position.
pub fn top_k(row: &[f32], k: usize) -> Vec<Ranked> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    idx.into_iter()
        .take(k)
        .map(|pos| Ranked {
            pos,
            weight: row[pos],
        })
        .collect()
}

/// `(max weight, argmax)`; ties go to the lower position.
pub fn max_argmax(row: &[f32]) -> (f32, usize) {
    let mut best = (f32::NEG_INFINITY, 0);
    for (i, &w) in row.iter().enumerate() {
        if w > best.0 {
            best = (w, i);
        }
    }
    best
}

/// Shannon entropy in nats, accumulated in f64 (`0 ln 0 = 0`).
pub fn entropy(row: &[f32]) -> f32 {
    -row.iter()
        .filter(|&&p| p > 0.0)
        .map(|&p| p as f64 * (p as f64).ln())
        .sum::<f64>() as f32
}

/// Element-wise mean of equally long rows (e.g. the heads of one query).
pub fn mean_rows<'a>(rows: impl IntoIterator<Item = &'a [f32]>) -> Vec<f32> {
    let mut acc: Vec<f64> = Vec::new();
    let mut count = 0usize;
    for r in rows {
        if acc.is_empty() {
            acc = vec![0.0; r.len()];
        }
        acc.iter_mut().zip(r).for_each(|(a, &x)| *a += x as f64);
        count += 1;
    }
    acc.into_iter()
        .map(|a| (a / count.max(1) as f64) as f32)
        .collect()
}

/// Markers of a per-layer profile: the peak and the largest rise between consecutive layers.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProfileMarks {
    pub peak_layer: usize,
    pub peak: f32,
    /// `(from layer, to layer, rise)`; `None` for a single layer.
    pub largest_jump: Option<(usize, usize, f32)>,
    /// The middle third of the layers, inclusive.
    pub middle_layers: (usize, usize),
    /// Mean over the middle layers.
    pub middle_mean: f32,
}

pub fn profile_marks(values: &[f32]) -> ProfileMarks {
    let (peak, peak_layer) = max_argmax(values);
    let largest_jump = values
        .windows(2)
        .enumerate()
        .map(|(i, w)| (i, i + 1, w[1] - w[0]))
        .fold(None, |best: Option<(usize, usize, f32)>, j| match best {
            Some(b) if b.2 >= j.2 => Some(b),
            _ => Some(j),
        });
    let n = values.len();
    let (lo, hi) = (n / 3, (2 * n).div_ceil(3).max(n / 3 + 1).min(n));
    let mid = &values[lo..hi];
    let middle_mean = mid.iter().sum::<f32>() / mid.len().max(1) as f32;
    ProfileMarks {
        peak_layer,
        peak,
        largest_jump,
        middle_layers: (lo, hi.saturating_sub(1)),
        middle_mean,
    }
}

/// A next-token candidate.
#[derive(Clone, Debug, Serialize)]
pub struct Candidate {
    pub id: u32,
    pub prob: f32,
    pub logit: f32,
}

/// The `k` most likely next tokens (softmax of the logits, f64 accumulation).
pub fn next_token_top_k(logits: &[f32], k: usize) -> Vec<Candidate> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = logits.iter().map(|&x| ((x - max) as f64).exp()).sum();
    top_k(logits, k)
        .into_iter()
        .map(|r| Candidate {
            id: r.pos as u32,
            prob: (((r.weight - max) as f64).exp() / z) as f32,
            logit: r.weight,
        })
        .collect()
}

/// Attention rollout for query `q` from per-layer head-averaged patterns (`[n, n]` each).
pub fn rollout(head_means: &[Vec<f32>], n: usize, q: usize) -> Vec<f32> {
    // the query's row, carried down through the layers: r ← r · A_l, from the last layer down
    let mut r: Vec<f64> = (0..n).map(|j| if j == q { 1.0 } else { 0.0 }).collect();
    for hm in head_means.iter().rev() {
        let mut next = vec![0.0f64; n];
        for i in 0..n {
            if r[i] == 0.0 {
                continue;
            }
            let row = &hm[i * n..][..n];
            let sum: f64 = row.iter().map(|&x| 0.5 * x as f64).sum::<f64>() + 0.5;
            for j in 0..n {
                let a = 0.5 * row[j] as f64 + if i == j { 0.5 } else { 0.0 };
                next[j] += r[i] * a / sum;
            }
        }
        r = next;
    }
    r.into_iter().map(|x| x as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_breaks_ties_by_lower_position() {
        let r = top_k(&[0.1, 0.3, 0.3, 0.2, 0.1], 3);
        assert_eq!(r.iter().map(|x| x.pos).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!(max_argmax(&[0.2, 0.4, 0.4]), (0.4, 1));
        assert_eq!(top_k(&[1.0], 5).len(), 1);
    }

    #[test]
    fn entropy_of_uniform_row_is_ln_n_and_of_one_hot_is_zero() {
        for n in [1usize, 2, 7, 100] {
            let row = vec![1.0 / n as f32; n];
            assert!((entropy(&row) - (n as f32).ln()).abs() < 1e-5, "n={n}");
        }
        assert_eq!(entropy(&[0.0, 1.0, 0.0]), 0.0);
    }

    #[test]
    fn mean_of_rows() {
        let a = [1.0f32, 0.0];
        let b = [0.0f32, 1.0];
        assert_eq!(mean_rows([&a[..], &b[..]]), vec![0.5, 0.5]);
    }

    #[test]
    fn profile_marks_find_peak_and_jump() {
        let m = profile_marks(&[0.1, 0.2, 0.7, 0.6, 0.9, 0.1]);
        assert_eq!((m.peak_layer, m.peak), (4, 0.9));
        let (a, b, rise) = m.largest_jump.unwrap();
        assert_eq!((a, b), (1, 2));
        assert!((rise - 0.5).abs() < 1e-6);
        assert!((m.middle_mean - 0.65).abs() < 1e-6);
        assert_eq!(m.middle_layers, (2, 3));
    }

    #[test]
    fn rollout_of_identity_attention_stays_on_the_query() {
        // every token attends only to itself: rollout keeps all weight on the query
        let n = 3;
        let eye: Vec<f32> = (0..n * n)
            .map(|i| if i / n == i % n { 1.0 } else { 0.0 })
            .collect();
        assert_eq!(rollout(&[eye.clone(), eye], n, 2), vec![0.0, 0.0, 1.0]);
    }

    #[test]
    fn rollout_by_hand_two_tokens_one_layer() {
        // P row 1 = [0.6, 0.4]: A row 1 = 0.5·[0.6, 0.4] + 0.5·[0, 1] = [0.3, 0.7] (sums to 1)
        let p = vec![1.0, 0.0, 0.6, 0.4];
        let r = rollout(std::slice::from_ref(&p), 2, 1);
        assert!((r[0] - 0.3).abs() < 1e-6 && (r[1] - 0.7).abs() < 1e-6);
        // two layers: r = [0,1]·A·A, A = [[1,0],[0.3,0.7]] → [0.3 + 0.7·0.3, 0.49] = [0.51, 0.49]
        let r = rollout(&[p.clone(), p], 2, 1);
        assert!((r[0] - 0.51).abs() < 1e-6 && (r[1] - 0.49).abs() < 1e-6);
    }

    #[test]
    fn next_token_probabilities_sum_over_all_to_one() {
        let logits = [2.0f32, 1.0, 0.0];
        let top = next_token_top_k(&logits, 3);
        let s: f32 = top.iter().map(|c| c.prob).sum();
        assert!((s - 1.0).abs() < 1e-6);
        assert_eq!(top[0].id, 0);
        assert!((top[0].prob - 0.665_240_9).abs() < 1e-6);
    }
}
