"""run_demos.py --tl: real TransformerLens's loaders pointed at the model attnscope runs, offline.
``TransformerBridge.boot_transformers(name)`` boots TL's bridge on the Hugging Face model
transformers builds from the same GGUF (float32, eager attention; a fresh one per call, as TL
processes a bridge's weights in place), and ``HookedTransformer.from_pretrained(name)`` (the
demos' other loader) gives that bridge in compatibility mode (``_no_processing``: unprocessed),
as test_tl_real.py loads TL (TL 4.0 removed HookedTransformer: a stand-in class gives these two)."""

import os


def _hf(alias: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = os.path.join(os.environ.get("ATTNSCOPE_CACHE", os.path.expanduser("~/.cache/attnscope")), "models")
    name = f"{alias}.gguf"
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    return tok, hf


def install(alias: str) -> None:
    import transformer_lens
    from transformer_lens.model_bridge import TransformerBridge

    boot = TransformerBridge.boot_transformers

    def boot_local(model_name: str, *args, **kwargs):
        tok, hf = _hf(alias)
        kwargs.pop("hf_model", None), kwargs.pop("tokenizer", None)
        kwargs.setdefault("device", "cpu")
        return boot("local", *args, hf_model=hf, tokenizer=tok, **kwargs)

    def from_pretrained(model_name: str, *args, **kwargs):
        b = boot_local(model_name)
        b.enable_compatibility_mode(disable_warnings=True)
        return b

    def from_pretrained_no_processing(model_name: str, *args, **kwargs):
        b = boot_local(model_name)
        b.enable_compatibility_mode(disable_warnings=True, no_processing=True)
        return b

    TransformerBridge.boot_transformers = staticmethod(boot_local)
    # TL 4.0 removed HookedTransformer (its demos at HEAD still load with it): the bridge stands in
    shim = type("HookedTransformer", (), {"from_pretrained": staticmethod(from_pretrained),
                                          "from_pretrained_no_processing": staticmethod(from_pretrained_no_processing)})
    transformer_lens.HookedTransformer = shim
