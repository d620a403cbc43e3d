//! The rows of a faithfulness report, a decoder's and an encoder's alike: a ranking's agreement
//! with a deletion truth (ρ, τ-b, their p-values, top-1, comprehensiveness and sufficiency at k)
//! and the best ranking.

use serde::Serialize;

#[derive(Clone, Debug, Default, Serialize)]
pub struct AtK {
    #[serde(rename = "1")]
    pub k1: Option<f32>,
    #[serde(rename = "3")]
    pub k3: Option<f32>,
    #[serde(rename = "5")]
    pub k5: Option<f32>,
}

#[derive(Clone, Debug, Serialize)]
pub struct MetricRow {
    pub ranking: String,
    pub truth: String,
    /// tokens ranked (with a handful, ρ and τ mean little: see the p-values)
    pub n: usize,
    pub spearman: Option<f64>,
    /// two-sided permutation p-value of ρ (exact for n ≤ 7, else 2,000 seeded permutations)
    pub spearman_p: Option<f64>,
    pub kendall: Option<f64>,
    pub kendall_p: Option<f64>,
    pub top1: Option<bool>,
    pub comprehensiveness: AtK,
    pub sufficiency: AtK,
    pub without_first: bool,
}

/// A ranking and its ρ against deletion.
#[derive(Clone, Debug, Serialize)]
pub struct Best {
    pub ranking: String,
    pub spearman: f64,
}

/// The metric row with the highest Spearman ρ among `metrics` (those that have one; ties to
/// the last), as a [`Best`].
pub fn best_of<'a>(metrics: impl Iterator<Item = &'a MetricRow>) -> Option<Best> {
    metrics
        .filter_map(|m| m.spearman.map(|r| (m, r)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(m, r)| Best {
            ranking: m.ranking.clone(),
            spearman: r,
        })
}
