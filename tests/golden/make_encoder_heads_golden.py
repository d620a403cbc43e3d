#!/usr/bin/env python
"""An encoder's head roles (issue #41), computed independently from transformers' attentions
(BertModel, eager, float32, output_attentions=True), as attnscope defines them (Clark et al. 2019,
"What does BERT look at?"): for each layer and head, the mean over the n queries i of
  previous_token  A[i, i-1]                       (0 for i = 0)
  next_token      A[i, i+1]                       (0 for i = n-1)
  cls             sum of A[i, j] over the [CLS] keys j
  sep             sum of A[i, j] over the [SEP] keys j
  broad           H(A[i, :]) / ln n,  H = -sum_j A[i, j] ln A[i, j]  (nats; 1 = uniform)
and the score of a uniform head (A = 1/n): (n-1)/n^2, (n-1)/n^2, #[CLS]/n, #[SEP]/n, 1.

Cases: all-MiniLM-L6-v2 on the lesson's sentence and a pair, the tiny BERT of tests/golden/arch/bert
on its single text and pair (that folder's tokenizer.json and weights, made by make_encoder_golden.py).
Writes tests/golden/encoder_heads.json.

Run: MINILM=~/.cache/attnscope/models/all-minilm-l6-v2 ~/.hfenv/bin/python tests/golden/make_encoder_heads_golden.py
"""
import json, math, os
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import numpy as np, torch
from transformers import AutoTokenizer, BertModel, PreTrainedTokenizerFast

here = os.path.dirname(os.path.abspath(__file__))
torch.set_num_threads(2)


def roles(att, ids, cls_id, sep_id):
    """att: float64 [L, H, n, n]."""
    n = att.shape[-1]
    prev = np.zeros(att.shape[:2])
    nxt = np.zeros(att.shape[:2])
    for i in range(n):
        if i >= 1:
            prev += att[:, :, i, i - 1]
        if i + 1 < n:
            nxt += att[:, :, i, i + 1]
    cls_cols = [j for j, t in enumerate(ids) if t == cls_id]
    sep_cols = [j for j, t in enumerate(ids) if t == sep_id]
    plogp = np.where(att > 0, att * np.log(np.where(att > 0, att, 1.0)), 0.0)
    ent = -plogp.sum(-1)  # [L, H, n]
    broad = ent.mean(-1) / math.log(n) if n > 1 else np.zeros(att.shape[:2])
    r = {
        "previous_token": prev / n,
        "next_token": nxt / n,
        "cls": att[:, :, :, cls_cols].sum(-1).mean(-1),
        "sep": att[:, :, :, sep_cols].sum(-1).mean(-1),
        "broad": broad,
    }
    uniform = {"previous_token": (n - 1) / n**2, "next_token": (n - 1) / n**2,
               "cls": len(cls_cols) / n, "sep": len(sep_cols) / n, "broad": 1.0}
    return {k: v.tolist() for k, v in r.items()}, uniform


def case(tok, model, text, pair):
    enc = tok(text, pair, return_token_type_ids=True) if pair is not None else tok(text, return_token_type_ids=True)
    ids, types = enc["input_ids"], enc["token_type_ids"]
    with torch.inference_mode():
        o = model(torch.tensor([ids]), token_type_ids=torch.tensor([types]), output_attentions=True)
    att = torch.stack(o.attentions)[:, 0].double().numpy()
    r, u = roles(att, ids, tok.cls_token_id, tok.sep_token_id)
    return {"text": text, "pair": pair, "token_ids": ids, "token_types": types, "roles": r, "uniform": u}


def main():
    out = {"transformers": __import__("transformers").__version__, "torch": torch.__version__, "cases": {}}
    d = os.path.expanduser(os.environ["MINILM"])
    tok = AutoTokenizer.from_pretrained(d)
    model = BertModel.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    for name, text, pair in [("minilm_lesson", "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc.", None),
                             ("minilm_pair", "How old are you?", "I am six years old.")]:
        out["cases"][name] = {"model": "all-minilm-l6-v2", **case(tok, model, text, pair)}
    b = os.path.join(here, "arch", "bert")
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(b, "tokenizer.json"), unk_token="[UNK]",
                                  cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]")
    model = BertModel.from_pretrained(b, dtype=torch.float32, attn_implementation="eager").eval()
    for name, text, pair in [("tiny_single", "The cat sat on the mat.", None),
                             ("tiny_pair", "What is it?", "The dog was happy, and it sat!")]:
        out["cases"][name] = {"model": "arch/bert", **case(tok, model, text, pair)}
    json.dump(out, open(os.path.join(here, "encoder_heads.json"), "w"), indent=1, ensure_ascii=False)
    sep = np.array(out["cases"]["minilm_lesson"]["roles"]["sep"])
    print("MiniLM lesson: [SEP] role per layer (mean over heads)", np.round(sep.mean(1), 3).tolist())
    for k in ["previous_token", "next_token", "broad"]:
        a = np.array(out["cases"]["minilm_lesson"]["roles"][k])
        l, h = np.unravel_index(a.argmax(), a.shape)
        print(f"top {k}: {l}.{h} {a[l, h]:.3f}")


if __name__ == "__main__":
    main()
