# Qwen2.5-Coder-1.5B (the `qwen2.5-coder-1.5b` alias, GGUF Q4_K_M), the scale check of issue 43:
#  - layer 0's whole attention pattern from an independent float64 NumPy forward of the same
#    weights (gguf-py's dequantization, RMSNorm, q/k with their biases, RoPE, softmax, all in
#    float64), stored as float32 [heads, n, n] per text: the "true" numbers, which f32 arithmetic
#    misses at this layer (its scores reach ~12,700);
#  - transformers' eager float32 forward (weights dequantized from the same GGUF): the last query's
#    pattern of every layer and head [layers, heads, n] and its layer-0 pattern, the next-token top-5.
# Run with the venv of ../shared/bench/hf_anchor.py (torch, transformers, gguf):
#   python make_qwen15b_golden.py   (writes qwen15b.json and qwen15b_*.npy)
import json, os, numpy as np, torch
from gguf import GGUFReader, quants
from transformers import AutoModelForCausalLM, AutoTokenizer

path = os.path.expanduser("~/.cache/attnscope/models/qwen2.5-coder-1.5b.gguf")
TEXTS = [
    "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc.",
    "Attention is all you need, said the paper, and the field agreed for a while.",
    "The capital of France is Paris, and the capital of Germany is Berlin.",
]
r = GGUFReader(path)
T = {t.name: t for t in r.tensors}
def W(name):
    t = T[name]
    a = quants.dequantize(t.data, t.tensor_type).astype(np.float64)
    return a.reshape([int(x) for x in reversed(t.shape)]) if a.ndim == 1 and len(t.shape) > 1 else a
def kv(key):
    f = r.fields[key]; return f.parts[f.data[0]][0]
nh, nkv = int(kv("qwen2.attention.head_count")), int(kv("qwen2.attention.head_count_kv"))
eps, base = float(kv("qwen2.attention.layer_norm_rms_epsilon")), float(kv("qwen2.rope.freq_base"))
E, an = W("token_embd.weight"), W("blk.0.attn_norm.weight")
Wq, bq, Wk, bk = W("blk.0.attn_q.weight"), W("blk.0.attn_q.bias"), W("blk.0.attn_k.weight"), W("blk.0.attn_k.bias")

def layer0_f64(ids):
    n = len(ids); x = E[ids]; hd = x.shape[1] // nh
    h = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * an
    q = (h @ Wq.T + bq).reshape(n, nh, hd); k = (h @ Wk.T + bk).reshape(n, nkv, hd)
    inv = 1.0 / base ** (np.arange(0, hd, 2) / hd); ang = np.arange(n)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rope = lambda t: t * cos[:, None] + np.concatenate([-t[..., hd // 2:], t[..., :hd // 2]], -1) * sin[:, None]
    s = np.einsum("qhd,khd->hqk", rope(q), np.repeat(rope(k), nh // nkv, axis=1)) / np.sqrt(hd)
    s = np.where(np.triu(np.ones((n, n), bool), 1), -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True)); return p / p.sum(-1, keepdims=True)

d, f = os.path.split(path)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, attn_implementation="eager").eval()
here = os.path.dirname(os.path.abspath(__file__))
out = {"texts": [], "producer": "tests/golden/make_qwen15b_golden.py: float64 NumPy layer 0 (gguf-py dequantization) and transformers eager float32, from the qwen2.5-coder-1.5b GGUF"}
for t, text in enumerate(TEXTS):
    ids = tok(text)["input_ids"]
    p64 = layer0_f64(ids)
    with torch.no_grad():
        o = m(torch.tensor([ids]), output_attentions=True)
    last = np.stack([a[0, :, -1, :].numpy() for a in o.attentions]).astype(np.float32)
    hf0 = o.attentions[0][0].double().numpy()
    np.save(os.path.join(here, f"qwen15b_{t}_layer0_f64.npy"), p64.astype(np.float32))
    np.save(os.path.join(here, f"qwen15b_{t}_transformers_lastrow.npy"), last)
    top = torch.topk(o.logits[0, -1].double(), 5)
    out["texts"].append({"text": text, "token_ids": ids,
        "transformers_layer0_vs_f64": float(np.abs(hf0 - p64).max()),
        "next_token_top5": [{"id": int(i), "logit": round(float(v), 4)} for v, i in zip(top.values, top.indices)]})
    print(len(ids), "transformers layer 0 vs float64", out["texts"][-1]["transformers_layer0_vs_f64"])
json.dump(out, open(os.path.join(here, "qwen15b.json"), "w"), ensure_ascii=False, indent=1)
