//! Arbitrary text through the GGUF-built tokenizers (each pre-tokenizer of the tiny vocabulary),
//! and every resulting id back to readable text.
#![no_main]
use attnscope::model::tiny::{tiny_model, write_gguf_with};
use attnscope::model::tokenize::Tokenizer;
use attnscope::model::Arch;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

fn tokenizers() -> &'static Vec<Tokenizer> {
    static T: OnceLock<Vec<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temporary folder");
        attnscope::model::tokenize::KNOWN_PRE
            .iter()
            .map(|pre| {
                let p = dir.path().join(format!("{pre}.gguf"));
                write_gguf_with(&tiny_model(Arch::Qwen2, 1), Arch::Qwen2, GgmlDType::F32, &p, &|md, _| {
                    md.iter_mut().filter(|(k, _)| k == "tokenizer.ggml.pre").for_each(|(_, v)| *v = Value::String(pre.to_string()));
                })
                .expect("written");
                let bytes = std::fs::read(&p).expect("read");
                let c = Content::read(&mut std::io::Cursor::new(&bytes)).expect("valid");
                Tokenizer::from_gguf(&c.metadata, &p).expect("known pre-tokenizer")
            })
            .collect()
    })
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    for t in tokenizers() {
        if let Ok(ids) = t.encode(&text, false) {
            for id in ids {
                let _ = t.token_text(id);
            }
        }
    }
});
