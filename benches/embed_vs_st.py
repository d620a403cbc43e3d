"""Embedding 1,000 short sentences: `attnscope embed` (the CLI, texts in parallel) against
sentence-transformers' `model.encode(texts, batch_size=32)`, side by side in one run on the same
machine, with all-MiniLM-L6-v2. Prints both wall times (model loading excluded for
sentence-transformers; the CLI's own reported embedding time and its whole process time), the
ratio, and the largest difference between the two embeddings. The sides alternate (attnscope,
sentence-transformers, attnscope, ...: --reps rounds, the median of each side's times), because a
shared machine's speed drifts within minutes; the load averages before and after are printed.
With --fast, `embed --precision fast` runs in each round too, its ratio and its smallest cosine to
attnscope's exact embeddings printed (issue #60's goals: exact >= 1.0x within 1e-5, fast >= 2x
with cosine >= 0.999). --threads N holds both sides to N threads.

    PYTHONPATH=/path/to/sentence_transformers ~/.hfenv/bin/python benches/embed_vs_st.py \
        [--n 1000] [--reps 3] [--fast] [--bin target/release/attnscope] [--threads N] [--smoke]

`--smoke`: 8 sentences, one round (checks the script; without sentence-transformers it says so
and times attnscope alone). Ends with a table: one row per side.
"""
import argparse
import json
import os
import statistics
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


def ours(a, path, precision="exact"):
    """attnscope's embeddings of the texts in `path` (the .npy it wrote, read by numpy where it is
    here), its reported embedding seconds and its whole process's."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "emb.npy")
        t0 = time.perf_counter()
        r = subprocess.run([a.bin, "embed", "-m", "all-minilm-l6-v2", "--precision", precision, "-f", path,
                            "-o", out, "--json"], check=True, capture_output=True, text=True, env=env(a))
        proc = time.perf_counter() - t0
        seconds = json.loads(r.stdout)["seconds"]
        try:
            import numpy as np
        except ImportError:
            return None, seconds, proc
        return np.load(out), seconds, proc


def env(a):
    """attnscope's environment: with --threads, that many rayon threads (as torch gets)."""
    e = dict(os.environ)
    if a.threads:
        e["RAYON_NUM_THREADS"] = str(a.threads)
    return e


def load():
    return "load average %.2f %.2f %.2f" % os.getloadavg()


def rounds(a, texts, st_model):
    """`a.reps` rounds of attnscope (exact, then fast with --fast) and sentence-transformers in
    turn: each side's embeddings of the last round and its times of every round."""
    times = {"exact": [], "proc": [], "fast": [], "st": []}
    got = {}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "texts.txt")
        open(path, "w").write("\n".join(texts) + "\n")
        # warm the file cache with one small run
        subprocess.run([a.bin, "embed", "-m", "all-minilm-l6-v2", "-t", "warm up", "--json"], check=True,
                       capture_output=True)
        for _ in range(a.reps):
            got["exact"], seconds, proc = ours(a, path)
            times["exact"].append(seconds)
            times["proc"].append(proc)
            if a.fast:
                got["fast"], seconds, _ = ours(a, path, "fast")
                times["fast"].append(seconds)
            if st_model is not None:
                t0 = time.perf_counter()
                got["st"] = st_model.encode(texts, batch_size=32, convert_to_numpy=True)
                times["st"].append(time.perf_counter() - t0)
    return got, {k: statistics.median(v) for k, v in times.items() if v}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3, help="rounds, the sides in turn (median of each)")
    ap.add_argument("--fast", action="store_true", help="also time `embed --precision fast`")
    ap.add_argument("--bin", default="target/release/attnscope")
    ap.add_argument("--model", default=os.path.join(models_dir(), "all-minilm-l6-v2"))
    ap.add_argument("--threads", type=int, default=None, help="threads of both sides: torch's and attnscope's (RAYON_NUM_THREADS); default: each its own "
                         "(on a loaded machine, --threads 1 keeps torch's waiting threads from spinning)")
    ap.add_argument("--smoke", action="store_true", help="8 sentences, one round: checks the script")
    a = ap.parse_args()
    if a.smoke:
        a.n, a.reps = 8, 1
    mods = reference(a.smoke, "sentence-transformers",
                     lambda: (__import__("numpy"), __import__("torch"), __import__("sentence_transformers")))
    texts = sentences(a.n)
    st_model = None
    if mods:
        np, torch, st_mod = mods
        if a.threads:
            torch.set_num_threads(a.threads)
        st_model = st_mod.SentenceTransformer(a.model, device="cpu")
        st_model.encode(texts[:32], batch_size=32)  # warm up
    before = load()
    got, t = rounds(a, texts, st_model)
    print(f"before: {before}; after: {load()}; {a.reps} round(s), medians")
    rows = [{"side": "attnscope embed (embedding only)", "texts": len(texts), "seconds": t["exact"]},
            {"side": "attnscope embed (whole process, load incl.)", "texts": len(texts), "seconds": t["proc"]}]
    if a.fast:
        rows.append({"side": "attnscope embed --precision fast", "texts": len(texts), "seconds": t["fast"]})
        if got.get("fast") is not None and got.get("exact") is not None:
            cos = float((got["fast"] * got["exact"]).sum(1).min())
            rows[-1]["cosine to exact"] = cos
            print(f"attnscope fast: smallest cosine to attnscope exact {cos:.6f} (goal >= 0.999)")
    if mods:
        st = t["st"]
        diff = float(np.abs(got["exact"] - got["st"]).max())
        cos = float((got["exact"] * got["st"]).sum(1).min())
        print(f"texts: {len(texts)}, torch threads: {torch.get_num_threads()}, cpus: {os.cpu_count()}")
        print(f"sentence-transformers encode(batch_size=32): {st:.3f} s")
        for r in rows:
            r["speedup"] = st / r["seconds"]
            print(f"{r['side'] + ':':<45}{r['seconds']:.3f} s  -> {r['speedup']:.2f}x")
        print(f"largest |difference| {diff:.2e}, smallest cosine {cos:.7f}")
        rows.append({"side": "sentence-transformers encode(batch_size=32)", "texts": len(texts), "seconds": st,
                     "largest diff": diff})
    table(["side", "texts", "seconds", "speedup", "largest diff", "cosine to exact"], rows)


if __name__ == "__main__":
    main()
