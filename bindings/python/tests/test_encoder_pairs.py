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
from cells import assert_cells

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = ROOT / "tests" / "golden"
BIN = os.environ.get("ATTNSCOPE_BIN", str(ROOT / "target" / "release" / "attnscope"))


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
            assert got.shape[0] == 1, name
            # README.md: every weight within 1.6e-6 of transformers (tests/encoder.rs asserts 5e-6)
            assert_cells(f"{name} layer {layer} [head, query, key] vs transformers", got[0], want[i], atol=5e-6)
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
    with pytest.raises(ValueError, match="no loss"):
        minilm(("How old are you?", "I am six."), return_type="loss")
    with pytest.raises(Exception, match="empty|text"):
        minilm.to_tokens(("How old are you?", ""))
    # a list of two texts stays a batch of two
    assert np.asarray(minilm.to_tokens(["a cat", "the dog sat"])).shape[0] == 2


def test_inspect_of_a_pair_gives_transformers_shares(minilm, cases):
    """``model.inspect(("A", "B"))`` is a typed call (no CLI): the [CLS]/[SEP]/punctuation shares per
    layer equal transformers', and the token types the tokenizer's."""
    case = cases["pair"]
    r = minilm.inspect((case["text"], case["pair"]), heads="all")
    assert r["kind"].startswith("encoder") and r["query"] == 0
    assert r["token_types"] == case["token_types"]
    for ours, theirs in (("cls", "cls_share"), ("sep", "sep_share"), ("punct", "punct_share")):
        assert_cells(f"pair: {ours} share [layer] vs transformers", r["special_shares"][ours], case[theirs], atol=2e-6)
    assert len(r["heads"]) == 12 and "forward_s" in r["timings"]
    with pytest.raises(ValueError, match="pair"):
        minilm.inspect(("only one",))


PAIR = ("How old are you?", "I am six years old.")


def test_heads_of_a_text_and_a_pair_match_transformers(minilm):
    """``model.heads`` on an encoder: previous/next-token, [CLS], [SEP] and broad scores per layer and
    head, against the same formulas on transformers' attentions (tests/golden/encoder_heads.json,
    made by make_encoder_heads_golden.py)."""
    g = json.loads((GOLDEN / "encoder_heads.json").read_text())["cases"]
    for name, inp in (("minilm_pair", PAIR), ("minilm_lesson", g["minilm_lesson"]["text"])):
        r = minilm.heads(inp)
        assert r["tokens"] == g[name]["token_ids"], name
        assert sorted(r["roles"]) == sorted(g[name]["roles"]) == ["broad", "cls", "next_token", "previous_token", "sep"]
        for role, want in g[name]["roles"].items():
            # README.md: within 1e-6 of transformers (tests/encoder_heads.rs asserts 2e-6)
            assert_cells(f"{name} {role} [layer, head] vs transformers", r["roles"][role], want, atol=2e-6)
            assert_cells(f"{name} {role}: a uniform head's score", r["uniform"][role], g[name]["uniform"][role], atol=1e-12)
    with pytest.raises(ValueError, match="pair"):
        minilm.heads(("one",))
    with pytest.raises(ValueError, match="induction"):
        minilm.heads(random_repeat=5)


def test_run_with_hooks_and_call_take_a_pair(minilm, cases):
    """A pair through ``run_with_hooks`` and ``model(...)``: what a hook reads equals transformers'
    pattern, the last block's residual is transformers' last hidden state (its mean over positions
    the golden mean pooling), and an editing hook gives what ``run_with_cache`` gives under it."""
    case = cases["pair"]
    seen = {}

    def keep(act, hook):
        seen[hook.name] = np.array(act)

    out = minilm.run_with_hooks(PAIR, fwd_hooks=[("blocks.5.attn.hook_pattern", keep)], return_type=None)
    assert out is None
    want = np.load(GOLDEN / "minilm_encoder_attn_pair.npy")[5]
    got = seen["blocks.5.attn.hook_pattern"]
    assert got.shape[0] == 1
    assert_cells("pair run_with_hooks: layer 5 [head, query, key] vs transformers", got[0], want, atol=5e-6)
    n, d = len(case["token_ids"]), minilm.cfg.d_model
    last = np.asarray(minilm(PAIR, stop_at_layer=minilm.cfg.n_layers))
    assert last.shape == (1, n, d)
    assert_cells("pair: mean of the last residual [dim] vs transformers", last[0].mean(0), case["mean_pooled"], atol=5e-6)
    # the pair's token types reach the forward: as one text (types all 0) the states differ
    ids = np.asarray(minilm.to_tokens(PAIR))
    as_one = np.asarray(minilm(ids, stop_at_layer=minilm.cfg.n_layers))
    assert np.abs(as_one - last).max() > 1e-3

    def zero_head(act, hook):
        act[:, 3] = 0.0

    edit = [("blocks.2.attn.hook_pattern", zero_head)]
    edited = np.asarray(minilm.run_with_hooks(PAIR, fwd_hooks=edit, stop_at_layer=minilm.cfg.n_layers))
    with minilm.hooks(fwd_hooks=edit):
        _, cache = minilm.run_with_cache(PAIR, names_filter="blocks.5.hook_resid_post")
    assert np.array_equal(edited, np.asarray(cache["blocks.5.hook_resid_post"]))
    assert np.abs(edited - last).max() > 1e-3
    assert minilm(PAIR) is None, "an encoder has no output head"


def test_viz_shows_a_pair_with_the_selector(minilm, tmp_path):
    """``viz.attention_heads(..., sentence_b_start=, pair=)``: the view page's A→B / B→A / A→A / B→B
    selector on a pair from ``run_with_cache``, as ``attnscope view --pair`` has it."""
    from attnscope import viz

    _, cache = minilm.run_with_cache(PAIR, names_filter="hook_pattern")
    pattern = np.asarray(cache.stack_activation("pattern"))[:, 0]
    tokens = minilm.to_str_tokens(PAIR)
    b0 = list(np.asarray(minilm.to_token_types(PAIR))[0]).index(1)
    assert tokens[b0 - 1] == "[SEP]"
    page = viz.attention_heads(pattern, tokens, sentence_b_start=b0, pair="a->b").html
    assert f'"sentence_b_start":{b0}' in page and '"pair":"AB"' in page
    plain = viz.attention_heads(pattern, tokens).html
    assert '"sentence_b_start":null' in plain and '"pair":' not in plain
    for kw, match in ((dict(pair="a->b"), "sentence_b_start"), (dict(sentence_b_start=b0, pair="x"), "not a selection"),
                      (dict(sentence_b_start=len(tokens)), "out of range"), (dict(sentence_b_start=-1), "negative")):
        with pytest.raises(ValueError, match=match):
            viz.attention_heads(pattern, tokens, **kw)
    causal = np.tril(np.ones((2, 4, 4), dtype=np.float32))
    causal /= causal.sum(-1, keepdims=True)
    with pytest.raises(ValueError, match="decoder"):
        viz.attention_heads(causal, ["a", "b", "c", "d"], sentence_b_start=2)
