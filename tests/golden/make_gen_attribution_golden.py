#!/usr/bin/env python
"""Reference for `generate --attribute` (issue #40, item 3) on SmolLM2-135M: transformers eager f32
(GGUF dequantized), torch autograd. A chat prompt through the model's own template (generation
prompt added), a greedy answer of up to MAX_NEW tokens (stopping at an end-of-turn/eos token), then
teacher-forced, for each answer token j (input: prompt + answer[:j], target answer[j], f = log p):
- logprob[j]: f;
- l2[j][i] = ||df/dx_i||, gxi[j][i] = df/dx_i . x_i (x: the input embeddings), over positions i < P + j;
- ig[j][i]: integrated gradients from the zero embedding, IG_STEPS midpoints, summed over the width;
- occlusion[j][i] = f(input) - f(input without token i) (deletion), for every i < P + j.
Writes smol_gen_attribution.json beside this script.
Usage: REF_MODEL_DIR=<folder with SmolLM2-135M-Instruct.Q4_1.gguf> python make_gen_attribution_golden.py"""
import json, os
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

QUESTION, MAX_NEW, IG_STEPS = "What is the capital of Vietnam?", 8, 8
MODEL_DIR = os.environ.get("REF_MODEL_DIR", ".")
G = "SmolLM2-135M-Instruct.Q4_1.gguf"
here = os.path.dirname(os.path.abspath(__file__))
torch.set_num_threads(2)
tok = AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=G)
model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, gguf_file=G, dtype=torch.float32,
                                             attn_implementation="eager").eval()
for p in model.parameters():
    p.requires_grad_(False)
emb = model.get_input_embeddings()
stops = {i for i in [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")] if isinstance(i, int) and i >= 0}
ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True)
if hasattr(ids, "keys"):
    ids = ids["input_ids"]
prompt = list(ids)
seq, answer = list(prompt), []
with torch.inference_mode():
    for _ in range(MAX_NEW):
        nxt = int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax())
        answer.append(nxt); seq.append(nxt)
        if nxt in stops:
            break


def logp(x, target):
    return torch.log_softmax(model(inputs_embeds=x, use_cache=False).logits[0, -1].double(), -1)[target]


P = len(prompt)
out = {"model_file": G, "question": QUESTION, "prompt_ids": prompt, "answer_ids": answer, "ig_steps": IG_STEPS,
       "logprob": [], "l2": [], "gxi": [], "ig": [], "occlusion": []}
for j, target in enumerate(answer):
    inp = seq[:P + j]
    x = emb(torch.tensor([inp])).detach().clone().requires_grad_(True)
    f = logp(x, target)
    f.backward()
    g = x.grad[0]
    out["logprob"].append(float(f))
    out["l2"].append(g.norm(dim=-1).tolist())
    out["gxi"].append((g * x[0]).sum(-1).tolist())
    total = torch.zeros_like(x[0])
    for k in range(IG_STEPS):
        xa = (x.detach() * ((k + 0.5) / IG_STEPS)).requires_grad_(True)
        logp(xa, target).backward()
        total += xa.grad[0]
    out["ig"].append(((total / IG_STEPS) * x.detach()[0]).sum(-1).tolist())
    occ = []
    with torch.inference_mode():
        for i in range(len(inp)):
            v = inp[:i] + inp[i + 1:]
            occ.append(float(f.detach()) - float(logp(emb(torch.tensor([v])), target)) if v else None)
    out["occlusion"].append(occ)
    print(j, repr(tok.decode([target])), "logp", float(f), flush=True)
json.dump(out, open(os.path.join(here, "smol_gen_attribution.json"), "w"))
