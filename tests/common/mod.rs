//! Helpers shared by the integration tests.
#![allow(dead_code)]

use attnscope::model::{Model, Precision};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

pub fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

pub fn golden_json(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(golden(name)).expect("golden file"))
        .expect("golden json")
}

pub fn golden_npy(name: &str) -> (Vec<usize>, Vec<f32>) {
    attnscope::render::npy::from_npy(&std::fs::read(golden(name)).expect("golden npy"))
        .expect("valid npy")
}

/// A golden file's array of token ids (`[101, 2023, ...]`), each checked to be a u32.
pub fn token_ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("token ids: not an array: {v}"))
        .iter()
        .map(|x| {
            x.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .unwrap_or_else(|| panic!("token ids: {x} is not a token id"))
        })
        .collect()
}

/// The real models are loaded once per test binary (the alias fetcher runs if they are not
/// in the cache; `.ci/run` fetches them beforehand).
pub fn real_model(alias: &str) -> &'static Model {
    static MODELS: OnceLock<Mutex<Vec<(&'static str, &'static Model)>>> = OnceLock::new();
    let m = MODELS.get_or_init(|| Mutex::new(Vec::new()));
    let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, model)) = g.iter().find(|(a, _)| *a == alias) {
        return model;
    }
    let model: &'static Model = Box::leak(Box::new(
        Model::load(alias, Precision::Exact, false)
            .unwrap_or_else(|e| panic!("loading {alias}: {e}")),
    ));
    let name: &'static str = Box::leak(alias.to_string().into_boxed_str());
    g.push((name, model));
    model
}

/// The largest `|got - want|` of two engines' outputs (not a reference: see [`assert_cells`]),
/// after checking that both have the same length and that every value on both sides is finite
/// (a plain `fold(.., f32::max)` drops NaNs, and two infinities would compare equal).
pub fn max_abs_diff(got: &[f32], want: &[f32], label: &str) -> f32 {
    assert_eq!(
        got.len(),
        want.len(),
        "{label}: length {} != {}",
        got.len(),
        want.len()
    );
    let mut worst = 0.0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.is_finite() && w.is_finite(),
            "{label}: index {i} is {g} against {w}"
        );
        worst = worst.max((g - w).abs());
    }
    worst
}

/// Two flat arrays compared index by index through [`assert_cells`] (same length, every value
/// finite, the worst index named): for two engines' outputs, or a reference whose shape is only
/// its length. Where the shape is known, [`assert_array`] names the cells by their indices.
pub fn assert_close(got: &[f32], want: &[f32], tol: f32, label: &str) {
    assert_eq!(
        got.len(),
        want.len(),
        "{label}: length {} != {}",
        got.len(),
        want.len()
    );
    assert_array(label, &[want.len()], got, want, Bound::Abs(tol as f64));
}

/// Runs `test` of the current test binary again in a child process with `ATTNSCOPE_AMX=0` (read
/// once per process), so `fast` takes the 8-bit VNNI kernel where the CPU has it; asserts that it
/// passed and returns what it printed.
pub fn rerun_without_amx(test: &str) -> String {
    rerun_with_amx(test, "0")
}

/// Runs `test` of the current test binary again in a child process with `ATTNSCOPE_AMX=value`
/// (read once per process); asserts that it passed and returns what it printed.
pub fn rerun_with_amx(test: &str, value: &str) -> String {
    rerun_with_env(test, "ATTNSCOPE_AMX", value)
}

/// Runs `test` of the current test binary again in a child process with `var=value` set;
/// asserts that it passed and returns what it printed.
pub fn rerun_with_env(test: &str, var: &str, value: &str) -> String {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(var, value)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{test} with {var}={value}:\n{text}"
    );
    text
}

/// Says loudly that `what` could not run on a kernel the engine has, because this CPU lacks it
/// or `ATTNSCOPE_ISA`/`ATTNSCOPE_AMX` hold the process below it, and counts it: one line in
/// `target/tmp/untested-kernels.txt`, which `.ci/run` prints and counts at its end. A test that
/// checks a kernel never passes quietly where the kernel did not run.
#[allow(dead_code)]
pub fn untested_kernel(what: &str) {
    use std::io::Write;
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| "unset".into());
    let line = format!(
        "{what} [{}; ATTNSCOPE_ISA {}, ATTNSCOPE_AMX {}]",
        std::env::current_exe()
            .unwrap()
            .file_name()
            .unwrap()
            .to_string_lossy(),
        env("ATTNSCOPE_ISA"),
        env("ATTNSCOPE_AMX"),
    );
    eprintln!("\n!!!!!!!! KERNEL NOT TESTED: {line}\n");
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("untested-kernels.txt");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap();
    writeln!(f, "{line}").unwrap();
}

/// The fast kernels this CPU has beside the one this process runs, each as
/// `(fast_kernel()'s name, variable, value)` that puts a child process on it: the 8-bit VNNI
/// blocks (`ATTNSCOPE_AMX=0`) where the process runs bf16 tiles, and the 8-bit AVX2 blocks
/// (`ATTNSCOPE_ISA=avx2`) where it runs either. None when `ATTNSCOPE_ISA` or `ATTNSCOPE_AMX` is
/// set: such a run is there for the kernel it forces.
#[allow(dead_code)]
pub fn other_fast_kernels() -> Vec<(&'static str, &'static str, &'static str)> {
    use attnscope::kernels::select::{kernels, FastOn, Hardware};
    let (k, hw) = (kernels(), Hardware::detect());
    if k.forced.is_some() {
        return Vec::new();
    }
    let mut others = Vec::new();
    if k.fast == FastOn::Bf16 && hw.vnni {
        others.push(("8-bit blocks on AVX-512 VNNI", "ATTNSCOPE_AMX", "0"));
    }
    let wider = matches!(k.fast, FastOn::Bf16 | FastOn::Int8);
    if wider && attnscope::kernels::gemm::Isa::Avx2.supported() {
        others.push(("8-bit blocks on AVX2", "ATTNSCOPE_ISA", "avx2"));
    }
    others
}

/// The `attnscope` executable, its standard input empty (a command that reads a text from stdin
/// gets none).
pub fn attnscope() -> assert_cmd::Command {
    let mut c = assert_cmd::Command::cargo_bin("attnscope").unwrap();
    c.write_stdin("");
    c
}

/// A tiny Qwen2 model (seed 1) written as an f32 GGUF file in `dir`.
#[cfg(feature = "test-fixtures")]
pub fn tiny_gguf(dir: &tempfile::TempDir) -> PathBuf {
    let p = dir.path().join("tiny.gguf");
    attnscope::model::tiny::write_gguf(
        &attnscope::model::tiny::tiny_model(attnscope::model::Arch::Qwen2, 1),
        attnscope::model::Arch::Qwen2,
        candle_core::quantized::GgmlDType::F32,
        &p,
    )
    .unwrap();
    p
}

/// A tiny Qwen2 whose every matrix's depth is whole blocks of 256 (the K-quants' super-block):
/// d_model 256, 4 heads of 64 (2 KV heads), d_ff 512 (lowmem's and the fast kernels' every block type).
#[cfg(feature = "test-fixtures")]
#[allow(dead_code)]
pub fn blockwide_model(seed: u64) -> attnscope::reference::transformer::RefModel {
    let mut m = attnscope::model::tiny::tiny_model(attnscope::model::Arch::Qwen2, seed);
    let (dm, hd, nh, nkv, ff) = (256, 64, 4, 2, 512);
    m.cfg.d_model = dm;
    m.cfg.head_dim = hd;
    m.cfg.n_heads = nh;
    m.cfg.n_kv_heads = nkv;
    m.cfg.d_ff = ff;
    let mut rng = attnscope::reference::Rng::new(seed + 1);
    let (q, kv) = (nh * hd, nkv * hd);
    let norm = |rng: &mut attnscope::reference::Rng| -> Vec<f32> {
        (0..dm).map(|_| 1.0 + 0.1 * rng.normal()).collect()
    };
    for l in &mut m.layers {
        l.attn_norm = norm(&mut rng);
        l.w_q = rng.normals(q * dm, 0.1);
        l.b_q = Some(rng.normals(q, 0.3));
        l.w_k = rng.normals(kv * dm, 0.1);
        l.b_k = Some(rng.normals(kv, 0.3));
        l.w_v = rng.normals(kv * dm, 0.1);
        l.b_v = Some(rng.normals(kv, 0.1));
        l.w_o = rng.normals(dm * q, 0.05);
        l.mlp_norm = norm(&mut rng);
        l.w_gate = rng.normals(ff * dm, 0.05);
        l.w_up = rng.normals(ff * dm, 0.05);
        l.w_down = rng.normals(dm * ff, 0.05);
    }
    m.embed = rng.normals(m.cfg.vocab * dm, 1.0);
    m.final_norm = norm(&mut rng);
    m.lm_head = Some(rng.normals(m.cfg.vocab * dm, 0.1));
    m
}

/// The GGUF block types the tiny models are written in (every one candle writes that the engine
/// reads through candle; IQ4 has tests of its own).
#[allow(dead_code)]
pub const BLOCK_TYPES: [candle_core::quantized::GgmlDType; 12] = [
    candle_core::quantized::GgmlDType::F32,
    candle_core::quantized::GgmlDType::F16,
    candle_core::quantized::GgmlDType::BF16,
    candle_core::quantized::GgmlDType::Q8_0,
    candle_core::quantized::GgmlDType::Q5_0,
    candle_core::quantized::GgmlDType::Q5_1,
    candle_core::quantized::GgmlDType::Q4_0,
    candle_core::quantized::GgmlDType::Q4_1,
    candle_core::quantized::GgmlDType::Q2K,
    candle_core::quantized::GgmlDType::Q3K,
    candle_core::quantized::GgmlDType::Q4K,
    candle_core::quantized::GgmlDType::Q6K,
];

/// A finished command's standard error, as text.
pub fn stderr_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Starts `attnscope serve` with `args` (give it `--addr 127.0.0.1:0`) and returns the child and
/// the `host:port` it printed it listens on.
pub fn start_serve(args: &[&str]) -> (std::process::Child, String) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_attnscope"))
        .arg("serve")
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .split("http://")
        .nth(1)
        .unwrap_or_else(|| panic!("serve printed no address: {line:?}"))
        .split(|c: char| c == '/' || c.is_whitespace())
        .next()
        .unwrap()
        .to_string();
    (child, addr)
}

/// The chromium executable, by the lookup `.ci/run` uses (`tests/browser/find-browser.sh`).
pub fn browser() -> String {
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser/find-browser.sh");
    let out = std::process::Command::new("sh")
        .arg(script)
        .output()
        .expect("sh runs");
    assert!(
        out.status.success(),
        "{} (ATTNSCOPE_REQUIRE_BROWSER={:?})",
        String::from_utf8_lossy(&out.stderr).trim(),
        std::env::var("ATTNSCOPE_REQUIRE_BROWSER").ok()
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A command the tests run to its end: `attnscope` as [`attnscope`] makes it, or a plain
/// `std::process::Command`.
pub trait Runs: std::fmt::Debug {
    fn run_to_end(&mut self) -> std::process::Output;
}

impl Runs for assert_cmd::Command {
    fn run_to_end(&mut self) -> std::process::Output {
        self.output().unwrap()
    }
}

impl Runs for std::process::Command {
    fn run_to_end(&mut self) -> std::process::Output {
        self.output().unwrap()
    }
}

/// Runs `cmd` and asserts that it exited 0, printing the command, its standard output and its
/// standard error if not; returns what it wrote.
pub fn succeeds(cmd: &mut impl Runs) -> std::process::Output {
    let out = cmd.run_to_end();
    assert!(
        out.status.success(),
        "{cmd:?} exited with {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        stderr_of(&out)
    );
    out
}

/// Runs `cmd` and asserts that it exited with `code`, printing the command, its standard output
/// and its standard error if not; returns its standard error.
pub fn fails_with(cmd: &mut impl Runs, code: i32) -> String {
    let out = cmd.run_to_end();
    assert_eq!(
        out.status.code(),
        Some(code),
        "{cmd:?}\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        stderr_of(&out)
    );
    stderr_of(&out)
}

/// `attnscope ARGS`, asserted to exit 0 (see [`succeeds`]); what it wrote.
pub fn run_ok<I, S>(args: I) -> std::process::Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    succeeds(attnscope().args(args))
}

/// `attnscope ARGS`, asserted to exit 0; its standard output parsed as JSON.
pub fn run_json<I, S>(args: I) -> serde_json::Value
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    serde_json::from_slice(&run_ok(args).stdout).unwrap()
}

/// `attnscope ARGS`, asserted to exit with `code` (see [`fails_with`]); its standard error.
pub fn run_err<I, S>(args: I, code: i32) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    fails_with(attnscope().args(args), code)
}

/// Every layer's pattern (a vector each) and every position's logits (one after another) of a
/// forward over `tokens`.
pub fn patterns_and_logits(model: &Model, tokens: &[u32]) -> (Vec<Vec<f32>>, Vec<f32>) {
    let block_bytes = attnscope::model::forward::RunOptions::default().block_bytes;
    patterns_and_logits_in_blocks(model, tokens, block_bytes)
}

/// [`patterns_and_logits`] with the attention computed in blocks of `block_bytes`.
pub fn patterns_and_logits_in_blocks(
    model: &Model,
    tokens: &[u32],
    block_bytes: usize,
) -> (Vec<Vec<f32>>, Vec<f32>) {
    use attnscope::model::capture::{AttnCache, CaptureSpec};
    let mut cache = AttnCache::new(&CaptureSpec::patterns(), tokens.len());
    let opts = attnscope::model::forward::RunOptions {
        logits_at: (0..tokens.len()).collect(),
        block_bytes,
        ..Default::default()
    };
    let out = model.forward(tokens, &opts, &mut cache).unwrap();
    let p = (0..model.dims.n_layers)
        .map(|l| cache.pattern(l).unwrap().data.to_vec())
        .collect();
    (p, out.logits.concat())
}

/// Head `h`'s values (from `vals`, `[n, head_dim]`) through layer `l`'s own columns of W_O
/// (`None` where W_O takes no column range), and the whole W_O product of rows that hold them
/// and zeros outside head `h`: the two the norm tests compare bit for bit.
pub fn one_head_and_padded_output_projection(
    model: &Model,
    l: usize,
    h: usize,
    vals: &attnscope::analysis::norms::Values,
    n: usize,
) -> (Option<Vec<f32>>, Vec<f32>) {
    let d = &model.dims;
    let (hd, width) = (d.head_dim, d.n_heads * d.head_dim);
    let z_h: Vec<f32> = (0..n)
        .flat_map(|j| vals.get(j, h / d.group_size()).to_vec())
        .collect();
    let mut padded = vec![0f32; n * width];
    for j in 0..n {
        padded[j * width + h * hd..][..hd].copy_from_slice(&z_h[j * hd..][..hd]);
    }
    let whole = model.output_projection(l, &padded, n);
    (model.head_output_projection(l, h, &z_h, n), whole)
}

/// One head's columns of W_O (`own`, [`one_head_and_padded_output_projection`]) give the bits of
/// the padded product (`whole`). Where `exact` runs three bf16 parts on the AMX tiles
/// (`ATTNSCOPE_AMX=exact`) a column range has no product of its own (`None`): the analyses then
/// take the padded product itself, and there is nothing to compare.
#[allow(dead_code)]
pub fn assert_head_columns_are_the_padded_product(
    own: Option<Vec<f32>>,
    whole: &[f32],
    label: &str,
) {
    use attnscope::kernels::select::{kernels, ExactOn};
    match own {
        Some(own) => assert!(
            own.iter()
                .zip(whole)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{label}: one head's columns differ from the padded product"
        ),
        None => assert_eq!(
            kernels().exact,
            ExactOn::Bf16x3,
            "{label}: W_O takes no column range"
        ),
    }
}

/// How far a compared cell may be from its reference.
#[derive(Clone, Copy, Debug)]
pub enum Bound {
    /// `|got - want| <= x` for every cell.
    Abs(f64),
    /// `|got - want| <= x * max |want|` over the reference's cells.
    RelMax(f64),
}

/// Compares a report with a reference cell by cell and returns the worst `|got - want|`.
///
/// Fails (with the label, the cell and both values) when an expected cell is missing, appears
/// twice, or is not expected at all; when either side holds a NaN or an infinity (a plain
/// `fold(.., f64::max)` drops NaNs, so a NaN would pass); or when the worst difference is over
/// `bound`. Prints the worst difference and the bound, so a run shows the measured figure.
/// The keys name the cells (`(layer, head)`, `"L3.H5"`, ...): any `Ord + Debug` type.
pub fn assert_cells<K, G, W>(label: &str, got: G, want: W, bound: Bound) -> f64
where
    K: Ord + std::fmt::Debug + Clone,
    G: IntoIterator<Item = (K, f64)>,
    W: IntoIterator<Item = (K, f64)>,
{
    use std::collections::BTreeMap;
    let mut expected: BTreeMap<K, f64> = BTreeMap::new();
    for (k, w) in want {
        assert!(w.is_finite(), "{label}: the reference's cell {k:?} is {w}");
        assert!(
            expected.insert(k.clone(), w).is_none(),
            "{label}: the reference has cell {k:?} twice"
        );
    }
    assert!(!expected.is_empty(), "{label}: the reference has no cells");
    let scale = expected.values().fold(0.0f64, |m, w| m.max(w.abs()));
    let tol = match bound {
        Bound::Abs(x) => x,
        Bound::RelMax(x) => x * scale,
    };
    let mut seen: BTreeMap<K, f64> = BTreeMap::new();
    let (mut worst, mut at) = (0.0f64, None);
    for (k, g) in got {
        assert!(g.is_finite(), "{label}: cell {k:?} is {g}");
        let Some(&w) = expected.get(&k) else {
            panic!("{label}: cell {k:?} (= {g}) is not in the reference");
        };
        assert!(
            seen.insert(k.clone(), g).is_none(),
            "{label}: cell {k:?} is reported twice"
        );
        let d = (g - w).abs();
        if at.is_none() || d > worst {
            worst = d;
            at = Some((k, g, w));
        }
    }
    let missing: Vec<&K> = expected.keys().filter(|k| !seen.contains_key(*k)).collect();
    assert!(
        missing.is_empty(),
        "{label}: {} of {} reference cells missing, first {:?}",
        missing.len(),
        expected.len(),
        missing[0]
    );
    let (k, g, w) = at.expect("at least one cell");
    eprintln!(
        "{label}: {} cells, max |difference| {worst:.2e} at {k:?} (bound {tol:.1e}{})",
        expected.len(),
        match bound {
            Bound::RelMax(x) => format!(" = {x:.0e} x max |ref| {scale:.3e}"),
            Bound::Abs(_) => String::new(),
        }
    );
    assert!(
        worst <= tol,
        "{label}: max |difference| {worst:.3e} > bound {tol:.2e} at cell {k:?} (got {g}, want {w})"
    );
    worst
}

/// The cells of a row-major array of `shape`, keyed by their index vector: what
/// [`assert_cells`] compares for two arrays of the same shape.
pub fn array_cells<T: Copy + Into<f64>>(shape: &[usize], data: &[T]) -> Vec<(Vec<usize>, f64)> {
    let n: usize = shape.iter().product();
    assert_eq!(
        n,
        data.len(),
        "array of shape {shape:?} has {} values",
        data.len()
    );
    let mut idx = vec![0usize; shape.len()];
    let mut out = Vec::with_capacity(n);
    for &v in data {
        out.push((idx.clone(), v.into()));
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

/// [`assert_cells`] on two row-major arrays that must both have `shape` (a wrong length fails
/// and names which side).
pub fn assert_array<G, W>(label: &str, shape: &[usize], got: &[G], want: &[W], bound: Bound) -> f64
where
    G: Copy + Into<f64>,
    W: Copy + Into<f64>,
{
    let n: usize = shape.iter().product();
    assert_eq!(
        got.len(),
        n,
        "{label}: {} values for shape {shape:?}",
        got.len()
    );
    assert_eq!(
        want.len(),
        n,
        "{label}: the reference has {} values for shape {shape:?}",
        want.len()
    );
    assert_cells(
        label,
        array_cells(shape, got),
        array_cells(shape, want),
        bound,
    )
}

/// The numbers of a JSON value (a number, or arrays of them nested to any depth, ragged or not),
/// keyed by their index path; a `null` (what serde_json writes for a NaN or an infinity) or
/// any other non-number is a NaN cell, so [`assert_cells`] fails on it and names it.
pub fn json_cells(v: &serde_json::Value) -> Vec<(Vec<usize>, f64)> {
    fn walk(v: &serde_json::Value, at: &mut Vec<usize>, out: &mut Vec<(Vec<usize>, f64)>) {
        match v {
            serde_json::Value::Array(xs) => {
                for (i, x) in xs.iter().enumerate() {
                    at.push(i);
                    walk(x, at, out);
                    at.pop();
                }
            }
            x => out.push((at.clone(), x.as_f64().unwrap_or(f64::NAN))),
        }
    }
    let mut out = Vec::new();
    walk(v, &mut Vec::new(), &mut out);
    out
}

/// [`assert_cells`] of `got` (row-major) against a JSON reference (numbers nested to any depth),
/// each value keyed by the index path of the reference's cell in the same place, so a message
/// names cells as the reference nests them. A different count of values fails, naming both.
pub fn assert_json<G: Copy + Into<f64>>(
    label: &str,
    got: &[G],
    want: &serde_json::Value,
    bound: Bound,
) -> f64 {
    let want = json_cells(want);
    assert_eq!(
        got.len(),
        want.len(),
        "{label}: {} values against the reference's {}",
        got.len(),
        want.len()
    );
    let got: Vec<(Vec<usize>, f64)> = want
        .iter()
        .zip(got)
        .map(|((at, _), &g)| (at.clone(), g.into()))
        .collect();
    assert_cells(label, got, want, bound)
}

/// Integrated gradients' reference for the lesson's sentence (an object with `ig` and
/// `ig_completeness_gap`) and its bound, a fraction of the largest score: torch autograd's f32
/// (`r`, the model's `*_gradients.json` text) within 3e-4 (measured: 3.9e-5 on SmolLM2, 2.5e-6 on
/// Gemma 3), but for Qwen2.5 float64 autograd's
/// (`qwen_ig_f64.json`, `make_ig_f64_golden.py`) within 1e-2. Qwen2.5's first midpoints (α =
/// 1/64, 3/64) put layer 0's attention, tiny inputs beside large q/k biases, where f32 is
/// ill-conditioned: at α = 1/64 attnscope's gradient × input is 0.85 from float64's (of 156),
/// transformers' f32 autograd's 1.9 (0.08 with layer 0's attention alone in float64), so over 32
/// steps attnscope's scores are 3.3e-3 (AMX integer tiles, the default here) to 6.8e-3 (the
/// AVX-512 f32 GEMM, `ATTNSCOPE_ISA=avx512`) and transformers' f32 ones 7.1e-3 of the largest from
/// float64's: the bound holds f32's own conditioning on every kernel, and a tenfold drift fails.
pub fn ig_reference(short: &str, r: &serde_json::Value) -> (serde_json::Value, f64) {
    match short {
        "qwen" => (golden_json("qwen_ig_f64.json"), 1e-2),
        _ => (r.clone(), 3e-4),
    }
}

/// Each tensor's name, shape and values, as a capture file holds them.
pub type Tensors = std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)>;

pub fn read_safetensors(bytes: &[u8]) -> Tensors {
    let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, t)| {
            let data = t
                .data()
                .chunks(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, (t.shape().to_vec(), data))
        })
        .collect()
}

/// Every member of an .npz, each parsed as .npy (`token_ids` among them).
pub fn read_npz(bytes: &[u8]) -> Tensors {
    use std::io::Read;
    let mut got = Tensors::new();
    let mut z = zip::ZipArchive::new(std::io::Cursor::new(bytes)).unwrap();
    for i in 0..z.len() {
        let mut f = z.by_index(i).unwrap();
        let name = f.name().unwrap().trim_end_matches(".npy").to_string();
        let mut body = Vec::new();
        f.read_to_end(&mut body).unwrap(); // the zip crate checks each member's CRC-32
        got.insert(name, attnscope::render::npy::from_npy(&body).unwrap());
    }
    got
}
