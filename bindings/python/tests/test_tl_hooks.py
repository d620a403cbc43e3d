"""#59: TransformerLens's HookPoint objects (``model.blocks[L].attn.hook_z.add_hook``, ``hook_dict``,
``mod_dict``, permanent and prepended hooks, ``reset_hooks``, ``hooks()``), ``model.tokenizer``
against transformers' tokenizer on the same GGUFs (tests/golden/tokenizer_hf.json, made by
tests/golden/make_tokenizer_golden.py), ``utils.lm_cross_entropy_loss``, the ``utilities`` alias,
CircuitsVis's ``attention_patterns``, and the token arguments' checks. The torch half (backward
hooks against autograd, torch tensors into every public call, bad tensors) runs
tests/torch_calls.py in the torch environment (see test_examples.py's header)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import attnscope
from attnscope import utils

ROOT = Path(__file__).resolve().parents[3]
TOK = json.loads((ROOT / "tests" / "golden" / "tokenizer_hf.json").read_text(encoding="utf-8"))
TEXT = "After Alice and Bob walked to the park, Bob handed a ball to"

pytestmark = pytest.mark.usefixtures("numpy_results")


def test_every_hook_point_is_an_object_with_tl_names(smol):
    names = smol.hook_names()
    assert list(smol.hook_dict) == names
    for name, hp in smol.hook_dict.items():
        assert hp.name == name and smol.mod_dict[name] is hp
    assert smol.blocks[3].attn.hook_z is smol.hook_dict["blocks.3.attn.hook_z"]
    assert smol.blocks[3].hook_resid_pre.name == "blocks.3.hook_resid_pre"
    assert smol.blocks[2].ln1.hook_scale.name == "blocks.2.ln1.hook_scale"
    assert smol.blocks[1].mlp.hook_post.layer() == 1
    assert smol.hook_embed.name == "hook_embed" and smol.ln_final.hook_scale.name == "ln_final.hook_scale"
    assert smol.blocks[3].attn.W_Q.shape == (smol.cfg.n_heads, smol.cfg.d_model, smol.cfg.d_head)  # weights still there
    for part in ("blocks.0", "blocks.0.attn", "blocks.0.mlp", "blocks.0.ln1", "embed", "unembed", "ln_final"):
        assert part in smol.mod_dict, part
    with pytest.raises(ValueError, match="not inside a block"):
        smol.hook_embed.layer()


def test_hooks_added_on_hook_points_run_like_tl(smol):
    base = np.asarray(smol(TEXT))
    seen = []

    def record(act, hook):
        seen.append((hook.name, hook.layer(), tuple(act.shape)))

    def zero(act, hook):
        return np.zeros_like(act)

    z = smol.blocks[3].attn.hook_z
    try:
        z.add_hook(record)
        z.add_hook(zero, prepend=True)  # runs before record: record sees the zeros
        z.add_hook(lambda a, h: seen.append(float(np.abs(a).max())))
        assert len(z.fwd_hooks) == 3
        edited = np.asarray(smol(TEXT))
        assert seen[0][:2] == ("blocks.3.attn.hook_z", 3) and seen[1] == 0.0
        assert np.abs(edited - base).max() > 1e-2
        # the same edit by run_with_hooks
        want = np.asarray(smol.run_with_hooks(TEXT, fwd_hooks=[("blocks.3.attn.hook_z", zero)]))
        assert np.array_equal(want, edited)
        _, cache = smol.run_with_cache(TEXT, names_filter="blocks.3.attn.hook_z")
        assert not np.asarray(cache["z", 3]).any()  # run_with_cache runs them too, and caches the edit
        z.remove_hooks()
        assert z.fwd_hooks == [] and np.array_equal(np.asarray(smol(TEXT)), base)
        # permanent: reset_hooks keeps it, reset_hooks(including_permanent=True) removes it
        smol.hook_embed.add_perma_hook(record)
        smol.add_hook(lambda n: n.endswith("hook_resid_post"), record)
        smol.reset_hooks()
        assert len(smol.hook_embed.fwd_hooks) == 1 and smol.blocks[0].hook_resid_post.fwd_hooks == []
        smol.hook_embed.remove_hooks()
        assert len(smol.hook_embed.fwd_hooks) == 1
        smol.hook_embed.ctx["x"] = 1
        smol.reset_hooks(including_permanent=True)
        assert smol.hook_embed.fwd_hooks == [] and smol.hook_embed.ctx == {}
    finally:
        smol.reset_hooks(including_permanent=True)


def test_hooks_context_and_run_with_hooks_leave_the_model_as_it_was(smol):
    z = smol.blocks[2].attn.hook_z
    z.add_hook(lambda a, h: None, is_permanent=True)
    try:
        with smol.hooks(fwd_hooks=[(lambda n: n.endswith("hook_z"), lambda a, h: None)]):
            assert len(z.fwd_hooks) == 2 and len(smol.blocks[5].attn.hook_z.fwd_hooks) == 1
        assert len(z.fwd_hooks) == 1
        smol.run_with_hooks(TEXT, fwd_hooks=[("blocks.2.attn.hook_z", lambda a, h: None)], reset_hooks_end=False)
        assert len(z.fwd_hooks) == 2  # TL: reset_hooks_end=False keeps them
        smol.reset_hooks()
        assert len(z.fwd_hooks) == 1
    finally:
        smol.reset_hooks(including_permanent=True)
    with pytest.raises(ValueError, match="dir="):
        z.add_hook(lambda a, h: None, dir="sideways")


def test_a_backward_hook_where_the_engine_has_no_gradient_is_refused(smol):
    # every point in a block has a gradient now (#59: the norms' and the MLP's too); the final
    # norm's have none
    with pytest.raises(ValueError, match="ln_final.hook_scale: the engine's backward has no gradient"):
        smol.ln_final.hook_scale.add_hook(lambda g, h: None, dir="bwd")
    with pytest.raises(ValueError, match="ln_final.hook_normalized"):
        with smol.hooks(bwd_hooks=[("ln_final.hook_normalized", lambda g, h: None)]):
            pass
    assert smol.ln_final.hook_scale.bwd_hooks == []
    # without torch, a forward with a backward hook attached is refused before it runs
    smol.blocks[0].attn.hook_z.add_hook(lambda g, h: None, dir="bwd")
    try:
        with pytest.raises(RuntimeError, match="import torch"):
            smol(TEXT)
    finally:
        smol.reset_hooks()
    assert smol.blocks[0].attn.hook_z.bwd_hooks == []


@pytest.mark.parametrize("which", ["smol", "qwen"])
def test_tokenizer_equals_transformers(which, request):
    m, ref = request.getfixturevalue(which), TOK[which]
    t = m.tokenizer
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "padding_side", "vocab_size"):
        assert getattr(t, key) == ref[key], key
    assert len(t) == ref["len"]
    for text, r in ref["texts"].items():
        assert t.encode(text) == r["ids"], text
        assert t.encode(text, add_special_tokens=False) == r["ids_plain"], text
        assert t.decode(r["ids"]) == r["decode"], text
        assert t.convert_ids_to_tokens(r["ids"]) == r["tokens"], text
        assert t(text)["input_ids"] == r["ids"]
    texts = list(ref["texts"])[:3]
    b = t(texts, padding=True)
    assert b["input_ids"] == ref["batch_ids"] and b["attention_mask"] == ref["batch_mask"]
    assert t.batch_decode(ref["batch_ids"]) == ref["batch_decode"]
    a = t(texts, padding=True, return_tensors="np")
    assert a["input_ids"].dtype == np.int64 and a["input_ids"].tolist() == ref["batch_ids"]
    assert t.batch_decode(np.asarray(ref["batch_ids"])) == ref["batch_decode"]
    assert t.decode(np.asarray([ref["batch_ids"][0]])) == ref["batch_decode"][0]
    assert t.convert_ids_to_tokens(ref["texts"]["Hello world"]["ids"][0]) == ref["texts"]["Hello world"]["tokens"][0]
    with pytest.raises(ValueError, match="padding=True"):
        t(texts, return_tensors="np")
    with pytest.raises(ValueError, match="out of range"):
        t.decode([m.cfg.d_vocab])
    with pytest.raises(TypeError, match="integers"):
        t.decode(np.asarray([1.5]))
    with pytest.raises(ValueError, match="return_tensors"):
        t.encode("x", return_tensors="tf")


def test_lm_cross_entropy_loss_and_the_utilities_alias(smol):
    import attnscope.utilities as utilities
    from attnscope import utilities as u2

    assert utilities is utils and u2 is utils and attnscope.utilities is utils
    tokens = np.asarray(smol.to_tokens([TEXT, "A short one"]))
    logits = np.asarray(smol(tokens), dtype=np.float64)
    # float64 by hand: -log softmax(logits[:, i])[tokens[:, i + 1]]
    z = logits[:, :-1] - logits[:, :-1].max(-1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = -np.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0]
    got = utils.lm_cross_entropy_loss(logits.astype(np.float32), tokens, per_token=True)
    assert got.shape == want.shape and np.abs(np.asarray(got) - want).max() < 1e-5
    assert abs(utils.lm_cross_entropy_loss(logits, tokens) - want.mean()) < 1e-6
    mask = (tokens != smol.cfg.pad_token_id).astype(np.int64)
    keep = mask[:, :-1] * mask[:, 1:]
    assert abs(utils.lm_cross_entropy_loss(logits, tokens, mask) - (want * keep).sum() / keep.sum()) < 1e-6
    assert abs(smol(tokens, return_type="loss") - want.mean()) < 1e-5


def test_circuitsvis_attention_patterns(smol):
    _, cache = smol.run_with_cache(TEXT, names_filter="hook_pattern")
    toks = smol.to_str_tokens(TEXT)
    pat = np.asarray(cache["pattern", 2])[0]
    v = attnscope.viz.attention.attention_patterns(tokens=toks, attention=pat,
                                                   attention_head_names=[f"L2H{i}" for i in range(pat.shape[0])])
    assert "L2H0" in v.html and v.html == attnscope.viz.attention_patterns(toks, pat, [f"L2H{i}" for i in range(9)]).html
    assert attnscope.viz.attention_heads(pat, toks).html.startswith("<!DOCTYPE html>")
    names = [f"L2H{i}" for i in range(9)]
    assert attnscope.viz.attention.attention_heads(tokens=toks, attention=pat, attention_head_names=names).html == v.html
    one = attnscope.viz.attention.attention_pattern(tokens=toks, attention=pat[4])
    assert one.html == attnscope.viz.attention_heads(pat[4:5], toks).html
    with pytest.raises(ValueError, match="one head"):
        attnscope.viz.attention_pattern(toks, pat)
    with pytest.raises(NotImplementedError, match="positive_color"):
        attnscope.viz.attention_heads(pat, toks, positive_color="red")
    with pytest.raises(TypeError, match="colour"):
        attnscope.viz.attention_heads(pat, toks, colour="red")
    with pytest.raises(NotImplementedError, match="max_value"):
        attnscope.viz.attention_patterns(toks, pat, max_value=0.5)
    with pytest.raises(ValueError, match="3 names for 9 heads"):
        attnscope.viz.attention_patterns(toks, pat, ["a", "b", "c"])


def test_token_and_text_arguments(smol):
    ids = np.asarray(smol.to_tokens(TEXT))
    alice = smol.to_single_token(" Alice")
    r1 = smol.attribute(TEXT, method="gradient", target=alice)
    r2 = smol.attribute(ids, method="gradient", target=np.int64(alice))
    r3 = smol.attribute(TEXT, method="gradient", target=np.asarray([alice]))
    assert np.array_equal(r1["scores"], r2["scores"]) and np.array_equal(r1["scores"], r3["scores"])
    with pytest.raises(TypeError, match="token id"):
        smol.attribute(TEXT, method="gradient", target=np.asarray([1.0]))
    with pytest.raises(TypeError, match="token id"):
        smol.attribute(TEXT, method="gradient", target=True)
    a = smol.ablate(ids[0, :6], target=alice)
    assert a == smol.ablate(smol.to_string(ids[0, :6]), target=str(alice))
    enc = smol.tokenizer.encode
    bad = np.asarray([enc(" A", add_special_tokens=False) + enc("l", add_special_tokens=False) + enc("ice", add_special_tokens=False)])
    assert enc(smol.to_string(bad[0]), add_special_tokens=False) != bad[0].tolist()  # " Alice" re-encodes otherwise
    with pytest.raises(ValueError, match="do not come back from their text"):
        smol.ablate(bad)


def _torch_python():
    python = os.environ.get("ATTNSCOPE_TORCH_PYTHON") or str(ROOT / "target" / "torchenv" / "bin" / "python")
    return python


def test_torch_inputs_backward_hooks_and_bad_tensors(tmp_path):
    """tests/torch_calls.py in the torch environment (the package linked onto its path, as
    test_examples.py does): it asserts and prints its figures."""
    python = _torch_python()
    (tmp_path / "attnscope").symlink_to(Path(attnscope.__file__).parent, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    probe = subprocess.run([python, "-c", "import torch, attnscope"], capture_output=True, text=True, env=env) \
        if os.path.exists(python) else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"no Python with torch ({python}); .ci/run makes target/torchenv (see test_examples.py's header)")
    r = subprocess.run([python, str(Path(__file__).with_name("torch_calls.py"))], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=1800)
    print(r.stdout, file=sys.stderr)
    assert r.returncode == 0, f"torch_calls.py failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert "every public call took torch inputs" in r.stdout
