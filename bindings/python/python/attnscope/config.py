"""A model's configuration in TransformerLens's names (:class:`Config`), from the engine's facts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional


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
def config_fields(f: Dict[str, Any]) -> Dict[str, Any]:
    """TransformerLens's config fields from the engine's facts ``f``: the norm (``RMS``, ``LN``),
    the positions (``rotary``; GPT-2's and encoders' learned ``standard``), the activation, the
    architecture class, ``eps``, the rotation's base and width (the model's own: TL 4's bridge
    reports 10000 for every family), whether the tokenizer adds BOS."""
    arch = f["arch"]
    rms = arch not in ("gpt2", "bert", "roberta", "distilbert")
    # the engine's family registry names both (src/model/family/)
    act, cls = f.get("act_fn"), f.get("hf_class")
    rotary = rms
    return dict(normalization_type="RMS" if rms else "LN", positional_embedding_type="rotary" if rotary else "standard",
                act_fn=act, original_architecture=cls, eps=f.get("eps", 1e-5), d_vocab_out=f["d_vocab"],
                gated_mlp=rms, final_rms=rms, uses_rms_norm=rms, tokenizer_prepends_bos=bool(f["adds_bos"]),
                rotary_base=f.get("rope_base") if rotary else None, rotary_dim=f.get("rotary_dim") if rotary else None,
                tie_word_embeddings=bool(f.get("tied_embeddings", False)))
