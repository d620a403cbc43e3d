"""TransformerLens's ``utils`` helpers that user code reaches for, on attnscope's hook names."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

# TransformerLens's aliases
_ALIAS = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q", "value": "v",
          "mlp_pre": "pre", "mlp_post": "post", "scores": "attn_scores",
          # TL 4's bridge: a block's hook_in / hook_out are its resid_pre / resid_post
          "in": "resid_pre", "out": "resid_post"}
_ATTN = {"q", "k", "v", "z", "rot_q", "rot_k", "result", "pattern", "attn_scores"}
_MLP = {"pre", "post", "pre_linear"}
_BLOCK = {"resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"}
_NORM = {"scale", "normalized"}


def get_act_name(name: str, layer: Optional[int] = None, layer_type: Optional[str] = None) -> str:
    """The full hook name, as TransformerLens's ``utils.get_act_name``: ``get_act_name("z", 3)``
    is ``"blocks.3.attn.hook_z"``, ``get_act_name("scale", 3, "ln1")`` is
    ``"blocks.3.ln1.hook_scale"``, ``get_act_name("scale")`` is ``"ln_final.hook_scale"`` and
    ``get_act_name("embed")`` is ``"hook_embed"``; a full name is returned as it is. A name
    attnscope has no hook for raises a ValueError naming the ones it has."""
    if name.startswith("blocks.") or name.startswith("ln_final.") or name.startswith("hook_") and layer is None:
        return name
    key = name
    if layer is not None and (name.startswith("hook_") or "." in name):
        # a block's hook suffix with its layer (attnscope's ("attn.hook_z", 3), ("ln1.hook_scale", 3))
        part, _, hook = name.rpartition(".")
        key = hook[len("hook_"):] if hook.startswith("hook_") else hook
        if part in ("ln1", "ln2") and layer_type is None:
            layer_type = part
    # TransformerLens also accepts e.g. "z3" or "pattern3a" (a: attn, m: mlp)
    digits = "".join(c for c in key if c.isdigit())
    if layer is None and digits and key.rstrip("a").rstrip("m").endswith(digits):
        key = key[: key.index(digits)]
        layer = int(digits)
    key = _ALIAS.get(key, key)
    if key in ("embed", "pos_embed"):
        return f"hook_{key}"
    if key in _NORM:
        if layer is None:
            return f"ln_final.hook_{key}"
        if layer_type not in ("ln1", "ln2"):
            raise ValueError(f"{name!r} at a layer needs layer_type 'ln1' or 'ln2'")
        return f"blocks.{int(layer)}.{layer_type}.hook_{key}"
    if key in _ATTN:
        suffix = f"attn.hook_{key}"
    elif key in _MLP:
        suffix = f"mlp.hook_{key}"
    elif key in _BLOCK:
        suffix = f"hook_{key}"
    else:
        known = sorted(_ATTN | _MLP | _BLOCK | _NORM | {"embed", "pos_embed"} | set(_ALIAS))
        raise ValueError(f"attnscope has no hook {name!r}; it has {', '.join(known)}")
    if layer is None:
        raise ValueError(f"{name!r} is a per-layer hook: give the layer")
    return f"blocks.{int(layer)}.{suffix}"


def tl_slice(s: Any):
    """TransformerLens's ``Slice`` input as a numpy index: ``None`` everything, an int (numpy's,
    or a 0-d tensor) that position (the axis dropped), a tuple ``slice(*s)``, a slice itself, a
    list, array or tensor those positions."""
    if s is None:
        return slice(None)
    if isinstance(s, slice):
        return s
    if isinstance(s, tuple):
        return slice(*s)
    if isinstance(s, (int, np.integer)) and not isinstance(s, bool):
        return int(s)
    a = np.asarray(s.detach().cpu().numpy() if hasattr(s, "detach") else s)
    if a.ndim == 0 and a.dtype.kind in "iu":
        return int(a)
    if a.ndim == 1 and (a.dtype.kind in "iu" or a.size == 0):
        return a.astype(np.int64)
    raise ValueError(f"pos_slice={s!r}: use None, an int, a tuple (start, stop[, step]), a slice or a list of positions")


def test_prompt(prompt: str, answer, model, prepend_space_to_answer: bool = True, print_details: bool = True,
                prepend_bos: Optional[bool] = None, top_k: int = 10) -> None:
    """TransformerLens's ``utils.test_prompt``: how the model does on ``answer`` (a string: every
    token of it; a list: the first token of each, as alternatives) after ``prompt``: the rank,
    logit and probability of each answer token and the ``top_k`` tokens, printed as TL prints
    them (without rich's bold), then the ranks. Returns None, as TL."""
    answers = [answer] if isinstance(answer, str) else list(answer)
    multi = len(answers) > 1
    if prepend_space_to_answer:
        answers = [a if a.startswith(" ") else " " + a for a in answers]
    p = np.asarray(model.to_tokens(prompt, prepend_bos=prepend_bos))[0]
    if multi:
        ans = [np.asarray(model.to_tokens(a, prepend_bos=False))[0, :1] for a in answers]
    else:
        ans = [np.asarray(model.to_tokens(answers[0], prepend_bos=False))[0]]
    tokens = np.stack([np.concatenate([p, a]) for a in ans]).astype(np.int64)
    prompt_str = model.to_str_tokens(prompt, prepend_bos=prepend_bos)
    ans_str = [model.to_str_tokens(a, prepend_bos=False) for a in answers]
    n_prompt, n_answer = len(prompt_str), 1 if multi else len(ans_str[0])
    if print_details:
        print("Tokenized prompt:", prompt_str)
        print("Tokenized answers:" if multi else "Tokenized answer:", ans_str if multi else ans_str[0])
    logits = np.asarray(model(tokens), dtype=np.float64)
    z = logits - logits.max(-1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    ranks = []
    for index in range(n_prompt, n_prompt + n_answer):
        toks = tokens[:, index]
        strs = [a[index - n_prompt] for a in ans_str]
        order = np.argsort(-probs[:, index - 1], axis=-1, kind="stable")
        rank = [int(np.nonzero(order[i] == toks[i])[0][0]) for i in range(len(answers))]
        ranks.append(list(zip(strs, rank)))
        if print_details:
            print(f"Performance on answer token{'s' if multi else ''}:\n" + "\n".join(
                f"Rank: {rank[i]: <8} Logit: {logits[i, index - 1, toks[i]]:5.2f} Prob: {probs[i, index - 1, toks[i]]:6.2%} Token: |{strs[i]}|"
                for i in range(len(answers))))
            for i in range(top_k):
                t = int(order[0, i])
                print(f"Top {i}th token. Logit: {logits[0, index - 1, t]:5.2f} Prob: {probs[0, index - 1, t]:6.2%} Token: |{model.to_string(t)}|")
    print("Ranks of the answer tokens:", [r[0] for r in ranks] if not multi else ranks)


test_prompt.__test__ = False  # pytest: a helper, not a test


def to_numpy(tensor) -> np.ndarray:
    """TransformerLens's ``utils.to_numpy``: a torch tensor (detached, on the CPU), a list or a
    number as a numpy array."""
    if hasattr(tensor, "detach"):
        return tensor.detach().cpu().numpy()
    return np.asarray(tensor)


def get_device() -> str:
    """TransformerLens's ``utils.get_device``: attnscope runs on the CPU."""
    return "cpu"


def lm_cross_entropy_loss(logits, tokens, attention_mask=None, per_token: bool = False):
    """TransformerLens's ``utils.lm_cross_entropy_loss``: the next-token cross-entropy of
    ``logits`` ``[b, n, vocab]`` against ``tokens`` ``[b, n]``, the mean over every row's
    positions 0..n-2 (with ``attention_mask``: over the predictions whose position and next are
    both real), or each ``[b, n - 1]`` with ``per_token`` (zero where masked out). On torch
    logits it is torch's computation (a tensor; a backward runs through it, and through
    attnscope's backward hooks); on numpy logits, float64's (a 0-d float32 array, or float32 ``[b, n - 1]``)."""
    if hasattr(logits, "log_softmax"):  # torch
        import torch

        t = tokens if isinstance(tokens, torch.Tensor) else torch.as_tensor(np.asarray(tokens))
        t = t.to(logits.device).long()
        lg = logits if logits.dim() == 3 else logits[None]
        t = t if t.dim() == 2 else t[None]
        if t.shape != lg.shape[:2]:
            raise ValueError(f"logits {tuple(lg.shape)} and tokens {tuple(t.shape)} do not match: [b, n, vocab] and [b, n]")
        lp = lg.log_softmax(dim=-1)[..., :-1, :].gather(dim=-1, index=t[..., 1:, None])[..., 0]
        if attention_mask is not None:
            m = attention_mask if isinstance(attention_mask, torch.Tensor) else torch.as_tensor(np.asarray(attention_mask))
            keep = torch.logical_and(m[:, :-1].bool(), m[:, 1:].bool()).to(lp.device)
            lp = lp * keep
            return -lp if per_token else -lp.sum() / keep.sum()
        return -lp if per_token else -lp.mean()
    from . import HookedModel

    return HookedModel.loss(logits, tokens, per_token=per_token, attention_mask=attention_mask)


def get_corner(tensor, n: int = 3):
    """TransformerLens's ``utils.get_corner``: the top-left ``n`` × ... × ``n`` corner of a tensor
    or array (``tensor[:n, :n, ...]`` on every axis)."""
    return tensor[tuple(slice(n) for _ in range(tensor.ndim))]


def remove_batch_dim(tensor):
    """TransformerLens's ``utils.remove_batch_dim``: drops a leading axis of size 1."""
    return tensor[0] if tensor.ndim > 0 and tensor.shape[0] == 1 else tensor
