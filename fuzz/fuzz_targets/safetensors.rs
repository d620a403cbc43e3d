//! Arbitrary bytes as the model.safetensors of a Hugging Face folder whose config.json and
//! tokenizer.json are valid (those of the tiny test model).
//! (The body is `attnscope::fuzzing::safetensors`, which `cargo test` replays on the saved inputs.)
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| attnscope::fuzzing::safetensors(data));
