"""Hugging Face transformers' q_proj and k_proj outputs (layer 3, float32, eager) of SmolLM2 and Qwen2.5
on one sentence, for the Python package's test that hook_q / hook_k and W_Q / W_K come in Hugging Face's
row order (llama GGUF files interleave each head's q/k rows; transformers' GGUF loader undoes it).

Run with the team's transformers venv: python make_qk_golden.py <folder with the .gguf files> qk_layer3.npz"""

import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TEXT = "The cat sat on the mat because it was tired"
LAYER = 3
folder, out = sys.argv[1], sys.argv[2]
arrays = {}
for prefix, gguf in (("smol", "smollm2-135m.gguf"), ("qwen", "qwen2.5-coder-0.5b.gguf")):
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    got = {}
    att = model.model.layers[LAYER].self_attn
    att.q_proj.register_forward_hook(lambda m, i, o: got.__setitem__("q", o))
    att.k_proj.register_forward_hook(lambda m, i, o: got.__setitem__("k", o))
    with torch.no_grad():
        model(torch.tensor([ids]))
    arrays[f"{prefix}_ids"] = np.asarray(ids, dtype=np.int64)
    arrays[f"{prefix}_q"] = got["q"][0].numpy().astype(np.float32)  # [n, n_heads·d_head]
    arrays[f"{prefix}_k"] = got["k"][0].numpy().astype(np.float32)  # [n, n_kv_heads·d_head]
np.savez_compressed(out, **arrays)
