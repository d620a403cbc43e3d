"""#59: TransformerLens's own demo notebooks run against attnscope, cell by cell, with only the
import and the model name changed, and a per-cell table printed (demo, cell, ran/FAILED, the
error's first line).

    target/torchenv/bin/python bindings/python/tests/tl_demos/run_demos.py NOTEBOOK_DIR [DEMO ...]

NOTEBOOK_DIR holds TL's notebooks (Main_Demo.ipynb, Exploratory_Analysis_Demo.ipynb,
Head_Detector_Demo.ipynb, Activation_Patching_in_TL_Demo.ipynb, Attribution_Patching_Demo.ipynb,
from TransformerLens's demos/ folder). Each code cell is rewritten by the rules in REWRITES (the
import lines and the model names; `%pip install` lines are left out) and run in order in one
IPython shell per demo, as Jupyter runs them (IPython, plotly, nbformat and circuitsvis installed
beside torch); a cell's output is not checked here
(the table says ran or FAILED; numbers are checked against real TL in test_tl_real.py). MODEL
(env ATTNSCOPE_DEMO_MODEL) replaces GPT-2: the GPT-2-specific cells (names of GPT-2's tokens,
heads and layers) are the ones the table shows failing for that reason."""

import json
import os
import re
import signal
import sys
import time
import traceback

MODEL = os.environ.get("ATTNSCOPE_DEMO_MODEL", "smollm2-135m")
DEMOS = ["Main_Demo", "Exploratory_Analysis_Demo", "Head_Detector_Demo", "Activation_Patching_in_TL_Demo",
         "Attribution_Patching_Demo"]
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
    (r"""(boot_transformers|from_pretrained(?:_no_processing)?)\(\s*["'][^"']+["']""", r'\1("' + MODEL + '"'),
    (r"^(\s*)[%!]\s*pip .*$", r"\1pass  # pip left out: the environment has what the demo needs"),
]

# cells not run, and why (the table shows them as skipped)
SKIP = {
    ("Main_Demo", 48): "the full OV circuit over the vocabulary: factors of 2 x 3.4 GB on SmolLM2 "
                       "(30 x 9 heads x 49152 x 64), more than a shared 24 GiB machine spares",
}


def rewrite(src: str) -> str:
    out = []
    for line in src.splitlines():
        for pat, rep in REWRITES:
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


def run_demo(folder: str, demo: str, limit_s: int):
    """[(cell index, 'ran' | 'FAILED', first line of the error, seconds)]: each cell in an IPython
    shell (as in Jupyter: magics and get_ipython() work), one namespace per demo."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.reset()
    rows = []
    signal.signal(signal.SIGALRM, _alarm)
    for i, src in enumerate(cells(folder, demo)):
        code, t = rewrite(src), time.time()
        if (demo, i) in SKIP:
            rows.append((i, "skipped", SKIP[demo, i], 0.0))
            print(f"{demo}\tcell{i:03d}\tskipped\t0.0s\t{SKIP[demo, i]}", flush=True)
            continue
        signal.alarm(limit_s)
        try:
            r = shell.run_cell(code, silent=False)
            e = r.error_before_exec or r.error_in_exec
            status, err = ("FAILED", _first_line(e)) if e is not None else ("ran", "")
        except BaseException as e:  # noqa: B036 - a cell's SystemExit / KeyboardInterrupt is its failure
            status, err = "FAILED", _first_line(e)
            if os.environ.get("ATTNSCOPE_DEMO_TRACE"):
                traceback.print_exc()
        finally:
            signal.alarm(0)
        rows.append((i, status, err, time.time() - t))
        print(f"{demo}\tcell{i:03d}\t{status}\t{rows[-1][3]:.1f}s\t{err}", flush=True)
    return rows


def main():
    folder, demos = sys.argv[1], sys.argv[2:] or DEMOS
    limit = int(os.environ.get("ATTNSCOPE_DEMO_CELL_LIMIT", "300"))
    total = ran = 0
    table = []
    for demo in demos:
        rows = run_demo(folder, demo, limit)
        n = sum(r[1] == "ran" for r in rows)
        print(f"== {demo}: {n} of {len(rows)} cells ran", flush=True)
        total, ran = total + len(rows), ran + n
        table += [(demo, *r) for r in rows]
    print("\n| demo | cell | result | seconds | error (first line) |\n|---|---|---|---|---|")
    for demo, i, status, err, secs in table:
        print(f"| {demo} | {i} | {status} | {secs:.1f} | {err.replace('|', '/')} |")
    print(f"\n== all: {ran} of {total} cells ran ({100 * ran / max(total, 1):.0f}%)")


if __name__ == "__main__":
    main()
