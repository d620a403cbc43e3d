"""run_with_cache(incl_bwd=True): the gradients at the hook points against torch autograd through
transformers' eager f32 forward (tests/golden/<m>_hook_grads.npz, made by
tests/golden/make_hookgrad_golden.py), for the three scalars: log p(top token), TransformerLens's
loss and a logit difference, on SmolLM2 (a llama GGUF with interleaved q/k rows) and Qwen2.5 (q/k/v
biases; fewer hooks). Each within 2e-4 of its largest value (measured: at most 4.4e-5)."""

from pathlib import Path

import numpy as np
import pytest

import attnscope
from cells import assert_cells

ROOT = Path(__file__).resolve().parents[3]
REFS = {m: np.load(ROOT / "tests" / "golden" / f"{m}_hook_grads.npz") for m in ("smol", "qwen")}
REF = REFS["smol"]
CLEAN = "After Alice and Bob walked to the park, Bob handed a ball to"
ANSWER, WRONG = 8590, 8363
# " Alice", " Bob" for each model
PAIRS = {"smol": (8590, 8363), "qwen": (29405, 14261)}


pytestmark = pytest.mark.usefixtures("numpy_results")


def check(cache, prefix, ref=REF):
    keys = [k for k in ref.files if k.startswith(prefix + "/")]
    assert keys
    for key in keys:
        name = key.split("/", 1)[1]
        want = ref[key]
        got = np.asarray(cache[name])
        assert got.shape == (1,) + want.shape, (name, got.shape, want.shape)
        assert float(np.abs(want).max()) > 0, name
        assert_cells(f"{prefix} {name} vs torch", got[0], want, rel_max=2e-4)


def names_of(prefix, ref=REF):
    return [k.split("/", 1)[1][: -len("_grad")] for k in ref.files if k.startswith(prefix + "/")]


@pytest.mark.parametrize("which", ["smol", "qwen"])
def test_every_scalar_matches_torch(which, request):
    m, ref = request.getfixturevalue(which), REFS[which]
    assert m.to_tokens(CLEAN, prepend_bos=False)[0].tolist() == ref["tokens"].tolist()
    answer, wrong = PAIRS[which]
    for i, (prefix, kw) in enumerate((("lp", {}), ("loss", {"metric": "loss"}),
                                      ("ld", {"metric": "logit_diff", "target": answer, "wrong": wrong}))):
        _, cache = m.run_with_cache(CLEAN, names_filter=names_of(prefix, ref), incl_bwd=True, prepend_bos=False, **kw)
        assert abs(cache.bwd_value - ref["values"][i]) < 1e-4, (which, prefix)
        check(cache, prefix, ref)


def test_tokens_match_the_reference(smol):
    assert smol.to_tokens(CLEAN, prepend_bos=False)[0].tolist() == REF["tokens"].tolist()


def test_target_logprob_gradients_match_torch(smol):
    names = names_of("lp")
    _, cache = smol.run_with_cache(CLEAN, names_filter=names, incl_bwd=True, prepend_bos=False)
    assert abs(cache.bwd_value - REF["values"][0]) < 1e-4
    assert cache.bwd_target == ANSWER
    check(cache, "lp")
    # the forward's values are cached too, and only the selected hooks' gradients
    assert cache["blocks.3.attn.hook_pattern"].shape == cache["blocks.3.attn.hook_pattern_grad"].shape
    assert "blocks.4.hook_resid_pre_grad" not in cache
    assert "blocks.3.hook_resid_pre_grad" not in cache  # layer 3's resid_pre was not asked for


def test_loss_gradients_match_torch(smol):
    names = names_of("loss")
    _, cache = smol.run_with_cache(CLEAN, names_filter=names, incl_bwd=True, metric="loss", prepend_bos=False)
    assert abs(cache.bwd_value - REF["values"][1]) < 1e-4
    check(cache, "loss")


def test_logit_diff_gradients_match_torch(smol):
    names = names_of("ld")
    _, cache = smol.run_with_cache(CLEAN, names_filter=names, incl_bwd=True, metric="logit_diff",
                                   target=" Alice", wrong=WRONG, prepend_bos=False)
    assert abs(cache.bwd_value - REF["values"][2]) < 1e-4
    check(cache, "ld")


def test_names_filter_by_suffix_and_remove_batch_dim(smol):
    _, cache = smol.run_with_cache(CLEAN, names_filter="hook_z", incl_bwd=True, remove_batch_dim=True,
                                   prepend_bos=False)
    n = len(REF["tokens"])
    for l in range(smol.cfg.n_layers):
        assert cache[f"blocks.{l}.attn.hook_z_grad"].shape == (n, smol.cfg.n_heads, smol.cfg.d_head)
    want = REF["lp/blocks.3.attn.hook_z_grad"]
    assert_cells("hook_z_grad", cache["blocks.3.attn.hook_z_grad"], want, rel_max=2e-4)


def test_bad_requests_are_clear_errors(smol):
    with pytest.raises(ValueError, match="logit_diff"):
        smol.run_with_cache(CLEAN, names_filter="hook_z", incl_bwd=True, metric="logit_diff", target=ANSWER)
    with pytest.raises(ValueError, match="unknown metric"):
        smol.run_with_cache(CLEAN, names_filter="hook_z", incl_bwd=True, metric="accuracy")
    with pytest.raises(ValueError, match="one text"):
        smol.run_with_cache([CLEAN, CLEAN], names_filter="hook_z", incl_bwd=True)
    with pytest.raises(ValueError, match="stop_at_layer"):
        smol.run_with_cache(CLEAN, names_filter="hook_z", incl_bwd=True, stop_at_layer=3)
    with pytest.raises(ValueError, match="incl_bwd"):
        smol.run_with_cache(CLEAN, names_filter="hook_z", metric="loss")
    with pytest.raises(ValueError):
        smol.run_with_cache(CLEAN, names_filter="hook_z", incl_bwd=True, target=10**9)
    with pytest.raises(ValueError, match="2 or more"):
        smol.run_with_cache("Hi", names_filter="hook_z", incl_bwd=True, metric="loss", prepend_bos=False)


def test_a_given_gradient_of_the_logits_seeds_the_backward(smol):
    """#59: metric="logits" takes the gradient of the caller's scalar with respect to the logits
    (what a torch metric's backward hands over): log p(top token)'s, one-hot minus softmax at the
    last position, gives that metric's gradients (against torch autograd, as above)."""
    names = names_of("lp")
    logits, _ = smol.run_with_cache(CLEAN, names_filter="hook_z", prepend_bos=False)
    last = logits[0, -1].astype(np.float64)
    p = np.exp(last - last.max())
    d = np.zeros(logits.shape[1:], np.float32)
    d[-1] = -p / p.sum()
    d[-1, int(np.argmax(last))] += 1.0
    ids = REF["tokens"].tolist()
    _, value, grads = smol._m.hook_gradients(ids, names, "logits", None, None, d.reshape(-1))
    assert value == 0.0  # the caller's scalar: not known to the engine
    cache = {name: data.reshape([1] + list(shape)) for name, shape, data in grads}
    check(cache, "lp")
    with pytest.raises(ValueError, match="positions"):
        smol._m.hook_gradients(ids, names, "logits", None, None, d.reshape(-1)[:-1])
    with pytest.raises(ValueError, match="dlogits"):
        smol._m.hook_gradients(ids, names, "logits", None, None, None)


def test_norm_and_mlp_hook_gradients_match_torch(smol):
    """#59: the norms' and the MLP's hook points have gradients too (TL's attribution demo reads
    ``grad_cache["scale", l, "ln1"]``): SmolLM2's layer 3 against torch autograd with the norms
    and the MLP written as TL writes them (tests/golden/inner_hook_grads/, made by
    make_inner_hookgrad_golden.py; the [n, width] ones at three rows), in TL's shapes."""
    import json
    folder = ROOT / "tests" / "golden" / "inner_hook_grads"
    meta = json.loads((folder / "values.json").read_text())["smol"]
    rows = meta["rows"]
    files = sorted(folder.glob("smol__*_grad.npy"))
    names = [f.name.split("__", 1)[1][: -len("_grad.npy")] for f in files]
    assert len(names) == 7 and "blocks.3.ln1.hook_scale" in names and "blocks.3.mlp.hook_pre_linear" in names
    _, cache = smol.run_with_cache(CLEAN, names_filter=names, incl_bwd=True, prepend_bos=False)
    assert abs(cache.bwd_value - meta["logprob"]) < 1e-4
    n = len(meta["token_ids"])
    for name, f in zip(names, files):
        got = np.asarray(cache[name + "_grad"])[0]
        want = np.load(f)
        if name.endswith("hook_scale"):
            assert got.shape == (n, 1), name
        else:
            got = got[rows]
        assert_cells(f"{name}_grad vs torch", got, want, rel_max=1e-4)
