"""The public Python surface stays what was recorded (api_surface.json, written by api_surface.py
before #57 split the binding by domain): every public name of the package and of its modules,
each public class's attributes with their signatures, the native module's. A name lost or a
signature changed by accident fails here, naming it; a deliberate change rewrites the record
(``python bindings/python/tests/api_surface.py --write``) and shows in its diff. No model is
loaded: this checks names, not numbers."""

import json
import pickle

import numpy as np

import attnscope
from api_surface import RECORD, surface


def _differences(want, got, path=""):
    """Every place where ``got`` differs from ``want``: (path, recorded, now)."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for k in sorted(set(want) | set(got)):
            out += _differences(want.get(k), got.get(k), f"{path}/{k}")
        return out
    return [] if want == got else [(path, want, got)]


def test_the_public_surface_is_the_one_recorded():
    want = json.loads(RECORD.read_text())
    got = json.loads(json.dumps(surface()))
    diffs = _differences(want, got)
    shown = "\n".join(f"{p}: recorded {w!r}, now {g!r}" for p, w, g in diffs[:40])
    assert not diffs, f"{len(diffs)} differences from {RECORD.name}:\n{shown}"
    # the record is not empty: the package's main names are in it
    for name in ("HookedModel", "HookedTransformer", "ActivationCache", "utils", "viz", "set_array_type"):
        assert name in want["attnscope"]["names"], name
    assert "run_with_cache" in want["attnscope"]["classes"]["HookedModel"]


def test_the_import_paths_users_write_still_work():
    from attnscope import (ActivationCache, Config, FactoredMatrix, HookedModel, HookedTransformer, HookPoint,  # noqa: F401
                           TransformerBridge, corpus, corpus_merge, utilities, utils, viz)
    from attnscope.utils import get_act_name
    from attnscope.utilities import get_act_name as get_act_name_too

    assert HookedTransformer is HookedModel
    assert get_act_name is get_act_name_too is attnscope.utils.get_act_name
    assert get_act_name("pattern", 3) == "blocks.3.attn.hook_pattern"
    # circuitsvis's module path
    assert attnscope.viz.attention.attention_heads is attnscope.viz.attention_heads


def test_caches_and_configs_pickle_and_keep_their_class():
    cache = attnscope.ActivationCache({"blocks.0.attn.hook_pattern": np.eye(3, dtype=np.float32)[None, None]}, n_layers=1)
    back = pickle.loads(pickle.dumps(cache))
    assert isinstance(back, attnscope.ActivationCache)
    assert np.array_equal(np.asarray(back["pattern", 0]), np.asarray(cache["pattern", 0]))
    assert repr(back) == repr(cache)
    cfg = attnscope.Config(model_name="m", architecture="llama", n_layers=1, n_heads=2, n_key_value_heads=1, d_head=4,
                           d_model=8, d_mlp=16, n_ctx=32, d_vocab=10, precision="exact", default_prepend_bos=False)
    assert pickle.loads(pickle.dumps(cfg)) == cfg
