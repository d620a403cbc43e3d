# Token ids that transformers gives for the tiny SentencePiece vocabulary of
# src/model/tiny.rs::tiny_sentencepiece_md (rebuilt here token by token; the token list is saved
# too, and the Rust test checks it is the same), written as a tokenizer-only GGUF for each shape
# transformers knows: llama with and without add_space_prefix, gemma3, phi3. transformers reads the
# GGUF with its own converter (convert_gguf_tokenizer). Run with the venv of
# ../shared/bench/hf_anchor.py: `python make_sentencepiece_golden.py` (writes sentencepiece_tiny.json).
import json, os, tempfile
import gguf
from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

tokens = ["<pad>", "<eos>", "<bos>", "<unk>"]
types = [3] * 4
for b in range(256):
    tokens.append(f"<0x{b:02X}>")
    types.append(6)
for t in ["\u2581", "  ", "\t"]:
    tokens.append(t)
    types.append(1 if t == "\u2581" else 4)
for c in "abcdefghijklmnopqrstuvwxyz":
    tokens.append(c)
    types.append(1)
for t in ["\u2581t", "he", "\u2581the", "\u2581a", "at", "\u2581h", "\u2581hat"]:
    tokens.append(t)
    types.append(1)
scores = [(-i / 1000.0 if len(t) > 1 and not t.startswith("<") and t.strip() == t else -1000.0) for i, t in enumerate(tokens)]

texts = ["the hat", "the  hat", " the hat", "hat the", "that", "a\tb", "é", "thé hat", "a  b   c", "the\nhat", "<bos>the", "xyz", "  ", "theat", "hhat hat"]
out = {"tokens": tokens, "producer": "transformers convert_gguf_tokenizer on a tokenizer-only GGUF; encode(text, add_special_tokens=False)", "vectors": {}}
for arch, prefix in [("llama", True), ("llama", False), ("gemma3", False), ("phi3", True)]:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "sp.gguf")
        w = gguf.GGUFWriter(path, arch)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(prefix)
        w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
        a, tok_dict, _ = get_gguf_tokenizer(path)
        backend, _ = convert_gguf_tokenizer(a, tok_dict)
        key = f"{arch}{'' if arch != 'llama' else ('+prefix' if prefix else '-prefix')}"
        out["vectors"][key] = [{"text": t, "ids": backend.encode(t, add_special_tokens=False).ids} for t in texts]
json.dump(out, open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sentencepiece_tiny.json"), "w"), ensure_ascii=False, indent=1)
print({k: v[:3] for k, v in out["vectors"].items()})
