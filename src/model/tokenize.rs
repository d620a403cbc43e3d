//! Text → token ids, with the Hugging Face `tokenizers` crate.
//!
//! A `tokenizer.json` is loaded as it is. A GGUF file carries its tokenizer in metadata
//! (`tokenizer.ggml.*`); we translate that into the equivalent `tokenizer.json` and load it the
//! same way, so both formats go through one, well-tested BPE implementation. The pre-tokenizer
//! (how text is split before BPE) is chosen by `tokenizer.ggml.pre` and must be known: an unknown
//! value is an error, never a silent fallback (a wrong split gives plausible but wrong ids).
//! The BPE model itself (vocabulary and merges) is built directly with the crate's builder, not
//! through JSON, with what the JSON would have said: a 151,936-token vocabulary and its 151,387
//! merges took ~0.6 s of the default model's load as a document written and parsed again.
//!
//! SentencePiece vocabularies (`tokenizer.ggml.model = llama`: Gemma, Llama 2, Mistral, TinyLlama)
//! carry scores instead of merges. The merges are recovered from the vocabulary the way
//! transformers does it when it reads the same GGUF (every split of a piece into two pieces of the
//! vocabulary, best piece first), and run through the same BPE with byte fallback (`<0xNN>`).

use super::error::{Error, Result};
use serde_json::{json, Value};
use std::path::Path;

/// The tokenizer and what the model says about BOS.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Whether the model's metadata asks for a BOS token at the start of the text.
    pub add_bos: bool,
    /// the BOS token's id, if the model has one
    pub bos_id: Option<u32>,
    /// The token a batch of texts is padded with (TransformerLens's `tokenizer.pad_token`): the
    /// model's padding token, else its end-of-text token (as TL sets it when there is none).
    pub pad_id: Option<u32>,
    /// A short description: "gpt2 byte-level BPE, pre-tokenizer qwen2 (from GGUF metadata)".
    pub kind: String,
    /// How a vocabulary piece spells its bytes.
    pub pieces: PieceStyle,
    /// The model's chat template (Jinja), from `tokenizer.chat_template` or tokenizer_config.json.
    pub chat_template: Option<String>,
    /// The end-of-sequence id the model's metadata names.
    pub eos_id: Option<u32>,
    /// Every text gets the special tokens of the file's post-processor (an encoder's
    /// `[CLS] … [SEP]`, as transformers' tokenizer adds them by default).
    pub specials: bool,
}

/// How a vocabulary piece spells the bytes it stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PieceStyle {
    /// GPT-2's byte-to-character table (`Ġ` is a space).
    ByteLevel,
    /// SentencePiece: `▁` is a space, `<0xNN>` is one byte, anything else is its UTF-8 text.
    SentencePiece,
    /// WordPiece (BERT): a piece is its text; `##` marks a continuation of the word before.
    WordPiece,
}

/// The three shapes of SentencePiece tokenizer a GGUF stands for (transformers picks one by
/// architecture when it reads the same file).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SpStyle {
    /// Gemma: spaces become `▁` (no prefix), tokens of blanks are respelled `▁▁`, merges ranked by
    /// the order of the vocabulary (Gemma's scores do not follow its merge order).
    Gemma,
    /// Phi-3: a `▁` prepended to the text by the normalizer.
    Phi3,
    /// Llama 2, Mistral, TinyLlama: `Metaspace`, a `▁` before the first word (as transformers
    /// builds it, even where the file's `add_space_prefix` is false); merges ranked by score.
    Llama { file_says_no_prefix: bool },
}

/// Merges recovered from a SentencePiece vocabulary (transformers' `generate_merges`): for every
/// piece (in vocabulary order), each split into two pieces that are both in the vocabulary; the
/// merges ordered by the piece's score (best first), then longer left part, then longer right
/// part, and otherwise as found (the splits of one piece by the ids of their parts). `vocab` is
/// `tokens`' own, as `vocab_map` makes it (a repeated piece has its last id, as in a Python dict).
fn sentencepiece_merges(
    tokens: &[String],
    vocab: &tokenizers::models::bpe::Vocab,
    score: &dyn Fn(usize) -> f64,
) -> Vec<(String, String)> {
    // a repeated piece counts once, where it first occurs (a Python dict's order)
    let mut seen = vec![false; tokens.len()];
    let mut merges: Vec<(f64, usize, usize, &str, &str)> = Vec::new();
    let mut local: Vec<(u32, u32, &str, &str)> = Vec::new();
    for t in tokens {
        let id = vocab[t.as_str()] as usize;
        if std::mem::replace(&mut seen[id], true) {
            continue;
        }
        let s = score(id);
        local.clear();
        local.extend(t.char_indices().skip(1).filter_map(|(b, _)| {
            let (l, r) = t.split_at(b);
            Some((*vocab.get(l)?, *vocab.get(r)?, l, r))
        }));
        local.sort_by_key(|&(l, r, _, _)| (l, r));
        merges.extend(
            local
                .iter()
                .map(|&(_, _, l, r)| (s, l.chars().count(), r.chars().count(), l, r)),
        );
    }
    // a stable sort, best first
    merges.sort_by(|a, b| {
        b.0.partial_cmp(&a.0)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(b.1.cmp(&a.1))
            .then(b.2.cmp(&a.2))
    });
    merges
        .into_iter()
        .map(|(_, _, _, l, r)| (l.to_string(), r.to_string()))
        .collect()
}

/// Merges as little-endian u32 id pairs (`vocab`'s ids, so `spelled[id]` spells each part back).
fn merges_as_ids(merges: &[(String, String)], vocab: &tokenizers::models::bpe::Vocab) -> Vec<u8> {
    let mut out = Vec::with_capacity(merges.len() * 8);
    for (l, r) in merges {
        for part in [l, r] {
            out.extend_from_slice(&vocab[part.as_str()].to_le_bytes());
        }
    }
    out
}

/// The merges [`merges_as_ids`] wrote, spelled with `spelled`; `None` if an id is out of range.
fn merges_from_ids(bytes: &[u8], spelled: &[String]) -> Option<Vec<(String, String)>> {
    if !bytes.len().is_multiple_of(8) {
        return None;
    }
    let part = |b: &[u8]| -> Option<String> {
        let id = u32::from_le_bytes(b.try_into().ok()?) as usize;
        spelled.get(id).cloned()
    };
    bytes
        .chunks_exact(8)
        .map(|c| Some((part(&c[..4])?, part(&c[4..])?)))
        .collect()
}

/// The split regex of Qwen2's tokenizer.json (and llama.cpp's `qwen2` pre-tokenizer).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's (llama.cpp `llama-bpe` / `llama3`): numbers in groups of up to three digits.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizers attnscope can build from GGUF metadata.
pub const KNOWN_PRE: &[&str] = &["qwen2", "smollm", "llama-bpe", "llama3", "gpt-2", "gpt2"];

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": use_regex})
}

fn split(regex: &str) -> Value {
    json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false})
}

/// `(normalizer, pre_tokenizer, ignore_merges)` of the Hugging Face tokenizer that the GGUF
/// `tokenizer.ggml.pre` value stands for.
fn pre_tokenizer_for(pre: &str) -> Option<(Value, Value, bool)> {
    Some(match pre {
        // Qwen2's tokenizer.json: NFC, then the regex split, then byte-level mapping.
        "qwen2" => (
            json!({"type": "NFC"}),
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level(false)]}),
            false,
        ),
        // SmolLM2: GPT-2's byte-level regex split, as transformers builds it from the GGUF
        // metadata (the reference ids). llama.cpp's `smollm` rule isolates every \p{N} first; the
        // two differ only where a space precedes a non-digit number character (" ¾"), since
        // SmolLM2's vocabulary has no multi-digit tokens.
        "smollm" => (Value::Null, byte_level(true), false),
        "llama-bpe" | "llama3" => (
            Value::Null,
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false)]}),
            true,
        ),
        "gpt-2" | "gpt2" => (Value::Null, byte_level(true), false),
        _ => return None,
    })
}

/// The tokens matched whole in the text before anything else, as transformers adds them: control
/// tokens (type 3, `<bos>`, `<|im_start|>`) as special, user-defined ones (type 4, `<think>`,
/// Gemma's `\t`) as plain added tokens, the latter only when `in_vocab` finds their spelling.
/// (token_type: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.)
fn added_tokens(
    tokens: &[String],
    types: &[i64],
    in_vocab: &dyn Fn(&str) -> bool,
) -> Vec<tokenizers::AddedToken> {
    tokens
        .iter()
        .enumerate()
        .filter_map(|(id, tok)| {
            match types.get(id).copied().unwrap_or(1) {
                3 => Some(true),
                4 if in_vocab(tok) => Some(false),
                _ => None,
            }
            .map(|special| {
                // what a tokenizer.json entry {"content", "special", all flags false} reads as
                tokenizers::AddedToken::from(tok.clone(), special)
                    .single_word(false)
                    .lstrip(false)
                    .rstrip(false)
                    .normalized(false)
            })
        })
        .collect()
}

/// Token → id, as a `tokenizer.json` vocabulary (a repeated token keeps its last id).
fn vocab_map(tokens: &[String]) -> tokenizers::models::bpe::Vocab {
    let mut vocab = tokenizers::models::bpe::Vocab::default();
    vocab.reserve(tokens.len());
    for (id, tok) in tokens.iter().enumerate() {
        vocab.insert(tok.clone(), id as u32);
    }
    vocab
}

/// A BPE model's own fields, as a `tokenizer.json`'s `model` would give them (no dropout, no
/// subword prefix or word suffix).
struct BpeParts {
    vocab: tokenizers::models::bpe::Vocab,
    merges: tokenizers::models::bpe::Merges,
    unk: Option<String>,
    fuse_unk: bool,
    byte_fallback: bool,
    ignore_merges: bool,
}

/// The merges of a `tokenizer.json` in the legacy form, `"a b"`, split as the crate splits them:
/// exactly one space, else the merge is refused (named by its 1-based rank); a `#version` line is
/// skipped.
fn split_merges(merges: &[String]) -> std::result::Result<tokenizers::models::bpe::Merges, String> {
    merges
        .iter()
        .filter(|m| !m.starts_with("#version"))
        .enumerate()
        .map(|(i, m)| match m.split_once(' ') {
            Some((a, b)) if !b.contains(' ') => Ok((a.to_string(), b.to_string())),
            _ => Err(format!(
                "merge {} (`{m}`) is not two pieces separated by one space",
                i + 1
            )),
        })
        .collect()
}

/// A BPE tokenizer: the `tokenizer.json` document of its normalizer, pre-tokenizer and decoder,
/// then the model built from `parts`, then the added tokens, in the order the crate's own reading
/// of a whole document takes (the added tokens find their ids in the model).
fn bpe_tokenizer(
    added: Vec<tokenizers::AddedToken>,
    normalizer: Value,
    pre_tokenizer: Value,
    decoder: Value,
    parts: BpeParts,
) -> std::result::Result<tokenizers::Tokenizer, String> {
    let doc = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": decoder,
        "model": {"type": "BPE", "vocab": {}, "merges": []},
    });
    // the loader boundary: a panic inside the tokenizers crate is the file's vocabulary's
    super::guard::quietly(move || {
        let mut inner: tokenizers::Tokenizer =
            doc.to_string().parse().map_err(|e| format!("{e}"))?;
        let mut bpe = tokenizers::models::bpe::BPE::builder()
            .vocab_and_merges(parts.vocab, parts.merges)
            .fuse_unk(parts.fuse_unk)
            .byte_fallback(parts.byte_fallback)
            .ignore_merges(parts.ignore_merges);
        if let Some(unk) = parts.unk {
            bpe = bpe.unk_token(unk);
        }
        inner.with_model(bpe.build().map_err(|e| format!("{e}"))?);
        inner.add_tokens(added).map_err(|e| format!("{e}"))?;
        Ok(inner)
    })
    .unwrap_or_else(|msg| Err(format!("the tokenizers library failed ({msg})")))
}

/// The tokenizer of a SentencePiece vocabulary, and how many merges it has.
fn sentencepiece_tokenizer(
    tokens: &[String],
    scores: &[f32],
    types: &[i64],
    style: SpStyle,
    merges_cache: Option<&super::panels::BlobCache>,
) -> std::result::Result<(tokenizers::Tokenizer, usize), String> {
    // Gemma stores a token of blanks as real spaces, looked up as `▁▁`
    let spelled: Vec<String> = match style {
        SpStyle::Gemma => tokens
            .iter()
            .map(|t| {
                if t.contains(' ') && t.trim().is_empty() {
                    "▁".repeat(t.chars().count())
                } else {
                    t.clone()
                }
            })
            .collect(),
        _ => tokens.to_vec(),
    };
    let vocab = vocab_map(&spelled);
    // the merges as id pairs, kept from an earlier load of the same file
    let kept = merges_cache
        .and_then(|c| c.load())
        .and_then(|b| merges_from_ids(&b, &spelled));
    let recovered = kept.is_none();
    let merges = match (kept, style) {
        (Some(m), _) => m,
        (None, SpStyle::Gemma) => sentencepiece_merges(&spelled, &vocab, &|i| -(i as f64)),
        (None, _) => sentencepiece_merges(&spelled, &vocab, &|i| scores[i] as f64),
    };
    // recovered: kept for the next load (a missing, damaged or stale file is replaced)
    if let Some(c) = merges_cache.filter(|_| recovered) {
        c.store(&merges_as_ids(&merges, &vocab));
    }
    let n_merges = merges.len();
    let added = added_tokens(tokens, types, &|t: &str| vocab.contains_key(t));
    let replace = |from: &str, to: &str| json!({"type": "Replace", "pattern": {"String": from}, "content": to});
    let (normalizer, pre_tokenizer, unk) = match style {
        SpStyle::Gemma => (
            replace(" ", "▁"),
            json!({"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false}),
            Some("<unk>".to_string()),
        ),
        SpStyle::Phi3 => (
            json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, replace(" ", "▁")]}),
            Value::Null,
            None,
        ),
        SpStyle::Llama { .. } => (
            Value::Null,
            json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false}),
            None,
        ),
    };
    let tokenizer = bpe_tokenizer(
        added,
        normalizer,
        pre_tokenizer,
        json!({"type": "Sequence", "decoders": [replace("▁", " "), {"type": "ByteFallback"}, {"type": "Fuse"}]}),
        BpeParts {
            vocab,
            merges,
            unk,
            fuse_unk: true,
            byte_fallback: true,
            ignore_merges: false,
        },
    )?;
    Ok((tokenizer, n_merges))
}

/// A GGUF file's metadata as the tokenizer reads it, with errors that name the file.
struct GgufMeta<'a> {
    md: &'a std::collections::HashMap<String, candle_core::quantized::gguf_file::Value>,
    path: &'a Path,
}

impl GgufMeta<'_> {
    /// The key is missing.
    fn missing(&self, key: &str) -> Error {
        Error::MissingKey {
            key: key.into(),
            path: self.path.into(),
            arch: "tokenizer".into(),
        }
    }

    /// The key's value is not what it should be.
    fn bad(&self, key: &str, reason: String) -> Error {
        Error::BadValue {
            key: key.into(),
            path: self.path.into(),
            reason,
        }
    }

    /// A string value.
    fn string(&self, key: &str) -> Result<String> {
        use candle_core::quantized::gguf_file::Value as V;
        match self.md.get(key) {
            Some(V::String(s)) => Ok(s.clone()),
            Some(_) => Err(self.bad(key, "not a string".into())),
            None => Err(self.missing(key)),
        }
    }

    /// An array of strings.
    fn strings(&self, key: &str) -> Result<Vec<String>> {
        use candle_core::quantized::gguf_file::Value as V;
        match self.md.get(key) {
            Some(V::Array(a)) => a
                .iter()
                .map(|v| match v {
                    V::String(s) => Ok(s.clone()),
                    _ => Err(self.bad(key, "array of non-strings".into())),
                })
                .collect(),
            Some(_) => Err(self.bad(key, "not an array".into())),
            None => Err(self.missing(key)),
        }
    }

    /// An unsigned integer, if present and one.
    fn u32(&self, key: &str) -> Option<u32> {
        self.md.get(key).and_then(|v| v.to_u32().ok())
    }

    /// A boolean, if present and one.
    fn bool(&self, key: &str) -> Option<bool> {
        self.md.get(key).and_then(|v| v.to_bool().ok())
    }

    /// `tokenizer.ggml.token_type`, one per token (1, normal, where a value is not a number;
    /// empty without the key).
    fn token_types(&self) -> Vec<i64> {
        use candle_core::quantized::gguf_file::Value as V;
        match self.md.get("tokenizer.ggml.token_type") {
            Some(V::Array(a)) => a
                .iter()
                .map(|v| v.to_i32().map(|x| x as i64).unwrap_or(1))
                .collect(),
            _ => Vec::new(),
        }
    }
}

/// A GGUF vocabulary built: the tokenizer (or why not), whether it adds BOS, how `info`
/// describes it, and how its pieces spell text.
struct BuiltVocab {
    built: std::result::Result<tokenizers::Tokenizer, String>,
    add_bos: bool,
    kind: String,
    pieces: PieceStyle,
}

/// A byte-level vocabulary's merges. gguf-py (llama.cpp's writer) cannot write an empty array,
/// so a vocabulary that has no merge to list (every ordinary token one byte-level symbol, as in
/// `tests/golden/arch/gguf`) comes without the key: then there are none. Longer tokens without
/// merges could never be produced, so that file is refused for the missing key, as llama.cpp does.
fn byte_level_merges(meta: &GgufMeta, tokens: &[String], types: &[i64]) -> Result<Vec<String>> {
    let one_symbol_each = tokens.iter().enumerate().all(|(id, t)| {
        // control, user-defined and unused tokens are matched whole, never merged into
        !matches!(types.get(id).copied().unwrap_or(1), 1 | 6) || t.chars().count() == 1
    });
    match meta.md.get("tokenizer.ggml.merges") {
        None if one_symbol_each => Ok(Vec::new()),
        _ => meta.strings("tokenizer.ggml.merges"),
    }
}

/// A byte-level BPE vocabulary (`tokenizer.ggml.model = gpt2`): its pre-tokenizer by name
/// (`tokenizer.ggml.pre`, refused when unknown), the vocabulary's map and the merges' pairs.
fn byte_level_vocab(meta: &GgufMeta, tokens: &[String], types: &[i64]) -> Result<BuiltVocab> {
    use candle_core::quantized::gguf_file::Value as V;
    let pre = match meta.md.get("tokenizer.ggml.pre") {
        Some(V::String(s)) => s.clone(),
        _ => "default".to_string(),
    };
    let (normalizer, pre_tok, ignore_merges) =
        pre_tokenizer_for(&pre).ok_or_else(|| Error::UnknownPreTokenizer {
            pre: pre.clone(),
            path: meta.path.into(),
            known: KNOWN_PRE.join(", "),
        })?;
    // the vocabulary's map and the merges' pairs side by side (151k of each in Qwen2.5's:
    // ~40 ms each; another core is free once the cache is checked)
    let (vocab, merges) = rayon::join(
        || vocab_map(tokens),
        || -> Result<_> {
            let merges = byte_level_merges(meta, tokens, types)?;
            let pairs = split_merges(&merges).map_err(|e| meta.bad("tokenizer.ggml.merges", e))?;
            Ok((merges.len(), pairs))
        },
    );
    let (n_merges, pairs) = merges?;
    let built = bpe_tokenizer(
        added_tokens(tokens, types, &|_| true),
        normalizer,
        pre_tok,
        json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
        BpeParts {
            vocab,
            merges: pairs,
            unk: None,
            fuse_unk: false,
            byte_fallback: false,
            ignore_merges,
        },
    );
    let kind = format!(
        "byte-level BPE ({} tokens, {n_merges} merges), pre-tokenizer `{pre}`, from GGUF metadata",
        tokens.len(),
    );
    Ok(BuiltVocab {
        built,
        add_bos: meta.bool("tokenizer.ggml.add_bos_token").unwrap_or(false),
        kind,
        pieces: PieceStyle::ByteLevel,
    })
}

/// A SentencePiece BPE vocabulary (`tokenizer.ggml.model = llama`): its style by the file's
/// architecture (Gemma, Phi-3, Llama), its scores (one per token; Gemma's order ranks the
/// merges instead), the merges recovered ([`sentencepiece_tokenizer`], kept in `merges_cache`).
fn sentencepiece_vocab(
    meta: &GgufMeta,
    tokens: &[String],
    types: &[i64],
    merges_cache: Option<&super::panels::BlobCache>,
) -> Result<BuiltVocab> {
    use candle_core::quantized::gguf_file::Value as V;
    let arch = match meta.md.get("general.architecture") {
        Some(V::String(s)) => s.as_str(),
        _ => "",
    };
    let style = match arch {
        "gemma" | "gemma2" | "gemma3" => SpStyle::Gemma,
        "phi3" => SpStyle::Phi3,
        // transformers puts the `▁` before the first word whatever the file's add_space_prefix
        // says (llama.cpp follows the key); we follow the reference and say so where the file
        // says otherwise
        _ => SpStyle::Llama {
            file_says_no_prefix: meta.bool("tokenizer.ggml.add_space_prefix") == Some(false),
        },
    };
    let scores: Vec<f32> = match (style, meta.md.get("tokenizer.ggml.scores")) {
        (SpStyle::Gemma, _) => Vec::new(),
        (_, Some(V::Array(a))) if a.len() == tokens.len() => a
            .iter()
            .map(|v| {
                v.to_f32()
                    .map_err(|_| meta.bad("tokenizer.ggml.scores", "not numbers".into()))
            })
            .collect::<Result<_>>()?,
        (_, Some(_)) => {
            return Err(meta.bad(
                "tokenizer.ggml.scores",
                format!("expected {} numbers, one per token", tokens.len()),
            ))
        }
        (_, None) => return Err(meta.missing("tokenizer.ggml.scores")),
    };
    let built = sentencepiece_tokenizer(tokens, &scores, types, style, merges_cache);
    let n_merges = built.as_ref().map(|b| b.1).unwrap_or(0);
    let kind = format!(
        "SentencePiece BPE ({} tokens, {n_merges} merges recovered from the {}), byte fallback, {}, from GGUF metadata",
        tokens.len(),
        if style == SpStyle::Gemma { "vocabulary order" } else { "scores" },
        match style {
            SpStyle::Gemma => "no space prefix (Gemma)",
            SpStyle::Phi3 => "space prefix (Phi-3)",
            SpStyle::Llama { file_says_no_prefix: false } => "space prefix",
            SpStyle::Llama { file_says_no_prefix: true } => "space prefix as transformers adds it (the file's add_space_prefix = false, which llama.cpp follows, would drop the first word's `▁`)",
        }
    );
    // llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    Ok(BuiltVocab {
        built: built.map(|b| b.0),
        add_bos: meta.bool("tokenizer.ggml.add_bos_token").unwrap_or(true),
        kind,
        pieces: PieceStyle::SentencePiece,
    })
}

impl Tokenizer {
    /// Builds the tokenizer from GGUF metadata.
    pub fn from_gguf(
        md: &std::collections::HashMap<String, candle_core::quantized::gguf_file::Value>,
        path: &Path,
    ) -> Result<Self> {
        Self::from_gguf_with(md, path, None)
    }

    /// [`Tokenizer::from_gguf`], keeping a SentencePiece vocabulary's recovered merges in
    /// `merges_cache` (and reading them from there when it holds this file's).
    pub fn from_gguf_with(
        md: &std::collections::HashMap<String, candle_core::quantized::gguf_file::Value>,
        path: &Path,
        merges_cache: Option<&super::panels::BlobCache>,
    ) -> Result<Self> {
        let meta = GgufMeta { md, path };
        let model = meta.string("tokenizer.ggml.model")?;
        let types = meta.token_types();
        let bos_id = meta.u32("tokenizer.ggml.bos_token_id");
        let pad_id = meta
            .u32("tokenizer.ggml.padding_token_id")
            .or_else(|| meta.u32("tokenizer.ggml.eos_token_id"));
        let tokens = meta.strings("tokenizer.ggml.tokens")?;
        let v = match model.as_str() {
            "gpt2" => byte_level_vocab(&meta, &tokens, &types)?,
            "llama" => sentencepiece_vocab(&meta, &tokens, &types, merges_cache)?,
            other => {
                return Err(meta.bad(
                    "tokenizer.ggml.model",
                    format!("`{other}` is not supported; attnscope reads byte-level BPE (`gpt2`) and SentencePiece BPE (`llama`) vocabularies"),
                ))
            }
        };
        let inner = v.built.map_err(|e| {
            Error::Tokenizer(format!(
                "building the tokenizer from {}: {e}",
                path.display()
            ))
        })?;
        Ok(Tokenizer {
            inner,
            add_bos: v.add_bos,
            bos_id,
            pad_id,
            kind: v.kind,
            pieces: v.pieces,
            chat_template: meta.string("tokenizer.chat_template").ok(),
            eos_id: meta.u32("tokenizer.ggml.eos_token_id"),
            specials: false,
        })
    }

    /// The id of the token spelled `piece` in the vocabulary, if there is one.
    pub fn id_of(&self, piece: &str) -> Option<u32> {
        self.inner.token_to_id(piece)
    }

    /// Loads a Hugging Face `tokenizer.json`; `add_bos`/`bos_id` come from the caller (config).
    pub fn from_file(path: &Path, add_bos: bool, bos_id: Option<u32>) -> Result<Self> {
        // the loader boundary: a panic inside the tokenizers crate is the file's
        let inner = super::guard::quietly(|| tokenizers::Tokenizer::from_file(path))
            .map_err(|msg| Error::LoaderPanic {
                path: path.into(),
                msg,
            })?
            .map_err(|e| Error::Tokenizer(format!("cannot load {}: {e}", path.display())))?;
        let mut inner = inner;
        let kind = format!("{} from {}", model_kind(&inner), path.display());
        // the file's truncation and padding (all-MiniLM-L6-v2's cut and pad every text to 128)
        // are for batches of a trainer; attnscope runs each text whole, refusing one too long
        inner
            .with_truncation(None)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        inner.with_padding(None);
        // a BPE with byte fallback is SentencePiece-style (`▁`, `<0xNN>`); the rest byte-level
        let pieces = match inner.get_model() {
            tokenizers::ModelWrapper::BPE(b) if b.byte_fallback => PieceStyle::SentencePiece,
            tokenizers::ModelWrapper::Unigram(_) => PieceStyle::SentencePiece,
            tokenizers::ModelWrapper::WordPiece(_) => PieceStyle::WordPiece,
            _ => PieceStyle::ByteLevel,
        };
        Ok(Tokenizer {
            inner,
            add_bos,
            bos_id,
            pad_id: None,
            kind,
            pieces,
            chat_template: None,
            eos_id: None,
            specials: false,
        })
    }

    /// Checks that an encoder's tokenizer.json is WordPiece, BPE or Unigram and that its
    /// post-processor puts `[CLS]` first and `[SEP]` last (what BERT was trained on; RoBERTa's
    /// `<s>` and `</s>` where the vocabulary has no `[CLS]`), naming what is missing.
    pub fn check_encoder_specials(&self, path: &Path) -> Result<()> {
        if matches!(
            self.inner.get_model(),
            tokenizers::ModelWrapper::WordLevel(_)
        ) {
            return Err(Error::Tokenizer(format!(
                "{} is a WordLevel tokenizer; attnscope reads WordPiece, BPE and Unigram vocabularies",
                path.display()
            )));
        }
        let (cls, sep) = match self.id_of("[CLS]") {
            Some(c) => (Some(c), self.id_of("[SEP]")),
            None => (self.id_of("<s>"), self.id_of("</s>")),
        };
        let ids = self
            .inner
            .encode("a", true)
            .map_err(|e| Error::Tokenizer(format!("encoding failed: {e}")))?;
        let ids = ids.get_ids();
        if cls.is_none()
            || sep.is_none()
            || ids.first() != cls.as_ref()
            || ids.last() != sep.as_ref()
        {
            return Err(Error::Tokenizer(format!(
                "{} does not put [CLS] first and [SEP] last (RoBERTa: <s> and </s>) with its post-processor; an encoder's texts need them, as BERT was trained",
                path.display()
            )));
        }
        Ok(())
    }

    /// The ids of the pair `a`, `b` with the post-processor's special tokens (BERT:
    /// `[CLS] a [SEP] b [SEP]`), and each token's type (0 for `a`'s part, 1 for `b`'s).
    pub fn encode_pair(&self, a: &str, b: &str) -> Result<(Vec<u32>, Vec<u32>)> {
        let enc = self
            .inner
            .encode((a, b), true)
            .map_err(|e| Error::Tokenizer(format!("encoding failed: {e}")))?;
        Ok((enc.get_ids().to_vec(), enc.get_type_ids().to_vec()))
    }

    /// Which text of the pair `a`, `b` each of `ids` (what [`Tokenizer::encode_pair`] gave, with
    /// its `types`) belongs to: 0 for `a`'s part, 1 for `b`'s. Where the post-processor's types
    /// tell the two apart (BERT's `[CLS] a [SEP]` 0, `b [SEP]` 1) they are the answer; where it
    /// types every token 0 (RoBERTa's `<s> a </s></s> b </s>`), `b`'s part starts after `a`
    /// encoded alone with its special tokens (`<s> a </s>`), so its part is `</s> b </s>`, as
    /// BERT's is `b [SEP]`. A literal separator inside either text does not move the split.
    pub fn pair_segments(&self, a: &str, ids: &[u32], types: &[u32]) -> Result<Vec<u32>> {
        if types.contains(&1) {
            return Ok(types.to_vec());
        }
        let first = self
            .inner
            .encode(a, true)
            .map_err(|e| Error::Tokenizer(format!("encoding failed: {e}")))?;
        let k = first.get_ids().len();
        if k == 0 || k >= ids.len() || first.get_ids() != &ids[..k] {
            return Err(Error::Tokenizer(format!(
                "cannot tell the pair's two texts apart: the first text alone is {k} tokens, not a prefix of the pair's {}",
                ids.len()
            )));
        }
        Ok((0..ids.len()).map(|i| u32::from(i >= k)).collect())
    }

    /// The id of a token spelled exactly `text` (a special token such as `<|im_end|>`), if any.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.inner.token_to_id(text)
    }

    /// Whether every text gets the BOS first from now on, whatever the model's metadata said
    /// (`--no-bos`, Python's `default_prepend_bos`); refused when asked for on a model without one.
    pub fn set_add_bos(&mut self, add: bool) -> Result<()> {
        if add && self.bos_id.is_none() {
            return Err(Error::Tokenizer(
                "a BOS token was asked for, but the model defines none".into(),
            ));
        }
        self.add_bos = add;
        Ok(())
    }

    /// Token ids of `text`. Special-token text (`<|im_start|>`) maps to its special id. A BOS id
    /// is put first when the model asks for it or `force_bos` is set.
    pub fn encode(&self, text: &str, force_bos: bool) -> Result<Vec<u32>> {
        self.encode_with(text, force_bos.then_some(true))
    }

    /// Token ids of `text`, with a BOS first as `bos` says: `Some(true)` always, `Some(false)`
    /// never, `None` when the model's metadata asks for one.
    pub fn encode_with(&self, text: &str, bos: Option<bool>) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, self.specials)
            .map_err(|e| Error::Tokenizer(format!("encoding failed: {e}")))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if bos.unwrap_or(self.add_bos) {
            match self.bos_id {
                Some(b) => ids.push(b),
                None => {
                    return Err(Error::Tokenizer(
                        "a BOS token was asked for, but the model defines none".into(),
                    ))
                }
            }
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// The raw vocabulary piece of an id (byte-level characters, e.g. `ĠNam`).
    pub fn piece(&self, id: u32) -> String {
        self.inner
            .id_to_token(id)
            .unwrap_or_else(|| format!("<id {id}>"))
    }

    /// The bytes a token stands for (byte-level pieces decoded; special tokens as their text).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let piece = self.piece(id);
        match self.pieces {
            PieceStyle::ByteLevel => {
                byte_level_decode(&piece).unwrap_or_else(|| piece.into_bytes())
            }
            PieceStyle::SentencePiece => sentencepiece_decode(&piece),
            PieceStyle::WordPiece => piece.into_bytes(),
        }
    }

    /// A readable text for a token: its UTF-8 text where it is whole characters, with any bytes
    /// that are not (SmolLM2 splits Vietnamese letters across tokens) shown as `<e1 bb>`.
    pub fn token_text(&self, id: u32) -> String {
        readable(&self.token_bytes(id))
    }

    /// The number of tokens in the vocabulary (added tokens included).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

fn model_kind(t: &tokenizers::Tokenizer) -> &'static str {
    match t.get_model() {
        tokenizers::ModelWrapper::BPE(_) => "BPE",
        tokenizers::ModelWrapper::WordPiece(_) => "WordPiece",
        tokenizers::ModelWrapper::Unigram(_) => "Unigram",
        tokenizers::ModelWrapper::WordLevel(_) => "WordLevel",
    }
}

/// GPT-2's byte ↔ unicode table: printable bytes map to themselves, the others to U+0100 + k.
fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).expect("byte is a char")
        } else {
            n += 1;
            char::from_u32(255 + n).expect("U+0100.. are chars")
        };
    }
    table
}

/// Inverse of the byte-level mapping; `None` if the piece has a character outside the table
/// (a special token such as `<|im_start|>` is plain text and decodes to itself anyway).
pub fn byte_level_decode(piece: &str) -> Option<Vec<u8>> {
    let table = byte_to_char_table();
    piece
        .chars()
        .map(|c| table.iter().position(|&t| t == c).map(|b| b as u8))
        .collect()
}

/// The bytes of a SentencePiece piece: `<0xNN>` is the byte NN, `▁` a space.
pub fn sentencepiece_decode(piece: &str) -> Vec<u8> {
    if let Some(hex) = piece
        .strip_prefix("<0x")
        .and_then(|p| p.strip_suffix('>'))
        .filter(|h| h.len() == 2)
    {
        if let Ok(b) = u8::from_str_radix(hex, 16) {
            return vec![b];
        }
    }
    piece.replace('▁', " ").into_bytes()
}

/// Bytes as text, with invalid UTF-8 runs shown as hex: `b"\xe1\xbb"` → `<e1 bb>`.
pub fn readable(bytes: &[u8]) -> String {
    let mut out = String::new();
    for chunk in bytes.utf8_chunks() {
        out.push_str(chunk.valid());
        let bad = chunk.invalid();
        if !bad.is_empty() {
            let hex: Vec<String> = bad.iter().map(|b| format!("{b:02x}")).collect();
            out.push_str(&format!("<{}>", hex.join(" ")));
        }
    }
    out
}

/// A token text for tables: leading spaces shown as `␣`, newlines and tabs escaped.
pub fn visible(text: &str) -> String {
    let trimmed = text.trim_start_matches(' ');
    let lead = text.len() - trimmed.len();
    let body = trimmed
        .replace('\n', "\\n")
        .replace('\r', "\\r")
        .replace('\t', "\\t");
    format!("{}{}", "␣".repeat(lead), body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_roundtrip_of_vietnamese_piece() {
        // "ĠNá»Ļi" is Qwen's piece for " Nội"
        assert_eq!(byte_level_decode("ĠNá»Ļi").unwrap(), " Nội".as_bytes());
        assert_eq!(byte_level_decode("á»").unwrap(), vec![0xe1, 0xbb]);
    }

    #[test]
    fn partial_utf8_is_shown_as_bytes() {
        assert_eq!(readable(&[0xe1, 0xbb]), "<e1 bb>");
        assert_eq!(readable(" N".as_bytes()), " N");
        assert_eq!(readable(&[b'a', 0x99]), "a<99>");
        assert_eq!(visible("  ab\n"), "␣␣ab\\n");
    }

    fn sentencepiece(arch: &str, prefix: bool) -> Tokenizer {
        let md: std::collections::HashMap<_, _> =
            crate::model::tiny::tiny_sentencepiece_md(arch, prefix)
                .into_iter()
                .collect();
        Tokenizer::from_gguf(&md, Path::new("sp.gguf")).unwrap()
    }

    /// A byte-level BPE (`tokenizer.ggml.model = gpt2`) from the tiny vocabulary, with `merges`.
    fn byte_level(pre: &str, merges: Option<Vec<String>>) -> Result<Tokenizer> {
        use candle_core::quantized::gguf_file::Value as V;
        let (tokens, tiny_merges, types) = crate::model::tiny::tiny_vocab();
        let strs = |v: Vec<String>| V::Array(v.into_iter().map(V::String).collect());
        let md: std::collections::HashMap<String, V> = [
            ("tokenizer.ggml.model", V::String("gpt2".into())),
            ("tokenizer.ggml.pre", V::String(pre.into())),
            ("tokenizer.ggml.tokens", strs(tokens)),
            (
                "tokenizer.ggml.token_type",
                V::Array(types.into_iter().map(V::I32).collect()),
            ),
            ("tokenizer.ggml.merges", strs(merges.unwrap_or(tiny_merges))),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        Tokenizer::from_gguf(&md, Path::new("bl.gguf"))
    }

    /// The model is built with the crate's builder, not read from a document: written out as a
    /// tokenizer.json and read back by the crate, it is written the same and splits every text
    /// the same (byte-level with two pre-tokenizers, SentencePiece in the three styles).
    #[test]
    fn a_directly_built_tokenizer_is_the_one_its_tokenizer_json_describes() {
        let all = [
            byte_level("qwen2", None).unwrap(),
            byte_level("smollm", None).unwrap(),
            sentencepiece("llama", true),
            sentencepiece("phi3", true),
            sentencepiece("gemma3", true),
        ];
        let texts = [
            "the hat",
            " the  hat\tat<|im_start|>he<|endoftext|>",
            "Hà Nội là thủ đô, 123 ¾ <bos><unk>\n\n  x",
            "",
        ];
        for t in &all {
            let json = t.inner.to_string(false).unwrap();
            assert!(
                json.contains("\"merges\":[["),
                "{}: merges as written",
                t.kind
            );
            let reread: tokenizers::Tokenizer = json.parse().unwrap();
            assert_eq!(reread.to_string(false).unwrap(), json, "{}", t.kind);
            assert_eq!(
                reread.get_vocab(true),
                t.inner.get_vocab(true),
                "{}: vocabulary with added tokens",
                t.kind
            );
            for text in texts {
                let ids =
                    |x: &tokenizers::Tokenizer| x.encode(text, false).unwrap().get_ids().to_vec();
                assert_eq!(ids(&t.inner), ids(&reread), "{}: {text:?}", t.kind);
            }
        }
        // the merges made pieces: " the" is one token, not four
        let t = &all[0];
        assert_eq!(t.encode(" the", false).unwrap(), vec![id(t, "Ġthe")]);
    }

    /// A merge that is not two pieces separated by one space is named, as the crate's reading of
    /// a tokenizer.json would refuse it; a `#version` line is skipped, as the crate skips it.
    #[test]
    fn a_malformed_merge_is_named_and_a_version_line_skipped() {
        let (_, merges, _) = crate::model::tiny::tiny_vocab();
        for bad in ["Ġt  he", "Ġthe", "a b c"] {
            let mut m = merges.clone();
            m.insert(1, bad.to_string());
            let e = byte_level("qwen2", Some(m))
                .err()
                .expect("refused")
                .to_string();
            assert!(
                e.contains("tokenizer.ggml.merges") && e.contains(&format!("merge 2 (`{bad}`)")),
                "{e}"
            );
        }
        let mut m = merges.clone();
        m.insert(0, "#version: 0.2".to_string());
        let t = byte_level("qwen2", Some(m)).unwrap();
        assert_eq!(
            t.inner.to_string(false).unwrap(),
            byte_level("qwen2", None)
                .unwrap()
                .inner
                .to_string(false)
                .unwrap()
        );
    }

    fn id(t: &Tokenizer, piece: &str) -> u32 {
        t.inner.token_to_id(piece).unwrap()
    }

    /// Llama-style SentencePiece, worked by hand: `▁` before the first word, merges ranked by the
    /// score of the piece they make (`▁t` > `he` > `▁the` > `▁a` > `at` > `▁h` > `▁hat`), so
    /// "the hat" → `▁ t h e ▁ h a t` → `▁t` → `he` → `▁the` → `at` → `▁h` → `▁hat`.
    #[test]
    fn sentencepiece_merges_by_score_with_a_space_prefix() {
        let t = sentencepiece("llama", true);
        assert_eq!(t.pieces, PieceStyle::SentencePiece);
        assert!(t.kind.contains("SentencePiece") && t.kind.contains("space prefix"));
        assert!(t.add_bos, "BOS from add_bos_token");
        assert_eq!(
            t.encode("the hat", false).unwrap(),
            vec![2, id(&t, "▁the"), id(&t, "▁hat")]
        );
        assert_eq!(
            t.encode_with("the hat", Some(false)).unwrap(),
            vec![id(&t, "▁the"), id(&t, "▁hat")]
        );
        // a character outside the vocabulary falls back to its UTF-8 bytes
        let ids = t.encode_with("é", Some(false)).unwrap();
        assert_eq!(ids, vec![id(&t, "▁"), 4 + 0xc3, 4 + 0xa9]);
        let bytes: Vec<u8> = ids.iter().flat_map(|&i| t.token_bytes(i)).collect();
        assert_eq!(bytes, " é".as_bytes());
        assert_eq!(t.token_text(id(&t, "▁hat")), " hat");
        assert_eq!(t.token_text(2), "<bos>");
        // a file that says add_space_prefix = false gets the prefix anyway (as transformers
        // does), and the description says so
        let t = sentencepiece("llama", false);
        assert_eq!(
            t.encode_with("the hat", Some(false)).unwrap(),
            vec![id(&t, "▁the"), id(&t, "▁hat")]
        );
        assert!(t.kind.contains("add_space_prefix = false"), "{}", t.kind);
        // Phi-3: the prefix comes from the normalizer, one `▁` per space after it
        let t = sentencepiece("phi3", true);
        assert_eq!(
            t.encode_with("the hat", Some(false)).unwrap(),
            vec![id(&t, "▁the"), id(&t, "▁hat")]
        );
    }

    /// Gemma: no prefix, merges ranked by vocabulary order (the token of two spaces, stored as
    /// "  " and respelled `▁▁`, comes before every letter pair), a user-defined `\t` matched whole.
    #[test]
    fn gemma_sentencepiece_ranks_by_order_and_respells_blanks() {
        let t = sentencepiece("gemma3", false);
        assert!(t.kind.contains("vocabulary order"));
        let two = id(&t, "▁▁");
        assert_eq!(two, 261, "the stored \"  \" token keeps its id");
        assert_eq!(
            t.encode_with("the  hat", Some(false)).unwrap(),
            vec![id(&t, "t"), id(&t, "he"), two, id(&t, "h"), id(&t, "at")]
        );
        assert_eq!(
            t.encode("a\tb", false).unwrap(),
            vec![2, id(&t, "a"), 262, id(&t, "b")]
        );
        assert_eq!(t.token_bytes(two), b"  ");
        assert_eq!(t.token_bytes(4 + 0x0a), b"\n");
    }

    /// Recovered SentencePiece merges kept as id pairs: a second build reads them and tokenizes
    /// the same; a damaged, foreign or out-of-range file is not used (the merges are recovered).
    #[test]
    fn kept_sentencepiece_merges_tokenize_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("sp.gguf");
        std::fs::write(&model, b"stands for the model file").unwrap();
        let texts = [
            "the  hat",
            "a\tb",
            "Hà Nội là thủ đô",
            "  leading blanks",
            "x",
        ];
        for (arch, prefix) in [("gemma3", false), ("llama", true), ("phi3", false)] {
            let md: std::collections::HashMap<_, _> =
                crate::model::tiny::tiny_sentencepiece_md(arch, prefix)
                    .into_iter()
                    .collect();
            let cache = merges_cache_of(&model, dir.path(), arch);
            let plain = Tokenizer::from_gguf(&md, &model).unwrap();
            let ids = |t: &Tokenizer| -> Vec<Vec<u32>> {
                texts.iter().map(|x| t.encode(x, false).unwrap()).collect()
            };
            let want = ids(&plain);
            let first = Tokenizer::from_gguf_with(&md, &model, Some(&cache)).unwrap();
            assert_eq!(ids(&first), want, "{arch}: the build that keeps them");
            let kept = cache.load().expect("kept");
            assert!(!kept.is_empty() && kept.len().is_multiple_of(8));
            let second = Tokenizer::from_gguf_with(&md, &model, Some(&cache)).unwrap();
            assert_eq!(ids(&second), want, "{arch}: read back");
            assert_eq!(second.kind, plain.kind);
            // a flipped byte: the CRC refuses it, the merges are recovered
            flip_kept_bytes(&cache.path);
            assert!(cache.load().is_none(), "{arch}: damaged");
            let third = Tokenizer::from_gguf_with(&md, &model, Some(&cache)).unwrap();
            assert_eq!(ids(&third), want, "{arch}: damaged file not used");
            assert_eq!(
                cache.load(),
                Some(kept.clone()),
                "{arch}: damaged file replaced"
            );
            // a changed model file: the stale merges are not read, and are replaced
            let f = std::fs::File::options().write(true).open(&model).unwrap();
            f.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(7))
                .unwrap();
            drop(f);
            let moved = merges_cache_of(&model, dir.path(), arch);
            assert!(moved.load().is_none(), "{arch}: stale");
            let fourth = Tokenizer::from_gguf_with(&md, &model, Some(&moved)).unwrap();
            assert_eq!(ids(&fourth), want);
            assert_eq!(moved.load(), Some(kept), "{arch}: stale file replaced");
        }
    }

    /// The kept-merges cache of the model file `model` of family `arch`, in `dir`.
    fn merges_cache_of(
        model: &std::path::Path,
        dir: &std::path::Path,
        arch: &str,
    ) -> crate::model::panels::BlobCache {
        crate::model::panels::BlobCache::new(
            std::slice::from_ref(&model.to_path_buf()),
            dir,
            &format!("m-{arch}"),
            0,
        )
        .unwrap()
    }

    /// Damages a kept file: a bit flipped in its last 4 KiB and one in its last non-zero byte.
    fn flip_kept_bytes(path: &std::path::Path) {
        let mut bytes = std::fs::read(path).unwrap();
        let n = bytes.len();
        bytes[n - 4096 + 1] ^= 1;
        let at = bytes.iter().rposition(|&b| b != 0).unwrap();
        bytes[at] ^= 0x40;
        std::fs::write(path, &bytes).unwrap();
    }

    /// Kept merge ids past the vocabulary are refused, not spelled; a cut pair is refused.
    #[test]
    fn kept_merge_ids_past_the_vocabulary_are_refused() {
        let spelled = vec!["a".to_string(), "b".to_string()];
        let mut bad = Vec::new();
        for id in [0u32, 1, 1, 2] {
            bad.extend_from_slice(&id.to_le_bytes());
        }
        assert!(merges_from_ids(&bad, &spelled).is_none());
        assert_eq!(
            merges_from_ids(&bad[..8], &spelled),
            Some(vec![("a".to_string(), "b".to_string())])
        );
        assert!(merges_from_ids(&bad[..7], &spelled).is_none());
    }

    /// The tiny vocabulary through transformers' own GGUF converter
    /// (tests/golden/sentencepiece_tiny.json, from make_sentencepiece_golden.py): every shape
    /// gives the same ids.
    #[test]
    fn sentencepiece_ids_equal_transformers() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/golden/sentencepiece_tiny.json"
        );
        let g: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let md = crate::model::tiny::tiny_sentencepiece_md("llama", true);
        let tokens = md
            .iter()
            .find(|(k, _)| k == "tokenizer.ggml.tokens")
            .map(|(_, v)| match v {
                candle_core::quantized::gguf_file::Value::Array(a) => a
                    .iter()
                    .map(|t| json!(t.to_string().unwrap()))
                    .collect::<Vec<_>>(),
                _ => unreachable!(),
            })
            .unwrap();
        assert_eq!(
            json!(tokens),
            g["tokens"],
            "the same vocabulary as the script's"
        );
        let mut failures = Vec::new();
        for (key, arch, prefix) in [
            ("llama+prefix", "llama", true),
            ("llama-prefix", "llama", false),
            ("gemma3", "gemma3", false),
            ("phi3", "phi3", true),
        ] {
            let t = sentencepiece(arch, prefix);
            for case in g["vectors"][key].as_array().unwrap() {
                let text = case["text"].as_str().unwrap();
                let want: Vec<u32> = case["ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect();
                let got = t.encode_with(text, Some(false)).unwrap();
                if got != want {
                    failures.push(format!("{key} {text:?}: got {got:?}, want {want:?}"));
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    #[test]
    fn an_unknown_vocabulary_model_is_refused_by_name() {
        let mut md: std::collections::HashMap<_, _> =
            crate::model::tiny::tiny_sentencepiece_md("llama", true)
                .into_iter()
                .collect();
        md.insert(
            "tokenizer.ggml.model".into(),
            candle_core::quantized::gguf_file::Value::String("t5".into()),
        );
        let e = Tokenizer::from_gguf(&md, Path::new("t5.gguf"))
            .err()
            .expect("a t5 vocabulary is refused")
            .to_string();
        assert!(
            e.contains("tokenizer.ggml.model") && e.contains("`t5`") && e.contains("SentencePiece"),
            "{e}"
        );
        // scores that do not match the tokens are refused too
        md.insert(
            "tokenizer.ggml.model".into(),
            candle_core::quantized::gguf_file::Value::String("llama".into()),
        );
        md.insert(
            "tokenizer.ggml.scores".into(),
            candle_core::quantized::gguf_file::Value::Array(vec![]),
        );
        let e = Tokenizer::from_gguf(&md, Path::new("sp.gguf"))
            .err()
            .expect("no scores")
            .to_string();
        assert!(e.contains("tokenizer.ggml.scores"), "{e}");
    }

    #[test]
    fn merges_are_ordered_like_transformers() {
        // "abc" splits as a|bc and ab|c (both in the vocabulary): ordered by the ids of the parts;
        // equal scores keep the longer left part first
        let toks: Vec<String> = ["a", "b", "c", "bc", "ab", "abc"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let m = sentencepiece_merges(&toks, &vocab_map(&toks), &|i| {
            [0.0, 0.0, 0.0, -1.0, -2.0, -3.0][i]
        });
        let m: Vec<(&str, &str)> = m.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        assert_eq!(m, vec![("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]);
        assert_eq!(sentencepiece_decode("<0x41>"), b"A");
        assert_eq!(sentencepiece_decode("▁Nội"), " Nội".as_bytes());
        assert_eq!(sentencepiece_decode("<0x4>"), b"<0x4>");
    }

    #[test]
    fn every_known_pre_tokenizer_parses() {
        for pre in KNOWN_PRE {
            let (norm, pre_tok, _) = pre_tokenizer_for(pre).unwrap();
            let doc = json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
                "normalizer": norm, "pre_tokenizer": pre_tok, "post_processor": null, "decoder": null,
                "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}});
            let t: tokenizers::Tokenizer = doc
                .to_string()
                .parse()
                .unwrap_or_else(|e| panic!("{pre}: {e}"));
            assert_eq!(t.encode("ab", false).unwrap().get_ids(), &[2], "{pre}");
        }
        assert!(pre_tokenizer_for("bloom").is_none());
    }
}
