"""TransformerLens's weight processing (#59): the steps ``HookedModel.from_pretrained`` takes, and
the weights in TransformerLens's shapes after them.

The engine applies the steps that change what the forward computes (``center_unembed`` centres
each position's logits over the vocabulary; ``fold_value_biases`` moves each head's value bias
into the output bias, so ``hook_v``, ``hook_z`` and ``hook_result`` lose it and ``hook_attn_out``
keeps it). ``fold_ln`` changes no activation (TransformerLens's ``hook_normalized`` is the
normalized vector before the norm's weight, folded or not), only the weights reported: each
RMSNorm's weight is multiplied into the matrices that read its output (``ln1`` into ``W_Q``,
``W_K``, ``W_V``; ``ln2`` into ``W_in``, ``W_gate``; ``ln_final`` into ``W_U``) and becomes ones.
``center_writing_weights`` is skipped for RMSNorm models, as TransformerLens skips it (an RMSNorm's
output depends on the stream's mean). ``refactor_factored_attn_matrices`` is refused: TransformerLens
itself refuses it on rotary models (Qwen2, Llama/SmolLM2, Gemma: the QK matrix depends on the query's
and key's positions), and on GPT-2 it is not implemented (TL's default leaves it off).
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Optional

import numpy as np

#: TransformerLens's processing steps, in its order; all but the last are on by default.
STEPS = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases",
         "refactor_factored_attn_matrices")

# the weights that read each norm's output (fold_ln multiplies the norm's weight into their rows)
_READERS = {"ln1.w": ("W_Q", "_W_K", "_W_V"), "ln2.w": ("W_in", "W_gate"), "ln_final.w": ("W_U",)}


def asked_steps(**flags: bool) -> List[str]:
    """The steps among ``flags`` that are on, refusing the ones attnscope does not implement."""
    unknown = sorted(set(flags) - set(STEPS))
    if unknown:
        raise TypeError(f"unknown processing step(s) {unknown}: TransformerLens's are {', '.join(STEPS)}")
    if flags.get("refactor_factored_attn_matrices"):
        raise NotImplementedError(
            "refactor_factored_attn_matrices: TransformerLens refuses it on rotary models (\"You can't refactor the "
            "QK circuit when using rotary embeddings (as the QK matrix depends on the position of the query and "
            "key)\"), which every decoder attnscope loads but GPT-2 is; on GPT-2 it is not implemented. Load "
            "without it (TransformerLens leaves it off by default)")
    return [s for s in STEPS if flags.get(s)]


def load_with_defaults(load: Callable[[List[str]], object], name: str, **flags: Optional[bool]):
    """``load(steps)`` with TransformerLens's default processing where a flag is ``None`` (every
    step but ``refactor_factored_attn_matrices``, as TL's ``from_pretrained``). A family whose
    processing is not implemented (Gemma, the encoders) refuses a step asked for by name; where
    no step was asked for by name it loads unprocessed, with a warning naming why."""
    resolved = {s: (s != "refactor_factored_attn_matrices") if flags.get(s) is None else bool(flags[s])
                for s in STEPS}
    steps = asked_steps(**resolved)
    try:
        return load(steps)
    except NotImplementedError as e:
        if not steps or any(flags.get(s) for s in STEPS):
            raise
        warnings.warn(
            f"{name}: TransformerLens's default weight processing ({', '.join(steps)}) is not implemented "
            f"for this model ({e}); loaded unprocessed, as from_pretrained_no_processing does, so its "
            "weights, logits and hook_v/hook_z are the checkpoint's, not TransformerLens's processed ones",
            UserWarning, stacklevel=3)
        return load([])


def processed_weight(name: str, raw: np.ndarray, steps: Dict[str, bool], make) -> np.ndarray:
    """The weight ``name`` after the processing ``steps`` (the engine's ``facts["processing"]``),
    from ``raw``, the engine's own (value biases already folded there). ``make(name)`` gives
    another weight, unprocessed."""
    if steps.get("fold_ln"):
        for norm, readers in _READERS.items():
            if name in readers:
                w = np.asarray(make(norm), dtype=np.float32)  # [layer, d_model], ln_final's [d_model]
                if name in ("W_Q", "_W_K", "_W_V"):  # [layer, head, d_model, d_head]
                    w = w[:, np.newaxis, :, np.newaxis]
                else:  # W_in, W_gate: [layer, d_model, d_mlp]; W_U: [d_model, d_vocab]
                    w = w[..., np.newaxis]
                raw = raw * w
            elif name == norm:
                return np.ones_like(raw)
    if steps.get("center_unembed") and name in ("W_U", "b_U"):
        raw = raw - raw.mean(-1, keepdims=True)
    return np.ascontiguousarray(raw, dtype=np.float32)
