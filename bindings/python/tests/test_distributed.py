"""Corpus statistics on a local Ray cluster (2 CPUs, 2 workers): the merged result equals the
single-process `attnscope corpus` (each f32 to its own precision: the merge is a typed call, the
CLI's JSON writes the shortest decimal), also when a worker is killed mid-run (at a known point), for any worker
count, with failing texts, and when resumed from partial results."""

import glob
import json
import os
import signal
import subprocess
import sys
import threading
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


def _kill_point():
    """Runs in every Ray worker process as it starts (Ray's worker_process_setup_hook): the first
    worker to finish a batch in an ``out_dir`` that holds ``victim.fifo`` (first by an exclusive
    create) has written that batch's part file; it then hands its pid and the batch's ids to the
    test through the FIFO and waits there, to be killed. Other runs are not touched."""
    import attnscope.distributed as d

    run = d._Worker.__call__

    def call(self, batch):
        rows = run(self, batch)
        fifo = os.path.join(self.out_dir, "victim.fifo") if self.out_dir else None
        if fifo and os.path.exists(fifo):
            try:
                os.close(os.open(os.path.join(self.out_dir, "victim.claimed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return rows
            with open(fifo, "w") as f:
                f.write(json.dumps({"pid": os.getpid(), "ids": [int(i) for i in rows["id"]]}))
            threading.Event().wait()  # SIGKILL ends it here
        return rows

    d._Worker.__call__ = call


@pytest.fixture(scope="module")
def local_ray():
    # the hook is sent to the workers by value (they cannot import this test module)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"worker_process_setup_hook": _kill_point})
    yield
    ray.shutdown()


def single(*args):
    out = subprocess.run([BIN, "corpus", "--model", MODEL, *args, "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_two_workers_equal_one_process_even_when_one_is_killed(local_ray, tmp_path):
    """A worker killed (SIGKILL: no cleanup at all) at a known point, after it wrote one batch's
    records and before Ray got them: Ray restarts it and runs that batch again, so exactly that
    batch's texts have two (identical) records on disk, every other text one, and the merged
    result is the single process's."""
    want = single("--limit", str(N))
    out = tmp_path / "records"
    out.mkdir()
    fifo = out / "victim.fifo"
    os.mkfifo(fifo)
    victim = {}

    def killer():
        with open(fifo) as f:  # until the victim has written and closed its end
            said = f.read()
        if said:
            victim.update(json.loads(said))
            os.kill(victim["pid"], signal.SIGKILL)

    t = threading.Thread(target=killer)
    t.start()
    try:
        got = dist.corpus(None, model=MODEL, num_workers=2, limit=N, out_dir=out, batch_size=2)
    finally:
        # a run in which no worker reached the kill point: the killer's open is let go empty
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # the killer has read and closed its end already
        t.join()
    assert victim, "no worker reached the kill point: the test did not test anything"
    assert_same(got, want)
    lines = [json.loads(l) for f in glob.glob(str(out / "part-*.jsonl")) for l in open(f)]
    seen = {}
    for r in lines:
        assert r["record"]["id"] == r["id"], r["id"]
        seen.setdefault(r["id"], []).append(r["record"])
    assert sorted(seen) == list(range(N))
    twice = sorted(i for i, recs in seen.items() if len(recs) > 1)
    assert twice == sorted(victim["ids"]), f"run twice: {twice}; the killed batch: {victim['ids']}"
    assert all(len(seen[i]) == 2 and seen[i][0] == seen[i][1] for i in twice)


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
