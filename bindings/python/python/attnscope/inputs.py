"""What the public calls take as arrays: numpy arrays, lists, and torch tensors on the CPU (read
through ``.numpy()``, the same memory, no copy; a tensor that requires grad is detached). A tensor
on another device, or a token argument that is not an integer, is refused with a message that
says what to do."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np


def is_tensor(x: Any) -> bool:
    return hasattr(x, "detach") and hasattr(x, "cpu")


def as_array(x: Any, what: str = "the input") -> np.ndarray:
    """``x`` as a numpy array (a CPU tensor's own memory)."""
    if is_tensor(x):
        device = getattr(x, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            raise ValueError(f"{what} is a tensor on {device}: attnscope runs on the CPU; pass it as .cpu()")
        return np.asarray(x.detach().numpy())
    return np.asarray(x)


def token_arg(x: Any, what: str) -> Optional[str]:
    """A ``target`` / ``answer`` / ``wrong`` argument as the engine takes it (a token id's digits
    or one token's text): a Python or numpy int, a one-element integer array or tensor, or a text."""
    if x is None or isinstance(x, str):
        return x
    if isinstance(x, bool):
        raise TypeError(f"{what}={x!r}: give a token id or one token's text")
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    a = as_array(x, what)
    if a.size != 1 or a.dtype.kind not in "iu":
        raise TypeError(f"{what}: give a token id (an int, or an integer array or tensor of one element) or one "
                        f"token's text, not an array of shape {a.shape} and dtype {a.dtype}")
    return str(int(a.reshape(-1)[0]))


def text_arg(model: Any, x: Any, what: str) -> str:
    """A text argument of a call the engine runs on text (``ablate``, ``patch``, ``circuit``,
    ...): a text, or token ids ``[n]`` / ``[1, n]`` (a list, an array or a tensor) whose text
    encodes back to exactly these ids (else refused: the call would run other tokens)."""
    if isinstance(x, str):
        return x
    a = as_array(x, what)
    if a.ndim == 2 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise TypeError(f"{what}: give a text or token ids [n] / [1, n], not shape {a.shape} dtype {a.dtype}")
    ids = [int(t) for t in a]
    model._check_ids(np.asarray(ids, dtype=np.int64))
    text = model.to_string(ids)
    back = list(model._m.encode(text, None))
    if back != ids:
        raise ValueError(f"{what}: these token ids do not come back from their text ({len(ids)} ids, "
                         f"{len(back)} when re-encoded); this call runs on text: pass the text itself")
    return text


# the calls the engine runs on text, and their text arguments: token ids are taken there too
# (ablate, patch and circuit call text_arg themselves)
TEXT_ARGS = {"inspect": ("text",), "faithfulness": ("text",), "sinks": ("text",), "heads": ("text",),
             "compare": ("text", "other_text"), "capture": ("text",), "qk_attribution": ("text",), "view": ("text",)}


def accept_tokens(cls: Any) -> Any:
    """Wraps ``cls``'s methods in :data:`TEXT_ARGS` so that each text argument may be token ids
    (a list, an array or a CPU tensor; :func:`text_arg`). A text, a tuple (a sentence pair) or
    None passes as it is."""
    import functools
    import inspect

    for name, args in TEXT_ARGS.items():
        fn = getattr(cls, name)
        sig = inspect.signature(fn)

        def wrapped(self: Any, *a: Any, _fn: Any = fn, _sig: Any = sig, _args: Any = args, **kw: Any) -> Any:
            bound = _sig.bind(self, *a, **kw)
            for arg in _args:
                v = bound.arguments.get(arg)
                if v is not None and not isinstance(v, (str, tuple)):
                    bound.arguments[arg] = text_arg(self, v, arg)
            return _fn(*bound.args, **bound.kwargs)

        setattr(cls, name, functools.wraps(fn)(wrapped))
    return cls
