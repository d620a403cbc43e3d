"""HookedModel.generate (issue #40) on the default-size tiny path: SmolLM2, greedy against the
reference tokens in tests/golden/smol_generate.json, seeded sampling reproducible, bad input."""
import json
import os

import numpy as np
import pytest

import attnscope
from cells import assert_cells

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests", "golden", "smol_generate.json")


def test_greedy_equals_transformers(smol):
    cases = json.load(open(GOLDEN, encoding="utf-8"))["cases"]
    for name, c in cases.items():
        toks = smol.generate(c["prompt"], max_new_tokens=c["max_new_tokens"], chat=c["kind"] == "chat",
                             return_type="tokens")
        assert toks.shape[0] == 1
        assert list(np.asarray(toks)[0]) == c["prompt_ids"] + c["generated_ids"]
        d = smol.generate(c["prompt"], max_new_tokens=c["max_new_tokens"], chat=c["kind"] == "chat",
                          return_type="details")
        got = [t["sink"] for t in d["generated"][1:]]
        # row i produced generated token i + 1; the last row produced nothing
        assert len(c["sink_rows"]) == len(d["generated"])
        want = c["sink_rows"][:-1]
        assert_cells(f"smol {name}: sink profile [generated row, layer]", got, want, atol=2e-5)
    s = smol.generate("Hà Nội là thủ đô của", max_new_tokens=8)
    assert s.startswith("Hà Nội là thủ đô của") and len(s) > len("Hà Nội là thủ đô của")


def test_seeded_sampling_and_bad_input(smol):
    a = smol.generate("Once upon a time", max_new_tokens=8, temperature=1.0, seed=3, return_type="tokens")
    b = smol.generate("Once upon a time", max_new_tokens=8, temperature=1.0, seed=3, return_type="tokens")
    assert np.array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError):
        smol.generate("x", temperature=-1.0)
    with pytest.raises(ValueError):
        smol.generate("x", top_p=0.0)
    with pytest.raises(ValueError):
        smol.generate("x", return_type="bytes")


ATTR_GOLDEN = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests", "golden", "smol_gen_attribution.json")


def test_attribute_generation_equals_autograd_and_deletions(smol):
    """model.attribute_generation against transformers + torch autograd (tests/golden/
    smol_gen_attribution.json): the greedy answer, and the gradient x input and occlusion matrices."""
    g = json.load(open(ATTR_GOLDEN, encoding="utf-8"))
    P, A = len(g["prompt_ids"]), len(g["answer_ids"])
    for method, key in (("grad-x-input", "gxi"), ("occlusion", "occlusion")):
        r = smol.attribute_generation(g["question"], method=method, max_new_tokens=A)
        assert list(r["prompt_ids"]) == g["prompt_ids"] and list(r["answer_ids"]) == g["answer_ids"]
        m = r["matrix"]
        assert m.dtype == np.float32 and m.shape == (P + A, A)
        assert len(r["prompt_tokens"]) == P and len(r["answer_tokens"]) == A
        assert len(g[key]) == A
        got, want = {}, {}
        for j, col in enumerate(g[key]):
            assert len(col) == P + j and np.isnan(m[P + j:, j]).all()
            got.update({(i, j): m[i, j] for i in range(P + j)})
            want.update({(i, j): w for i, w in enumerate(col)})
        # within 1e-4 of the largest value, as tests/generate.rs asserts
        assert_cells(f"smol attribute_generation {method} [position, answer token]", got, want, rel_max=1e-4)
        assert_cells(f"smol attribute_generation {method}: log p [answer token]", r["logprobs"], g["logprob"], atol=1e-4)
        assert len(r["attention"]) == A and all(len(a) == P + j for j, a in enumerate(r["attention"]))
    with pytest.raises(ValueError):
        smol.attribute_generation("x", method="bogus")
