#!/usr/bin/env python
"""Decoding speed, side by side in one run: `attnscope generate` (KV cache, per-token attention
statistics on) against transformers' `generate` (its KV cache, sdpa, greedy) on the same GGUF
dequantized to float32, a prompt of ~500 tokens and 128 new tokens. Decoding tokens/s counts the
steps after the first token (the prompt's forward is timed apart, as prefill).
Use: ~/.hfenv/bin/python benches/generate_vs_hf.py [--model qwen2.5-coder-0.5b] [--bin target/release/attnscope] [--smoke]
     [--repeats N] [--variant "ATTNSCOPE_DECODE=panels" --variant "ATTNSCOPE_DECODE=blocks" ...]

`--variant`: environment settings for attnscope's run (space-separated NAME=VALUE), one row each;
`--repeats`: rounds of (every variant, then transformers), medians reported, with the load average.

`--smoke`: SmolLM2, a ~16-token prompt and 4 new tokens (checks the script; without torch and
transformers it says so and times attnscope alone, its prompt cut by words). Ends with a table.
"""
import argparse
import json
import os
import subprocess
import time

from bench_util import models_dir, reference, table

SENTENCE = "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc."


def args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="qwen2.5-coder-0.5b; smollm2-135m with --smoke")
    ap.add_argument("--bin", default="target/release/attnscope")
    ap.add_argument("--prompt-len", type=int, default=500)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a ~16-token prompt, 4 new tokens: checks the script")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--variant", action="append", default=None,
                    help="NAME=VALUE ... for one attnscope run (repeatable); default: the environment as it is")
    a = ap.parse_args()
    if a.smoke:
        a.prompt_len, a.new = 16, 4
    a.model = a.model or ("smollm2-135m" if a.smoke else "qwen2.5-coder-0.5b")
    return a


def prompt(a, tok):
    """The prompt: SENTENCE repeated and cut to --prompt-len tokens by transformers' tokenizer
    (attnscope's gives the same ids: checked in the result), or by words without it."""
    if tok is None:
        words = " ".join([SENTENCE] * (a.prompt_len // 8 + 1)).split()
        return " ".join(words[: max(1, a.prompt_len // 2)]), None
    ids = tok(SENTENCE, add_special_tokens=False)["input_ids"]
    while len(ids) < a.prompt_len:
        ids += tok(" " + SENTENCE, add_special_tokens=False)["input_ids"]
    ids = ids[: a.prompt_len]
    return tok.decode(ids), ids


def transformers_generate(a, torch, model, prompt_ids):
    """transformers' prefill and greedy generate of --new tokens after `prompt_ids`."""
    x = torch.tensor([prompt_ids])
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(x, use_cache=False)  # warm-up and prefill time
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        g = model.generate(x, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False, use_cache=True)
        total = time.perf_counter() - t0
    n_new = g.shape[1] - x.shape[1]
    return {"new_tokens": n_new, "prefill_s": prefill, "total_s": total,
            "decode_tokens_per_s": (n_new - 1) / max(total - prefill, 1e-9)}, g[0, x.shape[1]:].tolist()


def run_ours(a, text, ids, variant):
    """attnscope generate under `variant`'s environment settings."""
    env = dict(os.environ, **dict(kv.split("=", 1) for kv in variant.split()))
    out = subprocess.run([a.bin, "generate", "-m", a.model, "--text", text, "--max-new-tokens", str(a.new), "--json"],
                         capture_output=True, text=True, check=True, env=env)
    j = json.loads(out.stdout)
    return j, {"prompt_tokens": len(j["prompt_ids"]), "same_prompt_ids": ids is None or j["prompt_ids"] == ids,
               "new_tokens": len(j["generated"]), "prefill_s": j["prefill_s"],
               "decode_tokens_per_s": j["decode_tokens_per_s"]}


def median(v):
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def main():
    a = args()
    variants = a.variant or [""]
    mods = reference(a.smoke, "transformers", lambda: (__import__("torch"), __import__("transformers")))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    tok = model = None
    if mods:
        torch, transformers = mods
        torch.set_num_threads(a.threads)
        d, f = models_dir(), f"{a.model}.gguf"
        tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32,
                                                                  attn_implementation="sdpa").eval()
    text, ids = prompt(a, tok)
    ours = {v: [] for v in variants}
    theirs, same, loads = [], {v: True for v in variants}, []
    for _ in range(a.repeats):
        got = {}
        for v in variants:
            got[v], o = run_ours(a, text, ids, v)
            ours[v].append(o)
        if mods:
            hf, hf_ids = transformers_generate(a, torch, model, got[variants[0]]["prompt_ids"])
            theirs.append(hf)
            for v, j in got.items():
                same[v] = same[v] and hf_ids[: len(j["generated"])] == [t["id"] for t in j["generated"]]
        loads.append(os.getloadavg()[0])
    rows = []
    hf_med = median([h["decode_tokens_per_s"] for h in theirs]) if theirs else None
    for v in variants:
        tps = [o["decode_tokens_per_s"] for o in ours[v]]
        row = {"side": f"attnscope generate {v}".strip(), **ours[v][-1], "decode_tokens_per_s": median(tps),
               "all_tokens_per_s": [round(t, 2) for t in tps]}
        if hf_med:
            row["vs_transformers"] = median(tps) / hf_med
            row["same_greedy_tokens"] = same[v]
        rows.append(row)
    if theirs:
        rows.append({"side": "transformers generate", "prompt_tokens": rows[0]["prompt_tokens"], **theirs[-1],
                     "decode_tokens_per_s": hf_med,
                     "all_tokens_per_s": [round(h["decode_tokens_per_s"], 2) for h in theirs]})
    print(json.dumps({"model": a.model, "repeats": a.repeats, "load_average": loads, "rows": rows}, indent=1))
    table(["side", "prompt_tokens", "new_tokens", "prefill_s", "decode_tokens_per_s", "vs_transformers"], rows)


if __name__ == "__main__":
    main()
