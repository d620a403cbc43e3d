"""The forward of a :class:`HookedModel` with capture: ``run_with_cache``, ``__call__``, the loss."""

from __future__ import annotations

import threading
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import hook_points
from .arrays import _np, _wrap
from .cache import ActivationCache
from .hooks import _MAPS, GLOBAL_HOOKS, HOOKS, _SHORT, HookFn, HookName, NamesFilter, TextOrTokens
from .inputs import token_arg as _tok

# the hook points the engine hands inside the attention, one row at a time
_PER_ROW = _MAPS + ("attn.hook_rot_q", "attn.hook_rot_k")


class RunMixin:
    """:class:`HookedModel`'s forward with capture (``run_with_cache``, ``__call__``) and
    TransformerLens's loss."""

    # every hook point's full name, in TransformerLens's order
    def hook_names(self) -> List[str]:
        """Every hook point of this model, in TransformerLens's names and order: ``hook_embed``
        (``hook_pos_embed`` for learned positions), each block's, then ``ln_final``'s."""
        n = self.cfg.n_layers
        before = [h for h in GLOBAL_HOOKS if h.startswith("hook_")]
        if self.cfg.architecture != "gpt2":
            before = [h for h in before if h != "hook_pos_embed"]
        after = [h for h in GLOBAL_HOOKS if not h.startswith("hook_")]
        return before + [f"blocks.{l}.{h}" for l in range(n) for h in HOOKS] + after

    def _split_name(self, name: str) -> Tuple[int, str]:
        """A full hook name as (layer, suffix); a hook outside the blocks is handed at layer 0
        (the embeddings) or at the last (the final norm)."""
        if name in GLOBAL_HOOKS:
            return (0 if name.startswith("hook_") else self.cfg.n_layers - 1), name
        _, l, suffix = name.split(".", 2)
        return int(l), suffix

    # the forward with capture
    def _hooks(self, names_filter: NamesFilter) -> List[Tuple[int, str]]:
        n = self.cfg.n_layers
        if names_filter is None:
            return [self._split_name(x) for x in self.hook_names()]
        if callable(names_filter):
            return [self._split_name(x) for x in self.hook_names() if names_filter(x)]
        try:
            wanted = [names_filter] if isinstance(names_filter, str) else list(names_filter)
        except TypeError:  # not iterable: an int, a float...
            wanted = None
        if wanted is None or not all(isinstance(w, str) for w in wanted):
            raise TypeError(f"names_filter={names_filter!r}: give None (every hook), a hook name or suffix "
                            "(\"hook_pattern\"), a list of them, or a function of a hook name that returns a bool")
        out: List[Tuple[int, str]] = []
        for w in wanted:
            if w in GLOBAL_HOOKS:
                if w not in self.hook_names():
                    raise ValueError(f"{w}: {self.cfg.model_name} has no learned positions (only GPT-2-style models do)")
                out.append(self._split_name(w))
            elif w.startswith("blocks."):
                parts = w.split(".", 2)
                if len(parts) < 3 or not parts[1].lstrip("-").isdigit() or parts[2] not in HOOKS:
                    raise ValueError(f"unknown hook name {w!r}; hooks are blocks.L.{{{', '.join(HOOKS)}}}")
                out.append((int(parts[1]), parts[2]))
            else:
                suffix = w if w in HOOKS else _SHORT.get(w)
                if suffix is None:
                    raise ValueError(f"unknown hook {w!r}; known: {', '.join(HOOKS)}")
                out.extend((l, suffix) for l in range(n))
        return out

    def run_with_cache(
        self,
        input: TextOrTokens,
        names_filter: NamesFilter = None,
        remove_batch_dim: bool = False,
        logits: Optional[str] = "all",
        prepend_bos: Optional[bool] = None,
        stop_at_layer: Optional[int] = None,
        return_type: Optional[str] = None,
        incl_bwd: bool = False,
        metric: str = "target_logprob",
        target: Optional[Union[str, int]] = None,
        wrong: Optional[Union[str, int]] = None,
    ):
        """Runs the model and returns ``(logits, cache)``.

        ``input``: a text, token ids ``[n]`` or ``[b, n]``, or a list of texts (padded as
        :meth:`to_tokens` pads them: a batch). Each row of a batch runs as it stands, as
        TransformerLens runs a right-padded batch (no attention mask): a row's real tokens get
        exactly what the text alone gets, and the pad positions what the row's tokens give.
        ``names_filter``: None (every hook: large), a hook name or suffix (``"hook_pattern"``,
        ``"blocks.3.attn.hook_q"``), a list of them, or a predicate on full names; only what it
        selects is computed and kept. ``logits``: ``"all"`` ``[b, n, vocab]``, ``"last"``
        ``[b, 1, vocab]`` or None. ``stop_at_layer``: TransformerLens's; the first result is then the
        residual stream before that block ``[b, n, d_model]`` (negative: from the end), and the cache
        holds what ran before it. Shapes (with the batch axis): pattern and attn_scores
        ``[b, head, query, key]``; q, rot_q, z ``[b, pos, head, d_head]``; k, v, rot_k ``[b, pos,
        kv_head, d_head]``; resid_pre, attn_out, resid_post ``[b, pos, d_model]``.

        ``incl_bwd=True`` (TransformerLens's) also caches ``<name>_grad``, the gradient of a scalar
        with respect to each selected hook point, in the hook's shape (one forward and one backward
        through the engine; a single text, no hooks attached, no ``stop_at_layer``). ``metric``:
        ``"target_logprob"`` (log p(``target``) at the last position; default the top next token),
        ``"loss"`` (TransformerLens's: the mean next-token cross-entropy) or ``"logit_diff"``
        (logit(``target``) − logit(``wrong``) at the last position); ``target``/``wrong``: a token
        id or one token's text. Gradients exist for ``hook_embed`` (``hook_pos_embed``),
        resid_pre/mid/post, attn_out, mlp_out, q, k, v, rot_q, rot_k, z, attn_scores and pattern
        (``[b, head, n, n]``: ask for the layers you need), the norms' ``ln1``/``ln2``
        ``hook_scale`` and ``hook_normalized``, and the MLP's ``hook_pre``, ``hook_pre_linear`` and
        ``hook_post``; the other hooks have none. The
        scalar's value is ``cache.bwd_value``.

        On an encoder (``model.is_encoder``: all-MiniLM-L6-v2) ``input`` may be a sentence pair
        ``("A", "B")``: ``[CLS] A [SEP] B [SEP]`` with token types 0 then 1 (:meth:`to_tokens`,
        :meth:`to_token_types`), the pattern ``[1, head, query, key]`` bidirectional (a query
        attends to the keys after it too), what ``attnscope capture --text A --pair B`` writes.
        An encoder has no output head: the default ``logits="all"`` gives None there."""
        if return_type not in (None, "logits"):
            raise ValueError(f"return_type={return_type!r}: run_with_cache returns the logits (or, with stop_at_layer, the residual)")
        rows = self._rows(input, prepend_bos, pair_ok=True)
        types = self._row_types(input)
        if self.is_encoder and logits == "all":
            logits = None
        mode = "none" if logits is None else logits
        stop = self._stop(stop_at_layer)
        if not incl_bwd and (metric != "target_logprob" or target is not None or wrong is not None):
            raise ValueError("metric=, target= and wrong= choose the scalar of incl_bwd=True's gradients")
        if incl_bwd:
            if len(rows) != 1:
                raise ValueError(f"incl_bwd=True runs one text; this batch has {len(rows)}")
            if stop is not None:
                raise ValueError("incl_bwd=True needs the whole forward: leave stop_at_layer unset")
            if self._fwd_hooks:
                raise ValueError("incl_bwd=True differentiates the model as it is: remove the attached hooks first")
            if types is not None:
                raise ValueError("incl_bwd=True takes one text, not a sentence pair")
        hooks = self._hooks(names_filter)
        lg, cache = hook_points.forward(self, rows, hooks, mode, self._fwd_hooks, stop, types)
        c = ActivationCache(cache, self.cfg.n_layers, model=self)
        if incl_bwd:
            names = [self._full_name(*h) for h in hooks]
            tgt, value, grads = self._m.hook_gradients(rows[0], names, metric, _tok(target, 'target'),
                                                      _tok(wrong, 'wrong'))
            for name, shape, data in grads:
                cache[name] = data.reshape([1] + list(shape))
            c.bwd_value, c.bwd_target = value, tgt
        if remove_batch_dim:
            if len(rows) != 1:
                raise ValueError(f"remove_batch_dim=True needs a batch of one; this one has {len(rows)}")
            c.remove_batch_dim()
        return _wrap(lg), c  # TransformerLens keeps the logits' batch axis even with remove_batch_dim

    def _stop(self, stop_at_layer: Optional[int]) -> Optional[int]:
        """``stop_at_layer`` as a block index 0..n_layers (TransformerLens slices ``blocks[:s]``)."""
        if stop_at_layer is None:
            return None
        n = self.cfg.n_layers
        s = int(stop_at_layer)
        if not -n <= s <= n:
            raise ValueError(f"stop_at_layer={stop_at_layer} is out of range: the model has {n} layers (use -{n}..{n})")
        return s % n if s < 0 else s

    def _runs_before(self, name: str, stop: Optional[int]) -> bool:
        """Whether the hook point ``name`` runs when the forward stops before block ``stop``."""
        if stop is None or name.startswith("hook_"):
            return True
        if name.startswith("blocks."):
            return int(name.split(".", 2)[1]) < stop
        return False  # ln_final: never, once stopped


    def _run_rows(self, rows: List[List[int]], capture: List[Tuple[int, str]], mode: str,
                  fwd_hooks: Sequence[Tuple[HookName, HookFn]], stop: Optional[int],
                  types: Optional[List[Optional[List[int]]]] = None):
        """The forward of each row, with the hook functions of ``fwd_hooks`` run where they are
        attached (on ``[b, ...]``: the rows' forwards run in lockstep, one thread each, meeting at
        every edited hook point). Returns (logits ``[b, n or 1, vocab]``, or with ``stop`` the
        residual stream before block ``stop``, or None; the captured arrays ``{name: [b, ...]}``)."""
        by_name = {k: v for k, v in self._resolve(fwd_hooks).items() if self._runs_before(k, stop)}
        edits = [self._split_name(x) for x in by_name]
        n_layers = self.cfg.n_layers
        capture = [c for c in capture if self._runs_before(self._full_name(*c), stop)]
        extra = None
        if stop is not None:
            # the residual stream before block `stop` (after the last, before the final norm)
            extra = (stop, "hook_resid_pre") if stop < n_layers else (n_layers - 1, "hook_resid_post")
            mode = "none"
        want = capture + ([extra] if extra is not None and extra not in capture else [])
        b = len(rows)
        results: List[Any] = [None] * b
        if b > 1 and types is None and not self.is_encoder and not any(h in _PER_ROW for _, h in edits):
            # one forward over the stacked rows (each weight read once for the batch; each row's
            # numbers are those of its own forward); an edit sees every row at once, [b, ...]; the
            # maps and rotated q/k are made row by row there, so their edits run rows in lockstep
            ed = self._stacked_editor(by_name) if by_name else None
            lg, arrays = self._m.run_batch(rows, want, mode, edits, ed, stop)
            cache = dict(arrays)
            if extra is not None:
                first = cache[self._full_name(*extra)]
                if extra not in capture:
                    del cache[self._full_name(*extra)]
                return first, cache
            return lg, cache
        if not by_name or b == 1:
            for i, ids in enumerate(rows):
                ed = self._editor(by_name, None, i) if by_name else None
                results[i] = self._m.run(ids, want, mode, edits, ed, stop, None if types is None else types[i])
        else:
            barrier, shared = threading.Barrier(b), {}

            def run_row(i: int) -> None:
                try:
                    results[i] = self._m.run(rows[i], want, mode, edits, self._editor(by_name, (barrier, shared, b), i), stop,
                                             None if types is None else types[i])
                except BaseException as e:  # the others stop at their next meeting
                    results[i] = e
                    barrier.abort()

            threads = [threading.Thread(target=run_row, args=(i,), daemon=True) for i in range(b)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                # the cause, not the broken meetings it left behind
                raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        one = b == 1

        def stack(arrays: List[np.ndarray]) -> np.ndarray:
            return arrays[0][np.newaxis] if one else np.stack(arrays)

        names = [name for name, _ in results[0][1]]
        cache = {name: stack([dict(r[1])[name] for r in results]) for name in names}
        if extra is not None:
            first = cache[self._full_name(*extra)]
            if extra not in capture:
                del cache[self._full_name(*extra)]
            return first, cache
        lg = None if results[0][0] is None else stack([r[0] for r in results])
        return lg, cache

    def _full_name(self, layer: int, suffix: str) -> str:
        return suffix if suffix in GLOBAL_HOOKS else f"blocks.{int(layer) % self.cfg.n_layers}.{suffix}"


    def __call__(self, input: TextOrTokens, return_type: Optional[str] = "logits", prepend_bos: Optional[bool] = None,
                 stop_at_layer: Optional[int] = None, loss_per_token: bool = False, attention_mask: Any = None,
                 padding_side: Optional[str] = None):
        """The logits ``[b, n, vocab]`` (``return_type="logits"``), the mean next-token loss
        (``"loss"``), both (``"both"``) or None; with ``stop_at_layer``, the residual stream before
        that block. Hooks added with :meth:`add_hook` or a :meth:`hooks` context apply. See
        :meth:`run_with_hooks` for batches and ``attention_mask``."""
        if padding_side not in (None, "right"):
            raise NotImplementedError(f"padding_side={padding_side!r}: attnscope pads on the right (TransformerLens's default)")
        return self.run_with_hooks(input, return_type=return_type, prepend_bos=prepend_bos, stop_at_layer=stop_at_layer,
                                   loss_per_token=loss_per_token, attention_mask=attention_mask)

    @staticmethod
    def loss(logits: np.ndarray, tokens: Union[np.ndarray, Sequence[int]], per_token: bool = False,
             attention_mask: Any = None):
        """Next-token cross-entropy of ``logits`` ``[b, n, vocab]`` against ``tokens`` ``[b, n]``
        (TransformerLens's ``lm_cross_entropy_loss``): the mean over every row's positions
        0..n-2 (a 0-d float32 array, a 0-d tensor under :func:`set_array_type`'s rules, as
        TransformerLens returns), or each one ``[b, n - 1]`` with ``per_token``. With ``attention_mask`` (1 on real
        tokens), a prediction counts only where its position and the next are real, and the mean
        is over those."""
        lg = _np(logits).astype(np.float64)
        if lg.ndim == 2:
            lg = lg[np.newaxis]
        t = _np(tokens)
        t = t.reshape(1, -1) if t.ndim == 1 else t
        if lg.ndim != 3 or t.shape != lg.shape[:2]:
            raise ValueError(f"logits {lg.shape} and tokens {t.shape} do not match: [b, n, vocab] and [b, n]")
        if t.shape[1] < 2:
            raise ValueError("the loss needs at least two tokens (it predicts each next one)")
        z = lg[:, :-1] - lg[:, :-1].max(axis=-1, keepdims=True)
        lp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
        per = -np.take_along_axis(lp, t[:, 1:, None].astype(np.int64), axis=-1)[..., 0]  # [b, n - 1]
        if attention_mask is not None:
            m = _np(attention_mask).astype(bool)
            if m.shape != t.shape:
                raise ValueError(f"attention_mask {m.shape} does not match the tokens {t.shape}")
            keep = m[:, :-1] & m[:, 1:]
            per = per * keep
            if per_token:
                return _wrap(per.astype(np.float32))
            return _wrap(np.array(per.sum() / keep.sum(), dtype=np.float32))
        # a 0-d array (a 0-d tensor under set_array_type's rules), as TransformerLens returns
        return _wrap(per.astype(np.float32) if per_token else np.array(per.mean(), dtype=np.float32))

    def loss_fn(self, logits: np.ndarray, tokens: Union[np.ndarray, Sequence[int]], attention_mask: Any = None,
                per_token: bool = False):
        """TransformerLens's name for :meth:`loss` (its argument order)."""
        return self.loss(logits, tokens, per_token=per_token, attention_mask=attention_mask)
