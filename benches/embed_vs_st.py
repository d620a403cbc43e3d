"""Embedding 1,000 short sentences: `attnscope embed` (the CLI, texts in parallel) against
sentence-transformers' `model.encode(texts, batch_size=32)`, side by side in one run on the same
machine, with all-MiniLM-L6-v2. Prints both wall times (model loading excluded for
sentence-transformers; the CLI's own reported embedding time and its whole process time), the
ratio, and the largest difference between the two embeddings.

    PYTHONPATH=/path/to/sentence_transformers ~/.hfenv/bin/python benches/embed_vs_st.py \
        [--n 1000] [--bin target/release/attnscope] [--threads N] [--smoke]

`--smoke`: 8 sentences (checks the script; without sentence-transformers it says so and times
attnscope alone). Ends with a table: one row per side.
"""
import argparse
import json
import os
import subprocess
import tempfile
import time

from bench_util import models_dir, reference, table

SUBJECTS = ["The cat", "A researcher", "My neighbour", "The old train", "A small bird", "The committee",
            "Her brother", "The river", "This algorithm", "The museum"]
VERBS = ["watched", "described", "ignored", "carried", "painted", "found", "explained", "crossed",
         "measured", "remembered"]
OBJECTS = ["the quiet harbour at dawn.", "a surprising result in the data.", "the red kite over the hill.",
           "an unfinished letter from 1921.", "the noisy market on Sunday.", "a theory about attention.",
           "the last bus home.", "three apples and a pear.", "the bridge near the station.",
           "a song nobody knew."]


def sentences(n):
    out = []
    for i in range(n):
        s, v, o = SUBJECTS[i % 10], VERBS[(i // 10) % 10], OBJECTS[(i // 100) % 10]
        out.append(f"{s} {v} {o}" if i < 1000 else f"{s} {v} {o} ({i})")
    return out


def ours(a, texts):
    """attnscope's embeddings of `texts` (the .npy it wrote, read by numpy where it is here), its
    reported embedding seconds and its whole process's."""
    with tempfile.TemporaryDirectory() as d:
        path, out = os.path.join(d, "texts.txt"), os.path.join(d, "emb.npy")
        open(path, "w").write("\n".join(texts) + "\n")
        # warm the file cache with one small run
        subprocess.run([a.bin, "embed", "-m", "all-minilm-l6-v2", "-t", "warm up", "--json"], check=True,
                       capture_output=True)
        t0 = time.perf_counter()
        r = subprocess.run([a.bin, "embed", "-m", "all-minilm-l6-v2", "-f", path, "-o", out, "--json"],
                           check=True, capture_output=True, text=True)
        proc = time.perf_counter() - t0
        seconds = json.loads(r.stdout)["seconds"]
        try:
            import numpy as np
        except ImportError:
            return None, seconds, proc
        return np.load(out), seconds, proc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--bin", default="target/release/attnscope")
    ap.add_argument("--model", default=os.path.join(models_dir(), "all-minilm-l6-v2"))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--smoke", action="store_true", help="8 sentences: checks the script")
    a = ap.parse_args()
    if a.smoke:
        a.n = 8
    mods = reference(a.smoke, "sentence-transformers",
                     lambda: (__import__("numpy"), __import__("torch"), __import__("sentence_transformers")))
    texts = sentences(a.n)
    e_ours, seconds, proc = ours(a, texts)
    rows = [{"side": "attnscope embed (embedding only)", "texts": len(texts), "seconds": seconds},
            {"side": "attnscope embed (whole process, load incl.)", "texts": len(texts), "seconds": proc}]
    if mods:
        np, torch, st_mod = mods
        if a.threads:
            torch.set_num_threads(a.threads)
        m = st_mod.SentenceTransformer(a.model, device="cpu")
        m.encode(texts[:32], batch_size=32)  # warm up
        t0 = time.perf_counter()
        e_st = m.encode(texts, batch_size=32, convert_to_numpy=True)
        st = time.perf_counter() - t0
        diff = float(np.abs(e_ours - e_st).max())
        cos = float((e_ours * e_st).sum(1).min())
        print(f"texts: {len(texts)}, torch threads: {torch.get_num_threads()}, cpus: {os.cpu_count()}")
        print(f"sentence-transformers encode(batch_size=32): {st:.3f} s")
        print(f"attnscope embed (embedding only):            {seconds:.3f} s  -> {st / seconds:.2f}x")
        print(f"attnscope embed (whole process, load incl.): {proc:.3f} s  -> {st / proc:.2f}x")
        print(f"largest |difference| {diff:.2e}, smallest cosine {cos:.7f}")
        for r in rows:
            r["speedup"] = st / r["seconds"]
        rows.append({"side": "sentence-transformers encode(batch_size=32)", "texts": len(texts), "seconds": st,
                     "largest diff": diff})
    table(["side", "texts", "seconds", "speedup", "largest diff"], rows)


if __name__ == "__main__":
    main()
