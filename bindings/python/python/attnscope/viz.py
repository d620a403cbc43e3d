"""Attention views for notebooks: the page of ``attnscope view``, self-contained (no CDN, no
require.js), shown inline through ``_repr_html_`` in an isolated iframe with a unique id, so any
number of views live in one notebook; ``.save("x.html")`` writes the page itself."""

from __future__ import annotations

import html
import itertools
import os
import sys
from typing import Any, Dict, Optional, Sequence, Union

import numpy as np

from . import _native
from .inputs import as_array

_ids = itertools.count()


class View:
    """An attention view. ``.html`` is the whole page."""

    def __init__(self, page: str, height: int = 760):
        self.html = page
        self.height = height
        self.id = f"attnscope-view-{os.getpid()}-{next(_ids)}"

    def _repr_html_(self) -> str:
        return (
            f'<iframe id="{self.id}" class="attnscope-view" srcdoc="{html.escape(self.html, quote=True)}" '
            f'style="width:100%;height:{self.height}px;border:1px solid #ddd;border-radius:4px" '
            f'sandbox="allow-scripts allow-downloads"></iframe>'
        )

    def save(self, path: Union[str, os.PathLike], overwrite: bool = False) -> str:
        """Writes the page (it opens offline in any browser); returns the path. An existing file
        is replaced only with ``overwrite=True`` (else ``FileExistsError``); the page goes to a
        temporary file beside ``path``, renamed into place when whole."""
        path = os.fspath(path)
        try:
            return _native.write_new_file(path, self.html, overwrite)
        except FileExistsError:
            raise FileExistsError(f"{path} already exists; pass overwrite=True to replace it") from None

    def __repr__(self) -> str:
        return f"View({len(self.html) / 1e6:.1f} MB page; show it in a notebook or .save('view.html'))"


def attention_heads(attention, tokens: Sequence[str], title: Optional[str] = None,
                    sentence_b_start: Optional[int] = None, pair: str = "all",
                    attention_head_names: Optional[Sequence[str]] = None, **circuitsvis: Any) -> View:
    """CircuitsVis's ``attention_heads(attention, tokens)``: ``attention`` is ``[heads, n, n]``
    (one layer) or ``[layers, heads, n, n]``, a numpy array or anything ``np.asarray`` takes
    (a torch tensor on the CPU), rows summing to 1; ``tokens`` the n token texts.

    For an encoder's sentence pair (bidirectional patterns, e.g. ``run_with_cache(("A", "B"))``'s),
    ``sentence_b_start`` (BertViz's: the first position of the second text, e.g.
    ``list(model.to_token_types(("A", "B"))[0]).index(1)``) turns on the head view's selector,
    as ``attnscope view --pair`` has it, and ``pair`` picks the selection shown first: ``"all"``,
    ``"a->b"`` (A's queries, B's keys), ``"b->a"``, ``"a->a"`` or ``"b->b"``."""
    _refuse_styling("attention_heads", circuitsvis)
    if attention_head_names is not None:
        title = _head_title(attention, attention_head_names) if title is None else title
    a = as_array(attention, "attention").astype(np.float32, copy=False)
    if a.ndim == 3:
        a = a[np.newaxis]
    if a.ndim != 4:
        raise ValueError(f"attention must be [heads, n, n] or [layers, heads, n, n], got shape {a.shape}")
    shape = [int(x) for x in a.shape]
    if sentence_b_start is not None:
        sentence_b_start = int(sentence_b_start)
        if sentence_b_start < 0:
            raise ValueError(f"sentence_b_start={sentence_b_start} is negative: it is the first position of the second text")
    page = _native.pattern_page(np.ascontiguousarray(a).reshape(-1), shape, [str(t) for t in tokens],
                                title or f"attention · {shape[1]} heads · {shape[2]} tokens", sentence_b_start, str(pair))
    return View(page)


def _refuse_styling(what: str, given: Dict[str, Any]) -> None:
    """CircuitsVis's colour and range arguments (``max_value``, ``min_value``, ``negative_color``,
    ``positive_color``, ``mask_upper_tri``): refused when given, naming them."""
    known = {"max_value", "min_value", "negative_color", "positive_color", "mask_upper_tri"}
    unknown = sorted(set(given) - known)
    if unknown:
        raise TypeError(f"{what} got unexpected arguments {unknown}")
    set_ = sorted(k for k, v in given.items() if v is not None)
    if set_:
        raise NotImplementedError(f"{what}: {', '.join(set_)} (CircuitsVis's colour and range arguments) are not "
                                  "supported; the view colours each head's weights from 0 to 1")


def _head_title(attention: Any, names: Sequence[str]) -> str:
    names = [str(n) for n in names]
    a = as_array(attention, "attention")
    heads = int(a.shape[-3]) if a.ndim >= 3 else 1
    if len(names) != heads:
        raise ValueError(f"attention_head_names has {len(names)} names for {heads} heads")
    return "attention · " + ", ".join(names)


def attention_patterns(tokens: Sequence[str], attention, attention_head_names: Optional[Sequence[str]] = None,
                       **circuitsvis: Any) -> View:
    """CircuitsVis's ``attention_patterns(tokens, attention)`` (its argument order: the tokens
    first): ``attention`` ``[heads, n, n]``, shown as :func:`attention_heads` shows it (each head's
    pattern, a token's attention on hover). ``attention_head_names`` (one per head) titles the
    view; CircuitsVis's colour and range arguments are refused when given."""
    _refuse_styling("attention_patterns", circuitsvis)
    title = None if attention_head_names is None else _head_title(attention, attention_head_names)
    return attention_heads(attention, tokens, title=title)


def attention_pattern(tokens: Sequence[str], attention, **circuitsvis: Any) -> View:
    """CircuitsVis's ``attention_pattern(tokens, attention)``: one head's pattern ``[n, n]``."""
    _refuse_styling("attention_pattern", circuitsvis)
    a = as_array(attention, "attention").astype(np.float32, copy=False)
    if a.ndim != 2:
        raise ValueError(f"attention_pattern shows one head's pattern [n, n], got shape {a.shape}; "
                         "attention_patterns takes [heads, n, n]")
    return attention_heads(a[np.newaxis], tokens)


# CircuitsVis's module layout: `import attnscope.viz as cv; cv.attention.attention_heads(...)`
attention = sys.modules[__name__]
