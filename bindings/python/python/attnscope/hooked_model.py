""":class:`HookedModel` (TransformerLens's ``HookedTransformer``): loading, tokens, generation;
its forward, hooks, weights and analyses come from the mixins of :mod:`.running`, :mod:`.hooks`,
:mod:`.weights` and :mod:`.analyses`."""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _native, hook_points, inputs, processing
from . import bridge as _bridge
from . import tokenizer as _tokenizer
from .analyses import AnalysesMixin
from .arrays import _np, _token_array, _wrap
from .config import Config, config_fields
from .hooks import GLOBAL_HOOKS, HOOKS, HooksMixin, TextOrTokens
from .running import RunMixin
from .weights import WeightsMixin, _Block, _Embed, _Part


class HookedModel(RunMixin, HooksMixin, WeightsMixin, AnalysesMixin):
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


inputs.accept_tokens(HookedModel)  # token ids (a tensor too) where the engine takes a text
for _name in ("enable_compatibility_mode", "tl_parameters", "tl_named_parameters", "set_use_attn_result",
              "set_use_split_qkv_input"):
    setattr(HookedModel, _name, getattr(_bridge, _name))
