"""`model.circuit` and `model.qk_attribution` on SmolLM2 against the CLI's own JSON
(`attnscope circuit --json`, `attnscope qk --json`): the same numbers, bit for bit."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
BIN = os.environ.get("ATTNSCOPE_BIN", str(ROOT / "target" / "release" / "attnscope"))
CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPT = "When Mary and John went to the store, Mary gave a drink to"


def cli(*args):
    out = subprocess.run([BIN, *args, "-m", "smollm2-135m", "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def f32(x):
    return np.float32(x)


def same_f32(a, b, where):
    """Each f32 of the report is the same float32 both ways (the JSON writes its shortest decimal)."""
    if isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            if k != "seconds":
                same_f32(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            same_f32(x, y, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        # f64 fields (faithfulness, cpr, cmd, spearman) round-trip through JSON exactly too
        assert a == b or f32(a) == f32(b) and abs(a - b) <= 1e-7 * max(1.0, abs(a)), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_circuit_equals_the_cli(smol):
    r = smol.circuit(CLEAN, CORRUPT, " Mary", " John", method="eap-ig", steps=2, evaluate=True, exact_edges=8)
    c = cli("circuit", "--clean", CLEAN, "--corrupt", CORRUPT, "--answer", " Mary", "--wrong", " John",
            "--method", "eap-ig", "--steps", "2", "--evaluate", "--exact-edges", "8")
    edges = c.pop("edges")
    assert len(edges) == c["n_edges"] == len(r["edge_scores"]) == int(np.isfinite(r["scores"]).sum())
    nodes, readers = r["node_names"], r["reader_names"]
    assert r["scores"].shape == (c["n_nodes"], c["n_readers"]) and r["scores"].dtype == np.float32
    assert len(nodes) == c["n_nodes"] and len(readers) == c["n_readers"]
    # every edge's score, the ranked arrays and the matrix, the same float32 as the CLI's
    got = [(nodes[u], readers[v], s) for u, v, s in zip(r["edge_from"], r["edge_to"], r["edge_scores"])]
    assert [(e["from"], e["to"]) for e in edges] == [(u, v) for u, v, _ in got]
    want = np.asarray([e["score"] for e in edges], dtype=np.float32)
    assert np.array_equal(r["edge_scores"], want)
    assert np.array_equal(r["scores"][r["edge_from"], r["edge_to"]], want)
    assert r.edges(3) == [(e["from"], e["to"], float(f32(e["score"]))) for e in edges[:3]]
    # the report's other fields, the same (evaluation's ladders, CPR/CMD, the exact edges)
    rep = {k: v for k, v in r.items() if k in c}
    assert set(rep) == set(c)
    same_f32(rep, c, "circuit")
    assert len(r["exact_edges"]["edges"]) == 8 and r["evaluation"]["ladder"][-1]["faithfulness"] == pytest.approx(1, abs=1e-4)
    # TransformerLens's hook points beside the EAP-IG library's names
    at = nodes.index("a3.h2")
    assert r["node_hooks"][at] == "blocks.3.attn.hook_result" and r["node_hooks"][0] == "hook_embed"
    assert r["reader_hooks"][readers.index("logits")] == f"blocks.{smol.cfg.n_layers - 1}.hook_resid_post"
    assert r["reader_hooks"][readers.index("a4.kv1.k")] == "blocks.4.hook_k_input"


def test_circuit_pairs_and_bad_input(smol, tmp_path):
    pairs = [{"clean": CLEAN, "corrupt": CORRUPT, "answer": " Mary", "wrong": " John"},
             {"clean": "When Anna and Paul went to the park, Paul gave a ball to",
              "corrupt": "When Anna and Paul went to the park, Anna gave a ball to", "answer": " Anna", "wrong": " Paul"}]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    a, b = smol.circuit(pairs=pairs), smol.circuit(pairs=f)
    assert a["pairs"] == 2 and np.array_equal(a["edge_scores"], b["edge_scores"])
    c = cli("circuit", "--pairs", str(f))
    assert np.array_equal(a["edge_scores"], np.asarray([e["score"] for e in c["edges"]], dtype=np.float32))
    with pytest.raises(ValueError, match="same count; they first differ at position"):
        smol.circuit(CLEAN, "When Mary and John went to the store, Mary gave a drink to her", " Mary", " John")
    with pytest.raises(ValueError, match="pairs line 2: no \"wrong\" field"):
        smol.circuit(pairs=[pairs[0], {k: v for k, v in pairs[1].items() if k != "wrong"}])
    with pytest.raises(ValueError, match="steps=0"):
        smol.circuit(CLEAN, CORRUPT, " Mary", " John", method="eap-ig", steps=0)
    with pytest.raises(ValueError, match="method"):
        smol.circuit(CLEAN, CORRUPT, " Mary", " John", method="acdc")
    with pytest.raises(ValueError, match="wrong is missing"):
        smol.circuit(CLEAN, CORRUPT, " Mary")
    with pytest.raises(ValueError, match="not both"):
        smol.circuit(CLEAN, pairs=pairs)


def test_qk_attribution_equals_the_cli(smol):
    r = smol.qk_attribution(CLEAN, 5, 3)
    c = cli("qk", "--text", CLEAN, "--layer", "5", "--head", "3")
    same_f32({k: v for k, v in r.items() if k in c}, c, "qk")
    assert set(c) <= set(r)
    assert np.array_equal(r["values"], np.asarray([t["value"] for t in c["terms"]]))
    assert r["values"].sum() == pytest.approx(r["score"], abs=1e-4)
    assert r["matrix"].sum() == pytest.approx(r["sum"], abs=1e-9)
    names = r["matrix_names"]
    t = c["terms"][0]
    assert r["matrix"][names.index(t["query_side"]), names.index(t["key_side"])] == t["value"]
    k = smol.qk_attribution(CLEAN, 5, 3, query=10, key=3)
    assert (k["query"], k["key"], k["against"]) == (10, 3, None)
    assert k["sum"] == pytest.approx(k["score"], abs=1e-4)
    with pytest.raises(ValueError, match="against"):
        smol.qk_attribution(CLEAN, 5, 3, against="max")
    with pytest.raises(ValueError, match="layer"):
        smol.qk_attribution(CLEAN, 99, 0)
