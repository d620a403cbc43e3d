"""``model.tokenizer``: the part of a Hugging Face tokenizer's interface TransformerLens users call
(``encode``, ``decode``, ``batch_decode``, ``__call__``, ``convert_ids_to_tokens``, the special
tokens' ids, ``padding_side``, ``vocab_size``), on the model's own tokenizer (the GGUF's or the
Hugging Face folder's): the same ids as transformers' tokenizer for the same file."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np


class Tokenizer:
    """The model's tokenizer with Hugging Face's method names. ``encode(text)`` adds what
    transformers' ``add_special_tokens=True`` adds for this model (a BOS where the model asks for
    one); ``add_special_tokens=False`` adds nothing."""

    def __init__(self, model: Any):
        self._model = model
        f = model.facts
        self.bos_token_id: Optional[int] = f.get("bos_id")
        self.eos_token_id: Optional[int] = f.get("eos_id")
        self.pad_token_id: Optional[int] = f.get("pad_id")
        self.vocab_size: int = int(f["d_vocab"])
        self.padding_side = "right"
        self.name_or_path = f.get("name")

    def _text(self, i: Optional[int]) -> Optional[str]:
        return None if i is None else self._model._m.token_texts([int(i)])[0]

    @property
    def bos_token(self) -> Optional[str]:
        return self._text(self.bos_token_id)

    @property
    def eos_token(self) -> Optional[str]:
        return self._text(self.eos_token_id)

    @property
    def pad_token(self) -> Optional[str]:
        return self._text(self.pad_token_id)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True, return_tensors: Optional[str] = None, **kw: Any):
        """The ids of ``text`` (a list; ``return_tensors="np"|"pt"``: ``[1, n]``)."""
        _no_kwargs("encode", kw)
        if not isinstance(text, str):
            raise TypeError(f"encode takes a text, not {type(text).__name__}")
        ids = list(self._model._m.encode(text, None if add_special_tokens else False))
        return ids if return_tensors is None else _tensor([ids], return_tensors)

    def __call__(self, text: Union[str, Sequence[str]], add_special_tokens: bool = True, padding: Union[bool, str] = False,
                 return_tensors: Optional[str] = None, return_attention_mask: bool = True, **kw: Any) -> Dict[str, Any]:
        """``{"input_ids", "attention_mask"}`` of a text or a list of texts; with ``padding`` (or
        ``return_tensors``, which needs rows of one length) padded on the right with
        ``pad_token_id``."""
        _no_kwargs("__call__", kw)
        if padding not in (False, True, "longest", "do_not_pad"):
            raise NotImplementedError(f"padding={padding!r}: use True / 'longest' (to the longest row) or False")
        if self.padding_side != "right":
            raise NotImplementedError(f"padding_side={self.padding_side!r}: attnscope pads on the right")
        one = isinstance(text, str)
        texts = [text] if one else list(text)
        rows = [self.encode(t, add_special_tokens) for t in texts]
        masks = [[1] * len(r) for r in rows]
        if padding in (True, "longest") and len(rows) > 1:
            n = max(len(r) for r in rows)
            if self.pad_token_id is None and any(len(r) != n for r in rows):
                raise ValueError("this tokenizer has no pad token: give texts of one token count")
            rows = [r + [self.pad_token_id] * (n - len(r)) for r in rows]
            masks = [m + [0] * (n - len(m)) for m in masks]
        out: Dict[str, Any] = {"input_ids": rows[0] if one and return_tensors is None else rows}
        if return_attention_mask:
            out["attention_mask"] = masks[0] if one and return_tensors is None else masks
        if return_tensors is not None:
            if len({len(r) for r in rows}) > 1:
                raise ValueError(f"rows of token counts {[len(r) for r in rows]}: pass padding=True to make a tensor")
            out = {k: _tensor(v, return_tensors) for k, v in out.items()}
        return out

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kw: Any) -> str:
        """The text of ``token_ids`` (a list, an array or a tensor of one row, or one id)."""
        _no_kwargs("decode", kw)
        a = _ids(token_ids)
        if a.ndim > 1:
            if a.shape[0] != 1:
                raise ValueError(f"decode takes one row of ids; this is {a.shape}: use batch_decode")
            a = a[0]
        ids = [int(t) for t in a.reshape(-1)]
        if skip_special_tokens:
            special = {self.bos_token_id, self.eos_token_id, self.pad_token_id} - {None}
            ids = [i for i in ids if i not in special]
        self._model._check_ids(np.asarray(ids, dtype=np.int64))
        return b"".join(bytes(b) for b in self._model._m.token_bytes(ids)).decode("utf-8", errors="replace")

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = False, **kw: Any) -> List[str]:
        """:meth:`decode` of each row."""
        _no_kwargs("batch_decode", kw)
        if hasattr(sequences, "shape") or isinstance(sequences, np.ndarray):
            a = _ids(sequences)
            rows = list(a[:, None] if a.ndim == 1 else a.reshape(a.shape[0], -1))
        else:
            rows = list(sequences)
        return [self.decode(r, skip_special_tokens) for r in rows]

    def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = False) -> Union[str, List[str]]:
        """Each id's token as the vocabulary spells it (``Ġ`` for a leading space in a byte-level
        BPE, as Hugging Face's); one id gives one string."""
        one = isinstance(ids, (int, np.integer)) or (hasattr(ids, "ndim") and ids.ndim == 0)
        a = [int(i) for i in _ids(ids).reshape(-1)]
        if skip_special_tokens:
            special = {self.bos_token_id, self.eos_token_id, self.pad_token_id} - {None}
            a = [i for i in a if i not in special]
        self._model._check_ids(np.asarray(a, dtype=np.int64))
        toks = [_spelled(b) for b in self._model._m.token_bytes(a)]
        return toks[0] if one else toks

    def tokenize(self, text: str, add_special_tokens: bool = False) -> List[str]:
        return self.convert_ids_to_tokens(self.encode(text, add_special_tokens))

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size})"


def _no_kwargs(what: str, kw: Dict[str, Any]) -> None:
    if kw:
        raise TypeError(f"tokenizer.{what}: attnscope's tokenizer does not take {sorted(kw)}")


def _ids(x: Any) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.dtype == object or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise TypeError(f"token ids must be integers, got {a.dtype}")
    return a.astype(np.int64)


def _tensor(rows: List[List[int]], kind: str) -> Any:
    a = np.asarray(rows, dtype=np.int64)
    if kind == "np":
        return a
    if kind == "pt":
        import torch

        return torch.from_numpy(a)
    raise ValueError(f"return_tensors={kind!r}: use 'np' or 'pt'")


# GPT-2's bytes-to-unicode map: how byte-level BPE vocabularies spell a token's bytes
def _byte_map() -> Dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTES = _byte_map()


def _spelled(b: bytes) -> str:
    return "".join(_BYTES[x] for x in bytes(b))
