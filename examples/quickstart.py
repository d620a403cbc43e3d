"""The TransformerLens quick start, on attnscope: change the import and the model name.

    python examples/quickstart.py [model]      (after `python3 -m pip install ./bindings/python`)
"""
import sys

import numpy as np

import attnscope  # instead of: from transformer_lens import HookedTransformer

model = attnscope.HookedModel.from_pretrained(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b")
print(model)

text = "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc."
logits, cache = model.run_with_cache(text, names_filter="hook_pattern")
tokens = model.to_str_tokens(text)
print(f"{len(tokens)} tokens; logits {logits.shape}; {len(cache)} patterns of shape {cache['pattern', 0].shape}")

# the attention sink: weight on the first token, last query, averaged over heads, per layer
sink = [float(cache["pattern", l][0, :, -1, 0].mean()) for l in range(model.cfg.n_layers)]
peak = int(np.argmax(sink))
print("sink profile:", " ".join(f"{s:.2f}" for s in sink), f"(peak: layer {peak})")

# the last layer's heads, from the last token: where does each look?
last = cache["pattern", -1][0, :, -1]
for h in range(4):
    top = np.argsort(-last[h])[:3]
    print(f"head {h}: " + ", ".join(f"{tokens[j]!r} {last[h, j]:.2f}" for j in top))

print("next token:", repr(model.to_string([int(np.argmax(logits[0, -1]))])))

# the view (inline in a notebook; here saved to a file)
view = attnscope.viz.attention_heads(cache["pattern", peak][0], tokens)
print("wrote", view.save("attnscope-quickstart.html"))
