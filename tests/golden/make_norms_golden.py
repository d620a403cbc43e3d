# Norm-based attention golden numbers (Kobayashi et al. 2020) from Hugging Face transformers (eager,
# float32, weights dequantized from the same GGUF): for the last query of the shared sentence, every
# layer and head, alpha_ij * ||W_O^h v_j|| (v_j = v_proj output, bias included; o_proj's bias left
# out), and for each layer the whole-layer ||sum_h alpha^h_ij W_O^h v_j||.
# Writes float32 [layers, heads + 1, n]: index `heads` holds the whole-layer row.
# Run with the venv of ../shared/bench/hf_anchor.py:
#   python make_norms_golden.py qwen2.5-coder-0.5b qwen_transformers.json qwen_norms_lastrow.npy
import json, os, sys, numpy as np, torch
from transformers import AutoModelForCausalLM
alias, golden, out = sys.argv[1:4]
gguf = os.path.expanduser(f"~/.cache/attnscope/models/{alias}.gguf")
d, f = os.path.split(gguf)
m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, attn_implementation="eager").eval()
here = os.path.dirname(os.path.abspath(__file__))
ids = json.load(open(os.path.join(here, golden)))["token_ids"]
cfg = m.config
H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
vs = {}
for l, layer in enumerate(m.model.layers):
    layer.self_attn.v_proj.register_forward_hook(lambda mod, inp, o, l=l: vs.__setitem__(l, o[0].detach().double()))
with torch.no_grad():
    att = m(torch.tensor([ids]), output_attentions=True).attentions
n, q = len(ids), len(ids) - 1
res = np.zeros((len(att), H + 1, n), dtype=np.float32)
for l, a in enumerate(att):
    wo = m.model.layers[l].self_attn.o_proj.weight.detach().double()  # [d_model, H*hd]
    v = vs[l].view(n, KV, hd)
    alpha = a[0, :, q, :].double()  # [H, n]
    total = torch.zeros(n, wo.shape[0], dtype=torch.float64)
    for h in range(H):
        f = v[:, h // (H // KV), :] @ wo[:, h * hd:(h + 1) * hd].T  # [n, d_model]
        contrib = alpha[h][:, None] * f
        res[l, h] = contrib.norm(dim=1).numpy()
        total += contrib
    res[l, H] = total.norm(dim=1).numpy()
np.save(os.path.join(here, out), res)
print(out, res.shape, "max", res.max())
