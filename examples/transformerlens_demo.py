# Run with torch installed: python examples/transformerlens_demo.py (results come back as torch tensors)
# TransformerLens's "Exploratory Analysis Demo" style code, the import and the model name changed
import torch
import attnscope as transformer_lens
from attnscope import utils
from functools import partial

model = transformer_lens.HookedModel.from_pretrained("qwen2.5-coder-0.5b")
prompt = "After Alice and Bob walked to the park, Bob handed a ball to"
corrupt = "After Alice and Bob walked to the park, Alice handed a ball to"
tokens = model.to_tokens(prompt)
corrupted_tokens = model.to_tokens(corrupt)
answer, wrong = model.to_single_token(" Alice"), model.to_single_token(" Bob")

def logit_diff(logits):
    return (logits[0, -1, answer] - logits[0, -1, wrong]).item()

clean_logits, clean_cache = model.run_with_cache(tokens)
corrupted_logits = model(corrupted_tokens)
print(type(clean_logits), clean_logits.shape, "clean", logit_diff(clean_logits), "corrupt", logit_diff(corrupted_logits))

def patch_residual_component(corrupted_residual_component, hook, pos, clean_cache):
    corrupted_residual_component[:, pos, :] = clean_cache[hook.name][:, pos, :]
    return corrupted_residual_component

results = torch.zeros(model.cfg.n_layers, tokens.shape[1])
for layer in range(4):
    for position in range(tokens.shape[1]):
        hook_fn = partial(patch_residual_component, pos=position, clean_cache=clean_cache)
        patched_logits = model.run_with_hooks(corrupted_tokens, fwd_hooks=[(utils.get_act_name("resid_pre", layer), hook_fn)], return_type="logits")
        results[layer, position] = logit_diff(patched_logits)
print(results[:4])

def head_ablation_hook(value, hook, head_index_to_ablate):
    value[:, :, head_index_to_ablate, :] = 0.
    return value
ablated = model.run_with_hooks(tokens, return_type="loss", fwd_hooks=[(utils.get_act_name("z", 14), partial(head_ablation_hook, head_index_to_ablate=10))])
print("loss", model(tokens, return_type="loss"), "ablated", ablated)
# pattern ablation: every head of layer 3 attends to the first token only
def pattern_hook(pattern, hook):
    pattern[:] = 0.0
    pattern[..., 0] = 1.0
print("pattern-ablated diff", logit_diff(model.run_with_hooks(tokens, fwd_hooks=[("blocks.3.attn.hook_pattern", pattern_hook)])))
# DLA
per_head, labels = clean_cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
attrs = clean_cache.logit_attrs(clean_cache.apply_ln_to_stack(per_head, pos_slice=-1), " Alice", " Bob")
top = torch.topk(attrs[:, 0].abs(), 5)  # [head, batch]: pos_slice=-1 drops the position axis (TL's Slice)
print("top heads by DLA", [(labels[i], round(attrs[i, 0].item(), 3)) for i in top.indices.tolist()])
print(torch.allclose(clean_cache["pattern", 0].sum(-1), torch.ones(1)), clean_cache["pattern", 0, "attn"].softmax(-1).shape)
