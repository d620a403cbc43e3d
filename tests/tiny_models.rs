//! Tiny generated models (Qwen2 and Llama shapes, GQA 4:2) written as GGUF and as Hugging Face
//! folders: both loads give the same patterns, equal to a forward written with the `reference`
//! module on the same weights.
// index loops over (layer, head, query) read like the maths; nested test types stay inline
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

mod common;
use attnscope::model::capture::{AttnCache, CaptureSpec, Hook, Queries};
use attnscope::model::forward::RunOptions;
use attnscope::model::panels;
use attnscope::model::tiny::{tiny_model, write_gguf, write_hf_folder};
use attnscope::model::{Arch, Model, Precision};
use attnscope::reference::transformer::forward as reference_forward;
use candle_core::quantized::GgmlDType;
use common::{assert_close, run_json};

const TOKENS: [u32; 9] = [72, 101, 108, 108, 111, 32, 256, 258, 259];

/// The kernels the row-by-row tests run: Llama and Qwen2 exact, and Qwen2 fast.
const EXACT_BOTH_FAST_QWEN2: [(Arch, Precision); 3] = [
    (Arch::Llama, Precision::Exact),
    (Arch::Qwen2, Precision::Exact),
    (Arch::Qwen2, Precision::Fast),
];

fn patterns(model: &Model, tokens: &[u32], block_bytes: usize) -> (Vec<Vec<f32>>, Vec<f32>) {
    common::patterns_and_logits_in_blocks(model, tokens, block_bytes)
}

fn check(arch: Arch) {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_model(arch, 42);
    let want = reference_forward(&m, &TOKENS);
    let gguf = dir.path().join("tiny.gguf");
    write_gguf(&m, arch, GgmlDType::F32, &gguf).unwrap();
    let hf = dir.path().join("hf");
    write_hf_folder(&m, arch, &hf, 1).unwrap();
    let sharded = dir.path().join("hf-sharded");
    write_hf_folder(&m, arch, &sharded, 3).unwrap();
    for (label, path) in [
        ("gguf", &gguf),
        ("safetensors", &hf),
        ("sharded safetensors", &sharded),
    ] {
        let model = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
        assert_eq!(model.dims.arch, arch);
        for block in [64 << 20, 4 * 9 * 4 * 2] {
            let (got, logits) = patterns(&model, &TOKENS, block);
            for l in 0..2 {
                assert_close(
                    &got[l],
                    &want.patterns[l],
                    2e-5,
                    &format!("{arch:?} {label} blocks.{l}.attn.hook_pattern (block {block} B)"),
                );
            }
            assert_close(
                &logits,
                &want.logits,
                1e-3,
                &format!("{arch:?} {label} logits"),
            );
        }
    }
}

#[test]
fn tiny_qwen2_gguf_and_safetensors_equal_reference() {
    check(Arch::Qwen2);
}

#[test]
fn tiny_llama_gguf_and_safetensors_equal_reference() {
    check(Arch::Llama);
}

/// Swapping the RoPE pair layout must be visible: a Llama GGUF read as if it were not permuted
/// gives other patterns (the reason RopeStyle is a type, not an afterthought).
#[test]
fn llama_gguf_without_permutation_differs() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_model(Arch::Llama, 42);
    let want = reference_forward(&m, &TOKENS);
    // write the Qwen2 way (no permutation) but declare llama: the loader uses interleaved RoPE
    let mut unpermuted = m.clone();
    let path = dir.path().join("wrong.gguf");
    // pre-apply the inverse: writing through the llama path permutes, so give it rows that
    // permute back to HF order only if the loader ignored the layout
    for l in &mut unpermuted.layers {
        l.w_q = inverse_permute(&l.w_q, 4, 8, 32);
        l.w_k = inverse_permute(&l.w_k, 2, 8, 32);
    }
    write_gguf(&unpermuted, Arch::Llama, GgmlDType::F32, &path).unwrap();
    let model = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
    let (got, _) = patterns(&model, &TOKENS, 64 << 20);
    let diff = common::max_abs_diff(&got[1], &want.patterns[1], "a wrong RoPE layout");
    assert!(
        diff > 1e-2,
        "a wrong RoPE layout should change the patterns, max diff {diff}"
    );
}

fn inverse_permute(w: &[f32], n_heads: usize, head_dim: usize, cols: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0.0; w.len()];
    for h in 0..n_heads {
        for i in 0..half {
            for (dst_i, src_i) in [(i, 2 * i), (i + half, 2 * i + 1)] {
                out[(h * head_dim + dst_i) * cols..][..cols]
                    .copy_from_slice(&w[(h * head_dim + src_i) * cols..][..cols]);
            }
        }
    }
    out
}

/// The capture contract: shapes, K/V not repeated for GQA, masked scores -inf, rows sum to 1,
/// the upper triangle exactly 0, head and query filters.
#[test]
fn capture_hooks_have_their_shapes_and_invariants() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_model(Arch::Qwen2, 7);
    let path = dir.path().join("t.gguf");
    write_gguf(&m, Arch::Qwen2, GgmlDType::F32, &path).unwrap();
    let model = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
    let n = TOKENS.len();
    let spec = CaptureSpec {
        hooks: attnscope::model::capture::Hook::ALL.to_vec(),
        layers: None,
        heads: None,
        queries: Queries::All,
    };
    let mut cache = AttnCache::new(&spec, n);
    model
        .forward(&TOKENS, &RunOptions::default(), &mut cache)
        .unwrap();
    let shape = |l, h| cache.get(l, h).unwrap().shape.clone();
    assert_eq!(shape(1, Hook::Q), vec![n, 4, 8]);
    assert_eq!(
        shape(1, Hook::K),
        vec![n, 2, 8],
        "hook_k is per KV head, not repeated"
    );
    assert_eq!(shape(1, Hook::V), vec![n, 2, 8]);
    assert_eq!(shape(1, Hook::Z), vec![n, 4, 8]);
    assert_eq!(shape(0, Hook::ResidPre), vec![n, 32]);
    assert_eq!(shape(0, Hook::Pattern), vec![4, n, n]);
    assert_eq!(cache.entries.len(), 2 * Hook::ALL.len());
    let p = cache.pattern(1).unwrap();
    let s = cache.attention_map(1, Hook::AttnScores).unwrap();
    for h in 0..4 {
        for i in 0..n {
            let row = p.row(h, i);
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
            for j in i + 1..n {
                assert_eq!(row[j], 0.0);
                assert_eq!(s.row(h, i)[j], f32::NEG_INFINITY);
            }
        }
    }
    // resid_post of layer 0 is resid_pre of layer 1
    assert_eq!(
        cache.get(0, Hook::ResidPost).unwrap().data,
        cache.get(1, Hook::ResidPre).unwrap().data
    );
    // filters: heads 1,3, last query only
    let spec = CaptureSpec {
        hooks: vec![Hook::Pattern, Hook::Q],
        layers: Some(vec![0]),
        heads: Some(vec![1, 3]),
        queries: Queries::Last,
    };
    let mut small = AttnCache::new(&spec, n);
    model
        .forward(&TOKENS, &RunOptions::default(), &mut small)
        .unwrap();
    assert_eq!(small.get(0, Hook::Pattern).unwrap().shape, vec![2, 1, n]);
    assert_eq!(small.get(0, Hook::Q).unwrap().shape, vec![1, 2, 8]);
    assert!(small.get(1, Hook::Pattern).is_none());
    assert_eq!(
        small.pattern(0).unwrap().row(1, 0),
        cache.pattern(0).unwrap().row(3, n - 1)
    );
}

/// Fast precision on a Q8_0 file stays close to exact, on the fast kernel this process runs (the
/// other fast kernels of this CPU: `fast_kernels_of_this_cpu_in_child_processes`). Without one,
/// fast must give exact's bits, and the fast kernel is reported as not tested.
#[test]
fn fast_precision_is_close_to_exact() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_model(Arch::Qwen2, 3);
    let path = dir.path().join("q8.gguf");
    write_gguf(&m, Arch::Qwen2, GgmlDType::Q8_0, &path).unwrap();
    let exact = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
    let fast = Model::load(path.to_str().unwrap(), Precision::Fast, false).unwrap();
    let (a, _) = patterns(&exact, &TOKENS, 64 << 20);
    let (b, _) = patterns(&fast, &TOKENS, 64 << 20);
    // a tiny random net amplifies the 8-bit activation rounding; the mean stays small
    let mean = b[1]
        .iter()
        .zip(&a[1])
        .map(|(x, y)| (x - y).abs())
        .sum::<f32>()
        / a[1].len() as f32;
    assert!(mean < 0.02, "fast vs exact: mean |diff| {mean}");
    match attnscope::model::weights::fast_kernel() {
        Some(kernel) => {
            eprintln!("fast precision on {kernel}: mean |fast - exact| {mean:.2e}");
            assert_ne!(
                a[1], b[1],
                "fast precision should really use the {kernel} kernel"
            )
        }
        None => {
            // fast runs exact's kernels: then it must be exact's bits
            common::untested_kernel(&format!(
                "tiny_models: --precision fast has no kernel of its own here ({}); only fast = exact is checked",
                attnscope::kernels::select::kernels().why_no_fast_kernel()
            ));
            assert_eq!(a[1], b[1], "fast = exact without a fast kernel");
        }
    }
}

/// Fast precision on every GGUF block type (a tiny model whose depths are whole super-blocks of
/// the K-quants): each file's fast run stays within [`FAST_TINY_BOUNDS`] of its exact run on every
/// layer's pattern, on the fast kernel this process runs (the other fast kernels of this CPU, the
/// AVX2 one among them: `fast_kernels_of_this_cpu_in_child_processes`), and really moves it.
/// Without a fast kernel, fast must give exact's bits, and that is reported as not tested.
#[test]
fn fast_precision_is_close_to_exact_on_every_block_type() {
    let dir = tempfile::tempdir().unwrap();
    let m = common::blockwide_model(3);
    let kernel = attnscope::model::weights::fast_kernel();
    for dtype in common::BLOCK_TYPES {
        let path = dir.path().join(format!("t-{dtype:?}.gguf"));
        write_gguf(&m, Arch::Qwen2, dtype, &path).unwrap();
        let exact = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
        let fast = Model::load(path.to_str().unwrap(), Precision::Fast, false).unwrap();
        let (a, _) = patterns(&exact, &TOKENS, 64 << 20);
        let (b, _) = patterns(&fast, &TOKENS, 64 << 20);
        let Some(kernel) = kernel else {
            assert_eq!(a, b, "{dtype:?}: fast = exact without a fast kernel");
            continue;
        };
        let (mut max, mut sum, mut cells) = (0f32, 0f32, 0);
        for (l, (x, y)) in b.iter().zip(&a).enumerate() {
            assert_eq!(x.len(), y.len(), "{dtype:?} layer {l}");
            for (p, q) in x.iter().zip(y) {
                assert!(p.is_finite(), "{dtype:?} layer {l}: {p}");
                max = max.max((p - q).abs());
                sum += (p - q).abs();
                cells += 1;
            }
        }
        let mean = sum / cells as f32;
        eprintln!(
            "fast precision on {kernel}, {dtype:?}: |fast - exact| max {max:.2e}, mean {mean:.2e}"
        );
        let (bound_max, bound_mean) = FAST_TINY_BOUNDS;
        assert!(
            max < bound_max && mean < bound_mean,
            "{dtype:?} on {kernel}: |fast - exact| max {max} (bound {bound_max}), mean {mean} (bound {bound_mean})"
        );
        assert!(
            max > 0.0,
            "{dtype:?}: fast should really use the {kernel} kernel"
        );
    }
    if kernel.is_none() {
        common::untested_kernel(&format!(
            "tiny_models: --precision fast has no kernel of its own here ({}); only fast = exact is checked on every block type",
            attnscope::kernels::select::kernels().why_no_fast_kernel()
        ));
    }
}

/// How far fast may move the block-wide tiny model's patterns from exact, (max, mean) over every
/// cell of both layers. A tiny random net amplifies the 8-bit rounding more than the real models
/// do (their bound is 0.04 on the last rows: `real_models.rs`): measured here, the 8-bit blocks
/// (VNNI and AVX2 alike, the same bits) moved a cell by up to 0.044 (Q5_1), 0.024-0.039 on the
/// other types, by 1.1e-3 to 1.6e-3 on average; bf16 tiles up to 0.012, 3e-4 to 5e-4 on average.
const FAST_TINY_BOUNDS: (f32, f32) = (0.08, 5e-3);

fn tiny_loaded(arch: Arch, seed: u64) -> (tempfile::TempDir, Model) {
    tiny_loaded_as(arch, seed, Precision::Exact)
}

/// As [`tiny_loaded`], at `precision`.
fn tiny_loaded_as(arch: Arch, seed: u64, precision: Precision) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    write_gguf(&tiny_model(arch, seed), arch, GgmlDType::F32, &path).unwrap();
    let model = Model::load(path.to_str().unwrap(), precision, false).unwrap();
    (dir, model)
}

/// The full run of TOKENS: its last position's logits and every layer's keys and values.
fn full_run(model: &Model) -> (Vec<f32>, attnscope::model::forward::KvPrefix) {
    let full = model
        .forward(
            &TOKENS,
            &RunOptions {
                logits_at: vec![TOKENS.len() - 1],
                keep_kv: true,
                ..Default::default()
            },
            &mut attnscope::model::capture::NoCapture,
        )
        .unwrap();
    (full.logits[0].clone(), full.kv.unwrap())
}

/// The last layer's attention output and MLP run on the logits rows alone unless a hook wants
/// them: the same logits, bit for bit, as the whole tail (forced here by capturing the last
/// layer's residual stream), for rows asked out of order and twice, exact and fast.
#[test]
fn the_last_layer_on_the_logits_rows_alone_equals_the_whole_tail() {
    use attnscope::model::capture::{CaptureSpec, Queries};
    for (arch, precision) in EXACT_BOTH_FAST_QWEN2 {
        let (_dir, model) = tiny_loaded_as(arch, 17, precision);
        let last = model.dims.n_layers - 1;
        let opts = RunOptions {
            logits_at: vec![TOKENS.len() - 1, 2, 6, 2],
            ..Default::default()
        };
        let alone = model
            .forward(&TOKENS, &opts, &mut attnscope::model::capture::NoCapture)
            .unwrap();
        let spec = CaptureSpec {
            hooks: vec![Hook::ResidPost],
            layers: Some(vec![last]),
            heads: None,
            queries: Queries::All,
        };
        let mut cache = AttnCache::new(&spec, TOKENS.len());
        let whole = model.forward(&TOKENS, &opts, &mut cache).unwrap();
        let resid = cache
            .get(last, Hook::ResidPost)
            .expect("the tail ran whole");
        assert_eq!(resid.data.len(), TOKENS.len() * model.dims.d_model);
        assert_eq!(alone.logits.len(), 4);
        assert_eq!(alone.logits, whole.logits, "{arch:?} {precision:?}");
        assert_eq!(alone.logits[1], alone.logits[3]);
    }
}

/// Running the rest of a sequence on a reused KV prefix equals running it whole.
#[test]
fn prefix_reuse_equals_a_full_run() {
    let (_d, model) = tiny_loaded(Arch::Llama, 5);
    let n = TOKENS.len();
    let (full_logits, kv) = full_run(&model);
    for p in [1, 4, n - 1] {
        let prefix = kv.truncate(p).unwrap();
        let out = model
            .forward_from(
                Some(&prefix),
                &TOKENS[p..],
                &RunOptions::last_logits(n),
                &mut attnscope::model::capture::NoCapture,
            )
            .unwrap();
        assert_close(
            &out.logits[0],
            &full_logits,
            1e-4,
            &format!("logits with a prefix of {p}"),
        );
    }
}

/// A batch of variants (other tokens, knockouts, each on its own share of the prefix) gives each
/// variant's logits bit for bit as its own run does: the kernels compute every row alone.
#[test]
fn a_batch_of_variants_equals_their_own_runs() {
    use attnscope::model::forward::Segment;
    for (arch, precision) in EXACT_BOTH_FAST_QWEN2 {
        let (_dir, model) = tiny_loaded_as(arch, 13, precision);
        if precision == Precision::Fast {
            eprintln!(
                "batch test, fast kernel: {}",
                attnscope::model::weights::fast_kernel().unwrap_or("the exact kernels")
            );
        }
        let n = TOKENS.len();
        let (_, kv) = full_run(&model);
        let deleted: Vec<u32> = TOKENS
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != 3)
            .map(|(_, &t)| t)
            .collect();
        let mut replaced = TOKENS.to_vec();
        replaced[5] = 200;
        // (variant, positions reused, knockout, logits rows)
        let cases: Vec<(Vec<u32>, usize, Vec<usize>, Vec<usize>)> = vec![
            (deleted.clone(), 3, vec![], vec![n - 2]),
            (replaced.clone(), 5, vec![], vec![n - 1, 6]),
            (TOKENS.to_vec(), 2, vec![2], vec![n - 1]),
            (TOKENS.to_vec(), 0, vec![4, 6], vec![n - 1]),
            (TOKENS.to_vec(), n - 1, vec![], vec![n - 1]),
        ];
        let segs: Vec<Segment> = cases
            .iter()
            .map(|(v, c, k, at)| Segment {
                tokens: &v[*c..],
                reuse: *c,
                knockout: k.clone(),
                logits_at: at.clone(),
            })
            .collect();
        let batch = model.forward_batch(Some(&kv), &segs).unwrap();
        assert_eq!(batch.len(), cases.len());
        for (i, (v, c, k, at)) in cases.iter().enumerate() {
            let alone = model
                .forward_from(
                    Some(&kv.truncate(*c).unwrap()),
                    &v[*c..],
                    &RunOptions {
                        logits_at: at.clone(),
                        knockout: k.clone(),
                        ..Default::default()
                    },
                    &mut attnscope::model::capture::NoCapture,
                )
                .unwrap();
            assert_eq!(batch[i].len(), at.len());
            if precision == Precision::Exact || !attnscope::model::weights::fast_uses_int8() {
                assert_eq!(batch[i], alone.logits, "{arch:?} {precision:?} variant {i}");
            } else {
                // the 8-bit VNNI kernel's edge tiles scale their block sums in another order
                // than its full tiles (a multiply and an add against one fused step; ~1e-6 here),
                // so a row's last bits depend on where it falls; left so, because aligning them
                // flipped a near-tie in SmolLM2's `fast` top-3 table against the reference
                for (b, a) in batch[i].iter().zip(&alone.logits) {
                    assert_close(b, a, 1e-4, &format!("{arch:?} 8-bit variant {i}"));
                }
            }
        }
        // and an unchanged variant on the whole prefix's first row is the full run
        assert_ne!(
            batch[0], batch[1],
            "{arch:?}: distinct variants, distinct logits"
        );
        // a segment cannot reuse more than the prefix holds, nor name a position outside itself
        a_segment_outside_its_prefix_is_refused(&model, &kv);
    }
}

/// A segment cannot reuse more than the prefix (`kv`, of [`TOKENS`]) holds, nor name a position
/// outside itself.
fn a_segment_outside_its_prefix_is_refused(
    model: &Model,
    kv: &attnscope::model::forward::KvPrefix,
) {
    use attnscope::model::forward::Segment;
    let n = TOKENS.len();
    let bad = Segment {
        tokens: &TOKENS[1..],
        reuse: n + 1,
        knockout: vec![],
        logits_at: vec![n - 1],
    };
    assert!(model.forward_batch(Some(kv), &[bad]).is_err());
    let outside = Segment {
        tokens: &TOKENS[4..],
        reuse: 4,
        knockout: vec![2],
        logits_at: vec![n - 1],
    };
    assert!(model.forward_batch(Some(kv), &[outside]).is_err());
}

/// The fast-precision tests again in child processes on every other fast kernel this CPU has
/// (the 8-bit VNNI blocks with the AMX tiles off, `ATTNSCOPE_AMX=0`; the 8-bit AVX2 blocks,
/// `ATTNSCOPE_ISA=avx2`): each must say it ran it.
#[test]
fn fast_kernels_of_this_cpu_in_child_processes() {
    let others = common::other_fast_kernels();
    if others.is_empty() {
        eprintln!(
            "NOTE: the fast tests ran the only fast kernel of this process: {}",
            attnscope::model::weights::fast_kernel().unwrap_or("none")
        );
    }
    for (kernel, var, value) in others {
        for (test, says) in [
            ("a_batch_of_variants_equals_their_own_runs", "fast kernel: "),
            ("fast_precision_is_close_to_exact", "fast precision on "),
            (
                "fast_precision_is_close_to_exact_on_every_block_type",
                "fast precision on ",
            ),
        ] {
            let text = common::rerun_with_env(test, var, value);
            assert!(
                text.contains(&format!("{says}{kernel}")),
                "{test} with {var}={value} did not run {kernel}:\n{text}"
            );
        }
    }
}

/// `ATTNSCOPE_ISA` and `ATTNSCOPE_AMX` force each kernel this CPU runs, and `info` names it;
/// a value the CPU cannot run, or one that names nothing, exits 2 naming the variable (never an
/// illegal instruction, never another kernel in silence). The choices themselves, on made-up
/// CPUs: `kernels::select`'s unit tests.
#[test]
fn forced_kernels_are_named_by_info_and_impossible_ones_refused() {
    use attnscope::kernels::select::Hardware;
    let dir = tempfile::tempdir().unwrap();
    let m = common::tiny_gguf(&dir);
    let hw = Hardware::detect();
    let info = |env: &[(&str, &str)]| {
        let mut c = common::attnscope();
        c.args(["info", "--json", "-m", m.to_str().unwrap()]);
        c.env_remove("ATTNSCOPE_ISA").env_remove("ATTNSCOPE_AMX");
        for (k, v) in env {
            c.env(k, v);
        }
        c
    };
    let mut cases = vec![(
        vec![("ATTNSCOPE_ISA", "scalar")],
        "f32-scalar",
        "f32-scalar",
    )];
    if hw.amx {
        cases.push((vec![], "amx-scaled", "amx-bf16"));
        cases.push((vec![("ATTNSCOPE_AMX", "exact")], "amx-bf16x3", "amx-bf16"));
    }
    if hw.vnni {
        cases.push((vec![("ATTNSCOPE_ISA", "avx512")], "f32-avx512", "vnni-int8"));
    }
    if attnscope::kernels::gemm::Isa::Avx2.supported() {
        cases.push((vec![("ATTNSCOPE_ISA", "avx2")], "f32-avx2+fma", "avx2-int8"));
    }
    for (env, exact, fast) in cases {
        let out = common::succeeds(&mut info(&env));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            (
                v["kernels"]["exact"].as_str(),
                v["kernels"]["fast"].as_str()
            ),
            (Some(exact), Some(fast)),
            "{env:?}"
        );
    }
    let impossible = if hw.amx {
        ("ATTNSCOPE_ISA", "avx2")
    } else {
        ("ATTNSCOPE_ISA", "amx")
    };
    for (env, want) in [
        (
            vec![("ATTNSCOPE_ISA", "avx-512")],
            "ATTNSCOPE_ISA=avx-512 names no kernel",
        ),
        (
            vec![impossible, ("ATTNSCOPE_AMX", "exact")],
            "asks for the AMX tiles",
        ),
    ] {
        let e = common::fails_with(&mut info(&env), 2);
        assert!(e.contains(want), "{env:?}: {e}");
    }
}

/// `ATTNSCOPE_DECODE` takes `blocks` or `panels`; any other value exits 2 naming it and both
/// accepted values (it once meant `panels` in silence), before any command starts.
#[test]
fn an_unknown_decode_value_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let m = common::tiny_gguf(&dir);
    let info = |value: &str| {
        let mut c = common::attnscope();
        c.args(["info", "-m", m.to_str().unwrap()])
            .env("ATTNSCOPE_DECODE", value);
        c
    };
    for good in ["blocks", "panels"] {
        common::succeeds(&mut info(good));
    }
    for bad in ["block", "BLOCKS", ""] {
        let e = common::fails_with(&mut info(bad), 2);
        assert!(
            e.contains(&format!("ATTNSCOPE_DECODE={bad} names no way to decode"))
                && e.contains("use blocks")
                && e.contains("or panels"),
            "{bad:?}: {e}"
        );
        assert!(!e.contains("panicked"), "{bad:?}: {e}");
    }
}

/// Attention knockout by hand: hide every key but the first from all other queries; each query
/// then splits its attention between key 0 and itself, softmax of two scores computed here from
/// the captured (rotated) q and k.
#[test]
fn knockout_of_every_key_but_one_is_hand_computable() {
    let (_d, model) = tiny_loaded(Arch::Qwen2, 9);
    let n = TOKENS.len();
    let spec = CaptureSpec {
        hooks: vec![Hook::Pattern, Hook::RotQ, Hook::RotK],
        layers: Some(vec![1]),
        heads: None,
        queries: Queries::All,
    };
    let mut cache = AttnCache::new(&spec, n);
    let opts = RunOptions {
        knockout: (1..n).collect(),
        ..Default::default()
    };
    model.forward(&TOKENS, &opts, &mut cache).unwrap();
    let (q, k) = (
        &cache.get(1, Hook::RotQ).unwrap().data,
        &cache.get(1, Hook::RotK).unwrap().data,
    );
    let p = cache.pattern(1).unwrap();
    let (nh, nkv, d) = (4, 2, 8);
    for h in 0..nh {
        let g = h / (nh / nkv);
        for i in 1..n {
            let qi = &q[(i * nh + h) * d..][..d];
            let score = |j: usize| {
                attnscope::reference::dot(qi, &k[(j * nkv + g) * d..][..d]) / (d as f32).sqrt()
            };
            let (s0, si) = (score(0), score(i));
            let w0 = 1.0 / (1.0 + (si - s0).exp());
            let row = p.row(h, i);
            assert!(
                (row[0] - w0).abs() < 1e-5,
                "head {h} query {i}: {} vs {w0}",
                row[0]
            );
            assert!((row[i] - (1.0 - w0)).abs() < 1e-5);
            assert!(
                row.iter()
                    .enumerate()
                    .all(|(j, &w)| j == 0 || j == i || w == 0.0),
                "only keys 0 and {i} are visible"
            );
        }
        assert_eq!(p.row(h, 0)[0], 1.0);
    }
}

/// Keeps every streamed statistic, by (layer, head, query).
struct Recorder(
    std::collections::BTreeMap<(usize, usize, usize), (f32, f32, u32, f32, Vec<(u32, f32)>)>,
);

impl attnscope::model::capture::Observer for Recorder {
    fn wants(&self, _: usize, _: Hook) -> bool {
        false
    }
    fn tensor(&mut self, _: usize, _: Hook, _: &[usize], _: &[f32]) {}
    fn attention_block(&mut self, _: usize, _: Hook, _: usize, _: [usize; 3], _: &[f32]) {}
    fn wants_stats(&self, _: usize) -> Option<attnscope::model::attention::StatsRequest> {
        Some(attnscope::model::attention::StatsRequest {
            top_k: 3,
            top_k_from: 0,
        })
    }
    fn attention_stats(
        &mut self,
        layer: usize,
        q0: usize,
        s: &attnscope::model::attention::AttnStats,
    ) {
        for h in 0..s.n_heads {
            for r in 0..s.rows {
                let x = h * s.rows + r;
                self.0.insert(
                    (layer, h, q0 + r),
                    (
                        s.first_key[x],
                        s.max_weight[x],
                        s.argmax[x],
                        s.entropy[x],
                        s.top[x * 3..x * 3 + 3].to_vec(),
                    ),
                );
            }
        }
    }
}

/// The streaming path (online softmax over key blocks of 2 or 3 keys, query blocks of a few
/// rows) gives exactly the numbers of the materialized patterns: logits, first-key weight, max
/// weight and argmax, entropy, top-k.
#[test]
fn streaming_statistics_equal_the_materialized_path() {
    let (_d, model) = tiny_loaded(Arch::Llama, 11);
    let tokens: Vec<u32> = (0..23).map(|i| (i * 37 % 250) as u32).collect();
    let n = tokens.len();
    let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
    let full = model
        .forward(&tokens, &RunOptions::last_logits(n), &mut cache)
        .unwrap();
    for (key_block, block_bytes) in [(2usize, 4 * 4 * 23 * 5), (3, 64 << 20), (1024, 4 * 4 * 7)] {
        let mut rec = Recorder(Default::default());
        let opts = RunOptions {
            logits_at: vec![n - 1],
            key_block,
            block_bytes,
            knockout: vec![],
            ..Default::default()
        };
        let out = model.forward(&tokens, &opts, &mut rec).unwrap();
        assert_close(
            &out.logits[0],
            &full.logits[0],
            1e-4,
            &format!("logits, key block {key_block}"),
        );
        for l in 0..2 {
            let p = cache.pattern(l).unwrap();
            for h in 0..4 {
                for q in 0..n {
                    let row = &p.row(h, q)[..=q];
                    let (f, mx, am, ent, top) = &rec.0[&(l, h, q)];
                    let label = format!("key block {key_block}, layer {l} head {h} query {q}");
                    assert!(
                        (f - row[0]).abs() < 1e-5,
                        "{label}: first key {f} vs {}",
                        row[0]
                    );
                    let (wmax, amax) = attnscope::analysis::vocab::max_argmax(row);
                    assert!((mx - wmax).abs() < 1e-5, "{label}: max");
                    assert_eq!(*am as usize, amax, "{label}: argmax");
                    assert!(
                        (ent - attnscope::analysis::vocab::entropy(row)).abs() < 1e-4,
                        "{label}: entropy {ent}"
                    );
                    let want = attnscope::analysis::vocab::top_k(row, 3);
                    // rows with fewer than 3 visible keys are padded with (u32::MAX, 0)
                    assert_eq!(top.len(), 3, "{label}: top-k length");
                    assert_eq!(want.len(), 3.min(q + 1), "{label}: reference top-k length");
                    assert!(
                        top[want.len()..]
                            .iter()
                            .all(|&(j, w)| j == u32::MAX && w == 0.0),
                        "{label}: padding"
                    );
                    for (t, w) in top.iter().zip(&want) {
                        assert_eq!(t.0 as usize, w.pos, "{label}: top-k position");
                        assert!((t.1 - w.weight).abs() < 1e-5, "{label}: top-k weight");
                    }
                }
            }
        }
    }
}

/// `inspect`'s observer asks for no pattern: the forward streams and recomputes the one query's
/// rows from the final softmax shift and sum. Its rows, sink shares, max weights and entropies
/// equal the same observer fed every materialized pattern, over key blocks of 2, 3 and 1,024
/// keys, with and without knockout, for the first, a middle and the last query.
#[test]
fn collector_from_streamed_rows_equals_collector_from_patterns() {
    use attnscope::analysis::collect::Collector;
    use attnscope::model::capture::Observer;
    let (_d, model) = tiny_loaded(Arch::Qwen2, 13);
    let tokens: Vec<u32> = (0..23).map(|i| (i * 41 % 250) as u32).collect();
    let n = tokens.len();
    for knockout in [vec![], vec![3, 9]] {
        let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
        model
            .forward(
                &tokens,
                &RunOptions {
                    logits_at: vec![n - 1],
                    knockout: knockout.clone(),
                    ..Default::default()
                },
                &mut cache,
            )
            .unwrap();
        for query in [0, 11, n - 1] {
            let mut want = Collector::new(2, 4, n, query);
            for l in 0..2 {
                want.attention_block(
                    l,
                    Hook::Pattern,
                    0,
                    [4, n, n],
                    cache.pattern(l).unwrap().data,
                );
            }
            for (key_block, block_bytes) in
                [(2usize, 4 * 4 * 23 * 5), (3, 64 << 20), (1024, 4 * 4 * 7)]
            {
                let mut got = Collector::new(2, 4, n, query);
                let opts = RunOptions {
                    logits_at: vec![n - 1],
                    key_block,
                    block_bytes,
                    knockout: knockout.clone(),
                    ..Default::default()
                };
                model.forward(&tokens, &opts, &mut got).unwrap();
                let label = format!("query {query}, key block {key_block}, knockout {knockout:?}");
                assert_same_collection(&got, &want, n, &label);
            }
        }
    }
}

/// `got` (streamed) collected what `want` (from the patterns) did over `n` keys, for each of the
/// 2 layers: the query rows, sink shares, max weights, entropies and α₁.
fn assert_same_collection(
    got: &attnscope::analysis::collect::Collector,
    want: &attnscope::analysis::collect::Collector,
    n: usize,
    label: &str,
) {
    for l in 0..2 {
        assert_eq!(
            got.query_rows[l].len(),
            4 * n,
            "{label}: rows of layer {l} were handed out"
        );
        assert_close(
            &got.query_rows[l],
            &want.query_rows[l],
            1e-5,
            &format!("{label}: rows of layer {l}"),
        );
        assert!(
            (got.sink_all_queries(l) - want.sink_all_queries(l)).abs() < 1e-5,
            "{label}: sink share"
        );
        assert_close(
            &got.mean_max_weight(l),
            &want.mean_max_weight(l),
            1e-5,
            &format!("{label}: max weight"),
        );
        assert_close(
            &got.mean_entropy(l),
            &want.mean_entropy(l),
            1e-4,
            &format!("{label}: entropy"),
        );
        assert_close(
            &got.head_sink(l),
            &want.head_sink(l),
            1e-5,
            &format!("{label}: α₁"),
        );
    }
}

/// `attnscope heads --json` (streamed, block by block) against the head-detector formulas written
/// out here on the materialized patterns of the same text: score = Σ(A ⊙ P) / Σ A.
#[test]
fn head_role_scores_equal_the_formulas_on_materialized_patterns() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tiny.gguf");
    write_gguf(&tiny_model(Arch::Llama, 5), Arch::Llama, GgmlDType::F32, &p).unwrap();
    let text = "the hat at the hat sat at the the hat he sat";
    let v = run_json([
        "heads",
        "--model",
        p.to_str().unwrap(),
        "--text",
        text,
        "--json",
    ]);
    let model = Model::load(p.to_str().unwrap(), Precision::Exact, false).unwrap();
    let t = model.encode(text, false).unwrap();
    let n = t.len();
    assert_eq!(v["tokens"].as_array().unwrap().len(), n);
    assert_every_role_is_its_formula(&model, &t, &v);
    // the text repeats tokens, so the duplicate and induction patterns are not empty
    assert!(
        v["uniform"]["duplicate_token"].as_f64().unwrap() > 0.0
            && v["uniform"]["induction"].as_f64().unwrap() > 0.0
    );
    each_line_is_the_mean_of_the_lines(&p, dir.path());
    random_repeat_copies_its_first_half(&p);
}

/// Each role's score of each (layer, head) in `heads --json` (`v`) is Σ(A ⊙ P) / Σ A of the
/// pattern the model materializes over `t`.
fn assert_every_role_is_its_formula(model: &Model, t: &[u32], v: &serde_json::Value) {
    let n = t.len();
    let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
    model
        .forward(t, &RunOptions::default(), &mut cache)
        .unwrap();
    let roles: [(&str, Box<dyn Fn(usize, usize) -> bool>); 5] = [
        ("previous_token", Box::new(|i, j| i >= 1 && j == i - 1)),
        ("duplicate_token", Box::new(|i, j| j < i && t[i] == t[j])),
        (
            "induction",
            Box::new(|i, j| j >= 1 && j <= i && t[j - 1] == t[i]),
        ),
        ("sink", Box::new(|_, j| j == 0)),
        ("local", Box::new(|i, j| j <= i && j + 3 >= i)),
    ];
    let mut checked = 0;
    for l in 0..model.dims.n_layers {
        let pat = cache.pattern(l).unwrap();
        for h in 0..model.dims.n_heads {
            for (role, p) in &roles {
                let (mut hit, mut mass) = (0f64, 0f64);
                for i in 0..n {
                    let row = pat.row_at(h, i).unwrap();
                    for j in 0..n {
                        mass += row[j] as f64;
                        if p(i, j) {
                            hit += row[j] as f64;
                        }
                    }
                }
                let got = v["roles"][role][l][h].as_f64().unwrap();
                assert!(
                    (got - hit / mass).abs() < 1e-6,
                    "{role} layer {l} head {h}: {got} vs {}",
                    hit / mass
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 5 * model.dims.n_layers * model.dims.n_heads);
}

/// `heads --each-line` on the model `p`: the mean over the lines (written in `dir`), each
/// computed alone.
fn each_line_is_the_mean_of_the_lines(p: &std::path::Path, dir: &std::path::Path) {
    let f = dir.join("lines.txt");
    std::fs::write(&f, "the hat at the hat\n\nsat at the the hat\n").unwrap();
    let each = run_json([
        "heads",
        "--model",
        p.to_str().unwrap(),
        "--file",
        f.to_str().unwrap(),
        "--each-line",
        "--json",
    ]);
    let one = |s: &str| {
        run_json([
            "heads",
            "--model",
            p.to_str().unwrap(),
            "--text",
            s,
            "--json",
        ])
    };
    let (a, b) = (one("the hat at the hat"), one("sat at the the hat"));
    assert_eq!(each["texts"], 2);
    let (x, y, m) = (
        a["roles"]["induction"][1][2].as_f64().unwrap(),
        b["roles"]["induction"][1][2].as_f64().unwrap(),
        each["roles"]["induction"][1][2].as_f64().unwrap(),
    );
    assert!((m - (x + y) / 2.0).abs() < 1e-12);
}

/// `heads --random-repeat` on the model `p`: 2N tokens, the second half a copy of the first.
fn random_repeat_copies_its_first_half(p: &std::path::Path) {
    let rr = run_json([
        "heads",
        "--model",
        p.to_str().unwrap(),
        "--random-repeat",
        "7",
        "--seed",
        "3",
        "--json",
    ]);
    let toks: Vec<u64> = rr["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(toks.len(), 14);
    assert_eq!(toks[..7], toks[7..]);
}

/// Norm-based attention on a tiny model. Layer 0 gets `W_O = s·I` (d_model = heads·head_dim), so
/// by hand `α·‖fₕ(xⱼ)‖ = α·s·‖vⱼ‖` and the whole layer's `‖Σₕ αʰ fₕ(xⱼ)‖ = s·√(Σₕ (αʰ‖vⱼ‖)²)`
/// (each head writes its own block); layer 1 keeps a random `W_O` and is checked against f64
/// products with the reference weights. Values and weights are the engine's captures.
#[test]
fn norm_based_attention_is_hand_computable() {
    use attnscope::analysis::norms::{mixed_norms, shares, value_norms, Values};
    let mut m = tiny_model(Arch::Qwen2, 9);
    let (dm, hd, nh, nkv) = (
        m.cfg.d_model,
        m.cfg.head_dim,
        m.cfg.n_heads,
        m.cfg.n_kv_heads,
    );
    assert_eq!(dm, nh * hd);
    let s = 1.5f32;
    m.layers[0].w_o = (0..dm * dm)
        .map(|i| if i / dm == i % dm { s } else { 0.0 })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    write_gguf(&m, Arch::Qwen2, GgmlDType::F32, &path).unwrap();
    let model = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
    let n = TOKENS.len();
    let spec = CaptureSpec {
        hooks: vec![Hook::Pattern, Hook::V],
        ..CaptureSpec::patterns()
    };
    let mut cache = AttnCache::new(&spec, n);
    model
        .forward(&TOKENS, &RunOptions::last_logits(n), &mut cache)
        .unwrap();
    let heads: Vec<usize> = (0..nh).collect();
    for l in 0..2 {
        let v = cache.get(l, Hook::V).unwrap();
        let vals = Values::pos_major(&v.data, n, nkv, hd);
        let p = cache.pattern(l).unwrap();
        let q = n - 1;
        let alphas: Vec<&[f32]> = heads.iter().map(|&h| p.row(h, q)).collect();
        let vn = value_norms(&model, l, &vals, &heads, n);
        one_heads_columns_are_the_padded_product(&model, l, &vals);
        gram_route_gives_the_same_norms(&model, l, &vals, &vn);
        let mixed = mixed_norms(&model, l, &vals, &alphas, n);
        let layer = HandLayer {
            m: &m,
            l,
            s,
            vals: &vals,
            alphas: &alphas,
            vn: &vn,
        };
        for j in 0..n {
            layer.check_key_against_f64_products(j, mixed[j]);
        }
        let sh = shares(&mixed);
        assert!((sh.iter().sum::<f32>() - 1.0).abs() < 1e-5);
    }
}

/// One head through its own columns of W_O: the bits of the whole product with zeros.
fn one_heads_columns_are_the_padded_product(
    model: &Model,
    l: usize,
    vals: &attnscope::analysis::norms::Values,
) {
    for h in 0..model.dims.n_heads {
        let (own, whole) =
            common::one_head_and_padded_output_projection(model, l, h, vals, TOKENS.len());
        common::assert_head_columns_are_the_padded_product(
            own,
            &whole,
            &format!("layer {l} head {h}"),
        );
    }
}

/// The Gram-matrix route of the long view gives the same norms as `value_norms`' (`vn`).
fn gram_route_gives_the_same_norms(
    model: &Model,
    l: usize,
    vals: &attnscope::analysis::norms::Values,
    vn: &[Vec<f32>],
) {
    let all = attnscope::analysis::norms::all_value_norms(model, l, vals);
    let n = TOKENS.len();
    for h in 0..model.dims.n_heads {
        for j in 0..n {
            assert!((all[h * n + j] - vn[h][j]).abs() < 1e-5 * vn[h][j].max(1.0));
        }
    }
}

/// One layer of the hand-computable norm test: the reference's weights `m`, the scale `s` of
/// layer 0's `W_O = s·I`, the engine's captured values, the last query's weights and its
/// per-head norms `‖fₕ(vⱼ)‖`.
struct HandLayer<'a> {
    m: &'a attnscope::reference::transformer::RefModel,
    l: usize,
    s: f32,
    vals: &'a attnscope::analysis::norms::Values<'a>,
    alphas: &'a [&'a [f32]],
    vn: &'a [Vec<f32>],
}

impl HandLayer<'_> {
    /// Head `h`'s value at key `j`.
    fn value(&self, h: usize, j: usize) -> &[f32] {
        let c = &self.m.cfg;
        self.vals.get(j, h / (c.n_heads / c.n_kv_heads))
    }

    /// f_h(v_j) = W_O[:, h·hd..(h+1)·hd] · v_j, from the reference's weights, in f64.
    fn head_write(&self, h: usize, vj: &[f64]) -> Vec<f64> {
        let (dm, hd) = (self.m.cfg.d_model, self.m.cfg.head_dim);
        (0..dm)
            .map(|r| {
                (0..hd)
                    .map(|c| self.m.layers[self.l].w_o[r * dm + h * hd + c] as f64 * vj[c])
                    .sum()
            })
            .collect()
    }

    /// Key `j`: each head's `‖fₕ(vⱼ)‖` in f64 (on layer 0, `s·‖vⱼ‖` by hand) against the
    /// engine's, and the whole layer's `‖Σₕ αʰ fₕ(vⱼ)‖` (on layer 0, by hand) against `mixed`,
    /// the engine's.
    fn check_key_against_f64_products(&self, j: usize, mixed: f32) {
        let l = self.l;
        let mut total = vec![0f64; self.m.cfg.d_model];
        for h in 0..self.m.cfg.n_heads {
            let vj: Vec<f64> = self.value(h, j).iter().map(|&x| x as f64).collect();
            let f = self.head_write(h, &vj);
            let norm = f.iter().map(|x| x * x).sum::<f64>().sqrt();
            if l == 0 {
                let by_hand = self.s as f64 * vj.iter().map(|x| x * x).sum::<f64>().sqrt();
                assert!((norm - by_hand).abs() < 1e-9 * by_hand.max(1.0));
            }
            assert!(
                (self.vn[h][j] as f64 - norm).abs() < 1e-5 * norm.max(1.0),
                "layer {l} head {h} key {j}: ‖f(x)‖ {} vs {norm}",
                self.vn[h][j]
            );
            f.iter()
                .zip(total.iter_mut())
                .for_each(|(x, t)| *t += self.alphas[h][j] as f64 * x);
        }
        let want = total.iter().map(|x| x * x).sum::<f64>().sqrt();
        if l == 0 {
            let by_hand = self.whole_layer_by_hand(j);
            assert!((want - by_hand).abs() < 1e-9 * by_hand.max(1.0));
        }
        assert!(
            (mixed as f64 - want).abs() < 1e-5 * want.max(1.0),
            "layer {l} key {j}: whole-layer norm {} vs {want}",
            mixed
        );
    }

    /// Layer 0's whole-layer norm at key `j` by hand: `s·√(Σₕ (αʰ‖vⱼ‖)²)`.
    fn whole_layer_by_hand(&self, j: usize) -> f64 {
        (0..self.m.cfg.n_heads)
            .map(|h| {
                let a = self.alphas[h][j] as f64 * self.s as f64;
                a * a
                    * self
                        .value(h, j)
                        .iter()
                        .map(|&x| (x as f64).powi(2))
                        .sum::<f64>()
            })
            .sum::<f64>()
            .sqrt()
    }
}

/// Takes attention maps only as blocks handed over (the forward's copy path).
struct BlocksOnly(AttnCache);

impl attnscope::model::capture::Observer for BlocksOnly {
    fn wants(&self, l: usize, h: Hook) -> bool {
        self.0.wants(l, h)
    }
    fn tensor(&mut self, l: usize, h: Hook, shape: &[usize], data: &[f32]) {
        self.0.tensor(l, h, shape, data)
    }
    fn attention_block(&mut self, l: usize, h: Hook, q0: usize, shape: [usize; 3], data: &[f32]) {
        self.0.attention_block(l, h, q0, shape, data)
    }
}

/// Lets the forward write patterns in place, and streams each layer out as `capture` does:
/// its maps taken, kept here, and their buffers recycled for the next layer.
struct InPlaceStreamed(AttnCache, Vec<(usize, Hook, Vec<f32>)>, usize);

impl attnscope::model::capture::Observer for InPlaceStreamed {
    fn wants(&self, l: usize, h: Hook) -> bool {
        self.0.wants(l, h)
    }
    fn tensor(&mut self, l: usize, h: Hook, shape: &[usize], data: &[f32]) {
        self.0.tensor(l, h, shape, data)
    }
    fn attention_block(&mut self, l: usize, h: Hook, q0: usize, shape: [usize; 3], data: &[f32]) {
        self.0.attention_block(l, h, q0, shape, data)
    }
    fn pattern_rows(
        &mut self,
        l: usize,
        q0: usize,
        rows: usize,
        heads: usize,
        k_len: usize,
    ) -> Option<attnscope::model::capture::PatternRows<'_>> {
        let rows = self.0.pattern_rows(l, q0, rows, heads, k_len);
        self.2 += rows.is_some() as usize;
        rows
    }
    fn layer_done(&mut self, l: usize) {
        for h in [Hook::AttnScores, Hook::Pattern] {
            let c = self.0.take(l, h).expect("both maps captured");
            self.1.push((l, h, c.data.clone()));
            // as `capture` does: a pattern's zeros above the diagonal are then not written again
            // (and a scores map's -inf there never passes for them)
            self.0.recycle_entry(c);
        }
    }
}

/// The kernel writing each pattern row in the caller's buffer (scores, softmax and P·V in
/// place, masked keys zeroed) gives the numbers of the blocks handed over for copying, bit for
/// bit: patterns, raw scores and logits, in one query block or many, into fresh buffers and
/// into recycled ones holding an earlier layer's numbers.
#[test]
fn patterns_written_in_place_equal_patterns_handed_over_in_blocks() {
    use attnscope::model::capture::{CaptureSpec, Queries};
    for arch in [Arch::Llama, Arch::Qwen2] {
        let (_d, model) = tiny_loaded(arch, 23);
        let n = TOKENS.len();
        let spec = CaptureSpec {
            hooks: vec![Hook::Pattern, Hook::AttnScores],
            layers: None,
            heads: None,
            queries: Queries::All,
        };
        for block in [64 << 20, 4 * 9 * 4 * 2] {
            let opts = RunOptions {
                logits_at: (0..n).collect(),
                block_bytes: block,
                ..Default::default()
            };
            let mut blocks = BlocksOnly(AttnCache::new(&spec, n));
            let want = model.forward(&TOKENS, &opts, &mut blocks).unwrap();
            let mut in_place = AttnCache::new(&spec, n);
            let got = model.forward(&TOKENS, &opts, &mut in_place).unwrap();
            let mut streamed = InPlaceStreamed(AttnCache::new(&spec, n), Vec::new(), 0);
            let got_streamed = model.forward(&TOKENS, &opts, &mut streamed).unwrap();
            assert_eq!(got.logits, want.logits, "{arch:?} block {block}");
            assert_eq!(got_streamed.logits, want.logits, "{arch:?} block {block}");
            assert_eq!(streamed.1.len(), 2 * model.dims.n_layers);
            // every query block of every layer was written in place
            assert!(streamed.2 >= model.dims.n_layers, "{}", streamed.2);
            if block < 1 << 20 {
                assert!(streamed.2 > model.dims.n_layers, "several blocks per layer");
            }
            for (l, hook, data) in &streamed.1 {
                let w = &blocks.0.get(*l, *hook).unwrap().data;
                let g = &in_place.get(*l, *hook).unwrap().data;
                let same =
                    |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    same(g, w),
                    "{arch:?} block {block} layer {l} {hook:?} in place"
                );
                assert!(
                    same(data, w),
                    "{arch:?} block {block} layer {l} {hook:?} recycled"
                );
            }
        }
    }
}

/// Moves `path`'s modification time `secs` seconds ahead, as an edit would.
fn modified_later(path: &std::path::Path, secs: u64) {
    std::fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(secs))
        .unwrap();
}

/// The packed-weight cache: a second load maps the panels the first one wrote and computes the
/// same numbers bit for bit; a damaged or cut-short file, or a changed model file, is never
/// read (the panels are packed again and the file replaced); a model under the size floor gets
/// no file.
#[test]
fn the_packed_weight_cache_gives_the_same_numbers_and_is_never_read_stale_or_damaged() {
    use attnscope::model::panels::{Settings, DEFAULT_MAX_BYTES, MIN_BYTES};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    let spec = path.to_str().unwrap();
    let settings = Settings {
        dir: dir.path().join("panels"),
        min_bytes: 0,
        max_bytes: DEFAULT_MAX_BYTES,
    };
    let cache_files = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(&settings.dir)
            .map(|d| d.map(|e| e.unwrap().path()).collect())
            .unwrap_or_default()
    };
    for (arch, seed) in [(Arch::Qwen2, 3), (Arch::Llama, 4)] {
        write_gguf(&tiny_model(arch, seed), arch, GgmlDType::F32, &path).unwrap();
        let plain = Model::load_with(spec, Precision::Exact, false, None).unwrap();
        let want = bits_of_a_run(&plain);
        let all = plain.mapped_projections().1;
        assert_eq!(plain.mapped_projections(), (0, all));

        // a changed model file (new contents, a new modification time) is not read from the
        // previous arch's cache: packed again, the file replaced
        let first = Model::load_with(spec, Precision::Exact, false, Some(&settings)).unwrap();
        assert_eq!(first.mapped_projections(), (0, all), "{arch:?}: packed");
        assert_eq!(bits_of_a_run(&first), want);
        // one file per model and layout, replaced when the model changes: this one, and the
        // previous arch's fast one where fast has a layout of its own
        let files = [first.panel_file().unwrap().to_path_buf()];
        assert!(files[0].exists());
        assert!(cache_files().len() <= 2, "{arch:?}: {:?}", cache_files());
        let second = Model::load_with(spec, Precision::Exact, false, Some(&settings)).unwrap();
        assert_eq!(second.mapped_projections(), (all, all), "{arch:?}: mapped");
        assert_eq!(
            bits_of_a_run(&second),
            want,
            "{arch:?}: mapped panels, same bits"
        );
        drop(second);

        // one flipped byte in the panels, then a file cut short: packed again, file rebuilt
        damaged_panels_are_packed_again(spec, &settings, &files[0], (arch, all), &want);
        // a later modification time (the next arch rewrites the file anyway)
        modified_later(&path, 5);
        let touched = Model::load_with(spec, Precision::Exact, false, Some(&settings)).unwrap();
        assert_eq!(
            touched.mapped_projections(),
            (0, all),
            "{arch:?}: source changed"
        );
        // fast precision: bf16 AMX tiles or 8-bit VNNI blocks in a file of their own (never the
        // f32 one), and without either kernel the exact f32 panels
        fast_has_a_file_per_layout(spec, &settings, (arch, all), touched.panel_file());
    }
    // a Hugging Face folder: its safetensors files and config.json make the identity
    a_folders_files_and_config_make_its_identity(dir.path(), &settings);
    // a model that is gone loses its file the next time any file is written
    a_gone_models_file_is_removed_at_the_next_write(dir.path(), &path, &settings);
    // under the size floor: no file at all
    let small = Settings {
        dir: dir.path().join("small"),
        min_bytes: MIN_BYTES,
        max_bytes: DEFAULT_MAX_BYTES,
    };
    Model::load_with(spec, Precision::Exact, false, Some(&small)).unwrap();
    assert!(
        !small.dir.join("x").exists()
            && std::fs::read_dir(&small.dir).map_or(0, |d| d.count()) == 0
    );
}

/// Every layer's pattern and every position's logits, as bits.
fn bits_of_a_run(m: &Model) -> (Vec<Vec<u32>>, Vec<u32>) {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let (p, logits) = patterns(m, &TOKENS, 1 << 20);
    (p.iter().map(|x| bits(x)).collect::<Vec<_>>(), bits(&logits))
}

/// The cache `file` of the model `spec` (`arch`, with `all` projections) with one flipped byte,
/// then cut short: packed again (the same bits as `want`), and the file rebuilt.
fn damaged_panels_are_packed_again(
    spec: &str,
    settings: &attnscope::model::panels::Settings,
    file: &std::path::Path,
    (arch, all): (Arch, usize),
    want: &(Vec<Vec<u32>>, Vec<u32>),
) {
    let mut bytes = std::fs::read(file).unwrap();
    let at = bytes.len() - 4096 - 17;
    bytes[at] ^= 0x20;
    std::fs::write(file, &bytes).unwrap();
    let damaged = Model::load_with(spec, Precision::Exact, false, Some(settings)).unwrap();
    assert_eq!(damaged.mapped_projections(), (0, all), "{arch:?}: damaged");
    assert_eq!(bits_of_a_run(&damaged), *want);
    let mut bytes = std::fs::read(file).unwrap();
    bytes.truncate(bytes.len() - 4096);
    std::fs::write(file, &bytes).unwrap();
    let short = Model::load_with(spec, Precision::Exact, false, Some(settings)).unwrap();
    assert_eq!(short.mapped_projections(), (0, all), "{arch:?}: cut short");
    let rebuilt = Model::load_with(spec, Precision::Exact, false, Some(settings)).unwrap();
    assert_eq!(
        rebuilt.mapped_projections(),
        (all, all),
        "{arch:?}: rebuilt"
    );
    assert_eq!(bits_of_a_run(&rebuilt), *want);
}

/// Fast precision: bf16 AMX tiles or 8-bit VNNI blocks in a file of their own (never the f32
/// one, `exact_file`), and without either kernel the exact f32 panels.
fn fast_has_a_file_per_layout(
    spec: &str,
    settings: &attnscope::model::panels::Settings,
    (arch, all): (Arch, usize),
    exact_file: Option<&std::path::Path>,
) {
    use attnscope::model::weights::PanelLayout;
    let fast_plain = bits_of_a_run(&Model::load_with(spec, Precision::Fast, false, None).unwrap());
    let fast = Model::load_with(spec, Precision::Fast, false, Some(settings)).unwrap();
    let fast_again = Model::load_with(spec, Precision::Fast, false, Some(settings)).unwrap();
    assert_eq!(bits_of_a_run(&fast), fast_plain);
    assert_eq!(
        bits_of_a_run(&fast_again),
        fast_plain,
        "{arch:?}: fast, mapped"
    );
    match PanelLayout::of(Precision::Fast) {
        PanelLayout::Bf16 { .. } | PanelLayout::Int8(_) => {
            assert_eq!(fast.mapped_projections(), (0, all), "{arch:?}: fast writes");
            assert_eq!(
                fast_again.mapped_projections(),
                (all, all),
                "{arch:?}: fast"
            );
            assert_ne!(fast.panel_file(), exact_file, "a file per layout");
        }
        PanelLayout::F32(_) => {
            assert_eq!(
                fast_again.mapped_projections(),
                (all, all),
                "{arch:?}: fast"
            );
            assert_eq!(fast.panel_file(), exact_file, "the exact file");
        }
        PanelLayout::Scaled(_) => panic!("fast never runs on integers and scales"),
    }
}

/// A Hugging Face folder (in `dir`): its safetensors files and config.json make the identity.
fn a_folders_files_and_config_make_its_identity(
    dir: &std::path::Path,
    settings: &attnscope::model::panels::Settings,
) {
    let hf = dir.join("hf");
    write_hf_folder(&tiny_model(Arch::Qwen2, 3), Arch::Qwen2, &hf, 2).unwrap();
    let hf_spec = hf.to_str().unwrap();
    let want = bits_of_a_run(&Model::load_with(hf_spec, Precision::Exact, false, None).unwrap());
    let first = Model::load_with(hf_spec, Precision::Exact, false, Some(settings)).unwrap();
    let all = first.mapped_projections().1;
    assert_eq!(first.mapped_projections(), (0, all));
    let second = Model::load_with(hf_spec, Precision::Exact, false, Some(settings)).unwrap();
    assert_eq!(second.mapped_projections(), (all, all), "folder: mapped");
    assert_eq!(
        bits_of_a_run(&second),
        want,
        "folder: mapped panels, same bits"
    );
    let cfg = hf.join("config.json");
    modified_later(&cfg, 5);
    let edited = Model::load_with(hf_spec, Precision::Exact, false, Some(settings)).unwrap();
    assert_eq!(
        edited.mapped_projections(),
        (0, all),
        "folder: config changed"
    );
}

/// A model (in `dir`) that is gone loses its file the next time any file is written (here the
/// model at `path`, modified).
fn a_gone_models_file_is_removed_at_the_next_write(
    dir: &std::path::Path,
    path: &std::path::Path,
    settings: &attnscope::model::panels::Settings,
) {
    let other = dir.join("other.gguf");
    write_gguf(
        &tiny_model(Arch::Llama, 8),
        Arch::Llama,
        GgmlDType::F32,
        &other,
    )
    .unwrap();
    let gone = Model::load_with(
        other.to_str().unwrap(),
        Precision::Exact,
        false,
        Some(settings),
    )
    .unwrap()
    .panel_file()
    .unwrap()
    .to_path_buf();
    assert!(gone.exists());
    std::fs::remove_file(&other).unwrap();
    modified_later(path, 9);
    let rewritten = Model::load_with(
        path.to_str().unwrap(),
        Precision::Exact,
        false,
        Some(settings),
    )
    .unwrap();
    assert!(rewritten.panel_file().unwrap().exists());
    assert!(!gone.exists(), "the gone model's file is removed");
}

/// The packed-weight cache knows a model by its file, not by the path it was reached by (a
/// hard link and a symbolic link find the first path's file, and map it); it is capped, the
/// least recently used files going first (a mapped file counts as used), and a model larger
/// than the cap is not kept; `list` names each file's model, layout and size, and `clear`
/// removes one model's files (by any path to it) or all.
#[test]
fn the_packed_weight_cache_is_keyed_by_the_file_and_capped_least_recently_used_first() {
    let t = ModelsAndCache::new();
    let (a, b, c) = (
        t.model("a.gguf", 11),
        t.model("b.gguf", 12),
        t.model("c.gguf", 13),
    );
    let hard = t.dir.path().join("a-hard-link.gguf");
    std::fs::hard_link(&a, &hard).unwrap();
    let soft = t.dir.path().join("a-symlink.gguf");
    std::os::unix::fs::symlink(&a, &soft).unwrap();
    let (a_file, all) = links_map_the_first_paths_file(&t, &a, [&hard, &soft]);
    let size = std::fs::metadata(&a_file).unwrap().len();
    let [b_file, c_file] = the_least_recently_used_make_room(&t, [&a, &b, &c], &a_file, size, all);
    let mut want = vec![b_file.clone(), c_file.clone()];
    want.sort();
    // a model larger than the cap is not kept, and nothing is removed for it
    let tiny_cap = t.settings(size / 2);
    let not_kept = t.load(&a, &tiny_cap);
    assert_eq!(not_kept.mapped_projections(), (0, all));
    assert_eq!(not_kept.panel_file(), None);
    assert_eq!(t.files(), want);
    list_names_each_files_model_layout_and_size(&t, &b_file, size);
    // clear one model's files by another path to it, then all
    t.load(&a, &t.settings(u64::MAX));
    assert_eq!(t.files().len(), 3);
    let removed = panels::clear(&t.cache, Some(hard.to_str().unwrap())).unwrap();
    assert_eq!(removed.len(), 1);
    assert_eq!(removed[0].path, a_file);
    assert!(!a_file.exists() && b_file.exists() && c_file.exists());
    assert!(panels::clear(&t.cache, Some("no-such-model"))
        .unwrap()
        .is_empty());
    assert_eq!(
        panels::clear(&t.cache, Some("b")).unwrap().len(),
        1,
        "by its name"
    );
    assert_eq!(panels::clear(&t.cache, None).unwrap().len(), 1);
    assert!(t.files().is_empty());
}

/// Issue #56, defect 7: the packed-weight cache knew a model file by its size, modification
/// time, device and inode, so a file changed in place with its modification time set back was
/// served the old panels (a NaN written into the file: unseen by the default run, while
/// `--memory low` saw it). The file's change time (which only the kernel sets) is now part of
/// its identity: the changed file is packed afresh, and its NaN stops the forward.
#[test]
fn a_model_changed_in_place_with_its_mtime_set_back_is_not_served_old_panels() {
    let t = ModelsAndCache::new();
    let a = t.model("a.gguf", 11);
    let s = t.settings(u64::MAX);
    let first = t.load(&a, &s);
    let all = first.mapped_projections().1;
    let old_file = first.panel_file().unwrap().to_path_buf();
    assert_eq!(t.load(&a, &s).mapped_projections(), (all, all), "cached");
    // a NaN into the first weight of layer 0's q projection, in place, the mtime set back
    let offset = {
        let mut f = std::fs::File::open(&a).unwrap();
        let c = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
        c.tensor_data_offset + c.tensor_infos["blk.0.attn_q.weight"].offset
    };
    let mtime = std::fs::metadata(&a).unwrap().modified().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    {
        use std::io::{Seek, Write};
        let mut f = std::fs::OpenOptions::new().write(true).open(&a).unwrap();
        f.seek(std::io::SeekFrom::Start(offset)).unwrap();
        f.write_all(&f32::NAN.to_le_bytes()).unwrap();
        f.set_modified(mtime).unwrap();
    }
    assert_eq!(std::fs::metadata(&a).unwrap().modified().unwrap(), mtime);
    let changed = t.load(&a, &s);
    assert_eq!(
        changed.mapped_projections(),
        (0, all),
        "packed afresh, not mapped"
    );
    assert_ne!(changed.panel_file(), Some(old_file.as_path()));
    let tokens = changed.encode("the hat", false).unwrap();
    let mut cache = AttnCache::new(&CaptureSpec::patterns(), tokens.len());
    let e = changed
        .forward(&tokens, &RunOptions::last_logits(tokens.len()), &mut cache)
        .err()
        .expect("the NaN stops the forward");
    assert!(e.to_string().contains("non-finite"), "{e}");
}

/// A folder of tiny models and a packed-weight cache (`cache`) inside it.
struct ModelsAndCache {
    dir: tempfile::TempDir,
    cache: std::path::PathBuf,
}

impl ModelsAndCache {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("panels");
        ModelsAndCache { dir, cache }
    }

    /// A tiny Qwen2 of `seed`, written as `name`.
    fn model(&self, name: &str, seed: u64) -> std::path::PathBuf {
        let p = self.dir.path().join(name);
        write_gguf(
            &tiny_model(Arch::Qwen2, seed),
            Arch::Qwen2,
            GgmlDType::F32,
            &p,
        )
        .unwrap();
        p
    }

    /// The cache, capped at `max_bytes`, for models of any size.
    fn settings(&self, max_bytes: u64) -> panels::Settings {
        panels::Settings {
            dir: self.cache.clone(),
            min_bytes: 0,
            max_bytes,
        }
    }

    fn load(&self, p: &std::path::Path, s: &panels::Settings) -> Model {
        Model::load_with(p.to_str().unwrap(), Precision::Exact, false, Some(s)).unwrap()
    }

    /// The cache's files, sorted.
    fn files(&self) -> Vec<std::path::PathBuf> {
        let mut v: Vec<_> = std::fs::read_dir(&self.cache)
            .map(|d| d.map(|e| e.unwrap().path()).collect())
            .unwrap_or_default();
        v.sort();
        v
    }
}

/// The first load of `a` packs and writes its file; the `links` to it map that file, and no
/// other is written. Returns the file and the model's number of projections.
fn links_map_the_first_paths_file(
    t: &ModelsAndCache,
    a: &std::path::Path,
    links: [&std::path::Path; 2],
) -> (std::path::PathBuf, usize) {
    let unlimited = t.settings(u64::MAX);
    let first = t.load(a, &unlimited);
    let all = first.mapped_projections().1;
    assert_eq!(first.mapped_projections(), (0, all), "packed and written");
    let a_file = first.panel_file().unwrap().to_path_buf();
    for other in links {
        let m = t.load(other, &unlimited);
        assert_eq!(
            m.mapped_projections(),
            (all, all),
            "{}: mapped",
            other.display()
        );
        assert_eq!(
            m.panel_file(),
            Some(a_file.as_path()),
            "{}",
            other.display()
        );
    }
    assert_eq!(t.files(), vec![a_file.clone()], "one file for three paths");
    (a_file, all)
}

/// With room for two files of `size` and `a`'s (`a_file`) already there: `b`, then `a` mapped again, then
/// `c` removes `b`, the least recently used; `b` again removes `a`. Returns `b`'s and `c`'s
/// files, the two left.
fn the_least_recently_used_make_room(
    t: &ModelsAndCache,
    [a, b, c]: [&std::path::Path; 3],
    a_file: &std::path::Path,
    size: u64,
    all: usize,
) -> [std::path::PathBuf; 2] {
    // room for two files of these (equal) models
    let capped = t.settings(2 * size + size / 2);
    let b_file = t.load(b, &capped).panel_file().unwrap().to_path_buf();
    // a is mapped again: now b is the least recently used
    assert_eq!(t.load(a, &capped).mapped_projections(), (all, all));
    let c_file = t.load(c, &capped).panel_file().unwrap().to_path_buf();
    let mut want = vec![a_file.to_path_buf(), c_file.clone()];
    want.sort();
    assert_eq!(
        t.files(),
        want,
        "b, the least recently used, made room for c"
    );
    assert!(!b_file.exists());
    // b again: now a is the least recently used (c was written after a was mapped)
    let b_again = t.load(b, &capped);
    assert_eq!(
        b_again.mapped_projections(),
        (0, all),
        "b was removed: packed again"
    );
    let mut want = vec![b_file.clone(), c_file.clone()];
    want.sort();
    assert_eq!(t.files(), want);
    [b_file, c_file]
}

/// `list`: model, layout, size of each file (`b_file`, then c's), most recently used first.
fn list_names_each_files_model_layout_and_size(
    t: &ModelsAndCache,
    b_file: &std::path::Path,
    size: u64,
) {
    let listed = panels::list(&t.cache);
    assert_eq!(listed.len(), 2);
    assert_eq!(listed[0].path, b_file);
    assert_eq!(listed[0].model, "b.gguf");
    assert_eq!(listed[1].model, "c.gguf");
    let layout = attnscope::model::weights::PanelLayout::of(Precision::Exact).name();
    for f in &listed {
        assert_eq!(f.layout, layout);
        assert_eq!(f.bytes, size);
        assert!(f.usable, "{f:?}");
    }
}
