# `attnscope sinks` on Gemma 3 270M, from Hugging Face transformers (eager, float32, weights
# dequantized from the same GGUF, output_attentions=True; sliding-window layers as transformers
# masks them) and NumPy float64, on the 765-token text of gemma_long.json (<bos> first, longer
# than the 512-token window). Per layer and head, over every query of the text:
#   first_token     α₁, the mean over queries 1..n-1 of the weight on key 0
#   mean_entropy    the mean over all queries of the row's entropy (nats)
#   mean_max_weight the mean over all queries of the row's largest weight
#   concentrated    the fraction of queries whose largest weight is >= 0.9
#   last_first      the last query's weight on key 0
#   last_top        the last query's 5 largest weights (position, weight), largest first
# with, per layer, sink_all_queries (the head mean of α₁) and sink_last_query (of last_first);
# `near_0_9` counts the (head, query) rows whose largest weight is within 1e-4 of 0.9 (where an
# f32 rounding may move a row across the threshold). Gu et al.'s Sink₁^ε as `sinks` runs it:
# 8 prompts of 64 tokens (<bos> + 63 tokens of the text after its <bos>, in order), per prompt
# and head α = the mean weight on key 0 over all 64 queries (the first token's own row included),
# per layer the share of heads with α > 0.3 averaged over the prompts; `gu_margin` is the
# smallest |α − 0.3|. The next token's id and probability after the whole text.
#
# Run with ~/.hfenv (transformers + torch + numpy), the GGUF in $ATTNSCOPE_CACHE/models:
#   ATTNSCOPE_CACHE=/work/cache ~/.hfenv/bin/python tests/golden/make_gemma_sinks_golden.py
# writes tests/golden/gemma_sinks.json.
import json, os
import numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer

here = os.path.dirname(os.path.abspath(__file__))
cache = os.environ.get("ATTNSCOPE_CACHE", os.path.expanduser("~/.cache/attnscope"))
torch.set_num_threads(2)
gguf = os.path.join(cache, "models", "gemma3-270m.gguf")
d, f = os.path.split(gguf)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32,
                                             attn_implementation="eager").eval()
long = json.load(open(os.path.join(here, "gemma_long.json")))
ids = tok(long["text"])["input_ids"]
assert ids == long["token_ids"], "the tokenizer splits gemma_long.json's text differently"


def attentions(ids):
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True, use_cache=False)
    return out, [a[0].double().numpy() for a in out.attentions]  # per layer [H, n, n]


out, att = attentions(ids)
n = len(ids)
layers, near = [], 0
for l, a in enumerate(att):
    mx = a.max(axis=-1)  # [H, n]
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(a > 0, a * np.log(a), 0.0).sum(-1)
    near += int((np.abs(mx - 0.9) < 1e-4).sum())
    heads = []
    for h in range(a.shape[0]):
        last = a[h, n - 1]
        order = np.argsort(-last, kind="stable")[:5]
        heads.append({"head": h, "first_token": float(a[h, 1:, 0].mean()),
                      "mean_entropy": float(ent[h].mean()), "mean_max_weight": float(mx[h].mean()),
                      "concentrated": float((mx[h] >= 0.9).mean()), "last_first": float(last[0]),
                      "last_top": [[int(i), float(last[i])] for i in order]})
    layers.append({"layer": l, "sink_all_queries": float(np.mean([h["first_token"] for h in heads])),
                   "sink_last_query": float(np.mean([h["last_first"] for h in heads])),
                   "heads": heads})
p = torch.softmax(out.logits[0, -1].double(), -1)
body, eps, gu_len, gu_prompts = ids[1:], 0.3, 64, 8
prompts = [[ids[0]] + body[i * (gu_len - 1):(i + 1) * (gu_len - 1)] for i in range(gu_prompts)]
per_layer, margin = np.zeros(len(att)), 1.0
for pr in prompts:
    _, pa = attentions(pr)
    for l, a in enumerate(pa):
        alpha = a[:, :, 0].mean(axis=1)  # [H], every query (0..n-1)
        margin = min(margin, float(np.abs(alpha - eps).min()))
        per_layer[l] += (alpha > eps).mean() / len(prompts)
json.dump({"producer": "tests/golden/make_gemma_sinks_golden.py: transformers eager float32 from "
                       "the gemma3-270m GGUF, NumPy float64",
           "n_tokens": n, "near_0_9": near, "layers": layers,
           "next_token": {"id": int(p.argmax()), "prob": float(p.max())},
           "gu": {"epsilon": eps, "prompt_len": gu_len, "prompts": gu_prompts,
                  "per_layer": per_layer.tolist(), "metric": float(per_layer.mean()),
                  "gu_margin": margin}},
          open(os.path.join(here, "gemma_sinks.json"), "w"), indent=0)
print("n", n, "rows near 0.9:", near, "gu margin", margin)
