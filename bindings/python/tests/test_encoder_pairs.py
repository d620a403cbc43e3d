"""An encoder's sentence pairs from Python (issue #41): ``run_with_cache(("A", "B"))`` on
all-MiniLM-L6-v2 with TransformerLens's names, ``to_tokens``/``to_token_types`` of a pair, the
pattern against transformers (tests/golden/minilm_encoder.json and minilm_encoder_attn_*.npy, made
by tests/golden/make_encoder_golden.py) and against the CLI's ``capture --pair`` of the same pair."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import attnscope

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = ROOT / "tests" / "golden"
BIN = os.environ.get("ATTNSCOPE_BIN", str(ROOT / "target" / "release" / "attnscope"))


@pytest.fixture(scope="module")
def minilm():
    return attnscope.HookedModel.from_pretrained("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def cases():
    return json.loads((GOLDEN / "minilm_encoder.json").read_text())["cases"]


def test_pair_tokens_types_and_pattern_match_transformers(minilm, cases):
    assert minilm.is_encoder
    for name in ["pair", "literal_sep_pair", "literal_sep", "short"]:
        case = cases[name]
        inp = (case["text"], case["pair"]) if case["pair"] is not None else case["text"]
        toks = minilm.to_tokens(inp)
        assert toks.shape == (1, len(case["token_ids"])), name
        assert [int(t) for t in np.asarray(toks)[0]] == case["token_ids"], name
        assert [int(t) for t in np.asarray(minilm.to_token_types(inp))[0]] == case["token_types"], name
        assert minilm.to_str_tokens(inp) == case["pieces"], name
        logits, cache = minilm.run_with_cache(inp, names_filter="hook_pattern")
        assert logits is None, "an encoder has no output head"
        want = np.load(GOLDEN / f"minilm_encoder_attn_{name}.npy")
        for i, layer in enumerate(case["attn_layers"]):
            got = np.asarray(cache[f"blocks.{layer}.attn.hook_pattern"])
            assert got.shape == (1,) + want[i].shape, name
            assert np.abs(got[0] - want[i]).max() < 1e-4, (name, layer, np.abs(got[0] - want[i]).max())
            # TransformerLens's short names reach the same array
            assert np.array_equal(np.asarray(cache["pattern", layer]), got)
        # bidirectional: a query puts weight on keys after it
        p = np.asarray(cache["blocks.5.attn.hook_pattern"])[0]
        assert np.triu(p, 1).sum() > 0.1 * p.shape[0]


def test_pair_pattern_equals_the_cli_capture(minilm, cases, tmp_path):
    case = cases["pair"]
    out = tmp_path / "pair.npz"
    r = subprocess.run([BIN, "capture", "-m", "all-minilm-l6-v2", "--text", case["text"], "--pair", case["pair"],
                        "--hooks", "pattern", "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    cli = np.load(out)
    _, cache = minilm.run_with_cache((case["text"], case["pair"]), names_filter="hook_pattern")
    for layer in range(minilm.cfg.n_layers):
        name = f"blocks.{layer}.attn.hook_pattern"
        np.testing.assert_array_equal(np.asarray(cache[name])[0], cli[name])
    np.testing.assert_array_equal(cli["token_ids"].astype(np.int64), np.asarray(minilm.to_tokens((case["text"], case["pair"])))[0])


def test_pairs_are_refused_where_they_would_run_as_one_text(minilm):
    with pytest.raises(ValueError, match="pair"):
        minilm(("How old are you?", "I am six."), return_type=None)
    with pytest.raises(Exception, match="empty|text"):
        minilm.to_tokens(("How old are you?", ""))
    # a list of two texts stays a batch of two
    assert np.asarray(minilm.to_tokens(["a cat", "the dog sat"])).shape[0] == 2
