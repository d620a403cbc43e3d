"""Integrated gradients on a 128-token text: `attnscope attribute --method integrated-gradients
--steps 32` (the CLI, start to end, model loading included) against Captum's IntegratedGradients
(32 steps, `riemann_middle`, zero baseline, `internal_batch_size` 8) on transformers' eager f32
model (loading excluded), side by side in one run: attnscope, Captum, attnscope again; the ratio
is Captum's time over the mean of attnscope's two. Both explain log p(top next token) at the last
position for the same token ids; the largest difference between their scores is printed too.

    PYTHONPATH=/path/to/captum ~/.hfenv/bin/python benches/ig_vs_captum.py \\
        [--model smollm2-135m] [--n 128] [--steps 32] [--bin target/release/attnscope] [--threads 2] [--smoke]

`--smoke`: 16 tokens, 4 steps (checks the script; without torch, transformers and Captum it says
so and times attnscope alone, the text cut by words). Ends with a table: one row per side.

Captum imports matplotlib for its plots only; where matplotlib is missing, a stub stands in
(IntegratedGradients never draws).
"""
import argparse
import importlib.abc
import importlib.machinery
import json
import os
import subprocess
import sys
import tempfile
import time
import types

from bench_util import models_dir, reference, table

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = (
    "The lesson says attention weights are not explanations. A model reads a sentence, and every layer mixes "
    "the tokens it has seen so far; the last position then predicts what comes next. Researchers who want to know "
    "which words mattered compare gradients, occlusion and attention, and they often disagree about the answer. "
    "Integrated gradients add up the gradient along a straight path from a baseline to the input, and the sum should "
    "equal the change of the output, which it rarely does exactly with a few steps. In this test the text is long "
    "enough to make the backward pass do real work over many positions at once, so that the measurement of its cost "
    "says something about texts that people actually give the tool every day.")


def stub_matplotlib():
    try:
        import matplotlib  # noqa: F401
        return
    except ImportError:
        pass

    class Any(types.ModuleType):
        def __getattr__(self, k):
            if k.startswith("__"):
                raise AttributeError(k)
            return type(k, (), {"__init__": lambda s, *a, **kw: None})

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("matplotlib", "mpl_toolkits", "PIL"):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)

        def create_module(self, spec):
            m = Any(spec.name)
            m.__path__ = []
            return m

        def exec_module(self, m):
            pass

    sys.meta_path.insert(0, Finder())


def imports():
    stub_matplotlib()
    import torch
    from captum.attr import IntegratedGradients
    import transformers
    return torch, IntegratedGradients, transformers


def ours(a, text, ids):
    """attnscope's integrated gradients of `text` (the CLI, start to end): seconds and its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "text.txt")
        open(path, "w").write(text)
        t0 = time.perf_counter()
        r = subprocess.run([a.bin, "attribute", "-m", a.model, "--no-bos", "-f", path, "--method",
                            "integrated-gradients", "--steps", str(a.steps), "--json"],
                           check=True, capture_output=True, text=True)
        el = time.perf_counter() - t0
    j = json.loads(r.stdout)
    assert ids is None or [t["id"] for t in j["tokens"]] == ids, "attnscope tokenized the text differently"
    return el, j


def captum(a, mods, model, ids):
    """Captum's integrated gradients of log p(top next token): seconds, the target, the scores, the gap."""
    torch, IntegratedGradients, _ = mods
    t = torch.tensor([ids])
    x = model.get_input_embeddings()(t).detach()
    t0 = time.perf_counter()
    with torch.no_grad():
        target = int(model(t, use_cache=False).logits[0, -1].argmax())

    def f(e):
        return torch.log_softmax(model(inputs_embeds=e, use_cache=False).logits[:, -1].float(), -1)[:, target]

    attr, delta = IntegratedGradients(f).attribute(
        x, baselines=torch.zeros_like(x), n_steps=a.steps, method="riemann_middle",
        internal_batch_size=a.batch, return_convergence_delta=True)
    el = time.perf_counter() - t0
    return el, target, attr[0].sum(-1).tolist(), float(delta)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--bin", default="target/release/attnscope")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--batch", type=int, default=8, help="Captum's internal_batch_size")
    ap.add_argument("--smoke", action="store_true", help="16 tokens, 4 steps: checks the script")
    a = ap.parse_args()
    if a.smoke:
        a.n, a.steps = 16, 4
    mods = reference(a.smoke, "Captum", imports)
    if mods is None:
        text = " ".join(TEXT.split()[: max(1, a.n * 3 // 4)])
        t1, j = ours(a, text, None)
        table(["side", "tokens", "steps", "seconds"],
              [{"side": "attnscope attribute (whole process)", "tokens": len(j["tokens"]), "steps": a.steps, "seconds": t1}])
        return
    torch, _, transformers = mods
    torch.set_num_threads(a.threads)
    d, g = models_dir(), a.model + ".gguf"
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=g)
    ids = tok((TEXT + " ") * 4, add_special_tokens=False)["input_ids"][: a.n]
    text = tok.decode(ids)
    assert tok(text, add_special_tokens=False)["input_ids"] == ids, "the text does not round-trip"
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=g, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    for p in model.parameters():
        p.requires_grad_(False)
    t1, j = ours(a, text, ids)
    tc, target, scores, delta = captum(a, mods, model, ids)
    t2, _ = ours(a, text, ids)
    mine = [t["score"] for t in j["tokens"]]
    diff = max(abs(x - y) for x, y in zip(mine, scores))
    big = max(abs(y) for y in scores)
    mean = (t1 + t2) / 2
    print(json.dumps({
        "model": a.model, "n": len(ids), "steps": a.steps, "threads": a.threads,
        "attnscope_s": [round(t1, 2), round(t2, 2)], "captum_s": round(tc, 2),
        "ratio": round(tc / mean, 2),
        "same_target": j["target"]["id"] == target,
        "max_score_diff": diff, "largest_score": big,
        "gap": {"attnscope": j["completeness_gap"], "captum": delta},
    }))
    print(f"{a.model}, {len(ids)} tokens, {a.steps} steps: attnscope {t1:.1f} s / {t2:.1f} s, "
          f"Captum {tc:.1f} s: attnscope {tc / mean:.2f}x faster; scores within {diff:.2e} "
          f"(largest {big:.2f})", file=sys.stderr)
    table(["side", "tokens", "steps", "seconds", "ratio", "max score diff"],
          [{"side": "attnscope attribute (whole process, mean of 2)", "tokens": len(ids), "steps": a.steps, "seconds": mean},
           {"side": "Captum IntegratedGradients", "tokens": len(ids), "steps": a.steps, "seconds": tc,
            "ratio": tc / mean, "max score diff": diff}])


if __name__ == "__main__":
    main()
