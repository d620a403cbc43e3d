//! `attnscope info` and `attnscope fetch`.

use super::common::{emit, ModelArgs};
use attnscope::model::fetch::{alias, alias_names, alias_path, ensure, ALIASES};
use attnscope::render::table::{title, Align, Table};
use serde_json::json;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
pub struct FetchArgs {
    /// Aliases to fetch, or `all` (every alias but the optional large ones).
    #[arg(default_value = "qwen2.5-coder-0.5b")]
    aliases: Vec<String>,
}

pub fn fetch(a: FetchArgs) -> anyhow::Result<()> {
    let names: Vec<String> = if a.aliases.iter().any(|x| x == "all") {
        ALIASES
            .iter()
            .filter(|x| !x.optional)
            .map(|x| x.name.to_string())
            .collect()
    } else {
        a.aliases
    };
    for n in names {
        let al = alias(&n).ok_or_else(|| {
            super::common::usage(format!("unknown alias `{n}`; known: {}", alias_names()))
        })?;
        let p = ensure(al, true)?;
        emit(&format!("{}\t{}\n", al.name, p.display()))?;
    }
    Ok(())
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let m = match a.model.load() {
        Ok(m) => m,
        Err(e) => return too_big(&a, e),
    };
    if a.json {
        return emit(&format!(
            "{}\n",
            serde_json::to_string_pretty(&json_report(&m))?
        ));
    }
    let mut s = header(&m);
    s += &facts_table(&m).render();
    if let Some(rows) = memory_model(&m) {
        s += &memory_table(&rows);
    }
    emit(&s)
}

/// `info --json`: the model's description, shape, packed-weight cache and memory model.
fn json_report(m: &attnscope::model::Model) -> serde_json::Value {
    let d = &m.dims;
    let (mapped, projections) = m.mapped_projections();
    let k = attnscope::kernels::select::kernels();
    let kernels = json!({"exact": k.exact_name(), "fast": k.fast_name(), "gemm": k.gemm.name(), "forced": k.forced});
    json!({"model": m.info, "dims": d, "kind": model_kind(d), "group_size": d.group_size(), "gqa": d.gqa_sentence(), "kernels": kernels,
           "cached_alias_path": alias(&m.info.name).map(alias_path),
           "packed_weight_cache": m.panel_file().map(|p| json!({"path": p, "mapped_projections": mapped, "projections": projections})),
           "circuit_graph": circuit_graph(d).map(|(nodes, readers, edges)| json!({"nodes": nodes, "readers": readers, "edges": edges})),
           "memory_model": memory_model(m).map(|rows| memory_json(&rows))})
}

/// The memory model's rows as JSON.
fn memory_json(rows: &[(usize, u64, u64)]) -> Vec<serde_json::Value> {
    rows.iter()
        .map(|(n, low, fast)| json!({"tokens": n, "low_bytes": low, "fast_bytes": fast}))
        .collect()
}

/// `info` of a model whose loading failed: where the model is too big for this machine at the
/// setting a run would take (the refusal every command that runs it gives), its shape and
/// memory model from the file's tables, read without loading the weights; any other error as
/// it came.
fn too_big(a: &Args, e: anyhow::Error) -> anyhow::Result<()> {
    use attnscope::model::memory;
    let Ok(plan) = memory::plan(&a.model.model, false) else {
        return Err(e);
    };
    let avail = memory::available()?;
    let p = a.model.precision;
    let setting = memory::setting(&plan.footprint, p, a.model.memory, avail)?;
    let Err(refusal) = memory::check_fits(&plan.footprint, setting, p, avail) else {
        return Err(e);
    };
    let rows = memory_rows(&plan.footprint, p, plan.dims.context_len);
    if a.json {
        let doc = json!({"model": {"name": plan.name, "path": plan.path, "format": plan.format, "file_size": plan.file_size, "precision": p, "memory": setting},
                         "dims": plan.dims, "kind": model_kind(&plan.dims), "fits": false, "refusal": refusal.to_string(),
                         "memory_model": memory_json(&rows)});
        return emit(&format!("{}\n", serde_json::to_string_pretty(&doc)?));
    }
    let d = &plan.dims;
    let mut s = title(&format!("{} ({})", plan.name, plan.format));
    s += &format!(
        "file: {} ({:.1} MB)\nnot loaded: too big for this machine; commands that run it refuse it: {refusal}\n\n",
        plan.path.display(),
        plan.file_size as f64 / 1e6
    );
    let mut t = Table::new([("", Align::Left), ("", Align::Left)]);
    for (k, v) in [
        ("architecture", d.arch.name().to_string()),
        ("kind", model_kind(d)),
        ("layers", d.n_layers.to_string()),
        ("query heads", d.n_heads.to_string()),
        ("KV heads", d.n_kv_heads.to_string()),
        ("head dim", d.head_dim.to_string()),
        ("d_model", d.d_model.to_string()),
        ("MLP width", d.d_ff.to_string()),
        ("context length", d.context_len.to_string()),
        ("vocab size", d.vocab_size.to_string()),
    ] {
        t.row([k.to_string(), v]);
    }
    s += &t.render();
    s += &memory_table(&rows);
    emit(&s)
}

/// The memory model as `info` prints it.
fn memory_table(rows: &[(usize, u64, u64)]) -> String {
    let mut s =
        "\npeak memory of an `inspect` (the memory model: docs/precision.md#memory)\n".to_string();
    let mut mt = Table::new([
        ("tokens", Align::Right),
        ("--memory low", Align::Right),
        ("--memory fast", Align::Right),
    ]);
    for &(n, low, fast) in rows {
        mt.row([
            n.to_string(),
            format!("{:.2} GB", low as f64 / 1e9),
            format!("{:.2} GB", fast as f64 / 1e9),
        ]);
    }
    s += &mt.render();
    s
}

/// The title, the description, the file and the packed-weight cache it maps or wrote.
fn header(m: &attnscope::model::Model) -> String {
    let mut s = title(&format!("{} ({})", m.info.name, m.info.format));
    if let Some(desc) = &m.info.description {
        s += &format!("{desc}\n");
    }
    s += &format!(
        "file: {} ({:.1} MB)\n",
        m.info.path.display(),
        m.info.file_size as f64 / 1e6
    );
    if let Some(p) = m.panel_file() {
        let (mapped, all) = m.mapped_projections();
        let bytes = std::fs::metadata(p).map(|md| md.len()).unwrap_or(0) as f64 / 1e9;
        s += &if mapped > 0 {
            format!("packed weights: {mapped} of {all} projections mapped from {} ({bytes:.2} GB; delete it any time)\n", p.display())
        } else {
            format!(
                "packed weights: written to {} ({bytes:.2} GB) for the next load to map\n",
                p.display()
            )
        };
    }
    s += "\n";
    s
}

/// The model's facts: shape, positions, embeddings, types, tokenizer, precision and memory.
fn facts_table(m: &attnscope::model::Model) -> Table {
    let d = &m.dims;
    let mut t = Table::new([("", Align::Left), ("", Align::Left)]);
    let rope = match d.rope_style {
        attnscope::model::RopeStyle::Neox => "half-split pairs (i, i+d/2)",
        attnscope::model::RopeStyle::Interleaved => "interleaved pairs (2i, 2i+1)",
    };
    for (k, v) in [
        ("architecture", d.arch.name().to_string()),
        ("kind", model_kind(d)),
        ("layers", d.n_layers.to_string()),
        ("query heads", d.n_heads.to_string()),
        (
            "KV heads",
            format!("{} ({})", d.n_kv_heads, d.gqa_sentence()),
        ),
        ("GQA group size", d.group_size().to_string()),
        ("head dim", d.head_dim.to_string()),
        ("d_model", d.d_model.to_string()),
        ("MLP width", d.d_ff.to_string()),
        ("context length", d.context_len.to_string()),
        ("RoPE base", format!("{}", d.rope_base)),
        ("RoPE scaling", rope_scaling_line(d)),
        ("RoPE layout", rope.to_string()),
        ("attention span", attention_span(d)),
        ("RMSNorm eps", format!("{:e}", d.rms_eps)),
        ("vocab size", d.vocab_size.to_string()),
        ("embeddings", embeddings_line(d).to_string()),
        ("tensor types", tensor_types_line(m)),
        ("tokenizer", m.info.tokenizer.clone()),
        ("BOS", bos_line(m)),
        ("precision", precision_line(m)),
        ("kernels", attnscope::kernels::select::kernels().describe()),
    ] {
        t.row([k.to_string(), v]);
    }
    t.row(["memory".to_string(), memory_line(m)]);
    if let Some(c) = circuit_graph(d) {
        t.row([
            "circuit graph".to_string(),
            format!(
                "{} nodes (input, each head, each MLP), {} readers (each head's q, each KV head's k and v, each MLP, the logits), {} edges (`attnscope circuit`)",
                c.0,
                c.1,
                thousands(c.2)
            ),
        ]);
    }
    if let Some(g) = &d.gemma {
        t.row(["Gemma".to_string(), gemma_line(g)]);
    }
    t
}

/// The circuit graph's upstream nodes, readers and edges (`attnscope circuit`), for a decoder.
fn circuit_graph(d: &attnscope::model::ModelDims) -> Option<(usize, usize, usize)> {
    (!d.arch.is_encoder()).then(|| {
        let g = attnscope::analysis::circuit::graph::Graph::new(d);
        (g.n_nodes(), g.n_readers(), g.n_edges())
    })
}

/// `79813` as `79,813`.
fn thousands(v: usize) -> String {
    let s = v.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The RoPE scaling row: none, or Llama 3's factors.
fn rope_scaling_line(d: &attnscope::model::ModelDims) -> String {
    match &d.rope_scaling {
        attnscope::model::config::RopeScaling::Default => "none".to_string(),
        attnscope::model::config::RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_context,
        } => format!("llama3: factor {factor}, low/high frequency factors {low_freq_factor}/{high_freq_factor}, original context {original_context}"),
    }
}

/// The embeddings row: an encoder's sum of embeddings, or a decoder's tied or separate head.
fn embeddings_line(d: &attnscope::model::ModelDims) -> &'static str {
    if d.arch.is_encoder() {
        "word + learned position + token type, then LayerNorm; no output head"
    } else if d.tied_embeddings {
        "tied (output = input embedding)"
    } else {
        "separate output matrix"
    }
}

/// The tensor types row: each type with how many tensors have it.
fn tensor_types_line(m: &attnscope::model::Model) -> String {
    m.info
        .tensor_types
        .iter()
        .map(|(k, v)| format!("{k}×{v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The BOS row: which token is put first by default, and the flag that changes it.
fn bos_line(m: &attnscope::model::Model) -> String {
    match (m.tokenizer.add_bos, m.tokenizer.bos_id) {
        (true, Some(b)) => format!(
            "`{}` (id {b}) put first by default (--no-bos leaves it out)",
            m.tokenizer.token_text(b)
        ),
        (_, Some(b)) => format!(
            "none by default (--bos puts `{}`, id {b}, first)",
            m.tokenizer.token_text(b)
        ),
        (_, None) => "none (the model defines no BOS token)".to_string(),
    }
}

/// The precision row: which kernels run the projections and the attention.
fn precision_line(m: &attnscope::model::Model) -> String {
    match m.info.precision {
        attnscope::model::Precision::Fast => format!(
            "fast: projections {}, attention f32 ({} kernel)",
            attnscope::model::weights::fast_kernel()
                .map(str::to_string)
                .unwrap_or_else(|| format!(
                    "on the exact f32 kernels ({})",
                    attnscope::kernels::select::kernels().why_no_fast_kernel()
                )),
            attnscope::kernels::gemm::Isa::detect().name()
        ),
        attnscope::model::Precision::Exact => {
            let (scaled, all) = m.scaled_projections();
            if attnscope::kernels::amx::exact_on_tiles() {
                "exact: f32 throughout (bf16x3 on AMX tiles)".to_string()
            } else if scaled > 0 {
                format!(
                    "exact: every product exact, summed in f32; {scaled} of {all} projections on AMX tiles as the file's integers and scales, {} attention on the {} kernel",
                    if scaled == all { "the" } else { "the rest and the" },
                    attnscope::kernels::gemm::Isa::detect().name()
                )
            } else {
                format!(
                    "exact: f32 throughout ({} kernel)",
                    attnscope::kernels::gemm::Isa::detect().name()
                )
            }
        }
    }
}

/// Gemma's scalings and soft-caps.
fn gemma_line(g: &attnscope::model::config::GemmaSettings) -> String {
    format!(
        "embeddings × {:.4} (√d_model); scores × {:.5}{}{}",
        g.embed_scale,
        g.query_scale,
        g.attn_softcap
            .map(|c| format!("; scores soft-capped at {c}"))
            .unwrap_or_default(),
        g.final_softcap
            .map(|c| format!("; logits soft-capped at {c}"))
            .unwrap_or_default()
    )
}

/// The memory setting, how many projections it multiplies from the file's blocks, and why.
fn memory_line(m: &attnscope::model::Model) -> String {
    let (low, all) = m.low_projections();
    let what = match m.info.memory {
        attnscope::model::Memory::Low if low == all => {
            "low: every projection multiplied from the file's quantized blocks (mapped), a panel dequantized just before each product".to_string()
        }
        attnscope::model::Memory::Low => format!(
            "low: {low} of {all} projections from the file's blocks; the rest (floats or a type low does not read) packed as f32 panels"
        ),
        attnscope::model::Memory::Fast => "fast: projections packed at load".to_string(),
    };
    format!("{what} ({})", m.info.memory_reason)
}

/// `(tokens, low, fast)` peak bytes of an `inspect` at a few lengths up to the context.
fn memory_model(m: &attnscope::model::Model) -> Option<Vec<(usize, u64, u64)>> {
    let fp = m.info.footprint.as_ref()?;
    Some(memory_rows(fp, m.info.precision, m.dims.context_len))
}

/// `(tokens, low, fast)` peak bytes of an `inspect` of `fp` at 128, 512, ... tokens up to
/// `context` (at least the first row).
fn memory_rows(
    fp: &attnscope::model::memory::Footprint,
    p: attnscope::model::Precision,
    context: usize,
) -> Vec<(usize, u64, u64)> {
    [128, 512, 2048, 8192, 32768]
        .into_iter()
        .enumerate()
        .filter(|&(i, n)| i == 0 || n <= context)
        .map(|(_, n)| {
            (
                n,
                fp.need(attnscope::model::Memory::Low, p, n),
                fp.need(attnscope::model::Memory::Fast, p, n),
            )
        })
        .collect()
}

/// Which keys a query sees: every earlier one, or a window on some layers (and their RoPE base).
fn attention_span(d: &attnscope::model::ModelDims) -> String {
    let windowed = d.windowed_layers();
    match d.sliding_window {
        None if d.arch.is_encoder() => "every token, before and after it, every layer".to_string(),
        None => "every earlier token, every layer".to_string(),
        Some(w) if windowed.len() == d.n_layers => format!(
            "a sliding window of {w} tokens (itself and the {} before it), every layer",
            w - 1
        ),
        Some(w) => {
            let full: Vec<String> = (0..d.n_layers)
                .filter(|l| !windowed.contains(l))
                .map(|l| l.to_string())
                .collect();
            let bases = match &d.gemma {
                Some(g) if g.rope_base_sliding != d.rope_base => format!(
                    "; RoPE base {} on the windowed layers, {} on the full ones",
                    g.rope_base_sliding, d.rope_base
                ),
                _ => String::new(),
            };
            format!(
                "a sliding window of {w} tokens on {} of {} layers; layers {} see every earlier token{bases}",
                windowed.len(),
                d.n_layers,
                full.join(", ")
            )
        }
    }
}

/// "decoder (causal)" or "encoder (bidirectional)" and how an encoder differs.
fn model_kind(d: &attnscope::model::ModelDims) -> String {
    if d.arch.is_encoder() {
        format!(
            "encoder (bidirectional): every token attends to every other (no causal mask), post-LN blocks, {} token types (a pair with --pair, as the tokenizer builds it), no next-token prediction (generate and next-token targets are refused)",
            d.type_vocab
        )
    } else {
        "decoder (causal): each token attends to itself and the tokens before it, and the last one predicts the next".into()
    }
}
