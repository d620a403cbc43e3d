#!/usr/bin/env python
"""The Python route for `attnscope ablate`, timed: transformers + torch, a GGUF dequantized to f32,
eager attention, every head zero-ablated in turn with a forward pre-hook on o_proj (its slice of
o_proj's input set to 0: TransformerLens's hook_z), as ../shared/reference/scripts/interventions_ref.py
does. Prints one JSON line: load time, the sweep's wall time, the number of forwards, threads, and the
largest |delta log p| (to check both tools measured the same thing).

  $HOME/.hfenv/bin/python hf_ablate.py --gguf MODEL.gguf [--text "..."] [--threads 2]
"""
import argparse, json, os, time

ap = argparse.ArgumentParser()
ap.add_argument("--gguf", required=True)
ap.add_argument("--text", default="Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc.")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--method", choices=["zero", "mean"], default="zero")
a = ap.parse_args()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
t0 = time.perf_counter()
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

torch.set_num_threads(a.threads)
d, f = os.path.split(os.path.abspath(a.gguf))
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, attn_implementation="eager").eval()
load_s = time.perf_counter() - t0
cfg = model.config
L, H = cfg.num_hidden_layers, cfg.num_attention_heads
D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
ids = torch.tensor([tok(a.text, add_special_tokens=False)["input_ids"]])


def last_logprobs():
    with torch.inference_mode():
        return torch.log_softmax(model(ids, use_cache=False).logits[0, -1].double(), -1)


t1 = time.perf_counter()
base = last_logprobs()
target = int(base.argmax())
largest = 0.0
for l in range(L):
    for h in range(H):
        def pre(mod, args, h=h):
            x = args[0].clone()
            s = slice(h * D, (h + 1) * D)
            x[..., s] = 0.0 if a.method == "zero" else x[..., s].mean(dim=1, keepdim=True)
            return (x,) + tuple(args[1:])
        hd = model.model.layers[l].self_attn.o_proj.register_forward_pre_hook(pre)
        try:
            largest = max(largest, abs(float(last_logprobs()[target] - base[target])))
        finally:
            hd.remove()
sweep_s = time.perf_counter() - t1
print(json.dumps({"load_s": round(load_s, 3), "sweep_s": round(sweep_s, 3), "forwards": L * H + 1,
                  "heads": L * H, "tokens": ids.shape[1], "threads": torch.get_num_threads(),
                  "largest_abs_delta": largest, "torch": torch.__version__}))
