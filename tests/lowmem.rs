//! `--memory low`: the projections multiplied straight from the file's quantized blocks. A tiny
//! model of every block type gives the numbers of the packed projections (`fast`), and the
//! bits of the f32 panels where `exact` runs those; the real models match transformers in both
//! settings (the golden tests rerun with `ATTNSCOPE_MEMORY=low`).
#![allow(clippy::needless_range_loop)]

mod common;
use attnscope::kernels::select::ExactOn;
use attnscope::model::tiny::{tiny_model, write_gguf};
use attnscope::model::tl_weights::Projection;
use attnscope::model::{Arch, Memory, Model, Precision};
use attnscope::reference::transformer::forward as reference_forward;
use attnscope::reference::Rng;
use candle_core::quantized::GgmlDType;
use common::assert_close;

/// What `exact` runs its packed projections on in this process (`ATTNSCOPE_AMX` and
/// `ATTNSCOPE_ISA` can force each: the f32 panels, the tiles' integers and scales, or three bf16
/// parts); `low` multiplies from the blocks, on the f32 GEMM or the integers and scales.
fn exact_kernel() -> ExactOn {
    attnscope::kernels::select::kernels().exact
}

const TOKENS: [u32; 9] = [72, 101, 108, 108, 111, 32, 256, 258, 259];

/// Every layer's pattern and every position's logits.
fn run(model: &Model) -> (Vec<Vec<f32>>, Vec<f32>) {
    common::patterns_and_logits(model, &TOKENS)
}

fn load(path: &std::path::Path, memory: Memory) -> Model {
    Model::load_full(
        path.to_str().unwrap(),
        Precision::Exact,
        Some(memory),
        false,
        None,
    )
    .unwrap()
}

/// Whether `a` and `b` hold the same bits (as far as the shorter goes).
fn bits(a: &[f32], b: &[f32]) -> bool {
    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// One file of block type `dtype` loaded in both settings: `low` multiplies every projection
/// from the blocks, `fast` packs them.
struct LowAndFast {
    dtype: GgmlDType,
    low: Model,
    fast: Model,
}

impl LowAndFast {
    /// Every layer's pattern within 1e-5 of fast's and the logits within 1e-4 of their scale,
    /// and bit for bit where `same_bits`. Returns low's patterns.
    fn patterns_and_logits_agree(&self, same_bits: bool) -> Vec<Vec<f32>> {
        let dtype = self.dtype;
        let (pl, ll) = run(&self.low);
        let (pf, lf) = run(&self.fast);
        for l in 0..2 {
            assert_close(
                &pl[l],
                &pf[l],
                1e-5,
                &format!("{dtype:?} layer {l} pattern"),
            );
            if same_bits {
                assert!(bits(&pl[l], &pf[l]), "{dtype:?} layer {l}: fast's bits");
            }
        }
        let scale = lf.iter().fold(1f32, |s, x| s.max(x.abs()));
        assert_close(&ll, &lf, 1e-4 * scale, &format!("{dtype:?} logits"));
        if same_bits {
            assert!(bits(&ll, &lf), "{dtype:?} logits: fast's bits");
        }
        pl
    }

    /// The backward's products by the transposes: from the blocks (low), packed (fast); the
    /// input gradients within 1e-4 of their scale, bit for bit on the f32 panels
    /// (`f32_kernels`).
    fn input_gradients_agree(&self, f32_kernels: bool) {
        let dtype = self.dtype;
        let metric = attnscope::model::backward::Metric::LogProb(None);
        let gl = self.low.gradient(&TOKENS, metric).unwrap();
        let gf = self.fast.gradient(&TOKENS, metric).unwrap();
        assert_eq!(gl.target, gf.target, "{dtype:?}");
        let gscale = gf.grad_input.iter().fold(1e-6f32, |s, x| s.max(x.abs()));
        assert_close(
            &gl.grad_input,
            &gf.grad_input,
            1e-4 * gscale,
            &format!("{dtype:?} input gradient"),
        );
        if f32_kernels {
            assert!(
                bits(&gl.grad_input, &gf.grad_input),
                "{dtype:?} input gradient: the f32 panels' bits"
            );
        }
    }

    /// The same weights, read back through each kernel: layer 1's four projections.
    fn read_back_weights_are_the_same_bits(&self) {
        for part in [
            Projection::Qkv,
            Projection::O,
            Projection::GateUp,
            Projection::Down,
        ] {
            let a = self.low.projection_weights(1, part).unwrap();
            let b = self.fast.projection_weights(1, part).unwrap();
            assert!(
                bits(&a.0, &b.0),
                "{:?} {part:?}: the dequantized weights, bit for bit",
                self.dtype
            );
        }
    }

    /// A head's columns of the output projection: 64 of 256, inside a K-quant super-block.
    fn head_output_projections_agree(&self) {
        let mut rng = Rng::new(11);
        let z = rng.normals(5 * 64, 1.0);
        for h in [1, 3] {
            let a = self.low.head_output_projection(0, h, &z, 5).unwrap();
            let b = match self.fast.head_output_projection(0, h, &z, 5) {
                Some(b) => b,
                // three bf16 parts take no column range: the padded product stands for it
                None if exact_kernel() == ExactOn::Bf16x3 => {
                    let mut padded = vec![0f32; 5 * 256];
                    for (r, row) in z.chunks(64).enumerate() {
                        padded[r * 256 + h * 64..][..64].copy_from_slice(row);
                    }
                    self.fast.output_projection(0, &padded, 5)
                }
                None => panic!("{:?} head {h}: W_O takes no column range", self.dtype),
            };
            assert_close(
                &a,
                &b,
                1e-5,
                &format!("{:?} head {h}'s output projection", self.dtype),
            );
        }
    }
}

/// For each block type: `low` multiplies every projection from the blocks, and its patterns,
/// logits, input gradients (the backward's products by the transposes), per-head output
/// projections (column slices that cut the K-quants' super-blocks) and
/// read-back weights equal `fast`'s: bit for bit on the f32 panels, and on the AMX tiles for the
/// types read as integers and scales (`low` decodes them per product into the tiles' layout);
/// within 1e-5 (1e-4 of the logits' scale) for the others on AMX (Q2_K, Q3_K, Q6_K, F16, F32:
/// `fast` packs f32 panels in another order of sums).
/// Where the CPU has AMX, the test then runs itself again on the f32 kernels
/// (`ATTNSCOPE_AMX=f32`), so the bits are compared on every CPU.
#[test]
fn low_memory_equals_the_packed_projections_on_every_block_type() {
    let dir = tempfile::tempdir().unwrap();
    let m = common::blockwide_model(3);
    let f32_kernels = exact_kernel() == ExactOn::F32;
    for dtype in common::BLOCK_TYPES {
        let path = dir.path().join(format!("t-{dtype:?}.gguf"));
        write_gguf(&m, Arch::Qwen2, dtype, &path).unwrap();
        // the same bits: on the f32 panels, and on the AMX tiles where the type is integers
        // and scales (`low` decodes them per product as `fast` packs them)
        let same_bits = f32_kernels
            || exact_kernel() == ExactOn::Scaled
                && attnscope::model::weights::scaled_kind_of(dtype.into()).is_some();
        let both = LowAndFast {
            dtype,
            low: load(&path, Memory::Low),
            fast: load(&path, Memory::Fast),
        };
        assert_eq!(both.low.info.memory, Memory::Low);
        assert_eq!(both.fast.info.memory, Memory::Fast);
        assert_eq!(
            both.low.low_projections(),
            (8, 8),
            "{dtype:?}: every projection from its blocks"
        );
        assert_eq!(both.fast.low_projections().0, 0, "{dtype:?}");
        let pl = both.patterns_and_logits_agree(same_bits);
        both.input_gradients_agree(f32_kernels);
        both.read_back_weights_are_the_same_bits();
        both.head_output_projections_agree();
        // F32 blocks are the reference's own weights: the reference forward's numbers
        if dtype == GgmlDType::F32 {
            let want = reference_forward(&m, &TOKENS);
            for l in 0..2 {
                assert_close(
                    &pl[l],
                    &want.patterns[l],
                    2e-5,
                    &format!("layer {l} vs reference"),
                );
            }
        }
    }
    if !f32_kernels {
        // the tiles ran above: the same checks on the f32 panels, bit for bit
        let text = common::rerun_with_amx(
            "low_memory_equals_the_packed_projections_on_every_block_type",
            "f32",
        );
        assert!(text.contains("test result: ok"), "{text}");
    }
}

/// IQ4_NL and IQ4_XS (read by attnscope's own code: candle's GGUF reader does not know them):
/// a tiny model whose every matrix is of the type loads in both settings; `low` multiplies every
/// projection from the blocks and gives `fast`'s numbers (bit for bit on the f32 panels, within
/// 1e-5 on the AMX tiles' integers and scales), and both give the reference forward's on the
/// weights the file holds. `info` names the type.
#[test]
fn iq4_files_run_end_to_end_in_both_settings() {
    use attnscope::model::weights::BlockType;
    let dir = tempfile::tempdir().unwrap();
    let m = common::blockwide_model(7);
    for ty in [BlockType::Iq4Nl, BlockType::Iq4Xs] {
        let path = dir.path().join(format!("t-{ty:?}.gguf"));
        let held = attnscope::model::tiny::write_gguf_iq4(&m, Arch::Qwen2, ty, &path).unwrap();
        let low = load(&path, Memory::Low);
        let fast = load(&path, Memory::Fast);
        assert_eq!(
            low.low_projections(),
            (8, 8),
            "{ty:?}: every projection from its blocks"
        );
        assert_eq!(fast.low_projections().0, 0, "{ty:?}");
        let (pl, ll) = run(&low);
        let (pf, lf) = run(&fast);
        let want = reference_forward(&held, &TOKENS);
        for l in 0..2 {
            assert_close(
                &pl[l],
                &pf[l],
                1e-5,
                &format!("{ty:?} layer {l} low vs fast"),
            );
            // the same bits: the f32 panels, or on AMX the tiles' integers and scales (not
            // `ATTNSCOPE_AMX=exact`'s three bf16 parts, which `low` does not run)
            assert!(
                bits(&pl[l], &pf[l]) || exact_kernel() == ExactOn::Bf16x3,
                "{ty:?} layer {l}: fast's bits"
            );
            assert_close(
                &pl[l],
                &want.patterns[l],
                2e-5,
                &format!("{ty:?} layer {l} vs reference"),
            );
        }
        let scale = lf.iter().fold(1f32, |s, x| s.max(x.abs()));
        assert_close(&ll, &lf, 1e-4 * scale, &format!("{ty:?} logits"));
        assert!(
            bits(&ll, &lf) || exact_kernel() == ExactOn::Bf16x3,
            "{ty:?} logits: fast's bits"
        );
        let n = TOKENS.len();
        let vocab = want.logits.len() / n;
        assert_close(
            &ll,
            &want.logits[..n * vocab],
            1e-4 * scale,
            &format!("{ty:?} logits vs reference"),
        );
        // the weights read back are the file's, bit for bit
        let w = low.projection_weights(0, Projection::Down).unwrap();
        assert!(
            bits(&w.0, &held.layers[0].w_down),
            "{ty:?}: the down projection's weights"
        );
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_attnscope"))
            .args(["info", "-m", path.to_str().unwrap()])
            .env("ATTNSCOPE_PANEL_CACHE", "off")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains(&format!("{ty:?}")),
            "{text}"
        );
    }
    if exact_kernel() != ExactOn::F32 {
        // the tiles ran above: the same checks on the f32 panels, bit for bit
        let text = common::rerun_with_amx("iq4_files_run_end_to_end_in_both_settings", "f32");
        assert!(text.contains("test result: ok"), "{text}");
    }
}

/// `low` with `--precision fast` is refused (it multiplies exactly), and so is an
/// `ATTNSCOPE_MEMORY` that names no setting; a Hugging Face folder's floats fall back to packed
/// panels and say so.
#[test]
fn low_memory_refusals_and_fallbacks_say_why() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    write_gguf(
        &tiny_model(Arch::Qwen2, 1),
        Arch::Qwen2,
        GgmlDType::Q8_0,
        &path,
    )
    .unwrap();
    let e = Model::load_full(
        path.to_str().unwrap(),
        Precision::Fast,
        Some(Memory::Low),
        false,
        None,
    )
    .err()
    .expect("low with fast is refused");
    assert!(e.to_string().contains("--precision exact"), "{e}");
    let hf = dir.path().join("hf");
    attnscope::model::tiny::write_hf_folder(&tiny_model(Arch::Qwen2, 1), Arch::Qwen2, &hf, 1)
        .unwrap();
    let m = load(&hf, Memory::Low);
    assert_eq!(m.low_projections().0, 0);
    assert!(
        m.info.memory_reason.contains("no quantized blocks"),
        "{}",
        m.info.memory_reason
    );
    // the default: chosen, and the reason given
    let m = Model::load_full(path.to_str().unwrap(), Precision::Exact, None, false, None).unwrap();
    assert!(!m.info.memory_reason.is_empty());
    let fp = m.info.footprint.as_ref().unwrap();
    let (chosen, why) = attnscope::model::memory::choose(fp, Precision::Exact, Some(1 << 20));
    assert_eq!(chosen, Memory::Low, "1 MB free: {why}");
    let (chosen, why) = attnscope::model::memory::choose(fp, Precision::Exact, Some(1 << 40));
    assert_eq!(chosen, Memory::Fast, "1 TB free: {why}");
    assert!(fp.weights(Memory::Low, Precision::Exact) < fp.weights(Memory::Fast, Precision::Exact));
}

/// The command line: `info --memory low` says the setting and prints the memory model (text and
/// JSON); `--memory low --precision fast` and an unknown setting exit 2.
#[test]
fn the_command_line_says_the_setting_and_refuses_bad_ones() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    write_gguf(
        &common::blockwide_model(5),
        Arch::Qwen2,
        GgmlDType::Q4K,
        &path,
    )
    .unwrap();
    let m = path.to_str().unwrap();
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_attnscope"))
            .args(args)
            .env("ATTNSCOPE_PANEL_CACHE", "off")
            .output()
            .unwrap()
    };
    let out = run(&["info", "-m", m, "--memory", "low"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("low: every projection multiplied from the file's quantized blocks"),
        "{text}"
    );
    assert!(
        text.contains("asked for (--memory low)") && text.contains("--memory fast"),
        "{text}"
    );
    let out = run(&["info", "-m", m, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        ["low", "fast"].contains(&v["model"]["memory"].as_str().unwrap()),
        "{v}"
    );
    let rows = v["memory_model"].as_array().unwrap();
    assert_eq!(rows[0]["tokens"], 128);
    for r in rows {
        assert!(
            r["low_bytes"].as_u64().unwrap() < r["fast_bytes"].as_u64().unwrap(),
            "{r}"
        );
    }
    let out = run(&[
        "inspect",
        "-m",
        m,
        "--memory",
        "low",
        "--precision",
        "fast",
        "-t",
        "the hat",
    ]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("--precision exact"));
    let out = run(&["inspect", "-m", m, "--memory", "tiny", "-t", "the hat"]);
    assert_eq!(out.status.code(), Some(2));
}

/// A model too big for the machine at the chosen setting is refused before its weights load,
/// with what it needs and what the machine has (exit 2); `ATTNSCOPE_MEM_AVAILABLE` fakes the
/// machine's available memory so the test is the same everywhere. Between `low`'s and `fast`'s
/// needs the default picks `low` and runs, and `--memory fast` is refused pointing at `low`.
#[test]
fn a_model_too_big_for_the_machine_is_refused_before_loading() {
    use attnscope::model::memory::{check_fits, parse_size, FIT_TOKENS};
    assert_eq!(parse_size("1234"), Some(1234));
    assert_eq!(parse_size("800M"), Some(800_000_000));
    assert_eq!(parse_size("1.5G"), Some(1_500_000_000));
    assert_eq!(parse_size(" 64k "), Some(64_000));
    for bad in ["", "lots", "-1G", "1.5T", "NaNG"] {
        assert_eq!(parse_size(bad), None, "{bad}");
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    write_gguf(
        &common::blockwide_model(5),
        Arch::Qwen2,
        GgmlDType::Q4K,
        &path,
    )
    .unwrap();
    let m = load(&path, Memory::Fast);
    let fp = m.info.footprint.as_ref().unwrap();
    let low = fp.need(Memory::Low, Precision::Exact, FIT_TOKENS);
    let fast = fp.need(Memory::Fast, Precision::Exact, FIT_TOKENS);
    assert!(low < fast, "{low} < {fast}");
    assert!(check_fits(fp, Memory::Fast, Precision::Exact, Some(fast)).is_ok());
    assert!(check_fits(fp, Memory::Fast, Precision::Exact, None).is_ok());
    let e = check_fits(fp, Memory::Fast, Precision::Exact, Some(fast - 1)).unwrap_err();
    assert!(
        e.is_bad_input() && e.to_string().contains("--memory low needs"),
        "{e}"
    );
    let run = |avail: &str, args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_attnscope"))
            .args(["inspect", "-m", path.to_str().unwrap(), "-t", "the hat"])
            .args(args)
            .env("ATTNSCOPE_PANEL_CACHE", "off")
            .env_remove("ATTNSCOPE_MEMORY")
            .env("ATTNSCOPE_MEM_AVAILABLE", avail)
            .output()
            .unwrap()
    };
    let gb = |b: u64| format!("{:.2} GB", b as f64 / 1e9);
    // too small for either setting
    let out = run("1000", &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!("needs {}", gb(low)))
            && err.contains("--memory low")
            && err.contains("0.00 GB available (ATTNSCOPE_MEM_AVAILABLE)")
            && err.contains("smaller model"),
        "{err}"
    );
    // room for low only: the default picks low and runs; fast is refused, pointing at low
    let between = ((low + fast) / 2).to_string();
    let out = run(&between, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&between, &["--memory", "fast"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!("needs {}", gb(fast)))
            && err.contains("--memory fast")
            && err.contains(&format!("--memory low needs {} and fits", gb(low))),
        "{err}"
    );
    // plenty: fast runs
    let out = run("1", &["--memory", "fast"]);
    assert_eq!(out.status.code(), Some(2), "1 byte is too little");
    let out = run("100G", &["--memory", "fast"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // a value that is not a size
    let out = run("lots", &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("ATTNSCOPE_MEM_AVAILABLE is `lots`"));
}
