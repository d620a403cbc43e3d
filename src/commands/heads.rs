//! `attnscope heads` (and Python's `head_roles`): a role score for every (layer, head) of each
//! input, one streamed forward per text ([`crate::analysis::heads`] scores them).

pub use crate::analysis::heads::{document, HeadRoles};
use crate::analysis::heads::{roles_of, roles_of_typed};
use crate::model::Model;

/// What `heads` scores: one or more token sequences, or one encoder's sentence pair.
#[derive(Clone, Debug, Default)]
pub struct HeadsInput {
    /// the token sequences (random repeated tokens, each line of a file, or a text)
    pub texts: Vec<Vec<u32>>,
    /// a sentence pair's token types (then `texts` holds the pair alone); `None`: all 0
    pub types: Option<Vec<u32>>,
}

/// The role scores of each of `input`'s texts, in order.
pub fn run(model: &Model, input: &HeadsInput) -> anyhow::Result<Vec<HeadRoles>> {
    match &input.types {
        Some(ty) => Ok(vec![roles_of_typed(model, &input.texts[0], Some(ty))?]),
        None => input.texts.iter().map(|t| roles_of(model, t)).collect(),
    }
}
