"""Sentence-transformers' embeddings of a few texts with all-MiniLM-L6-v2 (the golden of
tests/encoder.rs's `embed_matches_sentence_transformers` and the Python test_embed).

    PYTHONPATH=/tmp/st_pkgs ~/.hfenv/bin/python tests/golden/st_embeddings.py \
        ~/.cache/attnscope/models/all-minilm-l6-v2 tests/golden/minilm_st_embeddings.json
"""
import json
import sys

import torch
from sentence_transformers import SentenceTransformer

TEXTS = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog.",
    "Attention heads often attend to the separator token.",
    "Paris is the capital of France.",
]
PAIR = ("How old is the tower?", "It was built in 1889.")

torch.manual_seed(0)
folder, out = sys.argv[1], sys.argv[2]
m = SentenceTransformer(folder, device="cpu")
m.eval()
with torch.no_grad():
    norm = m.encode(TEXTS, batch_size=32, convert_to_numpy=True, normalize_embeddings=False)
    # the unnormalized mean pooling: the Transformer and Pooling modules alone
    feats = m.tokenize(TEXTS)
    feats = m[1](m[0](feats))
    raw = feats["sentence_embedding"].numpy()
    # a sentence pair: [CLS] A [SEP] B [SEP], token types 0 then 1, mean-pooled and normalized
    from transformers import AutoModel, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)(PAIR[0], PAIR[1], return_tensors="pt")
    last = AutoModel.from_pretrained(folder, attn_implementation="eager")(**tok).last_hidden_state[0]
    pair = torch.nn.functional.normalize(last.mean(0), dim=0).numpy()
import sentence_transformers, transformers
json.dump({
    "model": "all-minilm-l6-v2",
    "sentence_transformers": sentence_transformers.__version__,
    "transformers": transformers.__version__,
    "torch": torch.__version__,
    "texts": TEXTS,
    "normalized": [[float(x) for x in r] for r in norm],
    "mean_pooled": [[float(x) for x in r] for r in raw],
    "pair": list(PAIR),
    "pair_normalized": [float(x) for x in pair],
}, open(out, "w"))
print("wrote", out, norm.shape)
