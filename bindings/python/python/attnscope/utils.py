"""TransformerLens's ``utils`` helpers that user code reaches for, on attnscope's hook names."""

from __future__ import annotations

from typing import Optional

# TransformerLens's short names -> attnscope's hook suffix (after ``blocks.{layer}.``)
_ACT = {
    "resid_pre": "hook_resid_pre",
    "resid_mid": "hook_resid_mid",
    "resid_post": "hook_resid_post",
    "attn_out": "hook_attn_out",
    "mlp_out": "hook_mlp_out",
    "pre": "mlp.hook_pre",
    "post": "mlp.hook_post",
    "mlp_pre": "mlp.hook_pre",
    "mlp_post": "mlp.hook_post",
    "q": "attn.hook_q",
    "k": "attn.hook_k",
    "v": "attn.hook_v",
    "rot_q": "attn.hook_rot_q",
    "rot_k": "attn.hook_rot_k",
    "z": "attn.hook_z",
    "pattern": "attn.hook_pattern",
    "attn": "attn.hook_pattern",
    "attn_scores": "attn.hook_attn_scores",
    "scores": "attn.hook_attn_scores",
}


def get_act_name(name: str, layer: Optional[int] = None, layer_type: Optional[str] = None) -> str:
    """The full hook name, as TransformerLens's ``utils.get_act_name``: ``get_act_name("z", 3)``
    is ``"blocks.3.attn.hook_z"``; a full name is returned as it is. Names attnscope has no hook
    for (``embed``, ``ln1.hook_scale``, ``mlp.hook_pre``, ...) raise a ValueError naming them."""
    if name.startswith("blocks.") or name.startswith("hook_") and layer is None:
        return name
    key = name
    # TransformerLens also accepts e.g. "z3" or "pattern3a"
    digits = "".join(c for c in name if c.isdigit())
    if layer is None and digits and name.rstrip("a").rstrip("m").endswith(digits):
        key = name[: name.index(digits)]
        layer = int(digits)
    suffix = _ACT.get(key)
    if suffix is None:
        raise ValueError(f"attnscope has no hook {name!r}; it has {', '.join(sorted(_ACT))}")
    if layer is None:
        raise ValueError(f"{name!r} is a per-layer hook: give the layer")
    return f"blocks.{int(layer)}.{suffix}"
