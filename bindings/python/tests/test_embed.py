"""HookedModel.embed on all-MiniLM-L6-v2 against sentence-transformers' encode
(tests/golden/minilm_st_embeddings.json, made by tests/golden/st_embeddings.py)."""

import json
from pathlib import Path

import numpy as np
import pytest

import attnscope
from cells import assert_cells

GOLDEN = Path(__file__).resolve().parents[3] / "tests" / "golden"


@pytest.fixture(scope="module")
def golden():
    return json.loads((GOLDEN / "minilm_st_embeddings.json").read_text())


def check(got, want, what="embeddings"):
    want = np.asarray(want, dtype=np.float32)
    assert_cells(f"{what} [text, dim] vs sentence-transformers", got, want, atol=5e-6)
    cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() >= 0.99999, cos


def test_embed_matches_sentence_transformers(minilm, golden):
    got = minilm.embed(golden["texts"])
    assert got.dtype == np.float32
    check(got, golden["normalized"])
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    check(minilm.embed(golden["texts"], normalize=False), golden["mean_pooled"])
    one = minilm.embed(golden["texts"][0])
    assert one.shape == (1, 384)
    check(one, golden["normalized"][:1])
    # model.embed is still TransformerLens's embedding part
    assert np.asarray(minilm.embed.W_E).shape[1] == 384
    check(minilm.embed_sentences(golden["texts"]), golden["normalized"])


def test_embed_a_pair(minilm, golden):
    got = minilm.embed(tuple(golden["pair"]))
    check(got, [golden["pair_normalized"]])
    mixed = minilm.embed([golden["texts"][0], tuple(golden["pair"])])
    check(mixed, [golden["normalized"][0], golden["pair_normalized"]])


def test_a_literal_sep_is_type_0_as_transformers_has_it(minilm):
    # tests/golden/minilm_encoder.json: transformers' mean-pooled last hidden state (BertModel, eager)
    case = json.loads((GOLDEN / "minilm_encoder.json").read_text())["cases"]["literal_sep"]
    got = minilm.embed(case["text"], normalize=False)
    assert_cells("a text holding [SEP]: mean pooled [dim] vs transformers", got[0], case["mean_pooled"], atol=5e-6)


def test_embed_refuses_bad_input(minilm):
    with pytest.raises(TypeError):
        minilm.embed([3])
    with pytest.raises(ValueError):
        minilm.embed([])
    with pytest.raises(ValueError):
        minilm.embed("a", normalize="yes")
    with pytest.raises(Exception, match="max_seq_length"):
        minilm.embed("word " * 300)
