"""The examples the docs point at (examples/), run as a user runs them, their output checked: the
quick start (numpy only), the Slurm array job (examples/slurm/, with a stand-in ``sbatch``), the
TransformerLens demo snippets ("13 of 15 run", docs/commands/interventions.md) and the
TransformerLens demo, the last two with torch and einops.

torch comes from a second interpreter: ``$ATTNSCOPE_TORCH_PYTHON``, else ``target/torchenv/bin/python``
(.ci/run makes it: Debian's CPU build of torch, einops from PyPI), with this package put on its
path (a link to the package this test imports, nothing else of this environment, so its numpy
stays the one its torch was built with). Without one the TL tests are skipped with the reason, and
CI, which requires every Python test, fails."""

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import attnscope

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"
BIN = os.environ.get("ATTNSCOPE_BIN", str(ROOT / "target" / "release" / "attnscope"))


def run(python, script, cwd, *args, env=None):
    r = subprocess.run([python, str(EXAMPLES / script), *args], capture_output=True, text=True, cwd=cwd,
                       env=env, timeout=1800)
    assert r.returncode == 0, f"{script} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def torch_python(tmp_path_factory):
    """(interpreter, environment) that imports torch, einops and this attnscope."""
    python = os.environ.get("ATTNSCOPE_TORCH_PYTHON") or str(ROOT / "target" / "torchenv" / "bin" / "python")
    path = tmp_path_factory.mktemp("attnscope-only")
    (path / "attnscope").symlink_to(Path(attnscope.__file__).parent, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(path)}
    try:
        probe = subprocess.run([python, "-c", "import torch, einops, attnscope; print(torch.__version__)"],
                               capture_output=True, text=True, env=env)
    except OSError as e:
        pytest.skip(f"no Python with torch for the TransformerLens examples ({python}: {e}); see this file's header")
    if probe.returncode != 0:
        pytest.skip(f"{python} cannot import torch, einops and attnscope: {probe.stderr.strip().splitlines()[-1:]}; "
                    "see this file's header")
    print(f"TransformerLens examples on torch {probe.stdout.strip()} ({python})", file=sys.stderr)
    return python, env


def test_the_quickstart(tmp_path, smol):
    out = run(sys.executable, "quickstart.py", tmp_path, "smollm2-135m")
    cfg = smol.cfg
    n = len(smol.to_str_tokens("Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc."))
    want = (f"{n} tokens; logits (1, {n}, {cfg.d_vocab}); {cfg.n_layers} patterns of shape "
            f"(1, {cfg.n_heads}, {n}, {n})")
    assert want in out, out
    sink = re.search(r"^sink profile: ([\d. ]+) \(peak: layer (\d+)\)$", out, re.M)
    assert sink, out
    weights = [float(x) for x in sink.group(1).split()]
    assert len(weights) == cfg.n_layers and all(0 <= w <= 1 for w in weights)
    assert int(sink.group(2)) == max(range(len(weights)), key=lambda i: weights[i])
    heads = re.findall(r"^head (\d): (.+)$", out, re.M)
    assert [h for h, _ in heads] == ["0", "1", "2", "3"] and all(len(top.split(", ")) == 3 for _, top in heads), out
    assert re.search(r"^next token: '.+'$", out, re.M), out
    page = tmp_path / "attnscope-quickstart.html"
    assert f"wrote {page.name}" in out or f"wrote {page}" in out, out
    assert "<!DOCTYPE html>" in page.read_text(encoding="utf-8")[:200]


# A stand-in for Slurm's sbatch: runs the script at once, an array job's tasks one after another
# (SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_COUNT as Slurm sets them), and logs each submission. It
# refuses a dependent job whose dependency did not succeed, as afterok would leave it pending.
FAKE_SBATCH = """#!PYTHON
import os, subprocess, sys
args, env = sys.argv[1:], dict(os.environ)
script = args[-1]
opts = dict(a[2:].split("=", 1) for a in args[:-1] if a.startswith("--") and "=" in a)
with open(os.environ["SBATCH_LOG"], "a") as log:
    log.write(" ".join(args) + "\\n")
if "dependency" in opts and not os.path.exists(os.environ["SBATCH_LOG"] + ".ok"):
    sys.exit("sbatch: the dependency did not succeed")
lo, hi = map(int, opts["array"].split("-")) if "array" in opts else (None, None)
for i in range(lo, hi + 1) if lo is not None else [None]:
    if i is not None:
        env.update(SLURM_ARRAY_TASK_ID=str(i), SLURM_ARRAY_TASK_COUNT=str(hi - lo + 1))
    subprocess.run(["bash", script], env=env, check=True)
open(os.environ["SBATCH_LOG"] + ".ok", "w").close()
print(4242)
"""


def test_the_slurm_array_job(tmp_path):
    # examples/slurm/submit.sh as corpus.md shows it (TEXTS, TASKS, OUT), on SmolLM2 with a
    # stand-in sbatch: three shards, then the merge; the merged aggregate is the single process's
    texts = tmp_path / "texts.txt"
    texts.write_text("".join(f"the hat {i} sat on the mat number {i * i}.\n" for i in range(7)), encoding="utf-8")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(FAKE_SBATCH.replace("PYTHON", sys.executable, 1))
    sbatch.chmod(sbatch.stat().st_mode | stat.S_IXUSR)
    out, log = tmp_path / "corpus-out", tmp_path / "sbatch.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SBATCH_LOG": str(log), "TEXTS": str(texts),
           "TASKS": "3", "OUT": str(out), "MODEL": "smollm2-135m", "ATTNSCOPE": BIN, "SLURM_CPUS_PER_TASK": "1"}
    r = subprocess.run(["bash", str(EXAMPLES / "slurm" / "submit.sh")], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    jobs = log.read_text().splitlines()
    assert len(jobs) == 2 and "--array=0-2" in jobs[0] and "--dependency=afterok:4242" in jobs[1], jobs
    assert sorted(p.name for p in out.glob("shard_*.jsonl")) == [f"shard_{i}.jsonl" for i in range(3)]
    shards = [len((out / f"shard_{i}.jsonl").read_text().splitlines()) for i in range(3)]
    assert sum(shards) == 7 and all(shards), shards
    merged = json.loads((out / "aggregate.json").read_text())
    one = subprocess.run([BIN, "corpus", "--model", "smollm2-135m", "--file", str(texts), "--json"],
                         capture_output=True, text=True, check=True)
    want = json.loads(one.stdout)
    for d in (merged, want):
        d.pop("seconds", None)
    assert merged["sentences"] == 7 and merged == want
    assert (out / "aggregate.txt").read_text().strip(), "the merge's text report is empty"


# the snippets that fail, and why (docs/commands/interventions.md): written for GPT-2, they index
# hook_k / hook_v by query head, which a GQA model (SmolLM2: 9 query heads, 3 key/value heads) has
# only per key/value head
FAILING_SNIPPETS = {
    "main: layer-0 pattern from q and k (einsum, torch.testing.assert_close)",
    "main: head ablation on hook_v, return_type='loss'",
}


def test_the_tl_demo_snippets(tmp_path, torch_python):
    python, env = torch_python
    out = run(python, "tl_demo_snippets.py", tmp_path, env=env)
    results = dict(re.findall(r"^(\w+: .+?): (ok|FAIL .+) \(\d+\.\ds\)$", out, re.M))
    assert len(results) == 15, out
    failed = {name for name, r in results.items() if r != "ok"}
    assert failed == FAILING_SNIPPETS, {n: results[n] for n in failed ^ FAILING_SNIPPETS}
    assert "13 of 15 snippets ran" in out, out


def test_the_transformerlens_demo(tmp_path, torch_python):
    python, env = torch_python
    out = run(python, "transformerlens_demo.py", tmp_path, env=env)
    lines = out.splitlines()
    # results are torch tensors once the program has imported torch
    first = re.fullmatch(r"<class 'torch.Tensor'> torch.Size\(\[1, (\d+), 151936\]\) clean (-?[\d.]+) corrupt (-?[\d.]+)", lines[0])
    assert first, lines[0]
    n, clean, corrupt = int(first.group(1)), float(first.group(2)), float(first.group(3))
    assert clean > 0 > corrupt, lines[0]
    # patching layer 0's residual at one position of the corrupted run: at the one token the two
    # prompts differ in, the clean run's logit difference comes back whole; elsewhere nothing moves
    row0 = [float(x) for x in re.search(r"tensor\(\[\[([^\]]+)\]", out).group(1).replace("\n", " ").split(",")]
    assert len(row0) == n, row0
    assert sum(abs(x - clean) < 1e-4 for x in row0) == 1 and sum(abs(x - corrupt) < 1e-4 for x in row0) == n - 1, row0
    # a 0-d tensor under torch, as TransformerLens returns it (`tensor(3.85)`), else a 0-d array
    loss = re.search(r"^loss (?:tensor\()?([\d.]+)\)? ablated (?:tensor\()?([\d.]+)\)?$", out, re.M)
    assert loss and 0 < float(loss.group(1)) != float(loss.group(2)) > 0, out
    assert re.search(r"^pattern-ablated diff -?[\d.]+$", out, re.M), out
    dla = re.search(r"^top heads by DLA \[(.+)\]$", out, re.M)
    assert dla and len(re.findall(r"\('L\d+H\d+', -?[\d.]+\)", dla.group(1))) == 5, out
    # rows of every pattern sum to 1; the pattern is [batch, 14 heads, n, n]
    assert lines[-1] == f"True torch.Size([1, 14, {n}, {n}])", lines[-1]
