#!/usr/bin/env python
"""The tiny decoder fixtures of tests/golden/arch (llama3, qwen3, mistral, gemma, gemma2, gemma3,
phi3, gpt2, seed_oss) and what transformers computes on them (issue #55; gemma and seed_oss, issue
#57, were made by `new <name>` from their hand-written config.json).

The folders were first made by the team's generator in ../shared/reference/arch (transformers
5.24.0, torch 2.15.0; its README is the description copied into tests/golden/README.md), whose
script was not kept beside them. This script does what that README describes, so a fixture can be
checked, its references remade, or a new one made the same way:

- `check` (the default): loads each committed folder with transformers (eager attention, float32)
  and recomputes its references: the token ids of both texts, every attention weight, the last
  logits and their argmax; prints the largest difference from the committed files, and fails if
  the ids or argmax differ or an attention weight moves by more than 1e-5 (a logit by 1e-4).
- `references <name> ...`: writes those references (reference.json, attn_*.npy, logits_*.npy)
  into the committed folders, from their committed weights.
- `new <name> <out dir> [seed]`: a new folder from the committed config.json: random seeded
  weights (every matrix N(0, initializer_range²), "wide" at 0.25 so that a wrong convention moves
  the attention; every norm's weight randomized too, 1 + N(0, 0.5²) for (1 + w) or w norms alike,
  biases N(0, 0.1²)), the byte-level tokenizer (token id = byte value, `<|endoftext|>` = 256, no
  merges), saved with `save_pretrained`, then its references. Random draws differ from the
  original generator's, so a new folder is a new fixture: its goldens, the GGUF
  (make_gguf_fixtures.py) and the mixing goldens (../make_mixing_golden.py) are remade with it.

Texts: short "The cat sat on the mat." (23 tokens), long (89 tokens, below); no BOS.

Usage (the venv of ../shared/bench/hf_anchor.py):
    ~/.hfenv/bin/python tests/golden/arch/make_arch_fixtures.py [check | references <name>... |
        new <name> <out dir> [seed]]
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent
DECODERS = ["llama3", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi3", "gpt2", "seed_oss"]
TEXTS = {
    "short": "The cat sat on the mat.",
    "long": "Attention is all you need; the cat sat on the mat, and then the cat sat on the mat again!",
}
torch.set_num_threads(2)


def byte_tokenizer(vocab_size):
    """A byte-level BPE without merges: each byte is its own token (the GPT-2 byte-to-unicode
    mapping gives its spelling), `<|endoftext|>` after the 256 bytes."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_of = {c: b for b, c in enumerate(bytes_to_unicode())}
    assert set(byte_of) == set(alphabet)
    vocab = {c: byte_of[c] for c in alphabet}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    assert fast.convert_tokens_to_ids("<|endoftext|>") == 256 and vocab_size > 256
    return fast


def bytes_to_unicode():
    """GPT-2's byte-to-character table, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def randomize(model, std, seed):
    """Every parameter drawn again: matrices N(0, std²), norm weights 1 + N(0, 0.5²), biases
    N(0, 0.1²) (norms randomized so that a wrong norm convention shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name or ".ln_" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g) if name.endswith("weight") else 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def references(folder, name):
    """What transformers computes on the folder: per text the ids, every attention weight, the
    last logits."""
    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    ref = {"architecture": name, "model_type": model.config.model_type, "hf_class": type(model).__name__,
           "transformers": transformers.__version__, "torch": torch.__version__, "texts": {}}
    arrays = {}
    for which, text in TEXTS.items():
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_attentions=True)
        attn = torch.stack([a[0] for a in out.attentions]).float().numpy()
        logits = out.logits[0, -1].float().numpy()
        arrays[f"attn_{which}"], arrays[f"logits_{which}"] = attn, logits
        ref["texts"][which] = {"text": text, "token_ids": ids, "n_tokens": len(ids), "attn_shape": list(attn.shape),
                               "rowsum_max_abs_dev": float(np.abs(attn.sum(-1) - 1).max()),
                               "max_weight": float(attn.max()), "next_token_argmax": int(logits.argmax())}
    return ref, arrays


def check():
    worst = 0.0
    for name in DECODERS:
        folder = HERE / name
        ref, arrays = references(folder, name)
        old = json.loads((folder / "reference.json").read_text())
        for which in TEXTS:
            got, want = ref["texts"][which], old["texts"][which]
            assert got["token_ids"] == want["token_ids"], f"{name} {which}: token ids"
            assert got["next_token_argmax"] == want["next_token_argmax"], f"{name} {which}: argmax"
        d = {k: float(np.abs(v - np.load(folder / f"{k}.npy")).max()) for k, v in arrays.items()}
        print(f"{name}: ids and argmax equal; max |difference| " + ", ".join(f"{k} {v:.1e}" for k, v in d.items()))
        assert all(v <= (1e-4 if k.startswith("logits") else 1e-5) for k, v in d.items()), name
        worst = max(worst, *d.values())
    print(f"every committed reference reproduced (transformers {transformers.__version__}, worst {worst:.1e})")


def write_references(folder, name):
    ref, arrays = references(folder, name)
    (folder / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    for k, v in arrays.items():
        np.save(folder / f"{k}.npy", v.astype(np.float32))
    print(f"{folder}: references written")


def new(name, out, seed):
    cfg = AutoConfig.from_pretrained(HERE / name)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    randomize(model, cfg.initializer_range, seed)
    out.mkdir(parents=True, exist_ok=False)
    model.save_pretrained(out)
    byte_tokenizer(cfg.vocab_size).save_pretrained(out)
    for extra in ["tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja"]:
        (out / extra).unlink(missing_ok=True)
    write_references(out, name)


if __name__ == "__main__":
    args = sys.argv[1:] or ["check"]
    if args[0] == "check":
        check()
    elif args[0] == "references":
        for n in args[1:]:
            write_references(HERE / n, n)
    elif args[0] == "new":
        new(args[1], Path(args[2]), int(args[3]) if len(args) > 3 else 0)
    else:
        raise SystemExit(__doc__)
