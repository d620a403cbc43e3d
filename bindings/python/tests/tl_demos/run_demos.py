"""#59: TransformerLens's own demo notebooks run against attnscope, cell by cell, with only the
import and the model name changed, and a per-cell table printed (demo, cell, result, seconds, the
error's first line or the numbers checked against real TL).

    bash bindings/python/tests/tl_env.sh   # target/tlenv: torch, transformer-lens 4.3, attnscope's wheel
    target/tlenv/bin/python -m pip install ipython plotly nbformat pandas circuitsvis   # what the demos import
    target/tlenv/bin/python bindings/python/tests/tl_demos/run_demos.py [--tl] NOTEBOOK_DIR [DEMO ...]

(any Python with torch, IPython, plotly, nbformat, circuitsvis and pandas, attnscope importable
(the wheel, or PYTHONPATH=bindings/python/python with the built `_native` module copied there),
and transformer_lens for --tl).
NOTEBOOK_DIR holds TL's notebooks (Main_Demo.ipynb, Exploratory_Analysis_Demo.ipynb,
Head_Detector_Demo.ipynb, Activation_Patching_in_TL_Demo.ipynb, Attribution_Patching_Demo.ipynb,
from TransformerLens's demos/ folder). Each code cell is rewritten by the rules in REWRITES (the
import lines and the model names; `%pip install` lines are left out) and CELL_REWRITES (the
GPT-2-specific lines, each with its reason), and run in order in one IPython shell per demo, each
demo in a fresh process (a fresh kernel, as Jupyter runs it: `torch.set_grad_enabled(False)` in
one demo must not reach the next). Before each cell the harness seeds torch, numpy and random
with 0, so that cells drawing random tokens draw the same ones in both runs below.

`--tl` (needs transformer_lens): each demo runs twice, first against real TransformerLens (the
notebook's own imports, its loaders pointed at the Hugging Face model transformers builds from
the same GGUF, float32), then against attnscope. After each cell the numbers it made (every
variable the cell bound or rebound that is a tensor, an array or a number, and the cell's value)
are compared with TL's, relative to the largest |value| of TL's (integers exactly): the table
says `ran, N numbers match TL (worst ...)`, `ran, numbers DIFFER (...)`, or `ran` where the cell
made no number. A cell that fails under TL too is marked `fails with TL too` (the notebook's own,
or what GPT-2 has and the model does not). A number where TL's own value is off (TL_OFF, each
with the evidence against torch autograd) is reported apart: `TL is off (TL_OFF): ...`.
MODEL (env ATTNSCOPE_DEMO_MODEL) replaces GPT-2.
Each cell runs at most ATTNSCOPE_DEMO_CELL_LIMIT seconds (300; TL's run ATTNSCOPE_DEMO_TL_CELL_LIMIT,
the same by default; a cell that loads a model gets the first): over it, the cell fails with `_Timeout`."""

import json
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback

MODEL = os.environ.get("ATTNSCOPE_DEMO_MODEL", "smollm2-135m")
DEMOS = ["Main_Demo", "Exploratory_Analysis_Demo", "Head_Detector_Demo", "Activation_Patching_in_TL_Demo",
         "Attribution_Patching_Demo"]
# numbers within this of TL's (relative to the largest |value| of TL's) match: float32 on the
# same weights, two engines (the hooks agree within ~2e-5 in test_tl_real.py); a cell's patching
# metric divides by a logit difference, which this leaves room for
BOUND = float(os.environ.get("ATTNSCOPE_DEMO_BOUND", "1e-3"))
MODEL_NAME = (r"""(boot_transformers|from_pretrained(?:_no_processing)?)\(\s*["'][^"']+["']""",
              r'\1("' + MODEL + '"')
# (pattern, replacement): the import and the model name, nothing else
REWRITES = [
    (r"^(\s*)import transformer_lens\.utilities as utils", r"\1import attnscope.utils as utils"),
    (r"^(\s*)import transformer_lens\.utils as utils", r"\1import attnscope.utils as utils"),
    (r"^(\s*)import transformer_lens(\s|$)", r"\1import attnscope as transformer_lens\2"),
    (r"^(\s*)import transformer_lens\.(\w+) as", r"\1import attnscope.\2 as"),
    (r"^(\s*)from transformer_lens\.model_bridge import", r"\1from attnscope import"),
    (r"^(\s*)from transformer_lens\.hook_points import", r"\1from attnscope import"),
    (r"^(\s*)from transformer_lens\.utilities import", r"\1from attnscope.utils import"),
    (r"^(\s*)from transformer_lens\.utils import", r"\1from attnscope.utils import"),
    (r"^(\s*)from transformer_lens import", r"\1from attnscope import"),
    (r"^(\s*)from transformer_lens\.(\w+) import", r"\1from attnscope import"),
    MODEL_NAME,
]
PIP = (r"^(\s*)[%!]\s*pip .*$", r"\1pass  # pip left out: the environment has what the demo needs")
_GQA = ("GPT-2 has a key and a value per head; SmolLM2's 3 KV heads each serve 3 of its 9 query heads (GQA): "
        "hook_k/hook_v (and their gradients) have 3 heads, W_K/W_V 9 (repeated, as TL's properties give them), "
        "so the cell's einsum over heads fails in TL too; each KV head's k/v is repeated to the query heads it "
        "serves (_kv_to_heads, defined before the demo's cells, a no-op where the heads match)")
_GQA_B = ("the direct-path patch (used by cells 34 and 36) indexes hook_k/hook_v by query head B, as GPT-2 has a "
          "key and a value per head; SmolLM2's have its 3 KV heads (GQA), in TL too: B's patch goes to the KV "
          "head it reads (_head_of, defined before the demo's cells; q keeps its 9 heads)")
# defined in each demo's shell before its first cell (both runs): what the GQA rewrites call
PRELUDE = """
def _kv_to_heads(t, n_heads, dim=-2):
    return t.repeat_interleave(n_heads // t.shape[dim], dim=dim) if t.shape[dim] != n_heads else t

def _head_of(t, head, n_heads, dim=2):
    return head // (n_heads // t.shape[dim]) if t.shape[dim] != n_heads else head
"""
# the GPT-2-specific lines, changed for both runs (TL's and attnscope's): (pattern, replacement, why)
CELL_REWRITES = {
    ("Main_Demo", 51): [
        (r"for layer in range\(12\) for head in range\(12\)",
         "for layer in range(model.cfg.n_layers) for head in range(model.cfg.n_heads)",
         "the hover labels name GPT-2's 12 layers x 12 heads (144); SmolLM2 has 30 x 9 (270), so plotly refuses "
         "the lengths, in TL too")],
    ("Exploratory_Analysis_Demo", 4): [
        (r"^(\s*)refactor_factored_attn_matrices=True,", r"\1# refactor_factored_attn_matrices=True,",
         "TL refuses refactor_factored_attn_matrices on rotary models (AssertionError: the QK matrix depends on "
         "the positions); GPT-2's learned positions allow it")],
    ("Exploratory_Analysis_Demo", 27): [
        (r"^(\s*)hook_fn = partial\(patch_head_vector, head_index=head_index,",
         r"\1hook_fn = partial(patch_head_vector, head_index=head_index // (model.cfg.n_heads // model.cfg.n_key_value_heads),",
         "the cell patches hook_v by query head, as GPT-2 has a value per head; SmolLM2's hook_v has its 3 KV "
         "heads (GQA), in TL too: each query head's patch is its KV head's (the 3 heads sharing one get one number)")],
    ("Exploratory_Analysis_Demo", 32): [
        (r"corrupted_attn_act\[:, :, B_head_index, :\]",
         "corrupted_attn_act[:, :, _head_of(corrupted_attn_act, B_head_index, model.cfg.n_heads), :]", _GQA_B),
        (r"patched_attn_act\[:, :, B_head_index, :\] =",
         "patched_attn_act[:, :, _head_of(patched_attn_act, B_head_index, model.cfg.n_heads), :] =", _GQA_B),
        (r"_get_attention_weights\(model\.blocks\[B_layer\]\.attn, attn_act_type\)\[B_head_index\]",
         "_kv_to_heads(_get_attention_weights(model.blocks[B_layer].attn, attn_act_type), model.cfg.n_heads, 0)"
         "[B_head_index]",
         "TL 4's bridge gives W_K/W_V one per KV head (attnscope, as TL 3's HookedTransformer, repeats them): "
         "repeated to the query heads here, for both")],
    ("Main_Demo", 14): [
        (r"^head_index_to_ablate = 8$", "head_index_to_ablate = 8 % model.cfg.n_key_value_heads",
         "the cell indexes hook_v by head 8 of GPT-2's 12; SmolLM2's hook_v has its 3 KV heads (GQA), in TL too")],
    ("Attribution_Patching_Demo", 18): [
        (r"\[cache\[activation_name, l\] for l in",
         "[_kv_to_heads(cache[activation_name, l], model.cfg.n_heads) for l in",
         _GQA)],
    ("Attribution_Patching_Demo", 20): [
        (r"^(\s*)vector_grad = grad_cache\[activation_name, layer\]$",
         r"\1vector_grad = _kv_to_heads(grad_cache[activation_name, layer], model.cfg.n_heads)", _GQA),
        (r"^(\s*)W,$", r"\1_kv_to_heads(W, model.cfg.n_heads, 0),",
         "TL 4's bridge gives W_K/W_V one per KV head (attnscope, as TL 3's HookedTransformer, repeats them): "
         "repeated to the query heads here as well, for both")],
    ("Attribution_Patching_Demo", 31): [
        (r'attr_cache\.stack_activation\("([kv])"\)',
         r'_kv_to_heads(attr_cache.stack_activation("\1"), model.cfg.n_heads)', _GQA)],
    ("Attribution_Patching_Demo", 35): [
        (r'attr_cache\.stack_activation\("([kv])"\)',
         r'_kv_to_heads(attr_cache.stack_activation("\1"), model.cfg.n_heads)', _GQA)],
    ("Attribution_Patching_Demo", 33): [
        (r'(clean_cache\["pattern", \d+\]\[:, )(\d+)\]', r"\1\2 % model.cfg.n_heads]",
         "GPT-2's IOI heads L5H5, L10H7, L11H10: SmolLM2 has 9 heads a layer")],
}

# numbers where TL's own value is off, each with the evidence (torch autograd through transformers'
# eager forward of the same GGUF on the demo's batch): compare() names them apart ("TL is off")
# instead of as a difference; any other number of the cell is still held to BOUND
TL_OFF = {
    ("Attribution_Patching_Demo", 11, "corrupted_value"):
        "the metric at its own baseline, 0 by construction: TL 5.6e-7, attnscope 0.0, torch -5.0e-8 "
        "(float32 rounding; the cell asserts |value| < 1e-5, which both pass)",
    ("Attribution_Patching_Demo", 15, "residual_attr"):
        "TL 4's bridge aliases hook_resid_mid to ln2.hook_in (model_bridge/generalized_components/block.py), "
        "so its backward hook gets only the MLP branch's gradient, without the residual path's: each *_mid "
        "gradient equals torch's d/d resid_mid minus d/d resid_post within 1.4e-5 (0.3 to 1.0 of torch's norm, "
        "off by up to 1.4 of its largest; TL's residual_attr 0.87 off torch's); attnscope's *_mid gradients "
        "match torch within 4e-6, its residual_attr within 8e-7",
}

# cells not run, and why (the table shows them as skipped). None now: Main_Demo's 48 (the full OV
# circuit over the vocabulary, factors of 2 x 3.4 GB on SmolLM2 in TL) runs since FactoredMatrix keeps
# W_E and W_U beside its factors (TL's own run under --tl still folds them in: ~7 GB)
SKIP: dict = {}


def rewrite(src: str, demo: str = "", index: int = -1, tl: bool = False) -> str:
    rules = [MODEL_NAME] if tl else REWRITES
    rules = rules + [PIP] + [(p, r) for p, r, _ in CELL_REWRITES.get((demo, index), [])]
    out = []
    for line in src.splitlines():
        for pat, rep in rules:
            line = re.sub(pat, rep, line)
        out.append(line)
    return "\n".join(out)


def cells(folder: str, demo: str):
    nb = json.load(open(os.path.join(folder, f"{demo}.ipynb"), encoding="utf-8"))
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            yield "".join(c["source"])


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout("the cell ran over the harness's limit")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:150]


def _number(v):
    """A float64/int64 numpy copy of a tensor, array or number (None for anything else or a
    large one: more than 2e6 cells)."""
    import numpy as np

    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return np.array(v)
    if hasattr(v, "detach") and hasattr(v, "numpy"):
        if v.is_complex() or v.numel() > 2_000_000:
            return None
        v = v.detach().cpu()
        v = v.double() if v.is_floating_point() else v
        return v.numpy().copy()
    if isinstance(v, np.ndarray) and v.dtype.kind in "fiu" and v.size <= 2_000_000:
        return v.astype(np.float64 if v.dtype.kind == "f" else np.int64)
    return None


def snapshot(ns: dict, before: dict, result) -> dict:
    """The numbers a cell made: every name it bound or rebound (a new object), and its value."""
    out = {}
    for k, v in list(ns.items()):
        if k.startswith("_") or (k in before and before[k] is v):
            continue
        a = _number(v)
        if a is not None:
            out[k] = a
    a = _number(result)
    if a is not None:
        out["<cell value>"] = a
    return out


def compare(got: dict, want: dict, off: dict = None) -> str:
    """'' where nothing to compare; else how the numbers in both compare with TL's. `off`: the
    cell's names whose TL value is off (TL_OFF), reported apart from the differences."""
    import numpy as np

    names = sorted(set(got) & set(want))
    if not names:
        return ""
    worst, worst_name, bad, tl_off = 0.0, "", [], []
    for k in names:
        a, b = got[k], want[k]
        if a.shape != b.shape:
            bad.append(f"{k} shape {a.shape} vs TL {b.shape}")
            continue
        if b.dtype.kind == "i" and a.dtype.kind == "i":
            err = float(np.abs(a - b).max()) if a.size else 0.0
        else:
            scale = max(float(np.abs(b).max()) if b.size else 0.0, 1e-12)
            err = float(np.abs(a - b).max()) / scale if a.size else 0.0
            err = err if np.isfinite(a).all() == np.isfinite(b).all() else float("inf")
        if err > (0 if b.dtype.kind == "i" else BOUND):
            (tl_off if k in (off or {}) else bad).append(f"{k} {err:.2g}")
            continue
        if err >= worst:
            worst, worst_name = err, k
    if bad:
        return f"numbers DIFFER from TL: {'; '.join(bad[:4])}"
    note = f"; TL is off (TL_OFF): {'; '.join(tl_off)}" if tl_off else ""
    n = len(names) - len(tl_off)
    return (f"{n} numbers match TL (worst {worst:.1e}, {worst_name})" if n else "no other number") + note


def _seed():
    random.seed(0)
    try:
        import numpy as np
        np.random.seed(0)
        import torch
        torch.manual_seed(0)
    except ImportError:
        pass


def run_cell(shell, code: str, limit_s: int):
    """(status, error, value) of one cell."""
    signal.alarm(limit_s)
    try:
        r = shell.run_cell(code, silent=False)
        e = r.error_before_exec or r.error_in_exec
        return ("FAILED", _first_line(e), None) if e is not None else ("ran", "", r.result)
    except BaseException as e:  # noqa: B036 - a cell's SystemExit / KeyboardInterrupt is its failure
        if os.environ.get("ATTNSCOPE_DEMO_TRACE"):
            traceback.print_exc()
        return "FAILED", _first_line(e), None
    finally:
        signal.alarm(0)


def run_demo(folder: str, demo: str, limit_s: int, tl: bool = False, ref: dict = None, full_limit_s: int = 0):
    """[(cell index, 'ran' | 'FAILED' | 'skipped', error or the numbers' comparison, seconds)],
    and each cell's numbers: each cell in an IPython shell (as in Jupyter: magics and
    get_ipython() work), one namespace per demo."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.reset()
    # as a Jupyter kernel starts (IPython's default_extensions): Exploratory_Analysis_Demo's first
    # cell loads autoreload only where no extension is loaded yet
    shell.extension_manager.load_extension("storemagic")
    shell.run_cell(PRELUDE, silent=True)
    if tl:
        import tl_loaders
        tl_loaders.install(MODEL)
    rows, numbers = [], {}
    signal.signal(signal.SIGALRM, _alarm)
    for i, src in enumerate(cells(folder, demo)):
        t = time.time()
        if (demo, i) in SKIP:
            rows.append((i, "skipped", SKIP[demo, i], 0.0))
            print(f"{demo}\tcell{i:03d}\tskipped\t0.0s\t{SKIP[demo, i]}", flush=True)
            continue
        before = dict(shell.user_ns)
        _seed()
        loads = "boot_transformers" in src or "from_pretrained" in src  # a model load: the whole limit
        status, err, value = run_cell(shell, rewrite(src, demo, i, tl), full_limit_s if loads else limit_s)
        if status == "ran" and (tl or ref is not None):
            numbers[i] = snapshot(shell.user_ns, before, value)
            if ref is not None:
                off = {k: why for (d, c, k), why in TL_OFF.items() if (d, c) == (demo, i)}
                err = compare(numbers[i], ref.get("numbers", {}).get(i, {}), off)
        if ref is not None and status == "FAILED" and ref.get("status", {}).get(i) == "FAILED":
            err = f"fails with TL too (TL: {ref['errors'][i]}); here: {err}"
        rows.append((i, status, err, time.time() - t))
        print(f"{demo}\tcell{i:03d}\t{status}\t{rows[-1][3]:.1f}s\t{err}", flush=True)
    return rows, numbers


def child(args):
    """One demo in this process: `--child DEMO FOLDER OUT [--tl] [--ref REF]`."""
    demo, folder, out = args[1], args[2], args[3]
    tl = "--tl" in args
    ref = pickle.load(open(args[args.index("--ref") + 1], "rb")) if "--ref" in args else None
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    limit = int(os.environ.get("ATTNSCOPE_DEMO_CELL_LIMIT", "300"))
    full = limit
    if tl:  # TL's run only gives the numbers to compare with: a slow cell there is left uncompared
        limit = int(os.environ.get("ATTNSCOPE_DEMO_TL_CELL_LIMIT", str(limit)))
    rows, numbers = run_demo(folder, demo, limit, tl=tl, ref=ref, full_limit_s=full)
    with open(out, "wb") as f:
        pickle.dump({"rows": rows, "numbers": numbers if tl else {}, "status": {r[0]: r[1] for r in rows},
                     "errors": {r[0]: r[2] for r in rows}}, f)


def _spawn(demo: str, folder: str, out: str, extra) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", demo, folder, out, *extra]
    subprocess.run(cmd, check=False)
    if not os.path.exists(out):
        return {"rows": [(0, "FAILED", "the demo's process died (see its output above)", 0.0)]}
    return pickle.load(open(out, "rb"))


def main():
    if sys.argv[1] == "--child":
        return child(sys.argv[1:])
    against_tl = "--tl" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--tl"]
    folder, demos = args[0], args[1:] or DEMOS
    total = ran = checked = 0
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for demo in demos:
            extra = []
            if against_tl:
                ref_path = os.path.join(tmp, f"{demo}.tl.pkl")
                _spawn(demo, folder, ref_path, ["--tl"])
                extra = ["--ref", ref_path]
            rows = _spawn(demo, folder, os.path.join(tmp, f"{demo}.pkl"), extra)["rows"]
            n = sum(r[1] == "ran" for r in rows)
            print(f"== {demo}: {n} of {len(rows)} cells ran", flush=True)
            total, ran = total + len(rows), ran + n
            checked += sum(r[1] == "ran" and "numbers match" in r[2] for r in rows)
            table += [(demo, *r) for r in rows]
    print("\n| demo | cell | result | seconds | error (first line), or the numbers against TL |\n|---|---|---|---|---|")
    for demo, i, status, err, secs in table:
        print(f"| {demo} | {i} | {status} | {secs:.1f} | {err.replace('|', '/')} |")
    print("\nGPT-2-specific lines changed (in TL's run too):")
    for (demo, i), rules in sorted(CELL_REWRITES.items()):
        print(f"- {demo} cell {i}: {'; '.join(why for _, _, why in rules)}")
    print("\nNumbers where TL is off (not counted as differences):")
    for (demo, i, name), why in sorted(TL_OFF.items()):
        print(f"- {demo} cell {i} {name}: {why}")
    print(f"\n== all: {ran} of {total} cells ran ({100 * ran / max(total, 1):.0f}%)"
          + (f"; {checked} of them made numbers that match TL's within {BOUND:g}" if against_tl else ""))


if __name__ == "__main__":
    main()
