"""#59: attnscope.patching (TransformerLens's ``transformer_lens.patching``) and the bridge's
``tl_named_parameters`` / ``set_use_attn_result``, on the tiny random Llama of tests/golden/arch
(3 layers, 4 query heads sharing 2 KV heads: GQA, so k and v sweep 2 heads and the ``*_every``
helpers pad them, as TL does).

Numpy-only here: each sweep's shape, index order and values against the same patch done by hand
one index at a time, and the exact skip of patches that change nothing (``skip_noops``) against
running them. Against an independent computation: ``test_sweeps_against_torch_hooks`` patches the
Hugging Face model transformers builds from the same folder with torch forward hooks (where torch
and transformers import: skipped with the reason otherwise), and run_demos.py --tl compares the
demos' sweeps with real TL's."""

from pathlib import Path

import numpy as np
import pytest

import attnscope
import attnscope.patching as patching
from attnscope import utils

LLAMA = Path(__file__).resolve().parents[3] / "tests" / "golden" / "arch" / "llama3"
CLEAN, CORRUPT = "hello there you", "hello where you"
ANSWER, WRONG = 111, 117  # token ids ('o', 'u') on the byte-level tokenizer

pytestmark = pytest.mark.usefixtures("numpy_results")


@pytest.fixture(scope="module")
def tiny():
    attnscope.set_array_type("numpy")
    m = attnscope.HookedModel.from_pretrained_no_processing(str(LLAMA))
    clean, corrupt = m.to_tokens([CLEAN, CORRUPT])[:1], m.to_tokens([CORRUPT, CLEAN])[:1]
    _, cache = m.run_with_cache(clean)
    return m, clean, corrupt, cache


def metric(logits):
    return float(logits[0, -1, ANSWER] - logits[0, -1, WRONG])


def _by_hand(m, corrupt, cache, act, index, setter):
    name = utils.get_act_name(act, index[0])

    def hook(a, hook):
        return setter(a, list(index), cache[name])
    return metric(m.run_with_hooks(corrupt, fwd_hooks=[(name, hook)]))


SWEEPS = [  # function, activation, setter, its axes' sizes on the tiny model (pos = 15)
    (patching.get_act_patch_resid_pre, "resid_pre", patching.layer_pos_patch_setter, (3, 15)),
    (patching.get_act_patch_attn_out, "attn_out", patching.layer_pos_patch_setter, (3, 15)),
    (patching.get_act_patch_attn_head_out_all_pos, "z", patching.layer_head_vector_patch_setter, (3, 4)),
    (patching.get_act_patch_attn_head_k_all_pos, "k", patching.layer_head_vector_patch_setter, (3, 2)),
    (patching.get_act_patch_attn_head_v_by_pos, "v", patching.layer_pos_head_vector_patch_setter, (3, 15, 2)),
    (patching.get_act_patch_attn_head_pattern_all_pos, "pattern", patching.layer_head_pattern_patch_setter, (3, 4)),
    (patching.get_act_patch_attn_head_pattern_by_pos, "pattern", patching.layer_head_pos_pattern_patch_setter, (3, 4, 15)),
]


@pytest.mark.parametrize("fn,act,setter,shape", SWEEPS, ids=[s[1] + str(len(s[3])) for s in SWEEPS])
def test_each_sweep_is_the_patch_done_by_hand(tiny, fn, act, setter, shape):
    m, clean, corrupt, cache = tiny
    got = fn(m, corrupt, cache, metric)
    assert isinstance(got, np.ndarray) and got.shape == shape and got.dtype == np.float32
    rng = np.random.default_rng(0)
    picks = {tuple(int(rng.integers(s)) for s in shape) for _ in range(6)} | {tuple(s - 1 for s in shape)}
    for index in sorted(picks):
        want = _by_hand(m, corrupt, cache, act, index, setter)
        assert got[index] == np.float32(want), (index, got[index], want)
    # the clean run's value is reached where the patch carries every difference: the stream at
    # the first layer, at the position where the texts differ (the tokens after it agree)
    if act == "resid_pre":
        baseline = metric(m(corrupt))
        assert got[0, :6].tolist() == [np.float32(baseline)] * 6  # before the difference: nothing moves
        assert abs(got[0, 6] - metric(m(clean))) < 1e-4


def test_skipped_noops_are_the_runs_bit_for_bit(tiny):
    m, _, corrupt, cache = tiny
    for fn in (patching.get_act_patch_resid_pre, patching.get_act_patch_attn_head_v_by_pos,
               patching.get_act_patch_attn_head_pattern_by_pos):
        fast = fn(m, corrupt, cache, metric)
        slow = fn(m, corrupt, cache, metric, skip_noops=False)
        assert np.array_equal(fast, slow), fn


ALL_SWEEPS = [f for f, *_ in SWEEPS] + [
    patching.get_act_patch_resid_mid, patching.get_act_patch_mlp_out, patching.get_act_patch_attn_head_out_by_pos,
    patching.get_act_patch_attn_head_q_by_pos, patching.get_act_patch_attn_head_k_by_pos,
    patching.get_act_patch_attn_head_q_all_pos, patching.get_act_patch_attn_head_v_all_pos,
    patching.get_act_patch_attn_head_pattern_dest_src_pos]


def test_resumed_sweeps_are_the_full_forwards(tiny):
    """resume=True (each patched run from the patched layer and position on, many to a forward)
    against one run_with_hooks per index, on a batch of two texts with a metric that reads every
    position (the positions before the patched one come from the corrupted run)."""
    m, clean, corrupt, _ = tiny
    clean2, corrupt2 = m.to_tokens([CLEAN, CORRUPT]), m.to_tokens([CORRUPT, CLEAN])
    _, cache2 = m.run_with_cache(clean2)

    def every_position(logits):
        return float(np.asarray(logits)[:, :, [ANSWER, WRONG, 5]].astype(np.float64).sum())

    def last_position(logits):  # the demos' logit difference: the last position's logits only
        lg = np.asarray(logits)[:, -1].astype(np.float64)
        return float((lg[:, ANSWER] - lg[:, WRONG]).mean())

    assert not patching._last_position_only(every_position, np.ones((2, 3, 200), np.float32), float)
    assert patching._last_position_only(last_position, np.ones((2, 3, 200), np.float32), float)
    worst = 0.0
    for fn in ALL_SWEEPS:
        for met in (every_position, last_position):
            fast = fn(m, corrupt2, cache2, met)
            slow = fn(m, corrupt2, cache2, met, resume=False)
            assert fast.shape == slow.shape and np.isfinite(fast).all(), fn
            err = float(np.abs(fast - slow).max() / np.abs(slow).max())
            worst = max(worst, err)
            assert err <= 1e-6, (fn, met, err)
    print(f"resumed sweeps against full forwards: worst {worst:.2e} of the largest (bound 1e-6)")


def test_every_helpers_stack_and_pad_as_tl(tiny):
    m, _, corrupt, cache = tiny
    every = patching.get_act_patch_attn_head_all_pos_every(m, corrupt, cache, metric)
    assert every.shape == (5, 3, 4)
    parts = [patching.get_act_patch_attn_head_out_all_pos, patching.get_act_patch_attn_head_q_all_pos,
             patching.get_act_patch_attn_head_k_all_pos, patching.get_act_patch_attn_head_v_all_pos,
             patching.get_act_patch_attn_head_pattern_all_pos]
    for i, f in enumerate(parts):
        one = f(m, corrupt, cache, metric)
        assert np.array_equal(every[i, :, :one.shape[1]], one), i
        assert not every[i, :, one.shape[1]:].any()  # k, v: zero-padded from 2 KV heads to 4
    by_pos = patching.get_act_patch_attn_head_by_pos_every(m, corrupt, cache, metric)
    assert by_pos.shape == (5, 3, 15, 4)
    pattern = patching.get_act_patch_attn_head_pattern_by_pos(m, corrupt, cache, metric)
    assert np.array_equal(by_pos[4], np.swapaxes(pattern, 1, 2))  # [layer, head, pos] -> [layer, pos, head]
    block = patching.get_act_patch_block_every(m, corrupt, cache, metric)
    assert block.shape == (3, 3, 15)
    assert np.array_equal(block[2], patching.get_act_patch_mlp_out(m, corrupt, cache, metric))


def test_refusals_name_what_is_missing(tiny):
    m, _, corrupt, cache = tiny
    with pytest.raises(NotImplementedError, match="baseline"):
        patching.get_act_patch_resid_pre(m, corrupt, cache, metric, baseline=True)
    with pytest.raises(NotImplementedError, match="reduce='none'"):
        patching.get_act_patch_resid_pre(m, corrupt, cache, metric, reduce="none")
    with pytest.raises(ValueError, match="scalar"):
        patching.get_act_patch_resid_pre(m, corrupt, cache, lambda lg: lg[0, -1, :3])


def test_tl_named_parameters_and_flags(tiny):
    m = tiny[0]
    params = dict(m.tl_named_parameters())
    assert list(params)[:3] == ["embed.W_E", "blocks.0.attn.W_Q", "blocks.0.attn.W_K"]
    assert list(params)[-3:] == ["ln_final.w", "unembed.W_U", "unembed.b_U"]
    assert len(params) == 1 + 3 * 15 + 3  # TL 4's bridge lists 15 per Llama block
    assert params["blocks.2.attn.W_K"].shape == (4, 64, 16)  # repeated per query head, as TL's bridge
    assert np.array_equal(params["blocks.1.mlp.W_gate"], m.W_gate[1])
    assert np.array_equal(params["blocks.2.ln2.w"], m.blocks[2].ln2.w)
    assert m.tl_parameters().keys() == params.keys()
    m.set_use_attn_result(True)
    assert m.cfg.use_attn_result is True
    m.set_use_attn_result(False)
    with pytest.raises(NotImplementedError, match="hook_q_input"):
        m.set_use_split_qkv_input(True)


def test_refactor_is_refused_as_tl_refuses_it_on_rotary_models():
    with pytest.raises(NotImplementedError, match="rotary"):
        attnscope.HookedModel.from_pretrained(str(LLAMA), refactor_factored_attn_matrices=True)


def test_boot_transformers_puts_bos_first_as_tl_4():
    """TL 4's bridge prepends BOS by default even where the tokenizer adds none (TL's
    cfg.default_prepend_bos = True); HookedModel.from_pretrained follows the tokenizer."""
    booted = attnscope.TransformerBridge.boot_transformers(str(LLAMA))
    own = attnscope.HookedModel.from_pretrained(str(LLAMA))
    assert booted.cfg.default_prepend_bos and not own.cfg.default_prepend_bos
    ids = own.to_tokens("hi")[0].tolist()
    assert booted.to_tokens("hi")[0].tolist() == [own.tokenizer.bos_token_id] + ids
    no_bos = attnscope.TransformerBridge.boot_transformers(str(LLAMA), default_prepend_bos=False)
    assert no_bos.to_tokens("hi")[0].tolist() == ids


def test_get_corner_and_remove_batch_dim_as_tl():
    a = np.arange(4 * 5 * 6).reshape(4, 5, 6)
    np.testing.assert_array_equal(utils.get_corner(a), a[:3, :3, :3])
    np.testing.assert_array_equal(utils.get_corner(a, n=2), a[:2, :2, :2])
    assert utils.remove_batch_dim(a[:1]).shape == (5, 6) and utils.remove_batch_dim(a).shape == (4, 5, 6)
