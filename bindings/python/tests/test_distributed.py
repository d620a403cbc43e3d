"""Corpus statistics on a local Ray cluster (2 CPUs, 2 workers): the merged result equals the
single-process `attnscope corpus` (each f32 to its own precision: the merge is a typed call, the
CLI's JSON writes the shortest decimal), also when a worker is killed mid-run, for any worker
count, with failing texts, and when resumed from partial results."""

import glob
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

if os.environ.get("ATTNSCOPE_REQUIRE_PYTHON") == "1":
    import ray  # CI installs it: a missing Ray fails here
else:
    ray = pytest.importorskip("ray", reason="pip install 'ray[data]' to run the distributed tests")

import attnscope.distributed as dist
from test_attnscope import assert_same

ROOT = Path(__file__).resolve().parents[3]
BIN = os.environ.get("ATTNSCOPE_BIN", str(ROOT / "target" / "release" / "attnscope"))
MODEL = "smollm2-135m"
N = 40


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def single(*args):
    out = subprocess.run([BIN, "corpus", "--model", MODEL, *args, "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_two_workers_equal_one_process_even_when_one_is_killed(local_ray, tmp_path):
    want = single("--limit", str(N))
    out = tmp_path / "records"
    killed = []

    def killer():
        # once a batch is written, kill one worker process (SIGKILL: no cleanup at all)
        deadline = time.time() + 300
        while time.time() < deadline and not killed:
            pids = [int(Path(p).stem.split("-")[1]) for p in glob.glob(str(out / "worker-*.pid"))]
            if len(pids) >= 2 and glob.glob(str(out / "part-*.jsonl")):
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
            time.sleep(0.05)

    t = threading.Thread(target=killer)
    t.start()
    got = dist.corpus(None, model=MODEL, num_workers=2, limit=N, out_dir=out, batch_size=2)
    t.join()
    assert killed, "no worker was killed: the test did not test anything"
    assert_same(got, want)
    # every text has exactly its record in the partial files
    lines = [json.loads(l) for f in glob.glob(str(out / "part-*.jsonl")) for l in open(f)]
    assert sorted({r["id"] for r in lines}) == list(range(N)) and all(r["record"]["id"] == r["id"] for r in lines)


def test_any_worker_count_order_and_resume(local_ray, tmp_path):
    texts = ["The cat sat on the mat.", "   ", "Hà Nội là thủ đô của Việt Nam.", "x " * 9000, "Attention is all you need.", "A B C D E F G"]
    f = tmp_path / "texts.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    want = single("--file", str(f))
    with pytest.warns(UserWarning, match="text 1 was skipped"):
        one = dist.corpus(str(f), model=MODEL, num_workers=1, batch_size=5)
    assert_same(one, want)
    out = tmp_path / "rec"
    with pytest.warns(UserWarning):
        two = dist.corpus(list(texts), model=MODEL, num_workers=2, batch_size=1, out_dir=out)
    assert_same(two, want)
    parts = sorted(glob.glob(str(out / "part-*.jsonl")))
    stamp = [os.path.getmtime(p) for p in parts]
    # a re-run resumes: nothing is computed again, the result is the same
    with pytest.warns(UserWarning):
        again = dist.corpus(list(texts), model=MODEL, num_workers=2, out_dir=out)
    assert_same(again, want)
    assert sorted(glob.glob(str(out / "part-*.jsonl"))) == parts
    assert [os.path.getmtime(p) for p in parts] == stamp
    # records of other texts are refused, not mixed in
    with pytest.raises(ValueError, match="another text"):
        dist.corpus(list(reversed(texts)), model=MODEL, out_dir=out)


def test_faithfulness_over_a_corpus(local_ray):
    texts = ["The capital of France is Paris.", "One, two, three, four"]
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as fh:
        fh.write("\n".join(texts) + "\n")
    try:
        want = single("--file", fh.name, "--faithfulness")
    finally:
        os.unlink(fh.name)
    got = dist.faithfulness(texts, model=MODEL, num_workers=2, batch_size=1)
    assert_same(got, want)
    assert got["faithfulness"]


def test_head_roles_over_a_corpus(local_ray, tmp_path):
    texts = ["the cat sat on the mat and the cat sat", "one two three one two three one two three", "Hà Nội là thủ đô của Việt Nam. Hà Nội"]
    f = tmp_path / "lines.txt"
    f.write_text("\n".join(texts) + "\n")
    out = subprocess.run([BIN, "heads", "--model", MODEL, "--file", str(f), "--each-line", "--json"], capture_output=True, text=True, check=True)
    want = json.loads(out.stdout)
    got = dist.heads(texts, model=MODEL, num_workers=2, batch_size=1)
    assert got == want
    assert set(got["roles"]) == {"previous_token", "duplicate_token", "induction", "sink", "local"} and got["texts"] == 3
