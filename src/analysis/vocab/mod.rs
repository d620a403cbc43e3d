//! The shared words of the analyses: what a run predicts ([`Target`]) and how a token is named
//! ([`TokenRef`]), the attribution methods ([`Method`], [`ByMethod`]), the rank statistics, the
//! statistics of one attention row, the rows of a faithfulness report, and what a patching run
//! patches ([`PatchHook`], [`PatchCell`]), and how a report names a model and a token
//! ([`ModelFacts`], [`TokenInfo`], [`TopEntry`]). Every analysis imports them from here; none imports
//! them from another analysis.

mod method;
mod metrics;
mod rank;
mod rows;

pub use method::{ByMethod, Method};
pub use metrics::{best_of, AtK, Best, MetricRow};
pub use rank::{
    average_ranks, kendall_tau_b, kendall_tau_b_pairs, permutation_p, spearman, top_positions,
};
pub use rows::{
    entropy, max_argmax, mean_rows, next_token_top_k, profile_marks, rollout, top_k, Candidate,
    ProfileMarks, Ranked,
};

use crate::model::capture::Hook;
use crate::model::{Model, ModelDims, Result};
use serde::Serialize;

/// What the model should predict: its own next token, an id, or a token's text.
#[derive(Clone, Debug)]
pub enum Target {
    /// the model's own most likely next token
    Next,
    /// a token id
    Id(u32),
    /// a token's text (it must be one token)
    Text(String),
}

impl std::str::FromStr for Target {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Ok(match s {
            "next" => Target::Next,
            _ if !s.is_empty() && s.chars().all(|c| c.is_ascii_digit()) => {
                Target::Id(s.parse().map_err(|e| format!("{e}"))?)
            }
            _ => Target::Text(s.to_string()),
        })
    }
}

impl Target {
    /// The token id: the top of `logits` for [`Target::Next`], else the id or the one token the
    /// text is (an error naming `--target` otherwise).
    pub fn resolve(&self, model: &Model, logits: &[f32]) -> Result<u32> {
        self.resolve_as(model, logits, "--target")
    }

    /// [`Target::resolve`] for the flag `flag` (`--answer`, `--wrong`): its errors name it.
    pub fn resolve_as(&self, model: &Model, logits: &[f32], flag: &str) -> Result<u32> {
        Ok(match self {
            Target::Next => max_argmax(logits).1 as u32,
            Target::Id(i) => {
                if *i as usize >= model.dims.vocab_size {
                    return Err(crate::model::Error::OutOfRange {
                        what: format!("{flag} id"),
                        value: i.to_string(),
                        range: format!("0..{}", model.dims.vocab_size),
                    });
                }
                *i
            }
            Target::Text(t) => single_token(model, t, flag)?,
        })
    }
}

/// The id of `text` when it is exactly one token (as inside a text: no BOS), else an error naming
/// `what` (the flag).
pub fn single_token(model: &Model, text: &str, what: &str) -> Result<u32> {
    // one token as it would appear inside a text: no BOS
    let ids = model.tokenizer.encode_with(text, Some(false))?;
    match ids.as_slice() {
        [one] => Ok(*one),
        _ => Err(crate::model::Error::OutOfRange {
            what: format!("{what} {text:?}"),
            value: format!("({} tokens: {ids:?})", ids.len()),
            range: "text that is exactly one token, or a token id".into(),
        }),
    }
}

/// A token as a report names it: its id and readable text.
#[derive(Clone, Debug, Serialize)]
pub struct TokenRef {
    /// the token id
    pub id: u32,
    /// the token's readable text
    pub text: String,
}

impl TokenRef {
    /// Token `id` with its text.
    pub(crate) fn of(model: &Model, id: u32) -> TokenRef {
        TokenRef {
            id,
            text: model.tokenizer.token_text(id),
        }
    }

    /// Every token of `ids` with its text.
    pub(crate) fn all(model: &Model, ids: &[u32]) -> Vec<TokenRef> {
        ids.iter().map(|&t| TokenRef::of(model, t)).collect()
    }
}

/// Which activation a patching run takes from the clean run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PatchHook {
    /// a decoder layer's input at one position
    ResidPre,
    /// the attention block's output at one position
    AttnOut,
    /// the MLP's output at one position
    MlpOut,
    /// one head's output before `W_O` (`hook_z`) at every position
    Z,
    /// one head's whole attention pattern (`hook_pattern`)
    Pattern,
}

impl PatchHook {
    pub fn hook(self) -> Hook {
        match self {
            PatchHook::ResidPre => Hook::ResidPre,
            PatchHook::AttnOut => Hook::AttnOut,
            PatchHook::MlpOut => Hook::MlpOut,
            PatchHook::Z => Hook::Z,
            PatchHook::Pattern => Hook::Pattern,
        }
    }
    pub fn per_head(self) -> bool {
        matches!(self, PatchHook::Z | PatchHook::Pattern)
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct PatchCell {
    pub layer: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pos: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head: Option<usize>,
    /// answer's logit minus wrong's at the last position of the patched corrupted run
    pub logit_diff: f32,
    /// (patched − corrupt) / (clean − corrupt)
    pub recovered: f32,
}

/// A model's facts, as the reports give them.
#[derive(Clone, Debug, Serialize)]
pub struct ModelFacts {
    pub name: String,
    pub description: Option<String>,
    pub arch: String,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub group_size: usize,
    pub gqa: String,
    pub head_dim: usize,
    pub d_model: usize,
    pub precision: String,
    /// Sliding window of every layer (a query sees itself and the `window - 1` keys before it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    /// The layers that attend through the window (all of them for Mistral, some for Gemma).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub windowed_layers: Vec<usize>,
}

impl ModelFacts {
    pub fn of(m: &Model) -> Self {
        let d: &ModelDims = &m.dims;
        ModelFacts {
            name: m.info.name.clone(),
            description: m.info.description.clone(),
            arch: d.arch.name().into(),
            n_layers: d.n_layers,
            n_heads: d.n_heads,
            n_kv_heads: d.n_kv_heads,
            group_size: d.group_size(),
            gqa: d.gqa_sentence(),
            head_dim: d.head_dim,
            d_model: d.d_model,
            precision: m.info.precision.name().into(),
            sliding_window: d.sliding_window,
            windowed_layers: d.windowed_layers(),
        }
    }
}

/// A token of the text: position, id, text.
#[derive(Clone, Debug, Serialize)]
pub struct TokenInfo {
    pub pos: usize,
    pub id: u32,
    pub text: String,
}

/// An attended key: position, token, weight.
#[derive(Clone, Debug, Serialize)]
pub struct TopEntry {
    pub pos: usize,
    pub token: String,
    pub weight: f32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse() {
        assert!(matches!("next".parse::<Target>().unwrap(), Target::Next));
        assert!(matches!("42".parse::<Target>().unwrap(), Target::Id(42)));
        assert!(matches!(
            " Paris".parse::<Target>().unwrap(),
            Target::Text(_)
        ));
    }
}
