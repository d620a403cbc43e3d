"""Hook names (TransformerLens's) and TransformerLens's editing hooks on a :class:`HookedModel`:
``run_with_hooks``, ``add_hook``, ``reset_hooks``, the ``hooks()`` context."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _native, hook_points, inputs, utils
from .arrays import _wrap
from .hook_points import HookPoint


#: The hook suffixes the engine captures, in TransformerLens's names (`blocks.{l}.` + suffix).
HOOKS: Tuple[str, ...] = tuple(_native.hook_suffixes())
# the hooks outside the blocks, by their whole names: hook_embed, hook_pos_embed (GPT-2's learned
# positions only), ln_final.hook_scale and ln_final.hook_normalized
GLOBAL_HOOKS: Tuple[str, ...] = tuple(_native.global_hooks())

# short names accepted in cache["pattern", l] and stack_activation("pattern")
_SHORT = {h.rsplit(".", 1)[-1].replace("hook_", ""): h for h in HOOKS}
_SHORT.update({h.rsplit(".", 1)[-1]: h for h in HOOKS})


NamesFilter = Union[None, str, Sequence[str], Callable[[str], bool]]
TextOrTokens = Union[str, Sequence[str], np.ndarray, Sequence[int]]


HookFn = Callable[[np.ndarray, "HookPoint"], Optional[np.ndarray]]
HookName = Union[str, Callable[[str], bool]]

_MAPS = ("attn.hook_attn_scores", "attn.hook_pattern")


def _as_float32(x: Any, name: str, shape: Tuple[int, ...]) -> np.ndarray:
    """A hook's return value as a C-contiguous float32 numpy array of the activation's shape
    (a torch tensor is taken through numpy); anything else raises, naming the hook."""
    if inputs.is_tensor(x):  # a torch tensor on the CPU: its memory
        x = inputs.as_array(x, f"the hook at {name}'s return value")
    if not isinstance(x, np.ndarray):
        raise TypeError(f"the hook at {name} returned {type(x).__name__}; return None (edited in place) or an array")
    if x.dtype != np.float32:
        raise TypeError(f"the hook at {name} returned an array of dtype {x.dtype}; the activation is float32")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"the hook at {name} returned an array of shape {tuple(x.shape)}; the activation is {tuple(shape)}")
    return np.ascontiguousarray(x)


class HooksMixin:
    """:class:`HookedModel`'s editing hooks (TransformerLens's ``run_with_hooks`` and the hooks
    it keeps: ``add_hook``, ``reset_hooks``, ``hooks()``)."""

    # editing hooks (TransformerLens's run_with_hooks)
    def _resolve(self, fwd_hooks: Sequence[Tuple[HookName, HookFn]]) -> Dict[str, List[HookFn]]:
        """Hook functions by full hook name, in the order given."""
        names = self.hook_names()
        out: Dict[str, List[HookFn]] = {}
        for item in fwd_hooks:
            if not (isinstance(item, tuple) and len(item) == 2 and callable(item[1])):
                raise TypeError(f"a forward hook is a (name or predicate, function) pair, not {item!r}")
            name, fn = item
            if callable(name):
                chosen = [n for n in names if name(n)]
            else:
                if name not in names:
                    suffixes = ", ".join(HOOKS)
                    raise ValueError(f"unknown hook name {name!r}; attnscope's hooks are blocks.L.{{{suffixes}}} "
                                     f"for L in 0..{self.cfg.n_layers - 1}, and {', '.join(n for n in names if not n.startswith('blocks.'))}")
                chosen = [name]
            for n in chosen:
                out.setdefault(n, []).append(fn)
        return out

    def _editor(self, by_name: Dict[str, List[HookFn]], batch: Optional[Tuple[Any, Dict[str, Dict[Any, Any]], int]], row: int):
        """The callable the engine hands each edited activation to: it runs the hook functions of
        its name on ``[1, ...]`` (one row), or, in a batch run in lockstep (``batch``: a barrier,
        the shared slots, the batch size), on the rows of every forward stacked ``[b, ...]``."""

        def run_fns(name: str, act: np.ndarray) -> np.ndarray:
            hook = self.hook_dict[name]
            for fn in by_name[name]:
                r = fn(_wrap(act), hook)  # a torch tensor shares act's memory: in-place edits land
                if r is not None:
                    act = _as_float32(r, name, act.shape)
            return act

        def editor(name: str, arr: np.ndarray) -> np.ndarray:
            if batch is None:
                act = run_fns(name, arr[np.newaxis])  # TransformerLens's batch axis; writable
                # the engine refuses a NaN or infinity (a -inf score masks a key), naming the hook
                return np.ascontiguousarray(act[0], dtype=np.float32)
            barrier, shared, b = batch
            slot = shared.setdefault(name, {})
            slot[row] = arr
            if barrier.wait() == 0:  # one forward (any) runs the hooks on the whole batch
                try:
                    slot["out"] = run_fns(name, np.stack([slot[i] for i in range(b)]))
                except BaseException:
                    barrier.abort()
                    raise
            barrier.wait()
            return np.ascontiguousarray(slot["out"][row], dtype=np.float32)

        return editor


    def _stacked_editor(self, by_name: Dict[str, List[HookFn]]):
        """The callable a batch's stacked forward (``Model.run_batch``) hands each edited
        activation to, on every row at once (``[b, ...]``): it runs the hook functions of its name."""

        def editor(name: str, arr: np.ndarray) -> np.ndarray:
            hook = self.hook_dict[name]
            act = arr
            for fn in by_name[name]:
                r = fn(_wrap(act), hook)  # a torch tensor shares act's memory: in-place edits land
                if r is not None:
                    act = _as_float32(r, name, act.shape)
            # the engine refuses a NaN or infinity (a -inf score masks a key), naming the hook
            return np.ascontiguousarray(act, dtype=np.float32)

        return editor

    def run_with_hooks(self, input: TextOrTokens, fwd_hooks: Sequence[Tuple[HookName, HookFn]] = (),
                       bwd_hooks: Sequence[Tuple[HookName, HookFn]] = (), reset_hooks_end: bool = True,
                       clear_contexts: bool = False, return_type: Optional[str] = "logits",
                       prepend_bos: Optional[bool] = None, stop_at_layer: Optional[int] = None,
                       loss_per_token: bool = False, attention_mask: Any = None, **kwargs: Any):
        """Runs the model with ``fwd_hooks``: ``[(name or predicate on names, fn)]``, each
        ``fn(activation, hook)`` getting a writable float32 array in TransformerLens's shape
        (``hook_z``: ``[b, pos, head, d_head]``; ``hook_pattern``: ``[b, head, query, key]``) and a
        :class:`HookPoint`; it edits in place and returns None, or returns the array that replaces
        the activation. Hooks added with :meth:`add_hook` or a :meth:`hooks` context run first.
        ``input``: as :meth:`run_with_cache` (a batch runs each row as it stands; on an encoder a
        sentence pair ``("A", "B")`` with its token types, where ``"logits"`` gives None, there
        being no output head, and a loss is refused).
        ``return_type``: ``"logits"`` ``[b, n, vocab]``, ``"loss"`` (mean next-token cross-entropy
        over every row and position, pad positions included, as TransformerLens computes it
        without an attention mask; ``loss_per_token``: ``[b, n - 1]``), ``"both"`` (logits, loss)
        or None. ``attention_mask`` (``[b, n]``, 1 on real tokens) is taken for the loss only
        (TransformerLens's ``lm_cross_entropy_loss``: a prediction counts when its position and the
        next are real); the logits at pad positions under a mask are not computed (refused).
        ``stop_at_layer``: returns the residual stream before that block ``[b, n, d_model]``."""
        if kwargs:
            raise TypeError(f"run_with_hooks got arguments attnscope does not support: {sorted(kwargs)}")
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(f"return_type={return_type!r}: use 'logits', 'loss', 'both' or None")
        if attention_mask is not None and return_type != "loss":
            raise NotImplementedError(
                "attention_mask: attnscope takes it for return_type='loss' only; TransformerLens's logits at masked "
                "positions (pad queries at shifted positions) are not computed. Without a mask a right-padded batch "
                "gives TransformerLens's results")
        rows = self._rows(input, prepend_bos, pair_ok=True)
        types = self._row_types(input)
        if self.is_encoder and return_type in ("loss", "both"):
            raise ValueError(f"return_type={return_type!r}: {self.cfg.model_name} is an encoder (bidirectional attention), "
                             "with no next-token prediction and so no loss")
        stop = self._stop(stop_at_layer)
        mode = "none" if return_type is None or self.is_encoder else "all"
        hook_points.warn_reset(bwd_hooks, reset_hooks_end)
        # as TransformerLens: the hooks are attached for the run, and stay with reset_hooks_end=False
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end, clear_contexts):
            lg, _ = hook_points.forward(self, rows, [], mode, self._fwd_hooks, stop, types)
        if stop is not None:
            return _wrap(lg)  # TransformerLens returns the residual whatever return_type says
        if return_type is None:
            return None
        if return_type == "logits":
            return _wrap(lg)
        if hook_points.is_tracked(lg):  # backward hooks: a loss .backward() reaches them through
            loss = utils.lm_cross_entropy_loss(lg, np.asarray(rows), attention_mask, loss_per_token)
            return loss if return_type == "loss" else (lg, loss)
        loss = self.loss(lg, np.asarray(rows), per_token=loss_per_token, attention_mask=attention_mask)
        return loss if return_type == "loss" else (_wrap(lg), loss)


    @property
    def _fwd_hooks(self) -> List[Tuple[HookName, HookFn]]:
        """The forward hooks this thread attached (:meth:`add_hook`, :meth:`hooks`, hook points'
        ``add_hook``), in order, as (full name, fn)."""
        return hook_points.registry(self).fwd

    def add_hook(self, name: HookName, hook: HookFn, dir: str = "fwd", is_permanent: bool = False,
                 level: Optional[int] = None, prepend: bool = False) -> None:
        """Attaches ``hook`` at ``name`` (a hook name, or a predicate on names: every point it
        takes) for every later forward of this thread, until :meth:`reset_hooks` (a permanent one:
        until ``reset_hooks(including_permanent=True)``). ``dir="bwd"``: a backward hook
        (:mod:`attnscope.hook_points`). Hooks belong to the thread that adds them."""
        names = [n for n, _ in hook_points.resolve(self, [(name, hook)], "bwd" if dir == "bwd" else "fwd")]
        hook_points.add(self, names, hook, dir, is_permanent, prepend)

    def add_perma_hook(self, name: HookName, hook: HookFn, dir: str = "fwd") -> None:
        """:meth:`add_hook` with ``is_permanent=True`` (kept by ``reset_hooks()``)."""
        self.add_hook(name, hook, dir, is_permanent=True)

    def reset_hooks(self, clear_contexts: bool = True, direction: str = "both", including_permanent: bool = False,
                    level: Optional[int] = None) -> None:
        """Removes this thread's hooks (``direction``: ``"fwd"``, ``"bwd"`` or ``"both"``; the
        permanent ones too with ``including_permanent``); ``clear_contexts`` empties every hook
        point's ``ctx``."""
        hook_points.remove(self, direction, including_permanent)
        if clear_contexts:
            for hp in self.hook_dict.values():
                hp.clear_context()

    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Sequence[Tuple[HookName, HookFn]] = (), bwd_hooks: Sequence[Tuple[HookName, HookFn]] = (),
              reset_hooks_end: bool = True, clear_contexts: bool = False):
        """A context in which every forward of this thread (``run_with_cache`` included) runs
        ``fwd_hooks`` (and ``bwd_hooks`` on a backward); forwards in other threads do not see
        them. On leaving it (with ``reset_hooks_end``) exactly these hooks are removed, whatever
        else was added meanwhile."""
        fwd = hook_points.resolve(self, fwd_hooks, "fwd")
        bwd = hook_points.resolve(self, bwd_hooks, "bwd")
        # entries of their own (fresh tuples), so removal takes these and not an equal pair
        # added by add_hook or by another context
        mine = [e for n, fn in fwd for e in hook_points.add(self, [n], fn, "fwd")]
        mine += [e for n, fn in bwd for e in hook_points.add(self, [n], fn, "bwd")]
        try:
            yield self
        finally:
            if reset_hooks_end:
                hook_points.remove_entries(self, mine)
                if clear_contexts:
                    for hp in self.hook_dict.values():
                        hp.clear_context()
