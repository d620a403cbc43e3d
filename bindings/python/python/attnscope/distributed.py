"""Corpus-scale attention statistics on Ray (a laptop, a cluster or an autoscaler, one code path).

    import attnscope.distributed as dist
    agg = dist.corpus("texts.jsonl", model="qwen2.5-coder-0.5b", num_workers=8, out_dir="records/")

Each Ray worker loads the model once (a Ray Data ``map_batches`` actor) and returns each text's
record, the same record ``attnscope corpus --out`` writes. The records are merged by the exact merge
of ``attnscope corpus merge``, so the result is identical, to the last digit of every mean, std and
confidence interval, to a single-process ``attnscope corpus`` over the same texts, whatever the
worker count and order. Needs ``pip install "ray[data]"``.

Faults: a worker killed mid-run is restarted by Ray and its batch run again (records are idempotent
per text); a text that fails (empty, longer than the context) is reported, not fatal, and left out
as the CLI leaves it out; with ``out_dir`` every finished batch is written at once (one JSONL file
per batch, renamed into place when complete) and a re-run resumes from them."""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
import time
import uuid
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from . import _native

__all__ = ["corpus", "faithfulness", "heads", "load_texts"]


def load_texts(source: Union[None, str, os.PathLike, Sequence[str]]) -> List[Tuple[int, str]]:
    """(id, text) pairs with the ids ``attnscope corpus`` gives: None = the built-in corpus; a .txt
    (one text per line) or .jsonl file; a folder of them (files in sorted order, ids running on);
    or a list of texts."""
    if source is None:
        return list(enumerate(_native.corpus_texts(None)))
    if isinstance(source, (list, tuple)):
        return [(i, str(t)) for i, t in enumerate(source)]
    path = os.fspath(source)
    if os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "*")) if f.endswith((".txt", ".jsonl")))
        if not files:
            raise ValueError(f"{path} holds no .txt or .jsonl files")
        texts: List[str] = []
        for f in files:
            texts.extend(_native.corpus_texts(f))
        return list(enumerate(texts))
    return list(enumerate(_native.corpus_texts(path)))


class _Worker:
    """One Ray actor: the model, loaded once; each batch of (id, text) becomes records (``kind``
    "corpus": the records of ``attnscope corpus --out``; "heads": each text's head-role scores)."""

    def __init__(self, model: str, precision: str, bos: bool, faithfulness: bool, out_dir: Optional[str], threads: int, kind: str = "corpus"):
        # the engine's thread pool is sized from this on first use: one pool per worker's CPUs
        os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, threads)))
        if out_dir:
            # lets a test (or an operator) find the worker processes
            open(os.path.join(out_dir, f"worker-{os.getpid()}.pid"), "w").close()
        self.model = _native.Model.load(model, precision)
        self.bos, self.faithfulness, self.out_dir, self.kind = bos, faithfulness, out_dir, kind

    def __call__(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        items = [(int(i), str(t)) for i, t in zip(batch["id"], batch["text"])]
        if self.kind == "heads":
            rows = self.model.head_roles(items, self.bos)
        else:
            rows = self.model.corpus_records(items, self.bos, self.faithfulness)
        if self.out_dir and rows:
            # one file per batch, complete before it gets its name: a killed worker leaves none
            name = os.path.join(self.out_dir, f"part-{rows[0][0]:08d}-{uuid.uuid4().hex[:8]}.jsonl")
            with open(name + ".tmp", "w", encoding="utf-8") as f:
                for i, rec, err in rows:
                    f.write(json.dumps({"id": i, "record": json.loads(rec) if rec else None, "error": err}, ensure_ascii=False) + "\n")
            os.replace(name + ".tmp", name)
        return {"id": [r[0] for r in rows], "record": [r[1] for r in rows], "error": [r[2] for r in rows]}


def _done(out_dir: str) -> Dict[int, Tuple[str, str]]:
    """(record JSON, error) already in ``out_dir``, by text id."""
    done: Dict[int, Tuple[str, str]] = {}
    for f in sorted(glob.glob(os.path.join(out_dir, "part-*.jsonl"))):
        with open(f, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    v = json.loads(line)
                    done[int(v["id"])] = (json.dumps(v["record"], ensure_ascii=False) if v["record"] is not None else "", v["error"])
    return done


def _merge(records: Iterable[str], epsilon: float) -> Dict[str, Any]:
    """The exact merge of ``attnscope corpus merge``."""
    fd, path = tempfile.mkstemp(suffix=".jsonl", prefix="attnscope-records-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in records:
                f.write(r + "\n")
        return _native.corpus_merge([path], float(epsilon))
    finally:
        os.unlink(path)


def _run(
    kind: str,
    texts_or_path: Any,
    model: str,
    num_workers: int,
    precision: str,
    bos: bool,
    faithfulness: bool,
    limit: Optional[int],
    out_dir: Optional[Union[str, os.PathLike]],
    batch_size: int,
    cpus_per_worker: Optional[float],
    ray_address: Optional[str],
) -> Tuple[List[str], List[Tuple[int, str]], int, float]:
    """Runs every text on Ray workers; returns the records in id order, the errors, how many
    texts ran now, and the seconds taken."""
    import ray
    import ray.data

    start = time.perf_counter()
    if isinstance(texts_or_path, ray.data.Dataset):
        rows = texts_or_path.take_all()
        items = [(int(r.get("id", i)), str(r["text"])) for i, r in enumerate(rows)]
    else:
        items = load_texts(texts_or_path)
    if limit is not None:
        items = items[:limit]
    if not items:
        raise ValueError("no texts to run")
    out = os.fspath(out_dir) if out_dir is not None else None
    done: Dict[int, Tuple[str, str]] = {}
    texts = dict(items)
    if out:
        os.makedirs(out, exist_ok=True)
        done = _done(out)
        for i, (rec, _) in done.items():
            v = json.loads(rec) if rec else {}
            if i in texts and "text" in v and v["text"] != texts[i]:
                raise ValueError(f"{out} holds a record {i} for another text than text {i} of this corpus; use another out_dir")
            if "model" in v and v["model"] not in (model, os.path.basename(os.fspath(model))):
                raise ValueError(f"{out} holds records of model {v['model']!r}, not {model!r}; use another out_dir")
            if kind == "heads" and rec and "roles" not in v or kind == "corpus" and rec and "sink_all" not in v:
                raise ValueError(f"{out} holds records of another kind than {kind}; use another out_dir")
    todo = [(i, t) for i, t in items if i not in done]
    if not ray.is_initialized():
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
    cpus = cpus_per_worker or max(1.0, float(ray.cluster_resources().get("CPU", 1)) // max(1, num_workers))
    results: Dict[int, Tuple[str, str]] = {i: r for i, r in done.items() if i in texts}
    if todo:
        ds = ray.data.from_items([{"id": i, "text": t} for i, t in todo])
        mapped = ds.map_batches(
            _Worker,
            fn_constructor_kwargs=dict(model=model, precision=precision, bos=bos, faithfulness=faithfulness, out_dir=out, threads=int(cpus), kind=kind),
            batch_size=batch_size,
            concurrency=num_workers,
            num_cpus=cpus,
            # a killed worker is restarted and its batch run again
            max_restarts=-1,
            max_task_retries=-1,
        )
        for r in mapped.iter_rows():
            results[int(r["id"])] = (r["record"], r["error"])
    records, errors = [], []
    for i in sorted(results):
        rec, err = results[i]
        if rec:
            records.append(rec)
        else:
            errors.append((i, err))
    for i, e in errors:
        warnings.warn(f"text {i} was skipped: {e}", stacklevel=3)
    if not records:
        raise ValueError(f"none of the {len(items)} texts could be run; first error: {errors[0][1] if errors else '?'}")
    return records, errors, len(todo), time.perf_counter() - start


def _summary(what: str, records: int, todo: int, errors: int, tokens: int, secs: float, num_workers: int) -> None:
    print(
        f"attnscope.distributed.{what}: {records} texts ({todo} run now, {errors} skipped), {tokens} tokens, "
        f"{secs:.1f} s, {todo / secs / max(1, num_workers):.2f} texts/s per worker ({num_workers} workers)",
        file=sys.stderr,
    )


def corpus(
    texts_or_path: Union[None, str, os.PathLike, Sequence[str], Any] = None,
    model: str = "qwen2.5-coder-0.5b",
    num_workers: int = 2,
    precision: str = "exact",
    bos: bool = False,
    faithfulness: bool = False,
    limit: Optional[int] = None,
    epsilon: float = 0.3,
    out_dir: Optional[Union[str, os.PathLike]] = None,
    batch_size: int = 4,
    cpus_per_worker: Optional[float] = None,
    ray_address: Optional[str] = None,
) -> Dict[str, Any]:
    """The aggregate ``attnscope corpus --json`` prints for these texts, computed by ``num_workers``
    Ray workers. ``texts_or_path``: None (the built-in corpus), a .txt / .jsonl file, a folder of
    them, a list of texts, or a Ray Dataset with a ``text`` column (and optionally ``id``).
    ``faithfulness=True`` adds the occlusion rankings to each record, as ``corpus --faithfulness``.
    ``out_dir``: write records as they arrive and resume from them. Starts a local Ray (or joins
    ``ray_address``) unless Ray is already initialized."""
    records, errors, todo, secs = _run("corpus", texts_or_path, model, num_workers, precision, bos, faithfulness, limit, out_dir, batch_size, cpus_per_worker, ray_address)
    agg = _merge(records, epsilon)
    _summary("corpus", len(records), todo, len(errors), agg["tokens"], secs, num_workers)
    return agg


def faithfulness(texts_or_path=None, **kw: Any) -> Dict[str, Any]:
    """:func:`corpus` with the occlusion rankings of every text (``attnscope corpus --faithfulness``):
    the aggregate's ``faithfulness`` part sets attention rankings against leave-one-out."""
    return corpus(texts_or_path, faithfulness=True, **kw)


def heads(
    texts_or_path: Union[None, str, os.PathLike, Sequence[str], Any] = None,
    model: str = "qwen2.5-coder-0.5b",
    num_workers: int = 2,
    precision: str = "exact",
    bos: bool = False,
    limit: Optional[int] = None,
    out_dir: Optional[Union[str, os.PathLike]] = None,
    batch_size: int = 4,
    cpus_per_worker: Optional[float] = None,
    ray_address: Optional[str] = None,
) -> Dict[str, Any]:
    """Head-role scores (previous token, duplicate, induction, sink, local) averaged over the
    texts, each text counting once: the document ``attnscope heads --file F --each-line --json``
    prints for the same texts, identical to the last digit."""
    records, errors, todo, secs = _run("heads", texts_or_path, model, num_workers, precision, bos, False, limit, out_dir, batch_size, cpus_per_worker, ray_address)
    m = _native.Model.load(model, precision)
    doc = json.loads(m.head_roles_document(records))
    _summary("heads", len(records), todo, len(errors), sum(len(json.loads(r)["tokens"]) for r in records), secs, num_workers)
    return doc
