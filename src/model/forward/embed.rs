//! Sentence embeddings of an encoder, as sentence-transformers computes them: the mean of the
//! last hidden states over every token ([CLS] and [SEP] included), then divided by its L2 norm
//! when the model folder's `modules.json` lists a `Normalize` module (all-MiniLM-L6-v2's does).
//! Texts run in parallel (one sequence each, so there is no padding to mask).

use crate::model::error::{Error, Result};
use crate::model::Model;
use rayon::prelude::*;

/// One input to [`Model::embed_texts`]: a text, or a sentence pair `[CLS] a [SEP] b [SEP]`.
#[derive(Clone, Debug)]
pub struct EmbedInput {
    /// The (first) text.
    pub text: String,
    /// The pair's second text, if any.
    pub pair: Option<String>,
}

impl Model {
    /// Whether the model folder's `modules.json` (sentence-transformers) lists a `Normalize`
    /// module, i.e. whether its embeddings are L2-normalized. `false` when there is no such file.
    pub fn embeds_normalized(&self) -> bool {
        let path = self.info.path.join("modules.json");
        let Ok(text) = std::fs::read_to_string(&path) else {
            return false;
        };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
            return false;
        };
        v.as_array().is_some_and(|mods| {
            mods.iter().any(|m| {
                m["type"]
                    .as_str()
                    .is_some_and(|t| t.ends_with(".Normalize") || t == "Normalize")
            })
        })
    }

    /// The `max_seq_length` of the model folder's `sentence_bert_config.json`, if any: where
    /// sentence-transformers cuts a text.
    pub fn embed_max_seq_length(&self) -> Option<usize> {
        let text =
            std::fs::read_to_string(self.info.path.join("sentence_bert_config.json")).ok()?;
        let v = serde_json::from_str::<serde_json::Value>(&text).ok()?;
        v["max_seq_length"].as_u64().map(|m| m as usize)
    }

    /// Sentence embeddings `[texts.len(), d_model]`, row-major: each text's mean-pooled last
    /// hidden state ([`Model::embed_tokens`]), L2-normalized when `normalize` says so (`None`:
    /// as [`Model::embeds_normalized`] says). Texts run in parallel; `progress` is called once
    /// per finished text (from any thread). Refused for a decoder, an empty text, a text past
    /// the model's positions or past sentence-transformers' `max_seq_length` (which would cut it).
    pub fn embed_texts(
        &self,
        texts: &[EmbedInput],
        normalize: Option<bool>,
        progress: &(dyn Fn() + Sync),
    ) -> Result<Vec<f32>> {
        if !self.is_encoder() {
            return Err(Error::NotApplicable(format!(
                "sentence embeddings are for an encoder (BERT: mean-pooled last hidden state); {} is a decoder",
                self.info.name
            )));
        }
        let normalize = normalize.unwrap_or_else(|| self.embeds_normalized());
        let max_seq = self.embed_max_seq_length();
        let rows: Vec<Vec<f32>> = texts
            .par_iter()
            .map(|t| {
                let (tokens, types) = match &t.pair {
                    Some(b) => {
                        let (ids, types) = self.encode_pair(&t.text, b)?;
                        (ids, Some(types))
                    }
                    // one text: every type 0, a literal [SEP] inside it included
                    None => (self.encode(&t.text, false)?, None),
                };
                if let Some(max) = max_seq.filter(|&m| tokens.len() > m) {
                    return Err(Error::NotApplicable(format!(
                        "the text `{}` has {} tokens, more than the max_seq_length {max} of the model's sentence_bert_config.json, where sentence-transformers would cut it; shorten it",
                        t.text,
                        tokens.len()
                    )));
                }
                let mut e = self.embed_tokens_typed(&tokens, types.as_deref())?;
                if normalize {
                    l2_normalize(&mut e);
                }
                progress();
                Ok(e)
            })
            .collect::<Result<_>>()?;
        Ok(rows.concat())
    }
}

/// Divides `v` by its L2 norm, clamped below at 1e-12 as torch's `F.normalize` does.
pub fn l2_normalize(v: &mut [f32]) {
    let norm = v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
    let d = norm.max(1e-12);
    v.iter_mut().for_each(|x| *x = (*x as f64 / d) as f32);
}

#[cfg(test)]
mod tests {
    use super::l2_normalize;

    #[test]
    fn l2_normalize_by_hand() {
        let mut v = [3.0f32, 4.0];
        l2_normalize(&mut v);
        assert_eq!(v, [0.6, 0.8]);
        let mut z = [0.0f32, 0.0];
        l2_normalize(&mut z);
        assert_eq!(z, [0.0, 0.0]);
    }
}
