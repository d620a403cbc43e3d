"""TransformerLens's loader names (#59), so a TL user's imports work unchanged:
``HookedTransformer`` (:class:`attnscope.HookedModel`) and TL 4's ``TransformerBridge``:
``TransformerBridge.boot_transformers(name)`` then ``model.enable_compatibility_mode()``, which
TL's demos call at once. The bridge loads with TransformerLens's processing (what compatibility
mode gives); ``enable_compatibility_mode(no_processing=True)`` loads the model again unprocessed.
The weights are processed at load (the engine packs them), so a change reloads the model."""

from __future__ import annotations

from typing import Any, Optional


class TransformerBridge:
    """TL 4's loader: ``boot_transformers`` gives an :class:`attnscope.HookedModel`."""

    @staticmethod
    def boot_transformers(model_name: str, device: Optional[str] = None, dtype: Any = None, **kwargs: Any):
        from . import HookedModel

        if dtype is not None and "float32" not in str(dtype):
            raise ValueError(f"dtype={dtype!r}: attnscope computes in float32 (the exact precision)")
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
