//! Writes the seed corpora: generated tiny models (both archs, F32 and Q8_0, whole and cut),
//! their safetensors, and varied strings. `cargo +nightly run --release --bin seeds`.
use attnscope::model::tiny::{tiny_model, write_gguf, write_hf_folder};
use attnscope::model::Arch;
use candle_core::quantized::GgmlDType;

fn main() {
    let root = std::path::Path::new("corpus");
    for t in ["gguf", "safetensors", "tokenizer"] {
        std::fs::create_dir_all(root.join(t)).expect("corpus folders");
    }
    let tmp = tempfile::tempdir().expect("temporary folder");
    for (i, (arch, dt)) in [(Arch::Qwen2, GgmlDType::F32), (Arch::Llama, GgmlDType::F32), (Arch::Qwen2, GgmlDType::Q8_0)].into_iter().enumerate() {
        let p = tmp.path().join("m.gguf");
        write_gguf(&tiny_model(arch, i as u64), arch, dt, &p).expect("gguf");
        let bytes = std::fs::read(&p).expect("read");
        std::fs::write(root.join(format!("gguf/model{i}")), &bytes).expect("seed");
        std::fs::write(root.join(format!("gguf/cut{i}")), &bytes[..bytes.len() / 3]).expect("seed");
        let hf = tmp.path().join(format!("hf{i}"));
        write_hf_folder(&tiny_model(arch, i as u64), arch, &hf, 1).expect("hf");
        std::fs::copy(hf.join("model.safetensors"), root.join(format!("safetensors/model{i}"))).expect("seed");
    }
    for (i, s) in ["Hà Nội là thủ đô", "the hat", "日本語 😀 <|im_start|>x", "x=1; y=x**2", "  \t\r\n 123 ½ ¾"].iter().enumerate() {
        std::fs::write(root.join(format!("tokenizer/s{i}")), s).expect("seed");
    }
}
