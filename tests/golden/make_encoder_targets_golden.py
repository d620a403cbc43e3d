#!/usr/bin/env python
"""Occlusion of an encoder's targets (issue #41) on all-MiniLM-L6-v2, with sentence-transformers.

For each text: the tokenizer's ids; the text's sentence embedding (SentenceTransformer.forward on
the ids: Transformer → mean Pooling → Normalize) and [CLS] vector (its token_embeddings' first
row); then for every position i, the same of the ids without token i, and the cosine similarity
of each to the text's (`cos_embedding`, `cos_cls`): the scores `attnscope attribute --method
occlusion --target embedding|cls` gives as 1 − cos.

Run: PYTHONPATH=/tmp/st_pkgs ~/.hfenv/bin/python tests/golden/make_encoder_targets_golden.py \
       ~/.cache/attnscope/models/all-minilm-l6-v2 tests/golden/minilm_occlusion.json
"""
import json, os, sys
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
import sentence_transformers, transformers
from sentence_transformers import SentenceTransformer

torch.set_num_threads(2)
folder, out = sys.argv[1], sys.argv[2]
st = SentenceTransformer(folder, device="cpu")
st.eval()
tok = st.tokenizer
texts = ["The cat sat on the mat.", "Paris is the capital of France!"]


def vectors(ids):
    f = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
         "token_type_ids": torch.zeros(1, len(ids), dtype=torch.long)}
    with torch.inference_mode():
        o = st(f)
    return o["sentence_embedding"][0].double(), o["token_embeddings"][0][0].double()


cos = torch.nn.functional.cosine_similarity
cases = []
for text in texts:
    ids = tok(text)["input_ids"]
    emb, cls = vectors(ids)
    ce, cc = [], []
    for i in range(len(ids)):
        e, c = vectors(ids[:i] + ids[i + 1:])
        ce.append(float(cos(e, emb, dim=0)))
        cc.append(float(cos(c, cls, dim=0)))
    cases.append({"text": text, "token_ids": ids, "cos_embedding": ce, "cos_cls": cc})
json.dump({"model": "all-minilm-l6-v2 (model.safetensors sha256 53aa5117...)",
           "sentence_transformers": sentence_transformers.__version__, "transformers": transformers.__version__,
           "torch": torch.__version__, "modules": [type(m).__name__ for m in st], "cases": cases},
          open(out, "w"), indent=1)
print({c["text"]: [round(1 - x, 4) for x in c["cos_embedding"]] for c in cases})
