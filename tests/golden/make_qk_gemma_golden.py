"""The QK split (issue #58) of Gemma 3 270M on transformers, in float64: the `qk` part of
../shared/reference/scripts/circuits_ref.py (which covers SmolLM2 and Qwen2.5) with what Gemma 3
adds, each nonlinear scale frozen at its value in the run:
- the embedding is scaled by sqrt(d_model) (`input` is embed_tokens' output, scale included);
- RMSNorms multiply by (1 + w);
- each block's attention output is normalized before the residual add (post_attention_layernorm):
  a head's part of the residual is (1 + w) * (z_h W_O^h) / rms(o_proj's output) at its position;
  the MLP's part (m{l}) is post_feedforward_layernorm's output as it is;
- queries and keys go through a per-head RMSNorm before RoPE (q_norm, k_norm): each part is
  multiplied by (1 + w) / rms(the whole q or k of the head at that position);
- the scores are scaled by query_pre_attn_scalar^-1/2; sliding layers rotate with their own base
  and see the last sliding_window keys.
For 3 (layer, head, query) cases on the IOI-style clean text (<bos> first, as Gemma's tokenizer
adds it): every key's score, transformers' attention probabilities of the row (checked against the
split's softmax), the top key's score split into its 50 largest (query side x key side) terms and
the terms' sum. Components: input, a{L}.h{H}, m{L}, bias (Gemma has no q/k bias: its terms are 0).

Run: python make_qk_gemma_golden.py <folder with gemma-3-270m-q4_k_m.gguf> gemma_qk.json
(the team's transformers venv, ~/.hfenv)."""
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

folder, out_path = sys.argv[1], sys.argv[2]
gguf = "gemma-3-270m-q4_k_m.gguf"
torch.set_num_threads(2)
tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32,
                                             attn_implementation="eager").eval()
cfg = model.config
L, H, KV, D = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
G = H // KV
layers = model.model.layers
eps = cfg.rms_norm_eps
clean = "After Alice and Bob walked to the park, Bob handed a ball to"
ids = tok(clean)["input_ids"]
n = len(ids)
assert ids[0] == tok.bos_token_id, ids

z, attn_pre, mlp_out = {}, {}, {}
hooks = []
for l in range(L):
    at = layers[l].self_attn
    hooks.append(at.o_proj.register_forward_pre_hook(
        lambda m, a, l=l: z.__setitem__(l, a[0][0].detach().double())))
    hooks.append(at.o_proj.register_forward_hook(
        lambda m, a, o, l=l: attn_pre.__setitem__(l, o[0].detach().double())))
    hooks.append(layers[l].post_feedforward_layernorm.register_forward_hook(
        lambda m, a, o, l=l: mlp_out.__setitem__(l, o[0].detach().double())))
with torch.no_grad():
    out = model(torch.tensor([ids]), use_cache=False, output_attentions=True,
                output_hidden_states=True)
for h_ in hooks:
    h_.remove()


def gain(norm):
    return 1.0 + norm.weight.detach().double()


def rms(x):
    return torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


comp = {"input": out.hidden_states[0][0].double()}
for l in range(L):
    Wo = layers[l].self_attn.o_proj.weight.detach().double()
    post = gain(layers[l].post_attention_layernorm) / rms(attn_pre[l])  # [n, d]
    for h in range(H):
        s = slice(h * D, (h + 1) * D)
        comp[f"a{l}.h{h}"] = post * (z[l][:, s] @ Wo[:, s].T)
    comp[f"m{l}"] = mlp_out[l]


def rotary(l):
    kind = cfg.layer_types[l]
    cos, sin = model.model.rotary_emb(out.hidden_states[0], torch.arange(n)[None], kind)
    return cos[0].double(), sin[0].double()


def rope(x, cos, sin, p):
    h = x.shape[-1] // 2
    return x * cos[p] + torch.cat([-x[..., h:], x[..., :h]], -1) * sin[p]


def side(parts, W, norm, p, cos, sin):
    """Each component's part [C + 1, D] (bias last: zeros) of q or k at position p."""
    raw = torch.stack([c @ W.T for c in parts] + [torch.zeros(D, dtype=torch.float64)])
    frozen = gain(norm) / rms(raw.sum(0))  # the per-head norm's scale of the whole vector
    return rope(raw * frozen, cos, sin, p)


cases = []
for (l, h, i) in ((5, 1, n - 1), (9, 2, n - 1), (L - 1, 0, n - 3)):
    at = layers[l].self_attn
    names = ["input"] + [f"a{a}.h{b}" for a in range(l) for b in range(H)] + [f"m{a}" for a in range(l)]
    resid = out.hidden_states[l][0].double()
    total = sum(comp[c] for c in names)
    assert torch.allclose(total, resid, atol=1e-3 * float(resid.abs().max())), float((total - resid).abs().max())
    r = rms(resid)
    w = gain(layers[l].input_layernorm)
    Wq = at.q_proj.weight.detach().double()[h * D:(h + 1) * D]
    kv = h // G
    Wk = at.k_proj.weight.detach().double()[kv * D:(kv + 1) * D]
    cos, sin = rotary(l)
    q = side([w * comp[c][i] / r[i] for c in names], Wq, at.q_norm, i, cos, sin) * at.scaling
    window = cfg.sliding_window if cfg.layer_types[l] == "sliding_attention" else None
    lo = 0 if window is None else max(0, i - window + 1)
    rows = {j: q @ side([w * comp[c][j] / r[j] for c in names], Wk, at.k_norm, j, cos, sin).T
            for j in range(lo, i + 1)}
    scores = torch.tensor([float(rows[j].sum()) for j in range(lo, i + 1)])
    probs = torch.softmax(scores, -1)
    ref = out.attentions[l][0, h, i, lo:i + 1].double()
    diff = float((probs - ref).abs().max())
    assert diff < 1e-5, (l, h, i, diff)
    key = lo + int(scores.argmax())
    T = rows[key]
    all_names = names + ["bias"]
    flat = sorted(((all_names[a], all_names[b], float(T[a, b])) for a in range(T.shape[0])
                   for b in range(T.shape[1])), key=lambda t: -abs(t[2]))
    cases.append({"layer": l, "head": h, "query": i, "key": key, "window": window,
                  "score": float(T.sum()), "row_scores": [None] * lo + scores.tolist(),
                  "row_probs_transformers": [None] * lo + ref.tolist(), "max_prob_diff": diff,
                  "terms_top": [{"query_side": a, "key_side": b, "value": v} for a, b, v in flat[:50]],
                  "terms_sum": float(T.sum())})
    print("gemma qk", l, h, i, "key", key, "softmax of the split vs transformers", diff, flush=True)

json.dump({"model_file": gguf, "clean": clean, "clean_ids": ids, "qk": cases},
          open(out_path, "w"))
