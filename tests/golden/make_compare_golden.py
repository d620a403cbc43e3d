# `attnscope compare` of two texts on one model, from Hugging Face transformers (eager, float32,
# weights dequantized from the same GGUF, output_attentions=True) and NumPy float64: per side the
# token ids, the last query's attention row of every layer and head, the sink shares (the last
# query's weight on key 0, and the mean over queries 1..n-1, each averaged over heads) and the
# next-token top-5 probabilities; per head the Jensen-Shannon divergence (bits) of the two sides'
# last-query rows aligned by key position (a shorter row is 0 beyond its end), per layer its mean
# over heads and the divergence of the head-averaged rows. The texts are the lesson's sentence and
# the same sentence ending in "miền Nam." (one token differs), each with the model's own BOS.
#
# Run with ~/.hfenv (transformers + torch + numpy), the GGUFs in $ATTNSCOPE_CACHE/models:
#   ATTNSCOPE_CACHE=/work/cache ~/.hfenv/bin/python tests/golden/make_compare_golden.py
# writes tests/golden/compare_ref.json (qwen2.5-coder-0.5b and gemma3-270m).
import json, os
import numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TEXTS = ["Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc.",
         "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Nam."]
MODELS = ["qwen2.5-coder-0.5b", "gemma3-270m"]
cache = os.environ.get("ATTNSCOPE_CACHE", os.path.expanduser("~/.cache/attnscope"))
torch.set_num_threads(2)


def js_bits(p, q):
    """Jensen-Shannon divergence in bits of two rows aligned by position, in float64."""
    n = max(len(p), len(q))
    a, b = np.zeros(n), np.zeros(n)
    a[:len(p)], b[:len(q)] = p, q
    a, b = a / a.sum(), b / b.sum()
    m = 0.5 * (a + b)
    kl = lambda x: float(np.sum(x[x > 0] * np.log2(x[x > 0] / m[x > 0])))
    return 0.5 * kl(a) + 0.5 * kl(b)


def side(model, tok, text):
    ids = tok(text)["input_ids"]  # the tokenizer's own BOS: none for Qwen2.5, <bos> for Gemma 3
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True, use_cache=False)
    att = np.stack([a[0].double().numpy() for a in out.attentions])  # [L, H, n, n]
    n = len(ids)
    p = torch.softmax(out.logits[0, -1].double(), -1)
    top = torch.topk(p, 5)
    return {
        "token_ids": ids,
        # [L][H][n], 8 significant digits (the weights are float32's)
        "rows": [[[float(f"{w:.8g}") for w in r] for r in layer] for layer in att[:, :, n - 1, :]],
        "sink_query": att[:, :, n - 1, 0].mean(axis=1).tolist(),
        "sink_all": att[:, :, 1:, 0].mean(axis=(1, 2)).tolist(),
        "next_token": [{"id": int(i), "prob": float(v)} for v, i in zip(top.values, top.indices)],
    }


out = {"producer": "tests/golden/make_compare_golden.py: transformers eager float32 from the GGUF, "
                   "NumPy float64", "texts": TEXTS, "models": {}}
for alias in MODELS:
    gguf = os.path.join(cache, "models", alias + ".gguf")
    d, f = os.path.split(gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    a, b = (side(model, tok, t) for t in TEXTS)
    ra, rb = np.array(a["rows"]), np.array(b["rows"])
    L, H = ra.shape[:2]
    js = [[js_bits(ra[l, h], rb[l, h]) for h in range(H)] for l in range(L)]
    out["models"][alias] = {
        "a": a, "b": b, "js": js,
        "mean_js": [float(np.mean(js[l])) for l in range(L)],
        "head_mean_js": [js_bits(ra[l].mean(0), rb[l].mean(0)) for l in range(L)],
    }
    print(alias, len(a["token_ids"]), len(b["token_ids"]), "tokens; max JS", np.max(js), flush=True)
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "compare_ref.json"), "w") as fh:
    json.dump(out, fh, ensure_ascii=False)
