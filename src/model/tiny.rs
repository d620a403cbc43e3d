//! Tiny seeded models (Qwen2 and Llama shapes) written as real files in both formats: a GGUF
//! file and a Hugging Face folder (config.json, model.safetensors or shards, tokenizer.json).
//! The tests load them through the same code as real checkpoints and compare with a
//! [`crate::reference::transformer`] forward on the same weights; no network needed.
//!
//! Llama weights are written to GGUF the way llama.cpp's converter writes them: Q and K rows
//! permuted so the interleaved RoPE applies; Qwen2 weights are not permuted.

use crate::reference::transformer::{RefConfig, RefLayer, RefModel};
use crate::reference::Rng;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use serde_json::json;
use std::collections::HashMap;
use std::path::Path;

use super::config::Arch;
use super::tokenize::byte_level_decode;

/// The vocabulary: the 256 byte-level characters, 4 merges, 2 special tokens.
pub fn tiny_vocab() -> (Vec<String>, Vec<String>, Vec<i32>) {
    let mut tokens: Vec<String> = (0u8..=255).map(|b| byte_char(b).to_string()).collect();
    let merges = vec!["Ġ t", "h e", "Ġt he", "a t"];
    for m in &merges {
        tokens.push(m.replace(' ', ""));
    }
    tokens.push("<|endoftext|>".into());
    tokens.push("<|im_start|>".into());
    let mut types = vec![1; tokens.len()];
    let n = types.len();
    types[n - 2] = 3;
    types[n - 1] = 3;
    (
        tokens,
        merges.into_iter().map(String::from).collect(),
        types,
    )
}

fn byte_char(b: u8) -> char {
    // the inverse of byte_level_decode for one byte
    (0..=0x17f_u32)
        .filter_map(char::from_u32)
        .find(|c| byte_level_decode(&c.to_string()).is_some_and(|v| v == [b]))
        .expect("every byte has a byte-level character")
}

/// A seeded tiny model: 2 layers, d_model 32, 4 query heads sharing 2 KV heads of 8 dims.
pub fn tiny_model(arch: Arch, seed: u64) -> RefModel {
    let (tokens, _, _) = tiny_vocab();
    let cfg = RefConfig {
        n_layers: 2,
        d_model: 32,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
        d_ff: 64,
        vocab: tokens.len(),
        rope_base: 10000.0,
        rms_eps: 1e-6,
    };
    let mut rng = Rng::new(seed);
    let (dm, q, kv, ff) = (
        cfg.d_model,
        cfg.n_heads * cfg.head_dim,
        cfg.n_kv_heads * cfg.head_dim,
        cfg.d_ff,
    );
    let norm = |rng: &mut Rng| -> Vec<f32> { (0..dm).map(|_| 1.0 + 0.1 * rng.normal()).collect() };
    let bias = arch == Arch::Qwen2;
    let layers = (0..cfg.n_layers)
        .map(|_| RefLayer {
            attn_norm: norm(&mut rng),
            w_q: rng.normals(q * dm, 0.5),
            b_q: bias.then(|| rng.normals(q, 0.3)),
            w_k: rng.normals(kv * dm, 0.5),
            b_k: bias.then(|| rng.normals(kv, 0.3)),
            w_v: rng.normals(kv * dm, 0.3),
            b_v: bias.then(|| rng.normals(kv, 0.1)),
            w_o: rng.normals(dm * q, 0.2),
            mlp_norm: norm(&mut rng),
            w_gate: rng.normals(ff * dm, 0.2),
            w_up: rng.normals(ff * dm, 0.2),
            w_down: rng.normals(dm * ff, 0.2),
        })
        .collect();
    let embed = rng.normals(cfg.vocab * dm, 1.0);
    let final_norm = norm(&mut rng);
    let lm_head = (arch == Arch::Qwen2).then(|| rng.normals(cfg.vocab * dm, 0.3));
    RefModel {
        cfg,
        embed,
        layers,
        final_norm,
        lm_head,
    }
}

/// llama.cpp's Q/K permutation (convert_hf_to_gguf.py `permute`): within each head, HF's
/// half-split rows `(i, i + d/2)` become interleaved rows `(2i, 2i + 1)`.
pub fn permute_for_gguf(w: &[f32], n_heads: usize, head_dim: usize, cols: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0.0; w.len()];
    for h in 0..n_heads {
        for i in 0..half {
            for (src_i, dst_i) in [(i, 2 * i), (i + half, 2 * i + 1)] {
                let src = (h * head_dim + src_i) * cols;
                let dst = (h * head_dim + dst_i) * cols;
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    out
}

fn qt(data: &[f32], dims: &[usize], dtype: GgmlDType) -> candle_core::Result<QTensor> {
    let t = Tensor::from_vec(data.to_vec(), dims, &Device::Cpu)?;
    // norms and biases stay f32, as in real files
    let dtype = if dims.len() == 1 {
        GgmlDType::F32
    } else {
        dtype
    };
    QTensor::quantize(&t, dtype)
}

/// Writes `m` as a GGUF file; `dtype` for the matrices (F32 for exact comparisons).
pub fn write_gguf(
    m: &RefModel,
    arch: Arch,
    dtype: GgmlDType,
    path: &Path,
) -> candle_core::Result<()> {
    write_gguf_with(m, arch, dtype, path, &|_, _| {})
}

/// An edit of a GGUF file's metadata and tensor list before it is written.
pub type GgufEdit<'a> = &'a dyn Fn(&mut Vec<(String, Value)>, &mut Vec<(String, QTensor)>);

/// [`write_gguf`] with a hook that may edit the metadata and tensor list before writing (the
/// tests use it to make broken files: a missing tensor, an unknown pre-tokenizer, ...).
pub fn write_gguf_with(
    m: &RefModel,
    arch: Arch,
    dtype: GgmlDType,
    path: &Path,
    edit: GgufEdit<'_>,
) -> candle_core::Result<()> {
    let mut tensors = gguf_tensors(m, arch, dtype)?;
    let mut md = gguf_metadata(m, arch);
    edit(&mut md, &mut tensors);
    let mut f = std::fs::File::create(path)?;
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut f, &md_refs, &t_refs)
}

/// The tensors of `m` as llama.cpp names and lays them out (a llama file's q/k rows
/// interleaved per head), in `dtype`.
fn gguf_tensors(
    m: &RefModel,
    arch: Arch,
    dtype: GgmlDType,
) -> candle_core::Result<Vec<(String, QTensor)>> {
    let c = &m.cfg;
    let (dm, q, kv, ff) = (
        c.d_model,
        c.n_heads * c.head_dim,
        c.n_kv_heads * c.head_dim,
        c.d_ff,
    );
    let perm = |w: &[f32], heads: usize| {
        if arch == Arch::Llama {
            permute_for_gguf(w, heads, c.head_dim, dm)
        } else {
            w.to_vec()
        }
    };
    let perm_b = |b: &[f32], heads: usize| {
        if arch == Arch::Llama {
            permute_for_gguf(b, heads, c.head_dim, 1)
        } else {
            b.to_vec()
        }
    };
    let mut tensors: Vec<(String, QTensor)> = vec![
        (
            "token_embd.weight".into(),
            qt(&m.embed, &[c.vocab, dm], dtype)?,
        ),
        (
            "output_norm.weight".into(),
            qt(&m.final_norm, &[dm], dtype)?,
        ),
    ];
    if let Some(h) = &m.lm_head {
        tensors.push(("output.weight".into(), qt(h, &[c.vocab, dm], dtype)?));
    }
    for (i, l) in m.layers.iter().enumerate() {
        let p = |s: &str| format!("blk.{i}.{s}");
        tensors.push((p("attn_norm.weight"), qt(&l.attn_norm, &[dm], dtype)?));
        tensors.push((
            p("attn_q.weight"),
            qt(&perm(&l.w_q, c.n_heads), &[q, dm], dtype)?,
        ));
        tensors.push((
            p("attn_k.weight"),
            qt(&perm(&l.w_k, c.n_kv_heads), &[kv, dm], dtype)?,
        ));
        tensors.push((p("attn_v.weight"), qt(&l.w_v, &[kv, dm], dtype)?));
        if let (Some(bq), Some(bk), Some(bv)) = (&l.b_q, &l.b_k, &l.b_v) {
            tensors.push((p("attn_q.bias"), qt(&perm_b(bq, c.n_heads), &[q], dtype)?));
            tensors.push((
                p("attn_k.bias"),
                qt(&perm_b(bk, c.n_kv_heads), &[kv], dtype)?,
            ));
            tensors.push((p("attn_v.bias"), qt(bv, &[kv], dtype)?));
        }
        tensors.push((p("attn_output.weight"), qt(&l.w_o, &[dm, q], dtype)?));
        tensors.push((p("ffn_norm.weight"), qt(&l.mlp_norm, &[dm], dtype)?));
        tensors.push((p("ffn_gate.weight"), qt(&l.w_gate, &[ff, dm], dtype)?));
        tensors.push((p("ffn_up.weight"), qt(&l.w_up, &[ff, dm], dtype)?));
        tensors.push((p("ffn_down.weight"), qt(&l.w_down, &[dm, ff], dtype)?));
    }
    Ok(tensors)
}

/// The metadata of `m` as a GGUF file of `arch` has it: the shapes, RoPE and norm settings,
/// and the tiny byte-level BPE vocabulary ([`tiny_vocab`]).
fn gguf_metadata(m: &RefModel, arch: Arch) -> Vec<(String, Value)> {
    let c = &m.cfg;
    let a = arch.name();
    let (tokens, merges, types) = tiny_vocab();
    let u32v = |x: usize| Value::U32(x as u32);
    vec![
        ("general.architecture".into(), Value::String(a.into())),
        ("general.name".into(), Value::String(format!("tiny-{a}"))),
        (format!("{a}.block_count"), u32v(c.n_layers)),
        (format!("{a}.context_length"), u32v(256)),
        (format!("{a}.embedding_length"), u32v(c.d_model)),
        (format!("{a}.feed_forward_length"), u32v(c.d_ff)),
        (format!("{a}.attention.head_count"), u32v(c.n_heads)),
        (format!("{a}.attention.head_count_kv"), u32v(c.n_kv_heads)),
        (format!("{a}.rope.freq_base"), Value::F32(c.rope_base)),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(c.rms_eps),
        ),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        (
            "tokenizer.ggml.pre".into(),
            Value::String(
                if arch == Arch::Qwen2 {
                    "qwen2"
                } else {
                    "smollm"
                }
                .into(),
            ),
        ),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.iter().map(|t| Value::String(t.clone())).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.iter().map(|&t| Value::I32(t)).collect()),
        ),
        (
            "tokenizer.ggml.merges".into(),
            Value::Array(merges.iter().map(|t| Value::String(t.clone())).collect()),
        ),
        ("tokenizer.ggml.bos_token_id".into(), u32v(tokens.len() - 2)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
    ]
}

/// A tiny SentencePiece vocabulary as GGUF metadata (`tokenizer.ggml.model = llama`): control
/// tokens `<pad> <eos> <bos> <unk>`, the 256 byte-fallback tokens `<0xNN>`, single letters, `▁`,
/// a token of two real spaces (as Gemma files store it), a user-defined `\t`, and merged pieces
/// whose scores (and order) rank them: `▁t`, `he`, `▁the`, `▁a`, `at`, `▁hat`. For
/// `general.architecture` = `arch` (gemma3 ranks by order, others by score).
pub fn tiny_sentencepiece_md(arch: &str, add_space_prefix: bool) -> Vec<(String, Value)> {
    let mut tokens: Vec<String> = ["<pad>", "<eos>", "<bos>", "<unk>"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut types = vec![3i32; 4];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    for t in ["▁", "  ", "\t"] {
        tokens.push(t.to_string());
        types.push(if t == "▁" { 1 } else { 4 });
    }
    for c in 'a'..='z' {
        tokens.push(c.to_string());
        types.push(1);
    }
    for t in ["▁t", "he", "▁the", "▁a", "at", "▁h", "▁hat"] {
        tokens.push(t.to_string());
        types.push(1);
    }
    // scores: the merged pieces best first, in the order above; single characters below them
    let scores: Vec<f32> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if t.chars().count() > 1 && !t.starts_with('<') && t.trim() == t {
                -(i as f32) / 1000.0
            } else {
                -1000.0
            }
        })
        .collect();
    vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("tokenizer.ggml.model".into(), Value::String("llama".into())),
        ("tokenizer.ggml.pre".into(), Value::String("default".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        ),
        (
            "tokenizer.ggml.scores".into(),
            Value::Array(scores.into_iter().map(Value::F32).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(2)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(true)),
        (
            "tokenizer.ggml.add_space_prefix".into(),
            Value::Bool(add_space_prefix),
        ),
    ]
}

/// The tokenizer.json of the tiny vocabulary (byte-level BPE, GPT-2 split).
pub fn tiny_tokenizer_json() -> serde_json::Value {
    let (tokens, merges, types) = tiny_vocab();
    let vocab: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<_> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| types[*i] == 3)
        .map(|(i, t)| json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges}
    })
}

/// Writes `m` as a Hugging Face folder; `shards > 1` splits the weights over several files
/// with a `model.safetensors.index.json`.
pub fn write_hf_folder(
    m: &RefModel,
    arch: Arch,
    dir: &Path,
    shards: usize,
) -> candle_core::Result<()> {
    std::fs::create_dir_all(dir)?;
    let c = &m.cfg;
    let config = json!({
        "model_type": arch.name(), "hidden_size": c.d_model, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "intermediate_size": c.d_ff,
        "vocab_size": c.vocab, "max_position_embeddings": 256, "rope_theta": c.rope_base, "rms_norm_eps": c.rms_eps,
        "tie_word_embeddings": m.lm_head.is_none(), "bos_token_id": c.vocab - 2,
    });
    std::fs::write(dir.join("config.json"), config.to_string())?;
    std::fs::write(
        dir.join("tokenizer.json"),
        tiny_tokenizer_json().to_string(),
    )?;
    let t = |data: &[f32], dims: &[usize]| Tensor::from_vec(data.to_vec(), dims, &Device::Cpu);
    let (dm, q, kv, ff) = (
        c.d_model,
        c.n_heads * c.head_dim,
        c.n_kv_heads * c.head_dim,
        c.d_ff,
    );
    let mut all: Vec<(String, Tensor)> = vec![
        (
            "model.embed_tokens.weight".into(),
            t(&m.embed, &[c.vocab, dm])?,
        ),
        ("model.norm.weight".into(), t(&m.final_norm, &[dm])?),
    ];
    if let Some(h) = &m.lm_head {
        all.push(("lm_head.weight".into(), t(h, &[c.vocab, dm])?));
    }
    for (i, l) in m.layers.iter().enumerate() {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        all.push((p("input_layernorm.weight"), t(&l.attn_norm, &[dm])?));
        all.push((p("self_attn.q_proj.weight"), t(&l.w_q, &[q, dm])?));
        all.push((p("self_attn.k_proj.weight"), t(&l.w_k, &[kv, dm])?));
        all.push((p("self_attn.v_proj.weight"), t(&l.w_v, &[kv, dm])?));
        if let (Some(bq), Some(bk), Some(bv)) = (&l.b_q, &l.b_k, &l.b_v) {
            all.push((p("self_attn.q_proj.bias"), t(bq, &[q])?));
            all.push((p("self_attn.k_proj.bias"), t(bk, &[kv])?));
            all.push((p("self_attn.v_proj.bias"), t(bv, &[kv])?));
        }
        all.push((p("self_attn.o_proj.weight"), t(&l.w_o, &[dm, q])?));
        all.push((p("post_attention_layernorm.weight"), t(&l.mlp_norm, &[dm])?));
        all.push((p("mlp.gate_proj.weight"), t(&l.w_gate, &[ff, dm])?));
        all.push((p("mlp.up_proj.weight"), t(&l.w_up, &[ff, dm])?));
        all.push((p("mlp.down_proj.weight"), t(&l.w_down, &[dm, ff])?));
    }
    if shards <= 1 {
        let map: HashMap<String, Tensor> = all.into_iter().collect();
        return candle_core::safetensors::save(&map, dir.join("model.safetensors"));
    }
    let per = all.len().div_ceil(shards);
    let mut weight_map = serde_json::Map::new();
    for (s, chunk) in all.chunks(per).enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", s + 1, shards);
        for (name, _) in chunk {
            weight_map.insert(name.clone(), json!(file));
        }
        let map: HashMap<String, Tensor> = chunk.iter().cloned().collect();
        candle_core::safetensors::save(&map, dir.join(&file))?;
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        json!({"metadata": {}, "weight_map": weight_map}).to_string(),
    )?;
    Ok(())
}

/// Quantizes rows of `cols` values (`cols` whole blocks of `ty`, IQ4_NL or IQ4_XS) the simple
/// way (each block's scale from its largest weight, each weight the nearest of
/// [`super::weights::KVALUES_IQ4`]): the blocks' bytes, and the values they dequantize to
/// (`d · k`, IQ4_XS's sub-block scale `d · (ls − 32)` rounded to f32 first, as ggml computes
/// them).
pub fn quantize_iq4(x: &[f32], ty: super::weights::BlockType) -> (Vec<u8>, Vec<f32>) {
    use super::weights::{BlockType, KVALUES_IQ4 as K};
    let nearest = |v: f32| -> u8 {
        (0..16)
            .min_by(|&a, &b| (K[a] as f32 - v).abs().total_cmp(&(K[b] as f32 - v).abs()))
            .unwrap() as u8
    };
    // the signed value of largest magnitude
    let peak = |g: &[f32]| {
        g.iter()
            .copied()
            .fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m })
    };
    // one group of 32 with scale `dl`: its 16 bytes of nibbles, and its values
    let group = |g: &[f32], dl: f32, bytes: &mut Vec<u8>, vals: &mut Vec<f32>| {
        let q: Vec<u8> = g
            .iter()
            .map(|&v| if dl == 0.0 { 8 } else { nearest(v / dl) })
            .collect();
        bytes.extend((0..16).map(|j| q[j] | (q[j + 16] << 4)));
        vals.extend(q.iter().map(|&i| dl * K[i as usize] as f32));
    };
    let (mut bytes, mut vals) = (Vec::new(), Vec::with_capacity(x.len()));
    match ty {
        BlockType::Iq4Nl => {
            assert!(x.len().is_multiple_of(32), "whole blocks of 32");
            for g in x.chunks_exact(32) {
                let d = half::f16::from_f32(peak(g) / K[0] as f32);
                bytes.extend(d.to_le_bytes());
                group(g, d.to_f32(), &mut bytes, &mut vals);
            }
        }
        BlockType::Iq4Xs => {
            assert!(x.len().is_multiple_of(256), "whole blocks of 256");
            for sb in x.chunks_exact(256) {
                let scales: Vec<f32> = sb.chunks_exact(32).map(|g| peak(g) / K[0] as f32).collect();
                let amax = scales.iter().fold(0f32, |m, s| m.max(s.abs()));
                let d = half::f16::from_f32(amax / 31.0);
                let dd = d.to_f32();
                let ls: Vec<i32> = scales
                    .iter()
                    .map(|&s| {
                        let r = if dd == 0.0 {
                            0
                        } else {
                            (s / dd).round() as i32
                        };
                        r.clamp(-32, 31) + 32
                    })
                    .collect();
                let mut sh = 0u16;
                let mut sl = [0u8; 4];
                for (j, &l) in ls.iter().enumerate() {
                    sh |= (((l >> 4) & 3) as u16) << (2 * j);
                    sl[j / 2] |= ((l & 0x0f) as u8) << (4 * (j % 2));
                }
                bytes.extend(d.to_le_bytes());
                bytes.extend(sh.to_le_bytes());
                bytes.extend(sl);
                for (g, &l) in sb.chunks_exact(32).zip(&ls) {
                    group(g, dd * (l - 32) as f32, &mut bytes, &mut vals);
                }
            }
        }
        BlockType::Ggml(d) => panic!("quantize_iq4 writes IQ4_NL or IQ4_XS, not {d:?}"),
    }
    (bytes, vals)
}

/// Writes `m` as a GGUF file whose matrices (embeddings, projections, output head) are all
/// IQ4_NL or IQ4_XS blocks (norms and biases f32), and returns the model with the weights the
/// file holds ([`quantize_iq4`]'s values), for a reference forward. candle cannot write these
/// types: each matrix goes in as f16 values of the blocks' bytes, then the header's type id and
/// row length are set to the real ones (same byte counts, so nothing moves).
pub fn write_gguf_iq4(
    m: &RefModel,
    arch: Arch,
    ty: super::weights::BlockType,
    path: &Path,
) -> candle_core::Result<RefModel> {
    let (id, bs, ts): (u32, usize, usize) = match ty {
        super::weights::BlockType::Iq4Nl => (20, 32, 18),
        super::weights::BlockType::Iq4Xs => (23, 256, 136),
        super::weights::BlockType::Ggml(d) => {
            candle_core::bail!("write_gguf_iq4 writes IQ4_NL or IQ4_XS, not {d:?}")
        }
    };
    let round = |w: &[f32]| quantize_iq4(w, ty).1;
    let mut held = m.clone();
    held.embed = round(&m.embed);
    held.lm_head = m.lm_head.as_deref().map(round);
    for l in &mut held.layers {
        for w in [
            &mut l.w_q,
            &mut l.w_k,
            &mut l.w_v,
            &mut l.w_o,
            &mut l.w_gate,
            &mut l.w_up,
            &mut l.w_down,
        ] {
            *w = round(w);
        }
    }
    let changed = std::cell::RefCell::new(Vec::new());
    let edit = |_: &mut Vec<(String, Value)>, tensors: &mut Vec<(String, QTensor)>| {
        for (name, t) in tensors.iter_mut() {
            let dims = t.shape().dims().to_vec();
            let [rows, cols] = dims[..] else { continue };
            let vals: Vec<f32> = t
                .dequantize(&Device::Cpu)
                .and_then(|x| x.flatten_all())
                .and_then(|x| x.to_vec1())
                .expect("an f32 matrix");
            let (bytes, _) = quantize_iq4(&vals, ty);
            let storage = candle_core::quantized::QStorage::from_data(
                std::borrow::Cow::Owned(bytes),
                &Device::Cpu,
                GgmlDType::F16,
            )
            .expect("f16 storage");
            *t = QTensor::new(storage, (rows, cols / bs * ts / 2)).expect("f16 tensor");
            changed.borrow_mut().push((name.clone(), cols));
        }
    };
    write_gguf_with(m, arch, GgmlDType::F32, path, &edit)?;
    let mut file = std::fs::read(path)?;
    for (name, cols) in changed.into_inner() {
        // the tensor info: u64 name length, name, u32 n_dims = 2, u64 ne0, u64 ne1, u32 type
        let mut key = (name.len() as u64).to_le_bytes().to_vec();
        key.extend(name.as_bytes());
        key.extend(2u32.to_le_bytes());
        let at = file
            .windows(key.len())
            .position(|w| w == key)
            .expect("the tensor's info")
            + key.len();
        file[at..at + 8].copy_from_slice(&(cols as u64).to_le_bytes());
        file[at + 16..at + 20].copy_from_slice(&id.to_le_bytes());
    }
    std::fs::write(path, file)?;
    Ok(held)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_permutation_interleaves_each_head() {
        // one head of dim 4, one column: rows [a0, a1, b0, b1] (pairs (0,2), (1,3)) → [a0, b0, a1, b1]
        assert_eq!(
            permute_for_gguf(&[0.0, 1.0, 2.0, 3.0], 1, 4, 1),
            vec![0.0, 2.0, 1.0, 3.0]
        );
    }

    #[test]
    fn tiny_vocab_has_every_byte() {
        let (tokens, _, types) = tiny_vocab();
        assert_eq!(tokens.len(), 262);
        assert_eq!(tokens[b'a' as usize], "a");
        assert_eq!(tokens[b' ' as usize], "Ġ");
        assert_eq!(types[261], 3);
    }
}
