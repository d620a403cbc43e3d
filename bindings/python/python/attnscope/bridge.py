"""TransformerLens's loader names (#59), so a TL user's imports work unchanged:
``HookedTransformer`` (:class:`attnscope.HookedModel`) and TL 4's ``TransformerBridge``:
``TransformerBridge.boot_transformers(name)`` then ``model.enable_compatibility_mode()``, which
TL's demos call at once. The bridge loads with TransformerLens's processing (what compatibility
mode gives); ``enable_compatibility_mode(no_processing=True)`` loads the model again unprocessed.
The weights are processed at load (the engine packs them), so a change reloads the model."""

from __future__ import annotations

from typing import Any, Optional


class TransformerBridge:
    """TL 4's loader: ``boot_transformers`` gives an :class:`attnscope.HookedModel`. As TL 4's
    bridge, it puts the BOS token first in every text by default (``cfg.default_prepend_bos`` is
    True "even for non-BOS-trained models", TL's words), where ``HookedModel.from_pretrained``
    follows the model's tokenizer (SmolLM2 and Qwen2.5 add none); ``default_prepend_bos=False``
    asks for the model's way."""

    @staticmethod
    def boot_transformers(model_name: str, device: Optional[str] = None, dtype: Any = None, **kwargs: Any):
        from . import HookedModel

        if dtype is not None and "float32" not in str(dtype):
            raise ValueError(f"dtype={dtype!r}: attnscope computes in float32 (the exact precision)")
        kwargs.setdefault("default_prepend_bos", True)
        model = HookedModel.from_pretrained(model_name, device=device, **kwargs)
        model._boot = (model_name, kwargs)
        return model


def enable_compatibility_mode(model, disable_warnings: bool = False, no_processing: bool = False,
                              **steps: bool) -> None:
    """TL 4's ``enable_compatibility_mode``: TransformerLens's processing (``no_processing=False``;
    ``fold_ln=`` & co as TL takes them, ``refactor_factored_attn_matrices=True`` refused: not
    implemented) or the checkpoint's weights. A model loaded by ``boot_transformers`` is loaded
    again when the processing asked for is not the one it has; another model refuses the change
    (load it with ``from_pretrained`` or ``from_pretrained_no_processing``)."""
    from . import HookedModel, processing

    if no_processing and any(steps.values()):
        raise ValueError(f"no_processing=True with {sorted(k for k, v in steps.items() if v)}: choose one")
    processing.asked_steps(**steps)  # an unknown or unimplemented step is refused, named
    want = {} if no_processing else {s: steps.get(s, s != "refactor_factored_attn_matrices") for s in processing.STEPS[:4]}
    have = model.facts.get("processing", {})
    if all(bool(have.get(s)) == bool(want.get(s)) or (s == "center_writing_weights" and not have.get("center_writing_weights"))
           for s in processing.STEPS[:4]):
        return
    boot = getattr(model, "_boot", None)
    if boot is None:
        raise ValueError(
            f"enable_compatibility_mode(no_processing={no_processing}) on a model loaded with processing {have}: "
            f"load it with {'from_pretrained_no_processing' if no_processing else 'from_pretrained'} instead")
    name, kwargs = boot
    fresh = (HookedModel.from_pretrained_no_processing(name, **kwargs) if no_processing
             else HookedModel.from_pretrained(name, **{**kwargs, **want}))
    model.__dict__.update(fresh.__dict__)
    model._boot = boot


# TL's parameter names, in the order TL 4's bridge lists them (get_params): the embedding, then
# per block the attention's, the MLP's and the norms' weights, then the final norm and unembedding
_BLOCK_PARAMS = (("attn", ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")),
                 ("mlp", ("W_in", "W_out", "b_in", "b_out", "W_gate")),
                 ("ln1", ("w", "b")), ("ln2", ("w", "b")))
_GLOBAL_PARAMS = (("ln_final", "w", "ln_final.w"), ("ln_final", "b", "ln_final.b"), ("unembed", "W_U", "W_U"),
                  ("unembed", "b_U", "b_U"))
_WEIGHT = {"w": ".w", "b": ".b"}


def tl_parameters(model) -> dict:
    """TL 4's ``tl_parameters()``: ``{"blocks.0.attn.W_Q": [n_heads, d_model, d_head], ...}`` in TL's
    names, shapes and order (W_K and W_V repeated per query head, as TL's bridge gives them; the
    weights processed as the model was loaded). A weight the model lacks (an RMSNorm's bias,
    learned positions on a rotary model) is left out, as TL leaves it out."""
    out = {}

    def put(key: str, name: str, layer: Optional[int] = None) -> None:
        try:
            w = model._weight(name)
        except AttributeError:
            return
        from . import _wrap

        out[key] = _wrap(w if layer is None else w[layer])

    put("embed.W_E", "W_E")
    put("pos_embed.W_pos", "W_pos")
    for l in range(model.cfg.n_layers):
        for part, names in _BLOCK_PARAMS:
            for n in names:
                put(f"blocks.{l}.{part}.{n}", part + _WEIGHT[n] if part.startswith("ln") else n, l)
    for part, n, name in _GLOBAL_PARAMS:
        put(f"{part}.{n}", name)
    return out


def tl_named_parameters(model):
    """TL 4's ``tl_named_parameters()``: ``(name, tensor)`` pairs of :func:`tl_parameters`."""
    return iter(tl_parameters(model).items())


def _set_flag(model, flag: str, value: bool) -> None:
    object.__setattr__(model.cfg, flag, bool(value))


def set_use_attn_result(model, use_attn_result: bool) -> None:
    """TL's ``set_use_attn_result``: ``hook_result`` (each head's output in the residual stream,
    ``[b, pos, head, d_model]``) is always computed here; the flag is recorded in ``cfg``."""
    _set_flag(model, "use_attn_result", use_attn_result)


def set_use_split_qkv_input(model, use_split_qkv_input: bool) -> None:
    """TL's ``set_use_split_qkv_input``: refused when turned on (``hook_q_input`` & co, one copy of
    the residual stream per head, are not hook points here)."""
    if use_split_qkv_input:
        raise NotImplementedError("set_use_split_qkv_input(True): attnscope has no hook_q_input/hook_k_input/"
                                  "hook_v_input hook points; patch hook_q/hook_k/hook_v instead")
    _set_flag(model, "use_split_qkv_input", False)
