//! `attnscope corpus` as one call ([`run_corpus`]): the texts (a file, a list or the built-in
//! corpus), the shard and limit that select some of them, `--out`'s record file (records
//! appended as they are made, a rerun resuming from them), the records of a decoder or an
//! encoder, and their aggregate; [`merge_files`] is `corpus merge`.

use super::corpus::{
    aggregate, builtin, parse_lines, read_record_files, text_records, Aggregate, Made, Record,
    BATCH_TEXTS,
};
use super::corpus_encoder::{
    aggregate_encoder, encoder_record, is_encoder_file, read_encoder_records, EncoderAggregate,
    EncoderRecord,
};
use super::files::{read_lines_file, Output, ReadLimit};
use super::request::usage;
use crate::model::Model;
use anyhow::Context;
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The texts of a corpus file (`.txt`: one per line, `#` lines comments; `.jsonl`: strings or
/// objects with `"text"`), or of the built-in corpus for `None`, with the ids `corpus` gives
/// them (their index), and a name for the source.
pub fn load_texts(file: Option<&Path>) -> anyhow::Result<(Vec<String>, String)> {
    let Some(f) = file else {
        return Ok((builtin(), "the built-in corpus".into()));
    };
    // each line up to what a text of the longest context may take (the model checks its own)
    let text = read_lines_file(f, &ReadLimit::any_model())?;
    let texts = if f.extension().is_some_and(|e| e == "jsonl") {
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                let v: serde_json::Value = serde_json::from_str(l)
                    .map_err(|e| usage(format!("{}:{}: not JSON: {e}", f.display(), i + 1)))?;
                match v {
                    serde_json::Value::String(s) => Ok(s),
                    serde_json::Value::Object(o) => o
                        .get("text")
                        .and_then(|t| t.as_str())
                        .map(String::from)
                        .ok_or_else(|| {
                            usage(format!("{}:{}: no \"text\" field", f.display(), i + 1))
                        }),
                    _ => Err(usage(format!(
                        "{}:{}: expected a string or an object with \"text\"",
                        f.display(),
                        i + 1
                    ))),
                }
            })
            .collect::<anyhow::Result<Vec<_>>>()?
    } else {
        parse_lines(&text, false)
    };
    if texts.is_empty() {
        return Err(usage(format!("{} holds no texts", f.display())));
    }
    Ok((texts, f.display().to_string()))
}

/// `i/n` (`0 <= i < n`): shard `i` of `n` runs the texts whose index % n == i.
pub fn parse_shard(s: &str) -> anyhow::Result<(usize, usize)> {
    let bad = || {
        usage(format!(
            "--shard {s} is not of the form i/n with 0 <= i < n, e.g. 0/4"
        ))
    };
    let (i, n) = s.split_once('/').ok_or_else(bad)?;
    let (i, n): (usize, usize) = (
        i.trim().parse().map_err(|_| bad())?,
        n.trim().parse().map_err(|_| bad())?,
    );
    if n == 0 || i >= n {
        return Err(bad());
    }
    Ok((i, n))
}

/// What `corpus` is asked: the CLI's flags, Python's `corpus` arguments.
#[derive(Clone, Debug)]
pub struct CorpusRequest {
    /// Only the first `limit` texts.
    pub limit: Option<usize>,
    /// Shard `(i, n)`: the texts whose index % n == i ([`parse_shard`]); `(0, 1)` for all.
    pub shard: (usize, usize),
    /// The record file: one JSON record per text appended as it is made; the texts it already
    /// holds are not run again (resume).
    pub out: Option<PathBuf>,
    /// Also the faithfulness measurement of every text (a decoder's only).
    pub faithfulness: bool,
    /// A head counts as a sink head when its mean first-token weight exceeds this.
    pub epsilon: f32,
    /// A BOS token first although the model's metadata does not ask for one.
    pub bos: bool,
    /// The files the run reads (its texts' file, the model's): `out` is never one of them.
    pub inputs: Vec<PathBuf>,
}

impl Default for CorpusRequest {
    /// Every text, no record file, ε 0.3, the model's own BOS.
    fn default() -> Self {
        CorpusRequest {
            limit: None,
            shard: (0, 1),
            out: None,
            faithfulness: false,
            epsilon: 0.3,
            bos: false,
            inputs: Vec::new(),
        }
    }
}

impl CorpusRequest {
    /// `, shard i/n` when the texts are sharded (for the source's name).
    pub fn shard_suffix(&self) -> String {
        let (si, sn) = self.shard;
        if sn > 1 {
            format!(", shard {si}/{sn}")
        } else {
            String::new()
        }
    }
}

/// The aggregate over a corpus: a decoder's (sinks, concentration, massive activations,
/// faithfulness) or an encoder's (\[CLS\]/\[SEP\]/punctuation). Serialized as the aggregate itself
/// (`corpus --json`).
#[derive(Clone, Debug, Serialize)]
#[serde(untagged)]
pub enum CorpusAggregate {
    /// A decoder's aggregate.
    Decoder(Aggregate),
    /// An encoder's aggregate.
    Encoder(EncoderAggregate),
}

/// What [`run_corpus`] made: the aggregate, and the texts it skipped, each with its reason
/// (empty, too long: `text 3: ...`).
#[derive(Clone, Debug)]
pub struct CorpusOutcome {
    /// the statistics over the texts that ran
    pub aggregate: CorpusAggregate,
    /// the texts skipped, each with its reason
    pub skipped: Vec<String>,
}

/// `attnscope corpus`: runs the texts `req` selects (`source` names them in messages), appends
/// each record to `req.out` (resuming from the records it holds), and aggregates every record.
/// `note` hears what the caller should be told (a torn last line dropped from `out`);
/// `progress(done, total)` follows a decoder's texts.
pub fn run_corpus(
    model: &Model,
    texts: &[String],
    source: &str,
    req: &CorpusRequest,
    note: &mut dyn FnMut(&str),
    progress: &mut dyn FnMut(usize, usize),
) -> anyhow::Result<CorpusOutcome> {
    let (si, sn) = req.shard;
    let selected: Vec<usize> = (0..texts.len().min(req.limit.unwrap_or(usize::MAX)))
        .filter(|i| i % sn == si)
        .collect();
    if model.is_encoder() {
        if req.faithfulness {
            return Err(usage(format!("--faithfulness ranks tokens against a next token's probability; {} is an encoder (no next-token prediction)", model.info.name)));
        }
        let source = format!("{source}{}", req.shard_suffix());
        return run_encoder(model, texts, &selected, req, &source, note);
    }
    let made = Made::of(model, req.bos)?;
    let (mut records, mut out_file) = resume::<Record>(
        Resume {
            req,
            model: &model.info.name,
            made: &made,
            texts,
            source,
        },
        &|t, name| {
            if t.trim().is_empty() {
                Ok(Vec::new())
            } else {
                read_record_files(&[(t, name)])
            }
        },
        &|r| (r.model.as_str(), r.id, r.text.as_str(), &r.made),
        note,
    )?;
    let todo: Vec<usize> = selected
        .iter()
        .copied()
        .filter(|i| !records.iter().any(|r| r.id == *i))
        .collect();
    let mut skipped = Vec::new();
    let mut done = 0;
    // many texts to a forward (`text_records`), their records written as each chunk ends
    for chunk in todo.chunks(BATCH_TEXTS) {
        let items: Vec<(usize, &str)> = chunk.iter().map(|&i| (i, texts[i].as_str())).collect();
        let recs = text_records(model, &items, req.bos, req.faithfulness, |_| {})?;
        for (&i, rec) in chunk.iter().zip(recs) {
            done += 1;
            let rec = match rec {
                Ok(r) => r,
                Err(e) => {
                    skipped.push(format!("text {i}: {e}"));
                    progress(done, todo.len());
                    continue;
                }
            };
            if let Some(f) = out_file.as_mut() {
                writeln!(f, "{}", serde_json::to_string(&rec)?).context("appending to --out")?;
                f.flush()?;
            }
            records.push(rec);
            progress(done, todo.len());
        }
    }
    Ok(CorpusOutcome {
        aggregate: CorpusAggregate::Decoder(aggregate(&records, req.epsilon).map_err(usage)?),
        skipped,
    })
}

/// [`run_corpus`] on an encoder: the `selected` texts' records appended to `req.out` (skipping
/// those it already holds), and their aggregate.
fn run_encoder(
    model: &Model,
    texts: &[String],
    selected: &[usize],
    req: &CorpusRequest,
    source: &str,
    note: &mut dyn FnMut(&str),
) -> anyhow::Result<CorpusOutcome> {
    let made = Made::of(model, false)?;
    let (mut records, mut out_file) = resume::<EncoderRecord>(
        Resume {
            req,
            model: &model.info.name,
            made: &made,
            texts,
            source,
        },
        &|t, name| {
            if t.trim().is_empty() {
                Ok(Vec::new())
            } else {
                read_encoder_records(&[(t, name)])
            }
        },
        &|r| (r.model.as_str(), r.id, r.text.as_str(), &r.made),
        note,
    )?;
    let mut skipped = Vec::new();
    for &i in selected {
        if records.iter().any(|r| r.id == i) {
            continue;
        }
        let rec = match encoder_record(model, i, &texts[i])? {
            Ok(r) => r,
            Err(e) => {
                skipped.push(format!("text {i}: {e}"));
                continue;
            }
        };
        if let Some(f) = out_file.as_mut() {
            writeln!(f, "{}", serde_json::to_string(&rec)?).context("appending to --out")?;
            f.flush()?;
        }
        records.push(rec);
    }
    Ok(CorpusOutcome {
        aggregate: CorpusAggregate::Encoder(aggregate_encoder(&records).map_err(usage)?),
        skipped,
    })
}

/// `attnscope corpus merge`: the aggregate of the records in `files` (a decoder's or an
/// encoder's, not both), equal to a single run's over all their texts.
pub fn merge_files(files: &[PathBuf], epsilon: f32) -> anyhow::Result<CorpusAggregate> {
    let mut texts = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(f)
            .map_err(|e| usage(format!("cannot read {}: {e}", f.display())))?;
        texts.push((text, f.display().to_string()));
    }
    let encoders = texts.iter().filter(|(t, _)| is_encoder_file(t)).count();
    if encoders == texts.len() {
        let records = read_encoder_records(&texts).map_err(usage)?;
        return Ok(CorpusAggregate::Encoder(
            aggregate_encoder(&records).map_err(usage)?,
        ));
    }
    if encoders > 0 {
        return Err(usage(format!(
            "{encoders} of the {} record files hold an encoder's records and the others a decoder's; merge the records of one model at a time",
            texts.len()
        )));
    }
    let records = read_record_files(&texts).map_err(usage)?;
    Ok(CorpusAggregate::Decoder(
        aggregate(&records, epsilon).map_err(usage)?,
    ))
}

/// What a run resumes into: its request (`out`, `inputs`), its model's name and settings, its
/// texts and their source's name.
struct Resume<'a> {
    req: &'a CorpusRequest,
    model: &'a str,
    made: &'a Made,
    texts: &'a [String],
    source: &'a str,
}

/// Refuses a record of `path` (its model, id, text and settings) that this run would not have
/// made: another model, other settings, or a text that is not text `id` here.
fn check_resumed(
    path: &Path,
    (model, id, t, made): (&str, usize, &str, &Made),
    run: &Resume<'_>,
) -> anyhow::Result<()> {
    if model != run.model {
        return Err(usage(format!(
            "{} holds records of model `{model}`, not `{}`; use another --out",
            path.display(),
            run.model
        )));
    }
    if let Some((name, was, now)) = made.differs(run.made) {
        return Err(usage(format!(
            "{} holds records made with {name} {was} (record {id}), but this run has {name} {now}; records made otherwise give other numbers: use another --out, or this file's settings",
            path.display()
        )));
    }
    if run.texts.get(id).map(String::as_str) != Some(t) {
        return Err(usage(format!(
            "{} holds record {id} for a text that is not text {id} of {}; use another --out",
            path.display(),
            run.source
        )));
    }
    Ok(())
}

/// `--out`'s records so far and the file opened for appending (none without `--out`): a torn last
/// line (a run killed while appending: no newline, not a whole record) is dropped and its text runs
/// again; a whole record whose newline was never written gets it. Records of another model, made
/// with other settings ([`Made`]), or of a text that is not the same text here, are refused: the
/// file belongs to another run. `out` is checked first ([`Output::check_append`]: never one of the
/// inputs, in a folder that takes it). `parse(text, name)` reads a file's records, `meta(r)` gives
/// a record's (model, id, text, settings); `note` hears that a torn line was dropped.
#[allow(clippy::type_complexity)]
fn resume<R: serde::de::DeserializeOwned>(
    run: Resume<'_>,
    parse: &dyn Fn(&str, &str) -> Result<Vec<R>, String>,
    meta: &dyn Fn(&R) -> (&str, usize, &str, &Made),
    note: &mut dyn FnMut(&str),
) -> anyhow::Result<(Vec<R>, Option<std::fs::File>)> {
    let Some(path) = run.req.out.as_deref() else {
        return Ok((Vec::new(), None));
    };
    let inputs: Vec<&Path> = run.req.inputs.iter().map(PathBuf::as_path).collect();
    Output::check_append(path, &inputs)?;
    let mut records = Vec::new();
    if path.exists() {
        let mut text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        if !text.is_empty() && !text.ends_with('\n') {
            let start = text.rfind('\n').map_or(0, |i| i + 1);
            let last = &text[start..];
            let complete = serde_json::from_str::<R>(last).is_ok();
            // only a fragment of one of our records is dropped, and only below records that
            // read back: another kind of file is refused by `parse` below, untouched
            if !complete && last.starts_with("{\"id\":") && parse(&text[..start], "").is_ok() {
                note(&format!("{} ends in a torn line ({} bytes, written when a run was stopped); dropping it, its text runs again", path.display(), last.len()));
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .and_then(|f| f.set_len(start as u64))
                    .with_context(|| format!("dropping the torn line of {}", path.display()))?;
                text.truncate(start);
            } else if complete {
                // a whole record whose newline was never written: end its line before appending
                std::fs::OpenOptions::new()
                    .append(true)
                    .open(path)
                    .and_then(|mut f| f.write_all(b"\n"))
                    .with_context(|| format!("appending to {}", path.display()))?;
            }
        }
        records = parse(&text, &path.display().to_string()).map_err(usage)?;
        for r in &records {
            check_resumed(path, meta(r), &run)?;
        }
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    Ok((records, Some(file)))
}
