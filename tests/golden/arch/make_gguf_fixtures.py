#!/usr/bin/env python
"""GGUF files of the tiny decoder fixtures, written by an independent writer (issue #55).

The Hugging Face folders `tests/golden/arch/<name>/` (see make_arch_fixtures.py) are turned into
`tests/golden/arch/gguf/<name>.gguf` (float32) the way llama.cpp's `convert_hf_to_gguf.py` does:
gguf-py's `GGUFWriter` writes the file, gguf-py's `TensorNameMap` gives every tensor its GGUF name
(`gguf.get_tensor_name_map(arch, n_layers)`, what the converter's `map_tensor_name` uses), gguf-py's
`SpecialVocab` reads the BOS/EOS ids and merges from the folder, and the metadata is what the
converter's `TextModel.set_gguf_parameters` and the family's own class write. Nothing here is
attnscope's: `tests/arch_fixtures.rs` loads these files and checks them against transformers'
attention (`attn_*.npy` beside each folder's weights).

The converter's per-family steps, as in its classes (llama.cpp master, 2026):
- llama (`LlamaModel`): q_proj and k_proj rows permuted per head from Hugging Face's halves to
  llama.cpp's interleaved pairs (`LlamaModel.permute`); `rope_freqs.weight` from the Llama 3 rope
  parameters (`generate_extra_tensors`; its original context is read from `rope_parameters`, where
  transformers 5 keeps it, before the top level the converter reads); `rope.dimension_count` =
  head_dim; `vocab_size`.
- qwen3 (`Qwen3Model` <- `Qwen2Model`): no permutation (NEOX rope); q_norm/k_norm as attn_q_norm /
  attn_k_norm.
- gemma2 (`Gemma2Model`): every `*norm.weight` + 1 (Gemma's RMSNorm scales by 1 + w); its own key
  list (no rope base: llama.cpp's default 10000), soft-caps, `attention.sliding_window`; lm_head
  skipped (tied).
- gemma3 (`Gemma3Model`): the base keys, then its own; every `*norm.weight` + 1, q/k norms
  included; `attention.sliding_window` (the config has no `sliding_window_pattern` = 1).
- phi3 (`Phi3MiniModel`): fused qkv_proj and gate_up_proj kept fused (attn_qkv, ffn_up);
  `rope.dimension_count` = int(partial_rotary_factor * hidden) // heads;
  `rope.scaling.original_context_length`; `attention.sliding_window` 0 where the config has none.
- gpt2 (`GPT2Model`): Conv1D weights (`c_attn`, `c_proj`, `c_fc`, stored [in, out]) transposed;
  its own key list (feed-forward 4 * n_embd, `n_ctx`, here `n_positions`); no output tensor (tied).
- seed_oss (`SeedOssModel`, #57): the base keys, no permutation (NEOX rope), q/k/v biases as
  `attn_q.bias`..., and the MLP's norm (`post_attention_layernorm`) as `post_attention_norm`
  (gguf-py's tensor list for the arch has no `ffn_norm`).

Where the fixtures differ from what the converter expects, and what is written instead:
- The vocabulary: the fixtures' tokenizer.json is a byte-level BPE without merges (token id = byte),
  which the converter's pre-tokenizer hash does not know (it raises). It is written as the
  converter's `_set_vocab_gpt2` writes a known one: model `gpt2`, the tokens in id order padded to
  vocab_size with `[PAD<i>]` (type UNUSED), `<|endoftext|>` CONTROL, pre-tokenizer `gpt-2` (the
  fixtures' ByteLevel split with GPT-2's regex), and an empty merge list (`SpecialVocab` writes none
  for an empty list, and llama.cpp refuses a gpt2 vocabulary without the key). Gemma's converters
  read a SentencePiece `tokenizer.model`, which the fixtures do not have: they get the same
  byte-level vocabulary (Gemma 3's converter falls back to it; Gemma 2's has no fallback).
- gemma3: the converter drops embedding rows past the tokenizer's vocabulary (the real Gemma 3's
  out-of-vocabulary rows); here all 260 rows are kept, so the logits compare with transformers'.
- Keys llama.cpp reads but its converter does not write for these families, needed because the tiny
  configs are unlike the released models (llama.cpp derives them from the model size or fixes them):
  gemma2's `attention.scale` (query_pre_attn_scalar 24 is not head_dim 16) and gemma3's
  `attention.sliding_window_pattern` (layers 0-1 slide, layer 2 is full; llama.cpp fixes 1 in 6),
  both through gguf-py's own `add_attention_scale` / `add_sliding_window_pattern`.

Usage (the venv of ../shared/bench/hf_anchor.py with `pip install gguf`; gguf-py 0.19.0):
    ~/.hfenv/bin/python tests/golden/arch/make_gguf_fixtures.py [name ...]
"""
import json
import math
import sys
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

HERE = Path(__file__).resolve().parent
OUT = HERE / "gguf"
ARCH = {
    "llama3": gguf.MODEL_ARCH.LLAMA,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "gpt2": gguf.MODEL_ARCH.GPT2,
    "seed_oss": gguf.MODEL_ARCH.SEED_OSS,
}


def rope_parameters(cfg):
    """transformers 5's rope_parameters (the full-attention layers' for Gemma 3), else the older
    top-level keys, as the converter's `self.rope_parameters` reads them."""
    p = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0)}
    return p.get("full_attention", p)


def base_keys(w, cfg, n_layers):
    """The converter's TextModel.set_gguf_parameters for these configs."""
    w.add_block_count(n_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope_parameters(cfg)["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("head_dim") is not None:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])


def llama_keys(w, cfg, n_layers):
    """LlamaModel.set_gguf_parameters: the base keys, vocab_size, rope.dimension_count."""
    base_keys(w, cfg, n_layers)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def gemma2_keys(w, cfg, n_layers):
    """Gemma2Model.set_gguf_parameters (its own list: no rope base), plus attention.scale."""
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])
    # not written by the converter (llama.cpp takes 1/sqrt(head_dim) but for the 27B model)
    w.add_attention_scale(cfg["query_pre_attn_scalar"] ** -0.5)


def gemma3_keys(w, cfg, n_layers):
    """Gemma3Model.set_gguf_parameters, plus the per-layer sliding pattern."""
    base_keys(w, cfg, n_layers)
    assert cfg.get("attn_logit_softcapping") is None
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if cfg.get("sliding_window_pattern") != 1:
        w.add_sliding_window(cfg["sliding_window"])
    # not written by the converter (llama.cpp fixes every 6th layer full): one flag per layer
    w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])


def phi3_keys(w, cfg, n_layers):
    """Phi3MiniModel.set_gguf_parameters."""
    n_embd, n_head = cfg["hidden_size"], cfg["num_attention_heads"]
    rot_pct = rope_parameters(cfg).get("partial_rotary_factor", 1.0)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(n_layers)
    w.add_head_count(n_head)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(int(rot_pct * n_embd) // n_head)
    w.add_rope_freq_base(rope_parameters(cfg)["rope_theta"])
    # "use zero value of sliding_window to distinguish Phi-4 from other PHI3 models"
    w.add_sliding_window(cfg.get("sliding_window") or 0)


def gpt2_keys(w, cfg, n_layers):
    """GPT2Model.set_gguf_parameters (transformers 5 writes n_positions, not n_ctx)."""
    w.add_block_count(n_layers)
    w.add_context_length(cfg.get("n_ctx", cfg["n_positions"]))
    w.add_embedding_length(cfg["n_embd"])
    w.add_feed_forward_length(4 * cfg["n_embd"])
    w.add_head_count(cfg["n_head"])
    w.add_layer_norm_eps(cfg["layer_norm_epsilon"])


KEYS = {
    "llama3": llama_keys,
    "qwen3": base_keys,
    "gemma2": gemma2_keys,
    "gemma3": gemma3_keys,
    "phi3": phi3_keys,
    "gpt2": gpt2_keys,
    "seed_oss": base_keys,
}


def permute(w, n_head):
    """LlamaModel.permute: each head's rows from [first half; second half] to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg):
    """LlamaModel.generate_extra_tensors: llama.cpp's per-frequency divisors for Llama 3 rope."""
    p = rope_parameters(cfg)
    base, dim = p["rope_theta"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = p.get("factor", 8.0), p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    old = p.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def converted(name, cfg, hf):
    """(HF name, array) pairs after the converter's modify_tensors steps for the family."""
    for key, t in hf.items():
        if name == "llama3" and key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in key else cfg["num_key_value_heads"]
            t = permute(t, heads)
        if name in ("gemma2", "gemma3"):
            if key == "lm_head.weight":
                continue
            if key.endswith("norm.weight"):
                t = t + np.float32(1.0)
        if name == "gpt2":
            if key.endswith((".attn.bias", ".attn.masked_bias")):
                continue
            if key.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
                t = np.ascontiguousarray(t.T)
        yield key, t


def vocabulary(w, folder, cfg):
    """The converter's _set_vocab_gpt2 for the fixtures' byte-level BPE (see the module's doc)."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    reverse = {i: t for t, i in tok["model"]["vocab"].items()}
    added = {a["id"]: a for a in tok["added_tokens"]}
    tokens, types = [], []
    for i in range(cfg["vocab_size"]):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED)
        elif i in reverse:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True)
    assert not special.merges, "the fixtures' vocabulary has no merges"
    w.add_token_merges([])
    special.add_to_gguf(w, quiet=True)


def write(name):
    folder = HERE / name
    cfg = json.loads((folder / "config.json").read_text())
    n_layers = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    arch = ARCH[name]
    names = gguf.get_tensor_name_map(arch, n_layers)
    OUT.mkdir(exist_ok=True)
    path = OUT / f"{name}.gguf"
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(f"attnscope tiny {name} fixture")
    KEYS[name](w, cfg, n_layers)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocabulary(w, folder, cfg)
    hf = load_file(folder / "model.safetensors")
    for key, t in sorted(converted(name, cfg, hf)):
        gg = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if gg is None:
            raise SystemExit(f"{name}: gguf-py maps no GGUF name to {key}")
        w.add_tensor(gg, t.astype(np.float32))
    if name == "llama3" and rope_parameters(cfg).get("rope_type") == "llama3":
        w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", llama3_rope_factors(cfg))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{path.relative_to(HERE.parent.parent.parent)}: {path.stat().st_size} bytes, {len(hf)} tensors")


if __name__ == "__main__":
    for n in sys.argv[1:] or list(ARCH):
        write(n)
