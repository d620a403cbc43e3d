//! Head roles of an encoder (BERT, RoBERTa, DistilBERT): what Clark et al. 2019 ("What does BERT
//! look at?") read from each head of a bidirectional model. For a head's attention A over the n
//! tokens of a text (every query sees every key), each score is a mean over the n queries i:
//! - previous token: A[i, i-1] (0 for i = 0);
//! - next token: A[i, i+1] (0 for i = n-1);
//! - cls: the weight on the `[CLS]` (RoBERTa: `<s>`) keys, Σ_{j: t_j = \[CLS\]} A[i, j];
//! - sep: the weight on the `[SEP]` (`</s>`) keys: a pair's two or three count together;
//! - broad: the row's entropy over ln n, H(A[i, ·]) / ln n with H = −Σ_j A[i, j] ln A[i, j]
//!   (nats; 1 for a head that spreads its weight evenly, 0 for one on a single key).
//!
//! Since each row sums to 1, the first four are Σ(A ⊙ P) / Σ A for the role's 0/1 pattern P, the
//! decoder's head-detector formula (`heads`) with patterns that look both ways. The
//! uniform head (A = 1/n everywhere) scores (n−1)/n², (n−1)/n², #\[CLS\]/n, #\[SEP\]/n and 1.
//! [`EncoderRoleScores`] is an observer fed the attention block by block, as the forward hands
//! it out.

use super::head_scoring::{each_row, per_head, run_scored, HeadRoles};
use crate::model::capture::{Hook, Observer};
use crate::model::Model;
use std::collections::BTreeMap;

/// The roles scored on an encoder, in the order `heads` lists them.
pub const ENCODER_ROLES: [&str; 5] = ["previous_token", "next_token", "cls", "sep", "broad"];

/// Role scores of every (layer, head) of one encoder text, from streamed attention blocks.
pub struct EncoderRoleScores {
    n_layers: usize,
    n_heads: usize,
    n: usize,
    /// Per key: (is \[CLS\], is \[SEP\]).
    kinds: Vec<(bool, bool)>,
    /// sums[role][layer][head] over the queries seen
    sums: Vec<Vec<Vec<f64>>>,
}

impl EncoderRoleScores {
    /// The collector for `tokens` of a model with `n_layers` × `n_heads`, whose \[CLS\] and \[SEP\]
    /// ids are `cls` and `sep` (as [`Model::special_ids`] gives them).
    pub fn new(
        n_layers: usize,
        n_heads: usize,
        tokens: &[u32],
        cls: Option<u32>,
        sep: Option<u32>,
    ) -> Self {
        EncoderRoleScores {
            n_layers,
            n_heads,
            n: tokens.len(),
            kinds: tokens
                .iter()
                .map(|&t| (Some(t) == cls, Some(t) == sep))
                .collect(),
            sums: vec![vec![vec![0.0; n_heads]; n_layers]; ENCODER_ROLES.len()],
        }
    }

    /// Adds query row `a` (the weights on keys 0..a.len(); keys past it weigh 0) of (layer, head).
    fn add_row(&mut self, layer: usize, head: usize, i: usize, a: &[f32]) {
        let w = |j: usize| a.get(j).copied().unwrap_or(0.0) as f64;
        let (mut cls, mut sep, mut h) = (0f64, 0f64, 0f64);
        for (j, &x) in a.iter().enumerate().take(self.n) {
            let x = x as f64;
            let (c, s) = self.kinds[j];
            if c {
                cls += x;
            }
            if s {
                sep += x;
            }
            if x > 0.0 {
                h -= x * x.ln();
            }
        }
        let s = &mut self.sums;
        if i >= 1 {
            s[0][layer][head] += w(i - 1);
        }
        s[1][layer][head] += w(i + 1);
        s[2][layer][head] += cls;
        s[3][layer][head] += sep;
        s[4][layer][head] += h;
    }

    /// The scores once every layer has run, with `tokens` for the record.
    pub fn finish(&self, tokens: &[u32]) -> HeadRoles {
        let n = self.n.max(1) as f64;
        let ln_n = (self.n as f64).ln();
        let mut roles = BTreeMap::new();
        for (r, name) in ENCODER_ROLES.iter().enumerate() {
            let per_layer = per_head(self.n_layers, self.n_heads, |l, h| {
                let mean = self.sums[r][l][h] / n;
                match *name {
                    "broad" if ln_n > 0.0 => mean / ln_n,
                    "broad" => 0.0,
                    _ => mean,
                }
            });
            roles.insert(name.to_string(), per_layer);
        }
        HeadRoles {
            tokens: tokens.to_vec(),
            roles,
            uniform: self.uniform(),
        }
    }

    /// Each role's score for a head that spreads its weight evenly over the n keys.
    fn uniform(&self) -> BTreeMap<String, f64> {
        let n = self.n.max(1) as f64;
        let count =
            |f: fn(&(bool, bool)) -> bool| self.kinds.iter().filter(|k| f(k)).count() as f64;
        let neighbour = (n - 1.0) / (n * n);
        [
            ("previous_token", neighbour),
            ("next_token", neighbour),
            ("cls", count(|k| k.0) / n),
            ("sep", count(|k| k.1) / n),
            ("broad", if self.n > 1 { 1.0 } else { 0.0 }),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }
}

impl Observer for EncoderRoleScores {
    fn wants(&self, layer: usize, hook: Hook) -> bool {
        hook == Hook::Pattern && layer < self.n_layers
    }
    fn tensor(&mut self, _: usize, _: Hook, _: &[usize], _: &[f32]) {}
    fn attention_block(
        &mut self,
        layer: usize,
        hook: Hook,
        q_start: usize,
        shape: [usize; 3],
        data: &[f32],
    ) {
        if hook == Hook::Pattern {
            let (n_heads, n) = (self.n_heads, self.n);
            each_row(n_heads, n, q_start, shape, data, |h, i, row| {
                self.add_row(layer, h, i, row)
            });
        }
    }
}

/// The role scores of an encoder's `tokens`, run with `types` (a pair's token types; `None`: all
/// 0, one text): one forward, no n × n matrix kept.
pub fn encoder_roles(
    model: &Model,
    tokens: &[u32],
    types: Option<&[u32]>,
) -> crate::model::Result<HeadRoles> {
    let d = &model.dims;
    let (cls, sep) = model.special_ids();
    let mut r = EncoderRoleScores::new(d.n_layers, d.n_heads, tokens, cls, sep);
    run_scored(model, tokens, types, &mut r)?;
    Ok(r.finish(tokens))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds whole `[n, n]` maps (one per head) as one block.
    fn scores(tokens: &[u32], maps: &[Vec<f32>]) -> HeadRoles {
        let n = tokens.len();
        let mut r = EncoderRoleScores::new(1, maps.len(), tokens, Some(1), Some(2));
        let data: Vec<f32> = maps.iter().flatten().copied().collect();
        r.attention_block(0, Hook::Pattern, 0, [maps.len(), n, n], &data);
        r.finish(tokens)
    }

    #[test]
    fn hand_computed_scores() {
        // [CLS] a b [SEP]: ids 1 5 6 2
        let t = [1, 5, 6, 2];
        #[rustfmt::skip]
        let prev = vec![
            1.0, 0.0, 0.0, 0.0,
            1.0, 0.0, 0.0, 0.0,
            0.0, 1.0, 0.0, 0.0,
            0.0, 0.0, 1.0, 0.0,
        ];
        #[rustfmt::skip]
        let mixed = vec![
            0.0, 0.5, 0.0, 0.5,
            0.0, 0.0, 0.5, 0.5,
            0.25, 0.25, 0.25, 0.25,
            0.0, 0.0, 0.0, 1.0,
        ];
        let r = scores(&t, &[prev, mixed]);
        let s = |role: &str, h: usize| r.roles[role][0][h];
        // previous-token head: rows 1..3 put all on i-1: 3 of 4 queries
        assert!((s("previous_token", 0) - 0.75).abs() < 1e-12);
        assert!((s("next_token", 0) - 0.0).abs() < 1e-12);
        assert!((s("cls", 0) - 0.5).abs() < 1e-12); // rows 0 and 1 on [CLS]
        assert!((s("sep", 0) - 0.0).abs() < 1e-12);
        assert!(s("broad", 0).abs() < 1e-12); // every row on one key
                                              // mixed: next-token weights 0.5 (row 0), 0.5 (row 1), 0.25 (row 2)
        assert!((s("next_token", 1) - 1.25 / 4.0).abs() < 1e-12);
        assert!((s("previous_token", 1) - (0.0 + 0.25 + 0.0) / 4.0).abs() < 1e-12);
        assert!((s("sep", 1) - (0.5 + 0.5 + 0.25 + 1.0) / 4.0).abs() < 1e-12);
        assert!((s("cls", 1) - 0.25 / 4.0).abs() < 1e-12);
        // entropies: ln 2, ln 2, ln 4, 0; over ln 4
        let want = (2.0 * 2f64.ln() + 4f64.ln()) / 4.0 / 4f64.ln();
        assert!((s("broad", 1) - want).abs() < 1e-12);
        let u = &r.uniform;
        assert!((u["previous_token"] - 3.0 / 16.0).abs() < 1e-12);
        assert!((u["sep"] - 0.25).abs() < 1e-12);
        assert!((u["broad"] - 1.0).abs() < 1e-12);
    }

    #[test]
    fn a_uniform_head_scores_the_uniform_baseline() {
        let t = [1, 7, 8, 2, 9, 2];
        let n = t.len();
        let r = scores(&t, &[vec![1.0 / n as f32; n * n]]);
        for role in ENCODER_ROLES {
            assert!(
                (r.roles[role][0][0] - r.uniform[role]).abs() < 1e-6,
                "{role}: {} vs {}",
                r.roles[role][0][0],
                r.uniform[role]
            );
        }
        assert!((r.uniform["sep"] - 2.0 / 6.0).abs() < 1e-12);
    }

    #[test]
    fn blocks_of_rows_equal_the_whole_map() {
        let t = [1, 4, 5, 6, 2, 7, 8, 2];
        let n = t.len();
        let mut rng = crate::reference::Rng::new(5);
        let maps: Vec<Vec<f32>> = (0..2)
            .map(|_| {
                let mut m: Vec<f32> = (0..n * n).map(|_| rng.uniform() as f32 + 0.01).collect();
                for row in m.chunks_mut(n) {
                    let s: f32 = row.iter().sum();
                    row.iter_mut().for_each(|x| *x /= s);
                }
                m
            })
            .collect();
        let whole = scores(&t, &maps);
        let mut r = EncoderRoleScores::new(1, 2, &t, Some(1), Some(2));
        for q0 in (0..n).step_by(3) {
            let rows = 3.min(n - q0);
            let data: Vec<f32> = (0..2)
                .flat_map(|h| maps[h][q0 * n..(q0 + rows) * n].to_vec())
                .collect();
            r.attention_block(0, Hook::Pattern, q0, [2, rows, n], &data);
        }
        assert_eq!(r.finish(&t), whole);
    }
}
