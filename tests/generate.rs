//! Generation (issue #40): chat templates, KV-cache decoding against full forwards, seeded
//! sampling, bad input, and greedy generation on the real models against transformers.

mod common;

use attnscope::model::capture::{AttnCache, CaptureSpec};
use attnscope::model::config::Arch;
use attnscope::model::forward::{log_softmax, RunOptions};
use attnscope::model::generate::{pick, render_chat, GenOptions, Message};
use attnscope::model::tiny::{tiny_model, write_gguf, write_gguf_with};
use attnscope::model::{Model, Precision};
use attnscope::reference::Rng;
use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;

const CHATML: &str = "{%- for m in messages %}{%- if loop.first and m.role != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{%- endif %}<|im_start|>{{ m.role }}\n{{ m.content.strip() }}<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}";

fn msg(role: &str, content: &str) -> Message {
    Message {
        role: role.into(),
        content: content.into(),
    }
}

#[test]
fn a_hand_written_template_renders_as_jinja_would() {
    // `{%-` strips the newline before it
    let out = render_chat(CHATML, &[msg("user", "  Hi there ")], true, "", "").unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nYou are helpful.<|im_end|><|im_start|>user\nHi there<|im_end|><|im_start|>assistant"
    );
    // transformers renders with trim_blocks and lstrip_blocks: a block tag's own line leaves nothing
    let t = "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}";
    let out = render_chat(t, &[msg("user", "a"), msg("user", "b")], false, "", "").unwrap();
    assert_eq!(out, "a\nb\n");
    let out = render_chat(
        CHATML,
        &[msg("system", "Be brief."), msg("user", "Q")],
        false,
        "",
        "",
    )
    .unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nBe brief.<|im_end|><|im_start|>user\nQ<|im_end|>"
    );
    // Python-style methods, namespace, bos_token, tojson, loop controls
    let t = "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.content.startswith('skip') %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}[{{ m.role | upper }}:{{ m.content.lower() | tojson }}]{% endfor %}{{ ns.n }}";
    let out = render_chat(
        t,
        &[msg("user", "skip me"), msg("user", "KEEP")],
        true,
        "<s>",
        "",
    )
    .unwrap();
    assert_eq!(out, "<s>[USER:\"keep\"]1");
}

#[test]
fn a_template_that_fails_names_the_error() {
    let t = "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}ok";
    let e = render_chat(t, &[msg("system", "x")], true, "", "")
        .unwrap_err()
        .to_string();
    assert!(e.contains("System role not supported"), "{e}");
    let e = render_chat("{% for m in messages %}", &[msg("user", "x")], true, "", "")
        .unwrap_err()
        .to_string();
    assert!(e.contains("chat template") && e.contains("syntax"), "{e}");
}

/// Every generated token's log-probability and sink profile, computed on the KV cache one row at
/// a time, equal a full forward over the whole sequence (patterns captured).
fn kv_equals_full(model: &Model, prompt: &[u32], label: &str) {
    let o = GenOptions {
        max_new_tokens: 6,
        ..Default::default()
    };
    let g = model.generate(prompt, &o, |_| {}).unwrap();
    assert!(!g.generated.is_empty());
    let mut seq = prompt.to_vec();
    for t in &g.generated {
        let n = seq.len();
        let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
        let out = model
            .forward(&seq, &RunOptions::last_logits(n), &mut cache)
            .unwrap();
        let lp = log_softmax(&out.logits[0]);
        let best = (0..lp.len()).fold(0, |b, i| if lp[i] > lp[b] { i } else { b });
        assert_eq!(t.id as usize, best, "{label}: greedy token at {n}");
        assert!(
            (lp[best] - t.logprob).abs() <= 1e-4,
            "{label}: logprob {} vs {}",
            t.logprob,
            lp[best]
        );
        assert_eq!(t.sink.len(), model.dims.n_layers, "{label}");
        let nh = model.dims.n_heads;
        for l in 0..model.dims.n_layers {
            let p = cache.pattern(l).unwrap(); // [head, q, k]
            let s: f32 = (0..nh).map(|h| p.row(h, n - 1)[0]).sum::<f32>() / nh as f32;
            assert!(
                (s - t.sink[l]).abs() <= 1e-5,
                "{label}: layer {l} sink {} vs full {s}",
                t.sink[l]
            );
        }
        let w: f32 = t.top.iter().map(|x| x.1).sum();
        assert!(w > 0.0 && w <= 1.0 + 1e-5, "{label}: top weights {w}");
        seq.push(t.id);
    }
}

#[test]
fn kv_cache_rows_equal_full_forward_rows_on_every_family() {
    for arch in [Arch::Llama, Arch::Qwen2] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        write_gguf(&tiny_model(arch, 5), arch, GgmlDType::F32, &path).unwrap();
        let model = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
        kv_equals_full(
            &model,
            &[72, 101, 108, 108, 111, 32, 119],
            &format!("{arch:?}"),
        );
    }
    for fam in ["llama3", "qwen3", "mistral", "phi3", "gemma2", "gemma3"] {
        let dir = common::golden(&format!("arch/{fam}"));
        let model = Model::load(dir.to_str().unwrap(), Precision::Exact, false).unwrap();
        let prompt: Vec<u32> = (0..20u32).map(|i| (i * 37 + 11) % 250).collect();
        kv_equals_full(&model, &prompt, fam);
    }
}

fn tiny_gguf(dir: &std::path::Path, template: Option<&str>) -> std::path::PathBuf {
    let path = dir.join("t.gguf");
    let tpl = template.map(String::from);
    write_gguf_with(
        &tiny_model(Arch::Qwen2, 3),
        Arch::Qwen2,
        GgmlDType::F32,
        &path,
        &move |md, _| {
            if let Some(t) = &tpl {
                md.push(("tokenizer.chat_template".into(), Value::String(t.clone())));
            }
        },
    )
    .unwrap();
    path
}

#[test]
fn seeded_sampling_is_reproducible() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_gguf(dir.path(), None);
    let model = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
    let prompt = [72, 101, 108, 108, 111];
    let run = |seed: u64| -> Vec<u32> {
        let o = GenOptions {
            max_new_tokens: 12,
            temperature: 1.5,
            top_k: 40,
            top_p: 0.95,
            seed,
            ..Default::default()
        };
        let g = model.generate(&prompt, &o, |_| {}).unwrap();
        g.generated.iter().map(|t| t.id).collect()
    };
    let a = run(7);
    assert_eq!(a, run(7), "the same seed gives the same tokens");
    assert!(
        (1..6).any(|s| run(s) != a),
        "different seeds give different samples"
    );
    // top-k 1 is greedy whatever the temperature
    let logits: Vec<f32> = (0..50).map(|i| ((i * 7919) % 101) as f32 / 10.0).collect();
    let greedy = pick(&logits, &GenOptions::default(), &mut Rng::new(0));
    let o = GenOptions {
        temperature: 3.0,
        top_k: 1,
        ..Default::default()
    };
    for s in 0..10 {
        assert_eq!(pick(&logits, &o, &mut Rng::new(s)), greedy);
    }
}

fn cli(args: &[&str]) -> std::process::Output {
    assert_cmd::Command::cargo_bin("attnscope")
        .unwrap()
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn chat_through_the_template_and_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let plain = tiny_gguf(dir.path(), None);
    let p = plain.to_str().unwrap();
    let out = cli(&["generate", "-m", p, "--chat", "hi"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no chat template") && err.contains("--text"),
        "{err}"
    );
    for bad in [
        &["--temperature", "-1"][..],
        &["--top-p", "0"],
        &["--top-p", "1.5"],
        &["--max-new-tokens", "0"],
        &["--max-new-tokens", "100000000"],
    ] {
        let mut args = vec!["generate", "-m", p, "--text", "hello"];
        args.extend_from_slice(bad);
        let out = cli(&args);
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("error"));
    }
    let dir2 = tempfile::tempdir().unwrap();
    let broken = tiny_gguf(dir2.path(), Some("{% for m in messages %}{{ m.content }"));
    let out = cli(&["generate", "-m", broken.to_str().unwrap(), "--chat", "hi"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("chat template failed to render"), "{err}");
    // a working template: the prompt is the rendered chat, and --json has the per-token fields
    let dir3 = tempfile::tempdir().unwrap();
    let good = tiny_gguf(dir3.path(), Some(CHATML));
    let out = common::run_ok([
        "generate",
        "-m",
        good.to_str().unwrap(),
        "--chat",
        "hi",
        "--max-new-tokens",
        "3",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let model = Model::load(good.to_str().unwrap(), Precision::Exact, false).unwrap();
    let rendered = render_chat(CHATML, &[msg("user", "hi")], true, "", "").unwrap();
    let want = model.encode_with(&rendered, Some(false)).unwrap();
    let ids: Vec<u32> = v["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(ids, want);
    let gen = v["generated"].as_array().unwrap();
    assert!(!gen.is_empty() && gen.len() <= 3);
    for (i, t) in gen.iter().enumerate() {
        assert_eq!(t["position"].as_u64().unwrap() as usize, want.len() + i);
        assert_eq!(
            t["sink"].as_array().unwrap().len(),
            model.dims.n_layers,
            "one sink value per layer"
        );
        assert!(t["logprob"].as_f64().unwrap() <= 0.0);
    }
}

/// Greedy generation on a real model equals transformers' token for token (chat through the
/// model's own template, and raw), each generated token's log p within 1e-4 of the reference's,
/// and each generated row's sink profile within 2e-5 of its eager full-sequence forward
/// (measured: at most 3.6e-6).
fn real(alias: &str, golden: &str) {
    let model = common::real_model(alias);
    let g = common::golden_json(golden);
    let cases = g["cases"].as_object().unwrap();
    assert!(!cases.is_empty());
    for (name, c) in cases {
        let prompt = c["prompt"].as_str().unwrap();
        let ids = if c["kind"] == "chat" {
            model.chat_ids(prompt, None).unwrap()
        } else {
            model.encode(prompt, false).unwrap()
        };
        let want: Vec<u32> = c["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ids, want, "{alias} {name}: prompt ids");
        let o = GenOptions {
            max_new_tokens: c["max_new_tokens"].as_u64().unwrap() as usize,
            ..Default::default()
        };
        let out = model.generate(&ids, &o, |_| {}).unwrap();
        let got: Vec<u64> = out.generated.iter().map(|t| t.id as u64).collect();
        let want_gen: Vec<u64> = c["generated_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(got, want_gen, "{alias} {name}: generated ids");
        common::assert_cells(
            &format!("{alias} {name}: log p [generated token]"),
            out.generated
                .iter()
                .enumerate()
                .map(|(i, t)| (vec![i], t.logprob as f64)),
            common::json_cells(&c["logprobs"]),
            common::Bound::Abs(1e-4),
        );
        let rows = c["sink_rows"].as_array().unwrap();
        // row i is the query at the prompt's length + i, which produced generated token i + 1
        // (the last row produced nothing)
        assert_eq!(rows.len(), out.generated.len());
        let want: Vec<(Vec<usize>, f64)> = common::json_cells(&c["sink_rows"])
            .into_iter()
            .filter(|(at, _)| at[0] + 1 < rows.len())
            .collect();
        let got = out.generated[1..].iter().enumerate().flat_map(|(i, t)| {
            t.sink
                .iter()
                .enumerate()
                .map(move |(l, &x)| (vec![i, l], x as f64))
        });
        common::assert_cells(
            &format!("{alias} {name}: sink profile [generated row, layer]"),
            got,
            want,
            common::Bound::Abs(2e-5),
        );
    }
}

#[test]
fn qwen_greedy_generation_equals_transformers() {
    real("qwen2.5-coder-0.5b", "qwen_generate.json");
}

#[test]
fn smol_greedy_generation_equals_transformers() {
    real("smollm2-135m", "smol_generate.json");
}

#[test]
fn gemma_greedy_generation_equals_transformers() {
    real("gemma3-270m", "gemma_generate.json");
}

/// The ids of a JSON `tokens` list (`[{"id": ...}, ...]`).
fn ids_of(tokens: &serde_json::Value) -> Vec<u64> {
    tokens
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_u64().unwrap())
        .collect()
}

fn golden_chat_ids(golden: &str) -> (String, Vec<u64>) {
    let g = common::golden_json(golden);
    let c = &g["cases"]["chat_hanoi"];
    let ids = c["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    (c["prompt"].as_str().unwrap().to_string(), ids)
}

/// `--chat` on `inspect`, `view`, `faithfulness` and `ablate` runs the analysis on the chat
/// prompt exactly as transformers' `apply_chat_template` tokenizes it (the golden's prompt ids);
/// a model without a template (gemma3-270m's GGUF) is refused with exit 2 and a hint of --text.
#[test]
fn chat_prompts_run_the_analyses_as_transformers_tokenizes_them() {
    for (alias, golden) in [
        ("qwen2.5-coder-0.5b", "qwen_generate.json"),
        ("smollm2-135m", "smol_generate.json"),
    ] {
        common::real_model(alias); // fetched if missing
        let (question, want) = golden_chat_ids(golden);
        let out = common::run_ok(["inspect", "-m", alias, "--chat", &question, "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(ids_of(&v["tokens"]), want, "{alias}: inspect --chat tokens");
        // the query defaults to the last position: the template's generation prompt
        assert_eq!(v["query"].as_u64(), Some(want.len() as u64 - 1));
    }
    // the interventions and the view on the small model (each runs many forwards)
    let (question, want) = golden_chat_ids("smol_generate.json");
    let m = "smollm2-135m";
    for args in [
        &["faithfulness", "--gradients", "none", "--json"][..],
        &["ablate", "--json"],
    ] {
        let mut all = vec![args[0], "-m", m, "--chat", &question];
        all.extend_from_slice(&args[1..]);
        let out = cli(&all);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(ids_of(&v["tokens"]), want, "{args:?} --chat tokens");
    }
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("chat.html");
    let out = common::run_ok([
        "view",
        "-m",
        m,
        "--chat",
        &question,
        "--system",
        "Answer in one word.",
        "-o",
        page.to_str().unwrap(),
    ]);
    assert!(page.exists());
    let with_system = common::real_model(m)
        .chat_ids(&question, Some("Answer in one word."))
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("{} tokens", with_system.len())),
        "{stdout}"
    );
    let with_system: Vec<u64> = with_system.iter().map(|&i| i as u64).collect();
    assert_ne!(
        with_system, want,
        "the system message replaces the default one"
    );
    // no template: exit 2, with the hint
    common::real_model("gemma3-270m");
    for cmd in ["inspect", "view", "faithfulness", "ablate"] {
        let page = dir.path().join("g.html");
        let mut args = vec![cmd, "-m", "gemma3-270m", "--chat", "hi"];
        if cmd == "view" {
            args.extend_from_slice(&["-o", page.to_str().unwrap()]);
        }
        let out = cli(&args);
        assert_eq!(out.status.code(), Some(2), "{cmd}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("no chat template") && err.contains("--text"),
            "{cmd}: {err}"
        );
    }
    // --system without --chat is a usage error
    let out = cli(&["inspect", "-m", m, "--system", "x", "--text", "hi"]);
    assert_eq!(out.status.code(), Some(2));
}

/// `generate --attribute`'s matrix on tiny models: occlusion's one-forward-per-deletion columns
/// equal `attribute --method occlusion` (one deletion run per answer token) on each answer
/// token's own input, and every gradient method's columns equal `attribute` on that input;
/// positions past a token's input are NaN.
#[test]
fn the_generation_matrix_equals_attribute_on_each_teacher_forced_input() {
    use attnscope::analysis::vocab::Method;
    for arch in [Arch::Llama, Arch::Qwen2] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        write_gguf(&tiny_model(arch, 5), arch, GgmlDType::F32, &path).unwrap();
        let model = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
        for method in [
            Method::Occlusion,
            Method::Gradient,
            Method::GradXInput,
            Method::IntegratedGradients,
            Method::AttnLrp,
        ] {
            columns_equal_attribute_on_each_answer_tokens_input(&model, arch, method);
        }
    }
    a_one_token_prompt_and_what_is_refused();
}

/// `method`'s generation matrix of a prompt and its answer: each answer token's log p and column
/// equal `attribute` (4 steps) on that token's teacher-forced input, and the positions past that
/// input are NaN.
fn columns_equal_attribute_on_each_answer_tokens_input(
    model: &Model,
    arch: Arch,
    method: attnscope::analysis::vocab::Method,
) {
    use attnscope::analysis::attribute::{attribute, AttributeOptions};
    use attnscope::analysis::gen_attribute::attribute_generation;
    use attnscope::analysis::vocab::Target;
    let prompt = [72u32, 101, 108, 108, 111, 32];
    let answer = [119u32, 111, 114, 108, 100];
    let (p, a) = (prompt.len(), answer.len());
    let ids: Vec<u32> = prompt.iter().chain(&answer).copied().collect();
    let g = attribute_generation(model, &prompt, &answer, method, 4, &mut |_, _| {}).unwrap();
    assert_eq!(g.matrix.len(), p + a);
    assert_eq!(g.answer_len(), a);
    for j in 0..a {
        let want = attribute(
            model,
            &ids[..p + j],
            &AttributeOptions {
                method,
                target: Target::Id(answer[j]),
                wrong: None,
                steps: 4,
            },
            &mut |_, _| {},
        )
        .unwrap();
        assert!(
            (g.logprobs[j] - want.logprob.expect("a decoder's log p")).abs() <= 1e-5,
            "{arch:?} {method:?} {j}: logprob"
        );
        for i in 0..p + a {
            let got = g.matrix[i][j];
            if i >= p + j {
                assert!(
                    got.is_nan(),
                    "{arch:?} {method:?}: ({i}, {j}) is not an input"
                );
                continue;
            }
            let w = want.tokens[i].score;
            assert!(
                (got - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{arch:?} {method:?} cell ({i}, {j}): {got} vs attribute's {w}"
            );
        }
    }
}

/// A one-token prompt: deleting it leaves answer 0 nothing to predict from (NaN), the rest is
/// defined; an empty answer, and integrated gradients with 0 steps, are refused.
fn a_one_token_prompt_and_what_is_refused() {
    use attnscope::analysis::gen_attribute::attribute_generation;
    use attnscope::analysis::vocab::Method;
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_gguf(dir.path(), None);
    let model = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
    let g = attribute_generation(
        &model,
        &[72],
        &[101, 108],
        Method::Occlusion,
        1,
        &mut |_, _| {},
    )
    .unwrap();
    assert!(g.matrix[0][0].is_nan() && g.matrix[0][1].is_finite() && g.matrix[1][1].is_finite());
    assert!(
        attribute_generation(&model, &[72], &[], Method::Occlusion, 1, &mut |_, _| {}).is_err()
    );
    assert!(attribute_generation(
        &model,
        &[72],
        &[5],
        Method::IntegratedGradients,
        0,
        &mut |_, _| {}
    )
    .is_err());
}

/// The command: `--json` has the matrix (null above each column's input), `--html` writes a
/// self-contained page with it, and bad input exits 2.
#[test]
fn generate_attribute_json_html_and_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_gguf(dir.path(), None);
    let p = path.to_str().unwrap();
    let page = dir.path().join("a.html");
    let out = common::run_ok([
        "generate",
        "-m",
        p,
        "--text",
        "hello",
        "--max-new-tokens",
        "4",
        "--attribute",
        "occlusion",
        "--json",
        "--html",
        page.to_str().unwrap(),
    ]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let at = &v["attribution"];
    assert_eq!(at["method"], "occlusion");
    let np = at["prompt_tokens"].as_array().unwrap().len();
    let na = at["answer_tokens"].as_array().unwrap().len();
    assert_eq!(np, v["prompt_ids"].as_array().unwrap().len());
    assert_eq!(na, v["generated"].as_array().unwrap().len());
    let m = at["matrix"].as_array().unwrap();
    assert_eq!(m.len(), np + na);
    for (i, row) in m.iter().enumerate() {
        let row = row.as_array().unwrap();
        assert_eq!(row.len(), na);
        for (j, c) in row.iter().enumerate() {
            assert_eq!(c.is_null(), i >= np + j, "cell ({i}, {j}) = {c}");
        }
    }
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.contains("\"attribution\"") && !html.contains("/*ATTNSCOPE_DATA*/"));
    assert!(
        !html.contains("http://") && !html.contains("https://"),
        "no network"
    );
    // the terminal matrix without colour
    let out = common::succeeds(
        common::attnscope()
            .args([
                "generate",
                "-m",
                p,
                "--text",
                "hello",
                "--max-new-tokens",
                "3",
                "--attribute",
                "grad-x-input",
            ])
            .env("NO_COLOR", "1"),
    );
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.contains("why each answer token")
            && (s.contains(" +9") || s.contains(" -9"))
            && !s.contains("\x1b["),
        "{s}"
    );
    for bad in [
        &["--html", "x.html"][..],
        &["--attribute", "bogus"],
        &["--attribute", "integrated-gradients", "--steps", "0"],
        &["--attribute", "occlusion", "--html", page.to_str().unwrap()],
    ] {
        let mut args = vec!["generate", "-m", p, "--text", "hello"];
        args.extend_from_slice(bad);
        let out = cli(&args);
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
    }
}

/// `generate --attribute` on SmolLM2 against transformers + torch autograd
/// (`tests/golden/smol_gen_attribution.json`, `make_gen_attribution_golden.py`): the chat prompt,
/// the greedy answer, each answer token's teacher-forced log-probability, and every cell of the
/// gradient, grad × input, integrated gradients (8 steps) and occlusion (deletion) matrices.
#[test]
fn smol_generation_attribution_equals_transformers_and_autograd() {
    use attnscope::analysis::gen_attribute::attribute_generation;
    use attnscope::analysis::vocab::Method;
    let model = common::real_model("smollm2-135m");
    let g = common::golden_json("smol_gen_attribution.json");
    let ids = |k: &str| -> Vec<u32> {
        g[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let (prompt, answer) = (ids("prompt_ids"), ids("answer_ids"));
    assert_eq!(
        model
            .chat_ids(g["question"].as_str().unwrap(), None)
            .unwrap(),
        prompt,
        "the chat prompt"
    );
    let o = GenOptions {
        max_new_tokens: answer.len(),
        ..Default::default()
    };
    let gen: Vec<u32> = model
        .generate(&prompt, &o, |_| {})
        .unwrap()
        .generated
        .iter()
        .map(|t| t.id)
        .collect();
    assert_eq!(gen, answer, "the greedy answer");
    let p = prompt.len();
    let steps = g["ig_steps"].as_u64().unwrap() as usize;
    for (method, key) in [
        (Method::Gradient, "l2"),
        (Method::GradXInput, "gxi"),
        (Method::IntegratedGradients, "ig"),
        (Method::Occlusion, "occlusion"),
    ] {
        let m =
            attribute_generation(model, &prompt, &answer, method, steps, &mut |_, _| {}).unwrap();
        common::assert_cells(
            &format!("smol {key}: log p [answer token]"),
            m.logprobs
                .iter()
                .enumerate()
                .map(|(j, &x)| (vec![j], x as f64)),
            common::json_cells(&g["logprob"]),
            common::Bound::Abs(1e-4),
        );
        // the reference's columns are [answer token j][input position i < p + j]; the matrix is
        // [position][answer token], NaN where position i is not part of token j's input (so a
        // NaN inside the input is a missing cell, a number outside it an extra one)
        let want = common::json_cells(&g[key]);
        assert!(want.iter().all(|(at, _)| at[1] < p + at[0]), "{key} shape");
        let got = m.matrix.iter().enumerate().flat_map(|(i, row)| {
            row.iter()
                .enumerate()
                .filter(|(_, x)| !x.is_nan())
                .map(move |(j, &x)| (vec![j, i], x as f64))
        });
        common::assert_cells(
            &format!("smol {key} [answer token, position] vs transformers + autograd"),
            got,
            want,
            common::Bound::RelMax(1e-4),
        );
    }
}

/// `generate --json` of `alias` under `ATTNSCOPE_DECODE=way`: each generated token's id and
/// log-probability, and the sink profile of its row.
fn decoded(alias: &str, way: &str) -> Vec<(u64, f64, Vec<f64>)> {
    let out = assert_cmd::Command::cargo_bin("attnscope")
        .unwrap()
        .args(["generate", "-m", alias, "--max-new-tokens", "12", "--json"])
        .args([
            "-t",
            "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền",
        ])
        .env("ATTNSCOPE_DECODE", way)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{alias} {way}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["generated"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let sink = t["sink"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap());
            (
                t["id"].as_u64().unwrap(),
                t["logprob"].as_f64().unwrap(),
                sink.collect(),
            )
        })
        .collect()
}

/// A decode step multiplies from the file's blocks by default (`kernels/qmatvec.rs`: the same
/// products as the panels, summed in another order); `ATTNSCOPE_DECODE=panels` multiplies from
/// the packed panels. On the real models' block types (the default model's Q5_0, Q8_0, Q4_K,
/// Q6_K; SmolLM2's and Gemma 3's) both ways give the same greedy tokens, log-probabilities
/// within 1e-4 and sink shares within 1e-5. (The greedy tests above check the default way
/// against transformers.)
#[test]
fn decoding_from_the_blocks_equals_decoding_from_the_panels() {
    for alias in ["qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"] {
        let (blocks, panels) = (decoded(alias, "blocks"), decoded(alias, "panels"));
        assert_eq!(blocks.len(), 12, "{alias}");
        let ids = |v: &[(u64, f64, Vec<f64>)]| v.iter().map(|t| t.0).collect::<Vec<_>>();
        assert_eq!(ids(&blocks), ids(&panels), "{alias}: greedy tokens");
        for (i, (b, p)) in blocks.iter().zip(&panels).enumerate() {
            assert!(
                (b.1 - p.1).abs() <= 1e-4,
                "{alias} token {i}: log p {} vs {}",
                b.1,
                p.1
            );
            assert_eq!(b.2.len(), p.2.len());
            for (l, (x, y)) in b.2.iter().zip(&p.2).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-5,
                    "{alias} token {i} layer {l}: sink {x} vs {y}"
                );
            }
        }
    }
}
