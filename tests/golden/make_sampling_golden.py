# The distribution `generate` samples its first token from, as transformers defines it: the
# logits through TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper (the order
# GenerationMixin._get_logits_processor applies them), then softmax. Computed in float64 (the
# warpers run on a float64 tensor) for
# - synthetic logits (`cases`): small vectors made to put top-p's boundary on a token of large
#   probability (is the token whose cumulative probability crosses p kept?), top-k's cut inside
#   a tie (transformers keeps every token equal to the k-th largest), and a mixed case;
# - SmolLM2-135M's next-token logits after PROMPT (transformers eager float32 from the GGUF,
#   `smol`): per configuration how many tokens are kept, the probability of each kept token of
#   at least 1e-4 (`listed`) and the sum of the others (`rest`), and the margin of
#   top-p's decision (how far the kept tokens' cumulative probability before the last one is
#   below p, and the cumulative with it above p), so a test knows the boundary is not a rounding.
#
# Run with ~/.hfenv (transformers + torch + numpy), the GGUF in $ATTNSCOPE_CACHE/models:
#   ATTNSCOPE_CACHE=/work/cache ~/.hfenv/bin/python tests/golden/make_sampling_golden.py
# writes tests/golden/sampling_ref.json.
import json, os
import numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

PROMPT = "My favourite animal is the"
LISTED = 1e-4  # tokens kept with at least this probability are listed one by one, the rest summed
here = os.path.dirname(os.path.abspath(__file__))
cache = os.environ.get("ATTNSCOPE_CACHE", os.path.expanduser("~/.cache/attnscope"))
torch.set_num_threads(2)


def warped(logits, t, k, p):
    """Transformers' distribution after temperature t, top-k k (0: none), top-p p (1: none)."""
    s = torch.tensor([logits], dtype=torch.float64)
    ids = torch.zeros((1, 1), dtype=torch.long)
    s = TemperatureLogitsWarper(t)(ids, s)
    if k > 0:
        s = TopKLogitsWarper(k)(ids, s)
    if p < 1.0:
        s = TopPLogitsWarper(p)(ids, s)
    probs = torch.softmax(s, -1)[0].numpy()
    kept = np.nonzero(probs)[0]
    listed = [i for i in kept if probs[i] >= LISTED]
    return {"kept": int(len(kept)), "listed": {str(i): float(probs[i]) for i in listed},
            "rest": float(1.0 - sum(probs[i] for i in listed))}


def top_p_margin(logits, t, k, p):
    """Below and above p: the kept tokens' cumulative probability without and with the last."""
    z = np.asarray(logits, dtype=np.float64) / t
    order = np.argsort(-z, kind="stable")
    if k > 0:
        order = order[:k]
    q = np.exp(z[order] - z[order].max())
    c = np.cumsum(q / q.sum())
    j = int(np.searchsorted(c, p))  # the first token whose cumulative reaches p
    return {"before": float(c[j - 1]) if j > 0 else 0.0, "with": float(c[min(j, len(c) - 1)])}


def configs(logits):
    out = []
    for t, k, p in [(1.0, 0, 1.0), (0.7, 20, 1.0), (1.0, 0, 0.24), (0.8, 40, 0.9)]:
        out.append({"temperature": t, "top_k": k, "top_p": p, "probs": warped(logits, t, k, p),
                    "top_p_margin": top_p_margin(logits, t, k, p) if p < 1 else None})
    return out


# synthetic cases: probabilities 0.4, 0.35, 0.25 (top-p 0.5 must keep the 0.35 that crosses it;
# 0.74 keeps two, 0.76 three); logits with a tie just below top-k's cut; a mixed case
cases = []
three = np.log([0.4, 0.35, 0.25]).tolist()
for p in (0.5, 0.74, 0.76):
    cases.append({"name": f"three_p{p}", "logits": three, "temperature": 1.0, "top_k": 0,
                  "top_p": p, "probs": warped(three, 1.0, 0, p)})
ties = [2.0, 1.5, 1.0, 1.0, 0.5, 0.0]
cases.append({"name": "top_k_3_cut_in_a_tie", "logits": ties, "temperature": 1.0, "top_k": 3,
              "top_p": 1.0, "probs": warped(ties, 1.0, 3, 1.0)})
rng = np.random.default_rng(55)
mixed = (rng.standard_normal(32) * 1.5).tolist()
cases.append({"name": "mixed", "logits": mixed, "temperature": 0.9, "top_k": 12, "top_p": 0.85,
              "probs": warped(mixed, 0.9, 12, 0.85)})

gguf = os.path.join(cache, "models", "smollm2-135m.gguf")
d, f = os.path.split(gguf)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32,
                                             attn_implementation="eager").eval()
ids = tok(PROMPT)["input_ids"]
with torch.no_grad():
    logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].double().numpy()
smol = {"prompt": PROMPT, "token_ids": ids, "configs": configs(logits.tolist())}
for c in smol["configs"]:
    print(c["temperature"], c["top_k"], c["top_p"], c["probs"]["kept"], "kept;",
          len(c["probs"]["listed"]), "listed; margin", c["top_p_margin"], "max",
          max(c["probs"]["listed"].values()))
json.dump({"producer": "tests/golden/make_sampling_golden.py: transformers' TemperatureLogitsWarper, "
                       "TopKLogitsWarper, TopPLogitsWarper in float64; SmolLM2 logits from "
                       "transformers eager float32 from the GGUF",
           "cases": cases, "smol": smol},
          open(os.path.join(here, "sampling_ref.json"), "w"), indent=0)
