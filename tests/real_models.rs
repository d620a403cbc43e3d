//! The real checkpoints against Hugging Face transformers (tests/golden, from ../shared/reference):
//! token ids, every attention weight, sink profiles, next-token top-5.
// index loops over (layer, head, query) read like the maths; nested test types stay inline
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

mod common;
use attnscope::analysis::inspect::InspectReport;
use attnscope::model::capture::{AttnCache, CaptureSpec};
use attnscope::model::forward::RunOptions;
use common::*;

const SENTENCE: &str = "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc.";

/// Every attention weight against transformers: 1e-4 on the default model, whose large scores
/// f32 rounds by up to a quarter of that (README.md, "What exact means"; measured 5.8e-5), 2e-5
/// on SmolLM2 and Gemma 3 (measured at most 5.0e-6 and 3.0e-6, with and without the AMX tiles
/// and at `--memory low`).
fn attention_bound(alias: &str) -> f64 {
    if alias.starts_with("qwen") {
        1e-4
    } else {
        2e-5
    }
}

/// The next-token top-5 logits against transformers' (measured at most 6.3e-5).
const LOGITS: f64 = 3e-4;
/// The sink profiles against transformers' (measured at most 3.0e-6).
const SINKS: f64 = 2e-5;
/// Norm-based attention against transformers', relative (measured at most 2.5e-5).
const NORMS: f64 = 1e-4;

fn check_model(alias: &str, prefix: &str) {
    let model = real_model(alias);
    let g = golden_json(&format!("{prefix}_transformers.json"));
    let tokens = model.encode(SENTENCE, false).unwrap();
    assert_eq!(tokens, token_ids(&g["token_ids"]), "{alias}: token ids");
    let n = tokens.len();
    let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
    let out = model
        .forward(&tokens, &RunOptions::last_logits(n), &mut cache)
        .unwrap();
    // last-row attention of every layer and head
    let (shape, want) = golden_npy(&format!("{prefix}_transformers_attn_lastrow.npy"));
    assert_eq!(shape, vec![model.dims.n_layers, model.dims.n_heads, n]);
    let mut got = Vec::new();
    for l in 0..model.dims.n_layers {
        let p = cache.pattern(l).unwrap();
        for h in 0..model.dims.n_heads {
            got.extend_from_slice(p.row_at(h, n - 1).unwrap());
        }
    }
    assert_array(
        &format!("{alias}: last-row patterns [layer, head, key]"),
        &shape,
        &got,
        &want,
        Bound::Abs(attention_bound(alias)),
    );
    next_token_top5_matches(alias, &out.logits[0], &g["next_token_top5"]);
}

/// The next-token top-5 ids are the reference's, in its order, and their logits are within
/// [`LOGITS`] of its logits (cells keyed by rank).
fn next_token_top5_matches(alias: &str, logits: &[f32], want: &serde_json::Value) {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let want = want.as_array().unwrap();
    assert_eq!(want.len(), 5, "{alias}: the reference's top-5");
    let want_ids: Vec<usize> = want
        .iter()
        .map(|t| t["id"].as_u64().unwrap() as usize)
        .collect();
    assert_eq!(order[..5], want_ids[..], "{alias}: next-token top-5");
    assert_cells(
        &format!("{alias}: next-token top-5 logits [rank]"),
        want_ids
            .iter()
            .enumerate()
            .map(|(r, &id)| (r, logits[id] as f64)),
        want.iter()
            .enumerate()
            .map(|(r, t)| (r, t["logit"].as_f64().unwrap())),
        Bound::Abs(LOGITS),
    );
}

#[test]
fn qwen_matches_transformers() {
    check_model("qwen2.5-coder-0.5b", "qwen");
    // every weight of every layer, head, query and key
    let model = real_model("qwen2.5-coder-0.5b");
    let tokens = model.encode(SENTENCE, false).unwrap();
    let mut cache = AttnCache::new(&CaptureSpec::patterns(), tokens.len());
    model
        .forward(&tokens, &RunOptions::default(), &mut cache)
        .unwrap();
    let (shape, want) = golden_npy("qwen_transformers_attn_full.npy");
    assert_eq!(shape, vec![24, 14, tokens.len(), tokens.len()]);
    let got: Vec<f32> = (0..24)
        .flat_map(|l| cache.pattern(l).unwrap().data.to_vec())
        .collect();
    assert_array(
        "qwen: full patterns [layer, head, query, key]",
        &shape,
        &got,
        &want,
        Bound::Abs(1e-4),
    );
}

#[test]
fn smollm_matches_transformers() {
    check_model("smollm2-135m", "smol");
}

/// On a CPU with AMX, `exact` runs a quantized file's projections on the tiles as its integers
/// and scales (84 of the default model's 96: its Q6_K down projections have groups of 16 and stay
/// f32; every one of SmolLM2's Q4_1). The checks against transformers above then test that path;
/// these run them again in child processes with `ATTNSCOPE_AMX=f32`, so the f32 path is checked
/// on the real models too. Without AMX both are the f32 path, and this says so.
#[test]
fn exact_on_the_f32_kernels_matches_transformers_too() {
    use attnscope::model::{Model, Precision};
    let qwen = Model::load_with("qwen2.5-coder-0.5b", Precision::Exact, false, None).unwrap();
    let smol = Model::load_with("smollm2-135m", Precision::Exact, false, None).unwrap();
    if attnscope::kernels::amx::exact_scaled() {
        assert_eq!(
            qwen.scaled_projections(),
            (84, 96),
            "the default model on the tiles"
        );
        assert_eq!(
            smol.scaled_projections(),
            (120, 120),
            "SmolLM2 on the tiles"
        );
    } else {
        untested_kernel(&format!(
            "exact on AMX tiles as the files' integers and scales: this process runs {}",
            attnscope::kernels::select::kernels().exact_name()
        ));
        assert_eq!(qwen.scaled_projections().0, 0);
        assert_eq!(smol.scaled_projections().0, 0);
    }
    drop((qwen, smol));
    for test in ["qwen_matches_transformers", "smollm_matches_transformers"] {
        let text = rerun_with_amx(test, "f32");
        assert!(text.contains("test result: ok"), "{text}");
    }
}

/// `--memory low` (every projection multiplied from the file's quantized blocks, a panel
/// dequantized just before each product): the checks against transformers above, rerun in child
/// processes with `ATTNSCOPE_MEMORY=low`, the default model's attention and inspect numbers,
/// SmolLM2's and Gemma 3's patterns.
#[test]
fn low_memory_matches_transformers_too() {
    use attnscope::model::{Memory, Model, Precision};
    let qwen = Model::load_full(
        "qwen2.5-coder-0.5b",
        Precision::Exact,
        Some(Memory::Low),
        false,
        None,
    )
    .unwrap();
    assert_eq!(
        qwen.low_projections(),
        (96, 96),
        "every projection from its blocks"
    );
    drop(qwen);
    for test in [
        "qwen_matches_transformers",
        "smollm_matches_transformers",
        "gemma3_matches_transformers",
        "inspect_numbers_match_reference_qwen",
    ] {
        rerun_with_env(test, "ATTNSCOPE_MEMORY", "low");
    }
}

/// Gemma 3 270M (GGUF `gemma3`, SentencePiece vocabulary, `<bos>` first because the file says
/// so): the token ids, every weight of every layer, head, query and key, the next-token top-5.
#[test]
fn gemma3_matches_transformers() {
    check_model("gemma3-270m", "gemma");
    let model = real_model("gemma3-270m");
    let tokens = model.encode(SENTENCE, false).unwrap();
    assert_eq!(tokens[0], 2, "<bos> first");
    assert_eq!(model.token_texts(&tokens[..1]), vec!["<bos>".to_string()]);
    let mut cache = AttnCache::new(&CaptureSpec::patterns(), tokens.len());
    model
        .forward(&tokens, &RunOptions::default(), &mut cache)
        .unwrap();
    let (shape, want) = golden_npy("gemma_transformers_attn_full.npy");
    assert_eq!(shape, vec![18, 4, tokens.len(), tokens.len()]);
    let got: Vec<f32> = (0..18)
        .flat_map(|l| cache.pattern(l).unwrap().data.to_vec())
        .collect();
    assert_array(
        "gemma: full patterns [layer, head, query, key]",
        &shape,
        &got,
        &want,
        Bound::Abs(attention_bound("gemma3-270m")),
    );
    // the pieces read as the reference decodes them
    let g = golden_json("gemma_transformers.json");
    let want_text: Vec<String> = g["token_strings_decoded"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    assert_eq!(model.token_texts(&tokens), want_text);
}

/// Gemma 3 on a 765-token text, longer than its 512-token window (tests/golden/gemma_long.json,
/// from make_gemma_long_golden.py): the ids, the rows of the last query and of query 300 in
/// every layer and head, and the next-token top-5. The last query's sliding layers give exactly
/// 0 to the keys before its window (`<bos>` included); the full layers (5, 11, 17) do not.
#[test]
fn gemma3_past_its_window_matches_transformers() {
    use attnscope::model::capture::{Hook, Queries};
    let model = real_model("gemma3-270m");
    let g = golden_json("gemma_long.json");
    let tokens = model.encode(g["text"].as_str().unwrap(), false).unwrap();
    assert_eq!(
        tokens,
        token_ids(&g["token_ids"]),
        "gemma: token ids of the long text"
    );
    let n = tokens.len();
    assert!(n > 512 + 200);
    let spec = CaptureSpec {
        hooks: vec![Hook::Pattern],
        layers: None,
        heads: None,
        queries: Queries::List(vec![n - 1, 300]),
    };
    let mut cache = AttnCache::new(&spec, n);
    let out = model
        .forward(&tokens, &RunOptions::last_logits(n), &mut cache)
        .unwrap();
    let (shape, want) = golden_npy("gemma_long_attn.npy");
    assert_eq!(shape, vec![2, 18, 4, n]);
    let mut got = Vec::new();
    for q in [n - 1, 300] {
        for l in 0..18 {
            let p = cache.pattern(l).unwrap();
            for h in 0..4 {
                got.extend_from_slice(p.row_at(h, q).unwrap());
            }
        }
    }
    assert_array(
        "gemma: rows past the window [query n-1 | 300, layer, head, key]",
        &shape,
        &got,
        &want,
        Bound::Abs(attention_bound("gemma3-270m")),
    );
    let g_dims = model.dims.gemma.as_ref().unwrap();
    for l in 0..18 {
        let p = cache.pattern(l).unwrap();
        let sliding = g_dims.sliding_layers[l];
        assert_eq!(sliding, !(l + 1).is_multiple_of(6), "layer {l}");
        for h in 0..4 {
            let row = p.row_at(h, n - 1).unwrap();
            let hidden = &row[..n - 512];
            if sliding {
                assert!(
                    hidden.iter().all(|&w| w == 0.0),
                    "layer {l} head {h}: keys before the window"
                );
            } else {
                assert!(row[0] > 0.0, "full layer {l} head {h} sees <bos>");
            }
        }
    }
    next_token_top5_matches("gemma long", &out.logits[0], &g["next_token_top5"]);
}

/// The 40 strings of tokenizer_vectors.json: ids equal the HF tokenizer's exactly.
#[test]
fn tokenizer_vectors_match_hf() {
    let v = golden_json("tokenizer_vectors.json");
    for (alias, key) in [
        ("qwen2.5-coder-0.5b", "qwen"),
        ("smollm2-135m", "smol"),
        ("gemma3-270m", "gemma"),
    ] {
        let model = real_model(alias);
        let mut failures = Vec::new();
        for case in v["vectors"][key].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            let want = token_ids(&case["ids"]);
            // the vectors are add_special_tokens=False: no BOS even where the model adds one
            let got = model.tokenizer.encode_with(text, Some(false)).unwrap();
            if got != want {
                failures.push(format!("{text:?}: got {got:?}, want {want:?}"));
            }
        }
        assert!(
            failures.is_empty(),
            "{alias}: {} of 40 differ:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
}

/// The inspect report of the golden file's tables: every head of the last layer from the last
/// query, head averages of the first, middle and last layers.
fn lesson_report(
    model: &attnscope::model::Model,
    tokens: &[u32],
    g: &serde_json::Value,
) -> InspectReport {
    use attnscope::analysis::inspect::{build, InspectPlan};
    let (n, d) = (tokens.len(), &model.dims);
    let mid = g["middle_layer"].as_u64().unwrap() as usize;
    let plan = InspectPlan {
        query: n - 1,
        layer: d.n_layers - 1,
        heads: (0..d.n_heads).collect(),
        top_heads: 3,
        layers: vec![0, mid, d.n_layers - 1],
        top_layers: 4,
        concentrated_at: 0.9,
    };
    let mut c = plan.collector(d, n);
    let out = model
        .forward(tokens, &RunOptions::last_logits(n), &mut c)
        .unwrap();
    build(model, tokens, &c, &out.logits[0], &plan)
}

/// `--precision fast` (quantized kernels) against the reference: how far it moves, measured.
/// `--precision fast` on the shared sentence: where this CPU runs a fast kernel, every last-row
/// weight and the sink profiles stay within that kernel's bound of docs/precision.md
/// ([`FastBounds`]), the lesson's top-3 tables (last layer, heads 0-3; two keys within 0.01 of
/// each other in the reference may trade places) and the head-averaged top-4 name the same
/// tokens, and the top next token is the same. Where it has none (no AMX, VNNI nor AVX2, or
/// `ATTNSCOPE_ISA` below them), fast must give the exact numbers: that is checked, and said loudly
/// and counted as fast precision not tested (`untested_kernel`).
fn check_fast(alias: &str, prefix: &str, bounds: FastBounds) {
    let model =
        attnscope::model::Model::load(alias, attnscope::model::Precision::Fast, false).unwrap();
    let g = golden_json(&format!("{prefix}_transformers.json"));
    let tokens = model.encode(SENTENCE, false).unwrap();
    let (n, d) = (tokens.len(), &model.dims);
    let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
    let out = model
        .forward(&tokens, &RunOptions::last_logits(n), &mut cache)
        .unwrap();
    let (shape, want) = golden_npy(&format!("{prefix}_transformers_attn_lastrow.npy"));
    assert_eq!(shape, vec![d.n_layers, d.n_heads, n]);
    let got: Vec<f32> = (0..d.n_layers)
        .flat_map(|l| {
            (0..d.n_heads)
                .flat_map(|h| cache.pattern(l).unwrap().row_at(h, n - 1).unwrap().to_vec())
                .collect::<Vec<_>>()
        })
        .collect();
    match attnscope::model::weights::fast_kernel() {
        Some(kernel) => check_fast_kernel(
            &FastRun {
                alias,
                model: &model,
                tokens: &tokens,
                g: &g,
                want: &want,
                got: &got,
                logits: &out.logits[0],
            },
            kernel,
            bounds,
        ),
        None => {
            untested_kernel(&format!(
                "{alias}: --precision fast has no kernel of its own here ({}); only fast = exact is checked",
                attnscope::kernels::select::kernels().why_no_fast_kernel()
            ));
            assert_array(
                &format!("{alias}: fast = exact without AMX, VNNI or AVX2 [layer, head, key]"),
                &shape,
                &got,
                &want,
                Bound::Abs(attention_bound(alias)),
            );
        }
    }
}

/// How far `fast` may move a model's numbers on each kernel: docs/precision.md's figures
/// ("attention weights move by up to ..., the sink profiles by up to ..."), rounded up.
#[derive(Clone, Copy)]
struct FastBounds {
    /// bf16 AMX tiles: (last-row weights, sink profiles)
    bf16: (f64, f64),
    /// 8-bit blocks on AVX-512 VNNI or AVX2 (the same bits): (last-row weights, sink profiles)
    int8: (f64, f64),
}

/// One fast-precision run of the lesson sentence, beside the reference's numbers.
struct FastRun<'a> {
    alias: &'a str,
    model: &'a attnscope::model::Model,
    tokens: &'a [u32],
    /// the golden JSON (tables, sinks, next tokens)
    g: &'a serde_json::Value,
    /// transformers' last rows, `[layers, heads, n]`
    want: &'a [f32],
    /// the fast run's last rows, in the same layout
    got: &'a [f32],
    /// the last position's logits
    logits: &'a [f32],
}

/// The checks of a fast run on a CPU with a fast kernel (`kernel`): its deviation bound, that it
/// really ran, the sink profile within its bound, the top-3 tables and the next token.
fn check_fast_kernel(run: &FastRun, kernel: &str, bounds: FastBounds) {
    let FastRun { alias, logits, .. } = *run;
    let d = &run.model.dims;
    let (weights, sinks) = if kernel.contains("bf16") {
        bounds.bf16
    } else {
        bounds.int8
    };
    let max = assert_array(
        &format!("{alias} fast precision ({kernel}): last rows [layer, head, key]"),
        &[d.n_layers, d.n_heads, run.tokens.len()],
        run.got,
        run.want,
        Bound::Abs(weights),
    );
    assert!(
        max > 1e-4,
        "{alias}: fast precision should really use the {kernel} kernel (max deviation {max})"
    );
    let r = lesson_report(run.model, run.tokens, run.g);
    assert_sink_profiles(
        &format!("{alias} fast precision ({kernel}): sink profiles"),
        &r,
        run.g,
        sinks,
    );
    let tables =
        fast_head_tables_match_but_for_near_ties(run, &r) + fast_head_averaged_top3_match(run, &r);
    assert_eq!(tables, 4 * 3 + 3, "every table was compared");
    let top1 = logits
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0 as u64;
    assert_eq!(
        top1,
        run.g["next_token_top5"][0]["id"].as_u64().unwrap(),
        "{alias}: fast precision changed the top next token"
    );
}

/// Every layer's sink shares in `r` against the reference's, cell by cell (`(layer, "query")`:
/// the last query's; `(layer, "all")`: the mean over queries 1 to the end); the worst difference.
fn assert_sink_profiles(label: &str, r: &InspectReport, g: &serde_json::Value, bound: f64) -> f64 {
    let got = r.layers.iter().flat_map(|row| {
        [
            ((row.layer, "query"), row.sink_query as f64),
            ((row.layer, "all"), row.sink_all_queries as f64),
        ]
    });
    let want = |key: &'static str, what: &str| -> Vec<((usize, &'static str), f64)> {
        json_cells(&g[what])
            .into_iter()
            .map(|(i, w)| ((i[0], key), w))
            .collect()
    };
    let mut reference = want("query", "sink_share_lastq_full");
    reference.extend(want("all", "sink_share_mean_q1_to_end_full"));
    assert_cells(label, got, reference, Bound::Abs(bound))
}

/// The fast run's top-3 of the last layer's heads 0-3 name the reference's keys, but where two
/// keys within 0.01 of each other in the reference trade places; returns the rows compared.
fn fast_head_tables_match_but_for_near_ties(run: &FastRun, r: &InspectReport) -> usize {
    let (alias, want) = (run.alias, run.want);
    assert_eq!(r.heads.len(), run.model.dims.n_heads);
    let (n, d) = (run.tokens.len(), &run.model.dims);
    let mut tables = 0;
    for h in r.heads.iter().filter(|h| h.head < 4) {
        let top3 = run.g["last_layer_head_top3_lastq"][h.head.to_string()]
            .as_array()
            .unwrap();
        assert_eq!(h.top.len(), top3.len());
        // the reference's weight of key j in this head's last row
        let ref_w = |j: usize| want[((d.n_layers - 1) * d.n_heads + h.head) * n + j];
        for (got, w) in h.top.iter().zip(top3) {
            let pos = w["pos"].as_u64().unwrap() as usize;
            if got.pos != pos {
                // two keys closer in the reference than a hundredth may trade places: the
                // 8-bit blocks move weights by up to 0.04 (SmolLM2's last layer, head 1: keys 23
                // and 48, 0.084 and 0.079 in the reference)
                let what = format!(
                    "{alias} fast: head {} top-3 has key {} where the reference has {pos} ({} against {} there)",
                    h.head,
                    got.pos,
                    ref_w(got.pos),
                    ref_w(pos)
                );
                assert!(
                    (ref_w(pos) - ref_w(got.pos)).abs() < 0.01,
                    "{what}: not a near tie"
                );
                eprintln!("NOTE: {what}: a near tie");
            }
            tables += 1;
        }
    }
    tables
}

/// The fast run's head-averaged top-3 of each listed layer names the reference's keys; returns
/// the layers compared.
fn fast_head_averaged_top3_match(run: &FastRun, r: &InspectReport) -> usize {
    let mut tables = 0;
    for l in r.layers.iter().filter(|l| l.top.is_some()) {
        let want = run.g["head_avg_top4_lastq"][l.layer.to_string()]
            .as_array()
            .unwrap();
        let got: Vec<u64> = l
            .top
            .as_ref()
            .unwrap()
            .iter()
            .map(|t| t.pos as u64)
            .collect();
        let want: Vec<u64> = want.iter().map(|w| w["pos"].as_u64().unwrap()).collect();
        assert_eq!(
            got[..3],
            want[..3],
            "{} fast: layer {} head-averaged top-3",
            run.alias,
            l.layer
        );
        tables += 1;
    }
    tables
}

/// docs/precision.md's figures, rounded up, for both models: bf16 tiles (last rows, sinks) measured
/// 0.0137 and 0.0059 on SmolLM2 (0.0093 on its rows before an accumulating product was added to C
/// after its sum: a bf16 rounding of a later activation flips, one draw of bf16's noise), 0.0091
/// and 0.0041 on Qwen2.5; 8-bit blocks' sinks 0.0113-0.0119 on SmolLM2 (the 0.01 the speed issue
/// asks for is not met there: Q4_1 weights requantized to 8-bit blocks; this pins what is).
const FAST_BOUNDS: FastBounds = FastBounds {
    bf16: (0.016, 0.008),
    int8: (0.04, 0.0125),
};

#[test]
fn fast_precision_deviation_on_qwen() {
    check_fast("qwen2.5-coder-0.5b", "qwen", FAST_BOUNDS);
}

#[test]
fn fast_precision_deviation_on_smollm() {
    check_fast("smollm2-135m", "smol", FAST_BOUNDS);
}

/// The checks above ran the fast kernel this process picks (bf16 tiles on a CPU with AMX); this
/// runs them again in child processes on every other fast kernel the CPU has (the 8-bit VNNI
/// blocks with the tiles off, `ATTNSCOPE_AMX=0`; the 8-bit AVX2 blocks, `ATTNSCOPE_ISA=avx2`), so
/// each one is checked on the real models: the
/// deviation bound of its kind, the sink profile, the top-3 tables and the next token.
#[test]
fn fast_precision_on_every_fast_kernel_of_this_cpu() {
    let others = other_fast_kernels();
    if others.is_empty() {
        eprintln!(
            "NOTE: the checks above ran the only fast kernel of this process: {}",
            attnscope::model::weights::fast_kernel().unwrap_or("none")
        );
    }
    for (kernel, var, value) in others {
        for test in [
            "fast_precision_deviation_on_qwen",
            "fast_precision_deviation_on_smollm",
        ] {
            let text = rerun_with_env(test, var, value);
            assert!(
                text.contains(&format!("fast precision ({kernel})")),
                "{test} with {var}={value} did not run {kernel}:\n{text}"
            );
            for line in text.lines().filter(|l| l.contains("fast precision")) {
                eprintln!("{var}={value} {test}: {line}");
            }
        }
    }
}

/// `inspect`'s numbers (the report and its JSON come from this struct) equal the reference:
/// per-head top-3 of the last layer, head-averaged top-4 at first/middle/last layer, both sink
/// profiles, per-head max/argmax/entropy, next-token top-5 probabilities.
fn check_inspect(alias: &str, prefix: &str) {
    let model = real_model(alias);
    let g = golden_json(&format!("{prefix}_transformers.json"));
    let tokens = model.encode(SENTENCE, false).unwrap();
    let r = lesson_report(model, &tokens, &g);
    inspect_heads_match(alias, &r, &g);
    inspect_layer_tops_match(alias, model, &tokens, &r, &g);
    assert_sink_profiles(&format!("{alias}: sink profiles"), &r, &g, SINKS);
    inspect_next_tokens_match(alias, model, &r, &g);
}

/// `x` rounded to 4 decimals, as the reference's tables are.
fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

/// Each head of the last layer: the top-3 (heads 0-3, the lesson's table), max weight, argmax
/// and entropy equal the reference's.
fn inspect_heads_match(alias: &str, r: &InspectReport, g: &serde_json::Value) {
    let per_head = g["last_layer_per_head_lastq"].as_array().unwrap();
    assert_eq!(
        r.heads.len(),
        per_head.len(),
        "{alias}: heads of the last layer"
    );
    assert_cells(
        &format!("{alias}: last layer's entropy [head] (the reference's to 4 decimals)"),
        r.heads.iter().map(|h| (h.head, h.entropy as f64)),
        per_head.iter().map(|ph| {
            (
                ph["head"].as_u64().unwrap() as usize,
                ph["entropy_nats"].as_f64().unwrap(),
            )
        }),
        Bound::Abs(5e-5 + 1e-4),
    );
    for h in &r.heads {
        // the reference lists the top-3 of heads 0-3 (the lesson's table) and max/entropy of all
        let want = g["last_layer_head_top3_lastq"][h.head.to_string()]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert!(h.head >= 4 || want.len() == 3);
        if !want.is_empty() {
            assert_eq!(
                h.top.len(),
                want.len(),
                "{alias} head {}: top list length",
                h.head
            );
        }
        for (got, want) in h.top.iter().zip(&want) {
            assert_eq!(
                got.pos as u64,
                want["pos"].as_u64().unwrap(),
                "{alias} head {} top",
                h.head
            );
            assert_eq!(
                round4(got.weight as f64),
                want["weight"].as_f64().unwrap(),
                "{alias} head {} weight",
                h.head
            );
        }
        let ph = &g["last_layer_per_head_lastq"][h.head];
        assert_eq!(
            round4(h.max_weight as f64),
            ph["max_weight"].as_f64().unwrap()
        );
        assert_eq!(h.argmax as u64, ph["argmax_pos"].as_u64().unwrap());
    }
}

/// The head-averaged top-4 of the three layers the plan asks for: every position, weight and
/// token equals the reference's.
fn inspect_layer_tops_match(
    alias: &str,
    model: &attnscope::model::Model,
    tokens: &[u32],
    r: &InspectReport,
    g: &serde_json::Value,
) {
    // the plan asks for the top tokens of three layers: all three are checked
    assert_eq!(
        r.layers.iter().filter(|l| l.top.is_some()).count(),
        3,
        "{alias}: layers with a top list"
    );
    for l in r.layers.iter().filter(|l| l.top.is_some()) {
        let want = g["head_avg_top4_lastq"][l.layer.to_string()]
            .as_array()
            .unwrap();
        assert_eq!(
            l.top.as_ref().unwrap().len(),
            want.len(),
            "{alias} layer {}: head-avg top length",
            l.layer
        );
        for (got, want) in l.top.as_ref().unwrap().iter().zip(want) {
            assert_eq!(
                got.pos as u64,
                want["pos"].as_u64().unwrap(),
                "{alias} layer {} head-avg top",
                l.layer
            );
            assert_eq!(round4(got.weight as f64), want["weight"].as_f64().unwrap());
            // the reference decodes split UTF-8 as U+FFFD; attnscope shows the bytes (<81>)
            let lossy =
                String::from_utf8_lossy(&model.tokenizer.token_bytes(tokens[got.pos])).into_owned();
            assert_eq!(lossy, want["token"].as_str().unwrap());
        }
    }
}

/// The next-token top-5: ids, probabilities and texts equal the reference's.
fn inspect_next_tokens_match(
    alias: &str,
    model: &attnscope::model::Model,
    r: &InspectReport,
    g: &serde_json::Value,
) {
    let want_next = g["next_token_top5"].as_array().unwrap();
    assert!(
        want_next.len() == 5 && r.next_token.len() >= 5,
        "{alias}: next-token lists {} vs {}",
        r.next_token.len(),
        want_next.len()
    );
    for (got, want) in r.next_token.iter().zip(want_next) {
        assert_eq!(got.id as u64, want["id"].as_u64().unwrap());
        assert_eq!(
            round4(got.prob as f64),
            want["prob"].as_f64().unwrap(),
            "{alias} next-token prob"
        );
        assert_eq!(
            String::from_utf8_lossy(&model.tokenizer.token_bytes(got.id)),
            want["token"].as_str().unwrap()
        );
    }
}

#[test]
fn inspect_numbers_match_reference_qwen() {
    check_inspect("qwen2.5-coder-0.5b", "qwen");
}

#[test]
fn inspect_numbers_match_reference_smollm() {
    check_inspect("smollm2-135m", "smol");
}

/// The sink over all queries, for every query, against the head-averaged reference matrix.
#[test]
fn smollm_head_averaged_attention_of_every_query() {
    let model = real_model("smollm2-135m");
    let tokens = model.encode(SENTENCE, false).unwrap();
    let n = tokens.len();
    let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
    model
        .forward(&tokens, &RunOptions::default(), &mut cache)
        .unwrap();
    let (shape, want) = golden_npy("smol_transformers_attn_headavg.npy");
    assert_eq!(shape, vec![30, n, n]);
    let mut got = Vec::new();
    for l in 0..30 {
        let p = cache.pattern(l).unwrap();
        for q in 0..n {
            got.extend(attnscope::analysis::vocab::mean_rows(
                (0..9).map(|h| p.row_at(h, q).unwrap()),
            ));
        }
    }
    assert_array(
        "smol head-averaged patterns [layer, query, key]",
        &shape,
        &got,
        &want,
        Bound::Abs(attention_bound("smollm2-135m")),
    );
}

/// Occlusion values against independent whole-sequence runs (no prefix reuse, no memo).
#[test]
fn faithfulness_occlusions_equal_fresh_runs_smollm() {
    use attnscope::analysis::faithfulness::{run, FaithSettings};
    use attnscope::analysis::vocab::Target;
    let model = real_model("smollm2-135m");
    let text = "The capital of France is";
    let tokens = model.encode(text, false).unwrap();
    let r = run(
        model,
        &tokens,
        &FaithSettings {
            target: Target::Text(" Paris".into()),
            replacement: " ".into(),
            seed: 7,
            gradients: false,
            ig_steps: 0,
        },
        |_, _| {},
    )
    .unwrap();
    assert_eq!(r.target.token, " Paris");
    norm_ranking_equals_a_capture_of_the_values(model, &tokens, &r);
    let base = fresh_logprob(model, &tokens, vec![], r.target.id);
    assert!((base - r.target.logprob).abs() < 1e-4);
    occlusions_match_transformers(&tokens, &r);
    occlusions_equal_fresh_runs(model, &tokens, &r, base);
}

/// The norm-based ranking (from the kept KV prefix) equals the one from a capture of hook_v.
fn norm_ranking_equals_a_capture_of_the_values(
    model: &attnscope::model::Model,
    tokens: &[u32],
    r: &attnscope::analysis::faithfulness::FaithReport,
) {
    use attnscope::analysis::collect::Collector;
    use attnscope::analysis::norms::{mixed_norms, Values};
    let (n, d) = (tokens.len(), &model.dims);
    let last = d.n_layers - 1;
    let mut c = Collector::new(d.n_layers, d.n_heads, n, n - 1).keep_values(&[last]);
    model
        .forward(tokens, &RunOptions::last_logits(n), &mut c)
        .unwrap();
    let v = Values::pos_major(
        c.values[last].as_ref().unwrap(),
        n,
        d.n_kv_heads,
        d.head_dim,
    );
    let alphas: Vec<&[f32]> = (0..d.n_heads).map(|h| c.row(last, h)).collect();
    let want = mixed_norms(model, last, &v, &alphas, n);
    let got: Vec<f32> = r.tokens.iter().map(|t| t.norm_last).collect();
    assert_array("norm_last [key]", &[n], &got, &want, Bound::RelMax(1e-4));
}

/// The log-probability of `target` after `toks` from a fresh whole-sequence run, with the keys
/// in `knockout` masked.
fn fresh_logprob(
    model: &attnscope::model::Model,
    toks: &[u32],
    knockout: Vec<usize>,
    target: u32,
) -> f32 {
    let out = model
        .forward(
            toks,
            &RunOptions {
                logits_at: vec![toks.len() - 1],
                knockout,
                ..Default::default()
            },
            &mut attnscope::model::capture::NoCapture,
        )
        .unwrap();
    attnscope::model::forward::log_softmax(&out.logits[0])[target as usize]
}

/// Deletion and replacement against transformers (an independent implementation).
fn occlusions_match_transformers(
    tokens: &[u32],
    r: &attnscope::analysis::faithfulness::FaithReport,
) {
    let n = tokens.len();
    let g = golden_json("smol_faithfulness.json");
    assert_eq!(
        tokens,
        token_ids(&g["token_ids"]),
        "the golden numbers are for these tokens"
    );
    assert_eq!(
        (r.target.id as u64, r.replacement.id as u64),
        (
            g["target_id"].as_u64().unwrap(),
            g["replacement_id"].as_u64().unwrap()
        )
    );
    assert_cells(
        "smol faithfulness: target log p",
        [((), r.target.logprob as f64)],
        [((), g["target_logprob"].as_f64().unwrap())],
        Bound::Abs(2e-5),
    );
    assert_eq!(r.tokens.len(), n);
    let mut want: Vec<((&str, usize), f64)> = Vec::new();
    for (key, what) in [("loo", "loo_delta"), ("replace", "replace_delta")] {
        want.extend(
            json_cells(&g[what])
                .into_iter()
                .map(|(i, w)| ((key, i[0]), w)),
        );
    }
    let got = r.tokens.iter().enumerate().flat_map(|(j, t)| {
        [
            (("loo", j), t.loo.map_or(f64::NAN, |x| x as f64)),
            (("replace", j), t.replace as f64),
        ]
    });
    assert_cells(
        "smol faithfulness: Δ log p [deletion | replacement, position] vs transformers",
        got,
        want,
        Bound::Abs(2e-4),
    );
}

/// Every occlusion equals a fresh run of the changed input: the token deleted, replaced, or (no
/// transformers counterpart) its key masked. Faithfulness reuses a cached prefix, the fresh runs
/// do not; `base` is the fresh run's log-probability of the unchanged input.
fn occlusions_equal_fresh_runs(
    model: &attnscope::model::Model,
    tokens: &[u32],
    r: &attnscope::analysis::faithfulness::FaithReport,
    base: f32,
) {
    let n = tokens.len();
    let lp = |toks: &[u32], knock: Vec<usize>| fresh_logprob(model, toks, knock, r.target.id);
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for j in 0..n {
        let t = &r.tokens[j];
        let del: Vec<u32> = tokens
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != j)
            .map(|(_, &t)| t)
            .collect();
        got.push((("loo", j), t.loo.map_or(f64::NAN, |x| x as f64)));
        want.push((("loo", j), (lp(&del, vec![]) - base) as f64));
        let mut rep = tokens.to_vec();
        rep[j] = r.replacement.id;
        got.push((("replace", j), t.replace as f64));
        want.push((("replace", j), (lp(&rep, vec![]) - base) as f64));
        // the last position's key cannot be masked from its own query
        if j < n - 1 {
            got.push((("knockout", j), t.knockout.map_or(f64::NAN, |x| x as f64)));
            want.push((("knockout", j), (lp(tokens, vec![j]) - base) as f64));
        }
    }
    assert_cells(
        "smol faithfulness: Δ log p [kind, position] vs fresh runs",
        got,
        want,
        Bound::Abs(2e-4),
    );
}

/// `heads --random-repeat 50` on the default model: induction heads stand far above a head that
/// spreads its weight evenly (measured: the best ~0.48, about 70x a uniform head's 0.007).
#[test]
fn the_default_model_has_induction_heads() {
    let v = run_json(["heads", "--random-repeat", "50", "--json"]);
    let ind = v["roles"]["induction"].as_array().unwrap();
    assert_eq!(ind.len(), 24);
    let best = ind
        .iter()
        .flat_map(|l| l.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()))
        .fold(0.0, f64::max);
    let uniform = v["uniform"]["induction"].as_f64().unwrap();
    eprintln!(
        "best induction score {best:.3}, uniform head {uniform:.4}, ratio {:.1}",
        best / uniform
    );
    assert!(
        uniform > 0.0 && best / uniform > 20.0,
        "best {best} vs uniform {uniform}"
    );
    assert!(
        best <= 0.5 + 1e-6,
        "only the second half's rows can score: at most 0.5"
    );
}

/// Norm-based attention (Kobayashi et al. 2020) against transformers: `α·‖W_Oʰ vⱼ‖` for every
/// layer and head and the whole-layer `‖Σₕ αʰ W_Oʰ vⱼ‖` from the last query
/// (tests/golden/make_norms_golden.py), within [`NORMS`] relative; and `inspect`'s columns are them.
fn check_norms(alias: &str, prefix: &str) {
    use attnscope::analysis::collect::Collector;
    let model = real_model(alias);
    let d = &model.dims;
    let tokens = model.encode(SENTENCE, false).unwrap();
    let n = tokens.len();
    let all: Vec<usize> = (0..d.n_layers).collect();
    let mut c = Collector::new(d.n_layers, d.n_heads, n, n - 1).keep_values(&all);
    model
        .forward(&tokens, &RunOptions::last_logits(n), &mut c)
        .unwrap();
    let (shape, want) = golden_npy(&format!("{prefix}_norms_lastrow.npy"));
    assert_eq!(shape, vec![d.n_layers, d.n_heads + 1, n]);
    // relative to max(|reference|, 1): each cell divided by that on both sides
    let scaled = |data: Vec<f32>| -> Vec<f64> {
        data.iter()
            .zip(&want)
            .map(|(&x, &w)| x as f64 / (w.abs() as f64).max(1.0))
            .collect()
    };
    assert_array(
        &format!("{alias}: norm-based attention / max(|ref|, 1) [layer, head | whole layer, key]"),
        &shape,
        &scaled(norms_from_the_capture(model, &c, n)),
        &scaled(want.clone()),
        Bound::Abs(NORMS),
    );
    one_heads_columns_are_the_padded_product(alias, model, &c, n);
    let g = golden_json(&format!("{prefix}_transformers.json"));
    inspect_norm_columns_are_these(alias, model, &tokens, &g, &want);
}

/// The norms from the captured values and weights, `[layers, heads + 1, n]`: each head's
/// `α·‖fₕ(vⱼ)‖`, then the whole layer's.
fn norms_from_the_capture(
    model: &attnscope::model::Model,
    c: &attnscope::analysis::collect::Collector,
    n: usize,
) -> Vec<f32> {
    use attnscope::analysis::norms::{mixed_norms, value_norms, Values};
    let d = &model.dims;
    let heads: Vec<usize> = (0..d.n_heads).collect();
    let mut out = Vec::with_capacity(d.n_layers * (d.n_heads + 1) * n);
    for l in 0..d.n_layers {
        let v = Values::pos_major(c.values[l].as_ref().unwrap(), n, d.n_kv_heads, d.head_dim);
        let vn = value_norms(model, l, &v, &heads, n);
        let alphas: Vec<&[f32]> = heads.iter().map(|&h| c.row(l, h)).collect();
        let mixed = mixed_norms(model, l, &v, &alphas, n);
        for h in 0..=d.n_heads {
            for j in 0..n {
                out.push(if h < d.n_heads {
                    alphas[h][j] * vn[h][j]
                } else {
                    mixed[j]
                });
            }
        }
    }
    out
}

/// Each head through its own columns of W_O (on the tiles too, as integers and scales): the
/// bits of the whole product on rows that are zero outside the head, at 1/n_heads of its cost.
/// First and last layer; first, middle and last head.
fn one_heads_columns_are_the_padded_product(
    alias: &str,
    model: &attnscope::model::Model,
    c: &attnscope::analysis::collect::Collector,
    n: usize,
) {
    let d = &model.dims;
    for l in [0, d.n_layers - 1] {
        let v = attnscope::analysis::norms::Values::pos_major(
            c.values[l].as_ref().unwrap(),
            n,
            d.n_kv_heads,
            d.head_dim,
        );
        for h in [0, d.n_heads / 2, d.n_heads - 1] {
            let (own, whole) = one_head_and_padded_output_projection(model, l, h, &v, n);
            assert_head_columns_are_the_padded_product(
                own,
                &whole,
                &format!("{alias}: layer {l} head {h}"),
            );
        }
    }
}

/// The inspect report's columns are the reference's norms (`want`, as in
/// [`norms_from_the_capture`]): each last-layer head's norms, their top key, shares summing to 1
/// and the first key's norm, and the whole-layer norms of the listed layers.
fn inspect_norm_columns_are_these(
    alias: &str,
    model: &attnscope::model::Model,
    tokens: &[u32],
    g: &serde_json::Value,
    want: &[f32],
) {
    let (n, d) = (tokens.len(), &model.dims);
    let r = lesson_report(model, tokens, g);
    let last = d.n_layers - 1;
    assert_eq!(r.heads.len(), d.n_heads, "{alias}: the last layer's heads");
    for h in &r.heads {
        let want_row = &want[(last * (d.n_heads + 1) + h.head) * n..][..n];
        assert_array(
            &format!("{alias}: inspect norms of head {} [key]", h.head),
            &[n],
            &h.norms,
            want_row,
            Bound::RelMax(NORMS),
        );
        assert_eq!(
            h.norm_top[0].pos,
            attnscope::analysis::vocab::max_argmax(want_row).1
        );
        let share: f32 = h
            .norms
            .iter()
            .map(|x| x / h.norms.iter().sum::<f32>())
            .sum();
        assert!((share - 1.0).abs() < 1e-4);
        assert!(
            (h.first_key.norm - h.first_key.weight * h.first_key.value_norm.unwrap()).abs() < 1e-5
        );
    }
    let listed: Vec<usize> = r
        .layers
        .iter()
        .filter(|l| l.norms.is_some())
        .map(|l| l.layer)
        .collect();
    assert_eq!(
        listed.len(),
        3,
        "{alias}: the plan's three layers have norms"
    );
    for lr in r.layers.iter().filter(|l| l.norms.is_some()) {
        let want_row = &want[(lr.layer * (d.n_heads + 1) + d.n_heads) * n..][..n];
        assert_array(
            &format!(
                "{alias}: inspect whole-layer norms, layer {} [key]",
                lr.layer
            ),
            &[n],
            lr.norms.as_ref().unwrap(),
            want_row,
            Bound::RelMax(NORMS),
        );
    }
}

#[test]
fn norm_based_attention_matches_transformers_qwen() {
    check_norms("qwen2.5-coder-0.5b", "qwen");
}

#[test]
fn norm_based_attention_matches_transformers_smollm() {
    check_norms("smollm2-135m", "smol");
}

/// `compare` on the real models through the binary: side A on the shared sentence equals
/// transformers' last-row attention, the other side is a changed sentence; two models whose
/// tokenizers disagree are refused with the first differing token named.
#[test]
fn compare_on_the_real_models() {
    let bin = env!("CARGO_BIN_EXE_attnscope");
    let other = "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Nam.";
    let out = std::process::Command::new(bin)
        .args([
            "compare",
            "--model",
            "qwen2.5-coder-0.5b",
            "--text",
            SENTENCE,
            "--text",
            other,
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (shape, want) = golden_npy("qwen_transformers_attn_lastrow.npy");
    assert_cells(
        "compare side A rows [layer, head, key]",
        json_cells(&v["a"]["rows"]),
        array_cells(&shape, &want),
        Bound::Abs(1e-4),
    );
    let js: Vec<Vec<f64>> = serde_json::from_value(v["js"].clone()).unwrap();
    assert!(js.iter().flatten().all(|x| (0.0..=1.0).contains(x)));
    assert!(
        js.iter().flatten().any(|&x| x > 1e-4),
        "a changed word changes some head"
    );
    let diff_at: Vec<usize> = (0..18)
        .filter(|&i| v["a"]["token_ids"][i] != v["b"]["token_ids"][i])
        .collect();
    assert_eq!(diff_at.len(), 1, "one token differs: {diff_at:?}");
    let out = std::process::Command::new(bin)
        .args([
            "compare",
            "--model",
            "qwen2.5-coder-0.5b",
            "--model",
            "smollm2-135m",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains("tokenizers split the text differently") && e.contains("position 0"),
        "{e}"
    );
}

/// The commands on Gemma 3 through the binary: `<bos>` first by default and named as the first
/// token, `--no-bos` leaves it out, the built-in corpus of `sinks` has no second `<bos>` inside,
/// the windowed layers give the first token 0 from queries past the window, and faithfulness
/// runs with the default one-token replacement.
#[test]
fn gemma3_commands() {
    let bin = env!("CARGO_BIN_EXE_attnscope");
    let run = |args: &[&str]| -> serde_json::Value {
        let out = std::process::Command::new(bin).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let j = run(&["inspect", "-m", "gemma3-270m", "--json"]);
    assert_eq!(j["tokens"][0]["text"], "<bos>");
    assert_eq!(j["tokens"].as_array().unwrap().len(), 19);
    let j = run(&["inspect", "-m", "gemma3-270m", "--no-bos", "--json"]);
    assert_eq!(j["tokens"][0]["text"], "H");
    assert_eq!(j["tokens"].as_array().unwrap().len(), 18);
    let model = real_model("gemma3-270m");
    let corpus = attnscope::analysis::corpus::builtin_tokens(&model.tokenizer, 2000).unwrap();
    assert!(!corpus.contains(&2), "a <bos> inside the built-in corpus");
    let j = run(&[
        "sinks",
        "-m",
        "gemma3-270m",
        "--max-tokens",
        "700",
        "--json",
    ]);
    assert_eq!(j["first_token"], "<bos>");
    for l in j["layers"].as_array().unwrap() {
        let layer = l["layer"].as_u64().unwrap() as usize;
        let last = l["sink_last_query"].as_f64().unwrap();
        if (layer + 1).is_multiple_of(6) {
            assert!(last > 0.0, "full layer {layer}");
        } else {
            assert_eq!(
                last, 0.0,
                "windowed layer {layer}: query 699 cannot see <bos>"
            );
        }
    }
    let j = run(&["faithfulness", "-m", "gemma3-270m", "--json"]);
    assert_eq!(j["target"]["id"], 58132, "{}", j["target"]);
}

/// The packed-weight cache of the default model and of SmolLM2, exact and fast (whatever layout
/// fast packs on this CPU: 8-bit blocks (VNNI, AVX2), bf16 AMX tiles or exact's f32 panels): the load
/// that writes it and the load that maps it compute every attention weight and the logits bit
/// for bit as a load without any cache, and the mapped load reads every projection from the
/// file. (SmolLM2's 120 matrices once made a header whose data went a page before its offsets:
/// every load rebuilt the file.)
#[test]
fn packed_weight_caches_change_no_bit_and_are_read_back() {
    use attnscope::model::panels::{Settings, DEFAULT_MAX_BYTES, MIN_BYTES};
    use attnscope::model::{Model, Precision};
    let models = ["qwen2.5-coder-0.5b", "smollm2-135m"];
    for (name, precision) in models
        .iter()
        .flat_map(|&m| [(m, Precision::Exact), (m, Precision::Fast)])
    {
        let dir = tempfile::tempdir().unwrap();
        let settings = Settings {
            dir: dir.path().to_path_buf(),
            min_bytes: MIN_BYTES,
            max_bytes: DEFAULT_MAX_BYTES,
        };
        let run = |m: &Model| {
            let tokens = m.encode(SENTENCE, false).unwrap();
            let n = tokens.len();
            let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
            let out = m
                .forward(&tokens, &RunOptions::last_logits(n), &mut cache)
                .unwrap();
            let mut bits: Vec<u32> = out.logits[0].iter().map(|x| x.to_bits()).collect();
            for l in 0..m.dims.n_layers {
                bits.extend(cache.pattern(l).unwrap().data.iter().map(|x| x.to_bits()));
            }
            bits
        };
        let want = run(&Model::load_with(name, precision, false, None).unwrap());
        let writer = Model::load_with(name, precision, false, Some(&settings)).unwrap();
        let all = writer.mapped_projections().1;
        assert_eq!(
            writer.mapped_projections(),
            (0, all),
            "{name} {precision:?}"
        );
        assert!(
            run(&writer) == want,
            "{name} {precision:?}: the load that writes the cache"
        );
        drop(writer);
        let files: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(files.len(), 1, "{name} {precision:?}: {files:?}");
        let reader = Model::load_with(name, precision, false, Some(&settings)).unwrap();
        assert_eq!(
            reader.mapped_projections(),
            (all, all),
            "{name} {precision:?}"
        );
        assert!(
            run(&reader) == want,
            "{name} {precision:?}: the load that maps the cache"
        );
    }
}

/// Gu et al.'s sink metric from the streamed statistics equals the one computed here from the
/// whole patterns (α₁ = the mean over every query of the weight on the first token); Sun et al.'s
/// massive activations are the largest values of the captured hook_resid_post.
#[test]
fn gu_sink_metric_and_massive_activations_from_the_patterns() {
    use attnscope::analysis::sinks::gu_sink_metric;
    use attnscope::model::capture::{Hook, Queries};
    let model = real_model("qwen2.5-coder-0.5b");
    let d = &model.dims;
    let tokens = model.encode(SENTENCE, false).unwrap();
    let n = tokens.len();
    let g = gu_sink_metric(model, std::slice::from_ref(&tokens), 0.3).unwrap();
    let mut cache = AttnCache::new(
        &CaptureSpec {
            hooks: vec![Hook::Pattern, Hook::ResidPost],
            layers: None,
            heads: None,
            queries: Queries::All,
        },
        n,
    );
    model
        .forward(&tokens, &RunOptions::default(), &mut cache)
        .unwrap();
    let want = gu_fractions_from_the_patterns(model, &cache, n);
    assert_array(
        "Gu's fraction of heads [layer]",
        &[d.n_layers],
        &g.per_layer,
        &want,
        Bound::Abs(1e-9),
    );
    assert!((g.metric - want.iter().sum::<f64>() / d.n_layers as f64).abs() < 1e-9);
    assert!(
        g.metric > 0.2,
        "the default model has sink heads: {}",
        g.metric
    );
    massive_activations_are_the_largest_residuals(model, &cache);
    corpus_keeps_the_same_per_text(model, &cache, &want);
}

/// Per layer, the fraction of heads whose α₁ (the mean over every query of the weight on the
/// first token) is over 0.3, from the captured whole patterns.
fn gu_fractions_from_the_patterns(
    model: &attnscope::model::Model,
    cache: &AttnCache,
    n: usize,
) -> Vec<f64> {
    let d = &model.dims;
    let mut want = Vec::new();
    for l in 0..d.n_layers {
        let p = cache.pattern(l).unwrap();
        let over = (0..d.n_heads)
            .filter(|&h| {
                (0..n)
                    .map(|q| p.row_at(h, q).unwrap()[0] as f64)
                    .sum::<f64>()
                    / n as f64
                    > 0.3
            })
            .count();
        want.push(over as f64 / d.n_heads as f64);
    }
    want
}

/// Each layer's largest massive activation is the captured hook_resid_post's largest |value|,
/// and the default model's sit on the first token in its middle layers.
fn massive_activations_are_the_largest_residuals(
    model: &attnscope::model::Model,
    cache: &AttnCache,
) {
    use attnscope::analysis::sinkmetrics::Massive;
    use attnscope::model::capture::Hook;
    let d = &model.dims;
    let mut m = Massive::new(1);
    for l in 0..d.n_layers {
        let x = &cache.get(l, Hook::ResidPost).unwrap().data;
        m.add(l, d.d_model, x);
        let (i, v) = x
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
            .unwrap();
        let top = &m.layers[l].top[0];
        assert_eq!(
            (top.pos, top.dim, top.value),
            (i / d.d_model, i % d.d_model, *v)
        );
    }
    // the default model's massive activations sit on the first token in its middle layers
    let massive: Vec<_> = m.layers.iter().filter(|l| l.massive > 0).collect();
    assert!(
        !massive.is_empty() && massive.iter().all(|l| l.top[0].pos == 0),
        "{massive:?}"
    );
}

/// `corpus` keeps the same per text: its record's massive activations (3 largest) are the
/// captured residual's, and Gu's count from its α₁ is the one from the whole patterns (`want`).
fn corpus_keeps_the_same_per_text(
    model: &attnscope::model::Model,
    cache: &AttnCache,
    want: &[f64],
) {
    use attnscope::analysis::sinkmetrics::Massive;
    use attnscope::model::capture::Hook;
    let d = &model.dims;
    let rec = attnscope::analysis::corpus::text_record(model, 0, SENTENCE, false, false)
        .unwrap()
        .unwrap();
    let mut m3 = Massive::new(3);
    for l in 0..d.n_layers {
        m3.add(l, d.d_model, &cache.get(l, Hook::ResidPost).unwrap().data);
    }
    assert_eq!(rec.massive.as_ref().unwrap(), &m3.layers);
    let agg = attnscope::analysis::corpus::aggregate(std::slice::from_ref(&rec), 0.3).unwrap();
    let got: Vec<f64> = agg.layers.iter().map(|a| a.gu_heads_fraction).collect();
    assert_array(
        "corpus: Gu's fraction of heads [layer]",
        &[d.n_layers],
        &got,
        want,
        Bound::Abs(1e-9),
    );
    assert_eq!(agg.massive.unwrap().texts_with_any, 1.0);
}
