#!/usr/bin/env python
"""Reference for Gemma 3's gradients at the hook points (issue #39 item 6, `Model::hook_gradients`,
Python's `run_with_cache(incl_bwd=True)`): torch autograd through transformers' eager f32 forward
of gemma3-270m (GGUF dequantized), and for GPT-2's `hook_pos_embed` the tiny GPT-2 fixture
(tests/golden/arch/gpt2, safetensors).

Writes beside this script:
- gemma_hook_grads/<scalar>__<hook>_grad.npy (float32, TransformerLens's layout without the batch
  axis) for the clean text of make_hookgrad_golden.py with Gemma's <bos> first (15 tokens), and
  gemma_hook_grads/values.json (the three scalars, the token ids, the target):
  "lp": log p(top next token) at the last position: hook_embed (the scaled embedding, the input to
  layer 0), blocks.17.hook_resid_pre, layer 5 (a global layer): attn.hook_pattern, attn.hook_z,
  attn.hook_v, attn.hook_rot_q, attn.hook_rot_k (after the q/k norms and RoPE), hook_attn_out and
  hook_mlp_out (after the post-norms: what is added to the residual stream); layer 3's
  attn.hook_pattern (a sliding-window layer);
  "loss": TransformerLens's loss (mean next-token cross-entropy): blocks.5.hook_resid_pre;
  "ld": logit(" Alice") - logit(" Bob") at the last position: blocks.5.attn.hook_pattern.
- gpt2_pos_embed_grad.json: for the tiny GPT-2 fixture and tokens [72, 101, 108, 108, 111, 32, 256,
  258, 259], d log p(top next token) / d wpe(positions) ([n, d_model]), the token embedding's
  gradient (the same tensor: both are summed into the input) and the scalar.

Hook points in transformers' Gemma 3: resid_pre = a decoder layer's input; attn_out =
post_attention_layernorm's output; mlp_out =
post_feedforward_layernorm's output; z = o_proj's input; v = v_proj's output; rot_q/rot_k =
apply_rotary_pos_emb's outputs; pattern = the softmax's output (eager attention, replaced by the
same code keeping it).
Run: REF_MODEL_DIR=~/.cache/attnscope/models ~/.hfenv/bin/python tests/golden/make_gemma_hookgrad_golden.py
"""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import numpy as np
import torch
import transformers.models.gemma3.modeling_gemma3 as ml
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel

MODEL_DIR = os.path.expanduser(os.environ.get("REF_MODEL_DIR", "~/.cache/attnscope/models"))
GGUF = "gemma3-270m.gguf"
CLEAN = "After Alice and Bob walked to the park, Bob handed a ball to"
here = os.path.dirname(os.path.abspath(__file__))
out_dir = os.path.join(here, "gemma_hook_grads")
os.makedirs(out_dir, exist_ok=True)
torch.set_num_threads(2)
tok = AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=GGUF)
model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, gguf_file=GGUF, dtype=torch.float32,
                                             attn_implementation="eager").eval()
for p in model.parameters():
    p.requires_grad_(False)
cfg = model.config
L, NH, HD = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim
layers = model.model.layers
acts = {}
state = {"rope": 0, "attn": 0}


def keep(name, t):
    if t.requires_grad:
        t.retain_grad()
    acts[name] = t


orig_rope = ml.apply_rotary_pos_emb


def rope(q, k, cos, sin, unsqueeze_dim=1):
    qe, ke = orig_rope(q, k, cos, sin, unsqueeze_dim)
    l = state["rope"]; state["rope"] += 1
    keep(f"blocks.{l}.attn.hook_rot_q", qe); keep(f"blocks.{l}.attn.hook_rot_k", ke)
    return qe, ke


orig_eager = ml.eager_attention_forward


def eager(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kw):
    l = state["attn"]; state["attn"] += 1
    assert softcap is None, "Gemma 3 has no attention soft-cap"
    ks = ml.repeat_kv(key, module.num_key_value_groups)
    vs = ml.repeat_kv(value, module.num_key_value_groups)
    s = torch.matmul(query, ks.transpose(2, 3)) * scaling
    if attention_mask is not None:
        s = s + attention_mask
    p = torch.nn.functional.softmax(s, dim=-1, dtype=torch.float32)
    keep(f"blocks.{l}.attn.hook_pattern", p)
    return torch.matmul(p, vs).transpose(1, 2).contiguous(), p


ml.apply_rotary_pos_emb = rope
ml.eager_attention_forward = eager
for l, layer in enumerate(layers):
    layer.register_forward_pre_hook(
        lambda m, a, k, l=l: keep(f"blocks.{l}.hook_resid_pre", a[0] if a else k["hidden_states"]), with_kwargs=True)
    layer.post_attention_layernorm.register_forward_hook(lambda m, a, o, l=l: keep(f"blocks.{l}.hook_attn_out", o))
    layer.post_feedforward_layernorm.register_forward_hook(lambda m, a, o, l=l: keep(f"blocks.{l}.hook_mlp_out", o))
    layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a, l=l: keep(f"blocks.{l}.attn.hook_z", a[0]))
    layer.self_attn.v_proj.register_forward_hook(lambda m, a, o, l=l: keep(f"blocks.{l}.attn.hook_v", o))


def run(ids):
    acts.clear(); state["rope"] = 0; state["attn"] = 0
    t = torch.tensor([ids])
    x = model.get_input_embeddings()(t).detach().clone().requires_grad_(True)
    keep("hook_embed", x)
    return model(inputs_embeds=x, use_cache=False).logits[0]


def tl_shape(name, t):
    g = t.grad[0].detach()
    if name.endswith(("hook_rot_q", "hook_rot_k")):
        return g.transpose(0, 1)  # [h, n, hd] -> [n, h, hd]
    if name.endswith(("hook_v", "hook_z")):
        return g.reshape(g.shape[0], -1, HD)
    return g


def save(scalar, name):
    np.save(os.path.join(out_dir, f"{scalar}__{name}_grad.npy"), tl_shape(name, acts[name]).numpy().astype(np.float32))


ids = tok(CLEAN, add_special_tokens=True)["input_ids"]
assert ids[0] == tok.bos_token_id and len(ids) == 15, ids
answer = tok(" Alice", add_special_tokens=False)["input_ids"]
wrong = tok(" Bob", add_special_tokens=False)["input_ids"]
assert len(answer) == len(wrong) == 1
answer, wrong = answer[0], wrong[0]
values = {"token_ids": ids, "answer_id": answer, "wrong_id": wrong}
lg = run(ids)
target = int(lg[-1].argmax())
f = torch.log_softmax(lg[-1].double(), -1)[target]
f.backward()
values["target_id"] = target
values["logprob"] = float(f.detach())
for nm in ["hook_embed", f"blocks.{L - 1}.hook_resid_pre", "blocks.3.attn.hook_pattern"] + [
        f"blocks.5.{h}" for h in ("attn.hook_pattern", "attn.hook_z", "attn.hook_v", "attn.hook_rot_q", "attn.hook_rot_k",
                                  "hook_attn_out", "hook_mlp_out")]:
    save("lp", nm)
lg = run(ids)
loss = torch.nn.functional.cross_entropy(lg[:-1].double(), torch.tensor(ids[1:]))
loss.backward()
values["loss"] = float(loss.detach())
save("loss", "blocks.5.hook_resid_pre")
lg = run(ids)
d = lg[-1, answer] - lg[-1, wrong]
d.backward()
values["logit_diff"] = float(d.detach())
save("ld", "blocks.5.attn.hook_pattern")
json.dump(values, open(os.path.join(out_dir, "values.json"), "w"), indent=1)
print("gemma: target", target, values, flush=True)

# GPT-2's learned positions on the tiny fixture
ml.eager_attention_forward = orig_eager
gpt = GPT2LMHeadModel.from_pretrained(os.path.join(here, "arch", "gpt2"), dtype=torch.float32,
                                      attn_implementation="eager").eval()
for p in gpt.parameters():
    p.requires_grad_(False)
TOKENS = [72, 101, 108, 108, 111, 32, 256, 258, 259]
t = torch.tensor([TOKENS])
te = gpt.transformer.wte(t).detach().clone().requires_grad_(True)
pe = gpt.transformer.wpe(torch.arange(len(TOKENS))[None]).detach().clone().requires_grad_(True)
# the input GPT-2 builds from inputs_embeds is inputs_embeds + wpe(positions): feed te and add pe
# by replacing wpe's output
h = gpt.transformer.wpe.register_forward_hook(lambda m, a, o: pe)
lg = gpt(inputs_embeds=te, use_cache=False).logits[0]
h.remove()
target = int(lg[-1].argmax())
f = torch.log_softmax(lg[-1].double(), -1)[target]
f.backward()
json.dump({"tokens": TOKENS, "target_id": target, "logprob": float(f.detach()),
           "pos_embed_grad": pe.grad[0].tolist(), "embed_grad": te.grad[0].tolist()},
          open(os.path.join(here, "gpt2_pos_embed_grad.json"), "w"))
print("gpt2: target", target, "logprob", float(f.detach()), flush=True)
