# Occlusion golden numbers from Hugging Face transformers (eager, float32, weights dequantized from the
# same GGUF): the target's log-probability after the prompt, with each token deleted or replaced.
import json, os, sys, torch
from transformers import AutoModelForCausalLM
gguf = os.path.expanduser("~/.cache/attnscope/models/smollm2-135m.gguf")
d, f = os.path.split(gguf)
m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, attn_implementation="eager").eval()
ids = [int(x) for x in sys.argv[1].split(",")]
target, repl = int(sys.argv[2]), int(sys.argv[3])
def lp(toks):
    with torch.no_grad():
        out = m(torch.tensor([toks])).logits[0, -1].double()
    return float(torch.log_softmax(out, -1)[target])
base = lp(ids)
loo = [lp(ids[:j] + ids[j+1:]) - base for j in range(len(ids))]
rep = [lp(ids[:j] + [repl] + ids[j+1:]) - base for j in range(len(ids))]
json.dump({"source": "transformers %s, torch %s, eager attention, float32 from smollm2-135m.gguf" % (__import__("transformers").__version__, torch.__version__),
           "text": "The capital of France is", "target": " Paris", "token_ids": ids, "target_id": target, "replacement_id": repl,
           "target_logprob": base, "loo_delta": loo, "replace_delta": rep}, sys.stdout, indent=1)
