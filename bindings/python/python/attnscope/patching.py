"""TransformerLens's ``transformer_lens.patching`` (#59): activation patching sweeps with TL's
names, signatures, index order and output shapes, computed as TL computes them: one
``model.run_with_hooks(corrupted_tokens, fwd_hooks=[(name, hook)])`` per index, the hook copying
the clean cache's slice into the corrupted activation, and ``patching_metric(logits)`` stored at
that index.

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
                             **kwargs: Any):
    """TL's ``generic_activation_patch``: for each index (row of ``index_df``, or every
    combination of ``index_axis_names``' ranges, first axis the layer), one corrupted run with
    ``patch_setter(corrupted_activation, index, clean_activation)`` at
    ``get_act_name(activation_name, layer)``, and the metric of its logits. ``index_df`` gives a
    flat result (one value per row); otherwise one axis per index axis.

    ``skip_noops`` (attnscope's): an index whose patch leaves the corrupted activation bit for bit
    as it is (the clean and corrupted runs agree there: positions before the first token that
    differs, for one) is not run again; its value is the metric of the corrupted run's logits,
    which that forward would give bit for bit (the engine is deterministic). TL runs it; the
    values are the same (test_patching.py checks both ways)."""
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


def _every(sweeps, model, corrupted_tokens, clean_cache, metric, kwargs, pad: bool, pattern_last: bool = False):
    outs = [np.asarray(utils.to_numpy(f(model, corrupted_tokens, clean_cache, metric, **kwargs))) for f in sweeps]
    if pad:
        n_heads = outs[0].shape[-1]
        outs[2], outs[3] = _pad_heads(outs[2], n_heads), _pad_heads(outs[3], n_heads)
    if pattern_last:  # [layer, head, dest_pos] -> [layer, pos, head], as TL rearranges it
        outs[4] = np.swapaxes(outs[4], -1, -2)
    return _wrap(np.ascontiguousarray(np.stack(outs)))


def get_act_patch_attn_head_all_pos_every(model, corrupted_tokens, clean_cache, metric, **kwargs):
    """Every head at every position for each of out (z), q, k, v, pattern: ``[5, n_layers, n_heads]``."""
    sweeps = (get_act_patch_attn_head_out_all_pos, get_act_patch_attn_head_q_all_pos, get_act_patch_attn_head_k_all_pos,
              get_act_patch_attn_head_v_all_pos, get_act_patch_attn_head_pattern_all_pos)
    return _every(sweeps, model, corrupted_tokens, clean_cache, metric, kwargs, pad=True)


def get_act_patch_attn_head_by_pos_every(model, corrupted_tokens, clean_cache, metric, **kwargs):
    """Every head by position for each of out (z), q, k, v, pattern: ``[5, n_layers, pos, n_heads]``."""
    sweeps = (get_act_patch_attn_head_out_by_pos, get_act_patch_attn_head_q_by_pos, get_act_patch_attn_head_k_by_pos,
              get_act_patch_attn_head_v_by_pos, get_act_patch_attn_head_pattern_by_pos)
    return _every(sweeps, model, corrupted_tokens, clean_cache, metric, kwargs, pad=True, pattern_last=True)


def get_act_patch_block_every(model, corrupted_tokens, clean_cache, metric, **kwargs):
    """resid_pre, attn_out and mlp_out by position: ``[3, n_layers, pos]``."""
    sweeps = (get_act_patch_resid_pre, get_act_patch_attn_out, get_act_patch_mlp_out)
    return _every(sweeps, model, corrupted_tokens, clean_cache, metric, kwargs, pad=False)
