# Integrated gradients of Qwen2.5-Coder-0.5B on the lesson's sentence in float64: torch autograd
# through transformers' eager forward with every weight (dequantized from the GGUF to float32, as
# ../shared/reference/scripts/gradient_ref.py loads them) cast to float64, and the embeddings too.
# The same definition as gradient_ref.py (log p of the target at the last position, 32 midpoint
# steps from the zero embedding, per token the sum over the width of x · mean gradient, the
# completeness gap), computed in float64 instead of float32.
#
# Why: on Qwen2.5 the first midpoints (α = 1/64, 3/64) put layer 0's attention where f32 is
# ill-conditioned (tiny inputs beside large q/k biases), so an f32 autograd reference is itself
# off: gradient_ref.py's f32 gradient × input at α = 1/64 is 1.9 from this script's (of 156),
# attnscope's 0.85; with layer 0's attention alone in float64 the f32 reference is 0.08 off.
#
# Run with ~/.hfenv (transformers + torch + accelerate), the GGUF in $ATTNSCOPE_CACHE/models:
#   ATTNSCOPE_CACHE=/work/cache ~/.hfenv/bin/python tests/golden/make_ig_f64_golden.py
# writes tests/golden/qwen_ig_f64.json (about 15 minutes on 2 busy cores).
import json, os
import torch
from transformers import AutoModelForCausalLM

here = os.path.dirname(os.path.abspath(__file__))
cache = os.environ.get("ATTNSCOPE_CACHE", os.path.expanduser("~/.cache/attnscope"))
torch.set_num_threads(2)
model = AutoModelForCausalLM.from_pretrained(os.path.join(cache, "models"),
                                             gguf_file="qwen2.5-coder-0.5b.gguf",
                                             dtype=torch.float32, attn_implementation="eager")
model = model.eval().double()
for p in model.parameters():
    p.requires_grad_(False)
ref = json.load(open(os.path.join(here, "qwen_gradients.json")))["texts"]["lesson"]
ids, target = ref["token_ids"], ref["target_id"]
x = model.get_input_embeddings()(torch.tensor([ids])).detach()


def logp(inputs):
    return torch.log_softmax(model(inputs_embeds=inputs, use_cache=False).logits[0, -1], -1)[target]


steps, total = 32, torch.zeros_like(x[0])
for k in range(steps):
    xa = (x * ((k + 0.5) / steps)).requires_grad_(True)
    logp(xa).backward()
    total += xa.grad[0]
    print("step", k, flush=True)
ig = (total / steps) * x[0]
with torch.no_grad():
    f, f0 = float(logp(x)), float(logp(torch.zeros_like(x)))
json.dump({"producer": "tests/golden/make_ig_f64_golden.py: torch autograd in float64 through "
                       "transformers' eager forward, weights from the GGUF",
           "token_ids": ids, "target_id": target, "logprob": f, "steps": steps,
           "ig": ig.sum(-1).tolist(), "ig_completeness_gap": float(ig.sum()) - (f - f0)},
          open(os.path.join(here, "qwen_ig_f64.json"), "w"))
print("gap", float(ig.sum()) - (f - f0))
