#!/usr/bin/env python
# The Python route, as the team times it (a copy of ../shared/bench/hf_anchor.py): `attnscope bench
# --transformers PYTHON` writes this script to a temporary folder and runs it side by side with
# attnscope's own commands. Kept as the team wrote it, so its figures compare with theirs.
"""The usual Python route, timed on this machine: Hugging Face transformers + torch on CPU, a GGUF file
dequantized to float32, one forward over N tokens. Run it in the same session as attnscope's own
benchmark and compare by ratio (these machines are shared and noisy; CPUs differ between machines).

Set-up (once; torch's wheel is large):
  python3 -m venv $HOME/.hfenv && $HOME/.hfenv/bin/pip install torch==2.15.0 transformers==5.24.0 accelerate gguf numpy
Use:
  $HOME/.hfenv/bin/python hf_anchor.py --gguf MODEL.gguf --len 2048 --attn eager --output-attentions
  $HOME/.hfenv/bin/python hf_anchor.py --gguf MODEL.gguf --len 2048 --attn sdpa
  $HOME/.hfenv/bin/python hf_anchor.py --gguf MODEL.gguf --file text.txt --attn eager --output-attentions
Prints one JSON line: load times, forward median/min over --reps after --warmup, peak RSS (MB) of the
load and of the forwards, threads.
"""
import argparse, json, os, statistics, time

ap = argparse.ArgumentParser()
ap.add_argument("--gguf", required=True)
ap.add_argument("--len", type=int, default=0, help="tokens (0: the lesson's sentence)")
ap.add_argument("--file", help="use this text file as it is (no BOS unless the tokenizer adds one), instead of --len")
ap.add_argument("--attn", choices=["eager", "sdpa"], default="eager")
ap.add_argument("--output-attentions", action="store_true")
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--warmup", type=int, default=1)
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")


def kb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])


t0 = time.perf_counter()
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
torch.set_num_threads(a.threads)
t1 = time.perf_counter()
d, f = os.path.split(os.path.abspath(a.gguf))
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
t2 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, attn_implementation=a.attn).eval()
t3 = time.perf_counter()
peak_load = kb("VmHWM")
sentence = "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc."
ids = tok(open(a.file, encoding="utf-8").read() if a.file else sentence)["input_ids"]
while not a.file and a.len and len(ids) < a.len:
    ids = ids + tok(" " + sentence, add_special_tokens=False)["input_ids"]
if a.len and not a.file:
    ids = ids[: a.len]
x = torch.tensor([ids])
open("/proc/self/clear_refs", "w").write("5")  # reset the peak: what follows is the forwards' own peak
times = []
with torch.inference_mode():
    for i in range(a.warmup + a.reps):
        s = time.perf_counter()
        out = model(x, output_attentions=a.output_attentions, use_cache=False)
        dt = time.perf_counter() - s
        del out
        if i >= a.warmup:
            times.append(dt)
print(json.dumps({"gguf": f, "n_tokens": len(ids), "attn": a.attn, "output_attentions": a.output_attentions,
                  "threads": torch.get_num_threads(), "import_s": round(t1 - t0, 2), "tokenizer_s": round(t2 - t1, 2),
                  "load_s": round(t3 - t2, 2), "forward_median_s": round(statistics.median(times), 3),
                  "forward_min_s": round(min(times), 3), "peak_rss_load_mb": round(peak_load / 1024),
                  "peak_rss_forward_mb": round(kb("VmHWM") / 1024), "cpu": torch.backends.cpu.get_cpu_capability()}))
