//! Sentence embeddings of an encoder, as sentence-transformers computes them: the mean of the
//! last hidden states over every token (\[CLS\] and \[SEP\] included), then divided by its L2 norm
//! when the model folder's `modules.json` lists a `Normalize` module (all-MiniLM-L6-v2's does).
//! Texts run in parallel, [`EMBED_BATCH`] at a time in one forward: their rows stacked for the
//! projections (each weight matrix read once per batch, not once per text), the attention run
//! per text (each its own sequence, so there is no padding to mask).

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

/// How many texts one forward of [`Model::embed_texts`] stacks.
pub const EMBED_BATCH: usize = 32;

/// Keeps the last layer's `hook_resid_post` (the last hidden states of every stacked text).
struct LastHidden {
    layer: usize,
    out: Vec<f32>,
}

impl crate::model::capture::Observer for LastHidden {
    fn wants(&self, layer: usize, hook: crate::model::capture::Hook) -> bool {
        layer == self.layer && hook == crate::model::capture::Hook::ResidPost
    }
    fn tensor(&mut self, _: usize, _: crate::model::capture::Hook, _: &[usize], data: &[f32]) {
        self.out = data.to_vec();
    }
    fn attention_block(
        &mut self,
        _: usize,
        _: crate::model::capture::Hook,
        _: usize,
        _: [usize; 3],
        _: &[f32],
    ) {
    }
}

impl Model {
    /// Mean-pooled last hidden states of several token sequences in one forward (each its own
    /// sequence; the projections run on their stacked rows). `[seqs.len()][d_model]`.
    pub fn embed_batch(&self, seqs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        let segs: Vec<super::Segment> = seqs
            .iter()
            .map(|t| super::Segment {
                tokens: t,
                reuse: 0,
                knockout: Vec::new(),
                logits_at: Vec::new(),
            })
            .collect();
        let mut last = LastHidden {
            layer: self.dims.n_layers - 1,
            out: Vec::new(),
        };
        self.forward_segments(None, &segs, None, &super::RunOptions::default(), &mut last)?;
        let dm = self.dims.d_model;
        let mut rows = last.out.chunks(dm);
        Ok(seqs
            .iter()
            .map(|t| {
                let mut sum = vec![0f64; dm];
                for row in rows.by_ref().take(t.len()) {
                    sum.iter_mut().zip(row).for_each(|(s, &v)| *s += v as f64);
                }
                sum.iter().map(|s| (s / t.len() as f64) as f32).collect()
            })
            .collect())
    }

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
                "sentence embeddings are for an encoder (BERT: mean-pooled last hidden state); {} is a decoder: pass an encoder with -m, such as all-minilm-l6-v2",
                self.info.name
            )));
        }
        let normalize = normalize.unwrap_or_else(|| self.embeds_normalized());
        let max_seq = self.embed_max_seq_length();
        let seqs: Vec<(Vec<u32>, Option<Vec<u32>>)> = texts
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
                Ok((tokens, types))
            })
            .collect::<Result<_>>()?;
        // single texts (every type 0) run EMBED_BATCH to a forward; a pair (its types) alone
        let singles: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].1.is_none()).collect();
        let batched: Vec<Vec<Vec<f32>>> = singles
            .par_chunks(EMBED_BATCH)
            .map(|idx| {
                let batch: Vec<Vec<u32>> = idx.iter().map(|&i| seqs[i].0.clone()).collect();
                let es = self.embed_batch(&batch)?;
                es.iter().for_each(|_| progress());
                Ok(es)
            })
            .collect::<Result<_>>()?;
        let mut rows: Vec<Vec<f32>> = vec![Vec::new(); seqs.len()];
        for (idx, es) in singles.chunks(EMBED_BATCH).zip(batched) {
            for (&i, e) in idx.iter().zip(es) {
                rows[i] = e;
            }
        }
        let pairs: Vec<(usize, Vec<f32>)> = (0..seqs.len())
            .into_par_iter()
            .filter(|&i| seqs[i].1.is_some())
            .map(|i| {
                let e = self.embed_tokens_typed(&seqs[i].0, seqs[i].1.as_deref())?;
                progress();
                Ok((i, e))
            })
            .collect::<Result<_>>()?;
        for (i, e) in pairs {
            rows[i] = e;
        }
        if normalize {
            rows.iter_mut().for_each(|e| l2_normalize(e));
        }
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
