#!/usr/bin/env python
"""Golden numbers for value zeroing, ALTI-Logit and AttnLRP (issue #39), on the lesson sentence.

Independent of attnscope: Hugging Face transformers' eager float32 forward (GGUF dequantized), with
torch hooks, for the argmax next token after the sentence.

- Value zeroing [Mohebbi et al. 2023]: for layer l and token j, the layer's v_proj output of token j
  is zeroed (a forward hook; every kv head), layer l runs from its original input (the layers before
  it are unchanged) and each position i's layer output is compared with the original one:
  C[l, i, j] = cosine distance, rows normalized to sum 1; the rollout R[0] = C[0],
  R[l] = C[l] @ R[l-1] (the authors' compute_joint_attention with res=False).
- ALTI-Logit [Ferrando et al. 2023], as the authors' logit-explanations code computes it
  (src/contributions.py, extract_explanations.py), written for RMSNorm and GQA: per layer,
  T[t, j] = sum_h A[h, t, j] W_O^h v_j^{g(h)} (v_proj's output with its bias: the affine part);
  resid_mid[t] = x[t] + sum_j T[t, j] (+ o_proj's bias) is checked against the model's own;
  ALTI: c[t, j] = max(0, ||y_t||_1 - ||y_t - (T[t, j] + [t == j] x_t)||_1), rows normalized, rolled
  out as above; the logit update of source j: (U_w * g_final) . T[last, j] / rms(final residual of
  the last position) (the final RMSNorm with its scale held, as the paper's linear approximation);
  ALTI-Logit = dlogit[0] + sum_{l >= 1} dlogit[l] @ R[l-1].
- AttnLRP [Achtibat et al. 2024]: the authors' package lxt 2.1 (pip install --no-deps lxt), its
  efficient (gradient x input) rules: rms_norm_forward, gated_mlp_forward and
  wrap_attention_forward patched into transformers' modeling module; relevance = sum over the width of
  input_embeds.grad * input_embeds after logit.backward(). lxt's package __init__ imports its BERT
  patches, which fail on transformers 5 (find_pruneable_heads_and_indices is gone), and its
  patch_attention replaces transformers' attention registry with a dict (transformers 5 calls
  .get_interface on it), so the modules are imported without the package __init__ and the eager
  attention is wrapped directly (what patch_attention does for it).

Gemma's post-attention norm is linearized as the final norm is (its scale held at each position's), and
its norms weigh by (1 + w). lxt has no Mistral or Gemma 2 map: Mistral gets lxt's own Llama patches
(the same blocks); Gemma 2 gets no AttnLRP (its attention soft-cap has no lxt rule).

Usage: PYTHONPATH=<dir with lxt> python make_mixing_golden.py <gguf file or HF folder> <out.json> [ids]
(ids: comma-separated token ids; default: the lesson sentence without BOS)
"""
import json
import os
import sys
import types

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

SENTENCE = "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc."
torch.set_num_threads(2)
src, out_path = sys.argv[1], sys.argv[2]
if os.path.isdir(src):
    d, f, kw = src, os.path.basename(os.path.normpath(src)), {}
else:
    d, f = os.path.split(src)
    kw = {"gguf_file": f}
tok = AutoTokenizer.from_pretrained(d, **kw)
model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager", **kw).eval()
for p in model.parameters():
    p.requires_grad_(False)
cfg = model.config
L, nh, nkv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
layers = model.model.layers
ids = ([int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3
       else tok(SENTENCE, add_special_tokens=False)["input_ids"])
gemma = cfg.model_type.startswith("gemma")


def norm_of(m):
    """An RMSNorm's weight as it multiplies (Gemma's 1 + w) and its epsilon."""
    w = m.weight.double()
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    return (1.0 + w if gemma else w), eps
n = len(ids)
t_ids = torch.tensor([ids])


class Stop(Exception):
    pass


# ---------- the clean run: every layer's input, output, v, attention; the final residual
cap = {}
hooks = []
for l, layer in enumerate(layers):
    hooks.append(layer.register_forward_pre_hook(
        lambda m, a, k, l=l: cap.__setitem__(("in", l), (a[0] if a else k["hidden_states"])[0].clone()),
        with_kwargs=True))
    hooks.append(layer.register_forward_hook(
        lambda m, a, o, l=l: cap.__setitem__(("out", l), (o[0] if isinstance(o, tuple) else o)[0].clone())))
    hooks.append(layer.self_attn.v_proj.register_forward_hook(
        lambda m, a, o, l=l: cap.__setitem__(("v", l), o[0].clone())))
    mid = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
    hooks.append(mid.register_forward_pre_hook(
        lambda m, a, l=l: cap.__setitem__(("mid", l), a[0][0].clone())))
hooks.append(model.model.norm.register_forward_pre_hook(
    lambda m, a: cap.__setitem__("final", a[0][0].clone())))
with torch.no_grad():
    o = model(t_ids, use_cache=False, output_attentions=True)
for h in hooks:
    h.remove()
logits = o.logits[0, -1]
target = int(logits.argmax())
att = [a[0].double() for a in o.attentions]  # [nh, n, n]
print(f, n, "tokens, target", target, repr(tok.decode([target])), flush=True)


def rollout(c):
    r = [c[0]]
    for l in range(1, len(c)):
        r.append(c[l] @ r[-1])
    return r


# ---------- value zeroing
vz = []
for l in range(L):
    c = torch.zeros(n, n, dtype=torch.float64)
    orig = cap[("out", l)].double()
    for j in range(n):
        got = {}

        def zero(m, a, o, j=j):
            o = o.clone()
            o[0, j] = 0.0
            return o

        def grab(m, a, o):
            got["out"] = (o[0] if isinstance(o, tuple) else o)[0].double()
            raise Stop

        h1 = layers[l].self_attn.v_proj.register_forward_hook(zero)
        h2 = layers[l].register_forward_hook(grab)
        try:
            with torch.no_grad():
                model(t_ids, use_cache=False)
        except Stop:
            pass
        h1.remove()
        h2.remove()
        c[:, j] = 1.0 - torch.nn.functional.cosine_similarity(got["out"], orig, dim=-1)
    c = c / c.sum(-1, keepdim=True)
    vz.append(c)
vz_roll = rollout(vz)

# ---------- ALTI-Logit
u_w = model.lm_head.weight[target].double()
g_f, eps_f = norm_of(model.model.norm)
xf = cap["final"][-1].double()
rms_f = torch.sqrt(xf.pow(2).mean() + eps_f)
direction = u_w * g_f / rms_f
alti, dlogit, worst = [], [], 0.0
for l in range(L):
    a = att[l]
    v = cap[("v", l)].double().view(n, nkv, hd)
    wo = layers[l].self_attn.o_proj.weight.double()  # [d, nh*hd]
    bo = layers[l].self_attn.o_proj.bias
    u = torch.stack([v[:, h // (nh // nkv)] @ wo[:, h * hd:(h + 1) * hd].T for h in range(nh)])  # [nh, n, d]
    T = torch.einsum("htj,hjd->tjd", a, u)
    proj = T.sum(1) + (bo.double() if bo is not None else 0.0)
    if gemma:  # the post-attention norm, its scale held at each position's
        g_p, eps_p = norm_of(layers[l].post_attention_layernorm)
        scale = g_p[None, :] / torch.sqrt(proj.pow(2).mean(-1, keepdim=True) + eps_p)
        T, proj = T * scale[:, None, :], proj * scale
    x = cap[("in", l)].double()
    y = x + proj
    worst = max(worst, float((y - cap[("mid", l)].double()).abs().max() / cap[("mid", l)].abs().max()))
    res = T + torch.einsum("tj,td->tjd", torch.eye(n, dtype=torch.float64), x)
    imp = -(res - y[:, None, :]).abs().sum(-1)
    c = (imp + y.abs().sum(-1)[:, None]).clamp(min=0)
    alti.append(c / c.sum(-1, keepdim=True))
    dlogit.append(T[-1] @ direction)
alti_roll = rollout(alti)
layer_logit = [dlogit[0]] + [dlogit[l] @ alti_roll[l - 1] for l in range(1, L)]
alti_logit = sum(layer_logit)
print("ALTI: resid_mid rebuilt within", worst, "(relative)", flush=True)

# ---------- AttnLRP with lxt
import importlib  # noqa: E402

lrp, lrp_logit = None, None

for name in ("lxt.efficient", "lxt.efficient.models"):
    spec = importlib.util.find_spec(name.split(".")[0])
    m = types.ModuleType(name)
    m.__path__ = [os.path.join(spec.submodule_search_locations[0], *name.split(".")[1:])]
    sys.modules[name] = m
from lxt.efficient import patches  # noqa: E402

arch = {"gemma3_text": "gemma3"}.get(cfg.model_type, cfg.model_type)
mod = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
if arch == "mistral":
    from functools import partial
    lxt_map = {mod.MistralMLP: partial(patches.patch_method, patches.gated_mlp_forward),
               mod.MistralRMSNorm: partial(patches.patch_method, patches.rms_norm_forward)}
elif arch == "gemma2":
    lxt_map = None
else:
    lxt_map = importlib.import_module(f"lxt.efficient.models.{arch}").attnLRP
if lxt_map is not None:
    for target_cls, patch in lxt_map.items():
        if isinstance(target_cls, type):
            patch(target_cls)
    mod.eager_attention_forward = patches.wrap_attention_forward(mod.eager_attention_forward)
    emb = model.get_input_embeddings()(t_ids).detach().requires_grad_(True)
    out = model(inputs_embeds=emb, use_cache=False).logits[0, -1]
    assert int(out.argmax()) == target
    out[target].backward()
    lrp = (emb.grad[0] * emb[0]).sum(-1).detach().double().tolist()
    lrp_logit = float(out[target].detach())
    print("AttnLRP: logit", lrp_logit, "sum of relevances", sum(lrp), flush=True)

import transformers  # noqa: E402

json.dump({
    "source": f"make_mixing_golden.py: transformers {transformers.__version__}, torch {torch.__version__}, "
              f"eager float32 from {f}; lxt 2.1 for AttnLRP",
    "sentence": SENTENCE, "token_ids": ids, "target_id": target,
    "logit": float(logits[target]),
    "value_zeroing_last_rows": [c[-1].tolist() for c in vz],
    "value_zeroing_rollout_last": vz_roll[-1][-1].tolist(),
    "alti_last_rows": [c[-1].tolist() for c in alti],
    "alti_logit_layers": [v.tolist() for v in layer_logit],
    "alti_logit": alti_logit.tolist(),
    "attnlrp": lrp,
    "attnlrp_logit": lrp_logit,
}, open(out_path, "w"), indent=1)
