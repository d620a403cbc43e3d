//! Arbitrary text through the GGUF-built tokenizers (each pre-tokenizer of the tiny vocabulary),
//! and every resulting id back to readable text.
//! (The body is `attnscope::fuzzing::tokenizer`, which `cargo test` replays on the saved inputs.)
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| attnscope::fuzzing::tokenizer(data));
