#!/usr/bin/env python
"""Decoding speed, side by side in one run: `attnscope generate` (KV cache, per-token attention
statistics on) against transformers' `generate` (its KV cache, sdpa, greedy) on the same GGUF
dequantized to float32, a prompt of ~500 tokens and 128 new tokens. Decoding tokens/s counts the
steps after the first token (the prompt's forward is timed apart, as prefill).
Use: ~/.hfenv/bin/python benches/generate_vs_hf.py [--model qwen2.5-coder-0.5b] [--bin target/release/attnscope]
"""
import argparse, json, os, subprocess, time

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="qwen2.5-coder-0.5b")
ap.add_argument("--bin", default="target/release/attnscope")
ap.add_argument("--prompt-len", type=int, default=500)
ap.add_argument("--new", type=int, default=128)
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
torch.set_num_threads(a.threads)
gguf = os.path.expanduser(f"~/.cache/attnscope/models/{a.model}.gguf")
d, f = os.path.split(gguf)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
sentence = "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc."
ids = tok(sentence, add_special_tokens=False)["input_ids"]
while len(ids) < a.prompt_len:
    ids += tok(" " + sentence, add_special_tokens=False)["input_ids"]
ids = ids[: a.prompt_len]
text = tok.decode(ids)
# attnscope: the same text (its tokenizer gives the same ids: checked below)
out = subprocess.run([a.bin, "generate", "-m", a.model, "--text", text, "--max-new-tokens", str(a.new), "--json"],
                     capture_output=True, text=True, check=True)
j = json.loads(out.stdout)
ours = {"prompt_tokens": len(j["prompt_ids"]), "same_prompt_ids": j["prompt_ids"] == ids,
        "new_tokens": len(j["generated"]), "prefill_s": j["prefill_s"], "decode_tokens_per_s": j["decode_tokens_per_s"]}
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, attn_implementation="sdpa").eval()
x = torch.tensor([j["prompt_ids"]])
with torch.inference_mode():
    t0 = time.perf_counter()
    model(x, use_cache=False)  # warm-up and prefill time
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = model.generate(x, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False, use_cache=True)
    total = time.perf_counter() - t0
n_new = g.shape[1] - x.shape[1]
hf = {"new_tokens": n_new, "prefill_s": prefill, "total_s": total,
      "decode_tokens_per_s": (n_new - 1) / max(total - prefill, 1e-9)}
hf_ids = g[0, x.shape[1]:].tolist()
same = hf_ids[: len(j["generated"])] == [t["id"] for t in j["generated"]]
print(json.dumps({"attnscope": ours, "transformers": hf, "same_greedy_tokens": same,
                  "decode_speedup": ours["decode_tokens_per_s"] / hf["decode_tokens_per_s"]}, indent=1))
