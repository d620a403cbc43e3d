"""A :class:`HookedModel`'s weights in TransformerLens's names and shapes (``W_Q`` ... ``W_U``,
``model.blocks[l].attn.W_Q``, the OV and QK circuits), processed as the load asked."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

import numpy as np

from . import processing
from .arrays import _wrap
from .factored import FactoredMatrix

if TYPE_CHECKING:
    from .hooked_model import HookedModel


class _Part:
    """A part of the model whose attributes are TransformerLens's weights of that part
    (``model.blocks[3].attn.W_Q``, ``model.unembed.W_U``, ``model.ln_final.w``)."""

    def __init__(self, model: "HookedModel", names: Dict[str, str], layer: Optional[int] = None):
        self._model, self._names, self._layer = model, names, layer

    def __getattr__(self, attr: str) -> Any:
        names = self.__dict__.get("_names", {})
        if attr not in names:
            raise AttributeError(f"{attr}: this part has {sorted(names)}")
        a = self._model._weight(names[attr])
        return _wrap(a if self._layer is None else a[self._layer])

    def __dir__(self):
        return sorted(self._names)


class _Embed(_Part):
    """``model.embed``: TransformerLens's embedding part (``model.embed.W_E``) that, called on
    texts, gives their sentence embeddings (:meth:`HookedModel.embed_sentences`)."""

    def __call__(self, texts, normalize: Optional[bool] = None) -> np.ndarray:
        """``model.embed(texts, normalize=None)``: :meth:`HookedModel.embed_sentences`."""
        return self._model.embed_sentences(texts, normalize)


class _Block:
    """``model.blocks[l]``: its weights as ``.attn.W_Q``, ``.attn._W_K`` (GQA: one per KV head),
    ``.mlp.W_in``, ``.ln1.w``, ... (TransformerLens's names and shapes, without the layer axis)."""

    def __init__(self, model: "HookedModel", layer: int):
        attn = {k: k for k in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "_W_K", "_W_V", "_b_K", "_b_V")}
        self.attn = _Part(model, attn, layer)
        self.mlp = _Part(model, {k: k for k in ("W_in", "W_gate", "W_out", "b_in", "b_out")}, layer)
        self.ln1 = _Part(model, {"w": "ln1.w", "b": "ln1.b"}, layer)
        self.ln2 = _Part(model, {"w": "ln2.w", "b": "ln2.b"}, layer)
        self.layer = layer

    def __repr__(self) -> str:
        return f"Block({self.layer})"


class WeightsMixin:
    """:class:`HookedModel`'s weights in TransformerLens's shapes (processed as the load asked: see
    ``from_pretrained``)."""

    def _weight(self, name: str) -> np.ndarray:
        """The weight ``name`` for every layer, made from the engine's weights on first use and
        kept (float32 numpy; a copy: editing it does not change the model)."""
        if name not in self._weights:
            raw = self._make_weight(name)
            steps = self.facts.get("processing") or {}
            if any(steps.values()):
                raw = processing.processed_weight(name, raw, steps, self._make_weight)
            self._weights[name] = raw
        return self._weights[name]

    def _make_weight(self, name: str) -> np.ndarray:
        c = self.cfg
        L, H, G, dh, dm, ff = c.n_layers, c.n_heads, c.n_key_value_heads, c.d_head, c.d_model, c.d_mlp
        rep = H // G
        if name in ("W_K", "W_V", "b_K", "b_V"):
            # TransformerLens repeats each KV set for the query heads that share it (repeat_interleave)
            return np.repeat(self._weight("_" + name), rep, axis=1)
        if name in ("W_Q", "_W_K", "_W_V", "b_Q", "_b_K", "_b_V"):
            out = []
            for l in range(L):
                w, b = self._m.projection(l, "qkv")  # [(H + 2G)·dh, dm], Hugging Face's rows
                lo, n = {"Q": (0, H), "K": (H * dh, G), "V": ((H + G) * dh, G)}[name[-1]]
                if name.lstrip("_").startswith("W"):
                    out.append(w[lo:lo + n * dh].reshape(n, dh, dm).transpose(0, 2, 1))
                else:
                    out.append(np.zeros((n, dh), np.float32) if b is None else b[lo:lo + n * dh].reshape(n, dh))
            return np.ascontiguousarray(np.stack(out), dtype=np.float32)
        if name in ("W_O", "b_O"):
            out = []
            for l in range(L):
                w, b = self._m.projection(l, "o")  # [dm, H·dh]
                if name == "W_O":
                    out.append(w.reshape(dm, H, dh).transpose(1, 2, 0))
                else:
                    out.append(np.zeros(dm, np.float32) if b is None else b)
            return np.ascontiguousarray(np.stack(out), dtype=np.float32)
        if name in ("W_in", "W_gate", "b_in"):
            out = []
            for l in range(L):
                w, b = self._m.projection(l, "gate_up")  # [gate; up] (2·ff rows), or c_fc (ff rows)
                gated = w.shape[0] == 2 * ff
                if name == "W_gate" and not gated:
                    raise AttributeError(f"{c.model_name}'s MLP has no gate (W_gate is for gated MLPs)")
                lo = 0 if name == "W_gate" or not gated else ff
                if name == "b_in":
                    out.append(np.zeros(ff, np.float32) if b is None else b[lo:lo + ff])
                else:
                    out.append(w[lo:lo + ff].T)
            return np.ascontiguousarray(np.stack(out), dtype=np.float32)
        if name in ("W_out", "b_out"):
            out = []
            for l in range(L):
                w, b = self._m.projection(l, "down")  # [dm, ff]
                out.append(w.T if name == "W_out" else (np.zeros(dm, np.float32) if b is None else b))
            return np.ascontiguousarray(np.stack(out), dtype=np.float32)
        if name in ("ln1.w", "ln1.b", "ln2.w", "ln2.b"):
            idx = {"ln1.w": 0, "ln1.b": 1, "ln2.w": 2, "ln2.b": 3}[name]
            got = [self._m.layer_norms(l)[idx] for l in range(L)]
            if got[0] is None:
                raise AttributeError(f"{name}: {c.model_name}'s norms are RMSNorms, without a bias")
            return np.stack([np.asarray(g, dtype=np.float32) for g in got])
        if name in ("ln_final.w", "ln_final.b"):
            w, b, _ = self._m.final_norm()
            if name.endswith("b") and b is None:
                raise AttributeError(f"ln_final.b: {c.model_name}'s final norm is an RMSNorm, without a bias")
            return np.array(w if name.endswith("w") else b, dtype=np.float32)
        if name == "W_E":
            return self._m.embedding_matrix()
        if name == "W_pos":
            p = self._m.position_embeddings()
            if p is None:
                raise AttributeError(f"W_pos: {c.model_name} has no learned positions (it rotates q and k: RoPE)")
            return p
        if name == "W_U":
            return np.ascontiguousarray(self._m.unembed_matrix().T)
        if name == "b_U":
            return np.zeros(c.d_vocab, np.float32)
        raise AttributeError(name)

    @property
    def OV(self) -> FactoredMatrix:
        """TransformerLens's OV circuits: ``FactoredMatrix(W_V, W_O)``, ``[layer, head, d_model, d_model]``."""
        return FactoredMatrix(self._weight("W_V"), self._weight("W_O"))

    @property
    def QK(self) -> FactoredMatrix:
        """TransformerLens's QK circuits: ``FactoredMatrix(W_Q, W_Kᵀ)``, ``[layer, head, d_model, d_model]``
        (before RoPE: the positions' rotation is not in it, as in TransformerLens)."""
        return FactoredMatrix(self._weight("W_Q"), np.swapaxes(self._weight("W_K"), -1, -2))

    W_Q = property(lambda self: _wrap(self._weight("W_Q")),
                   doc="``[layer, head, d_model, d_head]``: ``ln1``'s output (with its weight) @ W_Q[l] + b_Q[l] is ``hook_q``; rows of q and k in Hugging Face's order for every format")
    W_K = property(lambda self: _wrap(self._weight("W_K")),
                   doc="``[layer, head, d_model, d_head]``, each KV set repeated for the query heads that share it (TransformerLens's ``repeat_interleave``); ``blocks[l].attn._W_K`` has one per KV head")
    W_V = property(lambda self: _wrap(self._weight("W_V")), doc="``[layer, head, d_model, d_head]`` (repeated as W_K)")
    W_O = property(lambda self: _wrap(self._weight("W_O")), doc="``[layer, head, d_head, d_model]``")
    b_Q = property(lambda self: _wrap(self._weight("b_Q")), doc="``[layer, head, d_head]`` (zeros without a bias)")
    b_K = property(lambda self: _wrap(self._weight("b_K")), doc="``[layer, head, d_head]`` (repeated as W_K)")
    b_V = property(lambda self: _wrap(self._weight("b_V")), doc="``[layer, head, d_head]`` (repeated as W_K)")
    b_O = property(lambda self: _wrap(self._weight("b_O")), doc="``[layer, d_model]``")
    W_in = property(lambda self: _wrap(self._weight("W_in")), doc="``[layer, d_model, d_mlp]``: the up projection (GPT-2: c_fc)")
    W_gate = property(lambda self: _wrap(self._weight("W_gate")), doc="``[layer, d_model, d_mlp]``: the gate (gated MLPs)")
    W_out = property(lambda self: _wrap(self._weight("W_out")), doc="``[layer, d_mlp, d_model]``")
    b_in = property(lambda self: _wrap(self._weight("b_in")), doc="``[layer, d_mlp]``")
    b_out = property(lambda self: _wrap(self._weight("b_out")), doc="``[layer, d_model]``")
    W_E = property(lambda self: _wrap(self._weight("W_E")),
                   doc="``[d_vocab, d_model]``: what ``hook_embed`` adds (Gemma's √d_model folded in, as TransformerLens does)")
    W_pos = property(lambda self: _wrap(self._weight("W_pos")), doc="``[n_ctx, d_model]``: learned positions (GPT-2 only)")
    W_U = property(lambda self: _wrap(self._weight("W_U")), doc="``[d_model, d_vocab]``")
    b_U = property(lambda self: _wrap(self._weight("b_U")), doc="``[d_vocab]`` (zeros: no output bias)")
