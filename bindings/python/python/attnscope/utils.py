"""TransformerLens's ``utils`` helpers that user code reaches for, on attnscope's hook names."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

# TransformerLens's aliases
_ALIAS = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q", "value": "v",
          "mlp_pre": "pre", "mlp_post": "post", "scores": "attn_scores"}
_ATTN = {"q", "k", "v", "z", "rot_q", "rot_k", "result", "pattern", "attn_scores"}
_MLP = {"pre", "post", "pre_linear"}
_BLOCK = {"resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"}
_NORM = {"scale", "normalized"}


def get_act_name(name: str, layer: Optional[int] = None, layer_type: Optional[str] = None) -> str:
    """The full hook name, as TransformerLens's ``utils.get_act_name``: ``get_act_name("z", 3)``
    is ``"blocks.3.attn.hook_z"``, ``get_act_name("scale", 3, "ln1")`` is
    ``"blocks.3.ln1.hook_scale"``, ``get_act_name("scale")`` is ``"ln_final.hook_scale"`` and
    ``get_act_name("embed")`` is ``"hook_embed"``; a full name is returned as it is. A name
    attnscope has no hook for raises a ValueError naming the ones it has."""
    if name.startswith("blocks.") or name.startswith("ln_final.") or name.startswith("hook_") and layer is None:
        return name
    key = name
    if layer is not None and (name.startswith("hook_") or "." in name):
        # a block's hook suffix with its layer (attnscope's ("attn.hook_z", 3), ("ln1.hook_scale", 3))
        part, _, hook = name.rpartition(".")
        key = hook[len("hook_"):] if hook.startswith("hook_") else hook
        if part in ("ln1", "ln2") and layer_type is None:
            layer_type = part
    # TransformerLens also accepts e.g. "z3" or "pattern3a" (a: attn, m: mlp)
    digits = "".join(c for c in key if c.isdigit())
    if layer is None and digits and key.rstrip("a").rstrip("m").endswith(digits):
        key = key[: key.index(digits)]
        layer = int(digits)
    key = _ALIAS.get(key, key)
    if key in ("embed", "pos_embed"):
        return f"hook_{key}"
    if key in _NORM:
        if layer is None:
            return f"ln_final.hook_{key}"
        if layer_type not in ("ln1", "ln2"):
            raise ValueError(f"{name!r} at a layer needs layer_type 'ln1' or 'ln2'")
        return f"blocks.{int(layer)}.{layer_type}.hook_{key}"
    if key in _ATTN:
        suffix = f"attn.hook_{key}"
    elif key in _MLP:
        suffix = f"mlp.hook_{key}"
    elif key in _BLOCK:
        suffix = f"hook_{key}"
    else:
        known = sorted(_ATTN | _MLP | _BLOCK | _NORM | {"embed", "pos_embed"} | set(_ALIAS))
        raise ValueError(f"attnscope has no hook {name!r}; it has {', '.join(known)}")
    if layer is None:
        raise ValueError(f"{name!r} is a per-layer hook: give the layer")
    return f"blocks.{int(layer)}.{suffix}"


def tl_slice(s: Any):
    """TransformerLens's ``Slice`` input as a numpy index: ``None`` everything, an int (numpy's,
    or a 0-d tensor) that position (the axis dropped), a tuple ``slice(*s)``, a slice itself, a
    list, array or tensor those positions."""
    if s is None:
        return slice(None)
    if isinstance(s, slice):
        return s
    if isinstance(s, tuple):
        return slice(*s)
    if isinstance(s, (int, np.integer)) and not isinstance(s, bool):
        return int(s)
    a = np.asarray(s.detach().cpu().numpy() if hasattr(s, "detach") else s)
    if a.ndim == 0 and a.dtype.kind in "iu":
        return int(a)
    if a.ndim == 1 and (a.dtype.kind in "iu" or a.size == 0):
        return a.astype(np.int64)
    raise ValueError(f"pos_slice={s!r}: use None, an int, a tuple (start, stop[, step]), a slice or a list of positions")
