#!/usr/bin/env python
"""Reference for gradients at the hook points and attribution patching (issue #39 items 4 and 6):
torch autograd through transformers' eager f32 forward (GGUF dequantized), SmolLM2-135M (argument
`smol`, the default) or Qwen2.5-Coder-0.5B (`qwen`: a smaller set of hooks, named below).

Writes beside this script:
- smol_hook_grads.npz: for the clean text of the patching pair, the gradients at TransformerLens's
  hook points (names + "_grad", no batch axis) for three scalars:
  "lp/<name>": log p(top next token) at the last position: hook_embed, layers 0, 15 and 29's
  hook_resid_pre, and at layer 3 every hook attnscope gives a gradient for (q, k, v, rot_q, rot_k,
  attn_scores, pattern, z, attn_out, resid_mid, mlp_out, resid_post);
  "loss/<name>": TransformerLens's loss (mean next-token cross-entropy): hook_embed, layer 3's
  resid_pre, pattern, z;
  "ld/<name>": logit(answer) - logit(wrong) at the last position: layer 3's resid_pre, attn_out;
  and "values": [logprob, loss, logit diff].
- smol_attrpatch.json: attribution patching of the pair: (clean - corrupt) . d(logit diff)/d act at
  the corrupted run, per layer and position for resid_pre, attn_out and mlp_out ([L, n]), per layer and
  head for z ([L, heads], summed over positions and the head's width).

Hook points in transformers' Llama: resid_pre = a decoder layer's input; attn_out = self_attn's output;
resid_mid = post_attention_layernorm's input; mlp_out = mlp's output; resid_post = the layer's output;
z = o_proj's input; q, k, v = the projections' outputs; rot_q/rot_k = apply_rotary_pos_emb's outputs;
attn_scores = the scaled, masked scores (eager attention, replaced by the same code keeping them);
pattern = the softmax's output.
For qwen the files are qwen_hook_grads.npz (lp: layer 23's resid_pre and layer 3's q, k, rot_k,
attn_scores, pattern, z; loss: layer 3's resid_pre; ld: layer 3's pattern) and qwen_attrpatch.json.
Run: REF_MODEL_DIR=~/.cache/attnscope/models ~/.hfenv/bin/python tests/golden/make_hookgrad_golden.py [smol|qwen]
"""
import json, os, sys
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import numpy as np
import torch
import transformers.models.llama.modeling_llama as ml_llama
import transformers.models.qwen2.modeling_qwen2 as ml_qwen2
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL_DIR = os.path.expanduser(os.environ.get("REF_MODEL_DIR", "~/.cache/attnscope/models"))
WHICH = sys.argv[1] if len(sys.argv) > 1 else "smol"
GGUF, ml = {"smol": ("smollm2-135m.gguf", ml_llama), "qwen": ("qwen2.5-coder-0.5b.gguf", ml_qwen2)}[WHICH]
CLEAN = "After Alice and Bob walked to the park, Bob handed a ball to"
CORRUPT = "After Alice and Bob walked to the park, Alice handed a ball to"
# " Alice", " Bob" (tests/golden/<m>_interventions.json)
ANSWER, WRONG = {"smol": (8590, 8363), "qwen": (29405, 14261)}[WHICH]
here = os.path.dirname(os.path.abspath(__file__))
torch.set_num_threads(2)
tok = AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=GGUF)
model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, gguf_file=GGUF, dtype=torch.float32,
                                             attn_implementation="eager").eval()
for p in model.parameters():
    p.requires_grad_(False)
cfg = model.config
L, NH, HD = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
NKV = cfg.num_key_value_heads
layers = model.model.layers

acts = {}  # name -> tensor [1, ...] (grad retained)
state = {"rope": 0, "attn": 0}


def keep(name, t):
    if t.requires_grad:
        t.retain_grad()
    acts[name] = t  # the hooks return None: nothing is replaced


orig_rope = ml.apply_rotary_pos_emb


def rope(q, k, cos, sin, unsqueeze_dim=1):
    qe, ke = orig_rope(q, k, cos, sin, unsqueeze_dim)
    l = state["rope"]; state["rope"] += 1
    keep(f"blocks.{l}.attn.hook_rot_q", qe); keep(f"blocks.{l}.attn.hook_rot_k", ke)
    return qe, ke


def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    l = state["attn"]; state["attn"] += 1
    ks = ml.repeat_kv(key, module.num_key_value_groups)
    vs = ml.repeat_kv(value, module.num_key_value_groups)
    s = torch.matmul(query, ks.transpose(2, 3)) * scaling
    if attention_mask is not None:
        s = s + attention_mask
    keep(f"blocks.{l}.attn.hook_attn_scores", s)
    p = torch.nn.functional.softmax(s, dim=-1, dtype=torch.float32)
    keep(f"blocks.{l}.attn.hook_pattern", p)
    return torch.matmul(p, vs).transpose(1, 2).contiguous(), p


ml.apply_rotary_pos_emb = rope
ml.eager_attention_forward = eager
for l, layer in enumerate(layers):
    layer.register_forward_pre_hook(
        lambda m, a, k, l=l: keep(f"blocks.{l}.hook_resid_pre", a[0] if a else k["hidden_states"]), with_kwargs=True)
    layer.register_forward_hook(
        lambda m, a, o, l=l: keep(f"blocks.{l}.hook_resid_post", o[0] if isinstance(o, tuple) else o))
    layer.self_attn.register_forward_hook(lambda m, a, o, l=l: keep(f"blocks.{l}.hook_attn_out", o[0]))
    layer.post_attention_layernorm.register_forward_pre_hook(lambda m, a, l=l: keep(f"blocks.{l}.hook_resid_mid", a[0]))
    layer.mlp.register_forward_hook(lambda m, a, o, l=l: keep(f"blocks.{l}.hook_mlp_out", o))
    layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a, l=l: keep(f"blocks.{l}.attn.hook_z", a[0]))
    for proj, nm in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
        getattr(layer.self_attn, proj).register_forward_hook(
            lambda m, a, o, l=l, nm=nm: keep(f"blocks.{l}.attn.hook_{nm}", o))


def run(ids, grad=True):
    acts.clear(); state["rope"] = 0; state["attn"] = 0
    t = torch.tensor([ids])
    x = model.get_input_embeddings()(t).detach().clone().requires_grad_(grad)
    keep("hook_embed", x)
    return model(inputs_embeds=x, use_cache=False).logits[0]


def tl_shape(name, t):
    """attnscope's (TransformerLens's) layout without the batch axis."""
    g = t.grad[0].detach()
    n = g.shape[-2] if name.endswith(("hook_rot_q", "hook_rot_k")) else None
    if name.endswith(("hook_rot_q", "hook_rot_k")):
        return g.transpose(0, 1).reshape(n, -1, HD)  # [h, n, hd] -> [n, h, hd]
    if name.endswith(("hook_q", "hook_k", "hook_v", "hook_z")):
        return g.reshape(g.shape[0], -1, HD)
    return g


clean = tok(CLEAN, add_special_tokens=False)["input_ids"]
corrupt = tok(CORRUPT, add_special_tokens=False)["input_ids"]
assert len(clean) == len(corrupt) == 14
out, values = {}, []
# log p(top next token)
lg = run(clean)
target = int(lg[-1].argmax())
f = torch.log_softmax(lg[-1].double(), -1)[target]
f.backward()
values.append(float(f.detach()))
if WHICH == "smol":
    names = ["hook_embed"] + [f"blocks.{l}.hook_resid_pre" for l in (0, 15, L - 1)]
    names += [f"blocks.3.{h}" for h in ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_rot_q", "attn.hook_rot_k",
                                          "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z", "hook_attn_out",
                                          "hook_resid_mid", "hook_mlp_out", "hook_resid_post")]
else:
    names = [f"blocks.{L - 1}.hook_resid_pre"] + [f"blocks.3.attn.{h}" for h in (
        "hook_q", "hook_k", "hook_rot_k", "hook_attn_scores", "hook_pattern", "hook_z")]
for nm in names:
    g = tl_shape(nm, acts[nm])
    if nm.endswith("hook_attn_scores"):
        g = torch.where(torch.isfinite(acts[nm][0].detach()) & (acts[nm][0].detach() > -1e30), g, torch.zeros_like(g))
    out[f"lp/{nm}_grad"] = g.numpy().astype(np.float32)
# the loss
lg = run(clean)
loss = torch.nn.functional.cross_entropy(lg[:-1].double(), torch.tensor(clean[1:]))
loss.backward()
values.append(float(loss.detach()))
for nm in (("hook_embed", "blocks.3.hook_resid_pre", "blocks.3.attn.hook_pattern", "blocks.3.attn.hook_z")
           if WHICH == "smol" else ("blocks.3.hook_resid_pre",)):
    out[f"loss/{nm}_grad"] = tl_shape(nm, acts[nm]).numpy().astype(np.float32)
# the logit difference
lg = run(clean)
d = lg[-1, ANSWER] - lg[-1, WRONG]
d.backward()
values.append(float(d))
for nm in (("blocks.3.hook_resid_pre", "blocks.3.hook_attn_out") if WHICH == "smol" else ("blocks.3.attn.hook_pattern",)):
    out[f"ld/{nm}_grad"] = tl_shape(nm, acts[nm]).numpy().astype(np.float32)
out["values"] = np.array(values, dtype=np.float64)
out["tokens"] = np.array(clean, dtype=np.int64)
np.savez_compressed(os.path.join(here, f"{WHICH}_hook_grads.npz"), **out)
print("target", target, "values", values, flush=True)

# attribution patching
KINDS = ("hook_resid_pre", "hook_attn_out", "hook_mlp_out", "attn.hook_z")
with torch.no_grad():
    lg_clean = run(clean, grad=False)
    clean_acts = {k: v.detach().clone() for k, v in acts.items()}
lg = run(corrupt)
d = lg[-1, ANSWER] - lg[-1, WRONG]
d.backward()
rep = {"model_file": GGUF, "clean": CLEAN, "corrupt": CORRUPT, "answer_id": ANSWER, "wrong_id": WRONG,
       "clean_logit_diff": float(lg_clean[-1, ANSWER] - lg_clean[-1, WRONG]), "corrupt_logit_diff": float(d)}
for kind in KINDS:
    rows = []
    for l in range(L):
        nm = f"blocks.{l}.{kind}"
        delta = (clean_acts[nm] - acts[nm].detach())[0]
        e = delta * acts[nm].grad[0]
        if kind == "attn.hook_z":
            rows.append(e.reshape(e.shape[0], NH, HD).sum(dim=(0, 2)).tolist())
        else:
            rows.append(e.sum(-1).tolist())
    rep[kind.split(".")[-1]] = rows
json.dump(rep, open(os.path.join(here, f"{WHICH}_attrpatch.json"), "w"))
print("attribution patching: clean", rep["clean_logit_diff"], "corrupt", rep["corrupt_logit_diff"])
