//! The numbers of `attnscope explain`: one attention step on a few words, small enough to redo
//! on paper. Inputs and weights are one-decimal numbers in [-1, 1] from a fixed seed, so Q, K
//! and V have exact two-decimal values.

use super::{attend_head_steps, linear, HeadSteps, Mask, Rng};

#[derive(Clone, Debug)]
pub struct Walkthrough {
    pub words: Vec<String>,
    pub d: usize,
    pub seed: u64,
    /// `[n, d]`, one row per word.
    pub x: Vec<f32>,
    /// `[d, d]` each, `[out, in]`: row `o` of `Q` is `W_Q · x`.
    pub w_q: Vec<f32>,
    pub w_k: Vec<f32>,
    pub w_v: Vec<f32>,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub steps: HeadSteps,
}

fn one_decimal(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.int(-10, 10) as f32 / 10.0).collect()
}

/// Builds the walkthrough for `words` with head dimension `d`.
pub fn walkthrough(words: &[String], d: usize, seed: u64) -> Walkthrough {
    let n = words.len();
    let mut rng = Rng::new(seed);
    let x = one_decimal(&mut rng, n * d);
    let w_q = one_decimal(&mut rng, d * d);
    let w_k = one_decimal(&mut rng, d * d);
    let w_v = one_decimal(&mut rng, d * d);
    // round away float noise: products of one-decimal numbers have exactly two decimals
    let round2 = |v: Vec<f32>| {
        v.into_iter()
            .map(|x| (x * 100.0).round() / 100.0)
            .collect::<Vec<f32>>()
    };
    let q = round2(linear(&x, &w_q, d, d));
    let k = round2(linear(&x, &w_k, d, d));
    let v = round2(linear(&x, &w_v, d, d));
    let steps = attend_head_steps(&q, &k, &v, d, Mask::Causal { offset: 0 });
    Walkthrough {
        words: words.to_vec(),
        d,
        seed,
        x,
        w_q,
        w_k,
        w_v,
        q,
        k,
        v,
        steps,
    }
}

/// "head dim 64; query heads 0-6 share KV set 0, 7-13 share KV set 1" for a model shape.
pub fn head_split(d_model: usize, n_heads: usize, n_kv_heads: usize) -> Result<String, String> {
    if n_heads == 0 || n_kv_heads == 0 {
        return Err("--heads and --kv-heads must be at least 1".into());
    }
    if !d_model.is_multiple_of(n_heads) {
        return Err(format!("--d-model {d_model} is not divisible by --heads {n_heads}; the heads split the width evenly"));
    }
    if !n_heads.is_multiple_of(n_kv_heads) {
        return Err(format!("--heads {n_heads} is not a multiple of --kv-heads {n_kv_heads}; each KV set serves the same number of query heads"));
    }
    let group = n_heads / n_kv_heads;
    let sets: Vec<String> = (0..n_kv_heads)
        .map(|g| {
            let (a, b) = (g * group, g * group + group - 1);
            let (range, verb) = if a == b {
                (a.to_string(), "uses")
            } else {
                (format!("{a}-{b}"), "share")
            };
            let prefix = match (g, a == b) {
                (0, true) => "query head ",
                (0, false) => "query heads ",
                _ => "",
            };
            format!("{prefix}{range} {verb} KV set {g}")
        })
        .collect();
    Ok(format!(
        "head dim {}; {}",
        d_model / n_heads,
        sets.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen_head_split_sentence() {
        assert_eq!(
            head_split(896, 14, 2).unwrap(),
            "head dim 64; query heads 0-6 share KV set 0, 7-13 share KV set 1"
        );
        assert_eq!(
            head_split(576, 9, 3).unwrap(),
            "head dim 64; query heads 0-2 share KV set 0, 3-5 share KV set 1, 6-8 share KV set 2"
        );
        assert_eq!(
            head_split(8, 2, 2).unwrap(),
            "head dim 4; query head 0 uses KV set 0, 1 uses KV set 1"
        );
        assert!(head_split(896, 14, 3)
            .unwrap_err()
            .contains("not a multiple"));
        assert!(head_split(900, 14, 2)
            .unwrap_err()
            .contains("not divisible"));
    }

    #[test]
    fn walkthrough_is_deterministic_and_exact() {
        let words: Vec<String> = ["Hà", "Nội", "là", "thủ", "đô"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let a = walkthrough(&words, 4, 1);
        let b = walkthrough(&words, 4, 1);
        assert_eq!(a.steps.pattern, b.steps.pattern);
        assert!(a
            .x
            .iter()
            .all(|v| (v * 10.0 - (v * 10.0).round()).abs() < 1e-5 && v.abs() <= 1.0));
        // Q = X W_Qᵀ, checked for one entry by hand
        let q10: f32 = (0..4).map(|j| a.x[4 + j] * a.w_q[j]).sum();
        assert!((a.q[4] - q10).abs() < 1e-5);
        for row in a.steps.pattern.chunks(5) {
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        }
        assert_ne!(walkthrough(&words, 4, 2).x, a.x);
    }
}
