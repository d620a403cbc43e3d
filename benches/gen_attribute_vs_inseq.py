#!/usr/bin/env python
"""Attribution of a generated answer, side by side in one run: `attnscope generate --attribute
occlusion` (one forward per deleted token gives every answer token's cell, teacher-forced) against
inseq's occlusion on transformers (the same GGUF dequantized to float32, eager) for a ~50-token
prompt and a 40-token answer, the answer teacher-forced on both sides (inseq gets attnscope's greedy
answer as `generated_texts`). Only the attribution is timed (attnscope's `attribution.seconds`;
inseq's `model.attribute`), not loading or generating.

inseq is not a dependency: install it beside the reference Python without touching its torch, e.g.
  ~/.hfenv/bin/python -m pip install --target /tmp/inseqlib --no-deps inseq captum jaxtyping typeguard \
      matplotlib pillow pyparsing cycler python-dateutil kiwisolver fonttools treescope
Use: ~/.hfenv/bin/python benches/gen_attribute_vs_inseq.py [--inseq-path /tmp/inseqlib] [--model smollm2-135m]
Note: inseq's (Captum's) occlusion replaces a token's embedding by zeros; attnscope's deletes the
token (as `attribute --method occlusion`); each is one forward per occluded token and target.
"""
import argparse, json, os, subprocess, sys, time

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="qwen2.5-coder-0.5b")
ap.add_argument("--bin", default="target/release/attnscope")
ap.add_argument("--inseq-path", default="/tmp/inseqlib")
ap.add_argument("--prompt-len", type=int, default=50)
ap.add_argument("--new", type=int, default=40)
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()
sys.path.insert(0, a.inseq_path)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
import inseq  # noqa: E402

torch.set_num_threads(a.threads)
gguf = os.path.expanduser(f"~/.cache/attnscope/models/{a.model}.gguf")
d, f = os.path.split(gguf)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
story = ("The old library in the centre of Hanoi keeps maps of the city from every century. Visitors "
         "come to see how the lakes, the river and the streets of the old quarter changed, and the "
         "librarian tells them a story about each map before they leave.")
ids = tok(story, add_special_tokens=False)["input_ids"][: a.prompt_len]
prompt = tok.decode(ids)

# attnscope: generate greedily, then attribute the answer (the timing it reports is the attribution)
out = subprocess.run([a.bin, "generate", "-m", a.model, "--text", prompt, "--max-new-tokens", str(a.new),
                      "--attribute", "occlusion", "--json"], capture_output=True, text=True, check=True)
r = json.loads(out.stdout)
at = r["attribution"]
p_len, n_ans = len(at["prompt_tokens"]), len(at["answer_tokens"])
answer_ids = [t["id"] for t in r["generated"]]
answer = tok.decode(answer_ids)
ours = at["seconds"]
print(f"attnscope: {p_len} prompt + {n_ans} answer tokens, occlusion {ours:.2f} s; inseq next", file=sys.stderr, flush=True)

model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, attn_implementation="eager").eval()
im = inseq.load_model(model, "occlusion", tokenizer=tok)
t0 = time.perf_counter()
res = im.attribute(input_texts=prompt, generated_texts=prompt + answer, show_progress=False)
theirs = time.perf_counter() - t0
sa = res.sequence_attributions[0]
print(json.dumps({
    "model": a.model, "prompt_tokens": p_len, "answer_tokens": n_ans,
    "inseq_target_tokens": len(sa.target) - len(sa.source) if sa.target is not None else None,
    "attnscope_occlusion_s": round(ours, 3), "inseq_occlusion_s": round(theirs, 3),
    "speedup": round(theirs / ours, 2), "threads": a.threads,
}, indent=1))
