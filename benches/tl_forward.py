"""The Python forward beside TransformerLens, one run on one machine (docs/benchmarks.md, "The
Python forward beside TransformerLens"): attnscope's HookedTransformer and TransformerLens 4.3's
bridge (compatibility mode, on the model transformers builds from the same GGUF, float32), the
same calls on SmolLM2-135M, medians of --reps calls after a warm-up, side by side.

    target/tlenv/bin/python benches/tl_forward.py [--reps 7] [--threads 2]

(target/tlenv: bindings/python/tests/tl_env.sh; it holds torch, transformer-lens and the wheel.)
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np

TEXT = "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc. " * 8
BATCH = ["the hat sat on the mat and the cat sat there too"] * 8


def zero_pos(act, hook):
    act[:, 3] = 0  # one position of every row, in place (numpy or torch)


def timed(f, reps):
    f()
    xs = []
    for _ in range(reps):
        s = time.perf_counter()
        f()
        xs.append(time.perf_counter() - s)
    return statistics.median(xs) * 1000


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tokens", type=int, default=120)
    a = ap.parse_args()
    import torch
    import attnscope

    torch.set_grad_enabled(False)
    torch.set_num_threads(a.threads)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bindings/python/tests/tl_demos"))
    import tl_loaders
    from transformer_lens.model_bridge import TransformerBridge

    ours = attnscope.HookedTransformer.from_pretrained("smollm2-135m")
    tok, hf = tl_loaders._hf("smollm2-135m")
    tl = TransformerBridge.boot_transformers("local", hf_model=hf, tokenizer=tok, device="cpu")
    tl.enable_compatibility_mode(disable_warnings=True)

    ids = tok(TEXT, return_tensors="pt").input_ids[:, : a.tokens]
    batch = tok(BATCH, return_tensors="pt").input_ids
    ours_ids, ours_batch = ids.numpy(), batch.numpy()
    n, (bn, bl) = ids.shape[1], batch.shape
    # the same logits first (float32, two engines)
    diff = np.abs(np.asarray(ours(ours_ids)) - tl(ids).numpy()).max()
    rows = [
        (f"model(tokens), 1 x {n}, every position's logits", lambda: ours(ours_ids), lambda: tl(ids)),
        (f"model(tokens, return_type=None), 1 x {n}", lambda: ours(ours_ids, return_type=None),
         lambda: tl(ids, return_type=None)),
        (f"model(tokens), a batch of {bn} x {bl}", lambda: ours(ours_batch), lambda: tl(batch)),
        (f"run_with_hooks, {bn} x {bl}, a resid_pre edit (a patching step)",
         lambda: ours.run_with_hooks(ours_batch, fwd_hooks=[("blocks.4.hook_resid_pre", zero_pos)]),
         lambda: tl.run_with_hooks(batch, fwd_hooks=[("blocks.4.hook_resid_pre", zero_pos)])),
        (f"run_with_cache(tokens), 1 x {n}, every hook", lambda: ours.run_with_cache(ours_ids),
         lambda: tl.run_with_cache(ids)),
        # TL computes hook_result only with cfg.use_attn_result; its cache above has none
        (f"run_with_cache(tokens), 1 x {n}, every hook but hook_result",
         lambda: ours.run_with_cache(ours_ids, names_filter=lambda h: not h.endswith("hook_result")),
         lambda: tl.run_with_cache(ids)),
    ]
    print(f"SmolLM2-135M, {a.threads} threads, medians of {a.reps}; logits differ by at most {diff:.2e}")
    print(f"{'call':<58} {'attnscope':>10} {'TL':>10} {'TL/attnscope':>13}")
    for name, f_ours, f_tl in rows:
        o, t = timed(f_ours, a.reps), timed(f_tl, a.reps)
        print(f"{name:<58} {o:>8.1f}ms {t:>8.1f}ms {t / o:>12.2f}x")
    print(f"{'transformers, the same 1 x ' + str(n):<58} {'':>10} {timed(lambda: hf(ids), a.reps):>8.1f}ms")


if __name__ == "__main__":
    main()
