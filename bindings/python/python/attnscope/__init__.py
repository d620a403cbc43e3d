"""attnscope: see, compute and measure the attention inside real language models.

A TransformerLens-shaped API on a Rust engine: exact numbers (to 1e-4 of Hugging Face transformers),
GGUF and Hugging Face checkpoints, long inputs on a CPU, and no torch needed.

    import attnscope
    model = attnscope.HookedModel.from_pretrained("qwen2.5-coder-0.5b")
    logits, cache = model.run_with_cache("Hà Nội là thủ đô của Việt Nam.", names_filter="hook_pattern")
    cache["pattern", 0]        # numpy float32 [1, head, query, key]
    model.view("Hà Nội là thủ đô của Việt Nam.")   # the attention view, inline in a notebook
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _native
from . import viz
from . import utils
from . import processing
from . import hook_points
from . import inputs
from .inputs import token_arg as _tok
from .hook_points import HookPoint
from . import tokenizer as _tokenizer
from .factored import FactoredMatrix
from . import distributed  # Ray is imported only when distributed.corpus runs

__all__ = ["HookedModel", "CircuitResult", "FactoredMatrix", "ActivationCache", "Config", "HookPoint", "corpus", "corpus_merge", "HOOKS", "GLOBAL_HOOKS", "viz", "utils",
           "distributed", "set_array_type", "utilities", "__version__"]
__version__ = _native.__version__
# TransformerLens 3+'s module name for its utils (`from transformer_lens import utilities`)
utilities = utils
sys.modules[__name__ + ".utilities"] = utils

#: The hook suffixes the engine captures, in TransformerLens's names (`blocks.{l}.` + suffix).
HOOKS: Tuple[str, ...] = tuple(_native.hook_suffixes())
# the hooks outside the blocks, by their whole names: hook_embed, hook_pos_embed (GPT-2's learned
# positions only), ln_final.hook_scale and ln_final.hook_normalized
GLOBAL_HOOKS: Tuple[str, ...] = tuple(_native.global_hooks())

# short names accepted in cache["pattern", l] and stack_activation("pattern")
_SHORT = {h.rsplit(".", 1)[-1].replace("hook_", ""): h for h in HOOKS}
_SHORT.update({h.rsplit(".", 1)[-1]: h for h in HOOKS})

_ARRAY_TYPE = "auto"


def set_array_type(kind: str) -> None:
    """What results are: ``"numpy"`` arrays, ``"torch"`` tensors (``torch.from_numpy``: the same
    memory, no copy), or ``"auto"`` (the default): torch tensors once the program has imported
    torch, numpy arrays otherwise. Hook functions get their activation the same way."""
    global _ARRAY_TYPE
    if kind not in ("numpy", "torch", "auto"):
        raise ValueError(f"array type {kind!r}: use 'numpy', 'torch' or 'auto'")
    if kind == "torch":
        import torch  # noqa: F401  (fails here, with torch's own message, if it is missing)
    _ARRAY_TYPE = kind


def _wrap(a: Any) -> Any:
    """A numpy result as the array type in force (see :func:`set_array_type`)."""
    if a is None or not isinstance(a, np.ndarray):
        return a
    kind = _ARRAY_TYPE
    if kind == "auto":
        kind = "torch" if "torch" in sys.modules else "numpy"
    if kind == "torch":
        return sys.modules["torch"].from_numpy(a) if "torch" in sys.modules else __import__("torch").from_numpy(a)
    return a


def _np(a: Any) -> np.ndarray:
    """A numpy view of a result or an argument (a torch tensor through ``.numpy()``)."""
    return inputs.as_array(a)


def _token_array(x: Any) -> np.ndarray:
    """Token ids as a numpy array; rows of different lengths (which numpy cannot stack) refused
    with a message that says so, not numpy's."""
    try:
        return _np(x)
    except ValueError:
        if isinstance(x, (list, tuple)):
            lengths = [len(r) if hasattr(r, "__len__") else 1 for r in x]
            raise ValueError(f"token lists of different lengths {lengths}: a batch is rows of one length [b, n]; "
                             "pad them (to_tokens pads a list of texts) or run them one at a time") from None
        raise


NamesFilter = Union[None, str, Sequence[str], Callable[[str], bool]]
TextOrTokens = Union[str, Sequence[str], np.ndarray, Sequence[int]]


@dataclass(frozen=True)
class Config:
    """A model's dimensions, in TransformerLens's names."""

    model_name: str
    architecture: str
    n_layers: int
    n_heads: int
    n_key_value_heads: int
    d_head: int
    d_model: int
    d_mlp: int
    n_ctx: int
    d_vocab: int
    precision: str
    default_prepend_bos: bool
    pad_token_id: Optional[int] = None
    #: where the model runs (TransformerLens's ``cfg.device``): always the CPU
    device: str = "cpu"
    # the rest of TransformerLens's HookedTransformerConfig that has a meaning here (#59), with
    # TL's values for these families (``config_fields``)
    normalization_type: Optional[str] = None
    positional_embedding_type: str = "rotary"
    act_fn: Optional[str] = None
    original_architecture: Optional[str] = None
    dtype: str = "float32"
    eps: float = 1e-5
    d_vocab_out: int = 0
    gated_mlp: bool = True
    final_rms: bool = True
    uses_rms_norm: bool = True
    attn_only: bool = False
    tokenizer_prepends_bos: bool = False
    tokenizer_appends_eos: bool = False
    rotary_base: Optional[float] = None
    rotary_dim: Optional[int] = None
    use_attn_result: bool = False
    parallel_attn_mlp: bool = False
    tie_word_embeddings: bool = False


# per family: (TL's act_fn, Hugging Face's architecture class)
_FAMILY = {"qwen2": ("silu", "Qwen2ForCausalLM"), "qwen3": ("silu", "Qwen3ForCausalLM"),
           "llama": ("silu", "LlamaForCausalLM"), "mistral": ("silu", "MistralForCausalLM"),
           "phi3": ("silu", "Phi3ForCausalLM"), "gemma2": ("gelu_pytorch_tanh", "Gemma2ForCausalLM"),
           "gemma3": ("gelu_pytorch_tanh", "Gemma3ForCausalLM"), "gpt2": ("gelu_new", "GPT2LMHeadModel"),
           "bert": ("gelu", "BertModel"), "roberta": ("gelu", "RobertaModel"),
           "distilbert": ("gelu", "DistilBertModel")}


def config_fields(f: Dict[str, Any]) -> Dict[str, Any]:
    """TransformerLens's config fields from the engine's facts ``f``: the norm (``RMS``, ``LN``),
    the positions (``rotary``; GPT-2's and encoders' learned ``standard``), the activation, the
    architecture class, ``eps``, the rotation's base and width (the model's own: TL 4's bridge
    reports 10000 for every family), whether the tokenizer adds BOS."""
    arch = f["arch"]
    rms = arch not in ("gpt2", "bert", "roberta", "distilbert")
    act, cls = _FAMILY.get(arch, (None, None))
    rotary = rms
    return dict(normalization_type="RMS" if rms else "LN", positional_embedding_type="rotary" if rotary else "standard",
                act_fn=act, original_architecture=cls, eps=f.get("eps", 1e-5), d_vocab_out=f["d_vocab"],
                gated_mlp=rms, final_rms=rms, uses_rms_norm=rms, tokenizer_prepends_bos=bool(f["adds_bos"]),
                rotary_base=f.get("rope_base") if rotary else None, rotary_dim=f.get("rotary_dim") if rotary else None,
                tie_word_embeddings=bool(f.get("tied_embeddings", False)))


class ActivationCache:
    """Captured activations by hook name: ``cache["blocks.0.attn.hook_pattern"]``,
    ``cache["pattern", 0]`` (negative layers count from the end), ``keys()``, ``items()``,
    ``stack_activation("pattern")``, ``remove_batch_dim()``. Values are numpy arrays that share
    the engine's memory (no copy); ``torch.from_numpy`` works on them."""

    def __init__(self, cache: Dict[str, np.ndarray], n_layers: int, has_batch_dim: bool = True,
                 model: Optional["HookedModel"] = None):
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

    def stack_head_results(self, layer: int = -1, return_labels: bool = False, incl_remainder: bool = False,
                           pos_slice: Any = None, apply_ln: bool = False):
        """TransformerLens's ``stack_head_results``: each head's output (``hook_result``: its ``z``
        through its slice of ``W_O``, without the bias), for every head of the layers before
        ``layer`` (``None``/-1: all): ``[layers·heads, batch, pos, d_model]``, labels ``"L{l}H{h}"``.
        Computed from the captured ``hook_z``; with ``incl_remainder``, one more component: the
        rest of the residual stream before ``layer``."""
        m = self._need_model()
        top = self._layer(layer, "stack_head_results")
        parts, labels = [], []
        for l in range(top):
            z = self._get(f"blocks.{l}.attn.hook_z")  # [batch, pos, head, d_head]
            b, n, h, dh = z.shape
            res, _bias = m._m.head_results(l, np.ascontiguousarray(z, dtype=np.float32).reshape(-1), b * n)
            res = np.asarray(res).reshape(b, n, h, -1)
            for hh in range(h):
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


class HookedModel:
    """A language model whose attention can be captured, inspected and measured.

    ``HookedModel.from_pretrained(name, precision="exact")``: an alias (``qwen2.5-coder-0.5b``,
    the default, ``smollm2-135m`` or ``gemma3-270m``; fetched on first use), a ``.gguf`` file, a Hugging Face folder,
    or a hub id ``org/name``. ``precision="fast"`` runs 8-bit weights and activations (about half
    the memory, attention weights move by up to ~0.04)."""

    def __init__(self, native: "_native.Model"):
        self._m = native
        f = json.loads(native.facts_json())
        self.cfg = Config(
            model_name=f["name"], architecture=f["arch"], n_layers=f["n_layers"], n_heads=f["n_heads"],
            n_key_value_heads=f["n_kv_heads"], d_head=f["head_dim"], d_model=f["d_model"], d_mlp=f["d_ff"],
            n_ctx=f["n_ctx"], d_vocab=f["d_vocab"], precision=f["precision"], default_prepend_bos=f["adds_bos"],
            pad_token_id=f.get("pad_id"), **config_fields(f),
        )
        self.facts = f
        #: an encoder (BERT): bidirectional attention, no next-token logits; a 2-tuple of texts
        #: ``("A", "B")`` is a sentence pair ``[CLS] A [SEP] B [SEP]`` (token types 0 then 1)
        self.is_encoder: bool = bool(f.get("is_encoder", False))
        self._pad_id: Optional[int] = f.get("pad_id")
        self._weights: Dict[str, np.ndarray] = {}  # W_Q & co in TransformerLens's shapes, made when first read
        self.blocks = [_Block(self, l) for l in range(self.cfg.n_layers)]
        self.embed = _Embed(self, {"W_E": "W_E"})
        self.pos_embed = _Part(self, {"W_pos": "W_pos"})
        self.unembed = _Part(self, {"W_U": "W_U", "b_U": "b_U"})
        self.ln_final = _Part(self, {"w": "ln_final.w", "b": "ln_final.b"})
        # hooks added with add_hook (kept until reset_hooks) and by hooks() contexts, per thread:
        # a forward runs the hooks its own thread attached, never another thread's (two threads'
        # interleaved hooks() blocks once left one installed for good, #56)
        self._local = threading.local()
        hook_points.install(self, HOOKS, GLOBAL_HOOKS)  # model.hook_dict, mod_dict, blocks[l].attn.hook_z & co
        #: the tokenizer with Hugging Face's interface (encode, decode, batch_decode, __call__, ...)
        self.tokenizer = _tokenizer.Tokenizer(self)

    @classmethod
    def from_pretrained(cls, name: str = "qwen2.5-coder-0.5b", precision: str = "exact",
                        default_prepend_bos: Optional[bool] = None, fold_ln: Optional[bool] = None,
                        center_writing_weights: Optional[bool] = None, center_unembed: Optional[bool] = None,
                        fold_value_biases: Optional[bool] = None, refactor_factored_attn_matrices: bool = False,
                        device: Optional[str] = None, memory: Optional[str] = None) -> "HookedModel":
        """Loads a model (see the class docstring). ``default_prepend_bos``: ``None`` follows the
        model (Gemma puts ``<bos>`` first, Qwen and SmolLM2 do not); ``False`` leaves it out of
        every text, ``True`` puts it first in every text.

        ``fold_ln``, ``center_writing_weights``, ``center_unembed``, ``fold_value_biases``:
        TransformerLens's weight processing, with its semantics (:mod:`attnscope.processing`:
        ``W_Q`` & co folded, the logits centred, the value biases in ``b_O``; the attention
        patterns are the same either way). On by default, as in TransformerLens's
        ``from_pretrained`` (``None``: TL's default, so TL's attribution recipes give the logit);
        ``from_pretrained_no_processing`` gives the checkpoint's own weights. Qwen2 and
        Llama/SmolLM2 only: other families refuse a step asked for by name, and by default load
        unprocessed with a warning. ``refactor_factored_attn_matrices`` is not implemented.
        ``device``: only ``None`` or ``"cpu"``.
        ``memory``: ``"low"`` keeps a GGUF's projections in the file's own quantized blocks and
        dequantizes a panel just before each product (the same numbers, about the file's size in
        memory), ``"fast"`` packs them at load; ``None`` chooses from the model's size and the
        machine's free memory (the CLI's ``--memory``)."""
        if device not in (None, "cpu"):
            raise ValueError(f"device={device!r}: attnscope runs on the CPU")
        return cls(processing.load_with_defaults(
            lambda steps: _native.Model.load(os.fspath(name), precision, default_prepend_bos, memory, steps),
            os.fspath(name), fold_ln=fold_ln, center_writing_weights=center_writing_weights,
            center_unembed=center_unembed, fold_value_biases=fold_value_biases,
            refactor_factored_attn_matrices=refactor_factored_attn_matrices))

    @classmethod
    def from_pretrained_no_processing(cls, name: str = "qwen2.5-coder-0.5b", precision: str = "exact",
                                      default_prepend_bos: Optional[bool] = None, **kwargs: Any) -> "HookedModel":
        """TransformerLens's name for loading the weights unprocessed (every processing step off)."""
        for s in processing.STEPS:
            if kwargs.get(s):
                raise ValueError(f"{s}=True: from_pretrained_no_processing loads the weights unprocessed; use from_pretrained")
            kwargs[s] = False
        return cls.from_pretrained(name, precision, default_prepend_bos, **kwargs)

    def __repr__(self) -> str:
        c = self.cfg
        return f"HookedModel({c.model_name!r}, {c.architecture}, {c.n_layers} layers, {c.n_heads} heads sharing {c.n_key_value_heads} KV sets, {c.precision})"

    def generate(self, input: Union[str, np.ndarray, Sequence[int]], max_new_tokens: int = 10, chat: bool = False,
                 temperature: float = 0.0, seed: Optional[int] = None, top_k: int = 0, top_p: float = 1.0,
                 system: Optional[str] = None, return_type: str = "str", verbose: bool = False):
        """Generates a continuation on a KV cache, like TransformerLens's ``generate``: greedy when
        ``temperature`` is 0, else sampled (``top_k``, ``top_p``, ``seed`` for the same text again).
        ``chat=True`` puts ``input`` (a string) through the model's own chat template, with the
        generation prompt added (``system``: a system message). Stops at EOS / end-of-turn or after
        ``max_new_tokens``. ``return_type="str"``: the prompt and the continuation as text;
        ``"tokens"``: their ids, ``[1, n]`` int64; ``"details"``: a dict with each generated
        token's log-probability, sink profile, top keys and concentrated heads."""
        if return_type not in ("str", "tokens", "details"):
            raise ValueError(f"return_type {return_type!r} is not one of: str, tokens, details")
        if isinstance(input, str):
            p, g, js = self._m.generate(text=input, chat=chat, system=system, max_new_tokens=max_new_tokens,
                                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed or 0)
        else:
            ids = self._ids(input)
            p, g, js = self._m.generate(ids=ids, chat=chat, max_new_tokens=max_new_tokens,
                                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed or 0)
        if verbose:
            print(b"".join(bytes(b) for b in self._m.token_bytes(g)).decode("utf-8", "replace"))
        if return_type == "tokens":
            return _wrap(np.asarray([p + g], dtype=np.int64))
        if return_type == "details":
            return json.loads(js)
        return b"".join(bytes(b) for b in self._m.token_bytes(p + g)).decode("utf-8", "replace")

    # tokens
    def embed_sentences(self, texts, normalize: Optional[bool] = None) -> np.ndarray:
        """``model.embed(texts, normalize=None)`` (``model.embed`` is also TransformerLens's
        embedding part: ``model.embed.W_E``). Sentence embeddings of an encoder (``all-minilm-l6-v2``): a float32 array ``[n_texts,
        d_model]``, computed as sentence-transformers' ``encode`` computes them: the mean of the
        last hidden states over every token ([CLS] and [SEP] included), then divided by its L2
        norm when the model folder's ``modules.json`` lists a ``Normalize`` module (all-MiniLM-L6-v2's
        does, so its rows have norm 1). ``normalize=True``/``False`` overrides that.

        ``texts``: a str, a pair ``("A", "B")`` (``[CLS] A [SEP] B [SEP]``, token types 0 then 1),
        or a list of them. Texts run in parallel in the engine; a text longer than
        ``max_seq_length`` (the folder's sentence_bert_config.json: 256) is refused, where
        sentence-transformers would cut it. A single text holding ``[SEP]`` itself runs with every
        token type 0, as the tokenizer gives it."""
        if isinstance(texts, (str, tuple)):
            texts = [texts]
        firsts: List[str] = []
        pairs: List[Optional[str]] = []
        for t in texts:
            if isinstance(t, str):
                firsts.append(t)
                pairs.append(None)
            elif isinstance(t, tuple) and len(t) == 2 and all(isinstance(x, str) for x in t):
                firsts.append(t[0])
                pairs.append(t[1])
            else:
                raise TypeError(f"embed takes a str, a pair (str, str) or a list of them; got {type(t).__name__}")
        if not firsts:
            raise ValueError("embed needs at least one text")
        if normalize not in (None, True, False):
            raise ValueError(f"normalize={normalize!r}: use None (as modules.json says), True or False")
        return self._m.embed(firsts, pairs, normalize)

    def to_tokens(self, input: Union[str, Sequence[str]], prepend_bos: Optional[bool] = None,
                  padding_side: Optional[str] = None, move_to_device: bool = True, truncate: bool = True) -> np.ndarray:
        """Token ids ``[1, n]`` (int64) of a text, or ``[b, n]`` of a list of texts, padded on the
        right with the pad token (the model's padding token, else its end-of-text token, as
        TransformerLens's tokenizer does; ``cfg.pad_token_id``) up to the longest. BOS comes
        first when the model asks for one (``cfg.default_prepend_bos``), or with
        ``prepend_bos=True``; ``prepend_bos=False`` leaves it out. ``padding_side="left"`` is not
        supported (TransformerLens then shifts positions under an attention mask)."""
        if padding_side not in (None, "right"):
            raise NotImplementedError(f"padding_side={padding_side!r}: attnscope pads on the right (TransformerLens's default)")
        if self._is_pair(input):
            return _wrap(np.asarray([self._m.encode_pair(*input)[0]], dtype=np.int64))
        if isinstance(input, str):
            return _wrap(np.asarray([self._m.encode(input, prepend_bos)], dtype=np.int64))
        if not (isinstance(input, (list, tuple)) and input and all(isinstance(t, str) for t in input)):
            raise TypeError(f"to_tokens takes a text or a non-empty list of texts, not {type(input).__name__}")
        return _wrap(self._pad([list(self._m.encode(t, prepend_bos)) for t in input]))

    def _is_pair(self, x: Any) -> bool:
        """Whether ``x`` is an encoder's sentence pair: a tuple of two texts on an encoder (on a
        decoder a tuple of texts stays a batch, as TransformerLens reads it)."""
        return self.is_encoder and isinstance(x, tuple) and len(x) == 2 and all(isinstance(t, str) for t in x)

    def to_token_types(self, input: Union[str, Tuple[str, str], Sequence[str]]) -> np.ndarray:
        """An encoder's token types (segment ids) ``[1, n]`` int64, as transformers' tokenizer
        gives them: all 0 for one text (a literal ``[SEP]`` inside it included), 0 then 1 for a
        pair ``("A", "B")``; ``[b, n]`` zeros for a list of texts (padded as :meth:`to_tokens`)."""
        if self._is_pair(input):
            return _wrap(np.asarray([self._m.encode_pair(*input)[1]], dtype=np.int64))
        return _wrap(np.zeros(np.asarray(self.to_tokens(input)).shape, dtype=np.int64))

    def _pad(self, rows: List[List[int]]) -> np.ndarray:
        """Rows of ids padded on the right with the pad token: ``[b, longest]`` int64."""
        n = max(len(r) for r in rows)
        if any(len(r) != n for r in rows) and self._pad_id is None:
            raise ValueError(f"{self.cfg.model_name} names no padding or end-of-text token: give texts of one token count "
                             f"(these have {[len(r) for r in rows]})")
        out = np.full((len(rows), n), -1 if self._pad_id is None else self._pad_id, dtype=np.int64)
        for i, r in enumerate(rows):
            out[i, :len(r)] = r
        return out

    def to_str_tokens(self, text_or_tokens: Union[str, np.ndarray, Sequence[int]], prepend_bos: Optional[bool] = None) -> List[str]:
        """The text of each token; a list of texts or a ``[b, n]`` array gives a list per row (on an
        encoder, a tuple of two texts is a sentence pair: one list)."""
        if self._is_pair(text_or_tokens):
            return self._m.token_texts(self._m.encode_pair(*text_or_tokens)[0])
        if isinstance(text_or_tokens, (list, tuple)) and text_or_tokens and all(isinstance(t, str) for t in text_or_tokens):
            return [self.to_str_tokens(t, prepend_bos) for t in text_or_tokens]
        if not isinstance(text_or_tokens, (str, list, tuple)) and _np(text_or_tokens).ndim == 2 and _np(text_or_tokens).shape[0] > 1:
            return [self.to_str_tokens(row) for row in _np(text_or_tokens)]
        ids = self._ids(text_or_tokens, prepend_bos)
        return self._m.token_texts(ids)

    def to_string(self, tokens: Union[np.ndarray, Sequence[int]]) -> Union[str, List[str]]:
        """Token ids back to text; a 2-D batch ``[b, n]`` gives a list of ``b`` texts."""
        a = _np(tokens)
        if a.ndim == 2:
            return [self.to_string(row) for row in a]
        ids = [int(t) for t in a.reshape(-1)]
        return b"".join(bytes(b) for b in self._m.token_bytes(ids)).decode("utf-8", errors="replace")

    def tokens_to_residual_directions(self, tokens: Union[str, int, np.ndarray, Sequence[int]]):
        """The unembedding direction of each token, ``W_U[:, token]``, as TransformerLens gives it:
        ``[d_model]`` for one token (a string that is one token, or an id), ``[..., d_model]`` for
        an array of ids. (The final norm's weight is not in it, as with TransformerLens's unfolded
        weights.)"""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        a = _np(tokens)
        ids = [int(t) for t in a.reshape(-1)]
        if ids and not 0 <= min(ids) <= max(ids) < self.cfg.d_vocab:
            raise ValueError(f"token ids must be in 0..{self.cfg.d_vocab - 1}")
        rows = np.asarray(self._m.unembed_rows(ids), dtype=np.float32).reshape(len(ids), self.cfg.d_model)
        return _wrap(rows.reshape(*a.shape, self.cfg.d_model))

    def to_single_token(self, string: str) -> int:
        """The id of ``string`` when it is exactly one token (no BOS), else a ValueError."""
        ids = self._m.encode(string, False)
        if len(ids) != 1:
            raise ValueError(f"{string!r} is {len(ids)} tokens ({ids}), not one")
        return int(ids[0])

    def get_token_position(self, single_token: Union[str, int], input: TextOrTokens, mode: str = "first",
                           prepend_bos: Optional[bool] = None) -> int:
        """Where a token first (``mode="first"``) or last (``"last"``) occurs in ``input``."""
        t = self.to_single_token(single_token) if isinstance(single_token, str) else int(single_token)
        ids = self._ids(input, prepend_bos)
        where = [i for i, x in enumerate(ids) if x == t]
        if not where:
            raise ValueError(f"token {t} ({self._m.token_texts([t])[0]!r}) is not in the input")
        if mode not in ("first", "last"):
            raise ValueError(f"mode={mode!r}: use 'first' or 'last'")
        return where[0] if mode == "first" else where[-1]

    def _rows(self, x: Any, prepend_bos: Optional[bool] = None, pair_ok: bool = False) -> List[List[int]]:
        """The input as rows of token ids of one length: a text is one row; a list of texts is
        padded as :meth:`to_tokens` pads it; a ``[b, n]`` array gives its rows as they are; an
        encoder's pair ``("A", "B")`` one row (where ``pair_ok``: the caller runs its token types,
        :meth:`_row_types`; elsewhere refused, so B is never run as type 0)."""
        if self._is_pair(x):
            if not pair_ok:
                raise ValueError("a sentence pair (A, B) runs in run_with_cache (and to_tokens, to_str_tokens, "
                                 "to_token_types, embed); run its token ids with run_with_cache")
            return [list(self._m.encode_pair(*x)[0])]
        if isinstance(x, (list, tuple)) and x and all(isinstance(t, str) for t in x):
            return [[int(t) for t in row] for row in self._pad([list(self._m.encode(t, prepend_bos)) for t in x])]
        if not isinstance(x, str):
            a = _token_array(x)
            if a.ndim == 2 and a.shape[0] > 1:
                if not np.issubdtype(a.dtype, np.integer) or a.shape[1] == 0:
                    raise ValueError(f"expected token ids [b, n], got an array of shape {a.shape} and dtype {a.dtype}")
                self._check_ids(a)
                return [[int(t) for t in row] for row in a]
        return [self._ids(x, prepend_bos)]

    def _check_ids(self, a: np.ndarray) -> None:
        """Refuses a token id outside the vocabulary (a negative one included), naming it and
        where it is."""
        if a.size == 0:
            return
        bad = np.argwhere((a < 0) | (a >= self.cfg.d_vocab))
        if len(bad):
            at = tuple(int(i) for i in bad[0])
            where = f"position {at[-1]}" + (f" of row {at[0]}" if len(at) == 2 else "")
            raise ValueError(f"token id {int(a[at])} at {where} is out of range; valid: 0..{self.cfg.d_vocab - 1} "
                             f"({self.cfg.model_name}'s vocabulary)")

    def _row_types(self, x: Any) -> Optional[List[Optional[List[int]]]]:
        """The token types of :meth:`_rows`' rows: a pair's 0/1, else None (all 0)."""
        if self._is_pair(x):
            return [list(self._m.encode_pair(*x)[1])]
        return None

    def _ids(self, x: Any, prepend_bos: Optional[bool] = None) -> List[int]:
        if isinstance(x, str):
            return list(self._m.encode(x, prepend_bos))
        a = _token_array(x)
        if a.ndim == 2 and a.shape[0] == 1:
            a = a[0]
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"expected a text or token ids [n] / [1, n], got an array of shape {a.shape} and dtype {a.dtype}")
        self._check_ids(a)
        return [int(t) for t in a]

    # the weights in TransformerLens's shapes (processed as the load asked: see from_pretrained)
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
        (``[b, head, n, n]``: ask for the layers you need); the other hooks have none. The
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

    def ablate(self, text: str, method: str = "zero", target: Optional[str] = None, positions: Optional[str] = None,
               mlp: bool = False, bos: bool = False) -> Dict[str, Any]:
        """Every head ablated in turn (``attnscope ablate --json``): Δ log p(target) and KL per head
        beside its attention, and their rank correlations."""
        text = inputs.text_arg(self, text, "text")
        return self._m.ablate(text, method, _tok(target, 'target'), positions, mlp, bos)

    def patch(self, clean: str, corrupt: str, hook: str = "resid-pre", answer: Optional[str] = None,
              wrong: Optional[str] = None) -> Dict[str, Any]:
        """Activation patching (``attnscope patch --json``): the corrupted run with one activation
        from the clean run, per layer × position (``resid-pre``, ``attn-out``, ``mlp-out``) or
        per layer × head (``z``); ``results`` with ``logit_diff`` and ``recovered``. Equal clean and
        corrupted logit differences raise ValueError (``recovered`` divides by their gap); a gap
        below 0.1 is warned about (``warnings``, and a Python warning)."""
        clean, corrupt = inputs.text_arg(self, clean, "clean"), inputs.text_arg(self, corrupt, "corrupt")
        r = self._m.patch(clean, corrupt, hook, _tok(answer, 'answer'),
                          _tok(wrong, 'wrong'))
        for w in r.get("warnings", []):
            warnings.warn(w, stacklevel=2)
        return r

    def inspect(self, text: Union[str, Tuple[str, str]], query: Optional[int] = None, layer: Optional[int] = None, heads: str = "0-3",
                layers: Optional[str] = None, top: Optional[int] = None, concentrated: float = 0.9, bos: bool = False) -> Dict[str, Any]:
        """The lesson's tables for one query (``attnscope inspect --json``): per-head top tokens of a
        layer, head-averaged top tokens, the sink profile, concentration, next-token top-5. On an
        encoder ``text`` may be a pair ``("A", "B")``: the [CLS]/[SEP]/punctuation shares and the
        rows of ``query`` (default [CLS])."""
        pair = None
        if isinstance(text, tuple):
            if len(text) != 2:
                raise ValueError("a pair is a tuple of two texts: (\"A\", \"B\")")
            text, pair = text
        return self._m.inspect(text, pair, query, layer, heads, layers, top, float(concentrated), bos)

    def faithfulness(self, text: str, target: Optional[str] = None, replace_with: Optional[str] = None, bos: bool = False) -> Dict[str, Any]:
        """Attention rankings against occlusion (``attnscope faithfulness --json``)."""
        return self._m.faithfulness(text, _tok(target, 'target'), replace_with, bos)

    def sinks(self, text: Optional[str] = None, max_tokens: Optional[int] = None, key_block: int = 1024, top: int = 5,
              file: Optional[str] = None) -> Dict[str, Any]:
        """The streamed sink profile and per-head statistics (``attnscope sinks --json``): no
        attention matrix is held, so 32k tokens fit in a few GB. ``text`` or ``file`` (default:
        the built-in corpus repeated up to ``max_tokens``)."""
        if text is not None and file is not None:
            raise ValueError("give text or file, not both")
        # a file is read as far as max_tokens tokens can reach (64 bytes a token), no further
        return self._m.sinks(text, max_tokens, key_block, top, file=None if file is None else os.fspath(file))

    def heads(self, text: Optional[Union[str, Tuple[str, str]]] = None, random_repeat: Optional[int] = None, seed: int = 0,
              bos: bool = False) -> Dict[str, Any]:
        """Head roles (``attnscope heads --json``): previous-token, duplicate-token, induction, sink
        and local scores ``roles[role][layer][head]``, on ``text`` or on ``random_repeat`` random
        tokens repeated once (the induction test). On an encoder the roles are previous_token,
        next_token, cls, sep and broad (means over the queries; broad = entropy / ln n), and
        ``text`` may be a pair ``("A", "B")``."""
        pair = None
        if isinstance(text, tuple):
            if not (len(text) == 2 and all(isinstance(t, str) for t in text)):
                raise ValueError("a pair is a tuple of two texts: (\"A\", \"B\")")
            text, pair = text
        return self._m.heads(text if random_repeat is None else None, random_repeat, seed, bos, pair)

    def compare(self, text: str, other_text: Optional[str] = None, other: Optional[Union["HookedModel", str]] = None,
                query: Optional[int] = None, top: int = 10, html: Optional[Union[str, os.PathLike]] = None, force: bool = False) -> Dict[str, Any]:
        """Two runs side by side (``attnscope compare --json``): ``text`` against ``other_text`` on
        this model, or ``text`` on this model against ``other`` (a HookedModel, say the same file
        loaded at another precision, or a model name; the tokenizers must agree). Per layer the sink
        profiles and their difference, per head the Jensen-Shannon divergence (bits) of the query's
        rows, the heads that changed most; ``a["rows"]``/``b["rows"]`` as ``[layers, heads, keys]``
        arrays. ``html``: also write the side-by-side page."""
        if (other_text is None) == (other is None):
            raise ValueError("give other_text (two texts on this model) or other (a second model), not both")
        o = None
        if other is not None:
            o = other._m if isinstance(other, HookedModel) else _native.Model.load(str(other))
        return self._m.compare(text, other_text, o, query, top, None if html is None else os.fspath(html), force)

    def capture(self, text: str, path: Union[str, os.PathLike], hooks: str = "pattern", layers: str = "all", heads: str = "all",
                queries: str = "all", force: bool = False) -> str:
        """Streams captured tensors to ``.safetensors`` or ``.npz`` (``attnscope capture``); returns
        what the command printed."""
        return self._m.capture(text, os.fspath(path), hooks, layers, heads, queries, force)

    def attribute(self, text: str, method: str = "grad-x-input", target: Optional[Union[str, int]] = None,
                  steps: int = 32, wrong: Optional[Union[str, int]] = None) -> Dict[str, Any]:
        """A score per input token for the last position's prediction, as ``attnscope attribute``
        computes it (``method``: gradient, grad-x-input, integrated-gradients, attention-x-gradient,
        attnlrp, value-zeroing, alti-logit, occlusion; ``target``: None for the model's top next
        token, a token id, or one token's text; ``wrong``: explain logit(target) − logit(wrong)
        instead of log p(target), or of the logit for attnlrp and alti-logit). Returns the report
        as a dict with ``scores`` (float32 numpy array, one per token) and ``tokens`` (their texts);
        attnlrp adds ``conservation_error``, value-zeroing and alti-logit ``layers`` (per layer).
        On an encoder only ``method="occlusion"`` applies, with ``target`` None or "embedding" (the
        mean-pooled sentence embedding) or "cls" (the [CLS] vector): each score is 1 − the cosine
        similarity of the vector without that token to the text's (``metric`` "cosine")."""
        ids = self._m.encode(text, None) if isinstance(text, str) else self._ids(text)
        rep, scores = self._m.attribute(ids, method, _tok(target, 'target'),
                                        _tok(wrong, 'wrong'), steps)
        r = json.loads(rep)
        r["scores"] = _wrap(scores)
        r["tokens"] = [t["text"] for t in r["tokens"]]
        r["token_ids"] = _wrap(np.asarray(ids, dtype=np.int64))
        return r

    def attribute_generation(self, input: str, method: str = "occlusion", max_new_tokens: int = 32, chat: bool = True,
                             system: Optional[str] = None, temperature: float = 0.0, seed: Optional[int] = None,
                             top_k: int = 0, top_p: float = 1.0, steps: int = 32) -> Dict[str, Any]:
        """Generates an answer to ``input`` (through the model's chat template when ``chat``, else a raw
        continuation; greedy unless ``temperature`` > 0), then attributes each answer token's
        log-probability, teacher-forced on the generated text, to the prompt tokens and the answer
        tokens before it (``attnscope generate --attribute``; ``method``: occlusion, gradient,
        grad-x-input, integrated-gradients (``steps`` midpoints), attention-x-gradient, attnlrp,
        value-zeroing, alti-logit). Returns a dict: ``matrix`` (float32 numpy ``[prompt + answer,
        answer]``: row a position, column an answer token, NaN where the position is not in that
        token's input), ``prompt_tokens``, ``answer_tokens`` (token texts), ``prompt_ids``,
        ``answer_ids``, ``logprobs`` (each answer token's teacher-forced log-probability),
        ``attention`` (per answer token, the head-and-layer-averaged row of the query that produced
        it), ``answer`` (the text), ``method``."""
        texts, p, matrix, logprobs, ids, attention = self._m.attribute_generation(
            input, method=method, chat=chat, system=system, max_new_tokens=max_new_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed or 0, steps=steps)
        answer = b"".join(bytes(b) for b in self._m.token_bytes(ids[p:])).decode("utf-8", "replace")
        return {"method": method, "matrix": matrix, "prompt_tokens": texts[:p], "answer_tokens": texts[p:],
                "prompt_ids": np.asarray(ids[:p], dtype=np.int64), "answer_ids": np.asarray(ids[p:], dtype=np.int64),
                "logprobs": np.asarray(logprobs, dtype=np.float32),
                "attention": [np.asarray(a, dtype=np.float32) for a in attention], "answer": answer}

    def circuit(self, clean: Optional[str] = None, corrupt: Optional[str] = None, answer: Optional[Union[str, int]] = None,
                wrong: Optional[Union[str, int]] = None, method: str = "eap", steps: Optional[int] = None,
                metric: str = "logit-diff", pairs: Optional[Union[str, os.PathLike, Sequence[Dict[str, Any]]]] = None,
                evaluate: bool = False, exact_edges: int = 0, bos: bool = False) -> Dict[str, Any]:
        """Which edges between the input, the heads and the MLPs carry the answer (``attnscope
        circuit --json``): every edge scored by edge attribution patching (``method="eap"``, Syed
        et al. 2023) or EAP with integrated gradients (``"eap-ig"``, ``steps`` midpoints between
        the corrupted and the clean embeddings, default 5; Hanna et al. 2024) on ``clean`` /
        ``corrupt`` (the same token count) with ``answer`` / ``wrong`` (a token's text, exactly one
        token, or its id; ``wrong`` is not needed for ``metric="logprob"``), or on ``pairs`` (a
        JSONL path, or a list of dicts with ``clean``, ``corrupt``, ``answer``, ``wrong``;
        averaged). ``evaluate``: the faithfulness of the top edges' circuits by exact edge
        patching (``evaluation``: the ladder, MIB's CPR and CMD); ``exact_edges=N``: the top N
        edges patched one at a time (``exact_edges``, with Spearman's ρ).

        Returns the JSON report's fields (``model``, ``method``, ``metric``, ``clean_metric``,
        ``corrupt_metric``, ``nodes``, ``evaluation``, ``exact_edges``, ...) with the edges as
        arrays instead of ``edges``: ``node_names`` (upstream: ``input``, ``a{L}.h{H}``, ``m{L}``,
        the names of Hanna et al.'s EAP-IG library), ``reader_names`` (downstream:
        ``a{L}.h{H}.q``, ``a{L}.kv{G}.k``, ``a{L}.kv{G}.v``, ``m{L}``, ``logits``), ``scores``
        (float32 ``[n_nodes, n_readers]``, NaN where no edge joins the two), and the edges
        ranked by |score| as the JSON ranks them: ``edge_from`` (indices into ``node_names``),
        ``edge_to`` (into ``reader_names``), ``edge_scores``. ``node_hooks`` / ``reader_hooks``:
        the TransformerLens hook point each node writes or reads (``hook_embed``,
        ``blocks.{L}.attn.hook_result``, ``blocks.{L}.hook_mlp_out``; ``blocks.{L}.hook_q_input``,
        ``hook_k_input``, ``hook_v_input``, ``hook_mlp_in``, and the last ``hook_resid_post``
        for the logits), the head's index into it being the node's ``head``. ``edges(k)`` gives
        the top ``k`` as ``(from, to, score)`` tuples."""
        one = [clean, corrupt, answer, wrong]
        if pairs is not None:
            if any(x is not None for x in one):
                raise ValueError("give clean, corrupt, answer and wrong, or pairs, not both")
            if isinstance(pairs, (str, os.PathLike)):
                source = os.fspath(pairs)
                with open(source, encoding="utf-8") as f:
                    text = f.read()
            else:
                source = "pairs"
                text = "\n".join(json.dumps(p) for p in pairs)
            args: Dict[str, Any] = dict(pairs=text, pairs_source=source)
        else:
            if wrong is None and metric == "logprob":
                wrong = answer
            missing = [n for n, v in zip(("clean", "corrupt", "answer", "wrong"), one[:3] + [wrong]) if v is None]
            if missing:
                raise ValueError(f"{missing[0]} is missing: give clean, corrupt, answer and wrong (or pairs)")
            args = dict(clean=inputs.text_arg(self, clean, "clean"), corrupt=inputs.text_arg(self, corrupt, "corrupt"), answer=_tok(answer, 'answer'), wrong=_tok(wrong, 'wrong'))
        if exact_edges < 0:
            raise ValueError(f"exact_edges={exact_edges}: must be 0 or more")
        rep, scores, efrom, eto, escores = self._m.circuit(method=method, steps=steps, metric=metric, evaluate=evaluate,
                                                           exact_edges=exact_edges, bos=bos, **args)
        return CircuitResult(rep, scores, efrom, eto, escores, self.cfg.n_layers)

    def qk_attribution(self, text: str, layer: int, head: int, query: Optional[int] = None, key: Optional[int] = None,
                       against: str = "second", bos: bool = False) -> Dict[str, Any]:
        """Why head ``layer``.``head`` attends where it does (``attnscope qk --json``): its
        pre-softmax score of ``query`` (default the last token) and ``key`` on ``text`` split
        exactly into terms, each a query-side component × a key-side component of the residual
        stream (``input``, each earlier head ``a{L}.h{H}``, each earlier MLP ``m{L}``, ``bias``),
        with each position's norm scale frozen from the run and its rotary rotation applied.
        Without ``key``: the split of the attended key's lead over the second key (``against=
        "second"``) or over the mean score of the keys the query sees (``"mean"``).

        Returns the JSON report (``score``, ``terms``: ``[{"query_side", "key_side", "value"}]``
        largest |value| first, ``sum``, ``gap``, ``components``, ``tokens``, ...) and the terms as
        arrays: ``values`` (float64), ``query_sides`` and ``key_sides`` (names), and ``matrix``
        (float64 ``[query component, key component]`` in ``components`` order, then ``bias``,
        0 where no term is)."""
        if key is not None and against != "second":
            raise ValueError(f"against={against!r} is for the attended key's lead: give it without key")
        r = self._m.qk_attribution(text, layer, head, query, key, against, bos)
        names = list(r["components"])
        for t in r["terms"]:  # "bias" after the components
            names += [n for n in (t["query_side"], t["key_side"]) if n not in names]
        at = {n: i for i, n in enumerate(names)}
        matrix = np.zeros((len(names), len(names)), dtype=np.float64)
        for t in r["terms"]:
            matrix[at[t["query_side"]], at[t["key_side"]]] += t["value"]
        r["values"] = np.asarray([t["value"] for t in r["terms"]], dtype=np.float64)
        r["query_sides"] = [t["query_side"] for t in r["terms"]]
        r["key_sides"] = [t["key_side"] for t in r["terms"]]
        r["matrix"] = matrix
        r["matrix_names"] = names
        return r

    def view(self, text: str, faithfulness: bool = False, bos: bool = False, ablate: Optional[str] = None,
             target: Optional[Union[int, str]] = None) -> "viz.View":
        """The ``attnscope view`` page for ``text``; shows inline in a notebook, ``.save(path)``.

        ``ablate="zero"`` (or ``"mean"``) adds the ablation panel of ``attnscope view --ablate``:
        every head removed in turn, its Δ log p(target) as a layers × heads grid and a sortable
        table (a click selects the head in the attention views). ``target``: the token the
        ablation and faithfulness panels measure, a token id or a token's text (default: the
        model's top next token)."""
        return viz.View(self._m.view_html(text, bos, faithfulness, ablate, _tok(target, 'target')))

    def corpus(self, texts: Optional[Union[str, os.PathLike, Sequence[str]]] = None, limit: Optional[int] = None, **kw: Any) -> Dict[str, Any]:
        """Sink statistics over many texts (``attnscope corpus --json``); see :func:`corpus`."""
        return corpus(texts, model=self, limit=limit, **kw)


inputs.accept_tokens(HookedModel)  # token ids (a tensor too) where the engine takes a text


class CircuitResult(dict):
    """``HookedModel.circuit``'s result: the JSON report's fields as a dict, the edges as arrays
    (see :meth:`HookedModel.circuit`)."""

    def __init__(self, rep: Dict[str, Any], scores: np.ndarray, efrom: np.ndarray, eto: np.ndarray, escores: np.ndarray,
                 n_layers: int):
        super().__init__(rep)
        ups = [n for n in rep["nodes"] if n["upstream"]]
        downs = [n for n in rep["nodes"] if not n["upstream"]]
        self["node_names"] = [n["name"] for n in ups]
        self["reader_names"] = [n["name"] for n in downs]
        self["node_hooks"] = [_tl_hook(n, n_layers) for n in ups]
        self["reader_hooks"] = [_tl_hook(n, n_layers) for n in downs]
        self["scores"] = scores
        self["edge_from"] = efrom
        self["edge_to"] = eto
        self["edge_scores"] = escores

    def edges(self, k: Optional[int] = None) -> List[Tuple[str, str, float]]:
        """The top ``k`` edges (all when None), largest |score| first: ``(from, to, score)``."""
        n = len(self["edge_scores"]) if k is None else min(k, len(self["edge_scores"]))
        nf, nt = self["node_names"], self["reader_names"]
        return [(nf[self["edge_from"][i]], nt[self["edge_to"][i]], float(self["edge_scores"][i])) for i in range(n)]


def _tl_hook(node: Dict[str, Any], n_layers: int) -> str:
    """The TransformerLens hook point a circuit node writes (upstream) or reads (downstream)."""
    kind, layer = node["kind"], node.get("layer")
    return {"input": "hook_embed", "head": f"blocks.{layer}.attn.hook_result", "mlp": f"blocks.{layer}.hook_mlp_out",
            "q": f"blocks.{layer}.hook_q_input", "k": f"blocks.{layer}.hook_k_input", "v": f"blocks.{layer}.hook_v_input",
            "mlp_in": f"blocks.{layer}.hook_mlp_in", "logits": f"blocks.{n_layers - 1}.hook_resid_post"}[kind]


def corpus(texts: Optional[Union[str, os.PathLike, Sequence[str]]] = None, model: Union[str, HookedModel] = "qwen2.5-coder-0.5b",
           limit: Optional[int] = None, shard: Optional[str] = None, out: Optional[Union[str, os.PathLike]] = None,
           epsilon: float = 0.3) -> Dict[str, Any]:
    """``attnscope corpus --json``: per-text sink records aggregated with confidence intervals.
    ``texts``: None (the built-in corpus), a .txt / .jsonl path, or a list of texts."""
    m = model._m if isinstance(model, HookedModel) else _native.Model.load(str(model))
    out = None if out is None else os.fspath(out)
    if isinstance(texts, (list, tuple)):
        return m.corpus(texts=list(texts), limit=limit, shard=shard, out=out, epsilon=float(epsilon))
    path = None if texts is None else os.fspath(texts)
    return m.corpus(path=path, limit=limit, shard=shard, out=out, epsilon=float(epsilon))


def corpus_merge(files: Sequence[Union[str, os.PathLike]], epsilon: float = 0.3) -> Dict[str, Any]:
    """``attnscope corpus merge --json``: the exact aggregate of record files from shards."""
    return _native.corpus_merge([os.fspath(f) for f in files], float(epsilon))


# TransformerLens's loader names (#59): a TL user's imports and loading lines run unchanged
from . import bridge as _bridge  # noqa: E402
from .bridge import TransformerBridge  # noqa: E402

HookedTransformer = HookedModel
for _name in ("enable_compatibility_mode", "tl_parameters", "tl_named_parameters", "set_use_attn_result",
              "set_use_split_qkv_input"):
    setattr(HookedModel, _name, getattr(_bridge, _name))


def __getattr__(name: str) -> Any:
    """``HookedRootModule`` (TransformerLens's, for a user's own torch module) imports torch, so
    it is loaded on first use (attnscope itself needs no torch)."""
    if name == "HookedRootModule":
        from .hooked_module import HookedRootModule
        return HookedRootModule
    raise AttributeError(f"module 'attnscope' has no attribute {name!r}")
