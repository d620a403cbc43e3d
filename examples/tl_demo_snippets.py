# TransformerLens demo snippets (Main_Demo, Exploratory_Analysis_Demo) with the import and model name changed,
# run against attnscope; each prints ok or why it fails. Needs torch and einops:
#   PYTHONPATH=bindings/python/python python examples/tl_demo_snippets.py
import time
from functools import partial
import torch, einops
from attnscope import HookedModel as HookedTransformer, utils
MODEL = "smollm2-135m"
model = HookedTransformer.from_pretrained(MODEL)
results = {}
def snippet(name):
    def deco(f):
        t = time.time()
        try:
            f(); results[name] = "ok"
        except Exception as e:
            results[name] = f"FAIL {type(e).__name__}: {str(e)[:160]}"
        print(f"{name}: {results[name]} ({time.time()-t:.1f}s)", flush=True)
    return deco

text = "TransformerLens lets you load in 50+ different open source language models, and exposes the internal activations of the model to you."
@snippet("main: model(text, return_type='both')")
def _():
    logits, loss = model(text, return_type="both")
    print("  loss", float(loss), tuple(logits.shape))

@snippet("main: run_with_cache remove_batch_dim, cache['pattern', 0, 'attn']")
def _():
    global cache
    logits, cache = model.run_with_cache(text, remove_batch_dim=True)
    attention_pattern = cache["pattern", 0, "attn"]
    str_tokens = model.to_str_tokens(text)
    assert attention_pattern.shape[-1] == len(str_tokens)

@snippet("main: layer-0 pattern from q and k (einsum, torch.testing.assert_close)")
def _():
    layer0_pattern_from_cache = cache["pattern", 0]
    q, k = cache["q", 0], cache["k", 0]
    seq, nhead, headsize = q.shape
    layer0_attn_scores = einops.einsum(q, k, "seqQ n h, seqK n h -> n seqQ seqK")
    mask = torch.triu(torch.ones((seq, seq), dtype=torch.bool), diagonal=1)
    layer0_attn_scores.masked_fill_(mask, -1e9)
    layer0_pattern_from_q_and_k = (layer0_attn_scores / headsize**0.5).softmax(-1)
    torch.testing.assert_close(layer0_pattern_from_cache, layer0_pattern_from_q_and_k)

@snippet("main: head ablation on hook_v, return_type='loss'")
def _():
    layer_to_ablate, head_index_to_ablate = 0, 8
    def head_ablation_hook(value, hook):
        value[:, :, head_index_to_ablate, :] = 0.
        return value
    tokens = model.to_tokens(text)
    original_loss = model(tokens, return_type="loss")
    ablated_loss = model.run_with_hooks(tokens, return_type="loss",
        fwd_hooks=[(utils.get_act_name("v", layer_to_ablate), head_ablation_hook)])
    print(f"  {original_loss:.3f} {ablated_loss:.3f}")

@snippet("main: head ablation on hook_z (same, z)")
def _():
    def head_ablation_hook(value, hook):
        value[:, :, 8, :] = 0.
        return value
    tokens = model.to_tokens(text)
    a = model(tokens, return_type="loss")
    b = model.run_with_hooks(tokens, return_type="loss", fwd_hooks=[(utils.get_act_name("z", 0), head_ablation_hook)])
    print(f"  {a:.3f} {b:.3f}")

clean_prompt = "After John and Mary went to the store, Mary gave a bottle of milk to"
corrupted_prompt = "After John and Mary went to the store, John gave a bottle of milk to"
@snippet("main: IOI residual-stream patching (layers x positions)")
def _():
    clean_tokens = model.to_tokens(clean_prompt)
    corrupted_tokens = model.to_tokens(corrupted_prompt)
    def logits_to_logit_diff(logits, correct_answer=" John", incorrect_answer=" Mary"):
        correct_index = model.to_single_token(correct_answer)
        incorrect_index = model.to_single_token(incorrect_answer)
        return logits[0, -1, correct_index] - logits[0, -1, incorrect_index]
    clean_logits, clean_cache = model.run_with_cache(clean_tokens)
    clean_logit_diff = logits_to_logit_diff(clean_logits)
    corrupted_logits = model(corrupted_tokens)
    corrupted_logit_diff = logits_to_logit_diff(corrupted_logits)
    def residual_stream_patching_hook(resid_pre, hook, position):
        clean_resid_pre = clean_cache[hook.name]
        resid_pre[:, position, :] = clean_resid_pre[:, position, :]
        return resid_pre
    num_positions = len(clean_tokens[0])
    ioi_patching_result = torch.zeros((model.cfg.n_layers, num_positions), device=model.cfg.device)
    for layer in range(model.cfg.n_layers):
        for position in range(num_positions):
            temp_hook_fn = partial(residual_stream_patching_hook, position=position)
            patched_logits = model.run_with_hooks(corrupted_tokens, fwd_hooks=[(utils.get_act_name("resid_pre", layer), temp_hook_fn)])
            patched_logit_diff = logits_to_logit_diff(patched_logits).detach()
            ioi_patching_result[layer, position] = (patched_logit_diff - corrupted_logit_diff) / (clean_logit_diff - corrupted_logit_diff)

@snippet("main: induction scores with a batch of 10 and a pattern hook (names filter)")
def _():
    batch_size, seq_len = 10, 50
    size = (batch_size, seq_len)
    input_tensor = torch.randint(1000, 10000, size)
    random_tokens = input_tensor.to(model.cfg.device)
    repeated_tokens = einops.repeat(random_tokens, "batch seq_len -> batch (2 seq_len)")
    repeated_logits = model(repeated_tokens)
    correct_log_probs = model.loss_fn(repeated_logits, repeated_tokens, per_token=True)

@snippet("main: induction scores (without cfg.device / loss_fn)")
def _():
    batch_size, seq_len = 10, 50
    repeated_tokens = einops.repeat(torch.randint(1000, 10000, (batch_size, seq_len)), "batch seq_len -> batch (2 seq_len)")
    induction_score_store = torch.zeros((model.cfg.n_layers, model.cfg.n_heads))
    def induction_score_hook(pattern, hook):
        induction_stripe = pattern.diagonal(dim1=-2, dim2=-1, offset=1 - seq_len)
        induction_score = einops.reduce(induction_stripe, "batch index pos -> index", "mean")
        induction_score_store[hook.layer(), :] = induction_score
    pattern_hook_names_filter = lambda name: name.endswith("pattern")
    model.run_with_hooks(repeated_tokens, return_type=None, fwd_hooks=[(pattern_hook_names_filter, induction_score_hook)])
    print("  best induction head score", float(induction_score_store.max()))

@snippet("exploratory: batched prompts, to_tokens(list), logit diff")
def _():
    prompts = ["When John and Mary went to the shops, John gave the bag to",
               "When Tom and James went to the park, James gave the ball to"]
    answers = [(" Mary", " John"), (" Tom", " James")]
    answer_tokens = torch.tensor([[model.to_single_token(a) for a in pair] for pair in answers])
    tokens = model.to_tokens(prompts, prepend_bos=True)
    original_logits, cache = model.run_with_cache(tokens)
    final_logits = original_logits[:, -1, :]
    answer_logits = final_logits.gather(dim=-1, index=answer_tokens)
    answer_logit_diff = answer_logits[:, 0] - answer_logits[:, 1]
    print("  logit diffs", answer_logit_diff.tolist())

@snippet("exploratory: tokens_to_residual_directions + accumulated_resid")
def _():
    tokens = model.to_tokens(["When John and Mary went to the shops, John gave the bag to"])
    _, cache = model.run_with_cache(tokens)
    answer_residual_directions = model.tokens_to_residual_directions(torch.tensor([[model.to_single_token(" Mary"), model.to_single_token(" John")]]))

@snippet("exploratory: accumulated_resid + apply_ln_to_stack")
def _():
    tokens = model.to_tokens(["When John and Mary went to the shops, John gave the bag to"])
    _, cache = model.run_with_cache(tokens)
    accumulated_residual, labels = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, return_labels=True)
    scaled = cache.apply_ln_to_stack(accumulated_residual, layer=-1, pos_slice=-1)

@snippet("weights: W_Q shapes and an OV circuit from W_V @ W_O")
def _():
    assert model.W_Q.shape == (model.cfg.n_layers, model.cfg.n_heads, model.cfg.d_model, model.cfg.d_head)
    OV = model.W_V[1, 4] @ model.W_O[1, 4]
    assert OV.shape == (model.cfg.d_model, model.cfg.d_model)
    print("  blocks[0].attn.W_Q", tuple(model.blocks[0].attn.W_Q.shape))

@snippet("weights: model.OV FactoredMatrix")
def _():
    model.OV[1, 4].eigenvalues

@snippet("main: stop_at_layer")
def _():
    r = model(text, stop_at_layer=3)
    print("  ", tuple(r.shape))

@snippet("main: generate")
def _():
    model.generate("The cat", max_new_tokens=5)

print()
ok = sum(v == "ok" for v in results.values())
print(f"{ok} of {len(results)} snippets ran")
