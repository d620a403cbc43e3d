"""Type stubs of the Rust engine (``attnscope._native``). Use the package's ``HookedModel``."""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import numpy.typing as npt

__version__: str

class Model:
    """A loaded model (weights in the engine's memory)."""

    @staticmethod
    def load(spec: str, precision: str = "exact", add_bos: Optional[bool] = None,
             memory: Optional[str] = None) -> "Model":
        """Loads an alias (fetched on first use), a .gguf file, a Hugging Face folder or a hub id.
        ``memory``: "low" (the file's quantized blocks, a panel dequantized per product), "fast"
        (packed at load) or None (chosen from the model's size and the free memory)."""
    def facts_json(self) -> str:
        """The model's dimensions and description, as JSON."""
    def encode(self, text: str, bos: Optional[bool] = None) -> List[int]:
        """Token ids (BOS first when the model asks for one, or when ``bos``)."""
    def encode_pair(self, a: str, b: str) -> Tuple[List[int], List[int]]:
        """An encoder's sentence pair ``[CLS] a [SEP] b [SEP]``: (token ids, token types 0 then 1)."""
    def token_texts(self, ids: Sequence[int]) -> List[str]:
        """The text of each token."""
    def token_bytes(self, ids: Sequence[int]) -> List[bytes]:
        """The bytes of each token."""
    def run(
        self, ids: Sequence[int], hooks: Sequence[Tuple[int, str]], logits: str = "all",
        edits: Sequence[Tuple[int, str]] = (), editor: Optional[Callable[[str, npt.NDArray[np.float32]], npt.NDArray[np.float32]]] = None,
        stop_at_layer: Optional[int] = None, token_types: Optional[Sequence[int]] = None,
    ) -> Tuple[Optional[npt.NDArray[np.float32]], List[Tuple[str, npt.NDArray[np.float32]]]]:
        """One forward capturing exactly the (layer, hook suffix) pairs; arrays share the engine's memory.
        ``edits`` are handed to ``editor(name, array)``, whose result flows on; ``stop_at_layer``
        (0..n_layers) ends the forward before that block, once its hook_resid_pre is handed (no logits).
        ``token_types``: an encoder's, one per id (a pair's 0/1); None: all 0."""
    def projection(self, layer: int, part: str) -> Tuple[npt.NDArray[np.float32], Optional[npt.NDArray[np.float32]]]:
        """Layer ``layer``'s ``qkv``, ``o``, ``gate_up`` or ``down`` projection as (W ``[out, in]``, bias or None),
        in Hugging Face's layout and q/k row order, dequantized."""
    def layer_norms(self, layer: int) -> Tuple[npt.NDArray[np.float32], Optional[npt.NDArray[np.float32]],
                                               npt.NDArray[np.float32], Optional[npt.NDArray[np.float32]]]:
        """(ln1 weight, ln1 bias or None, ln2 weight, ln2 bias or None)."""
    def embed(self, texts: Sequence[str], pairs: Sequence[Optional[str]], normalize: Optional[bool] = None) -> npt.NDArray[np.float32]:
        """Sentence embeddings ``[len(texts), d_model]`` of an encoder (mean pooling, L2 as modules.json says)."""
    def embeds_normalized(self) -> bool:
        """Whether the model folder's modules.json lists a Normalize module."""
    def embedding_matrix(self) -> npt.NDArray[np.float32]:
        """The token embeddings ``[vocab, d_model]`` as the forward adds them (Gemma's scale in)."""
    def unembed_matrix(self) -> npt.NDArray[np.float32]:
        """The output head ``[vocab, d_model]``."""
    def position_embeddings(self) -> Optional[npt.NDArray[np.float32]]:
        """GPT-2's learned positions ``[n_ctx, d_model]``, or None."""
    def final_norm(self) -> Tuple[npt.NDArray[np.float32], Optional[npt.NDArray[np.float32]], float]:
        """The final norm's (weight, bias or None, epsilon)."""
    def corpus_records(self, items: Sequence[Tuple[int, str]], bos: bool = False, faithfulness: bool = False) -> List[Tuple[int, str, str]]:
        """(id, record JSON, error) for each (id, text): the records of ``attnscope corpus --out``."""
    def head_roles(self, items: Sequence[Tuple[int, str]], bos: bool = False) -> List[Tuple[int, str, str]]:
        """(id, head-role scores JSON, error) for each (id, text)."""
    def head_roles_document(self, scores: Sequence[str]) -> str:
        """``attnscope heads --each-line --json`` from each text's scores, in order."""
    def view_html(self, text: str, bos: bool = False, faithfulness: bool = False, ablate: Optional[str] = None,
                  target: Optional[str] = None) -> str:
        """The page of ``attnscope view``; ``ablate`` (``"zero"`` or ``"mean"``) adds the ablation panel."""
    def inspect(self, text: str, pair: Optional[str] = None, query: Optional[int] = None, layer: Optional[int] = None,
                heads: str = "0-3", layers: Optional[str] = None, top: Optional[int] = None, concentrated: float = 0.9,
                bos: bool = False) -> Dict[str, Any]:
        """``attnscope inspect --json``'s report as Python objects."""
    def faithfulness(self, text: str, target: Optional[str] = None, replace_with: Optional[str] = None,
                     bos: bool = False) -> Dict[str, Any]:
        """``attnscope faithfulness --json``'s report as Python objects."""
    def compare(self, text: str, other_text: Optional[str] = None, other: Optional["Model"] = None,
                query: Optional[int] = None, top: int = 10, html: Optional[str] = None,
                force: bool = False) -> Dict[str, Any]:
        """``attnscope compare --json``'s report as Python objects; each side's ``rows`` a float32
        array ``[layers, heads, keys]``."""
    def capture(self, text: str, path: str, hooks: str = "pattern", layers: str = "all", heads: str = "all",
                queries: str = "all", force: bool = False) -> str:
        """Streams the captured tensors to ``path`` (``attnscope capture``); returns the line it prints."""
    def corpus(self, texts: Optional[Sequence[str]] = None, path: Optional[str] = None, limit: Optional[int] = None,
               shard: Optional[str] = None, out: Optional[str] = None, epsilon: float = 0.3,
               faithfulness: bool = False, bos: bool = False) -> Dict[str, Any]:
        """``attnscope corpus --json``'s aggregate as Python objects."""
    def ablate(self, text: str, method: str = "zero", target: Optional[str] = None, positions: Optional[str] = None,
               mlp: bool = False, bos: bool = False) -> Dict[str, Any]:
        """``attnscope ablate --json``'s report as Python objects."""
    def patch(self, clean: str, corrupt: str, hook: str = "resid-pre", answer: Optional[str] = None,
              wrong: Optional[str] = None, bos: bool = False) -> Dict[str, Any]:
        """``attnscope patch --json``'s report as Python objects."""
    def heads(self, text: Optional[str] = None, random_repeat: Optional[int] = None, seed: int = 0,
              bos: bool = False) -> Dict[str, Any]:
        """``attnscope heads --json``'s document as Python objects."""
    def sinks(self, text: Optional[str] = None, max_tokens: Optional[int] = None, key_block: int = 1024, top: int = 5,
              bos: bool = False, file: Optional[str] = None) -> Dict[str, Any]:
        """``attnscope sinks --json``'s report as Python objects (``file``: read as far as ``max_tokens`` reach)."""
    def hook_gradients(self, ids: Sequence[int], names: Sequence[str], metric: str, target: Optional[str] = None,
                       wrong: Optional[str] = None) -> Tuple[int, float, List[Tuple[str, List[int], npt.NDArray[np.float32]]]]:
        """The gradients of ``metric`` (target_logprob, loss, logit_diff) at the hook points ``names``:
        (target id, value, [(name + "_grad", shape, flat float32 array)])."""

def corpus_merge(files: Sequence[str], epsilon: float = 0.3) -> Dict[str, Any]:
    """``attnscope corpus merge --json``'s aggregate of record files, as Python objects."""

def pattern_page(patterns: npt.NDArray[np.float32], shape: Sequence[int], tokens: Sequence[str], title: str,
                 sentence_b_start: Optional[int] = None, pair: str = "all") -> str:
    """The view page for patterns ``[layers, heads, n, n]`` (flattened) and token texts."""

def corpus_texts(path: Optional[str] = None) -> List[str]:
    """The texts of a corpus file (or the built-in corpus), indexed as ``attnscope corpus`` does."""

def write_new_file(path: str, text: str, overwrite: bool = False) -> str:
    """Writes ``text`` to ``path`` through a temporary file renamed into place; an existing file only
    with ``overwrite`` (else ``FileExistsError``). Returns the path."""

def hook_suffixes() -> List[str]:
    """The hook suffixes, in order (``hook_resid_pre``, ``attn.hook_q``, ...)."""

def global_hooks() -> List[str]:
    """The hooks outside the blocks, by their whole names (``hook_embed``, ``hook_pos_embed``,
    ``ln_final.hook_scale``, ``ln_final.hook_normalized``)."""

def full_hook_name(layer: int, suffix: str) -> str:
    """``blocks.{layer}.{suffix}``."""
