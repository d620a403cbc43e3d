#!/usr/bin/env python
"""Tiny random RoBERTa and DistilBERT folders (issue #41), checked as arch/bert is.

tests/golden/arch/roberta/: a byte-level BPE tokenizer.json trained with `tokenizers` on a few
sentences (<s> A </s> / <s> A </s></s> B </s>, RobertaProcessing), RobertaForMaskedLM (2 layers,
4 heads, hidden 32, MLP 64, 40 positions + padding_idx 1 + 1, type_vocab_size 1, seed 43) saved with
save_pretrained: its tensors carry the `roberta.` prefix beside the task head `lm_head.*`, which
attnscope ignores.
tests/golden/arch/distilbert/: the WordPiece tokenizer of arch/bert (copied), DistilBertForSequenceClassification
(2 layers, 4 heads, dim 32, hidden_dim 64, 40 positions, seed 44): `distilbert.` prefix beside
`pre_classifier.*` and `classifier.*`.

reference.json holds each case's token ids (the tokenizer's), the token types the model uses (all 0:
RoBERTa has one type, DistilBERT none), the shares, the [CLS] (<s>) hidden state, mean pooling, and
attn_<case>.npy every attention weight [L, H, n, n] of the base model (eager, float32).

Run: ~/.hfenv/bin/python tests/golden/make_encoder_families_golden.py
"""
import json, os, shutil, unicodedata
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import numpy as np, torch
import transformers
from transformers import (DistilBertConfig, DistilBertForSequenceClassification, PreTrainedTokenizerFast,
                          RobertaConfig, RobertaForMaskedLM)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

here = os.path.dirname(os.path.abspath(__file__))
torch.set_num_threads(2)
CASES = [("single", "The cat sat on the mat.", None),
         ("pair", "What is it?", "The dog was happy, and it sat!")]


def is_punct(piece):
    piece = piece.lstrip("\u0120")
    return len(piece) > 0 and all(unicodedata.category(c).startswith("P") for c in piece)


def randomize(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():  # weights of a trained model's size: larger than init's 0.02
        for n, p in model.named_parameters():
            ln = ("LayerNorm" in n or "layer_norm" in n) and n.endswith("weight")
            p.copy_(torch.randn_like(p) * (1.0 if ln else 0.3) + (1.0 if ln else 0.0))


def run(tok, base, text, pair, cls_piece, sep_piece):
    enc = tok(text, pair) if pair is not None else tok(text)
    ids = enc["input_ids"]
    with torch.inference_mode():
        o = base(torch.tensor([ids]), output_attentions=True)
    att = torch.stack(o.attentions)[:, 0].numpy()
    pieces = tok.convert_ids_to_tokens(ids)
    hs = o.last_hidden_state[0].numpy()
    cls = [i for i, p in enumerate(pieces) if p == cls_piece]
    sep = [i for i, p in enumerate(pieces) if p == sep_piece]
    pun = [i for i, p in enumerate(pieces) if is_punct(p)]
    share = lambda cols: [float(att[l][:, :, cols].sum(-1).mean()) if cols else 0.0 for l in range(att.shape[0])]  # noqa
    return {"text": text, "pair": pair, "token_ids": ids, "token_types": [0] * len(ids), "pieces": pieces,
            "cls_share": share(cls), "sep_share": share(sep), "punct_share": share(pun),
            "cls_hidden": hs[0].tolist(), "mean_pooled": hs.mean(0).tolist(), "pooler_output": None,
            "attn_layers": list(range(att.shape[0]))}, att


def write(out, tok, base, hf_class, cls_piece, sep_piece):
    ref = {"hf_class": hf_class, "transformers": transformers.__version__, "torch": torch.__version__, "cases": {}}
    for name, text, pair in CASES:
        j, att = run(tok, base, text, pair, cls_piece, sep_piece)
        np.save(os.path.join(out, f"attn_{name}.npy"), att.astype(np.float32))
        ref["cases"][name] = j
    json.dump(ref, open(os.path.join(out, "reference.json"), "w"), indent=1, ensure_ascii=False)
    print(out, {k: len(v["token_ids"]) for k, v in ref["cases"].items()})


def tiny_roberta():
    out = os.path.join(here, "arch", "roberta")
    os.makedirs(out, exist_ok=True)
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    t = Tokenizer(models.BPE(unk_token=None))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    corpus = [c[1] for c in CASES] + [c[2] for c in CASES if c[2]] + ["the cat and the dog sat on a mat"] * 3
    t.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    t.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), add_prefix_space=False)
    t.save(os.path.join(out, "tokenizer.json"))
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(out, "tokenizer.json"), bos_token="<s>",
                                  eos_token="</s>", cls_token="<s>", sep_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", mask_token="<mask>")
    cfg = RobertaConfig(vocab_size=t.get_vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=42, type_vocab_size=1, pad_token_id=1,
                        bos_token_id=0, eos_token_id=2, hidden_act="gelu", layer_norm_eps=1e-5,
                        attn_implementation="eager")
    model = RobertaForMaskedLM(cfg).eval()
    randomize(model, 43)
    model.save_pretrained(out, safe_serialization=True)
    write(out, tok, model.roberta, "RobertaModel (RobertaForMaskedLM's base)", "<s>", "</s>")


def tiny_distilbert():
    out = os.path.join(here, "arch", "distilbert")
    os.makedirs(out, exist_ok=True)
    shutil.copy(os.path.join(here, "arch", "bert", "tokenizer.json"), os.path.join(out, "tokenizer.json"))
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(out, "tokenizer.json"), unk_token="[UNK]",
                                  cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]")
    cfg = DistilBertConfig(vocab_size=len(tok), dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                           max_position_embeddings=40, activation="gelu", sinusoidal_pos_embds=False,
                           pad_token_id=0, attn_implementation="eager")
    model = DistilBertForSequenceClassification(cfg).eval()
    randomize(model, 44)
    model.save_pretrained(out, safe_serialization=True)
    write(out, tok, model.distilbert, "DistilBertModel (DistilBertForSequenceClassification's base)", "[CLS]", "[SEP]")


if __name__ == "__main__":
    tiny_roberta()
    tiny_distilbert()
