#!/usr/bin/env python
"""Reference for the gradients at the norms' and the MLP's hook points (#59: TransformerLens's
`ln1.hook_scale`, `ln1.hook_normalized`, `ln2.hook_scale`, `ln2.hook_normalized`, `mlp.hook_pre`,
`mlp.hook_pre_linear`, `mlp.hook_post`; `Model::hook_gradients`, Python's backward hooks and
`run_with_cache(incl_bwd=True)`): torch autograd through transformers' eager f32 forward (GGUF
dequantized) of smollm2-135m, qwen2.5-coder-0.5b and gemma3-270m, the scalar log p(top next token)
at the last position of the clean text of make_hookgrad_golden.py (Gemma with its <bos> first).

The norms and the MLPs of the layer named below are replaced by the same computation written as
TransformerLens writes it, keeping its hook points: scale = sqrt(mean(x^2) + eps), normalized =
x / scale, output = normalized * w (Gemma: * (1 + w)); pre = gate_proj(x), pre_linear = up_proj(x),
post = act(pre) * pre_linear, output = down_proj(post). ln1 is the attention's input norm, ln2 the
MLP's (Gemma 3: pre_feedforward_layernorm).

Writes beside this script, in inner_hook_grads/: <model>__<hook>_grad.npy (float32, TransformerLens's
layout without the batch axis; the [n, d_model] and [n, d_ff] ones only at the rows listed in
values.json, to keep the files small) and values.json (per model: token ids, target, value, layer,
rows).
Run: REF_MODEL_DIR=~/.cache/attnscope/models ~/.hfenv/bin/python tests/golden/make_inner_hookgrad_golden.py
"""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL_DIR = os.path.expanduser(os.environ.get("REF_MODEL_DIR", "~/.cache/attnscope/models"))
CLEAN = "After Alice and Bob walked to the park, Bob handed a ball to"
HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "inner_hook_grads")
# model: (gguf, layer, special tokens, hooks kept, ln2's module name, (1 + w) norm)
MODELS = {
    "smol": ("smollm2-135m.gguf", 3, False, ["ln1.hook_scale", "ln1.hook_normalized", "ln2.hook_scale",
                                              "ln2.hook_normalized", "mlp.hook_pre", "mlp.hook_pre_linear",
                                              "mlp.hook_post"], "post_attention_layernorm", False),
    "qwen": ("qwen2.5-coder-0.5b.gguf", 3, False, ["ln1.hook_scale", "ln2.hook_scale", "ln2.hook_normalized",
                                                   "mlp.hook_pre_linear"], "post_attention_layernorm", False),
    "gemma": ("gemma3-270m.gguf", 5, True, ["ln1.hook_scale", "ln1.hook_normalized", "ln2.hook_scale",
                                            "mlp.hook_pre", "mlp.hook_post"], "pre_feedforward_layernorm", True),
}
torch.set_num_threads(2)


def norm_forward(keep, prefix, module, one_plus):
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))

    def forward(x):
        x = x.float()
        scale = (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        keep(prefix + ".hook_scale", scale)
        normalized = x / scale
        keep(prefix + ".hook_normalized", normalized)
        w = module.weight.float()
        return normalized * ((1.0 + w) if one_plus else w)
    return forward


def mlp_forward(keep, mlp):
    def forward(x):
        pre = mlp.gate_proj(x)
        keep("mlp.hook_pre", pre)
        pre_linear = mlp.up_proj(x)
        keep("mlp.hook_pre_linear", pre_linear)
        post = mlp.act_fn(pre) * pre_linear
        keep("mlp.hook_post", post)
        return mlp.down_proj(post)
    return forward


def one(key, gguf, layer, special, hooks, ln2_name, one_plus, values):
    tok = AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, gguf_file=gguf, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    for p in model.parameters():
        p.requires_grad_(False)
    acts = {}

    def keep(name, t):
        t.retain_grad()
        acts[name] = t
    blk = model.model.layers[layer]
    blk.input_layernorm.forward = norm_forward(keep, "ln1", blk.input_layernorm, one_plus)
    ln2 = getattr(blk, ln2_name)
    ln2.forward = norm_forward(keep, "ln2", ln2, one_plus)
    blk.mlp.forward = mlp_forward(keep, blk.mlp)
    ids = tok(CLEAN, add_special_tokens=special)["input_ids"]
    x = model.get_input_embeddings()(torch.tensor([ids])).detach().requires_grad_(True)
    logits = model(inputs_embeds=x, use_cache=False).logits[0]
    target = int(logits[-1].argmax())
    f = torch.log_softmax(logits[-1].double(), -1)[target]
    f.backward()
    n = len(ids)
    rows = [0, n // 2, n - 1]
    for h in hooks:
        g = acts[h].grad[0].detach().numpy().astype(np.float32)
        if g.shape[-1] > 1:
            g = g[rows]
        assert np.abs(g).max() > 0, (key, h)
        np.save(os.path.join(HERE, f"{key}__blocks.{layer}.{h}_grad.npy"), g)
    values[key] = {"model": gguf.removesuffix(".gguf"), "token_ids": ids, "target_id": target,
                   "logprob": float(f.detach()), "layer": layer, "rows": rows}
    print(key, "target", target, "logprob", float(f.detach()), flush=True)


os.makedirs(HERE, exist_ok=True)
values = {}
for key, args in MODELS.items():
    one(key, *args, values)
json.dump(values, open(os.path.join(HERE, "values.json"), "w"), indent=1)
