"""#59: attnscope.patching against real TransformerLens's ``transformer_lens.patching`` on the same
weights: ``generic_activation_patch`` (resumed, and with ``resume=False``) with each of TL's patch
setters (resid_pre and mlp_out by position, z, q, k, v per head, the pattern per head and per
query row), a few indices each (``index_df``: TL's flat form), on SmolLM2 with an IOI pair. TL 4's ``TransformerBridge`` in
compatibility mode on the model transformers builds from the GGUF (float32, eager), attnscope's
``from_pretrained`` (both process the weights as TL does by default).

Runs where ``transformer_lens``, ``torch`` and ``pandas`` import (TL 4: the bridge); skipped with
the reason otherwise (CI does not install TL 4 yet)."""

import os

import numpy as np
import pytest

import attnscope
import attnscope.patching as ours

try:
    import pandas as pd
    import torch
    import transformer_lens.patching as theirs
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"real TransformerLens 4 is not installed ({e}): the patching comparison with it did NOT run",
                allow_module_level=True)

PROMPTS = ["When John and Mary went out, John gave it to", "When John and Mary went out, Mary gave it to"]
# measured 2.34e-5 (resid_pre; 9.1e-6 to 1.6e-5 the others) of metric values up to 2.7 (TL 4.3,
# transformers 5.25, torch 2.15; 1.1e-5 to 1.8e-5 in a second draw of indices)
BOUND = 5e-5
SETTERS = [("resid_pre", "layer_pos_patch_setter", ("layer", "pos")),
           ("mlp_out", "layer_pos_patch_setter", ("layer", "pos")),
           ("z", "layer_head_vector_patch_setter", ("layer", "head")),
           ("q", "layer_head_vector_patch_setter", ("layer", "head")),
           ("k", "layer_head_vector_patch_setter", ("layer", "kv_head")),
           ("v", "layer_pos_head_vector_patch_setter", ("layer", "pos", "kv_head")),
           ("pattern", "layer_head_pattern_patch_setter", ("layer", "head")),
           ("pattern", "layer_head_pos_pattern_patch_setter", ("layer", "head", "pos"))]


@pytest.fixture(scope="module")
def both():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = os.path.join(os.environ.get("ATTNSCOPE_CACHE", os.path.expanduser("~/.cache/attnscope")), "models")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file="smollm2-135m.gguf")
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file="smollm2-135m.gguf", attn_implementation="eager",
                                              dtype=torch.float32).eval()
    tl = TransformerBridge.boot_transformers("local", hf_model=hf, tokenizer=tok, device="cpu")
    tl.enable_compatibility_mode(disable_warnings=True)
    m = attnscope.HookedModel.from_pretrained("smollm2-135m")
    clean = torch.as_tensor(np.asarray(m.to_tokens(PROMPTS)))
    ids = [[m.to_single_token(" Mary"), m.to_single_token(" John")], [m.to_single_token(" John"), m.to_single_token(" Mary")]]
    return tl, m, clean, clean[[1, 0]], torch.tensor(ids)


@pytest.mark.parametrize("act,setter,axes", SETTERS, ids=[f"{a}-{s.split('_patch')[0]}" for a, s, _ in SETTERS])
def test_patching_matches_transformer_lens(both, act, setter, axes):
    tl, m, clean, corrupt, answers = both

    def logit_diff(logits):
        last = torch.as_tensor(logits)[:, -1]
        return (last.gather(1, answers[:, :1]) - last.gather(1, answers[:, 1:])).mean()
    sizes = {"layer": m.cfg.n_layers, "pos": clean.shape[1], "head": m.cfg.n_heads, "kv_head": m.cfg.n_key_value_heads}
    rng = np.random.default_rng(len(act) + len(setter))
    rows = sorted({tuple(int(rng.integers(sizes[a])) for a in axes) for _ in range(5)} | {tuple(sizes[a] - 1 for a in axes)})
    df = pd.DataFrame(rows)
    with torch.no_grad():
        want = theirs.generic_activation_patch(tl, corrupt, tl.run_with_cache(clean)[1], logit_diff,
                                               getattr(theirs, setter), act, index_df=df).numpy()
    got = np.asarray(ours.generic_activation_patch(m, corrupt, m.run_with_cache(clean)[1], logit_diff,
                                                   getattr(ours, setter), act, index_df=df))
    # resume=False: one run_with_hooks per index, as TL runs them (the default resumes each patched
    # run at the patched layer and position: the same numbers, test_patching.py)
    full = np.asarray(ours.generic_activation_patch(m, corrupt, m.run_with_cache(clean)[1], logit_diff,
                                                    getattr(ours, setter), act, index_df=df, resume=False))
    err = float(np.abs(got - want).max())
    err_full = float(np.abs(full - want).max())
    print(f"{act} {setter}: {len(rows)} indices, max |diff| {err:.2e} resumed, {err_full:.2e} full forwards "
          f"(values up to {np.abs(want).max():.2f})")
    assert got.shape == want.shape and err < BOUND and err_full < BOUND, (got, full, want)
