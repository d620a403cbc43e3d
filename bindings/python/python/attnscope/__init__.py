"""attnscope: see, compute and measure the attention inside real language models.

A TransformerLens-shaped API on a Rust engine: exact numbers (to 1e-4 of Hugging Face transformers),
GGUF and Hugging Face checkpoints, long inputs on a CPU, and no torch needed.

    import attnscope
    model = attnscope.HookedModel.from_pretrained("qwen2.5-coder-0.5b")
    logits, cache = model.run_with_cache("Hà Nội là thủ đô của Việt Nam.", names_filter="hook_pattern")
    cache["pattern", 0]        # numpy float32 [1, head, query, key]
    model.view("Hà Nội là thủ đô của Việt Nam.")   # the attention view, inline in a notebook

The package, one module per concern (this file only gathers their names):
:mod:`.hooked_model` (:class:`HookedModel`: loading, tokens, generation) with its mixins
:mod:`.running` (the forward with capture), :mod:`.hooks` (hook names, editing hooks),
:mod:`.weights` (TransformerLens's weights) and :mod:`.analyses` (the CLI's analyses, the corpus);
:mod:`.cache` (:class:`ActivationCache`), :mod:`.config` (:class:`Config`), :mod:`.arrays` (numpy
or torch results); :mod:`.viz`, :mod:`.utils`, :mod:`.patching`, :mod:`.processing`,
:mod:`.hook_points`, :mod:`.factored`, :mod:`.bridge`, :mod:`.distributed`; :mod:`._native`, the
Rust engine.
"""

from __future__ import annotations

import sys
from typing import Any

from . import _native
from . import viz
from . import utils
from . import processing
from . import hook_points
from . import inputs
from .hook_points import HookPoint
from .factored import FactoredMatrix
from . import distributed  # Ray is imported only when distributed.corpus runs
from .arrays import set_array_type, _wrap, _np, _token_array  # noqa: F401 (_wrap & co: the package's modules import them from here)
from .config import Config, config_fields  # noqa: F401
from .hooks import HOOKS, GLOBAL_HOOKS, NamesFilter, TextOrTokens, HookFn, HookName, _SHORT  # noqa: F401
from .cache import ActivationCache
from .analyses import CircuitResult, corpus, corpus_merge
from .hooked_model import HookedModel

__all__ = ["HookedModel", "CircuitResult", "FactoredMatrix", "ActivationCache", "Config", "HookPoint", "corpus", "corpus_merge", "HOOKS", "GLOBAL_HOOKS", "viz", "utils",
           "distributed", "set_array_type", "utilities", "__version__"]
__version__ = _native.__version__
# TransformerLens 3+'s module name for its utils (`from transformer_lens import utilities`)
utilities = utils
sys.modules[__name__ + ".utilities"] = utils

# TransformerLens's loader names (#59): a TL user's imports and loading lines run unchanged
from . import bridge as _bridge  # noqa: E402
from .bridge import TransformerBridge  # noqa: E402

HookedTransformer = HookedModel


def __getattr__(name: str) -> Any:
    """``HookedRootModule`` (TransformerLens's, for a user's own torch module) imports torch, so
    it is loaded on first use (attnscope itself needs no torch)."""
    if name == "HookedRootModule":
        from .hooked_module import HookedRootModule
        return HookedRootModule
    raise AttributeError(f"module 'attnscope' has no attribute {name!r}")
