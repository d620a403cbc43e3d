#!/usr/bin/env python
"""Independent references for `dla`, `patch --hook attn-out|mlp-out|z|pattern`, `ablate --mlp`,
`ablate --positions` and ablation's KL column (issue #55): transformers' eager float32 forward (the
GGUF dequantized), torch forward hooks, every number in float64 from the hooked activations or the
logits. Nothing here comes from attnscope.

Writes tests/golden/<m>_ref_interventions.json for m = smol (smollm2-135m) and qwen
(qwen2.5-coder-0.5b), with "texts" (the lesson sentence and the IOI-style pair, their token ids) and:
- "dla": per case, at the last position, each part's direct contribution to logit(answer) ("logit")
  and to logit(answer) - logit(wrong) ("diff"), through the final RMSNorm with its scale frozen from
  the run (TransformerLens's apply_ln_to_stack + logit_attrs): part(c) = s * sum_i gamma_i u_i c_i,
  s = 1 / sqrt(mean(x^2) + eps) of the last layer's output x at the last position, gamma the final
  norm's weight, u = W_U[answer] (- W_U[wrong]). Parts: "embed" (embed_tokens' output), "heads"
  [L][H] (head h's slice of o_proj's input times its columns of o_proj's weight; o_proj has no
  bias in either model), "mlp" [L] (the MLP's output); "metric" is the model's own logit (difference)
  and "sum_of_parts" the parts added up. Cases: "lesson" (answer = the top next token, wrong = the
  second) and "ioi" (the clean text; answer " Alice", wrong " Bob").
- "ablation": the lesson sentence, target = the top next token; "zero_all" (every position set to
  0) and "mean_subset" (`positions` only, set to the mean over every position of the text, as
  `ablate --method mean --positions` does): "heads" [L][H] with head h's slice of o_proj's input
  (TL's hook_z) ablated, "mlp" [L] with the MLP's output (hook_mlp_out) ablated; each cell
  [delta_logprob, kl]: log p(target) less the clean run's, and KL(clean || ablated) =
  sum_v p_clean(v) (log p_clean(v) - log p_ablated(v)) of the next token, in nats.
- "patching": the IOI-style pair (answer " Alice", wrong " Bob"), the corrupted run with one
  activation taken from the clean run, scored by logit(answer) - logit(wrong) at the last
  position: "attn_out" and "mlp_out" [L][n] (self_attn's output, the MLP's output at one position),
  "z" [L][H] (head h's slice of o_proj's input at every position), "pattern" [L][H] (head h's whole
  post-softmax map replaced, the corrupted run's values weighed by it: the eager attention function
  replaced by the same code with that substitution).
Numbers are rounded to 7 significant digits.
Run: REF_MODEL_DIR=/work/cache/models ~/.hfenv/bin/python tests/golden/make_interventions_golden.py smol qwen
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
import transformers.models.llama.modeling_llama as ml_llama
import transformers.models.qwen2.modeling_qwen2 as ml_qwen2
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL_DIR = os.path.expanduser(os.environ.get("REF_MODEL_DIR", "~/.cache/attnscope/models"))
FILES = {"smol": ("smollm2-135m.gguf", ml_llama), "qwen": ("qwen2.5-coder-0.5b.gguf", ml_qwen2)}
SENTENCE = "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc."
CLEAN = "After Alice and Bob walked to the park, Bob handed a ball to"
CORRUPT = "After Alice and Bob walked to the park, Alice handed a ball to"
NAMES = (" Alice", " Bob")
HERE = os.path.dirname(os.path.abspath(__file__))

# What the hooks do on the next forward: EDIT = (kind, layer, fn(tensor) -> tensor) or None;
# RECORD = a dict the hooks fill with {(kind, layer): activation [n, ...] (float32)} or None.
EDIT = None
RECORD = None
WHICH, MODEL = None, None  # the model `make` runs (smol | qwen) and its transformers model


def r7(x):
    return float(f"{float(x):.7g}")


def touch(kind, layer, x):
    """The hook point `kind` of `layer` sees activation x ([1, n, ...]): record it, and return the
    edited one (or None)."""
    if RECORD is not None:
        RECORD[(kind, layer)] = x[0].detach().clone()
    if EDIT is not None and EDIT[0] == kind and EDIT[1] == layer:
        return EDIT[2](x.detach().clone())
    return None


def eager_with_pattern_hook(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    """transformers' eager_attention_forward (llama and qwen2 have the same one) with the softmax's
    output handed to `touch` as hook_pattern [1, heads, q, k]."""
    ml = FILES[WHICH][1]
    k = ml.repeat_kv(key, module.num_key_value_groups)
    v = ml.repeat_kv(value, module.num_key_value_groups)
    w = torch.matmul(query, k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        w = w + attention_mask
    w = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    edited = touch("pattern", module.layer_idx, w)
    if edited is not None:
        w = edited
    return torch.matmul(w, v).transpose(1, 2).contiguous(), w


def install_hooks(model):
    inner = model.model
    inner.embed_tokens.register_forward_hook(lambda m, a, o: touch("embed", 0, o))
    inner.norm.register_forward_pre_hook(lambda m, a: touch("final", 0, a[0]))
    for l, layer in enumerate(inner.layers):
        def z_pre(m, a, l=l):
            e = touch("z", l, a[0])
            return None if e is None else (e,) + tuple(a[1:])

        def attn_out(m, a, o, l=l):
            e = touch("attn_out", l, o[0])
            return None if e is None else (e,) + tuple(o[1:])

        layer.self_attn.o_proj.register_forward_pre_hook(z_pre)
        layer.self_attn.register_forward_hook(attn_out)
        layer.mlp.register_forward_hook(lambda m, a, o, l=l: touch("mlp_out", l, o))


def last_logits(ids, edit=None, record=None):
    """The last position's logits (float64) of a forward with `edit` applied and `record` filled."""
    global EDIT, RECORD
    EDIT, RECORD = edit, record
    try:
        with torch.inference_mode():
            return MODEL(torch.tensor([ids]), use_cache=False, logits_to_keep=1).logits[0, -1].double()
    finally:
        EDIT, RECORD = None, None


def dla_case(ids, answer, wrong):
    """Every part's direct contribution to logit(answer) and to logit(answer) - logit(wrong)."""
    rec = {}
    lg = last_logits(ids, record=rec)
    cfg = MODEL.config
    L, H = cfg.num_hidden_layers, cfg.num_attention_heads
    D = cfg.hidden_size // H
    x = rec[("final", 0)][-1].double()
    scale = 1.0 / torch.sqrt((x * x).mean() + cfg.rms_norm_eps)
    gamma = MODEL.model.norm.weight.detach().double()
    W_U = MODEL.lm_head.weight.detach().double()
    out = {"answer_id": answer, "wrong_id": wrong, "final_scale": float(scale)}
    for name, u in (("logit", W_U[answer]), ("diff", W_U[answer] - W_U[wrong])):
        ug = scale * gamma * u
        part = lambda c: float((c.double() * ug).sum())  # noqa: E731
        heads, mlp = [], []
        for l in range(L):
            attn = MODEL.model.layers[l].self_attn
            assert attn.o_proj.bias is None, "o_proj has a bias: its part is not written"
            W_O = attn.o_proj.weight.detach().double()  # [d_model, H*D]
            z = rec[("z", l)][-1].double()
            heads.append([part(W_O[:, h * D:(h + 1) * D] @ z[h * D:(h + 1) * D]) for h in range(H)])
            mlp.append(part(rec[("mlp_out", l)][-1]))
        embed = part(rec[("embed", 0)][-1])
        total = embed + sum(map(sum, heads)) + sum(mlp)
        metric = float(lg[answer] - (lg[wrong] if name == "diff" else 0.0))
        print(WHICH, "dla", name, "metric", metric, "sum of parts", total, flush=True)
        out[name] = {"metric": metric, "sum_of_parts": total, "embed": embed, "heads": heads, "mlp": mlp}
    return out


def fill(method, cols, positions):
    """An edit of x [1, n, width]: values `cols` at `positions` set to 0, or to their mean over
    every position."""
    def f(x):
        v = 0.0 if method == "zero" else x[0, :, cols].double().mean(0).float()
        x[0, positions, cols] = v
        return x
    return f


def effect(base_lp, lg, target):
    lp = torch.log_softmax(lg, -1)
    kl = float((base_lp.exp() * (base_lp - lp)).sum())
    return [float(lp[target] - base_lp[target]), kl]


def ablation(ids, target, method, positions):
    """Every head's and MLP's [delta log p, KL] for `method` ablation at `positions`."""
    base_lp = torch.log_softmax(last_logits(ids), -1)
    cfg = MODEL.config
    L, H = cfg.num_hidden_layers, cfg.num_attention_heads
    D, dm = cfg.hidden_size // H, cfg.hidden_size
    heads = [[effect(base_lp, last_logits(ids, ("z", l, fill(method, slice(h * D, (h + 1) * D), positions))),
                     target) for h in range(H)] for l in range(L)]
    mlp = [effect(base_lp, last_logits(ids, ("mlp_out", l, fill(method, slice(0, dm), positions))), target)
           for l in range(L)]
    print(WHICH, "ablation", method, len(positions), "positions: largest |delta| head",
          max(abs(c[0]) for r in heads for c in r), "mlp", max(abs(c[0]) for c in mlp), flush=True)
    return {"method": method, "positions": positions, "heads": heads, "mlp": mlp}


def replace_with(src, at):
    """An edit that writes src's values at index `at` (a tuple of indices and slices)."""
    def f(x):
        x[at] = src[at[1:]]
        return x
    return f


def patching(clean, corrupt, answer, wrong):
    """The patched logit differences of attn_out, mlp_out (per layer and position), z and
    pattern (per layer and head)."""
    rec = {}
    lc = last_logits(clean, record=rec)
    lx = last_logits(corrupt)
    ld = lambda lg: float(lg[answer] - lg[wrong])  # noqa: E731
    cfg = MODEL.config
    L, H = cfg.num_hidden_layers, cfg.num_attention_heads
    D, n = cfg.hidden_size // H, len(clean)
    out = {"clean_logit_diff": ld(lc), "corrupt_logit_diff": ld(lx)}
    for kind in ("attn_out", "mlp_out"):
        out[kind] = [[ld(last_logits(corrupt, (kind, l, replace_with(rec[(kind, l)], (0, p, slice(None))))))
                      for p in range(n)] for l in range(L)]
    out["z"] = [[ld(last_logits(corrupt, ("z", l, replace_with(rec[("z", l)], (0, slice(None), slice(h * D, (h + 1) * D))))))
                 for h in range(H)] for l in range(L)]
    out["pattern"] = [[ld(last_logits(corrupt, ("pattern", l, replace_with(rec[("pattern", l)], (0, h)))))
                       for h in range(H)] for l in range(L)]
    print(WHICH, "patching clean", out["clean_logit_diff"], "corrupt", out["corrupt_logit_diff"], flush=True)
    return out


def check_against_shared(out):
    """The zero ablation of every head (all positions) against the team's reference
    (<m>_interventions.json, made by interventions_ref.py with its own hooks), as a check of the
    hooks here."""
    path = os.path.join(HERE, f"{WHICH}_interventions.json")
    theirs = json.load(open(path))["ablation"]["zero"]
    mine = out["ablation"]["zero_all"]["heads"]
    d = max(abs(mine[l][h][0] - theirs[l][h]) for l in range(len(mine)) for h in range(len(mine[0])))
    print(WHICH, "zero ablation vs", os.path.basename(path), "max |difference|", d, flush=True)
    assert d < 5e-5, d  # two f32 forwards (other threads, other GEMM shapes) differ by ~1e-5


def make(which):
    global WHICH, MODEL
    WHICH = which
    gguf, ml = FILES[which]
    ml.eager_attention_forward = eager_with_pattern_hook
    tok = AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=gguf)
    MODEL = AutoModelForCausalLM.from_pretrained(MODEL_DIR, gguf_file=gguf, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    install_hooks(MODEL)
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    lesson, clean, corrupt = enc(SENTENCE), enc(CLEAN), enc(CORRUPT)
    assert len(clean) == len(corrupt)
    answer, wrong = enc(NAMES[0])[-1], enc(NAMES[1])[-1]
    top2 = [int(i) for i in torch.topk(last_logits(lesson), 2).indices]
    n = len(lesson)
    positions = [2, 5, 6, 7, n - 1]
    out = {"model_file": gguf, "texts": {"lesson": SENTENCE, "lesson_ids": lesson, "clean": CLEAN,
                                         "clean_ids": clean, "corrupt": CORRUPT, "corrupt_ids": corrupt},
           "dla": {"lesson": dla_case(lesson, *top2), "ioi": dla_case(clean, answer, wrong)},
           "ablation": {"target_id": top2[0],
                        "zero_all": ablation(lesson, top2[0], "zero", list(range(n))),
                        "mean_subset": ablation(lesson, top2[0], "mean", positions)},
           "patching": {"answer_id": answer, "wrong_id": wrong, **patching(clean, corrupt, answer, wrong)}}
    with open(os.path.join(HERE, f"{which}_ref_interventions.json"), "w") as f:
        json.dump(json.loads(json.dumps(out), parse_float=r7), f, separators=(",", ":"))
    check_against_shared(out)


if __name__ == "__main__":
    torch.set_num_threads(1)  # 2 threads ran 5x slower on the shared 2-core machine
    for which in sys.argv[1:] or ["smol", "qwen"]:
        make(which)
