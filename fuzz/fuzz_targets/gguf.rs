//! Arbitrary bytes as a GGUF model: header, metadata, tokenizer, tensor table and data.
//! Loading may fail with an error, never panic or allocate beyond what the bytes can hold.
#![no_main]
use attnscope::model::{Model, Precision};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Model::from_gguf_bytes("fuzz.gguf", data.to_vec(), Precision::Exact) {
        // a model that loads must also run
        let _ = m.encode("Hà Nội 123", false).and_then(|t| m.next_token_logits(&t));
    }
});
