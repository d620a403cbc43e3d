"""tests/golden/tokenizer_hf.json: what transformers' tokenizer gives for SmolLM2's and
Qwen2.5's GGUFs (the ids with and without special tokens, decode, batch_decode,
convert_ids_to_tokens, a padded batch, the special tokens' ids), for
bindings/python/tests/test_tl_hooks.py's model.tokenizer check.
Run: REF_MODEL_DIR=<folder with the GGUFs> /root/.hfenv/bin/python tests/golden/make_tokenizer_golden.py"""
import json
import os
from pathlib import Path

from transformers import AutoTokenizer

DIR = os.environ.get("REF_MODEL_DIR", ".")
FILES = {"smol": "SmolLM2-135M-Instruct.Q4_1.gguf", "qwen": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"}
TEXTS = ["Hello world", " leading space and  two", "Hà Nội là thủ đô của Việt Nam.", "def f(x):\n    return x**2\n",
         "emoji 🙂 and 中文", "<|endoftext|> inside"]
out = {}
for key, f in FILES.items():
    tok = AutoTokenizer.from_pretrained(DIR, gguf_file=f)
    rows = {}
    for t in TEXTS:
        ids = tok.encode(t)
        rows[t] = {"ids": ids, "ids_plain": tok.encode(t, add_special_tokens=False), "decode": tok.decode(ids),
                   "tokens": tok.convert_ids_to_tokens(ids)}
    batch = tok(TEXTS[:3], padding=True)
    out[key] = {"texts": rows, "batch_ids": batch["input_ids"], "batch_mask": batch["attention_mask"],
                "batch_decode": tok.batch_decode(batch["input_ids"]),
                "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
                "padding_side": tok.padding_side, "vocab_size": tok.vocab_size, "len": len(tok)}
Path(__file__).with_name("tokenizer_hf.json").write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
