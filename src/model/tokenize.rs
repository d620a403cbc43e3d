//! Text → token ids, with the Hugging Face `tokenizers` crate.
//!
//! A `tokenizer.json` is loaded as it is. A GGUF file carries its tokenizer in metadata
//! (`tokenizer.ggml.*`); we translate that into the equivalent `tokenizer.json` and load it the
//! same way, so both formats go through one, well-tested BPE implementation. The pre-tokenizer
//! (how text is split before BPE) is chosen by `tokenizer.ggml.pre` and must be known: an unknown
//! value is an error, never a silent fallback (a wrong split gives plausible but wrong ids).

use super::error::{Error, Result};
use serde_json::{json, Value};
use std::path::Path;

/// The tokenizer and what the model says about BOS.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Whether the model's metadata asks for a BOS token at the start of the text.
    pub add_bos: bool,
    pub bos_id: Option<u32>,
    /// A short description: "gpt2 byte-level BPE, pre-tokenizer qwen2 (from GGUF metadata)".
    pub kind: String,
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

impl Tokenizer {
    /// Builds the tokenizer from GGUF metadata.
    pub fn from_gguf(
        md: &std::collections::HashMap<String, candle_core::quantized::gguf_file::Value>,
        path: &Path,
    ) -> Result<Self> {
        use candle_core::quantized::gguf_file::Value as V;
        let missing = |key: &str| Error::MissingKey {
            key: key.into(),
            path: path.into(),
            arch: "tokenizer".into(),
        };
        let bad = |key: &str, reason: String| Error::BadValue {
            key: key.into(),
            path: path.into(),
            reason,
        };
        let get_str = |key: &str| -> Result<String> {
            match md.get(key) {
                Some(V::String(s)) => Ok(s.clone()),
                Some(_) => Err(bad(key, "not a string".into())),
                None => Err(missing(key)),
            }
        };
        let get_strs = |key: &str| -> Result<Vec<String>> {
            match md.get(key) {
                Some(V::Array(a)) => a
                    .iter()
                    .map(|v| match v {
                        V::String(s) => Ok(s.clone()),
                        _ => Err(bad(key, "array of non-strings".into())),
                    })
                    .collect(),
                Some(_) => Err(bad(key, "not an array".into())),
                None => Err(missing(key)),
            }
        };
        let model = get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(bad("tokenizer.ggml.model", format!("`{model}` is not supported; attnscope reads byte-level BPE (`gpt2`) tokenizers")));
        }
        let pre = match md.get("tokenizer.ggml.pre") {
            Some(V::String(s)) => s.clone(),
            _ => "default".to_string(),
        };
        let (normalizer, pre_tok, ignore_merges) =
            pre_tokenizer_for(&pre).ok_or_else(|| Error::UnknownPreTokenizer {
                pre: pre.clone(),
                path: path.into(),
                known: KNOWN_PRE.join(", "),
            })?;
        let tokens = get_strs("tokenizer.ggml.tokens")?;
        let merges = get_strs("tokenizer.ggml.merges")?;
        let types: Vec<i64> = match md.get("tokenizer.ggml.token_type") {
            Some(V::Array(a)) => a
                .iter()
                .map(|v| v.to_i32().map(|x| x as i64).unwrap_or(1))
                .collect(),
            _ => vec![1; tokens.len()],
        };
        let mut vocab = serde_json::Map::with_capacity(tokens.len());
        let mut added = Vec::new();
        for (id, tok) in tokens.iter().enumerate() {
            vocab.insert(tok.clone(), json!(id));
            // token_type: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
            // Control and user-defined tokens are matched in the text before BPE, as HF does.
            if let t @ (3 | 4) = types.get(id).copied().unwrap_or(1) {
                added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": t == 3,
            }))
            }
        }
        let get_u32 = |key: &str| md.get(key).and_then(|v| v.to_u32().ok());
        let add_bos = md
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false);
        let bos_id = get_u32("tokenizer.ggml.bos_token_id");
        let doc = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": normalizer,
            "pre_tokenizer": pre_tok,
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges,
            },
        });
        let inner: tokenizers::Tokenizer = doc.to_string().parse().map_err(|e| {
            Error::Tokenizer(format!(
                "building the tokenizer from {}: {e}",
                path.display()
            ))
        })?;
        Ok(Tokenizer {
            inner,
            add_bos,
            bos_id,
            kind: format!(
                "byte-level BPE ({} tokens, {} merges), pre-tokenizer `{pre}`, from GGUF metadata",
                tokens.len(),
                merges.len()
            ),
        })
    }

    /// Loads a Hugging Face `tokenizer.json`; `add_bos`/`bos_id` come from the caller (config).
    pub fn from_file(path: &Path, add_bos: bool, bos_id: Option<u32>) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| Error::Tokenizer(format!("cannot load {}: {e}", path.display())))?;
        let kind = format!("{} from {}", model_kind(&inner), path.display());
        Ok(Tokenizer {
            inner,
            add_bos,
            bos_id,
            kind,
        })
    }

    /// Token ids of `text`. Special-token text (`<|im_start|>`) maps to its special id. A BOS id
    /// is put first when the model asks for it or `force_bos` is set.
    pub fn encode(&self, text: &str, force_bos: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(format!("encoding failed: {e}")))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if self.add_bos || force_bos {
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
        byte_level_decode(&piece).unwrap_or_else(|| piece.into_bytes())
    }

    /// A readable text for a token: its UTF-8 text where it is whole characters, with any bytes
    /// that are not (SmolLM2 splits Vietnamese letters across tokens) shown as `<e1 bb>`.
    pub fn token_text(&self, id: u32) -> String {
        readable(&self.token_bytes(id))
    }

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
