//! Every row of the README's bad-input table: a clear error naming the cause, never a panic
//! and never a wrong number. (CLI exit codes and messages for user values are in cli.rs.)
// index loops over (layer, head, query) read like the maths; nested test types stay inline
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

mod common;

use attnscope::model::tiny::{tiny_model, write_gguf, write_gguf_with, write_hf_folder};
use attnscope::model::{Arch, Model, Precision};
use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;
use common::{attnscope, fails_with, run_err};
use std::path::{Path, PathBuf};

fn load_err(path: &Path) -> String {
    match Model::load(path.to_str().unwrap(), Precision::Exact, false) {
        Ok(_) => panic!("{} loaded although it is broken", path.display()),
        Err(e) => e.to_string(),
    }
}

fn tiny_gguf_bytes() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.gguf");
    write_gguf(&tiny_model(Arch::Qwen2, 1), Arch::Qwen2, GgmlDType::F32, &p).unwrap();
    std::fs::read(p).unwrap()
}

/// A GGUF header written by hand, so counts, lengths and offsets can be anything.
struct Raw(Vec<u8>);
impl Raw {
    fn new(version: u32, n_tensors: u64, n_kv: u64) -> Self {
        let mut b = b"GGUF".to_vec();
        b.extend(version.to_le_bytes());
        b.extend(n_tensors.to_le_bytes());
        b.extend(n_kv.to_le_bytes());
        Raw(b)
    }
    fn string(mut self, s: &str) -> Self {
        self.0.extend((s.len() as u64).to_le_bytes());
        self.0.extend(s.as_bytes());
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn kv_str(self, k: &str, v: &str) -> Self {
        self.string(k).u32(8).string(v)
    }
    fn write(&self, dir: &Path, name: &str) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, &self.0).unwrap();
        p
    }
}

#[test]
fn a_folder_without_config_json() {
    let dir = tempfile::tempdir().unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("has no config.json"), "{e}");
}

#[test]
fn an_unsupported_gguf_version() {
    let dir = tempfile::tempdir().unwrap();
    let e = load_err(&Raw::new(7, 0, 0).write(dir.path(), "v7.gguf"));
    assert!(e.contains("unsupported GGUF version 7"), "{e}");
}

/// Every prefix of a real (tiny) GGUF file is an error, not a panic: every byte of the header,
/// metadata and tensor table, then every 61st byte of the tensor data, and the last 64.
#[test]
fn every_prefix_of_a_gguf_file_is_an_error() {
    let bytes = tiny_gguf_bytes();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("prefix.gguf");
    // every byte up to the start of the tensor data, then a stride through the data
    let header_end =
        candle_core::quantized::gguf_file::Content::read(&mut std::io::Cursor::new(&bytes))
            .unwrap()
            .tensor_data_offset as usize;
    assert!(header_end > 1000 && header_end < bytes.len());
    let cuts: Vec<usize> = (0..header_end.min(bytes.len()))
        .chain((header_end..bytes.len()).step_by(61))
        .chain(bytes.len().saturating_sub(64)..bytes.len())
        .collect();
    for cut in cuts {
        std::fs::write(&p, &bytes[..cut]).unwrap();
        let r = std::panic::catch_unwind(|| {
            Model::load(p.to_str().unwrap(), Precision::Exact, false).map(|_| ())
        });
        match r {
            Ok(Err(_)) => {}
            Ok(Ok(())) => panic!("a prefix of {cut} of {} bytes loaded", bytes.len()),
            Err(_) => panic!("a prefix of {cut} bytes panicked"),
        }
    }
}

#[test]
fn absurd_counts_lengths_and_dims_are_refused_without_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let pad = |mut r: Raw| {
        r.0.extend([0u8; 64]); // enough bytes that the count checks, not the size checks, decide
        r
    };
    let cases = [
        (
            "tensors.gguf",
            Raw::new(3, u64::MAX / 2, 0),
            "tensor_count 9223372036854775807 exceeds",
        ),
        (
            "kv.gguf",
            Raw::new(3, 0, 1 << 40),
            "metadata_kv_count 1099511627776 exceeds",
        ),
        (
            "strlen.gguf",
            pad(Raw::new(3, 0, 1).u64(1 << 50)),
            "string length 1125899906842624 exceeds",
        ),
        (
            "dims.gguf",
            pad(Raw::new(3, 1, 0).string("w").u32(1000)),
            "has 1000 dimensions",
        ),
        (
            "arraylen.gguf",
            Raw::new(3, 0, 1).string("k").u32(9).u32(4).u64(1 << 55),
            "array length 36028797018963968 exceeds",
        ),
    ];
    for (name, raw, what) in cases {
        let e = load_err(&raw.write(dir.path(), name));
        assert!(
            e.contains("corrupt or truncated") && e.contains(what),
            "{name}: {e}"
        );
    }
    // dims whose product overflows, and tensor data past the end of the file
    let overflow = Raw::new(3, 1, 1)
        .kv_str("general.architecture", "qwen2")
        .string("token_embd.weight")
        .u32(2)
        .u64(1 << 40)
        .u64(1 << 40)
        .u32(0)
        .u64(0);
    let e = load_err(&overflow.write(dir.path(), "overflow.gguf"));
    assert!(
        e.contains("corrupt or truncated") && e.contains("past the end of the file"),
        "{e}"
    );
    use attnscope::model::weights::{Logical, TensorSource};
    let overflow = pad(pad(Raw::new(3, 1, 0)
        .string("token_embd.weight")
        .u32(2)
        .u64(1 << 40)
        .u64(1 << 40)
        .u32(0)
        .u64(0)));
    let mut g =
        attnscope::model::gguf::GgufFile::from_bytes(Path::new("overflow2.gguf"), overflow.0)
            .unwrap();
    let e = g
        .get(&Logical::Embed)
        .err()
        .expect("2^80 values must not load")
        .to_string();
    assert!(
        e.contains("dimensions [1099511627776, 1099511627776] overflow"),
        "{e}"
    );
}

#[test]
fn tensor_offsets_past_the_end() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("offset.gguf");
    let m = tiny_model(Arch::Qwen2, 1);
    write_gguf(&m, Arch::Qwen2, GgmlDType::F32, &p).unwrap();
    // cut the file in the middle of the tensor data: the last tensors now lie past the end
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 4096]).unwrap();
    let e = load_err(&p);
    assert!(e.contains("truncated"), "{e}");
}

#[test]
fn a_missing_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("missing.gguf");
    write_gguf_with(
        &tiny_model(Arch::Llama, 1),
        Arch::Llama,
        GgmlDType::F32,
        &p,
        &|_, t| t.retain(|(n, _)| n != "blk.1.ffn_up.weight"),
    )
    .unwrap();
    let e = load_err(&p);
    assert!(e.contains("tensor `blk.1.ffn_up.weight` not found"), "{e}");
}

#[test]
fn a_shape_that_does_not_match_the_config() {
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("hf");
    write_hf_folder(&tiny_model(Arch::Qwen2, 1), Arch::Qwen2, &hf, 1).unwrap();
    let cfg_path = hf.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["intermediate_size"] = 48.into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let e = load_err(&hf);
    assert!(
        e.contains("has shape [64, 32], but the config implies [48, 32]"),
        "{e}"
    );
}

/// A tiny Qwen2 GGUF file `name` in `dir` whose metadata string `key` says `value`.
fn qwen2_gguf_with_string(dir: &tempfile::TempDir, name: &str, key: &str, value: &str) -> PathBuf {
    let p = dir.path().join(name);
    write_gguf_with(
        &tiny_model(Arch::Qwen2, 1),
        Arch::Qwen2,
        GgmlDType::F32,
        &p,
        &|md, _| {
            md.iter_mut()
                .filter(|(k, _)| k == key)
                .for_each(|(_, v)| *v = Value::String(value.into()));
        },
    )
    .unwrap();
    p
}

#[test]
fn unknown_architectures_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = qwen2_gguf_with_string(&dir, "bloom.gguf", "general.architecture", "bloom");
    let e = load_err(&p);
    assert!(
        e.contains("unsupported architecture `bloom`") && e.contains("qwen2, llama"),
        "{e}"
    );
    let hf = dir.path().join("hf");
    write_hf_folder(&tiny_model(Arch::Qwen2, 1), Arch::Qwen2, &hf, 1).unwrap();
    let cfg = std::fs::read_to_string(hf.join("config.json"))
        .unwrap()
        .replace("\"qwen2\"", "\"bloom\"");
    std::fs::write(hf.join("config.json"), cfg).unwrap();
    let e = load_err(&hf);
    assert!(
        e.contains("unsupported architecture `bloom`") && e.contains("gpt2"),
        "{e}"
    );
}

#[test]
fn an_unknown_pre_tokenizer_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = qwen2_gguf_with_string(&dir, "pre.gguf", "tokenizer.ggml.pre", "bloom");
    let e = load_err(&p);
    assert!(
        e.contains("unknown pre-tokenizer `bloom`") && e.contains("qwen2"),
        "{e}"
    );
}

#[test]
fn a_corrupt_safetensors_file() {
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("hf");
    write_hf_folder(&tiny_model(Arch::Llama, 1), Arch::Llama, &hf, 1).unwrap();
    let st = hf.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() / 2]).unwrap();
    let e = load_err(&hf);
    assert!(e.contains("corrupt or truncated"), "{e}");
    std::fs::write(&st, [0xffu8; 16]).unwrap();
    let e = load_err(&hf);
    // (the path itself ends in .safetensors: the check is on the message's own words)
    assert!(
        e.contains("is not a GGUF or safetensors model (first bytes [ff, ff"),
        "{e}"
    );
}

/// `general.alignment = 0` made candle divide by zero (a panic, exit 101) in a 100-byte file.
/// Now every alignment that is not a power of two is named, and no panic escapes the loader.
#[test]
fn a_zero_or_odd_alignment_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (name, ty, v) in [
        ("zero.gguf", 4u32, 0u32),
        ("three.gguf", 4, 3),
        ("u8zero.gguf", 0, 0),
    ] {
        let mut raw = Raw::new(3, 0, 2)
            .kv_str("general.architecture", "qwen2")
            .string("general.alignment")
            .u32(ty);
        raw.0.extend(if ty == 0 {
            vec![v as u8]
        } else {
            v.to_le_bytes().to_vec()
        });
        let p = raw.write(dir.path(), name);
        assert!(std::fs::metadata(&p).unwrap().len() < 128);
        let r = std::panic::catch_unwind(|| load_err(&p));
        let e = r.unwrap_or_else(|_| panic!("{name} panicked"));
        assert!(
            e.contains("general.alignment is")
                && e.contains("power of two")
                && e.contains("corrupt or truncated"),
            "{name}: {e}"
        );
        // the binary exits 2 with the message, not 101
        let err = run_err(["info", "--model", p.to_str().unwrap()], 2);
        assert!(!err.contains("panicked"), "{name}: {err}");
    }
    // a 64-bit alignment is not what GGUF stores: candle would quietly use 32
    let p = Raw::new(3, 0, 1)
        .string("general.alignment")
        .u32(10)
        .u64(64)
        .write(dir.path(), "u64.gguf");
    assert!(load_err(&p).contains("unsigned 32-bit"));
    // a power of two passes this check (and the file then fails for what it lacks)
    let p = Raw::new(3, 0, 1)
        .string("general.alignment")
        .u32(4)
        .u32(64)
        .write(dir.path(), "ok.gguf");
    assert!(!load_err(&p).contains("general.alignment"));
}

/// A block count far beyond the tensors in the file is refused before anything is sized by
/// it, and loading it stays small (peak memory measured on the binary).
#[test]
fn a_huge_block_count_is_refused_without_memory() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("layers.gguf");
    write_gguf_with(
        &tiny_model(Arch::Qwen2, 1),
        Arch::Qwen2,
        GgmlDType::F32,
        &p,
        &|md, _| {
            md.iter_mut()
                .filter(|(k, _)| k == "qwen2.block_count")
                .for_each(|(_, v)| *v = Value::U32(1 << 24));
        },
    )
    .unwrap();
    let e = load_err(&p);
    assert!(
        e.contains("block_count")
            && e.contains("16777216 layers need at least")
            && e.contains("corrupt or truncated"),
        "{e}"
    );
    let peak = dir.path().join("peak");
    fails_with(
        attnscope().env("ATTNSCOPE_PEAK_FILE", &peak).args([
            "info",
            "--model",
            p.to_str().unwrap(),
        ]),
        2,
    );
    let peak: u64 = std::fs::read_to_string(&peak)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(peak < 200 << 20, "refusing the file took {} MB", peak >> 20);
}

/// `n / block_size * type_size` wrapped in release builds: 2^62 f32 values made a 0-byte
/// tensor that "fit" in any file.
#[test]
fn a_tensor_size_that_overflows_is_refused() {
    use attnscope::model::gguf::GgufFile;
    use attnscope::model::weights::{Logical, TensorSource};
    let mut raw = Raw::new(3, 1, 0)
        .string("token_embd.weight")
        .u32(2)
        .u64(1 << 31)
        .u64(1 << 31)
        .u32(0)
        .u64(0);
    raw.0.resize(160, 0); // tensor data starts (aligned) inside the file
    let mut g = GgufFile::from_bytes(Path::new("wrap.gguf"), raw.0).unwrap();
    let e = g
        .get(&Logical::Embed)
        .err()
        .expect("an overflowing size must not load")
        .to_string();
    assert!(e.contains("take more bytes than a file can hold"), "{e}");
}

/// A NaN in a weight, or scores that overflow f32, stop the forward with the layer named
/// (exit 2: the model is the bad input; it said exit 1, "the attention scores holds")
/// instead of printing rows in which the NaN quietly became weight 0.
#[test]
fn non_finite_scores_are_named_with_their_layer() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(
        &str,
        &dyn Fn(&mut attnscope::reference::transformer::RefModel),
    ); 3] = [
        ("nan.gguf", &|m| m.layers[1].w_k[5] = f32::NAN),
        ("overflow.gguf", &|m| {
            let l = &mut m.layers[1];
            l.w_q
                .iter_mut()
                .chain(l.w_k.iter_mut())
                .for_each(|w| *w *= 1e20);
        }),
        ("inf_mlp.gguf", &|m| m.layers[0].w_down[3] = f32::INFINITY),
    ];
    for (name, edit) in cases {
        let mut m = tiny_model(Arch::Qwen2, 2);
        edit(&mut m);
        let p = dir.path().join(name);
        write_gguf(&m, Arch::Qwen2, GgmlDType::F32, &p).unwrap();
        let model = Model::load(p.to_str().unwrap(), Precision::Exact, false).unwrap();
        let tokens = model.encode("the hat at the hat", false).unwrap();
        let e = model
            .next_token_logits(&tokens)
            .err()
            .unwrap_or_else(|| panic!("{name}: a non-finite model gave logits"))
            .to_string();
        let layer = if name == "inf_mlp.gguf" {
            "at layer 0"
        } else {
            "at layer 1"
        };
        assert!(e.contains("non-finite") && e.contains(layer), "{name}: {e}");
        let err = run_err(
            [
                "inspect",
                "--model",
                p.to_str().unwrap(),
                "--text",
                "the hat at the hat",
            ],
            2,
        );
        assert!(
            err.contains(layer) && err.contains("turned up in the ") && !err.contains("holds"),
            "{name}: {err}"
        );
    }
}

/// A GGUF whose tensor has a block type attnscope cannot read (llama.cpp's i-quants, or a type
/// id no one knows) is refused with the type named, not read as something else.
#[test]
fn a_tensor_of_a_block_type_attnscope_cannot_read() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = tiny_gguf_bytes();
    // the tensor info of `output_norm.weight`: name, n_dims (u32), dims (u64 each), type (u32)
    let name = b"output_norm.weight";
    let at = bytes
        .windows(name.len())
        .position(|w| w == name)
        .expect("the tensor's name is in the file")
        + name.len();
    let n_dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    let ty = at + 4 + 8 * n_dims;
    assert_eq!(
        u32::from_le_bytes(bytes[ty..ty + 4].try_into().unwrap()),
        0,
        "F32"
    );
    for (id, named) in [
        (16u32, "block type 16 (IQ2_XXS)"),
        (39, "block type 39 (MXFP4)"),
        (99, "block type 99 (a type id no GGML version defines)"),
    ] {
        let mut b = bytes.clone();
        b[ty..ty + 4].copy_from_slice(&id.to_le_bytes());
        let p = dir.path().join(format!("type{id}.gguf"));
        std::fs::write(&p, &b).unwrap();
        let e = load_err(&p);
        assert!(
            e.contains(named) && e.contains("`output_norm.weight`") && e.contains("Q4_K_M"),
            "type {id}: the error names the type: {e}"
        );
    }
}

// Issue #56, defect 9: messages that named the wrong thing.

/// A multi-token `--answer`/`--wrong` is reported under its own flag (was `--target`); the same
/// token for both, both given, is not told to pass them (it was).
#[test]
fn messages_name_the_flag_that_was_given() {
    let dir = tempfile::tempdir().unwrap();
    let m = common::tiny_gguf(&dir);
    let m = m.to_str().unwrap();
    let patch = |extra: &[&str]| {
        let mut a = vec![
            "patch",
            "-m",
            m,
            "--clean",
            "the hat",
            "--corrupt",
            "the cat",
        ];
        a.extend_from_slice(extra);
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    for (args, want) in [
        (patch(&["--answer", "ab"]), "--answer \"ab\" (2 tokens"),
        (
            patch(&["--answer", "3", "--wrong", "ab"]),
            "--wrong \"ab\" (2 tokens",
        ),
        (
            vec!["dla", "-m", m, "--text", "the hat", "--answer", "ab"]
                .into_iter()
                .map(String::from)
                .collect(),
            "--answer \"ab\" (2 tokens",
        ),
    ] {
        let e = run_err(&args, 2);
        assert!(e.contains(want) && !e.contains("--target"), "{args:?}: {e}");
    }
    let e = run_err(patch(&["--answer", "3", "--wrong", "3"]), 2);
    assert!(
        e.contains("--answer and --wrong name the same token") && !e.contains("pass --"),
        "{e}"
    );
}

/// An empty `--clean` is not told to use `--text`; `generate --max-new-tokens` past the context
/// names that option (it said to shorten the text); `patch` with equal clean and corrupted logit
/// differences is refused, exit 2 (it printed a grid of NaN, exit 0: defect 4).
#[test]
fn messages_name_the_text_and_the_count_that_are_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let m = common::tiny_gguf(&dir);
    let m = m.to_str().unwrap();
    let e = run_err(
        ["patch", "-m", m, "--clean", " ", "--corrupt", "the hat"],
        2,
    );
    assert!(e.contains("--clean") && !e.contains("--text"), "{e}");
    let e = run_err(
        [
            "generate",
            "-m",
            m,
            "--text",
            "the hat",
            "--max-new-tokens",
            "1000000000",
        ],
        2,
    );
    assert!(
        e.contains("max-new-tokens 1000000000 is out of range") && !e.contains("shorten the text"),
        "{e}"
    );
    let out = attnscope()
        .args([
            "patch",
            "-m",
            m,
            "--clean",
            "the hat",
            "--corrupt",
            "the hat",
        ])
        .args(["--answer", "3", "--wrong", "4"])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        common::stderr_of(&out),
    );
    assert_eq!(out.status.code(), Some(2), "{stdout}{stderr}");
    assert!(
        !stdout.contains("NaN") && stderr.contains("the same logit difference"),
        "{stderr}"
    );
}

/// `-m` on a FIFO or on /dev/null says what the path is (it said the file does not exist); the
/// FIFO is never opened (that would wait for a writer).
#[test]
fn a_fifo_or_a_device_is_not_a_missing_model() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("model.gguf");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for (path, kind) in [
        (
            fifo.to_str().unwrap(),
            "is a named pipe (FIFO), not a model file",
        ),
        ("/dev/null", "is a character device, not a model file"),
    ] {
        let e = run_err(["info", "-m", path], 2);
        assert!(e.contains(kind) && !e.contains("does not exist"), "{e}");
    }
}

/// With RUST_BACKTRACE=1 (as CI and many shells set it), a truncated GGUF's message is one
/// line: candle appends a backtrace to its errors then, which was printed (14 frames).
#[test]
fn a_truncated_gguf_message_holds_no_backtrace() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("cut.gguf");
    std::fs::write(&p, &tiny_gguf_bytes()[..100]).unwrap();
    let e = fails_with(
        attnscope()
            .env("RUST_BACKTRACE", "1")
            .args(["info", "-m", p.to_str().unwrap()]),
        2,
    );
    assert!(e.contains("cannot read GGUF file"), "{e}");
    assert_eq!(e.trim_end().lines().count(), 1, "{e}");
    assert!(!e.contains("candle_core::"), "{e}");
}

/// A safetensors header whose shape does not fill a tensor's bytes names the tensor (the
/// safetensors crate's message names none).
#[test]
fn a_safetensors_shape_error_names_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("hf");
    write_hf_folder(&tiny_model(Arch::Llama, 1), Arch::Llama, &hf, 1).unwrap();
    let st = hf.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let name = "model.layers.1.mlp.up_proj.weight";
    let shape = header[name]["shape"].clone();
    header[name]["shape"] = serde_json::json!([shape[0].as_u64().unwrap() + 1, shape[1]]);
    let mut h = header.to_string().into_bytes();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(&h);
    out.extend(&bytes[8 + n..]);
    std::fs::write(&st, out).unwrap();
    let e = load_err(&hf);
    assert!(e.contains(&format!("tensor `{name}` has shape [")), "{e}");
}

/// A BERT config.json without `layer_norm_eps` or `max_position_embeddings` takes transformers'
/// defaults (1e-12 and 512: `BertConfig`), with a warning; it was refused as missing
/// `rms_norm_eps`. The tiny BERT's own values are 1e-12 and 64, so without `layer_norm_eps` it
/// gives the same numbers, and without `max_position_embeddings` its 64-row position table no
/// longer matches (as in transformers). A decoder without its epsilon is refused naming its key.
#[test]
fn a_bert_config_takes_transformers_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let bert = common::golden("arch/bert");
    let inspect = |m: &Path| {
        attnscope()
            .args([
                "inspect",
                "-m",
                m.to_str().unwrap(),
                "--text",
                "the cat sat",
                "--json",
            ])
            .output()
            .unwrap()
    };
    let want = inspect(&bert);
    assert!(want.status.success(), "{}", common::stderr_of(&want));
    let copy = |drop: &str| {
        let d = dir.path().join(drop);
        std::fs::create_dir(&d).unwrap();
        for f in std::fs::read_dir(&bert).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, d.join(f.file_name().unwrap())).unwrap();
        }
        let mut cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(d.join("config.json")).unwrap()).unwrap();
        cfg.as_object_mut().unwrap().remove(drop);
        std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
        d
    };
    let got = inspect(&copy("layer_norm_eps"));
    let stderr = common::stderr_of(&got);
    assert!(got.status.success(), "{stderr}");
    assert!(
        stderr.contains("no `layer_norm_eps`; transformers' default for the architecture, 1e-12"),
        "{stderr}"
    );
    let (got, want): (serde_json::Value, serde_json::Value) = (
        serde_json::from_slice(&got.stdout).unwrap(),
        serde_json::from_slice(&want.stdout).unwrap(),
    );
    for k in ["tokens", "heads", "layers", "special_shares"] {
        assert_eq!(got[k], want[k], "{k}");
    }
    let e = load_err(&copy("max_position_embeddings"));
    assert!(
        e.contains("position_embeddings.weight") && e.contains("[512, 64]"),
        "{e}"
    );
    let hf = dir.path().join("qwen");
    write_hf_folder(&tiny_model(Arch::Qwen2, 1), Arch::Qwen2, &hf, 1).unwrap();
    let cfg_path = hf.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("rms_norm_eps");
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let e = load_err(&hf);
    assert!(e.contains("metadata key `rms_norm_eps` missing"), "{e}");
}

/// A UTF-8 byte-order mark at the start of a text (a file saved by Notepad) is left out, with a
/// note; it was kept as 3 byte tokens at position 0.
#[test]
fn a_byte_order_mark_is_left_out_and_said() {
    let dir = tempfile::tempdir().unwrap();
    let m = common::tiny_gguf(&dir);
    let file = dir.path().join("bom.txt");
    std::fs::write(&file, "\u{feff}the hat").unwrap();
    let tokens = |args: &[&str]| {
        let out = attnscope()
            .args(["inspect", "-m", m.to_str().unwrap(), "--json"])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", common::stderr_of(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (v["tokens"].clone(), common::stderr_of(&out))
    };
    let (plain, _) = tokens(&["--text", "the hat"]);
    for args in [
        &["--text", "\u{feff}the hat"][..],
        &["--file", file.to_str().unwrap()][..],
    ] {
        let (got, stderr) = tokens(args);
        assert_eq!(got, plain, "{args:?}");
        assert!(stderr.contains("byte-order mark (U+FEFF)"), "{stderr}");
    }
}

/// Every index option takes a leading minus and refuses it by name with the valid range, exit 2
/// (clap said "unexpected argument '-1' found"): nothing in the CLI counts from the end.
#[test]
fn negative_indices_are_refused_with_their_range() {
    let dir = tempfile::tempdir().unwrap();
    let m = common::tiny_gguf(&dir);
    let m = m.to_str().unwrap();
    let out = dir.path().join("x.png");
    let out = out.to_str().unwrap();
    let t = ["-m", m, "--text", "the hat sat"];
    let cases: [(&[&str], &[&str], &str); 11] = [
        (
            &["inspect"],
            &["--layer", "-1"],
            "layer -1 is out of range: this model has layers 0-1",
        ),
        (
            &["inspect"],
            &["--query", "-1"],
            "query position -1 is out of range: the text has query positions 0-",
        ),
        (&["inspect"], &["--heads", "-2"], "head -2 is out of range"),
        (
            &["inspect"],
            &["--layers", "-1"],
            "layer -1 is out of range",
        ),
        (
            &["qk", "--layer", "0"],
            &["--head", "-3"],
            "head -3 is out of range: this model has heads 0-",
        ),
        (
            &["qk", "--head", "0"],
            &["--layer", "-1"],
            "layer -1 is out of range",
        ),
        (
            &["qk", "--layer", "0", "--head", "0"],
            &["--key", "-1"],
            "key position -1 is out of range",
        ),
        (
            &["heatmap", "--out", out],
            &["--layer", "-1"],
            "layer -1 is out of range",
        ),
        (
            &["heatmap", "--out", out, "--layer", "0"],
            &["--head", "-1"],
            "head -1 is out of range",
        ),
        (
            &["capture", "--out", out],
            &["--queries", "-1"],
            "query position -1 is out of range",
        ),
        (
            &["ablate"],
            &["--positions", "-1"],
            "position -1 is out of range",
        ),
    ];
    for (cmd, flag, want) in cases {
        let args: Vec<&str> = cmd.iter().chain(&t).chain(flag).copied().collect();
        let e = run_err(&args, 2);
        assert!(
            e.contains(want) && e.contains("does not count from the end"),
            "{args:?}: {e}"
        );
    }
    let e = run_err(["compare", "--text", "the hat", "--query", "-1"], 2);
    assert!(e.contains("query position -1 is out of range"), "{e}");
}

/// A count that 0 makes meaningless is refused, exit 2: `dla`, `ablate`, `circuit --top 0`
/// printed an empty table, `generate -k 0` empty top-key columns, `inspect --mask-tokens 0` an
/// empty grid, `sinks --gu-len 0` left Gu et al.'s metric out, and `explain --d-model 0` split
/// a width of 0 into heads of 0.
#[test]
fn counts_that_0_makes_meaningless_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let m = common::tiny_gguf(&dir);
    let m = m.to_str().unwrap();
    let t = ["-m", m, "--text", "the hat sat"];
    let pair = [
        "--clean",
        "the hat",
        "--corrupt",
        "the cat",
        "--answer",
        "3",
        "--wrong",
        "4",
    ];
    let cases: [(&[&str], &str); 7] = [
        (&["dla"], "--top"),
        (&["ablate"], "--top"),
        (&["generate", "--max-new-tokens", "1"], "--top"),
        (&["inspect"], "--mask-tokens"),
        (&["sinks", "-m", m], "--gu-len"),
        (&["explain"], "--d-model"),
        (&["circuit", "-m", m], "--top"),
    ];
    for (cmd, flag) in cases {
        let mut args: Vec<&str> = cmd.to_vec();
        match cmd[0] {
            "circuit" => args.extend(pair),
            "sinks" | "explain" => {}
            _ => args.extend(t),
        }
        args.extend([flag, "0"]);
        let e = run_err(&args, 2);
        assert!(
            e.contains("give 1 or more") && e.contains(flag),
            "{args:?}: {e}"
        );
    }
}
