"""TransformerLens's ``transformer_lens.patching`` (#59): activation patching sweeps with TL's
names, signatures, index order and output shapes, with TL's numbers: the patched forward of each
index (the clean cache's slice copied into the corrupted activation) and ``patching_metric(logits)``
stored at that index. TL runs one ``model.run_with_hooks(corrupted_tokens, fwd_hooks=[(name,
hook)])`` per index (``resume=False`` here); with TL's own setters attnscope resumes each patched
run at the patched layer and position, many to a forward (:func:`generic_activation_patch`).

``get_act_patch_resid_pre(model, corrupted_tokens, clean_cache, metric)`` gives
``[n_layers, pos]``; the ``*_by_pos`` head sweeps ``[n_layers, pos, heads]``; the ``*_all_pos``
ones ``[n_layers, heads]``; the ``*_every`` helpers stack them on a leading axis (k and v, with one
per KV head, zero-padded to ``n_heads`` as TL pads them). TL 4's per-example statistics
(``reduce="none"``, ``baseline=True``, a mapping of metrics: its ``PatchingResult``) are refused
by name; ``reduce="mean"`` (a ``[batch]`` metric averaged) is taken. The results are float32, in
the array type :func:`attnscope.set_array_type` chooses (torch once torch is imported)."""

from __future__ import annotations

import itertools
from functools import partial
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from . import _wrap, utils

def make_df_from_ranges(column_max_ranges: Sequence[int], column_names: Sequence[str]):
    """TL's index table: the cartesian product of ``range(m)`` per column, last column fastest
    (a pandas DataFrame)."""
    import pandas as pd

    rows = list(itertools.product(*[range(m) for m in column_max_ranges]))
    return pd.DataFrame(rows, columns=list(column_names))


def _axis_ranges(model, corrupted_tokens, activation_name: str, index_axis_names: Sequence[str]) -> List[int]:
    heads = model.cfg.n_heads
    if activation_name in ("k", "v") and getattr(model.cfg, "n_key_value_heads", None) is not None:
        heads = model.cfg.n_key_value_heads  # TL: one per KV head for k and v
    pos = int(np.shape(corrupted_tokens)[-1])
    ranges = {"layer": model.cfg.n_layers, "pos": pos, "src_pos": pos, "dest_pos": pos,
              "head_index": heads, "head": heads}
    unknown = [a for a in index_axis_names if a not in ranges]
    if unknown:
        raise ValueError(f"index axis {unknown}: TransformerLens's are {sorted(ranges)}")
    return [ranges[a] for a in index_axis_names]


def _metric_value(out: Any, reduce: str, batch: int) -> float:
    a = np.asarray(out.detach().cpu().numpy() if hasattr(out, "detach") else out, dtype=np.float64)
    if reduce == "mean":
        if a.shape != (batch,):
            raise ValueError(f"patching_metric must return a [batch] tensor of length {batch} under reduce='mean', "
                             f"got shape {a.shape}")
        return float(a.mean())
    if a.ndim != 0:
        raise ValueError(f"patching_metric must return a scalar under reduce='scalar', got shape {a.shape}; "
                         "return a [batch] tensor and pass reduce='mean'")
    return float(a)


def generic_activation_patch(model, corrupted_tokens, clean_cache, patching_metric: Callable[[Any], Any],
                             patch_setter: Callable, activation_name: str,
                             index_axis_names: Optional[Sequence[str]] = None, index_df: Any = None,
                             return_index_df: bool = False, *, reduce: str = "scalar", skip_noops: bool = True,
                             resume: bool = True, **kwargs: Any):
    """TL's ``generic_activation_patch``: for each index (row of ``index_df``, or every
    combination of ``index_axis_names``' ranges, first axis the layer), one corrupted run with
    ``patch_setter(corrupted_activation, index, clean_activation)`` at
    ``get_act_name(activation_name, layer)``, and the metric of its logits. ``index_df`` gives a
    flat result (one value per row); otherwise one axis per index axis.

    ``skip_noops`` (attnscope's): an index whose patch leaves the corrupted activation bit for bit
    as it is (the clean and corrupted runs agree there: positions before the first token that
    differs, for one) is not run again; its value is the metric of the corrupted run's logits,
    which that forward would give bit for bit (the engine is deterministic). TL runs it; the
    values are the same (test_patching.py checks both ways).

    ``resume`` (attnscope's): with one of this module's setters, on an attnscope model with no
    hooks attached, each patched run starts at the patched layer from the corrupted run's
    residual stream, and at the patched position from its keys and values (the engine's
    :class:`_native.PatchBase`, as ``attnscope patch`` runs), many patches to a forward: an edit
    at layer ``l``, position ``p`` leaves every earlier layer and position as it was, so the
    logits are those of the full forward TL runs (the positions before ``p``: the corrupted
    run's), several times faster. ``resume=False``: one ``run_with_hooks`` per index."""
    asked = sorted(k for k, v in kwargs.items() if v)
    if asked or not callable(patching_metric) or reduce not in ("scalar", "mean"):
        what = asked or ([f"reduce={reduce!r}"] if reduce not in ("scalar", "mean") else ["a mapping of metrics"])
        raise NotImplementedError(
            f"{', '.join(what)}: TransformerLens 4's per-example PatchingResult is not implemented in attnscope; "
            "use reduce='scalar' (the default) or 'mean' with one metric")
    if index_df is None:
        if index_axis_names is None:
            raise ValueError("give index_axis_names or index_df")
        ranges = _axis_ranges(model, corrupted_tokens, activation_name, index_axis_names)
        indices = list(itertools.product(*[range(m) for m in ranges]))
        shape = tuple(ranges)
    else:
        if index_axis_names is not None:
            raise ValueError("give index_axis_names or index_df, not both")
        indices = [tuple(int(x) for x in row) for row in index_df.itertuples(index=False)]
        shape = (len(indices),)
    store = np.zeros(shape, dtype=np.float32)
    batch = int(np.shape(corrupted_tokens)[0])
    noop = _NoOps(model, corrupted_tokens, clean_cache, patch_setter, activation_name, indices) if skip_noops else None
    if resume and _resumable(model, patch_setter):
        values = _resumed(model, corrupted_tokens, clean_cache, patching_metric, patch_setter, activation_name,
                          indices, noop, lambda out: _metric_value(out, reduce, batch))
        for c, (index, v) in enumerate(zip(indices, values)):
            store[(c,) if index_df is not None else index] = v
        out = _wrap(store)
        if return_index_df:
            return out, (index_df if index_df is not None else make_df_from_ranges(shape, index_axis_names))
        return out
    for c, index in enumerate(indices):
        name = utils.get_act_name(activation_name, layer=index[0])
        if noop is not None and noop.unchanged(name, index):
            logits = noop.corrupted_logits  # the patch changes nothing: the corrupted run's logits, bit for bit
        else:
            hook = partial(_patching_hook, setter=patch_setter, index=list(index), clean=clean_cache[name])
            logits = model.run_with_hooks(corrupted_tokens, fwd_hooks=[(name, hook)])
        store[(c,) if index_df is not None else index] = _metric_value(patching_metric(logits), reduce, batch)
    out = _wrap(store)
    if return_index_df:
        return out, (index_df if index_df is not None else make_df_from_ranges(shape, index_axis_names))
    return out


def _resumable(model, setter) -> bool:
    """Whether the sweep can run resumed: a setter this module knows, on an attnscope decoder
    with no forward hooks attached (they would have to run in every patched forward)."""
    return (setter in _PLANS and hasattr(model, "_m") and not getattr(model, "is_encoder", True)
            and not model._fwd_hooks)


# each setter's patch as the engine takes it: (index, positions, heads' width) -> (first position
# run, first value, end value, rows written: positions from the first, or heads for a map)
_PLANS = {}


def _resumed(model, corrupted_tokens, clean_cache, metric, setter, act: str, indices, noop, value) -> List[float]:
    """The metric of each index's patched run, the runs resumed (:func:`generic_activation_patch`'s
    ``resume``): per layer, up to ``chunk`` patches run together for each row of the batch, the
    logits of a patch ``[batch, n, vocab]`` the corrupted run's before its first position."""
    from . import _native

    rows = model._rows(corrupted_tokens)
    base = noop.corrupted_logits if noop is not None else model(corrupted_tokens)
    base = np.asarray(utils.to_numpy(base), dtype=np.float32)
    b, n, vocab = base.shape
    chunk = max(1, int(256e6 // (b * n * vocab * 4)))  # a chunk's logits: at most ~256 MB
    runs = [_native.PatchBase(model._m, r) for r in rows]
    last = _last_position_only(metric, base, value)
    if last:
        chunk = 1024  # one logit row per patch
    out: List[float] = []
    by_layer = itertools.groupby(indices, key=lambda i: i[0])
    for layer, group in by_layer:
        name = utils.get_act_name(act, layer=layer)
        clean = np.asarray(utils.to_numpy(clean_cache[name]), dtype=np.float32)
        srcs = [np.ascontiguousarray(clean[i]).reshape(-1) for i in range(b)]
        suffix = name.split(".", 2)[2]
        # each row's patch from its first position that changes (a map's: from its first query)
        trim = noop is not None and act != "pattern"
        rows2d = [(clean[i].reshape(n, -1), noop.corrupted[name][i].reshape(n, -1)) for i in range(b)] if trim else None
        group = list(group)
        for c0 in range(0, len(group), chunk):
            part = group[c0:c0 + chunk]
            todo = [k for k, index in enumerate(part) if noop is None or not noop.unchanged(name, index)]
            specs = [_PLANS[setter](part[k], n, clean.shape) for k in todo]
            per_row = [[_trim(sp, *rows2d[i], n) for sp in specs] if trim else specs for i in range(b)]
            got = [runs[i].run(layer, suffix, srcs[i], per_row[i], not last) if specs else [] for i in range(b)]
            vals = [None] * len(part)
            for j, k in enumerate(todo):
                lg = base.copy()
                if last:  # positions the metric does not read: NaN, never stale numbers
                    lg[:, :-1] = np.nan
                for i in range(b):
                    lg[i, n - len(got[i][j]):] = got[i][j]
                vals[k] = value(metric(_wrap(lg)))
                if last and not np.isfinite(vals[k]):  # it may read a NaN position after all: every position
                    lg = base.copy()
                    for i in range(b):
                        row = runs[i].run(layer, suffix, srcs[i], [per_row[i][j]])[0]
                        lg[i, n - len(row):] = row
                    vals[k] = value(metric(_wrap(lg)))
            corrupted = None
            for k in range(len(part)):
                if vals[k] is None:  # the patch changes nothing: the corrupted run's logits, bit for bit
                    corrupted = value(metric(_wrap(base.copy()))) if corrupted is None else corrupted
                    vals[k] = corrupted
            out.extend(vals)
    return out


def _trim(spec, clean_row: np.ndarray, corrupt_row: np.ndarray, n: int):
    """One row's patch ``spec`` run from its first written position whose values change (``[n,
    width]`` rows of the clean and corrupted activations): the earlier ones write what is already
    there, bit for bit. A patch that changes nothing in this row runs the last position alone."""
    start, c0, c1, at = spec
    changed = [a for a in at if not np.array_equal(clean_row[start + a, c0:c1], corrupt_row[start + a, c0:c1])]
    if not changed:
        return n - 1, c0, c1, []
    first = start + min(changed)
    return first, c0, c1, [start + a - first for a in at if start + a >= first]


def _last_position_only(metric, base: np.ndarray, value) -> bool:
    """Whether ``metric`` reads the last position's logits only: its value on the corrupted
    logits is the same bit for bit with every earlier position replaced by NaN, 1e4 or -1e4
    (TL's demos' logit differences read ``logits[:, -1]``; a loss reads every position)."""
    want = value(metric(_wrap(base.copy())))
    for fill in (np.nan, 1e4, -1e4):
        probe = base.copy()
        probe[:, :-1] = fill
        try:
            got = value(metric(_wrap(probe)))
        except Exception:  # noqa: BLE001 - a metric that fails on the probe reads it: all positions
            return False
        if not got == want:
            return False
    return True


class _NoOps:
    """Which patches change nothing: the corrupted run's activations at the patched hook points
    (one forward with them cached), each patch applied to a copy and compared bit for bit."""

    def __init__(self, model, corrupted_tokens, clean_cache, setter, activation_name: str, indices):
        names = sorted({utils.get_act_name(activation_name, layer=i[0]) for i in indices})
        self.corrupted_logits, cache = model.run_with_cache(corrupted_tokens, names_filter=names)
        self.corrupted = {n: np.asarray(utils.to_numpy(cache[n])) for n in names}
        self.clean = {n: np.asarray(utils.to_numpy(clean_cache[n])) for n in names}
        self.setter = setter

    def unchanged(self, name: str, index) -> bool:
        act = self.corrupted[name]
        try:
            patched = self.setter(act.copy(), list(index), self.clean[name])
        except Exception:  # a setter written for torch tensors only: run the patch
            return False
        return patched.shape == act.shape and np.array_equal(np.asarray(patched), act)


def _patching_hook(corrupted_activation, hook, setter, index, clean):
    return setter(corrupted_activation, index, clean)


def layer_pos_patch_setter(corrupted_activation, index, clean_activation):
    """index = [layer, pos]: activations ``[batch, pos, ...]``."""
    assert len(index) == 2
    _, pos = index
    corrupted_activation[:, pos, ...] = clean_activation[:, pos, ...]
    return corrupted_activation


def layer_pos_head_vector_patch_setter(corrupted_activation, index, clean_activation):
    """index = [layer, pos, head_index]: head vectors ``[batch, pos, head, d_head]``."""
    assert len(index) == 3
    _, pos, head_index = index
    corrupted_activation[:, pos, head_index] = clean_activation[:, pos, head_index]
    return corrupted_activation


def layer_head_vector_patch_setter(corrupted_activation, index, clean_activation):
    """index = [layer, head_index]: one head's vectors at every position."""
    assert len(index) == 2
    _, head_index = index
    corrupted_activation[:, :, head_index] = clean_activation[:, :, head_index]
    return corrupted_activation


def layer_head_pattern_patch_setter(corrupted_activation, index, clean_activation):
    """index = [layer, head_index]: patterns ``[batch, head, dest, src]``."""
    assert len(index) == 2
    _, head_index = index
    corrupted_activation[:, head_index, :, :] = clean_activation[:, head_index, :, :]
    return corrupted_activation


def layer_head_pos_pattern_patch_setter(corrupted_activation, index, clean_activation):
    """index = [layer, head_index, dest_pos]."""
    assert len(index) == 3
    _, head_index, dest_pos = index
    corrupted_activation[:, head_index, dest_pos, :] = clean_activation[:, head_index, dest_pos, :]
    return corrupted_activation


def layer_head_dest_src_pos_pattern_patch_setter(corrupted_activation, index, clean_activation):
    """index = [layer, head_index, dest_pos, src_pos]."""
    assert len(index) == 4
    _, head_index, dest_pos, src_pos = index
    corrupted_activation[:, head_index, dest_pos, src_pos] = clean_activation[:, head_index, dest_pos, src_pos]
    return corrupted_activation


def _head_cols(h: int, shape) -> tuple:
    width = shape[-1]  # [batch, pos, head, d_head]: a head's values in a position's row
    return h * width, (h + 1) * width


_PLANS.update({
    layer_pos_patch_setter: lambda i, n, shape: (i[1], 0, int(np.prod(shape[2:])), [0]),
    layer_pos_head_vector_patch_setter: lambda i, n, shape: (i[1], *_head_cols(i[2], shape), [0]),
    layer_head_vector_patch_setter: lambda i, n, shape: (0, *_head_cols(i[1], shape), list(range(n))),
    layer_head_pattern_patch_setter: lambda i, n, shape: (0, 0, n * n, [i[1]]),
    layer_head_pos_pattern_patch_setter: lambda i, n, shape: (0, i[2] * n, (i[2] + 1) * n, [i[1]]),
    layer_head_dest_src_pos_pattern_patch_setter: lambda i, n, shape: (0, i[2] * n + i[3], i[2] * n + i[3] + 1, [i[1]]),
})


def _sweep(setter, act: str, axes: Sequence[str], doc: str):
    f = partial(generic_activation_patch, patch_setter=setter, activation_name=act, index_axis_names=tuple(axes))
    f.__doc__ = doc
    return f


_POS, _HEAD_POS, _HEAD = ("layer", "pos"), ("layer", "pos", "head"), ("layer", "head")
get_act_patch_resid_pre = _sweep(layer_pos_patch_setter, "resid_pre", _POS, "resid_pre by position: [n_layers, pos]")
get_act_patch_resid_mid = _sweep(layer_pos_patch_setter, "resid_mid", _POS, "resid_mid by position: [n_layers, pos]")
get_act_patch_attn_out = _sweep(layer_pos_patch_setter, "attn_out", _POS, "attn_out by position: [n_layers, pos]")
get_act_patch_mlp_out = _sweep(layer_pos_patch_setter, "mlp_out", _POS, "mlp_out by position: [n_layers, pos]")
get_act_patch_attn_head_out_by_pos = _sweep(layer_pos_head_vector_patch_setter, "z", _HEAD_POS,
                                            "each head's output (hook_z) by position: [n_layers, pos, n_heads]")
get_act_patch_attn_head_q_by_pos = _sweep(layer_pos_head_vector_patch_setter, "q", _HEAD_POS,
                                          "each head's query by position: [n_layers, pos, n_heads]")
get_act_patch_attn_head_k_by_pos = _sweep(layer_pos_head_vector_patch_setter, "k", _HEAD_POS,
                                          "each KV head's key by position: [n_layers, pos, n_key_value_heads]")
get_act_patch_attn_head_v_by_pos = _sweep(layer_pos_head_vector_patch_setter, "v", _HEAD_POS,
                                          "each KV head's value by position: [n_layers, pos, n_key_value_heads]")
get_act_patch_attn_head_pattern_by_pos = _sweep(layer_head_pos_pattern_patch_setter, "pattern",
                                                ("layer", "head_index", "dest_pos"),
                                                "each head's pattern row by query: [n_layers, n_heads, dest_pos]")
get_act_patch_attn_head_pattern_dest_src_pos = _sweep(
    layer_head_dest_src_pos_pattern_patch_setter, "pattern", ("layer", "head_index", "dest_pos", "src_pos"),
    "each head's pattern cell: [n_layers, n_heads, dest_pos, src_pos]")
get_act_patch_attn_head_out_all_pos = _sweep(layer_head_vector_patch_setter, "z", _HEAD,
                                             "each head's output at every position: [n_layers, n_heads]")
get_act_patch_attn_head_q_all_pos = _sweep(layer_head_vector_patch_setter, "q", _HEAD,
                                           "each head's query at every position: [n_layers, n_heads]")
get_act_patch_attn_head_k_all_pos = _sweep(layer_head_vector_patch_setter, "k", _HEAD,
                                           "each KV head's key at every position: [n_layers, n_key_value_heads]")
get_act_patch_attn_head_v_all_pos = _sweep(layer_head_vector_patch_setter, "v", _HEAD,
                                           "each KV head's value at every position: [n_layers, n_key_value_heads]")
get_act_patch_attn_head_pattern_all_pos = _sweep(layer_head_pattern_patch_setter, "pattern", ("layer", "head_index"),
                                                 "each head's whole pattern: [n_layers, n_heads]")


def _pad_heads(a: np.ndarray, n_heads: int) -> np.ndarray:
    """k and v's results (one per KV head) zero-padded on the last axis to n_heads, as TL pads."""
    return np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, n_heads - a.shape[-1])])


def _every(name: str, sweeps, doc: str, pad: bool, pattern_last: bool = False):
    """One ``*_every`` helper: ``sweeps`` run in order and stacked on a leading axis; ``pad``: k and
    v (the 3rd and 4th, one per KV head) zero-padded to ``n_heads``; ``pattern_last``: the 5th,
    ``[layer, head, dest_pos]``, rearranged to ``[layer, pos, head]`` as TL rearranges it."""

    def every(model, corrupted_tokens, clean_cache, metric, **kwargs):
        outs = [np.asarray(utils.to_numpy(f(model, corrupted_tokens, clean_cache, metric, **kwargs))) for f in sweeps]
        if pad:
            n_heads = outs[0].shape[-1]
            outs[2], outs[3] = _pad_heads(outs[2], n_heads), _pad_heads(outs[3], n_heads)
        if pattern_last:
            outs[4] = np.swapaxes(outs[4], -1, -2)
        return _wrap(np.ascontiguousarray(np.stack(outs)))

    every.__name__ = every.__qualname__ = name
    every.__doc__ = doc
    return every


get_act_patch_attn_head_all_pos_every = _every(
    "get_act_patch_attn_head_all_pos_every",
    (get_act_patch_attn_head_out_all_pos, get_act_patch_attn_head_q_all_pos, get_act_patch_attn_head_k_all_pos,
     get_act_patch_attn_head_v_all_pos, get_act_patch_attn_head_pattern_all_pos),
    "Every head at every position for each of out (z), q, k, v, pattern: ``[5, n_layers, n_heads]``.", pad=True)
get_act_patch_attn_head_by_pos_every = _every(
    "get_act_patch_attn_head_by_pos_every",
    (get_act_patch_attn_head_out_by_pos, get_act_patch_attn_head_q_by_pos, get_act_patch_attn_head_k_by_pos,
     get_act_patch_attn_head_v_by_pos, get_act_patch_attn_head_pattern_by_pos),
    "Every head by position for each of out (z), q, k, v, pattern: ``[5, n_layers, pos, n_heads]``.",
    pad=True, pattern_last=True)
get_act_patch_block_every = _every(
    "get_act_patch_block_every", (get_act_patch_resid_pre, get_act_patch_attn_out, get_act_patch_mlp_out),
    "resid_pre, attn_out and mlp_out by position: ``[3, n_layers, pos]``.", pad=False)
