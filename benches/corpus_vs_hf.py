"""`attnscope corpus` over the 224 built-in texts against transformers' batched forward with
`output_attentions=True` on the same texts, side by side in one run on the same machine, with the
default model (qwen2.5-coder-0.5b, its GGUF dequantized to float32, eager attention: the only one
that returns the weights).

The two alternate (attnscope, transformers, attnscope, transformers, ...: --reps rounds) because
these machines' speed drifts within minutes. attnscope's time is the whole `corpus --json` process
(loading the model, tokenizing, the forwards, the statistics, the aggregate); transformers' is its
forwards only (tokenizing, padding and the model call per batch; loading excluded), so the ratio is
conservative. Texts go to transformers sorted by length in batches of --batch (left padding, an
attention mask), which keeps its padding small.

    ~/.hfenv/bin/python benches/corpus_vs_hf.py [--bin target/release/attnscope] [--reps 2] \
        [--batch 16] [--threads N] [--limit N] [--smoke]

`--smoke`: 4 texts of SmolLM2, one round (checks the script; without torch and transformers it
says so and times attnscope alone). Ends with a table: one row per side.
"""
import argparse
import json
import os
import statistics
import subprocess
import time

from bench_util import models_dir, reference, table

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

HERE = os.path.dirname(os.path.abspath(__file__))


def builtin_texts():
    """`analysis::corpus::builtin`: one text per non-empty line, `#` lines skipped, `\\n` unescaped."""
    out = []
    for line in open(os.path.join(HERE, "..", "data", "corpus.txt"), encoding="utf-8").read().split("\n"):
        line = line.rstrip("\r")
        if not line.strip() or line.startswith("#"):
            continue
        out.append(line.replace("\\n", "\n"))
    return out


def transformers_side(a, texts):
    """transformers' timer over `texts` (batched, sorted by length, left padding), the token
    count, and its thread count; None where transformers is missing in a smoke run."""
    mods = reference(a.smoke, "transformers", lambda: (__import__("torch"), __import__("transformers")))
    if mods is None:
        return None
    torch, transformers = mods
    torch.set_num_threads(a.threads)
    d, f = os.path.split(os.path.abspath(a.gguf))
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    order = sorted(range(len(texts)), key=lambda i: len(tok(texts[i])["input_ids"]))
    n_tokens = sum(len(tok(t)["input_ids"]) for t in texts)

    def hf_once():
        t0 = time.perf_counter()
        with torch.inference_mode():
            for b in range(0, len(order), a.batch):
                batch = [texts[i] for i in order[b:b + a.batch]]
                enc = tok(batch, return_tensors="pt", padding=True)
                out = model(**enc, output_attentions=True, use_cache=False)
                assert len(out.attentions) == model.config.num_hidden_layers
                del out
        return time.perf_counter() - t0

    # warm-up: torch's first-call costs
    with torch.inference_mode():
        model(**tok(texts[:2], return_tensors="pt", padding=True), output_attentions=True, use_cache=False)
    return hf_once, n_tokens, torch.get_num_threads()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/attnscope")
    ap.add_argument("--gguf", default=None, help="the model's GGUF (default: the cache's file of --model)")
    ap.add_argument("--model", default=None, help="attnscope's name for the same model (qwen2.5-coder-0.5b; smollm2-135m with --smoke)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--limit", type=int, default=0, help="only the first N texts (0: all)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--smoke", action="store_true", help="4 texts of SmolLM2, one round: checks the script")
    a = ap.parse_args()
    if a.smoke:
        a.reps, a.limit, a.batch = 1, 4, 4
    a.model = a.model or ("smollm2-135m" if a.smoke else "qwen2.5-coder-0.5b")
    a.gguf = a.gguf or os.path.join(models_dir(), f"{a.model}.gguf")
    texts = builtin_texts()
    if a.limit:
        texts = texts[: a.limit]
    hf = transformers_side(a, texts)
    cmd = [a.bin, "corpus", "-m", a.model, "--json"] + (["--limit", str(a.limit)] if a.limit else [])

    def ours_once():
        t0 = time.perf_counter()
        r = subprocess.run(cmd, check=True, capture_output=True, text=True)
        dt = time.perf_counter() - t0
        return dt, json.loads(r.stdout)

    # warm-up: the model file and packed panels in the page cache
    subprocess.run(cmd[:4] + ["--limit", "2", "--json"], check=True, capture_output=True)
    ours, theirs = [], []
    for _ in range(a.reps):
        dt, agg = ours_once()
        ours.append(dt)
        if hf:
            theirs.append(hf[0]())
    mo = statistics.median(ours)
    mh = statistics.median(theirs) if theirs else None
    n_texts = agg["sentences"]
    print(json.dumps({
        "texts": len(texts), "tokens": hf and hf[1], "threads": hf and hf[2], "hf_batch": a.batch,
        "attnscope_s": [round(x, 2) for x in ours], "transformers_s": [round(x, 2) for x in theirs],
        "attnscope_median_s": round(mo, 2), "transformers_median_s": mh and round(mh, 2),
        "speedup": mh and round(mh / mo, 2),
        "attnscope_texts_in_aggregate": n_texts,
    }))
    rows = [{"side": "attnscope corpus (whole process)", "texts": n_texts, "median s": mo}]
    if hf:
        rows.append({"side": "transformers output_attentions (forwards)", "texts": len(texts), "median s": mh,
                     "speedup": mh / mo})
    table(["side", "texts", "median s", "speedup"], rows)


if __name__ == "__main__":
    main()
