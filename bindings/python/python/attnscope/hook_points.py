"""TransformerLens's hook points as objects: ``model.blocks[3].attn.hook_z``, ``model.hook_embed``,
``model.ln_final.hook_scale``, each a :class:`HookPoint` with ``add_hook`` / ``remove_hooks``;
``model.hook_dict`` and ``model.mod_dict``; backward hooks.

Hooks belong to the thread that adds them (a forward runs the hooks its own thread attached).
A backward hook runs when ``.backward()`` reaches the logits of a forward that ran while it was
attached (the logits are then a torch tensor that requires grad): the engine's backward is seeded
with the gradient of the caller's scalar with respect to the logits and gives the gradient at each
hooked point, which the hook gets as ``fn(grad, hook)``. The engine has the gradient at
``hook_embed``, resid_pre/mid/post, attn_out, mlp_out, q, k, v, rot_q, rot_k, z, attn_scores,
pattern and result (attn_out's for every head), the norms' ``ln1``/``ln2`` ``hook_scale`` and
``hook_normalized``, and the MLP's ``hook_pre``, ``hook_pre_linear`` and ``hook_post``; a backward hook named anywhere else is refused,
naming the point (one on a predicate goes to the points it takes that have one, with a warning)."""

from __future__ import annotations

import re
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

# the hook points the engine's backward gives a gradient at (suffixes in a block, or whole names)
GRAD_SUFFIXES = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out",
                 "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_rot_q", "attn.hook_rot_k", "attn.hook_z",
                 "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_result", "ln1.hook_scale", "ln1.hook_normalized",
                 "ln2.hook_scale", "ln2.hook_normalized", "mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post")
GRAD_GLOBALS = ("hook_embed", "hook_pos_embed")

_TL_RESET_WARNING = ("WARNING: Hooks will be reset at the end of run_with_hooks. This removes the backward hooks "
                     "before a backward pass can occur.")


def has_gradient(name: str) -> bool:
    """Whether the engine's backward gives the gradient at the hook point ``name``."""
    if name in GRAD_GLOBALS:
        return True
    m = re.match(r"blocks\.\d+\.(.+)$", name)
    return m is not None and m.group(1) in GRAD_SUFFIXES


def gradient_points(model: Any, pred: Callable[[str], bool], names: List[str]) -> List[str]:
    """The points a predicate's backward hook goes to: those it takes where the engine has the
    gradient (TransformerLens attaches it everywhere the predicate takes; the rest are named in a
    warning, and a gradient cache built by the hook has no entry for them)."""
    skipped = [n for n in names if not has_gradient(n)]
    if skipped:
        kinds = sorted({re.sub(r"^blocks\.\d+\.", "blocks.L.", n) for n in skipped})
        warnings.warn(f"a backward hook on a predicate: {len(skipped)} of the {len(names)} points it takes have no gradient "
                      f"in attnscope's backward and get no call ({', '.join(kinds)})", stacklevel=4)
    return [n for n in names if has_gradient(n)]


def check_bwd(name: str) -> None:
    if not has_gradient(name):
        raise ValueError(
            f"a backward hook at {name}: the engine's backward has no gradient there; it has one at hook_embed and "
            f"blocks.L.{{{', '.join(GRAD_SUFFIXES)}}} (run_with_cache(..., incl_bwd=True) caches them)")


class HookPoint:
    """A hook point, as TransformerLens's: ``name`` (``"blocks.3.attn.hook_z"``), ``layer()``,
    ``ctx`` (a dict the hook functions may keep things in), ``add_hook(fn, dir="fwd"|"bwd",
    is_permanent=False, prepend=False)``, ``remove_hooks(dir="fwd", including_permanent=False)``.
    ``fn(activation, hook)`` gets the activation (the gradient for ``"bwd"``) and this object;
    a forward hook's return value, when not None, replaces the activation."""

    def __init__(self, name: Optional[str] = None, model: Any = None):
        self.name = name
        self.ctx: Dict[str, Any] = {}
        self._model = model
        # a hook point of a user's own module (HookPoint() in a HookedRootModule): its own hooks
        self._own: List[Tuple[Callable, bool]] = []

    def __call__(self, x: Any) -> Any:
        """A user's own module's hook point (``self.hook_x = HookPoint()``, then
        ``self.hook_x(value)``): runs the hooks added here on ``x`` and returns what they leave."""
        if self._model is not None:
            raise TypeError(f"{self.name}: a model's hook point runs inside the engine's forward, not by calling it")
        for fn, _ in list(self._own):
            r = fn(x, self)
            x = x if r is None else r
        return x

    def layer(self) -> int:
        m = re.match(r"blocks\.(\d+)\.", self.name)
        if m is None:
            raise ValueError(f"{self.name} is not inside a block")
        return int(m.group(1))

    def _need_model(self) -> Any:
        if self._model is None:
            raise ValueError(f"{self.name}: this HookPoint belongs to no model; use model.hook_dict[{self.name!r}]")
        return self._model

    def add_hook(self, hook: Callable, dir: str = "fwd", is_permanent: bool = False, level: Optional[int] = None,
                 prepend: bool = False) -> None:
        """Attaches ``hook`` here for every later forward of this thread (until removed)."""
        if self._model is None and dir == "fwd":
            self._own.insert(0, (hook, is_permanent)) if prepend else self._own.append((hook, is_permanent))
            return
        add(self._need_model(), [self.name], hook, dir, is_permanent, prepend)

    def add_perma_hook(self, hook: Callable, dir: str = "fwd") -> None:
        """``add_hook(hook, dir, is_permanent=True)``: kept by ``reset_hooks()``."""
        self.add_hook(hook, dir, is_permanent=True)

    def remove_hooks(self, dir: str = "fwd", including_permanent: bool = False, level: Optional[int] = None) -> None:
        """Removes this thread's hooks here (``dir``: ``"fwd"``, ``"bwd"`` or ``"both"``),
        the permanent ones too with ``including_permanent``."""
        if self._model is None:
            self._own = [(fn, perm) for fn, perm in self._own if perm and not including_permanent]
            return
        remove(self._need_model(), dir, including_permanent, lambda n: n == self.name)

    def clear_context(self) -> None:
        self.ctx = {}

    @property
    def fwd_hooks(self) -> List[Callable]:
        return [fn for n, fn in registry(self._need_model()).fwd if n == self.name]

    @property
    def bwd_hooks(self) -> List[Callable]:
        return [fn for n, fn in registry(self._need_model()).bwd if n == self.name]

    def __repr__(self) -> str:
        return f"HookPoint({self.name!r})"


class _Registry:
    """One thread's hooks on one model: ``fwd``/``bwd`` lists of (full name, fn) entries, in the
    order they run; ``permanent``: the ids of the entries ``reset_hooks`` keeps."""

    def __init__(self) -> None:
        self.fwd: List[Tuple[Any, Callable]] = []
        self.bwd: List[Tuple[str, Callable]] = []
        self.permanent: set = set()


def registry(model: Any) -> _Registry:
    reg = getattr(model._local, "hooks", None)
    if reg is None:
        reg = model._local.hooks = _Registry()
    return reg


def _dir(dir: str, both: bool = False) -> Tuple[str, ...]:
    allowed = ("fwd", "bwd", "both") if both else ("fwd", "bwd")
    if dir not in allowed:
        raise ValueError(f"dir={dir!r}: use {', '.join(repr(a) for a in allowed)}")
    return ("fwd", "bwd") if dir == "both" else (dir,)


def add(model: Any, names: Sequence[str], fn: Callable, dir: str = "fwd", is_permanent: bool = False,
        prepend: bool = False) -> List[Tuple[str, Callable]]:
    """Attaches ``fn`` at each of ``names`` (full names, checked) in this thread; returns the entries."""
    (d,) = _dir(dir)
    if not callable(fn):
        raise TypeError(f"a hook is a function fn(activation, hook), not {type(fn).__name__}")
    if d == "bwd":
        for n in names:
            check_bwd(n)
    reg = registry(model)
    entries = [(n, fn) for n in names]
    lst = reg.fwd if d == "fwd" else reg.bwd
    if prepend:
        lst[:0] = entries
    else:
        lst.extend(entries)
    if is_permanent:
        reg.permanent.update(id(e) for e in entries)
    return entries


def remove(model: Any, dir: str, including_permanent: bool, which: Callable[[str], bool] = lambda n: True) -> None:
    """Removes this thread's hooks in ``dir`` at the points ``which`` takes (not the permanent
    ones unless ``including_permanent``)."""
    reg = registry(model)
    for d in _dir(dir, both=True):
        lst = reg.fwd if d == "fwd" else reg.bwd
        kept = [e for e in lst if not which(e[0]) or (id(e) in reg.permanent and not including_permanent)]
        reg.permanent -= {id(e) for e in lst} - {id(e) for e in kept}
        lst[:] = kept


def resolve(model: Any, hooks: Sequence[Tuple[Any, Callable]], what: str) -> List[Tuple[str, Callable]]:
    """``[(name or predicate, fn)]`` as ``[(full name, fn)]`` (a predicate: every name it takes)."""
    out: List[Tuple[str, Callable]] = []
    for item in hooks:
        names = list(model._resolve([item]))
        if what == "bwd":
            names = gradient_points(model, item[0], names) if callable(item[0]) else names
            for n in names:
                check_bwd(n)
        out.extend((n, item[1]) for n in names)
    return out


def remove_entries(model: Any, entries: Sequence[Tuple[Any, Callable]]) -> None:
    ids = {id(e) for e in entries}
    reg = registry(model)
    reg.fwd[:] = [e for e in reg.fwd if id(e) not in ids]
    reg.bwd[:] = [e for e in reg.bwd if id(e) not in ids]
    reg.permanent -= ids


# the parts of TransformerLens's module tree a block's hook suffix lives in
_PARTS = ("attn", "mlp", "ln1", "ln2")


class _Module:
    """A part of TransformerLens's module tree that attnscope has no weights for
    (``blocks[L].hook_*`` parents such as ``ln1`` on a model without its weights)."""

    def __init__(self, name: str):
        self._name = name

    def __repr__(self) -> str:
        return f"Module({self._name!r})"


def install(model: Any, hooks: Sequence[str], global_hooks: Sequence[str]) -> None:
    """Puts a :class:`HookPoint` on every hook point of ``model`` (``model.hook_dict``) and fills
    ``model.mod_dict`` (TransformerLens's module names: ``blocks.3``, ``blocks.3.attn``, and every
    hook point)."""
    hook_dict: Dict[str, HookPoint] = {}
    mod_dict: Dict[str, Any] = {"": model, "embed": model.embed, "pos_embed": model.pos_embed,
                                "unembed": model.unembed, "ln_final": model.ln_final}
    for name in model.hook_names():
        hp = hook_dict[name] = HookPoint(name, model)
        mod_dict[name] = hp
        if name.startswith("blocks."):
            _, l, suffix = name.split(".", 2)
            parent: Any = model.blocks[int(l)]
            mod_dict[f"blocks.{l}"] = parent
            part, _, attr = suffix.rpartition(".")
            if part:
                if not hasattr(parent, part) or parent.__dict__.get(part) is None:
                    setattr(parent, part, _Module(f"blocks.{l}.{part}"))
                parent = getattr(parent, part)
                mod_dict[f"blocks.{l}.{part}"] = parent
            setattr(parent, attr, hp)
        elif name.startswith("ln_final."):
            setattr(model.ln_final, name.split(".", 1)[1], hp)
        else:
            setattr(model, name, hp)
    model.hook_dict = hook_dict
    model.mod_dict = mod_dict


# backward hooks: the torch autograd node on the logits
def _edit_watch(fn: Callable, edited: set) -> Callable:
    """``fn`` as a forward hook that records (in ``edited``) the hook points whose activation it
    changed: the engine's backward differentiates the model unedited, so a backward hook after an
    edit would get a wrong gradient (refused)."""

    def watched(act: Any, hook: HookPoint) -> Any:
        before = _np(act).copy()
        r = fn(act, hook)
        after = _np(r) if r is not None else _np(act)
        if before.shape != after.shape or not np.array_equal(before, after, equal_nan=True):
            edited.add(hook.name)
        return r

    return watched


def _np(a: Any) -> np.ndarray:
    if hasattr(a, "detach") and hasattr(a, "cpu"):
        return a.detach().cpu().numpy()
    return np.asarray(a)


def watch_forward(fwd: Sequence[Tuple[Any, Callable]], edited: set) -> List[Tuple[Any, Callable]]:
    return [(n, _edit_watch(fn, edited)) for n, fn in fwd]


def _torch(bwd: Sequence[Tuple[str, Callable]]) -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        raise RuntimeError(
            f"backward hooks ({', '.join(sorted({n for n, _ in bwd}))}) run when .backward() reaches the logits, "
            "a torch tensor: import torch first (attnscope itself needs no torch), or use "
            "run_with_cache(..., incl_bwd=True) for the gradients as arrays")
    return torch


def backward_node(model: Any, logits: np.ndarray, rows: List[List[int]], bwd: List[Tuple[str, Callable]],
                  edited: set) -> Any:
    """The logits as a torch tensor whose ``.backward()`` runs the engine's backward, seeded with
    the gradient it receives, and hands each backward hook (still attached when it runs) the
    gradient at its point ``[b, ...]``, the last hook points first (as torch's backward reaches
    them)."""
    torch = _torch(bwd)
    live = registry(model).bwd
    order = {n: i for i, n in enumerate(model.hook_names())}
    attached = list(bwd)

    class _EngineBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, anchor: Any) -> Any:
            return torch.from_numpy(logits)

        @staticmethod
        def backward(ctx: Any, dlogits: Any) -> Any:
            ids = {id(e) for e in live}
            todo = [e for e in attached if id(e) in ids]  # TransformerLens: removed hooks do not run
            if todo:
                run_backward_hooks(model, rows, todo, dlogits, edited, order)
            return None

    anchor = torch.zeros((), dtype=torch.float32, requires_grad=True)
    return _EngineBackward.apply(anchor)


_RESULT = re.compile(r"^(blocks\.\d+)\.attn\.hook_result$")


def run_backward_hooks(model: Any, rows: List[List[int]], todo: List[Tuple[str, Callable]], dlogits: Any,
                       edited: set, order: Dict[str, int]) -> None:
    if edited:
        raise RuntimeError(
            f"backward hooks: the forward hooks edited {', '.join(sorted(edited))}, and the engine's backward "
            "differentiates the unedited model; run the backward without editing hooks attached")
    d = dlogits.detach().cpu().numpy().astype(np.float32, copy=False)
    names = sorted({n for n, _ in todo}, key=lambda n: order[n])
    # hook_result's gradient is hook_attn_out's for every head (attn_out is the heads' sum plus b_O)
    asked = sorted({_RESULT.sub(r"\1.hook_attn_out", n) for n in names})
    per: Dict[str, List[np.ndarray]] = {n: [] for n in names}
    for i, ids in enumerate(rows):
        _, _, grads = model._m.hook_gradients(ids, asked, "logits", None, None, np.ascontiguousarray(d[i]).reshape(-1))
        got = {name[: -len("_grad")]: data.reshape(shape) for name, shape, data in grads}  # "<point>_grad"
        for n in names:
            m = _RESULT.match(n)
            if m is not None:
                g = got[f"{m.group(1)}.hook_attn_out"]
                got[n] = np.ascontiguousarray(np.broadcast_to(g[:, None, :], (g.shape[0], model.cfg.n_heads, g.shape[1])))
            if n not in got:
                raise RuntimeError(f"backward hook at {n}: the engine gave no gradient there")
            per[n].append(got[n])
    from . import _wrap
    hook_points = model.hook_dict
    for name, fn in sorted(todo, key=lambda e: -order[e[0]]):
        r = fn(_wrap(np.stack(per[name])), hook_points[name])
        if r is not None:
            raise NotImplementedError(
                f"the backward hook at {name} returned a value: replacing a gradient (to change what flows "
                "upstream) is not supported; read the gradient and return None")


def warn_reset(bwd_hooks: Sequence[Any], reset_hooks_end: bool) -> None:
    if bwd_hooks and reset_hooks_end:
        warnings.warn(_TL_RESET_WARNING, stacklevel=3)


def is_tracked(x: Any) -> bool:
    """Whether ``x`` is a torch tensor a backward runs through (the logits of a forward with
    backward hooks attached)."""
    return bool(getattr(x, "requires_grad", False))


def forward(model: Any, rows: List[List[int]], capture: List[Tuple[int, str]], mode: str,
            fwd: Sequence[Tuple[Any, Callable]], stop: Optional[int], types: Any) -> Tuple[Any, Dict[str, np.ndarray]]:
    """``model._run_rows``; with backward hooks attached in this thread, the logits come back as
    a torch tensor whose ``.backward()`` runs them (:func:`backward_node`)."""
    bwd = list(registry(model).bwd)
    if not bwd:
        return model._run_rows(rows, capture, mode, fwd, stop, types)
    names = ", ".join(sorted({n for n, _ in bwd}))
    if stop is not None:
        raise ValueError(f"backward hooks ({names}) run from the logits: leave stop_at_layer unset")
    if mode != "all":
        raise ValueError(f"backward hooks ({names}) run from the logits: ask for every position's (logits='all')")
    if types is not None or model.is_encoder:
        raise ValueError(f"backward hooks ({names}): an encoder has no logits to differentiate")
    _torch(bwd)
    edited: set = set()
    lg, cache = model._run_rows(rows, capture, mode, watch_forward(fwd, edited), stop, types)
    return backward_node(model, lg, rows, bwd, edited), cache
