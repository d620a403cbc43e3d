#!/usr/bin/env python
"""Goldens for circuits (issue #58): EAP and EAP-IG edge scores (torch autograd) and exact edge patching
(a float64 torch forward whose readers read their own inputs), on the shared IOI-style pair.

The EAP part is ../shared/reference/scripts/circuits_ref.py (its QK split left out: `attnscope qk`'s
goldens are its own), unchanged in what it computes:
- eap: every edge's score = sum over positions of (a_u(corrupt) - a_u(clean)) . dm/d in_v at the clean
  run, m = logit(answer) - logit(wrong) at the last position (Syed et al. 2023);
- eap_ig: the same with dm/d in_v averaged over 5 runs whose input embeddings are
  x_corrupt + a (x_clean - x_corrupt), a = (i + 1/2) / 5 (Hanna et al. 2024, inputs variant).
Graph: upstream input, a{L}.h{H} (z_h through W_O's columns), m{L}; downstream a{L}.h{H}.q,
a{L}.kv{G}.k, a{L}.kv{G}.v, m{L}, logits. The gradient of an attention input is the gradient at the
q/k/v projection's output slice carried back through that projection and through the layer's input
norm at its actual scale; checked: these add up to the attention branch's gradient, the MLP input's
to the MLP branch's.

Added here, exact edge patching in float64 (the weights as transformers dequantizes them, cast up):
a forward written out with the model's own modules in which every reader (each head's q, each kv
head's k and v, each MLP, the logits) reads its own input. A circuit C is evaluated as
hannamw/EAP-IG's evaluate_graph does: the clean text runs, and each reader r reads
    in_r = resid_r + sum over edges u -> r not in C of (a_u(corrupt) - a_u(this run)).
Written: the metric of the empty circuit (= the corrupted run), the full one (= the clean run) and
the circuits of the top 0.1%, 1% and 5% of edges by |EAP-IG score|, each with its edge list; and a
sample of single edges (the top 20 by |EAP-IG| and 20 drawn at random) each patched alone in the
clean run (that edge carries a_u(corrupt)), as delta = m(patched) - m(clean).

Kept for the tests (tests/circuits.rs): per method the top 2,000 edges by |score| and 2,000 others
drawn at random (seed 58), as [from, to, score]; n_edges; both runs' metrics.
Gemma 3 (gemma): its <bos> first; the post-norms taken at each run's own scale (a head's node output is
its share of the post-normed attention output, (1 + w) / rms(o_proj's output) times z_h W_O^h; m{L} the
MLP's post-normed output), the q/k norms, the sliding layers' window and rotary base, all in float64.
Run: REF_MODEL_DIR=<folder with smollm2-135m.gguf, qwen2.5-coder-0.5b.gguf, gemma3-270m.gguf>
     python make_circuits_golden.py smol|qwen|gemma   (writes <m>_circuits.json beside this script)
transformers 5.25.0, torch 2.15.0, CPU, 2 threads. smol_circuits.json and gemma_circuits.json are this
script's; qwen_circuits.json is its version before the Gemma changes, whose float64 forward ran the norms
through transformers' modules (float32 inside): on SmolLM2 the two versions' patched metrics differ by
2.3e-6 at most, the scores not at all.
"""
import copy, json, os, random, sys
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL_DIR = os.environ.get("REF_MODEL_DIR", ".")
MODELS = {"smol": "smollm2-135m.gguf", "qwen": "qwen2.5-coder-0.5b.gguf", "gemma": "gemma3-270m.gguf"}
here = os.path.dirname(os.path.abspath(__file__))
m = sys.argv[1]
torch.set_num_threads(2)
g = MODELS[m]
tok = AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=g)
model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, gguf_file=g, dtype=torch.float32,
                                             attn_implementation="eager").eval()
cfg = model.config
L, H = cfg.num_hidden_layers, cfg.num_attention_heads
KV = cfg.num_key_value_heads
D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
G = H // KV
layers = model.model.layers
enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
# Gemma 3: its <bos> first (as its tokenizer and attnscope put it); each block's output goes through a
# post-norm before it joins the residual stream, and the MLP reads its own pre-norm
GEMMA = cfg.model_type.startswith("gemma")
text_ids = (lambda t: tok(t)["input_ids"]) if GEMMA else enc  # noqa: E731
mlp_norm = lambda lay: lay.pre_feedforward_layernorm if GEMMA else lay.post_attention_layernorm  # noqa: E731

clean = "After Alice and Bob walked to the park, Bob handed a ball to"
corrupt = "After Alice and Bob walked to the park, Alice handed a ball to"
names = (" Alice", " Bob")
ci, xi = text_ids(clean), text_ids(corrupt)
assert len(ci) == len(xi), (len(ci), len(xi))
ans, wrong = enc(names[0])[-1], enc(names[1])[-1]
n = len(ci)

up_names = ["input"] + [f"a{l}.h{h}" for l in range(L) for h in range(H)] + [f"m{l}" for l in range(L)]


def norm_weight(norm):
    """An RMSNorm's effective weight in float64: Gemma's norms multiply by (1 + w)."""
    w = norm.weight.detach().double()
    return 1.0 + w if GEMMA else w


def norm64(norm, x):
    """An RMSNorm in float64 (the modules compute in float32 whatever they are given)."""
    eps = getattr(norm, "variance_epsilon", None) or norm.eps
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight(norm)


def post_share(lay, proj):
    """Gemma's post-attention norm as a per-row factor of the run: (1 + w) / rms(o_proj's output)."""
    norm = lay.post_attention_layernorm
    r = torch.rsqrt(proj.pow(2).mean(-1, keepdim=True) + norm.eps)
    return r * (1.0 + norm.weight.detach().double())


def node_outputs(ids):
    """Every upstream node's output [n, d] (float64), and the logits. Gemma: a head's output is its
    share of the post-normed attention output (the post-norm's scale of this run), the MLP's is the
    post-normed MLP output."""
    z, mo, proj = {}, {}, {}
    hs = []
    for l in range(L):
        hs.append(layers[l].self_attn.o_proj.register_forward_pre_hook(
            lambda mod, a, l=l: z.__setitem__(l, a[0][0].detach().double())))
        hs.append(layers[l].self_attn.o_proj.register_forward_hook(
            lambda mod, a, o, l=l: proj.__setitem__(l, o[0].detach().double())))
        out_mod = layers[l].post_feedforward_layernorm if GEMMA else layers[l].mlp
        hs.append(out_mod.register_forward_hook(
            lambda mod, a, o, l=l: mo.__setitem__(l, o[0].detach().double())))
    with torch.no_grad():
        lg = model(torch.tensor([ids]), use_cache=False).logits[0]
        emb = model.model.embed_tokens(torch.tensor([ids]))[0].detach().double()
    for h_ in hs:
        h_.remove()
    out = {"input": emb}
    for l in range(L):
        Wo = layers[l].self_attn.o_proj.weight.detach().double()
        share = post_share(layers[l], proj[l]) if GEMMA else 1.0
        for h in range(H):
            s = slice(h * D, (h + 1) * D)
            out[f"a{l}.h{h}"] = (z[l][:, s] @ Wo[:, s].T) * share
        out[f"m{l}"] = mo[l]
    return out, lg


def rms_back(norm, x, gy):
    """Gradient at the norm's input x [n, d] from the gradient gy at its output (RMSNorm, f64; Gemma's
    (1 + w) form by autograd through a float64 copy of the norm)."""
    w = norm_weight(norm)
    eps = getattr(norm, "variance_epsilon", None) or norm.eps
    x = x.double(); gy = gy.double()
    r = torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    d = x.shape[-1]
    return (w * gy) / r - x * ((w * x * gy).sum(-1, keepdim=True)) / (d * r ** 3)


def input_grads(embeds):
    """dm/d(input of each downstream node) [n, d] at a run on these input embeddings."""
    saved = {}
    hs = []

    def keep(key):
        def f(t):
            saved[key] = t
        return f
    for l in range(L):
        at = layers[l].self_attn
        def pre(mod, a, kw, l=l):
            x_ = a[0] if a else kw["hidden_states"]
            saved[("resid_pre", l)] = x_.detach()
            x_.register_hook(keep(("g_resid_pre", l)))
        hs.append(layers[l].register_forward_pre_hook(pre, with_kwargs=True))
        for nm in ("q_proj", "k_proj", "v_proj"):
            hs.append(getattr(at, nm).register_forward_hook(
                lambda mod, a, o, l=l, nm=nm: (o.register_hook(keep((nm, l))), None)[1]))
        hs.append(layers[l].mlp.register_forward_pre_hook(
            lambda mod, a, l=l: (a[0].register_hook(keep(("mlp_in", l))), None)[1]))
        def mid(mod, a, l=l):
            saved[("resid_mid", l)] = a[0].detach()
            a[0].register_hook(keep(("g_resid_mid", l)))
        hs.append(mlp_norm(layers[l]).register_forward_pre_hook(mid))
    hs.append(model.model.norm.register_forward_pre_hook(
        lambda mod, a: (a[0].register_hook(keep("final")), None)[1]))
    e = embeds.clone().float().requires_grad_(True)
    lg = model(inputs_embeds=e[None], use_cache=False).logits[0]
    metric = lg[-1, ans] - lg[-1, wrong]
    metric.backward()
    for h_ in hs:
        h_.remove()
    grads = {"logits": saved["final"][0].double()}
    for l in range(L):
        at = layers[l].self_attn
        x = saved[("resid_pre", l)][0]
        for h in range(H):
            s = slice(h * D, (h + 1) * D)
            gy = saved[("q_proj", l)][0][:, s].double() @ at.q_proj.weight.detach().double()[s]
            grads[f"a{l}.h{h}.q"] = rms_back(layers[l].input_layernorm, x, gy)
        for kv in range(KV):
            s = slice(kv * D, (kv + 1) * D)
            for nm, key in (("k_proj", "k"), ("v_proj", "v")):
                gy = saved[(nm, l)][0][:, s].double() @ getattr(at, nm).weight.detach().double()[s]
                grads[f"a{l}.kv{kv}.{key}"] = rms_back(layers[l].input_layernorm, x, gy)
        grads[f"m{l}"] = rms_back(mlp_norm(layers[l]), saved[("resid_mid", l)][0],
                                  saved[("mlp_in", l)][0])
        # self-check: the attention inputs' gradients add up to the attention branch's gradient
        branch = saved[("g_resid_pre", l)][0].double() - saved[("g_resid_mid", l)][0].double()
        parts = sum(grads[f"a{l}.h{h}.q"] for h in range(H)) + sum(
            grads[f"a{l}.kv{kv}.{x}"] for kv in range(KV) for x in "kv")
        err = float((parts - branch).abs().max() / (branch.abs().max() + 1e-30))
        assert err < 1e-3, (l, err)
        mlp_branch = saved[("g_resid_mid", l)][0].double() - (saved[("g_resid_pre", l + 1)][0].double()
                                                             if l + 1 < L else saved["final"][0].double())
        err = float((grads[f"m{l}"] - mlp_branch).abs().max() / (mlp_branch.abs().max() + 1e-30))
        assert err < 1e-3, ("mlp", l, err)
    return grads, float(metric.detach())


def layer_of(name):
    return -1 if name == "input" else int(name[1:].split(".")[0])


def edges_of():
    out = []
    for v_layer in range(L):
        downs = [f"a{v_layer}.h{h}.q" for h in range(H)] + [f"a{v_layer}.kv{k}.{x}" for k in range(KV) for x in "kv"]
        ups = [u for u in up_names if (u == "input" or layer_of(u) < v_layer)]
        out += [(u, d) for d in downs for u in ups]
        ups_m = [u for u in up_names if u == "input" or layer_of(u) < v_layer or (u.startswith("a") and layer_of(u) == v_layer)]
        out += [(u, f"m{v_layer}") for u in ups_m]
    out += [(u, "logits") for u in up_names]
    return out


acts_c, lc = node_outputs(ci)
acts_x, lx = node_outputs(xi)
delta = {u: acts_x[u] - acts_c[u] for u in up_names}
edges = edges_of()
with torch.no_grad():  # the input to layer 0 (Gemma's embeddings come scaled)
    emb_c = model.model.embed_tokens(torch.tensor([ci]))[0].detach()
    emb_x = model.model.embed_tokens(torch.tensor([xi]))[0].detach()
gc, mc = input_grads(emb_c)
eap = [[u, v, float((delta[u] * gc[v]).sum())] for u, v in edges]
k = 5
acc = None
for i in range(k):
    a = (i + 0.5) / k
    gi, _ = input_grads(emb_x + a * (emb_c - emb_x))
    acc = gi if acc is None else {key: acc[key] + gi[key] for key in acc}
eap_ig = [[u, v, float((delta[u] * acc[v] / k).sum())] for u, v in edges]
print(m, len(edges), "edges; clean metric", mc, "largest |eap|", max(abs(e[2]) for e in eap), flush=True)

# --- exact edge patching, float64 ------------------------------------------------------------------
m64 = copy.deepcopy(model).double()
L64 = m64.model.layers
pos_ids = torch.arange(n)[None]
x_dummy = torch.zeros(1, n, cfg.hidden_size, dtype=torch.float64)
if GEMMA:  # one rotary table per layer type (local and global bases)
    tables = {t: m64.model.rotary_emb(x_dummy, pos_ids, t) for t in set(cfg.layer_types)}
    rope_of = {l: tables[cfg.layer_types[l]] for l in range(L)}
else:
    t = m64.model.rotary_emb(x_dummy, pos_ids)
    rope_of = {l: t for l in range(L)}
up_index = {u: i for i, u in enumerate(up_names)}


def mask_of(at):
    """Causal, and a sliding window's (a query sees itself and the window - 1 keys before it)."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    hidden = j > i
    if getattr(at, "sliding_window", None):
        hidden = hidden | (j <= i - at.sliding_window)
    return torch.zeros(n, n, dtype=torch.float64).masked_fill(hidden, float("-inf"))


def rope(x, l):  # x [n, heads, D], rotate_half convention (transformers' for these families)
    cos, sin = (t[0][:, None] for t in rope_of[l])
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], -1)
    return x * cos + rot * sin


def ups_of(reader):
    if reader == "logits":
        return up_names
    lr = layer_of(reader)
    attn = not reader.startswith("m")
    return [u for u in up_names if u == "input" or layer_of(u) < lr or
            (not attn and u.startswith("a") and layer_of(u) == lr)]


def attention64(l, read, x, nodes):
    """Layer l's heads' outputs {a{l}.h{h}: [n, d]} from each reader's own input."""
    lay, at = L64[l], L64[l].self_attn
    def proj(r, mod, s, qk_norm):
        y = mod(norm64(lay.input_layernorm, read(r, x, nodes)))[:, s]
        return norm64(qk_norm, y) if qk_norm is not None else y
    qn, kn = (at.q_norm, at.k_norm) if GEMMA else (None, None)
    q = torch.stack([proj(f"a{l}.h{h}.q", at.q_proj, slice(h * D, (h + 1) * D), qn) for h in range(H)], 1)
    kk = torch.stack([proj(f"a{l}.kv{g_}.k", at.k_proj, slice(g_ * D, (g_ + 1) * D), kn) for g_ in range(KV)], 1)
    vv = torch.stack([proj(f"a{l}.kv{g_}.v", at.v_proj, slice(g_ * D, (g_ + 1) * D), None) for g_ in range(KV)], 1)
    q, kk = rope(q, l), rope(kk, l)
    Wo, mask = at.o_proj.weight.detach(), mask_of(at)
    heads = {}
    for h in range(H):
        sc = q[:, h] @ kk[:, h // G].T * at.scaling
        if getattr(at, "attn_logit_softcapping", None):
            sc = torch.tanh(sc / at.attn_logit_softcapping) * at.attn_logit_softcapping
        zh = torch.softmax(sc + mask, -1) @ vv[:, h // G]
        heads[f"a{l}.h{h}"] = zh @ Wo[:, h * D:(h + 1) * D].T
    if GEMMA:  # each head's share of the post-normed output, at this run's scale
        share = post_share(lay, sum(heads.values()))
        heads = {k: v * share for k, v in heads.items()}
    return heads


def forward64(ids, read):
    """The float64 forward with every reader's input from read(reader, resid, nodes); the metric and
    the nodes' outputs {name: [n, d]}."""
    with torch.no_grad():
        nodes = {"input": m64.model.embed_tokens(torch.tensor([ids]))[0]}
        x = nodes["input"].clone()
        for l in range(L):
            lay = L64[l]
            heads = attention64(l, read, x, nodes)
            nodes.update(heads)
            bias = lay.self_attn.o_proj.bias
            x = x + sum(heads.values()) + (bias.detach() if bias is not None else 0)
            out = lay.mlp(norm64(mlp_norm(lay), read(f"m{l}", x, nodes)))
            nodes[f"m{l}"] = norm64(lay.post_feedforward_layernorm, out) if GEMMA else out
            x = x + nodes[f"m{l}"]
        lg = m64.lm_head(norm64(m64.model.norm, read("logits", x, nodes)))[-1]
        cap = getattr(cfg, "final_logit_softcapping", None)
        if cap:
            lg = torch.tanh(lg / cap) * cap
    return float(lg[ans] - lg[wrong]), nodes


def plain(r, x, nodes):
    return x


mc64, nodes_c = forward64(ci, plain)
mx64, nodes_x = forward64(xi, plain)
assert abs(mc64 - mc) < 1e-3 and abs(mx64 - float(lx[-1, ans] - lx[-1, wrong])) < 1e-3, (mc64, mc, mx64)
corr_stack = torch.stack([nodes_x[u] for u in up_names])  # [U, n, d]


def circuit_reader(in_circuit):
    """read() of a circuit: each reader's edges not in the circuit carry the corrupted outputs."""
    def read(r, x, nodes):
        ups = ups_of(r)
        out_mask = torch.tensor([0.0 if (u, r) in in_circuit else 1.0 for u in ups], dtype=torch.float64)
        if out_mask.sum() == 0:
            return x
        idx = [up_index[u] for u in ups]
        cur = torch.stack([nodes[u] for u in ups])
        return x + torch.einsum("u,und->nd", out_mask, corr_stack[idx] - cur)
    return read


by_ig = sorted(range(len(edges)), key=lambda i: -abs(eap_ig[i][2]))
empty, _ = forward64(ci, circuit_reader(set()))
full, _ = forward64(ci, circuit_reader(set(edges)))
assert abs(empty - mx64) < 1e-9 and abs(full - mc64) < 1e-9, (empty, mx64, full, mc64)
circuits = []
for frac in (0.001, 0.01, 0.05):
    top = [edges[i] for i in by_ig[:int(frac * len(edges))]]
    val, _ = forward64(ci, circuit_reader(set(top)))
    circuits.append({"fraction": frac, "edges": [list(e) for e in top], "metric": val})
    print(m, "circuit", frac, len(top), "edges: metric", val, "faithfulness", (val - mx64) / (mc64 - mx64), flush=True)

rng = random.Random(58)
single = by_ig[:20] + rng.sample(by_ig[20:], 20)
singles = []
for i in single:
    u, r = edges[i]
    d = nodes_x[u] - nodes_c[u]
    val, _ = forward64(ci, lambda rr, x, nodes, r=r, d=d: x + d if rr == r else x)
    singles.append({"from": u, "to": r, "delta": val - mc64, "eap_ig": eap_ig[i][2], "eap": eap[i][2]})
print(m, "single edges: top", singles[0], flush=True)


def kept(scores):
    order = sorted(range(len(scores)), key=lambda i: -abs(scores[i][2]))
    rest = random.Random(58).sample(order[2000:], 2000)
    return [scores[i] for i in order[:2000] + rest]


out = {"model_file": g, "clean": clean, "corrupt": corrupt, "clean_ids": ci, "corrupt_ids": xi,
       "answer_id": ans, "wrong_id": wrong, "clean_metric": mc,
       "corrupt_metric": float(lx[-1, ans] - lx[-1, wrong]), "n_edges": len(edges),
       "max_abs_eap": max(abs(e[2]) for e in eap), "max_abs_eap_ig": max(abs(e[2]) for e in eap_ig),
       "eap": kept(eap), "eap_ig": kept(eap_ig), "eap_ig_steps": k,
       "patching": {"clean_metric": mc64, "corrupt_metric": mx64, "empty": empty, "full": full,
                    "circuits": circuits, "single_edges": singles}}
json.dump(out, open(os.path.join(here, f"{m}_circuits.json"), "w"))
