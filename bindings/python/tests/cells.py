"""The one comparison the Python tests use against a reference (the Python side of tests/common's
``assert_cells``): ``np.testing``-style, but it fails on a NaN or an infinity on either side, on a
shape that differs (no broadcasting: a missing row or column is a failure, not a smaller array
compared), and on a mapping whose keys differ; the message names the worst cell and both values,
and the worst difference is printed (``pytest -s`` shows the measured figure) and returned.

    assert_cells("qwen: every pattern", got, want, atol=1e-4)
    assert_cells("sinks", {l: s for ...}, {l: w for ...}, atol=1e-4)
    assert_cells("scores", got, want, rel_max=1e-3)   # within 1e-3 of max |want|
"""

import numpy as np


def _as_cells(label, side, v):
    if isinstance(v, dict):
        keys = sorted(v, key=repr)
        return keys, np.array([float(v[k]) if v[k] is not None else np.nan for k in keys], dtype=np.float64)
    try:
        a = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise AssertionError(f"{label}: {side} is not an array of numbers ({e})") from None
    return None, a


def assert_cells(label, got, want, atol=None, rel_max=None):
    """Compares ``got`` with the reference ``want`` cell by cell, within ``atol`` (absolute) or
    ``rel_max`` (relative to the reference's largest |value|); exactly one of the two."""
    assert (atol is None) != (rel_max is None), f"{label}: give atol or rel_max"
    gk, g = _as_cells(label, "the result", got)
    wk, w = _as_cells(label, "the reference", want)
    if gk is not None or wk is not None:
        assert gk is not None and wk is not None, f"{label}: a mapping against an array"
        missing = [k for k in wk if k not in set(gk)]
        extra = [k for k in gk if k not in set(wk)]
        assert not missing, f"{label}: {len(missing)} of {len(wk)} reference cells missing, first {missing[0]!r}"
        assert not extra, f"{label}: cell {extra[0]!r} is not in the reference"
        names = wk
    else:
        assert g.shape == w.shape, f"{label}: shape {g.shape}, the reference's {w.shape}"
        names = None
    assert w.size > 0, f"{label}: the reference has no cells"

    def cell(i):
        return names[i] if names is not None else tuple(int(x) for x in np.unravel_index(i, w.shape))

    bad = np.flatnonzero(~np.isfinite(w))
    assert bad.size == 0, f"{label}: the reference's cell {cell(bad[0])} is {w.flat[bad[0]]}"
    bad = np.flatnonzero(~np.isfinite(g))
    assert bad.size == 0, f"{label}: cell {cell(bad[0])} is {g.flat[bad[0]]}"
    d = np.abs(g - w)
    at = int(np.argmax(d))
    worst = float(d.flat[at])
    scale = float(np.abs(w).max())
    tol = atol if atol is not None else rel_max * scale
    how = f"{tol:.1e}" if atol is not None else f"{tol:.1e} = {rel_max:.0e} x max |ref| {scale:.3e}"
    print(f"{label}: {w.size} cells, max |difference| {worst:.2e} at {cell(at)} (bound {how})")
    assert worst <= tol, (
        f"{label}: max |difference| {worst:.3e} > bound {tol:.2e} at cell {cell(at)} "
        f"(got {g.flat[at]}, want {w.flat[at]})"
    )
    return worst
