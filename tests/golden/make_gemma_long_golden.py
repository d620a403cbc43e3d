# Gemma 3 270M on a text longer than its 512-token sliding window, from Hugging Face transformers
# (eager, float32, weights dequantized from the same GGUF, <bos> first as the tokenizer adds it):
# the token ids, the attention of the last query and of query 300 for every layer and head
# (float32 [2, layers, heads, n]), and the next-token top-5 logits. The sliding layers hide the
# first tokens (and <bos>) from the last query; the full layers (5, 11, 17) do not.
# Run with the venv of ../shared/bench/hf_anchor.py:
#   python make_gemma_long_golden.py   (writes gemma_long.json and gemma_long_attn.npy)
import json, os, numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf = os.path.expanduser("~/.cache/attnscope/models/gemma3-270m.gguf")
d, f = os.path.split(gguf)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, attn_implementation="eager").eval()
paras = [
    "The river rose slowly through the night, and by morning the lower fields were under water.",
    "Farmers moved their animals to the hills while children carried sandbags along the dike.",
    "Nobody in the village could remember a flood like it, not even the oldest fisherman.",
    "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc, bên bờ sông Hồng.",
    "In 1999 the council built a new pump station; it failed twice before it worked at all.",
    "def mean(xs):\n    return sum(xs) / len(xs)  # the average of a list of numbers\n",
    "Attention weights say where a head looks, not what the model would lose without it.",
]
text = " ".join(paras[i % len(paras)] + f" (part {i})" for i in range(30))
ids = tok(text)["input_ids"]
assert ids[0] == 2 and 600 <= len(ids) <= 900, len(ids)
with torch.no_grad():
    out = m(torch.tensor([ids]), output_attentions=True)
n = len(ids)
att = np.stack([np.stack([a[0, :, q, :].numpy() for a in out.attentions]) for q in (n - 1, 300)]).astype(np.float32)
logits = out.logits[0, -1].double()
top = torch.topk(logits, 5)
here = os.path.dirname(os.path.abspath(__file__))
np.save(os.path.join(here, "gemma_long_attn.npy"), att)
json.dump({"text": text, "token_ids": ids, "queries": [n - 1, 300],
           "next_token_top5": [{"id": int(i), "logit": round(float(v), 4)} for v, i in zip(top.values, top.indices)],
           "producer": "tests/golden/make_gemma_long_golden.py: transformers eager float32 from the gemma3-270m GGUF"},
          open(os.path.join(here, "gemma_long.json"), "w"), ensure_ascii=False, indent=1)
print("n", n, "attn", att.shape)
