//! Head roles: how much of each head's attention falls where a role would put it.
//!
//! For a detection pattern P (0/1, lower triangular) and a head's attention A over n tokens, the
//! score is Σ(A ⊙ P) / Σ A, TransformerLens's head detector with `error_measure="mul"` (no BOS or
//! current-token exclusion). The patterns:
//! - previous token: P[i, i-1] = 1;
//! - duplicate token: P[i, j] = 1 iff t_i = t_j and j < i;
//! - induction: P[i, j] = 1 iff t_{j-1} = t_i and 1 ≤ j ≤ i;
//! - sink: P[i, 0] = 1 (the mean weight on the first position);
//! - local: P[i, j] = 1 for i - 3 ≤ j ≤ i (the mean weight on the last 4 keys).
//!
//! An encoder's heads look both ways, so it is scored on other roles (previous/next token,
//! \[CLS\], \[SEP\], broad), defined in [`super::heads_encoder`]; [`roles_of`] picks by the model.
//!
//! [`RoleScores`] is an observer: it takes the attention block by block as the forward produces it
//! (rows of `[heads, rows, keys]`), so no n × n matrix is ever held, whatever the length.

pub use super::head_scoring::HeadRoles;
use super::head_scoring::{each_row, per_head, run_scored};
pub use super::heads_encoder::ENCODER_ROLES;
use crate::model::capture::{Hook, Observer};
use crate::model::Model;
use std::collections::BTreeMap;

pub const ROLES: [&str; 5] = [
    "previous_token",
    "duplicate_token",
    "induction",
    "sink",
    "local",
];

/// For each query i, the keys j where each role's pattern is 1 (previous token, duplicate,
/// induction), from the token ids; sink and local follow from the positions alone.
struct Patterns {
    dup: Vec<Vec<u32>>,
    ind: Vec<Vec<u32>>,
}

impl Patterns {
    fn new(tokens: &[u32]) -> Self {
        let n = tokens.len();
        let mut positions: std::collections::HashMap<u32, Vec<u32>> =
            std::collections::HashMap::new();
        let (mut dup, mut ind) = (vec![Vec::new(); n], vec![Vec::new(); n]);
        for (i, &t) in tokens.iter().enumerate() {
            if let Some(earlier) = positions.get(&t) {
                dup[i] = earlier.clone();
                // t_{j-1} = t_i with j ≤ i: one after each earlier (or this) occurrence of t_i
                ind[i] = earlier
                    .iter()
                    .map(|&p| p + 1)
                    .filter(|&j| j as usize <= i)
                    .collect();
            }
            positions.entry(t).or_default().push(i as u32);
        }
        Patterns { dup, ind }
    }
}

/// Role scores of every (layer, head) of one text, accumulated from streamed attention blocks.
pub struct RoleScores {
    n_layers: usize,
    n_heads: usize,
    n: usize,
    patterns: Patterns,
    /// sums[role][layer][head] of Σ A ⊙ P, and the Σ A per (layer, head)
    sums: Vec<Vec<Vec<f64>>>,
    mass: Vec<Vec<f64>>,
}

impl RoleScores {
    pub fn new(n_layers: usize, n_heads: usize, tokens: &[u32]) -> Self {
        RoleScores {
            n_layers,
            n_heads,
            n: tokens.len(),
            patterns: Patterns::new(tokens),
            sums: vec![vec![vec![0.0; n_heads]; n_layers]; ROLES.len()],
            mass: vec![vec![0.0; n_heads]; n_layers],
        }
    }

    /// Adds one query row `a` (the weights on keys 0..=i) of (layer, head).
    fn add_row(&mut self, layer: usize, head: usize, i: usize, a: &[f32]) {
        let w = |j: usize| a.get(j).copied().unwrap_or(0.0) as f64;
        let s = &mut self.sums;
        if i >= 1 {
            s[0][layer][head] += w(i - 1);
        }
        s[1][layer][head] += self.patterns.dup[i]
            .iter()
            .map(|&j| w(j as usize))
            .sum::<f64>();
        s[2][layer][head] += self.patterns.ind[i]
            .iter()
            .map(|&j| w(j as usize))
            .sum::<f64>();
        s[3][layer][head] += w(0);
        s[4][layer][head] += (i.saturating_sub(3)..=i).map(w).sum::<f64>();
        self.mass[layer][head] += a[..(i + 1).min(a.len())]
            .iter()
            .map(|&x| x as f64)
            .sum::<f64>();
    }

    /// The scores once every layer has run, with `tokens` for the record.
    pub fn finish(&self, tokens: &[u32]) -> HeadRoles {
        HeadRoles {
            tokens: tokens.to_vec(),
            roles: self.scores(),
            uniform: uniform_scores(tokens),
        }
    }

    fn scores(&self) -> std::collections::BTreeMap<String, Vec<Vec<f64>>> {
        let mut roles = std::collections::BTreeMap::new();
        for (r, name) in ROLES.iter().enumerate() {
            let per_layer = per_head(self.n_layers, self.n_heads, |l, h| {
                if self.mass[l][h] > 0.0 {
                    self.sums[r][l][h] / self.mass[l][h]
                } else {
                    0.0
                }
            });
            roles.insert(name.to_string(), per_layer);
        }
        roles
    }
}

/// Each role's score for a head that attends evenly to every visible key (A[i, j] = 1/(i+1)).
pub fn uniform_scores(tokens: &[u32]) -> std::collections::BTreeMap<String, f64> {
    let n = tokens.len();
    let mut r = RoleScores::new(1, 1, tokens);
    for i in 0..n {
        let row = vec![1.0 / (i + 1) as f32; i + 1];
        r.add_row(0, 0, i, &row);
    }
    r.scores().into_iter().map(|(k, v)| (k, v[0][0])).collect()
}

impl Observer for RoleScores {
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

/// `count` ids drawn from `0..vocab` (seeded), then the same ids again: the standard induction
/// test (an induction head attends, in the second half, to the token after the earlier copy).
pub fn random_repeat(count: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = crate::reference::Rng::new(seed);
    let half: Vec<u32> = (0..count)
        .map(|_| (rng.next_u64() % vocab.max(1) as u64) as u32)
        .collect();
    half.iter().chain(&half).copied().collect()
}

/// The induction test's input: `count` random token ids then the same again, after the model's
/// BOS when it uses one (or `bos`); `count` must leave room in the context.
pub fn random_repeat_tokens(
    model: &Model,
    count: usize,
    seed: u64,
    bos: bool,
) -> crate::model::Result<Vec<u32>> {
    let d = &model.dims;
    if model.is_encoder() {
        return Err(crate::model::Error::NotApplicable(format!(
            "--random-repeat (Python: random_repeat) is the induction test of a causal model; {} is an encoder (bidirectional attention, no induction to test): give it a text",
            model.info.name
        )));
    }
    if count == 0 || 2 * count + 1 > d.context_len {
        return Err(crate::model::Error::OutOfRange {
            what: "--random-repeat (Python: random_repeat)".into(),
            value: count.to_string(),
            range: format!("1..={}", (d.context_len - 1) / 2),
        });
    }
    let mut t = if bos || model.tokenizer.add_bos {
        model.tokenizer.encode("", true)?
    } else {
        Vec::new()
    };
    t.extend(random_repeat(
        count,
        model.tokenizer.vocab_size().min(d.vocab_size),
        seed,
    ));
    Ok(t)
}

/// The role scores of one token sequence (streamed: no n × n matrix is held). On a decoder the
/// roles of [`ROLES`] (causal patterns, against a uniform causal head); on an encoder those of
/// [`ENCODER_ROLES`] (previous/next token, \[CLS\], \[SEP\], broad: `heads_encoder`'s definitions).
pub fn roles_of(model: &Model, tokens: &[u32]) -> anyhow::Result<HeadRoles> {
    roles_of_typed(model, tokens, None)
}

/// [`roles_of`] with an encoder's token types (a sentence pair's, as [`Model::encode_pair`]
/// gives them; `None`: all 0; types are an encoder's).
pub fn roles_of_typed(
    model: &Model,
    tokens: &[u32],
    types: Option<&[u32]>,
) -> anyhow::Result<HeadRoles> {
    if model.is_encoder() {
        return Ok(super::heads_encoder::encoder_roles(model, tokens, types)?);
    }
    let d = &model.dims;
    let mut r = RoleScores::new(d.n_layers, d.n_heads, tokens);
    run_scored(model, tokens, types, &mut r)?;
    Ok(r.finish(tokens))
}

/// The roles `model` is scored on, in the order they are listed: [`ROLES`] on a decoder,
/// [`ENCODER_ROLES`] on an encoder.
pub fn role_names(model: &Model) -> &'static [&'static str] {
    if model.is_encoder() {
        &ENCODER_ROLES
    } else {
        &ROLES
    }
}

/// The mean of several texts' scores (each text counts once), in the order given.
pub fn mean_roles(all: &[HeadRoles]) -> BTreeMap<String, Vec<Vec<f64>>> {
    let mut out = BTreeMap::new();
    for role in all[0].roles.keys() {
        let first = &all[0].roles[role];
        let mean = (0..first.len())
            .map(|l| {
                (0..first[l].len())
                    .map(|h| {
                        all.iter().map(|r| r.roles[role][l][h]).sum::<f64>() / all.len() as f64
                    })
                    .collect()
            })
            .collect();
        out.insert(role.clone(), mean);
    }
    out
}

/// Each role's uniform-head score, averaged like the scores (each text once).
pub fn mean_uniform(all: &[HeadRoles]) -> BTreeMap<String, f64> {
    all[0]
        .uniform
        .keys()
        .map(|r| {
            (
                r.clone(),
                all.iter().map(|x| x.uniform[r]).sum::<f64>() / all.len() as f64,
            )
        })
        .collect()
}

/// The document `heads --each-line --json` prints, from each text's scores in order.
pub fn document(
    model: &Model,
    all: &[HeadRoles],
    extra: serde_json::Map<String, serde_json::Value>,
) -> anyhow::Result<serde_json::Value> {
    let first = all
        .first()
        .ok_or_else(|| anyhow::anyhow!("no head-role scores to average"))?;
    for r in all {
        let same = r.roles.len() == first.roles.len()
            && r.uniform.keys().eq(first.uniform.keys())
            && r.roles.iter().all(|(k, v)| {
                first.roles.get(k).is_some_and(|f| {
                    f.len() == v.len() && f.iter().zip(v).all(|(a, b)| a.len() == b.len())
                })
            });
        if !same {
            return Err(anyhow::Error::new(crate::model::Error::NotApplicable(
                "head-role scores of different roles or shapes (another model's?) cannot be averaged".into(),
            )));
        }
    }
    let mut doc = extra;
    let uniform = mean_uniform(all);
    doc.insert("model".into(), model.info.name.clone().into());
    doc.insert("precision".into(), model.info.precision.name().into());
    doc.insert("texts".into(), all.len().into());
    doc.insert(
        "tokens".into(),
        if all.len() == 1 {
            serde_json::to_value(&all[0].tokens)?
        } else {
            serde_json::to_value(all.iter().map(|r| &r.tokens).collect::<Vec<_>>())?
        },
    );
    doc.insert("roles".into(), serde_json::to_value(mean_roles(all))?);
    doc.insert("uniform".into(), serde_json::to_value(&uniform)?);
    Ok(serde_json::Value::Object(doc))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full [n, n] map per head fed as one block.
    fn scores(tokens: &[u32], maps: &[Vec<f32>]) -> HeadRoles {
        let n = tokens.len();
        let mut r = RoleScores::new(1, maps.len(), tokens);
        let data: Vec<f32> = maps.iter().flatten().copied().collect();
        r.attention_block(0, Hook::Pattern, 0, [maps.len(), n, n], &data);
        r.finish(tokens)
    }

    fn map(n: usize, mut f: impl FnMut(usize, usize) -> f32) -> Vec<f32> {
        (0..n * n)
            .map(|k| if k % n <= k / n { f(k / n, k % n) } else { 0.0 })
            .collect()
    }

    #[test]
    fn hand_computed_scores() {
        // tokens a b a b: dup keys of 2 = {0}, of 3 = {1}; induction keys of 2 = {1}, of 3 = {2}
        let t = [7, 8, 7, 8];
        // row 0 can only see itself; the others put everything on the token before
        let prev = map(4, |i, j| (i == 0 || j + 1 == i) as u8 as f32);
        let ind = map(4, |i, j| match i {
            0 => (j == 0) as u8 as f32,
            1 => (j == 0) as u8 as f32,
            2 => (j == 1) as u8 as f32,
            _ => (j == 2) as u8 as f32,
        });
        let r = scores(&t, &[prev, ind]);
        let s = |role: &str, h: usize| r.roles[role][0][h];
        // previous-token head: rows 1..3 put 1 on i-1 (3 of 4 rows), row 0 on itself
        assert!((s("previous_token", 0) - 0.75).abs() < 1e-12);
        assert!((s("sink", 0) - 0.5).abs() < 1e-12); // rows 0 and 1 on position 0
        assert!((s("local", 0) - 1.0).abs() < 1e-12);
        // induction head: rows 2, 3 on the token after the earlier copy
        assert!((s("induction", 1) - 0.5).abs() < 1e-12);
        assert!((s("duplicate_token", 1) - 0.0).abs() < 1e-12);
        // the previous-token head of a b a b is also an induction head here (i-1 = j for row 2, 3)
        assert!((s("induction", 0) - 0.5).abs() < 1e-12);
        // uniform: row i spreads 1/(i+1); dup keys: rows 2 and 3 have one each
        let u = &r.uniform;
        assert!(
            (u["duplicate_token"] - (1.0 / 3.0 + 1.0 / 4.0) / 4.0).abs() < 1e-7,
            "{u:?}"
        );
        assert!(
            (u["sink"] - (1.0 + 0.5 + 1.0 / 3.0 + 0.25) / 4.0).abs() < 1e-7,
            "{u:?}"
        );
        assert!((u["local"] - 1.0).abs() < 1e-7);
    }

    #[test]
    fn blocks_of_rows_equal_the_whole_map() {
        let t = random_repeat(6, 5, 3);
        let n = t.len();
        let mut rng = crate::reference::Rng::new(9);
        let maps: Vec<Vec<f32>> = (0..3)
            .map(|_| {
                let mut m = map(n, |_, _| rng.uniform() as f32 + 0.01);
                for i in 0..n {
                    let s: f32 = m[i * n..i * n + i + 1].iter().sum();
                    m[i * n..i * n + i + 1].iter_mut().for_each(|x| *x /= s);
                }
                m
            })
            .collect();
        let whole = scores(&t, &maps);
        // the same maps in blocks of 5 rows and narrower key widths, as the forward hands them out
        let mut r = RoleScores::new(1, 3, &t);
        for q0 in (0..n).step_by(5) {
            let rows = 5.min(n - q0);
            let kw = q0 + rows;
            let data: Vec<f32> = (0..3)
                .flat_map(|h| {
                    (0..rows)
                        .flat_map(|x| maps[h][(q0 + x) * n..(q0 + x) * n + kw].to_vec())
                        .collect::<Vec<_>>()
                })
                .collect();
            r.attention_block(0, Hook::Pattern, q0, [3, rows, kw], &data);
        }
        let blocks = r.finish(&t);
        for role in ROLES {
            for h in 0..3 {
                assert!(
                    (blocks.roles[role][0][h] - whole.roles[role][0][h]).abs() < 1e-12,
                    "{role} {h}"
                );
            }
        }
    }

    #[test]
    fn random_repeat_repeats() {
        let t = random_repeat(50, 1000, 1);
        assert_eq!(t.len(), 100);
        assert_eq!(t[..50], t[50..]);
        assert_ne!(random_repeat(50, 1000, 2), t);
    }
}
