//! Arbitrary bytes as a GGUF model: header, metadata, tokenizer, tensor table and data.
//! Loading may fail with an error, never panic or allocate beyond what the bytes can hold.
//! (The body is `attnscope::fuzzing::gguf`, which `cargo test` replays on the saved inputs.)
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| attnscope::fuzzing::gguf(data));
