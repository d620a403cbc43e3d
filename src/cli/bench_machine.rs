//! `attnscope bench --machine`: one screen of what this CPU has (model, the instruction sets the
//! kernels use, cores, caches), its measured limits (the f32 FMA peak of a register-only loop,
//! per core and on every core; the memory bandwidth of a streaming read far past the last
//! cache), and each kernel's measured rate against the limit that bounds it: the f32 GEMM and
//! the AMX tiles at the model's shapes against the FMA peak, the decode step's products from the
//! file's blocks and a whole decode step (`generate`) against the bandwidth over the bytes of
//! weights a token reads.

use attnscope::kernels::qmatvec::{self, Blocks, Part};
use attnscope::render::table::{title, Align, Table};
use serde::Serialize;
use std::time::Instant;

/// One cache level of cpu0 (`/sys/devices/system/cpu/cpu0/cache/index*`).
#[derive(Serialize)]
pub(super) struct CacheRow {
    level: String,
    kind: String,
    size: String,
    shared_with: String,
}

/// The screen's figures.
#[derive(Serialize)]
pub(super) struct MachineReport {
    cpu: String,
    flags: Vec<(String, bool)>,
    cores: usize,
    threads: usize,
    caches: Vec<CacheRow>,
    fma_peak_gflops_one_core: f64,
    fma_peak_gflops_all_cores: f64,
    bandwidth_gbs: f64,
    exact_kernel: String,
    decode_from_blocks: bool,
    /// `(name, GFLOP/s or GB/s, the limit's name, fraction of it)`
    kernels: Vec<(String, f64, String, f64)>,
    decode_bytes_per_token: u64,
    decode_limit_tokens_per_s: f64,
    decode_tokens_per_s: f64,
}

/// The ISA flags of `/proc/cpuinfo` that decide which kernels run.
fn flags() -> Vec<(String, bool)> {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let have: std::collections::HashSet<&str> = info
        .lines()
        .find(|l| l.starts_with("flags"))
        .and_then(|l| l.split(':').nth(1))
        .map(|f| f.split_whitespace().collect())
        .unwrap_or_default();
    [
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512_vnni",
        "avx512_bf16",
        "amx_tile",
        "amx_int8",
    ]
    .iter()
    .map(|f| (f.to_string(), have.contains(f)))
    .collect()
}

/// cpu0's caches, as Linux lists them.
fn caches() -> Vec<CacheRow> {
    let root = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let read = |d: &std::path::Path, f: &str| {
        std::fs::read_to_string(d.join(f))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "?".into())
    };
    let mut dirs: Vec<_> = std::fs::read_dir(root)
        .map(|r| r.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    dirs.retain(|d| {
        d.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("index"))
    });
    dirs.sort();
    dirs.iter()
        .map(|d| CacheRow {
            level: format!("L{}", read(d, "level")),
            kind: read(d, "type"),
            size: read(d, "size"),
            shared_with: read(d, "shared_cpu_list"),
        })
        .collect()
}

/// 12 independent FMA chains of the widest vectors, in registers only, for about `seconds`:
/// GFLOP/s of one thread.
fn fma_loop(seconds: f64) -> f64 {
    let start = Instant::now();
    let mut flops = 0f64;
    let mut sink = 0f32;
    while start.elapsed().as_secs_f64() < seconds {
        let (f, s) = fma_burst(1 << 20);
        flops += f;
        sink += s;
    }
    std::hint::black_box(sink);
    flops / start.elapsed().as_secs_f64() / 1e9
}

/// `iters` rounds of 12 FMAs on the widest vectors: `(flops, a value to keep)`.
fn fma_burst(iters: usize) -> (f64, f32) {
    #[cfg(target_arch = "x86_64")]
    {
        use attnscope::kernels::simd::{current, Level};
        match current() {
            // SAFETY: `current` names only a level whose features this CPU has.
            Level::Avx512 => return (iters as f64 * 12.0 * 32.0, unsafe { fma512(iters) }),
            // SAFETY: as above.
            Level::Avx2 => return (iters as f64 * 12.0 * 16.0, unsafe { fma256(iters) }),
            Level::Base => {}
        }
    }
    let mut acc = [1f32; 12];
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = a.mul_add(0.999_999, 1e-7);
        }
    }
    (iters as f64 * 24.0, acc.iter().sum())
}

macro_rules! fma_chains {
    ($name:ident, $feat:literal, $ty:ty, $set:ident, $fma:ident, $store:ident, $lanes:literal) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feat)]
        unsafe fn $name(iters: usize) -> f32 {
            use std::arch::x86_64::*;
            let (m, c) = ($set(0.999_999), $set(1e-7));
            let mut acc: [$ty; 12] = [$set(1.0); 12];
            for _ in 0..iters {
                for a in acc.iter_mut() {
                    *a = $fma(*a, m, c);
                }
            }
            let mut out = [0f32; $lanes];
            let mut s = 0f32;
            for a in acc {
                // SAFETY: `out` holds one vector of lanes
                unsafe { $store(out.as_mut_ptr(), a) };
                s += out.iter().sum::<f32>();
            }
            s
        }
    };
}
fma_chains!(
    fma512,
    "avx512f,fma",
    __m512,
    _mm512_set1_ps,
    _mm512_fmadd_ps,
    _mm512_storeu_ps,
    16
);
fma_chains!(
    fma256,
    "avx2,fma",
    __m256,
    _mm256_set1_ps,
    _mm256_fmadd_ps,
    _mm256_storeu_ps,
    8
);

/// The FMA peak: one thread, and one per core at once (rayon's threads).
fn fma_peak(seconds: f64) -> (f64, f64) {
    use rayon::prelude::*;
    let one = (0..2).map(|_| fma_loop(seconds)).fold(0.0, f64::max);
    let threads = rayon::current_num_threads();
    let all = (0..2)
        .map(|_| {
            (0..threads)
                .into_par_iter()
                .map(|_| fma_loop(seconds))
                .sum::<f64>()
        })
        .fold(0.0, f64::max);
    (one, all)
}

/// GB/s of a read of `gib` GiB on every thread (summed as u64 lanes), the best of three.
fn bandwidth(gib: f64) -> f64 {
    use rayon::prelude::*;
    let n = (gib * (1u64 << 30) as f64) as usize / 8;
    let buf: Vec<u64> = (0..n).into_par_iter().map(|i| i as u64).collect();
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let s: u64 = buf
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
            .reduce(|| 0, |a, b| a.wrapping_add(b));
        std::hint::black_box(s);
        best = best.max((n * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// The decode kernel's read rate (GB/s) over Q4_K blocks of `bytes` in all (past the caches,
/// as a decode step's weights are), `k` wide: the best of three passes.
fn matvec_rate(bytes: usize, k: usize) -> f64 {
    let rb = Blocks::Q4K.row_bytes(k);
    let rows = bytes / rb;
    let mut rng = attnscope::reference::Rng::new(3);
    let mut w: Vec<u8> = (0..rows * rb).map(|_| rng.next_u64() as u8).collect();
    // finite scales: the f16 `d` and `dmin` of every block small
    for b in w.chunks_exact_mut(144) {
        b[..2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        b[2..4].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
    }
    let x = rng.normals(k, 1.0);
    let mut y = vec![0f32; rows];
    let part = [Part {
        bytes: &w,
        ty: Blocks::Q4K,
        rows,
    }];
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        qmatvec::matvec(&part, &x, &mut y, false);
        best = best.max(w.len() as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// Bytes of weights one decode step reads: every projection and the output head, as the file
/// holds them (the embedding's one row aside).
fn decode_bytes(model: &attnscope::model::Model) -> u64 {
    model.decode_bytes()
}

/// A decode step's tokens/s: `generate` of `new` tokens after the built-in corpus's first
/// `prompt` tokens (the prefill excluded), the best of `repeats`.
fn decode_rate(
    model: &attnscope::model::Model,
    prompt: usize,
    new: usize,
    repeats: usize,
) -> anyhow::Result<f64> {
    let ids = attnscope::analysis::corpus::builtin_tokens(&model.tokenizer, prompt)?;
    let o = attnscope::model::generate::GenOptions {
        max_new_tokens: new,
        ..Default::default()
    };
    let mut best = 0f64;
    for _ in 0..repeats.max(1) {
        let g = model.generate(&ids, &o, |_| {})?;
        let steps = g.generated.len().saturating_sub(1);
        best = best.max(steps as f64 / g.decode_s.max(1e-9));
    }
    Ok(best)
}

/// Measures the machine and the model's kernels, and prints the screen.
pub(super) fn run(
    model: &attnscope::model::Model,
    rates: &super::bench::Rates,
    repeats: usize,
    json: bool,
) -> anyhow::Result<()> {
    let (cpu, threads) = attnscope::analysis::measure::machine();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (one, all) = fma_peak(0.3);
    let bw = bandwidth(1.5);
    let mut kernels = Vec::new();
    for g in &rates.gemms {
        let shape = format!("{} [{}×{}]·[{}×{}]ᵀ", g.name, g.m, g.k, g.n, g.k);
        kernels.push((
            format!("f32 GEMM {shape}"),
            g.attnscope_gflops,
            "FMA peak".into(),
            g.attnscope_gflops / all,
        ));
        if let Some(r) = g.amx_scaled_gflops {
            kernels.push((
                format!("AMX integers×scales {shape}"),
                r,
                "FMA peak".into(),
                r / all,
            ));
        }
    }
    let k = model.dims.d_model;
    let mv = matvec_rate(
        decode_bytes(model).max(1 << 28) as usize,
        k.div_ceil(256) * 256,
    );
    kernels.push((
        "decode matvec, Q4_K blocks (GB/s)".into(),
        mv,
        "bandwidth".into(),
        mv / bw,
    ));
    let bytes = decode_bytes(model);
    let limit = bw * 1e9 / bytes.max(1) as f64;
    let tps = decode_rate(model, 500.min(model.dims.context_len / 2), 32, repeats)?;
    let r = MachineReport {
        cpu,
        flags: flags(),
        cores,
        threads,
        caches: caches(),
        fma_peak_gflops_one_core: one,
        fma_peak_gflops_all_cores: all,
        bandwidth_gbs: bw,
        exact_kernel: attnscope::kernels::select::kernels().exact_name(),
        decode_from_blocks: qmatvec::chosen(),
        kernels,
        decode_bytes_per_token: bytes,
        decode_limit_tokens_per_s: limit,
        decode_tokens_per_s: tps,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", screen(&r, &model.info.name));
    }
    Ok(())
}

/// The report as text.
fn screen(r: &MachineReport, model: &str) -> String {
    let mut s = title("This machine");
    let have: Vec<String> = r
        .flags
        .iter()
        .map(|(f, on)| format!("{f}{}", if *on { "" } else { " (no)" }))
        .collect();
    s += &format!(
        "CPU: {} — {} cores, {} threads\n",
        r.cpu, r.cores, r.threads
    );
    s += &format!("ISA: {}\n", have.join(", "));
    let caches: Vec<String> = r
        .caches
        .iter()
        .map(|c| format!("{} {} {} (cpus {})", c.level, c.kind, c.size, c.shared_with))
        .collect();
    s += &format!("Caches: {}\n", caches.join("; "));
    s += &format!(
        "f32 FMA peak (register-only loop): {:.0} GFLOP/s one core, {:.0} all cores\n",
        r.fma_peak_gflops_one_core, r.fma_peak_gflops_all_cores
    );
    s += &format!(
        "Memory bandwidth (streaming read of 1.5 GiB): {:.1} GB/s\n\n",
        r.bandwidth_gbs
    );
    s += &title(&format!(
        "Kernels ({model}; exact on {}, decode from the file's blocks: {})",
        r.exact_kernel, r.decode_from_blocks
    ));
    let mut t = Table::new([
        ("kernel", Align::Left),
        ("rate", Align::Right),
        ("against", Align::Left),
        ("fraction", Align::Right),
    ]);
    for (name, rate, of, f) in &r.kernels {
        t.row([
            name.clone(),
            format!("{rate:.1}"),
            of.clone(),
            format!("{:.0}%", 100.0 * f),
        ]);
    }
    s += &t.render();
    s += &format!(
        "\nDecode: {:.1} tokens/s (generate, 500-token prompt, 32 new); limit {:.1} tokens/s = bandwidth / {:.0} MB of weights a token reads: {:.0}% of it\n",
        r.decode_tokens_per_s,
        r.decode_limit_tokens_per_s,
        r.decode_bytes_per_token as f64 / 1e6,
        100.0 * r.decode_tokens_per_s / r.decode_limit_tokens_per_s
    );
    s
}
