//! The bodies of the fuzz targets (`fuzz/fuzz_targets/*.rs`), shared with `tests/fuzz_replay.rs`,
//! which replays every saved input (the committed crafted files, the generated seeds, and a local
//! `fuzz/corpus/` if one exists) under an ordinary `cargo test`. Each may return an error;
//! none may panic.

use crate::model::tiny::{tiny_model, write_gguf_with, write_hf_folder};
use crate::model::tokenize::Tokenizer;
use crate::model::{Arch, Model, Precision};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;
use std::path::Path;
use std::sync::OnceLock;

/// Arbitrary bytes as a GGUF model; a model that loads must also run.
pub fn gguf(data: &[u8]) {
    if let Ok(m) = Model::from_gguf_bytes("fuzz.gguf", data.to_vec(), Precision::Exact) {
        let _ = m
            .encode("Hà Nội 123", false)
            .and_then(|t| m.next_token_logits(&t));
    }
}

/// A Hugging Face folder (the tiny model's config.json and tokenizer.json) for [`safetensors`].
pub fn safetensors_folder() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tempfile::tempdir_in("/dev/shm")
            .or_else(|_| tempfile::tempdir())
            .expect("a temporary folder");
        write_hf_folder(&tiny_model(Arch::Llama, 1), Arch::Llama, d.path(), 1)
            .expect("tiny model written");
        d
    })
    .path()
}

/// Arbitrary bytes as the model.safetensors of a valid folder. Not reentrant (one file).
pub fn safetensors(data: &[u8]) {
    let dir = safetensors_folder();
    std::fs::write(dir.join("model.safetensors"), data).expect("write");
    if let Ok(m) = Model::load(dir.to_str().expect("utf-8 path"), Precision::Exact, false) {
        let _ = m
            .encode("the hat", false)
            .and_then(|t| m.next_token_logits(&t));
    }
}

fn tokenizers() -> &'static Vec<Tokenizer> {
    static T: OnceLock<Vec<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temporary folder");
        crate::model::tokenize::KNOWN_PRE
            .iter()
            .map(|pre| {
                let p = dir.path().join(format!("{pre}.gguf"));
                write_gguf_with(
                    &tiny_model(Arch::Qwen2, 1),
                    Arch::Qwen2,
                    GgmlDType::F32,
                    &p,
                    &|md, _| {
                        md.iter_mut()
                            .filter(|(k, _)| k == "tokenizer.ggml.pre")
                            .for_each(|(_, v)| *v = Value::String(pre.to_string()));
                    },
                )
                .expect("written");
                let bytes = std::fs::read(&p).expect("read");
                let c = Content::read(&mut std::io::Cursor::new(&bytes)).expect("valid");
                Tokenizer::from_gguf(&c.metadata, &p).expect("known pre-tokenizer")
            })
            // and the three shapes of SentencePiece vocabulary
            .chain(
                [
                    ("llama", true),
                    ("llama", false),
                    ("gemma3", false),
                    ("phi3", true),
                ]
                .into_iter()
                .map(|(arch, prefix)| {
                    let md: std::collections::HashMap<_, _> =
                        crate::model::tiny::tiny_sentencepiece_md(arch, prefix)
                            .into_iter()
                            .collect();
                    Tokenizer::from_gguf(&md, Path::new("sp.gguf")).expect("tiny vocabulary")
                }),
            )
            .collect()
    })
}

/// Arbitrary text through every GGUF-built tokenizer, and each id back to text.
pub fn tokenizer(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    for t in tokenizers() {
        if let Ok(ids) = t.encode(&text, false) {
            for id in ids {
                let _ = t.token_text(id);
            }
        }
    }
}

/// The generated seed inputs, as (target, name, bytes): tiny models of both architectures in F32
/// and Q8_0, whole and cut, their safetensors, and varied strings.
pub fn seeds() -> Vec<(&'static str, String, Vec<u8>)> {
    use crate::model::tiny::write_gguf;
    let tmp = tempfile::tempdir().expect("temporary folder");
    let mut out = Vec::new();
    for (i, (arch, dt)) in [
        (Arch::Qwen2, GgmlDType::F32),
        (Arch::Llama, GgmlDType::F32),
        (Arch::Qwen2, GgmlDType::Q8_0),
    ]
    .into_iter()
    .enumerate()
    {
        let p = tmp.path().join("m.gguf");
        write_gguf(&tiny_model(arch, i as u64), arch, dt, &p).expect("gguf");
        let bytes = std::fs::read(&p).expect("read");
        out.push(("gguf", format!("cut{i}"), bytes[..bytes.len() / 3].to_vec()));
        out.push(("gguf", format!("model{i}"), bytes));
        let hf = tmp.path().join(format!("hf{i}"));
        write_hf_folder(&tiny_model(arch, i as u64), arch, &hf, 1).expect("hf");
        out.push((
            "safetensors",
            format!("model{i}"),
            std::fs::read(hf.join("model.safetensors")).expect("read"),
        ));
    }
    for (i, s) in [
        "Hà Nội là thủ đô",
        "the hat",
        "日本語 😀 <|im_start|>x",
        "x=1; y=x**2",
        "  \t\r\n 123 ½ ¾",
    ]
    .iter()
    .enumerate()
    {
        out.push(("tokenizer", format!("s{i}"), s.as_bytes().to_vec()));
    }
    out
}
