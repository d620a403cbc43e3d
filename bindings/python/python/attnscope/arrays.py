"""What results are (numpy arrays or torch tensors, :func:`set_array_type`) and how arguments
become numpy arrays: the one rule every module of the package follows."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from . import inputs


_ARRAY_TYPE = "auto"


def set_array_type(kind: str) -> None:
    """What results are: ``"numpy"`` arrays, ``"torch"`` tensors (``torch.from_numpy``: the same
    memory, no copy), or ``"auto"`` (the default): torch tensors once the program has imported
    torch, numpy arrays otherwise. Hook functions get their activation the same way."""
    global _ARRAY_TYPE
    if kind not in ("numpy", "torch", "auto"):
        raise ValueError(f"array type {kind!r}: use 'numpy', 'torch' or 'auto'")
    if kind == "torch":
        import torch  # noqa: F401  (fails here, with torch's own message, if it is missing)
    _ARRAY_TYPE = kind


def _wrap(a: Any) -> Any:
    """A numpy result as the array type in force (see :func:`set_array_type`)."""
    if a is None or not isinstance(a, np.ndarray):
        return a
    kind = _ARRAY_TYPE
    if kind == "auto":
        kind = "torch" if "torch" in sys.modules else "numpy"
    if kind == "torch":
        return sys.modules["torch"].from_numpy(a) if "torch" in sys.modules else __import__("torch").from_numpy(a)
    return a


def _np(a: Any) -> np.ndarray:
    """A numpy view of a result or an argument (a torch tensor through ``.numpy()``)."""
    return inputs.as_array(a)


def _token_array(x: Any) -> np.ndarray:
    """Token ids as a numpy array; rows of different lengths (which numpy cannot stack) refused
    with a message that says so, not numpy's."""
    try:
        return _np(x)
    except ValueError:
        if isinstance(x, (list, tuple)):
            lengths = [len(r) if hasattr(r, "__len__") else 1 for r in x]
            raise ValueError(f"token lists of different lengths {lengths}: a batch is rows of one length [b, n]; "
                             "pad them (to_tokens pads a list of texts) or run them one at a time") from None
        raise
