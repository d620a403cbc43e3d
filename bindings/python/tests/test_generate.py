"""HookedModel.generate (issue #40) on the default-size tiny path: SmolLM2, greedy against the
reference tokens in tests/golden/smol_generate.json, seeded sampling reproducible, bad input."""
import json
import os

import numpy as np
import pytest

import attnscope

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests", "golden", "smol_generate.json")


@pytest.fixture(scope="module")
def smol():
    return attnscope.HookedModel.from_pretrained("smollm2-135m")


def test_greedy_equals_transformers(smol):
    cases = json.load(open(GOLDEN, encoding="utf-8"))["cases"]
    for c in cases.values():
        toks = smol.generate(c["prompt"], max_new_tokens=c["max_new_tokens"], chat=c["kind"] == "chat",
                             return_type="tokens")
        assert toks.shape[0] == 1
        assert list(np.asarray(toks)[0]) == c["prompt_ids"] + c["generated_ids"]
        d = smol.generate(c["prompt"], max_new_tokens=c["max_new_tokens"], chat=c["kind"] == "chat",
                          return_type="details")
        got = [t["sink"] for t in d["generated"][1:]]
        want = c["sink_rows"][: len(got)]
        assert np.abs(np.asarray(got) - np.asarray(want)).max() <= 1e-4
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
