//! Arbitrary bytes as the model.safetensors of a Hugging Face folder whose config.json and
//! tokenizer.json are valid (those of the tiny test model).
#![no_main]
use attnscope::model::tiny::{tiny_model, write_hf_folder};
use attnscope::model::{Arch, Model, Precision};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

fn folder() -> &'static std::path::Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tempfile::tempdir_in("/dev/shm").or_else(|_| tempfile::tempdir()).expect("a temporary folder");
        write_hf_folder(&tiny_model(Arch::Llama, 1), Arch::Llama, d.path(), 1).expect("tiny model written");
        d
    })
    .path()
}

fuzz_target!(|data: &[u8]| {
    let dir = folder();
    std::fs::write(dir.join("model.safetensors"), data).expect("write");
    if let Ok(m) = Model::load(dir.to_str().expect("utf-8 path"), Precision::Exact, false) {
        let _ = m.encode("the hat", false).and_then(|t| m.next_token_logits(&t));
    }
});
