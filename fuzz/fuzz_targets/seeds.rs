//! Writes the seed corpora (`attnscope::fuzzing::seeds`) and the committed crafted inputs
//! (`tests/fuzz_corpus/`) into `corpus/`. `cargo +nightly run --release --bin seeds`.
fn main() {
    let root = std::path::Path::new("corpus");
    for (target, name, bytes) in attnscope::fuzzing::seeds() {
        std::fs::create_dir_all(root.join(target)).expect("corpus folder");
        std::fs::write(root.join(target).join(name), bytes).expect("seed");
    }
    for target in ["gguf", "safetensors", "tokenizer"] {
        let crafted = std::path::Path::new("../tests/fuzz_corpus").join(target);
        for e in std::fs::read_dir(&crafted).into_iter().flatten().flatten() {
            std::fs::copy(e.path(), root.join(target).join(e.file_name())).expect("crafted seed");
        }
    }
}
