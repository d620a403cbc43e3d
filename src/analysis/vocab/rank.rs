//! Rank statistics: how well one ranking of positions agrees with another (Spearman's ρ,
//! Kendall's τ-b, their permutation p-values), and a ranking's top positions.

use crate::reference::Rng;

/// Ranks with ties averaged (1-based), as Spearman's ρ needs.
pub fn average_ranks(v: &[f64]) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[a].total_cmp(&v[b]));
    let mut ranks = vec![0.0; v.len()];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && v[idx[j + 1]] == v[idx[i]] {
            j += 1;
        }
        let r = (i + j) as f64 / 2.0 + 1.0;
        for &k in &idx[i..=j] {
            ranks[k] = r;
        }
        i = j + 1;
    }
    ranks
}

fn pearson(a: &[f64], b: &[f64]) -> Option<f64> {
    let n = a.len() as f64;
    let (ma, mb) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
    let cov: f64 = a.iter().zip(b).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let va: f64 = a.iter().map(|x| (x - ma).powi(2)).sum();
    let vb: f64 = b.iter().map(|y| (y - mb).powi(2)).sum();
    (va > 0.0 && vb > 0.0).then(|| cov / (va * vb).sqrt())
}

/// Spearman's rank correlation; `None` when either side is constant or shorter than 2.
pub fn spearman(a: &[f64], b: &[f64]) -> Option<f64> {
    if a.len() < 2 {
        return None;
    }
    pearson(&average_ranks(a), &average_ranks(b))
}

/// The two-sided permutation p-value of `stat(a, b)`: the share of orderings of `b` whose
/// statistic is at least as far from 0 as the observed one. Exact (every permutation) for n ≤ 7;
/// above, 2,000 permutations from a fixed seed, p = (hits + 1) / (2,000 + 1).
pub fn permutation_p(a: &[f64], b: &[f64], stat: fn(&[f64], &[f64]) -> Option<f64>) -> Option<f64> {
    let obs = stat(a, b)?.abs() - 1e-12;
    let n = b.len();
    let mut perm: Vec<f64> = b.to_vec();
    if n <= 7 {
        // Heap's algorithm over every ordering
        let (mut hits, mut total) = (0usize, 0usize);
        let mut c = vec![0usize; n];
        let mut visit = |p: &[f64]| {
            total += 1;
            if stat(a, p).is_some_and(|v| v.abs() >= obs) {
                hits += 1;
            }
        };
        visit(&perm);
        let mut i = 0;
        while i < n {
            if c[i] < i {
                if i % 2 == 0 {
                    perm.swap(0, i)
                } else {
                    perm.swap(c[i], i)
                }
                visit(&perm);
                c[i] += 1;
                i = 0;
            } else {
                c[i] = 0;
                i += 1;
            }
        }
        return Some(hits as f64 / total as f64);
    }
    let mut rng = Rng::new(20260);
    let mut hits = 0usize;
    const B: usize = 2000;
    for _ in 0..B {
        for i in (1..n).rev() {
            perm.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        if stat(a, &perm).is_some_and(|v| v.abs() >= obs) {
            hits += 1;
        }
    }
    Some((hits + 1) as f64 / (B + 1) as f64)
}

/// Kendall's τ-b (ties corrected); `None` when either side is constant or shorter than 2.
///
/// Counted in O(n log n) (Knight 1966: sort by `a`, then count `b`'s inversions by merge sort),
/// the same integer counts of concordant, discordant and tied pairs as comparing every pair
/// ([`kendall_tau_b_pairs`]), so the same value bit for bit; `faithfulness`'s permutation
/// p-values take 2,000 of them per metric row, which every pair made seconds at 200 tokens.
/// Non-finite values go to the pairwise count (whose comparisons define how they count).
pub fn kendall_tau_b(a: &[f64], b: &[f64]) -> Option<f64> {
    let n = a.len();
    if n != b.len() || !a.iter().chain(b).all(|x| x.is_finite()) {
        return kendall_tau_b_pairs(a, b);
    }
    // pairs tied in a run of equal values (== , so -0.0 ties 0.0 as in the pairwise count)
    let tied = |sorted: &mut dyn Iterator<Item = f64>| -> i64 {
        let (mut total, mut run, mut prev) = (0i64, 0i64, None::<f64>);
        for x in sorted {
            if prev == Some(x) {
                run += 1;
            } else {
                total += run * (run - 1) / 2;
                run = 1;
            }
            prev = Some(x);
        }
        total + run * (run - 1) / 2
    };
    let cmp = |x: f64, y: f64| x.partial_cmp(&y).expect("finite");
    let mut idx: Vec<usize> = (0..n).collect();
    idx.sort_unstable_by(|&i, &j| cmp(a[i], a[j]).then(cmp(b[i], b[j])));
    let t_a = tied(&mut idx.iter().map(|&i| a[i]));
    // pairs tied in both: runs of equal (a, b) in that order
    let t_ab = {
        let (mut total, mut run) = (0i64, 0i64);
        for w in 0..n {
            if w > 0 && a[idx[w]] == a[idx[w - 1]] && b[idx[w]] == b[idx[w - 1]] {
                run += 1;
            } else {
                total += run * (run - 1) / 2;
                run = 1;
            }
        }
        total + run * (run - 1) / 2
    };
    // b in a's order: its inversions (strictly greater before smaller) are the discordant pairs
    let mut v: Vec<f64> = idx.iter().map(|&i| b[i]).collect();
    let mut buf = vec![0f64; n];
    let disc = merge_inversions(&mut v, &mut buf);
    let t_b = tied(&mut v.iter().copied());
    let n0 = (n as i64) * (n as i64 - 1) / 2;
    // conc + disc = n0 − t_a − t_b + t_ab: every pair tied in neither
    let conc = n0 - t_a - t_b + t_ab - disc;
    let (ties_a, ties_b) = (t_a - t_ab, t_b - t_ab);
    let denom = (((conc + disc + ties_a) * (conc + disc + ties_b)) as f64).sqrt();
    (n >= 2 && denom > 0.0).then(|| (conc - disc) as f64 / denom)
}

/// Sorts `v` ascending (stable merge sort) and returns how many pairs `i < j` had
/// `v[i] > v[j]` (equal values are not inversions).
fn merge_inversions(v: &mut [f64], buf: &mut [f64]) -> i64 {
    let n = v.len();
    if n < 2 {
        return 0;
    }
    let mid = n / 2;
    let mut inv = {
        let (l, r) = v.split_at_mut(mid);
        let (bl, br) = buf.split_at_mut(mid);
        merge_inversions(l, bl) + merge_inversions(r, br)
    };
    let (mut i, mut j, mut k) = (0, mid, 0);
    while i < mid && j < n {
        if v[j] < v[i] {
            // v[j] is smaller than every value left in the left half
            inv += (mid - i) as i64;
            buf[k] = v[j];
            j += 1;
        } else {
            buf[k] = v[i];
            i += 1;
        }
        k += 1;
    }
    buf[k..k + mid - i].copy_from_slice(&v[i..mid]);
    k += mid - i;
    buf[k..k + n - j].copy_from_slice(&v[j..n]);
    v.copy_from_slice(&buf[..n]);
    inv
}

/// Kendall's τ-b by comparing every pair (O(n²)): the definition [`kendall_tau_b`] counts
/// faster, kept for non-finite values and as the tests' reference.
pub fn kendall_tau_b_pairs(a: &[f64], b: &[f64]) -> Option<f64> {
    let n = a.len();
    let (mut conc, mut disc, mut ties_a, mut ties_b) = (0i64, 0i64, 0i64, 0i64);
    for i in 0..n {
        for j in i + 1..n {
            let (da, db) = (a[i] - a[j], b[i] - b[j]);
            match (da == 0.0, db == 0.0) {
                (true, true) => {}
                (true, false) => ties_a += 1,
                (false, true) => ties_b += 1,
                _ if da.signum() == db.signum() => conc += 1,
                _ => disc += 1,
            }
        }
    }
    let denom = (((conc + disc + ties_a) * (conc + disc + ties_b)) as f64).sqrt();
    (n >= 2 && denom > 0.0).then(|| (conc - disc) as f64 / denom)
}

/// The `k` highest-scoring positions among `candidates` (ties to the lower position).
pub fn top_positions(scores: &[f32], candidates: &[usize], k: usize) -> Vec<usize> {
    let mut c = candidates.to_vec();
    c.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    c.truncate(k);
    c.sort_unstable();
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn rank_correlations_of_constructed_rankings() {
        let a = [1.0, 2.0, 3.0, 4.0, 5.0];
        let up = [10.0, 20.0, 30.0, 40.0, 50.0];
        let down = [5.0, 4.0, 3.0, 2.0, 1.0];
        assert!((spearman(&a, &up).unwrap() - 1.0).abs() < 1e-12);
        assert!((spearman(&a, &down).unwrap() + 1.0).abs() < 1e-12);
        assert!((kendall_tau_b(&a, &up).unwrap() - 1.0).abs() < 1e-12);
        assert!((kendall_tau_b(&a, &down).unwrap() + 1.0).abs() < 1e-12);
        assert_eq!(spearman(&a, &[1.0; 5]), None);
        // one swap of five: ρ = 1 - 6·2/(5·24) = 0.9; τ = (9 - 1)/10 = 0.8
        let swap = [1.0, 2.0, 3.0, 5.0, 4.0];
        assert!((spearman(&a, &swap).unwrap() - 0.9).abs() < 1e-12);
        assert!((kendall_tau_b(&a, &swap).unwrap() - 0.8).abs() < 1e-12);
    }

    #[test]
    fn kendall_by_merge_sort_counts_every_pair_alike() {
        // ties in a, in b, in both, -0.0 beside 0.0, and lengths 0..40: the same bits as the
        // pairwise count
        let mut rng = Rng::new(5);
        for n in 0..40usize {
            for levels in [2u64, 3, 7, 1000] {
                let draw = |rng: &mut Rng| -> Vec<f64> {
                    (0..n)
                        .map(|_| match rng.next_u64() % levels {
                            0 => -0.0,
                            1 => 0.0,
                            v => v as f64 * 0.25 - 3.0,
                        })
                        .collect()
                };
                let (a, b) = (draw(&mut rng), draw(&mut rng));
                let (fast, pairs) = (kendall_tau_b(&a, &b), kendall_tau_b_pairs(&a, &b));
                assert_eq!(
                    fast.map(f64::to_bits),
                    pairs.map(f64::to_bits),
                    "{a:?} {b:?}"
                );
            }
        }
        // by hand: a = [1, 2, 3], b = [1, 3, 3]: pairs (1,2) and (1,3) concordant, (2,3) tied
        // in b only; τ-b = 2 / √(3 · 2)
        let t = kendall_tau_b(&[1.0, 2.0, 3.0], &[1.0, 3.0, 3.0]).unwrap();
        assert!((t - 2.0 / 6f64.sqrt()).abs() < 1e-15, "{t}");
        // a NaN goes to the pairwise count
        let nan = [1.0, f64::NAN, 3.0];
        assert_eq!(
            kendall_tau_b(&nan, &[1.0, 2.0, 3.0]).map(f64::to_bits),
            kendall_tau_b_pairs(&nan, &[1.0, 2.0, 3.0]).map(f64::to_bits)
        );
    }

    #[test]
    fn ties_get_average_ranks() {
        assert_eq!(
            average_ranks(&[10.0, 20.0, 20.0, 5.0]),
            vec![2.0, 3.5, 3.5, 1.0]
        );
    }

    #[test]
    fn permutation_p_values() {
        // a perfect ranking of 5: exactly 2 of 120 orderings (this one and its reverse) reach |ρ| = 1
        let a = [1.0, 2.0, 3.0, 4.0, 5.0];
        let p = permutation_p(&a, &a, spearman).unwrap();
        assert!((p - 2.0 / 120.0).abs() < 1e-12, "{p}");
        // a constant truth has no correlation, so no p-value
        assert_eq!(permutation_p(&a, &[1.0; 5], spearman), None);
        // larger n: sampled, bounded below by 1/2001, near 1 for a shuffled truth
        let a: Vec<f64> = (0..30).map(|i| i as f64).collect();
        let p = permutation_p(&a, &a, kendall_tau_b).unwrap();
        assert!((p - 1.0 / 2001.0).abs() < 1e-12);
        let shuffled: Vec<f64> = (0..30).map(|i| ((i * 17) % 30) as f64).collect();
        assert!(permutation_p(&a, &shuffled, spearman).unwrap() > 0.05);
    }

    #[test]
    fn top_positions_respect_candidates_and_ties() {
        let s = [0.9, 0.1, 0.5, 0.5];
        assert_eq!(top_positions(&s, &[0, 1, 2, 3], 2), vec![0, 2]);
        assert_eq!(top_positions(&s, &[1, 2, 3], 2), vec![2, 3]);
    }
}
