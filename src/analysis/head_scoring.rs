//! What both head-role scorers share (the decoder's, `heads`, and the encoder's,
//! `heads_encoder`): the scores' shape ([`HeadRoles`]), the walk over a streamed attention block's
//! rows, the per-(layer, head) table and the watched forward. A block below both, so neither
//! imports the other's internals.

use crate::model::capture::Observer;
use crate::model::forward::RunOptions;
use crate::model::Model;
use serde::Serialize;

/// The scores, `roles[role][layer][head]`, with the uniform head's score per role for scale.
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct HeadRoles {
    /// the token ids the roles were scored on
    pub tokens: Vec<u32>,
    /// `roles[role][layer][head]`: each head's score per role
    pub roles: std::collections::BTreeMap<String, Vec<Vec<f64>>>,
    /// the score of a head that spreads its weight evenly over every visible key
    pub uniform: std::collections::BTreeMap<String, f64>,
}

/// Hands each query row of a streamed block of `hook_pattern` (`[heads, rows, k_width]`, its
/// first row query `q_start`) to `add(head, query, row)`, for the first `n_heads` heads and the
/// queries below `n`: the per-head collection of both role scorers (a decoder's and
/// `heads_encoder`'s).
pub(super) fn each_row(
    n_heads: usize,
    n: usize,
    q_start: usize,
    [heads, rows, kw]: [usize; 3],
    data: &[f32],
    mut add: impl FnMut(usize, usize, &[f32]),
) {
    for h in 0..heads.min(n_heads) {
        for x in 0..rows {
            let i = q_start + x;
            if i < n {
                add(h, i, &data[(h * rows + x) * kw..(h * rows + x + 1) * kw]);
            }
        }
    }
}

/// `table[layer][head]` of `f(layer, head)`: one role's scores.
pub(super) fn per_head(
    n_layers: usize,
    n_heads: usize,
    f: impl Fn(usize, usize) -> f64,
) -> Vec<Vec<f64>> {
    (0..n_layers)
        .map(|l| (0..n_heads).map(|h| f(l, h)).collect())
        .collect()
}

/// One forward of `tokens` (with an encoder's token `types`; `None`: all 0) watched by a role
/// scorer `obs`.
pub(super) fn run_scored(
    model: &Model,
    tokens: &[u32],
    types: Option<&[u32]>,
    obs: &mut dyn Observer,
) -> crate::model::Result<()> {
    let opts = RunOptions {
        token_types: types.map(<[u32]>::to_vec),
        ..Default::default()
    };
    model.forward(tokens, &opts, obs)?;
    Ok(())
}
