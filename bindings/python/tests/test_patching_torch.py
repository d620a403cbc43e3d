"""attnscope.patching's sweeps against torch forward hooks on the Hugging Face model, and
HookedRootModule (a torch module): the part of test_patching.py that needs torch and transformers.
Collected where torch imports (conftest.py); tests/python.rs runs it in target/tlenv beside
test_tl_real.py, so CI runs it (target/pyenv has no torch, on purpose)."""

import numpy as np
import pytest

import attnscope.patching as patching
from cells import assert_cells
from test_patching import ANSWER, LLAMA, WRONG, metric, tiny  # noqa: F401 (tiny is a fixture)


def test_sweeps_against_torch_hooks(tiny):
    """resid_pre by position, z and v per head against the Hugging Face model with torch forward
    hooks doing the same patches (an independent forward)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        pytest.skip(f"torch and transformers are needed for the comparison with torch hooks ({e}): it did NOT run")
    m, clean, corrupt, cache = tiny
    hf = AutoModelForCausalLM.from_pretrained(str(LLAMA), dtype=torch.float32, attn_implementation="eager").eval()
    worst = 0.0
    for fn, module, cut in (
        (patching.get_act_patch_resid_pre, lambda l: hf.model.layers[l], "resid"),
        (patching.get_act_patch_attn_head_out_all_pos, lambda l: hf.model.layers[l].self_attn.o_proj, "z"),
        (patching.get_act_patch_attn_head_v_all_pos, lambda l: hf.model.layers[l].self_attn.v_proj, "v"),
    ):
        got = np.asarray(fn(m, corrupt, cache, metric), dtype=np.float64)
        want = _torch_sweep(hf, torch, module, cut, clean, corrupt, got.shape)
        worst = max(worst, float(np.abs(got - want).max()))
    print(f"patching sweeps vs torch hooks: worst {worst:.2e}")
    assert worst < 2e-5  # measured 4.9e-6 (transformers 5, torch 2.15)


def _torch_sweep(hf, torch, module, cut, clean, corrupt, shape):
    """The sweep with torch hooks: resid (a block's input at one position), z (o_proj's input, one
    head's d_head slice at every position), v (v_proj's output, one KV head's slice)."""
    dh = hf.config.hidden_size // hf.config.num_attention_heads
    ct, xt = torch.tensor(np.asarray(clean)), torch.tensor(np.asarray(corrupt))
    saved = {}

    def save(l):
        def pre(mod, args, kwargs=None):
            saved[l] = (args[0] if args else kwargs["hidden_states"]).clone()
        return pre
    with torch.no_grad():
        out = np.zeros(shape)
        for l in range(shape[0]):
            mod = module(l)
            if cut == "v":
                h = mod.register_forward_hook(lambda mod, a, o, l=l: saved.__setitem__(l, o.clone()))
            else:
                h = mod.register_forward_pre_hook(save(l), with_kwargs=True)
            hf(ct)
            h.remove()
            for j in range(shape[1]):
                sl = (slice(None), j) if cut == "resid" else (slice(None), slice(None), slice(j * dh, (j + 1) * dh))
                out[l, j] = _patched(hf, torch, mod, cut, saved[l], sl, xt)
    return out


def _patched(hf, torch, mod, cut, clean_act, sl, xt):
    def pre(m, args, kwargs):
        x = (args[0] if args else kwargs["hidden_states"]).clone()
        x[sl] = clean_act[sl]
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    def post(m, a, o):
        o = o.clone()
        o[sl] = clean_act[sl]
        return o
    h = mod.register_forward_hook(post) if cut == "v" else mod.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        lg = hf(xt).logits.double()
    finally:
        h.remove()
    return float(lg[0, -1, ANSWER] - lg[0, -1, WRONG])


def test_hooked_root_module_runs_tl_main_demo_toy_model():
    """TL's Main_Demo toy model (x -> x² + 3 -> (·)² - 4) on attnscope's HookedRootModule and
    HookPoint: the cache holds each point's value in the order the forward reached it, and a hook
    that returns 0 at layer2.hook_square makes the output the offset (-4), worked by hand."""
    try:
        import torch
    except ImportError as e:
        pytest.skip(f"HookedRootModule is a torch module ({e}): it did NOT run")
    from attnscope import HookedRootModule, HookPoint

    class SquareThenAdd(torch.nn.Module):
        def __init__(self, offset):
            super().__init__()
            self.offset = torch.nn.Parameter(torch.tensor(offset))
            self.hook_square = HookPoint()

        def forward(self, x):
            return self.offset + self.hook_square(x * x)

    class TwoLayerModel(HookedRootModule):
        def __init__(self):
            super().__init__()
            self.layer1, self.layer2 = SquareThenAdd(3.0), SquareThenAdd(-4.0)
            self.hook_in, self.hook_mid, self.hook_out = HookPoint(), HookPoint(), HookPoint()
            self.setup()

        def forward(self, x):
            return self.hook_out(self.layer2(self.hook_mid(self.layer1(self.hook_in(x)))))

    model = TwoLayerModel()
    out, cache = model.run_with_cache(torch.tensor(5.0))
    assert out.item() == 780.0
    assert [(k, v.item()) for k, v in cache.items()] == [
        ("hook_in", 5.0), ("layer1.hook_square", 25.0), ("hook_mid", 28.0), ("layer2.hook_square", 784.0),
        ("hook_out", 780.0)]
    seen = []

    def zero(x, hook):
        seen.append(hook.name)
        return torch.tensor(0.0)
    assert model.run_with_hooks(torch.tensor(5.0), fwd_hooks=[("layer2.hook_square", zero)]).item() == -4.0
    assert seen == ["layer2.hook_square"] and model(torch.tensor(5.0)).item() == 780.0  # the hook is gone
    with pytest.raises(KeyError, match="layer3"):
        model.run_with_hooks(torch.tensor(5.0), fwd_hooks=[("layer3.hook_square", zero)])


def test_a_gradient_cache_stacks_each_heads_result_gradient(smol):
    """#59 (TL's Attribution_Patching_Demo, cells 11 and 17): a cache of the gradients that backward
    hooks at hook_z and hook_result read, as ActivationCache(grads, model); its stack_head_results stacks
    the cached hook_result, each head's output gradient: attn_out sums the heads' outputs, so every
    head's is attn_out's gradient (torch autograd: tests/golden/smol_hook_grads.npz, as
    test_hook_grads.py). Before, it put hook_z's gradient through W_O in their place (79x TL's
    largest value in the demo's head_out_attr)."""
    import attnscope
    import test_hook_grads as hg

    grads = {}
    attnscope.set_array_type("torch")  # as in the demo (the tiny fixture above leaves numpy set)
    smol.reset_hooks()
    keep = ("attn.hook_z", "attn.hook_result")
    smol.add_hook(lambda name: name.endswith(keep), lambda g, hook: grads.__setitem__(hook.name, g.detach()), "bwd")
    try:
        logits = smol(smol.to_tokens(hg.CLEAN, prepend_bos=False))
        (logits[0, -1, hg.ANSWER] - logits[0, -1, hg.WRONG]).backward()
    finally:
        smol.reset_hooks()
        attnscope.set_array_type("auto")
    cache = attnscope.ActivationCache(grads, smol)
    stack = np.asarray(cache.stack_head_results(layer=4))
    heads = smol.cfg.n_heads
    assert stack.shape == (4 * heads, 1, len(hg.REF["tokens"]), smol.cfg.d_model)
    want = hg.REF["ld/blocks.3.hook_attn_out_grad"]
    for h in range(heads):
        assert_cells(f"L3H{h} hook_result grad vs torch", stack[3 * heads + h, 0], want, rel_max=2e-4)
    summed = np.asarray(grads["blocks.3.attn.hook_result"]).sum(2)  # [1, pos, d_model]: no head axis
    with pytest.raises(ValueError, match="one output per head"):
        attnscope.ActivationCache({"blocks.0.attn.hook_result": summed}, smol).stack_head_results(layer=1)
