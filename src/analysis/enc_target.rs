//! What `attribute` and `compare` explain on an encoder, which predicts no next token: a vector
//! of the text. `embedding` is the sentence embedding (the last hidden states mean-pooled over
//! every token, as sentence-transformers' Pooling computes it, L2-normalized when the folder's
//! `modules.json` says so); `cls` is the last hidden state of the first token (`[CLS]`, RoBERTa's
//! `<s>`). A variant's score is the cosine similarity of its vector to the text's, and a token's
//! importance by occlusion is `1 − cos(v(text without the token), v(text))`.

use super::vocab::Target;
use crate::model::error::{Error, Result};
use crate::model::forward::l2_normalize;
use crate::model::Model;
use serde::Serialize;

/// The vector an encoder's attribution explains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EncoderTarget {
    /// The mean-pooled sentence embedding (normalized as the folder says).
    Embedding,
    /// The first token's (`[CLS]`'s) last hidden state.
    Cls,
}

impl EncoderTarget {
    /// `embedding` or `cls`.
    pub fn name(self) -> &'static str {
        match self {
            EncoderTarget::Embedding => "embedding",
            EncoderTarget::Cls => "cls",
        }
    }

    /// The encoder's target for `--target`: `next` (the default) and `embedding` give the
    /// sentence embedding, `cls` the \[CLS\] vector; a token (an id or a text) is refused, naming
    /// the two.
    pub fn of(model: &Model, t: &Target) -> Result<Self> {
        match t {
            Target::Next => Ok(EncoderTarget::Embedding),
            Target::Text(s) if s == "embedding" => Ok(EncoderTarget::Embedding),
            Target::Text(s) if s == "cls" => Ok(EncoderTarget::Cls),
            other => Err(Error::NotApplicable(format!(
                "--target {} names a next token, but {} is an encoder (no next-token prediction); an encoder's targets are `embedding` (the mean-pooled sentence embedding, the default) and `cls` (the [CLS] vector)",
                match other {
                    Target::Id(i) => i.to_string(),
                    Target::Text(s) => format!("{s:?}"),
                    Target::Next => "next".into(),
                },
                model.info.name
            ))),
        }
    }

    /// The target vector of `tokens`.
    pub fn vector(self, model: &Model, tokens: &[u32]) -> Result<Vec<f32>> {
        let h = model.encoder_states(tokens)?;
        let dm = model.dims.d_model;
        Ok(match self {
            EncoderTarget::Cls => h[..dm].to_vec(),
            EncoderTarget::Embedding => {
                let mut sum = vec![0f64; dm];
                for row in h.chunks(dm) {
                    sum.iter_mut().zip(row).for_each(|(s, &v)| *s += v as f64);
                }
                let n = tokens.len() as f64;
                let mut e: Vec<f32> = sum.iter().map(|s| (s / n) as f32).collect();
                if model.embeds_normalized() {
                    l2_normalize(&mut e);
                }
                e
            }
        })
    }
}

/// The cosine similarity of two vectors (in f64); 0 when either is zero.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (x as f64, y as f64);
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    if aa == 0.0 || bb == 0.0 {
        0.0
    } else {
        ab / (aa.sqrt() * bb.sqrt())
    }
}

/// Occlusion by deletion on an encoder: for each position i, the cosine similarity of the
/// target vector of `tokens` without token i to that of `tokens`. Returns the similarities
/// (importance is `1 − cos`). Needs two tokens at least; `progress(done, total)` after each
/// forward. With `cls`, deleting position 0 compares the variant's first token (no longer
/// `[CLS]`).
pub fn occlusion_cosines(
    model: &Model,
    tokens: &[u32],
    target: EncoderTarget,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<f64>> {
    let n = tokens.len();
    if n < 2 {
        return Err(Error::OutOfRange {
            what: "text".into(),
            value: format!("{n} token(s)"),
            range: "at least 2 tokens (occlusion deletes one and keeps the rest)".into(),
        });
    }
    let base = target.vector(model, tokens)?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let variant: Vec<u32> = tokens
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != i)
            .map(|(_, &t)| t)
            .collect();
        out.push(cosine(&target.vector(model, &variant)?, &base));
        progress(i + 1, n);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cosine_by_hand() {
        // (1, 0)·(1, 1) = 1; ‖·‖ = 1 and √2 → 1/√2
        assert!((cosine(&[1.0, 0.0], &[1.0, 1.0]) - 0.5f64.sqrt()).abs() < 1e-12);
        assert!((cosine(&[2.0, 4.0], &[1.0, 2.0]) - 1.0).abs() < 1e-12);
        assert_eq!(cosine(&[0.0, 0.0], &[1.0, 2.0]), 0.0);
        assert!((cosine(&[1.0, 0.0], &[-3.0, 0.0]) + 1.0).abs() < 1e-12);
    }
}
