//! `corpus` on an encoder (BERT): there is no next token and no causal sink profile, so each
//! text's record holds what Clark et al. (2019) measure instead: per layer, the share of
//! attention on `[CLS]`, on `[SEP]` and on punctuation (mean over heads and queries, as
//! `inspect` computes it), and per head the shares on `[CLS]` and `[SEP]`. The aggregate is the
//! mean over texts (each text counts once), with its spread, and the fraction of (text, head)
//! pairs that put most of their attention on `[SEP]`. Records are JSON lines with
//! `"kind": "encoder"`; `corpus merge` combines shards of them.

use super::corpus::{not_a_record, settings_agree, stat, Made, Stat};
use super::encoder::shares_of_patterns;
use crate::model::capture::{AttnCache, CaptureSpec};
use crate::model::forward::RunOptions;
use crate::model::Model;
use serde::{Deserialize, Serialize};

/// What one text contributes.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct EncoderRecord {
    /// Index of the text in its corpus.
    pub id: usize,
    pub text: String,
    pub model: String,
    /// The model file, precision and version that made it (`bos` false).
    #[serde(flatten)]
    pub made: Made,
    /// Always "encoder": what tells these records from a decoder's.
    pub kind: String,
    pub n_tokens: usize,
    /// Per layer: the share of attention on \[CLS\] (mean over heads and queries).
    pub cls: Vec<f32>,
    /// Per layer: the share on \[SEP\].
    pub sep: Vec<f32>,
    /// Per layer: the share on punctuation tokens.
    pub punct: Vec<f32>,
    /// Per layer, per head: the share on \[CLS\] (mean over queries).
    pub head_cls: Vec<Vec<f32>>,
    /// Per layer, per head: the share on \[SEP\].
    pub head_sep: Vec<Vec<f32>>,
}

/// A head counts as \[SEP\]-attending in a text when at least this share of its attention (mean
/// over queries) lands on \[SEP\].
pub const SEP_HEAD_SHARE: f32 = 0.5;

/// Whether the first record of a record file is an encoder's.
pub fn is_encoder_file(text: &str) -> bool {
    text.lines()
        .find(|l| !l.trim().is_empty())
        .and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .is_some_and(|v| v["kind"] == "encoder")
}

/// The record of text `id` on an encoder (one text: every token type 0). The outer error is the
/// engine's (fatal); the inner one the text's own (empty, too long: the text is skipped).
pub fn encoder_record(
    model: &Model,
    id: usize,
    text: &str,
) -> anyhow::Result<Result<EncoderRecord, String>> {
    let tokens = match model.encode(text, false) {
        Ok(t) => t,
        Err(e) => return Ok(Err(e.to_string())),
    };
    let (n, nl, nh) = (tokens.len(), model.dims.n_layers, model.dims.n_heads);
    let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
    model.forward(&tokens, &RunOptions::default(), &mut cache)?;
    let maps: Vec<&[f32]> = (0..nl)
        .map(|l| cache.pattern(l).expect("every layer was captured").data)
        .collect();
    let shares = shares_of_patterns(model, &tokens, maps.iter().copied());
    let (cls_id, sep_id) = model.special_ids();
    let made = Made::of(model, false)?;
    let per_head = |id: Option<u32>| -> Vec<Vec<f32>> {
        let cols: Vec<usize> = (0..n).filter(|&j| Some(tokens[j]) == id).collect();
        maps.iter()
            .map(|p| {
                (0..nh)
                    .map(|h| {
                        let s: f64 = (0..n)
                            .map(|i| {
                                let row = &p[(h * n + i) * n..][..n];
                                cols.iter().map(|&j| row[j] as f64).sum::<f64>()
                            })
                            .sum();
                        (s / n as f64) as f32
                    })
                    .collect()
            })
            .collect()
    };
    Ok(Ok(EncoderRecord {
        id,
        text: text.to_string(),
        model: model.info.name.clone(),
        made,
        kind: "encoder".into(),
        n_tokens: n,
        cls: shares.cls,
        sep: shares.sep,
        punct: shares.punct,
        head_cls: per_head(cls_id),
        head_sep: per_head(sep_id),
    }))
}

/// A record's own shape: `kind` "encoder", at least one layer, every per-layer array as long as
/// the layer count, the same number of heads (at least one) in every layer, shares in [0, 1].
pub fn check_encoder_record(r: &EncoderRecord) -> Result<(), String> {
    if r.kind != "encoder" {
        return Err(format!("its kind is `{}`, not `encoder`", r.kind));
    }
    let nl = r.cls.len();
    if nl == 0 || r.n_tokens == 0 {
        return Err("it has no layers or no tokens".into());
    }
    for (name, len) in [
        ("sep", r.sep.len()),
        ("punct", r.punct.len()),
        ("head_cls", r.head_cls.len()),
        ("head_sep", r.head_sep.len()),
    ] {
        if len != nl {
            return Err(format!("`{name}` has {len} layers but `cls` has {nl}"));
        }
    }
    let heads = r.head_sep[0].len();
    if heads == 0
        || r.head_cls
            .iter()
            .chain(&r.head_sep)
            .any(|h| h.len() != heads)
    {
        return Err(format!(
            "its per-head arrays do not all have {heads} (≥ 1) heads"
        ));
    }
    let all = r
        .cls
        .iter()
        .chain(&r.sep)
        .chain(&r.punct)
        .chain(r.head_cls.iter().flatten())
        .chain(r.head_sep.iter().flatten());
    if let Some(v) = all.into_iter().find(|v| !(-1e-4..=1.0 + 1e-4).contains(*v)) {
        return Err(format!("a share is {v}, outside [0, 1]"));
    }
    Ok(())
}

/// Reads encoder record files (`(text, source name)` each), checking every record and that all
/// come from one model with the same layers and heads and settings ([`Made`]), and that an id
/// seen twice is the same record (text and numbers); errors name the file and line.
pub fn read_encoder_records<S: AsRef<str>>(files: &[(S, S)]) -> Result<Vec<EncoderRecord>, String> {
    let mut out: Vec<EncoderRecord> = Vec::new();
    let mut first_at = String::new();
    for (text, source) in files {
        let source = source.as_ref();
        for (i, line) in text.as_ref().lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let at = format!("{source}:{}", i + 1);
            let r: EncoderRecord = serde_json::from_str(line).map_err(|e| {
                not_a_record(line, &at, &e, "encoder corpus record (merge the records of one model, written by `attnscope corpus --out`, at a time)")
            })?;
            check_encoder_record(&r)
                .map_err(|e| format!("{at}: record {} is malformed: {e}", r.id))?;
            if let Some(r0) = out.first() {
                if r.model != r0.model
                    || r.cls.len() != r0.cls.len()
                    || r.head_sep[0].len() != r0.head_sep[0].len()
                {
                    return Err(format!(
                        "{at}: record {} comes from model `{}`, but {first_at} from `{}`; merge the records of one model at a time",
                        r.id, r.model, r0.model
                    ));
                }
                settings_agree(&r.made, &at, &r0.made, &first_at)?;
            } else {
                first_at = at.clone();
            }
            if let Some(o) = out.iter().find(|o| o.id == r.id && o.text != r.text) {
                return Err(format!(
                    "{at}: record {} is for another text than an earlier record {}; the files come from different corpora",
                    r.id, o.id
                ));
            }
            if out.iter().any(|o| o.id == r.id && *o != r) {
                return Err(format!(
                    "{at}: record {} repeats an earlier record's text with other numbers; the two come from different runs, and merging them once would keep whichever came first",
                    r.id
                ));
            }
            out.push(r);
        }
    }
    if out.is_empty() {
        return Err("the files hold no records".into());
    }
    Ok(out)
}

/// One layer of [`EncoderAggregate`]: each share's mean over texts, with its spread.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct EncoderLayerAggregate {
    pub layer: usize,
    pub cls: Stat,
    pub sep: Stat,
    pub punct: Stat,
    /// The fraction of (text, head) pairs whose share on \[SEP\] is at least [`SEP_HEAD_SHARE`].
    pub sep_heads_fraction: f64,
    /// The same for \[CLS\].
    pub cls_heads_fraction: f64,
}

/// What `corpus` reports on an encoder.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct EncoderAggregate {
    pub model: String,
    /// "encoder".
    pub kind: &'static str,
    pub sentences: usize,
    pub tokens: usize,
    pub layers: Vec<EncoderLayerAggregate>,
    /// The layer with the largest mean share on \[SEP\].
    pub peak_sep_layer: usize,
}

/// Aggregates encoder records (order and duplicates by id do not matter).
pub fn aggregate_encoder(records: &[EncoderRecord]) -> Result<EncoderAggregate, String> {
    let mut recs: Vec<&EncoderRecord> = records.iter().collect();
    recs.sort_by_key(|r| r.id);
    recs.dedup_by_key(|r| r.id);
    let first = recs.first().ok_or("no records to aggregate")?;
    for r in &recs {
        check_encoder_record(r).map_err(|e| format!("record {} is malformed: {e}", r.id))?;
        if r.model != first.model || r.cls.len() != first.cls.len() {
            return Err(format!(
                "record {} comes from model `{}`, others from `{}`; aggregate one model at a time",
                r.id, r.model, first.model
            ));
        }
    }
    let nl = first.cls.len();
    let frac = |pick: &dyn Fn(&EncoderRecord) -> &Vec<Vec<f32>>, l: usize| -> f64 {
        let (mut hit, mut all) = (0usize, 0usize);
        for r in &recs {
            for &s in &pick(r)[l] {
                all += 1;
                hit += (s >= SEP_HEAD_SHARE) as usize;
            }
        }
        hit as f64 / all.max(1) as f64
    };
    let layers: Vec<EncoderLayerAggregate> = (0..nl)
        .map(|l| {
            let col = |f: &dyn Fn(&EncoderRecord) -> &Vec<f32>| -> Stat {
                stat(&recs.iter().map(|r| f(r)[l] as f64).collect::<Vec<_>>())
            };
            EncoderLayerAggregate {
                layer: l,
                cls: col(&|r| &r.cls),
                sep: col(&|r| &r.sep),
                punct: col(&|r| &r.punct),
                sep_heads_fraction: frac(&|r| &r.head_sep, l),
                cls_heads_fraction: frac(&|r| &r.head_cls, l),
            }
        })
        .collect();
    let peak_sep_layer = layers
        .iter()
        .max_by(|a, b| {
            a.sep
                .mean
                .total_cmp(&b.sep.mean)
                .then(b.layer.cmp(&a.layer))
        })
        .map_or(0, |l| l.layer);
    Ok(EncoderAggregate {
        model: first.model.clone(),
        kind: "encoder",
        sentences: recs.len(),
        tokens: recs.iter().map(|r| r.n_tokens).sum(),
        layers,
        peak_sep_layer,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: usize, sep: f32, heads: [f32; 2]) -> EncoderRecord {
        EncoderRecord {
            id,
            text: format!("text {id}"),
            model: "m".into(),
            made: Made {
                model_sha256: "cd".repeat(32),
                bos: false,
                precision: "exact".into(),
                attnscope_version: env!("CARGO_PKG_VERSION").into(),
            },
            kind: "encoder".into(),
            n_tokens: 4,
            cls: vec![0.1],
            sep: vec![sep],
            punct: vec![0.2],
            head_cls: vec![vec![0.1, 0.1]],
            head_sep: vec![heads.to_vec()],
        }
    }

    #[test]
    fn aggregate_by_hand_and_shards_merge_to_one_run() {
        let all = vec![
            rec(0, 0.2, [0.1, 0.6]),
            rec(1, 0.4, [0.5, 0.3]),
            rec(2, 0.6, [0.9, 0.2]),
        ];
        let a = aggregate_encoder(&all).unwrap();
        let l = &a.layers[0];
        assert!((l.sep.mean - 0.4).abs() < 1e-7);
        assert!(
            (l.sep.std - 0.2).abs() < 1e-7,
            "sample std of 0.2, 0.4, 0.6"
        );
        // heads at or above 0.5 on [SEP]: 0.6, 0.5, 0.9 of six
        assert!((l.sep_heads_fraction - 0.5).abs() < 1e-12);
        assert_eq!(l.cls_heads_fraction, 0.0);
        // two shard files, one repeating a record, merge to the same aggregate
        let line = |r: &EncoderRecord| serde_json::to_string(r).unwrap() + "\n";
        let f1 = line(&all[0]) + &line(&all[2]);
        let f2 = line(&all[1]) + &line(&all[0]);
        let read = read_encoder_records(&[(f1.as_str(), "a"), (f2.as_str(), "b")]).unwrap();
        assert_eq!(aggregate_encoder(&read).unwrap(), a);
        assert!(is_encoder_file(&f1));
        // a decoder's record, another model, a share past 1: refused, naming the place
        let e = read_encoder_records(&[("{\"id\":0,\"text\":\"x\"}\n", "d")]).unwrap_err();
        assert!(e.contains("d:1"), "{e}");
        let mut other = all[1].clone();
        other.model = "other".into();
        let f3 = line(&other);
        let e = read_encoder_records(&[(f1.as_str(), "a"), (f3.as_str(), "c")]).unwrap_err();
        assert!(e.contains("c:1") && e.contains("other"), "{e}");
        let mut bad = all[1].clone();
        bad.sep = vec![1.5];
        assert!(check_encoder_record(&bad).is_err());
    }
}
