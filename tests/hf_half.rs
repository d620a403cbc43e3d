//! Hugging Face folders in F16 and BF16 read from their files' bytes (no f32 copy of the
//! weights): the numbers are those of the same weights rounded to the type and saved as F32,
//! `--memory low` multiplies every projection from the bytes, the memory model counts the
//! file's bytes; a folder too big for the machine is refused from its headers, before loading.

mod common;
use attnscope::model::memory::FIT_TOKENS;
use attnscope::model::tiny::{tiny_model, write_hf_folder};
use attnscope::model::{Arch, Memory, Model, Precision};
use candle_core::{DType, Device, Tensor};
use common::{assert_close, max_abs_diff};
use std::collections::HashMap;
use std::path::Path;

const TOKENS: [u32; 9] = [72, 101, 108, 108, 111, 32, 256, 258, 259];

/// Copies the folder `from` to `to` with every tensor of its `model.safetensors` converted by
/// `convert` (the other files copied as they are).
fn convert_folder(from: &Path, to: &Path, convert: &dyn Fn(&Tensor) -> Tensor) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() && p.file_name().unwrap() != "model.safetensors" {
            std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
        }
    }
    let tensors = candle_core::safetensors::load(from.join("model.safetensors"), &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, convert(&t)))
        .collect::<HashMap<String, Tensor>>();
    candle_core::safetensors::save(&tensors, to.join("model.safetensors")).unwrap();
}

fn load(path: &Path, memory: Memory) -> Model {
    Model::load_full(
        path.to_str().unwrap(),
        Precision::Exact,
        Some(memory),
        false,
        None,
    )
    .unwrap()
}

/// Every layer's pattern and every position's logits.
fn run(model: &Model) -> (Vec<f32>, Vec<f32>) {
    let (p, logits) = common::patterns_and_logits(model, &TOKENS);
    (p.concat(), logits)
}

/// For F16 and BF16, with a tied and an untied head: the folder's numbers at `fast` and `low`
/// equal (within 1e-5) those of an F32 folder holding the same weights rounded to the type (the
/// values the bytes decode to), and differ from the unrounded F32 weights' by the rounding only;
/// `low` multiplies every projection from the bytes; the memory model counts the projections
/// at their bytes in the file for `low`, and packed (f32 panels, or BF16's values on the AMX
/// tiles) for `fast`.
#[test]
fn f16_and_bf16_folders_give_the_rounded_weights_numbers_from_their_bytes() {
    let dir = tempfile::tempdir().unwrap();
    for (seed, arch) in [(1, Arch::Qwen2), (4, Arch::Llama)] {
        let m = tiny_model(arch, seed);
        let f32_dir = dir.path().join(format!("f32-{seed}"));
        write_hf_folder(&m, arch, &f32_dir, 1).unwrap();
        let full = run(&load(&f32_dir, Memory::Fast));
        for (dt, name, tol) in [(DType::F16, "F16", 2e-2f32), (DType::BF16, "BF16", 1e-1)] {
            let half = dir.path().join(format!("{name}-{seed}"));
            convert_folder(&f32_dir, &half, &|t| t.to_dtype(dt).unwrap());
            let rounded = dir.path().join(format!("{name}-rounded-{seed}"));
            convert_folder(&f32_dir, &rounded, &|t| {
                t.to_dtype(dt).unwrap().to_dtype(DType::F32).unwrap()
            });
            let want = run(&load(&rounded, Memory::Fast));
            let fast = load(&half, Memory::Fast);
            assert_eq!(fast.info.memory, Memory::Fast);
            assert!(fast.info.tensor_types.contains_key(name), "{name}");
            assert_eq!(fast.low_projections().0, 0);
            let low = load(&half, Memory::Low);
            assert_eq!(low.info.memory, Memory::Low, "{}", low.info.memory_reason);
            let (n_low, all) = low.low_projections();
            assert_eq!(n_low, all, "{name}: every projection from the bytes");
            for (label, model) in [("fast", &fast), ("low", &low)] {
                let got = run(model);
                let l = format!("{arch:?} {name} {label}");
                assert_close(&got.0, &want.0, 1e-5, &format!("{l}: patterns"));
                assert_close(&got.1, &want.1, 1e-4, &format!("{l}: logits"));
                // the rounding shows against the unrounded weights, within the type's precision
                let d = max_abs_diff(&got.0, &full.0, &l);
                assert!(d > 0.0 && d < tol, "{l}: {d:.2e} from the f32 weights");
            }
            // the memory model: low holds the projections' bytes, 2 per weight
            let fp = low.info.footprint.as_ref().unwrap();
            let c = &m.cfg;
            let (q, kv) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
            let weights_per_layer =
                (q + 2 * kv) * c.d_model + c.d_model * q + 3 * c.d_ff * c.d_model;
            let bytes = 2 * (c.n_layers * weights_per_layer) as u64;
            assert_eq!(fp.projections_bytes(Memory::Low, Precision::Exact), bytes);
            // fast: f32 panels (twice the bytes), or for BF16 on AMX the tiles' 16-bit values
            let packed = if dt == DType::F16 { 2 * bytes } else { bytes };
            assert!(fp.projections_bytes(Memory::Fast, Precision::Exact) >= packed);
            let head = 2 * (c.vocab * c.d_model) as u64;
            assert_eq!(fp.head_bytes, head, "{name}: the head's bytes");
        }
    }
}

/// A folder too big for the machine (`ATTNSCOPE_MEM_AVAILABLE`) is refused before any tensor is
/// read, with what it needs and what the machine has (sized from the files' headers), and
/// `info` still prints its memory model.
#[test]
fn a_folder_too_big_for_the_machine_is_refused_from_its_headers() {
    let dir = tempfile::tempdir().unwrap();
    let f32_dir = dir.path().join("f32");
    write_hf_folder(&tiny_model(Arch::Qwen2, 2), Arch::Qwen2, &f32_dir, 1).unwrap();
    let half = dir.path().join("f16");
    convert_folder(&f32_dir, &half, &|t| t.to_dtype(DType::F16).unwrap());
    let m = load(&half, Memory::Fast);
    let fp = m.info.footprint.as_ref().unwrap();
    let low = fp.need(Memory::Low, Precision::Exact, FIT_TOKENS);
    let fast = fp.need(Memory::Fast, Precision::Exact, FIT_TOKENS);
    assert!(low < fast, "{low} < {fast}");
    let gb = |b: u64| format!("{:.2} GB", b as f64 / 1e9);
    let run = |dir: &Path, avail: &str, args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_attnscope"))
            .args(args)
            .args(["-m", dir.to_str().unwrap()])
            .env("ATTNSCOPE_PANEL_CACHE", "off")
            .env_remove("ATTNSCOPE_MEMORY")
            .env("ATTNSCOPE_MEM_AVAILABLE", avail)
            .output()
            .unwrap()
    };
    let inspect = ["inspect", "-t", "the hat"];
    let out = run(&half, "1000", &inspect);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!("needs {}", gb(low)))
            && err.contains("0.00 GB available (ATTNSCOPE_MEM_AVAILABLE)"),
        "{err}"
    );
    // room for low only: the default picks low; fast is refused, pointing at low
    let between = ((low + fast) / 2).to_string();
    let out = run(&half, &between, &inspect);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(
        &half,
        &between,
        &["inspect", "-t", "the hat", "--memory", "fast"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!("needs {}", gb(fast)))
            && err.contains(&format!("--memory low needs {} and fits", gb(low))),
        "{err}"
    );
    // info is not a run: it prints the memory model of a model the machine cannot hold
    let out = run(&half, "1000", &["info"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains(&gb(low)) && text.contains(&gb(fast)),
        "{text}"
    );
}

/// all-MiniLM-L6-v2 (an F32 folder) converted to F16 in a temporary folder: every projection
/// read from the bytes at `low`, and the last hidden states within f16's rounding of the F32
/// original's (the weights move by up to 2⁻¹¹ relative).
#[test]
fn minilm_in_f16_runs_from_its_bytes() {
    let f32_model = common::real_model("all-minilm-l6-v2");
    let dir = tempfile::tempdir().unwrap();
    let half = dir.path().join("minilm-f16");
    convert_folder(&f32_model.info.path, &half, &|t| {
        t.to_dtype(DType::F16).unwrap()
    });
    let low = load(&half, Memory::Low);
    assert_eq!(low.info.tensor_types.get("F16"), Some(&104));
    let (n_low, all) = low.low_projections();
    assert_eq!(n_low, all);
    let fp = low.info.footprint.as_ref().unwrap();
    // low: 2 bytes a weight; fast: f32 panels, 4 (F16 is not an AMX integers-and-scales type)
    assert!(
        2 * fp.projections_bytes(Memory::Low, Precision::Exact)
            <= fp.projections_bytes(Memory::Fast, Precision::Exact),
        "low holds the projections at half their f32 size"
    );
    let tokens = f32_model
        .encode("The quick brown fox jumps over the lazy dog.", false)
        .unwrap();
    let want = f32_model.encoder_states(&tokens).unwrap();
    let got = low.encoder_states(&tokens).unwrap();
    let d = common::assert_array(
        "MiniLM F16 against F32: last hidden states [position, dim]",
        &[tokens.len(), f32_model.dims.d_model],
        &got,
        &want,
        common::Bound::RelMax(2e-2),
    );
    assert!(d > 0.0, "the f16 rounding shows");
}
