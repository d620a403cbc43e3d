"""The activations a forward captured, by hook name (:class:`ActivationCache`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Union

import numpy as np

from . import utils
from .arrays import _np, _wrap

if TYPE_CHECKING:
    from .hooked_model import HookedModel


class ActivationCache:
    """Captured activations by hook name: ``cache["blocks.0.attn.hook_pattern"]``,
    ``cache["pattern", 0]`` (negative layers count from the end), ``keys()``, ``items()``,
    ``stack_activation("pattern")``, ``remove_batch_dim()``. Values are numpy arrays that share
    the engine's memory (no copy); ``torch.from_numpy`` works on them."""

    def __init__(self, cache: Dict[str, np.ndarray], n_layers: int, has_batch_dim: bool = True,
                 model: Optional["HookedModel"] = None):
        from .hooked_model import HookedModel  # (imported here: hooked_model imports this module)

        if isinstance(n_layers, HookedModel):  # TransformerLens's ActivationCache(cache_dict, model)
            model, n_layers = n_layers, n_layers.cfg.n_layers
        self.cache_dict = cache
        self.n_layers = n_layers
        self.has_batch_dim = has_batch_dim
        self.model = model

    def _name(self, key: Any) -> str:
        """The hook name ``key`` means, as TransformerLens's ``ActivationCache.__getitem__`` reads
        it: a name in the cache; a short name through ``utils.get_act_name`` (``"embed"``,
        ``"scale"``: ``ln_final``'s, ``"z3"``); a tuple ``(name, layer[, layer_type])`` with a
        negative layer counted from the end (``("attn", 5)``: the pattern, ``("scale", 1,
        "ln1")``). An unknown name raises a KeyError naming the close ones."""
        if isinstance(key, str):
            if key in self.cache_dict:
                return key
            return self._act_name(key, (key,))
        if isinstance(key, tuple) and 2 <= len(key) <= 3 and isinstance(key[0], str):
            kind, layer, *rest = key
            if layer is not None:
                if not -self.n_layers <= int(layer) < self.n_layers:
                    raise KeyError(f"layer {layer} is out of range: the model has {self.n_layers} layers")
                layer = int(layer) % self.n_layers
            return self._act_name(key, (kind, layer, *rest))
        raise KeyError(f"{key!r}: use a hook name, or (name, layer[, layer_type]) as in TransformerLens")

    def _act_name(self, key: Any, args: tuple) -> str:
        try:
            return utils.get_act_name(*args)
        except ValueError as e:
            raise KeyError(f"{key!r}: {e}") from None

    def __getitem__(self, key: Any) -> np.ndarray:
        name = self._name(key)
        try:
            return _wrap(self.cache_dict[name])
        except KeyError:
            import difflib
            close = difflib.get_close_matches(name, list(self.cache_dict), n=4, cutoff=0.6)
            hint = f"; close ones: {close}" if close else f"; captured: {list(self.cache_dict)[:6]}..."
            raise KeyError(f"{name} is not in the cache (not captured: names_filter, or no such hook){hint}") from None

    def __contains__(self, key: Any) -> bool:
        try:
            return self._name(key) in self.cache_dict
        except KeyError:
            return False

    def __len__(self) -> int:
        return len(self.cache_dict)

    def __iter__(self) -> Iterator[str]:
        return iter(self.cache_dict)

    def keys(self):
        return self.cache_dict.keys()

    def values(self):
        return [_wrap(v) for v in self.cache_dict.values()]

    def items(self):
        return [(k, _wrap(v)) for k, v in self.cache_dict.items()]

    def stack_activation(self, kind: str, layer: int = -1) -> np.ndarray:
        """The activation of every layer up to `layer` (exclusive, -1 = all), stacked on a new
        first axis: ``[layers, ...]`` (a copy)."""
        top = self.n_layers if layer == -1 else layer
        return _wrap(np.stack([_np(self[kind, l]) for l in range(top)]))

    def remove_batch_dim(self) -> "ActivationCache":
        """Drops the leading batch axis of 1 from every array (views, no copy), in place."""
        if self.has_batch_dim:
            self.cache_dict = {k: v[0] for k, v in self.cache_dict.items()}
            self.has_batch_dim = False
        return self

    # direct logit attribution, as TransformerLens's cache methods (see docs/commands/interventions.md)
    def _get(self, name: str) -> np.ndarray:
        """The array with a batch axis, or a KeyError saying which hook to capture."""
        if name not in self.cache_dict:
            raise KeyError(f"{name} was not captured; run_with_cache with names_filter=None (or including it) first")
        a = self.cache_dict[name]
        return a if self.has_batch_dim else a[np.newaxis]

    def _out(self, stack: np.ndarray, labels: List[str], return_labels: bool):
        stack = _wrap(stack if self.has_batch_dim else stack[:, 0])
        return (stack, labels) if return_labels else stack

    def _need_model(self) -> "HookedModel":
        if self.model is None:
            raise ValueError("this cache has no model: it comes from run_with_cache, which sets it")
        return self.model

    @staticmethod
    def _pos(a: np.ndarray, pos_slice: Any, dim: int = -2) -> np.ndarray:
        """``a`` sliced on its position axis ``dim`` as TransformerLens's ``Slice`` does: an int
        drops the axis, a tuple is ``slice(*t)``, a list or array picks those positions."""
        idx = [slice(None)] * a.ndim
        idx[dim] = utils.tl_slice(pos_slice)
        return a[tuple(idx)]

    def _layer(self, layer: Optional[int], what: str) -> int:
        """TransformerLens's ``layer``: ``None`` or -1 mean ``n_layers`` (the stream before the
        unembedding); otherwise ``0..n_layers``."""
        if layer is None or layer == -1:
            return self.n_layers
        if not 0 <= int(layer) <= self.n_layers:
            raise ValueError(f"{what}: layer={layer} is out of range: 0..{self.n_layers}, or None / -1 for all of them")
        return int(layer)

    def accumulated_resid(self, layer: Optional[int] = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice: Any = None, mlp_input: bool = False, return_labels: bool = False):
        """TransformerLens's ``accumulated_resid``: the residual stream before each layer up to and
        including ``layer`` (``None``/-1: every layer and the final one), stacked: ``[components,
        batch, pos, d_model]``; labels ``"0_pre"``, ``"0_mid"``, ..., ``"final_post"``. With
        ``apply_ln``, through ``layer``'s norm with the run's scale, or, for the final layer, each
        component through the final norm with its own statistics (TL's logit lens)."""
        top = self._layer(layer, "accumulated_resid")
        parts, labels = [], []
        for l in range(top + 1):
            if l == self.n_layers:
                parts.append(self._get(f"blocks.{self.n_layers - 1}.hook_resid_post"))
                labels.append("final_post")
                continue
            parts.append(self._get(f"blocks.{l}.hook_resid_pre"))
            labels.append(f"{l}_pre")
            if (incl_mid and l < top) or (mlp_input and l == top):
                parts.append(self._get(f"blocks.{l}.hook_resid_mid"))
                labels.append(f"{l}_mid")
        stack = np.stack([self._pos(p, pos_slice) for p in parts])
        if apply_ln:
            stack = _np(self.apply_ln_to_stack(stack, top, mlp_input=mlp_input, pos_slice=pos_slice,
                                               recompute_ln=top == self.n_layers))
        return self._out(stack, labels, return_labels)

    def decompose_resid(self, layer: Optional[int] = None, mlp_input: bool = False, mode: str = "all",
                        apply_ln: bool = False, pos_slice: Any = None, incl_embeds: bool = True,
                        return_labels: bool = False):
        """TransformerLens's ``decompose_resid``: the residual stream before ``layer`` (``None``/-1:
        the stream before the unembedding) as the sum of its parts: the embeddings (``hook_embed``
        and ``hook_pos_embed`` where they are separate, else ``blocks.0.hook_resid_pre``: Gemma's
        scaled embedding), then each layer's ``attn_out`` and ``mlp_out``; ``[components, batch,
        pos, d_model]``. ``mlp_input``: the input of ``layer``'s MLP (its ``attn_out`` too)."""
        if mode not in ("all", "attn", "mlp"):
            raise ValueError(f"mode={mode!r}: use 'all', 'attn' or 'mlp'")
        top = self._layer(layer, "decompose_resid")
        if mlp_input and top == self.n_layers:
            raise ValueError(f"mlp_input=True needs a layer below {self.n_layers} (the final norm has no MLP)")
        parts, labels = [], []
        if incl_embeds:
            if "hook_pos_embed" in self.cache_dict:
                parts += [self._get("hook_embed"), self._get("hook_pos_embed")]
                labels += ["embed", "pos_embed"]
            else:
                parts.append(self._get("blocks.0.hook_resid_pre"))
                labels.append("embed")
        for l in range(top):
            if mode in ("all", "attn"):
                parts.append(self._get(f"blocks.{l}.hook_attn_out"))
                labels.append(f"{l}_attn_out")
            if mode in ("all", "mlp"):
                parts.append(self._get(f"blocks.{l}.hook_mlp_out"))
                labels.append(f"{l}_mlp_out")
        if mlp_input and mode in ("all", "attn"):
            parts.append(self._get(f"blocks.{top}.hook_attn_out"))
            labels.append(f"{top}_attn_out")
        if not parts:
            raise ValueError("decompose_resid has no component to stack: incl_embeds=False and no layer below `layer`")
        stack = np.stack([self._pos(p, pos_slice) for p in parts])
        if apply_ln:
            stack = _np(self.apply_ln_to_stack(stack, top, mlp_input=mlp_input, pos_slice=pos_slice))
        return self._out(stack, labels, return_labels)

    def _head_results(self, l: int) -> np.ndarray:
        """Layer ``l``'s per-head outputs ``[batch, pos, head, d_model]``: the cached
        ``hook_result`` (TransformerLens reads it first: in a cache of gradients it is the gradient
        at each head's output), or, where it was not captured, ``hook_z`` through ``W_O``."""
        name = f"blocks.{l}.attn.hook_result"
        if name in self.cache_dict:
            res = self._get(name)
            if res.ndim != 4:
                raise ValueError(f"{name} has shape {tuple(res.shape)}: stack_head_results needs one output per "
                                 "head, [batch, pos, head, d_model] (drop it from the cache to compute it from hook_z)")
            return res
        z = self._get(f"blocks.{l}.attn.hook_z")  # [batch, pos, head, d_head]
        b, n, h, _dh = z.shape
        res, _bias = self._need_model()._m.head_results(l, np.ascontiguousarray(z, dtype=np.float32).reshape(-1), b * n)
        return np.asarray(res).reshape(b, n, h, -1)

    def stack_head_results(self, layer: int = -1, return_labels: bool = False, incl_remainder: bool = False,
                           pos_slice: Any = None, apply_ln: bool = False):
        """TransformerLens's ``stack_head_results``: each head's output (``hook_result``: its ``z``
        through its slice of ``W_O``, without the bias), for every head of the layers before
        ``layer`` (``None``/-1: all): ``[layers·heads, batch, pos, d_model]``, labels ``"L{l}H{h}"``.
        As in TL, the cache's own ``hook_result`` where it holds one (a gradient cache's is the
        gradient at each head's output: ``hook_z``'s gradient through ``W_O`` is not that), else
        computed from the captured ``hook_z``; with ``incl_remainder``, one more component: the
        rest of the residual stream before ``layer``."""
        top = self._layer(layer, "stack_head_results")
        parts, labels = [], []
        for l in range(top):
            res = self._head_results(l)  # [batch, pos, head, d_model]
            for hh in range(res.shape[2]):
                parts.append(self._pos(res[:, :, hh], pos_slice))
                labels.append(f"L{l}H{hh}")
        if incl_remainder:
            final = self._pos(self._get(f"blocks.{top - 1}.hook_resid_post") if top > 0
                              else self._get("blocks.0.hook_resid_pre"), pos_slice)
            rest = final - (np.sum(parts, axis=0) if parts else 0)
            parts.append(rest)
            labels.append("remainder")
        if parts:
            stack = np.stack(parts)
        else:
            stack = np.zeros((0,) + self._pos(self._get("blocks.0.hook_resid_pre"), pos_slice).shape, np.float32)
        if apply_ln:
            stack = _np(self.apply_ln_to_stack(stack, top, pos_slice=pos_slice))
        return self._out(stack, labels, return_labels)

    def apply_ln_to_stack(self, residual_stack: np.ndarray, layer: Optional[int] = None, mlp_input: bool = False,
                          pos_slice: Any = None, batch_slice: Any = None, has_batch_dim: bool = True,
                          recompute_ln: bool = False) -> np.ndarray:
        """TransformerLens's ``apply_ln_to_stack``: each component through the norm before ``layer``
        (``None``/-1/``n_layers``: the final norm; else ``ln1``, ``ln2`` with ``mlp_input``) with
        the scale of the actual run (frozen: so the components still add up): LayerNorm centres
        each one, and both divide by the run's scale, which ``pos_slice`` slices (the stack is
        taken as already sliced, as in TL). The norm's weight is not applied (TL folds it into
        the next weights: ``fold_ln``, ``from_pretrained``'s default; :meth:`logit_attrs` applies it
        otherwise). ``recompute_ln`` with the final norm: each component through the whole final
        norm, weight included, with its own statistics (TL's logit lens)."""
        m = self._need_model()
        top = self._layer(layer, "apply_ln_to_stack")
        w, b, eps = m._m.final_norm()
        stack = _np(residual_stack).astype(np.float64)
        if has_batch_dim and batch_slice is not None:
            stack = self._pos(stack, batch_slice, dim=1)
        if recompute_ln and top == self.n_layers:
            if b is not None:
                stack = stack - stack.mean(-1, keepdims=True)
            stack = stack / np.sqrt((stack ** 2).mean(-1, keepdims=True) + eps) * m._weight("ln_final.w")
            if b is not None:
                stack = stack + m._weight("ln_final.b")
            return _wrap(stack.astype(np.float32))
        if top == self.n_layers:
            final = self._pos(self._get(f"blocks.{self.n_layers - 1}.hook_resid_post"), pos_slice).astype(np.float64)
            if b is not None:
                final = final - final.mean(-1, keepdims=True)
            scale = np.sqrt((final ** 2).mean(-1, keepdims=True) + eps)  # [batch, (pos,) 1]
        else:
            if mlp_input and top == self.n_layers:
                raise ValueError("mlp_input=True needs a layer below n_layers")
            name = f"blocks.{top}.ln{2 if mlp_input else 1}.hook_scale"
            scale = self._pos(self._get(name), pos_slice).astype(np.float64)
        if batch_slice is not None:
            scale = self._pos(scale, batch_slice, dim=0)
        if not has_batch_dim:
            scale = scale[0]
        if b is not None:
            stack = stack - stack.mean(-1, keepdims=True)
        return _wrap((stack / scale).astype(np.float32))

    def logit_attrs(self, residual_stack: np.ndarray, tokens: Union[int, str], incorrect_tokens: Optional[Union[int, str]] = None,
                    pos_slice: Any = None, batch_slice: Any = None, has_batch_dim: bool = True) -> np.ndarray:
        """TransformerLens's ``logit_attrs``: each component's direct contribution to the logit of
        ``tokens`` (minus that of ``incorrect_tokens``): the stack through the final norm with the
        run's scale (:meth:`apply_ln_to_stack`, ``pos_slice`` slicing the scale), dotted with the
        token's direction ``W_U[:, token]`` times the final norm's weight (ones once folded:
        ``fold_ln``, where TL's recipe needs it; unprocessed, the weight is applied here, so the
        components add up to the logit either way). Shape: the stack's without ``d_model``."""
        m = self._need_model()
        direction = self._direction(m, tokens)
        if incorrect_tokens is not None:
            direction = direction - self._direction(m, incorrect_tokens)
        scaled = _np(self.apply_ln_to_stack(residual_stack, -1, pos_slice=pos_slice, batch_slice=batch_slice,
                                            has_batch_dim=has_batch_dim)).astype(np.float64)
        return _wrap((scaled @ direction).astype(np.float32))

    @staticmethod
    def _direction(m: "HookedModel", token: Union[int, str]) -> np.ndarray:
        """``W_U[:, token]`` times the final norm's weight, float64 ``[d_model]``."""
        tid = m.to_single_token(token) if isinstance(token, str) else int(token)
        u = m._weight("W_U")[:, tid].astype(np.float64)
        return u * m._weight("ln_final.w").astype(np.float64)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self.cache_dict)} tensors: {list(self.cache_dict)[:4]}{'...' if len(self.cache_dict) > 4 else ''})"
