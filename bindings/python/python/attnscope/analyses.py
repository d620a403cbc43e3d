"""attnscope's analyses as calls on a :class:`HookedModel` (the CLI's commands: ``inspect``,
``faithfulness``, ``ablate``, ``patch``, ``circuit``, ...), and the corpus calls."""

from __future__ import annotations

import json
import os
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _native, inputs, viz
from .arrays import _wrap
from .inputs import token_arg as _tok

if TYPE_CHECKING:
    from .hooked_model import HookedModel


class AnalysesMixin:
    """:class:`HookedModel`'s analyses: each the CLI command of its name, its report as Python
    objects."""

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
            from .hooked_model import HookedModel  # (imported here: hooked_model imports this module)
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
    from .hooked_model import HookedModel  # (imported here: hooked_model imports this module)
    m = model._m if isinstance(model, HookedModel) else _native.Model.load(str(model))
    out = None if out is None else os.fspath(out)
    if isinstance(texts, (list, tuple)):
        return m.corpus(texts=list(texts), limit=limit, shard=shard, out=out, epsilon=float(epsilon))
    path = None if texts is None else os.fspath(texts)
    return m.corpus(path=path, limit=limit, shard=shard, out=out, epsilon=float(epsilon))


def corpus_merge(files: Sequence[Union[str, os.PathLike]], epsilon: float = 0.3) -> Dict[str, Any]:
    """``attnscope corpus merge --json``: the exact aggregate of record files from shards."""
    return _native.corpus_merge([os.fspath(f) for f in files], float(epsilon))
