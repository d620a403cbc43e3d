//! The memory model `info` prints, checked against measured peaks: `inspect` of a fixed text
//! (under 128 tokens) at each `--memory` setting, in a child process that reports its own peak
//! resident memory (`VmHWM`, `ATTNSCOPE_PEAK_FILE`), on the three real models and the 1.5B at
//! `low` (all fetched by `.ci/run`). The bound (docs/precision.md#memory): the measured peak within
//! ±10% of the model's 128-token row. Measured on a 2-core Sapphire Rapids-class machine (AMX) and
//! an AVX2-only EPYC: every peak within 0.3-2.3% of its prediction.

use attnscope::model::memory::{plan, FIT_TOKENS};
use attnscope::model::{Memory, Precision};

const TEXT: &str = "Attention heads in a transformer read from earlier positions: each query \
compares itself with every key, turns the scores into weights with a softmax, and sums the values \
with those weights. The first token often takes most of the weight when nothing else matches, a \
sink that keeps the sums stable. This text is long enough to show that on every layer of the model.";

/// The peak resident bytes of `attnscope inspect -m alias --memory memory` on [`TEXT`].
fn measured_peak(alias: &str, memory: Memory) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let peak = dir.path().join("peak");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_attnscope"))
        .args([
            "inspect",
            "-m",
            alias,
            "-t",
            TEXT,
            "--memory",
            memory.name(),
        ])
        .env("ATTNSCOPE_PANEL_CACHE", "off")
        .env("ATTNSCOPE_PEAK_FILE", &peak)
        .env_remove("ATTNSCOPE_MEMORY")
        .env_remove("ATTNSCOPE_MEM_AVAILABLE")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{alias} --memory {memory}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read_to_string(&peak)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn the_memory_model_matches_measured_peaks_on_the_real_models() {
    let mut table = String::from("model                 memory  predicted   measured  ratio\n");
    let mut worst = 0f64;
    for alias in [
        "smollm2-135m",
        "qwen2.5-coder-0.5b",
        "gemma3-270m",
        "qwen2.5-coder-1.5b",
    ] {
        let p = plan(alias, false).unwrap();
        // the 1.5B at `low` only: its `fast` row (5.5 GB of f32 panels, ~40 s to pack without the
        // cache) checks the same arithmetic as the smaller models' `fast` rows
        let settings: &[Memory] = if alias == "qwen2.5-coder-1.5b" {
            &[Memory::Low]
        } else {
            &Memory::ALL
        };
        for &memory in settings {
            let predicted = p.footprint.need(memory, Precision::Exact, FIT_TOKENS);
            let measured = measured_peak(alias, memory);
            let ratio = measured as f64 / predicted as f64;
            worst = worst.max((ratio - 1.0).abs());
            table += &format!(
                "{alias:<21} {:<6} {:>7.1} MB {:>7.1} MB  {ratio:.3}\n",
                memory.name(),
                predicted as f64 / 1e6,
                measured as f64 / 1e6
            );
            assert!(
                (0.9..=1.1).contains(&ratio),
                "{alias} --memory {memory}: measured {measured} bytes, predicted {predicted} \
                 (ratio {ratio:.3}, bound 0.9-1.1)\n{table}"
            );
        }
    }
    eprintln!("{table}largest deviation {:.1}%", 100.0 * worst);
}
