"""The examples the docs point at (examples/), run as a user runs them, their output checked: the
quick start (numpy only), the TransformerLens demo snippets ("13 of 15 run", docs/commands/
interventions.md) and the TransformerLens demo, the last two with torch and einops.

torch comes from a second interpreter: ``$ATTNSCOPE_TORCH_PYTHON``, else ``target/torchenv/bin/python``
(.ci/run makes it: Debian's CPU build of torch, einops from PyPI), with this package put on its
path (a link to the package this test imports, nothing else of this environment, so its numpy
stays the one its torch was built with). Without one the TL tests are skipped with the reason, and
CI, which requires every Python test, fails."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import attnscope

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"


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
    loss = re.search(r"^loss (\S+) ablated (\S+)$", out, re.M)
    assert loss and 0 < float(loss.group(1)) != float(loss.group(2)) > 0, out
    assert re.search(r"^pattern-ablated diff -?[\d.]+$", out, re.M), out
    dla = re.search(r"^top heads by DLA \[(.+)\]$", out, re.M)
    assert dla and len(re.findall(r"\('L\d+H\d+', -?[\d.]+\)", dla.group(1))) == 5, out
    # rows of every pattern sum to 1; the pattern is [batch, 14 heads, n, n]
    assert lines[-1] == f"True torch.Size([1, 14, {n}, {n}])", lines[-1]
