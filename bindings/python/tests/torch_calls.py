"""#59's torch half, run by test_tl_hooks.py in the torch environment (torch imported: results are
torch tensors). It asserts, and prints the figures it measured:

1. backward hooks (``add_hook(fn, "bwd")``, ``run_with_hooks(bwd_hooks=)``) against torch autograd
   through transformers (tests/golden/<m>_hook_grads.npz, made by make_hookgrad_golden.py): the
   gradient each hook gets after ``.backward()`` of log p(top token) at the last position, with the
   metric in float64 (within 2e-4 of each point's largest) and in float32 as a TL user writes it
   (within 3e-3: torch's float32 log_softmax alone moves the gradient of the logits by up to
   1.6e-5), and of TL's float32 loss (``return_type="loss"``, within 1e-3);
2. torch tensors into every public call (tokens, token arguments, hooks' returns, cache methods'
   stacks), each result a torch tensor where it is an array, equal to the numpy call's;
3. bad tensors (a float token tensor, a tensor off the CPU, a hook returning the wrong shape or NaN
   or raising): a clear exception, the model unchanged after it;
4. run_with_cache / run_with_hooks timed with torch and numpy inputs (printed, not asserted)."""

import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

import attnscope
from attnscope import utils

ROOT = Path(__file__).resolve().parents[3]
CLEAN = "After Alice and Bob walked to the park, Bob handed a ball to"
CORRUPT = "After Alice and Bob walked to the park, Alice handed a ball to"
smol = attnscope.HookedModel.from_pretrained("smollm2-135m")
T = torch.Tensor


def rel(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.isfinite(got).all()
    return float(np.abs(got - want).max() / np.abs(want).max())


def grads_by_hooks(m, tokens, names, metric, via="add_hook"):
    got = {}

    def keep(grad, hook):
        assert isinstance(grad, T) and hook is m.hook_dict[hook.name]
        got[hook.name] = grad.clone()

    if via == "add_hook":
        for n in names:
            m.hook_dict[n].add_hook(keep, dir="bwd")
        value = metric(m(tokens))
    else:
        value = metric(m.run_with_hooks(tokens, bwd_hooks=[(n, keep) for n in names], reset_hooks_end=False))
    value.backward()
    m.reset_hooks()
    return float(value), got


def lp_top64(logits):
    last = logits[0, -1].double().log_softmax(-1)
    return last[last.argmax()]


def lp_top32(logits):
    last = logits[0, -1].log_softmax(-1)
    return last[last.argmax()]


def check_backward_hooks():
    worst = {}
    for key, name in (("smol", None), ("qwen", "qwen2.5-coder-0.5b")):
        # the references are transformers' unprocessed weights: fold_value_biases (from_pretrained's
        # default) moves each pattern row's gradient by dz·b_V, a constant the softmax removes
        m = smol if name is None else attnscope.HookedModel.from_pretrained_no_processing(name)
        ref = np.load(ROOT / "tests" / "golden" / f"{key}_hook_grads.npz")
        tokens = torch.tensor(ref["tokens"])[None]
        for prefix, metric, bound, via in (("lp", lp_top64, 2e-4, "add_hook"), ("lp", lp_top32, 3e-3, "run_with_hooks"),
                                           ("loss", None, 1e-3, "add_hook")):
            names = [k.split("/", 1)[1][: -len("_grad")] for k in ref.files if k.startswith(prefix + "/")]
            if metric is None:  # TL's loss, through run_with_hooks(return_type="loss")
                got = {}
                m.add_hook(lambda n: n in names, lambda g, h: got.__setitem__(h.name, g.clone()), "bwd")
                loss = m(tokens, return_type="loss")
                assert isinstance(loss, T) and loss.requires_grad
                value = float(loss)
                loss.backward()
                m.reset_hooks()
            else:
                value, got = grads_by_hooks(m, tokens, names, metric, via)
            assert abs(value - ref["values"][0 if prefix == "lp" else 1]) < 1e-4, (key, prefix, value)
            assert sorted(got) == sorted(names), (sorted(got), names)
            w = max(rel(got[n][0].numpy(), ref[f"{prefix}/{n}_grad"]) for n in names)
            label = f"{key} {prefix} ({'float64' if metric is lp_top64 else 'float32' if metric else 'loss'} metric)"
            print(f"backward hooks vs torch autograd, {label}: worst {w:.3g} of each point's largest (bound {bound:g})")
            assert w < bound, (label, w)
            worst[label] = w
        if name is not None:
            del m
    # a batch: each row's gradient is the row's own
    names = ["blocks.3.attn.hook_z", "hook_embed"]
    toks = smol.to_tokens([CLEAN, CORRUPT])
    _, both = grads_by_hooks(smol, toks, names, lambda lg: lg[:, -1].double().log_softmax(-1).max(-1).values.sum())
    for i in range(2):
        _, one = grads_by_hooks(smol, toks[i:i + 1], names, lp_top64)
        for n in names:
            assert rel(both[n][i], one[n][0]) < 1e-6, n
    # hook_result's gradient is hook_attn_out's for each head; a predicate's backward hook goes to
    # the points with a gradient, the others named in a warning
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = {}
        smol.add_hook(lambda n: n.startswith(("blocks.4.", "ln_final.")), lambda g, h: got.__setitem__(h.name, g.clone()),
                      "bwd")
        lp_top64(smol(toks[:1])).backward()
        smol.reset_hooks()
    assert any("ln_final.hook_scale" in str(x.message) and "ln_final.hook_normalized" in str(x.message) for x in w), w
    assert "ln_final.hook_scale" not in got and "blocks.4.hook_resid_post" in got
    assert "blocks.4.ln1.hook_scale" in got and "blocks.4.mlp.hook_post" in got  # #59: they have one now
    r, a = got["blocks.4.attn.hook_result"], got["blocks.4.hook_attn_out"]
    assert r.shape == a.shape[:2] + (smol.cfg.n_heads,) + a.shape[2:]
    assert all(torch.equal(r[:, :, h], a) for h in range(smol.cfg.n_heads))
    # TL's attribution-patching recipe (Attribution_Patching_Demo's get_cache_fwd_and_bwd, a
    # logit difference in float64): its gradients equal incl_bwd=True's (the engine's own seed)
    alice, bob = smol.to_single_token(" Alice"), smol.to_single_token(" Bob")
    cache, grad_cache = {}, {}
    smol.reset_hooks()
    smol.add_hook(lambda n: "hook_z" in n, lambda a, h: cache.__setitem__(h.name, a.detach().clone()), "fwd")
    smol.add_hook(lambda n: "hook_z" in n, lambda g, h: grad_cache.__setitem__(h.name, g.detach()), "bwd")
    logits = smol(toks[:1])
    value = logits[0, -1, alice].double() - logits[0, -1, bob].double()
    value.backward()
    smol.reset_hooks()
    grads = attnscope.ActivationCache(grad_cache, smol)
    _, want = smol.run_with_cache(toks[:1], names_filter="hook_z", incl_bwd=True, metric="logit_diff", target=alice, wrong=bob)
    w = max(rel(grads["z", l], want[f"blocks.{l}.attn.hook_z_grad"]) for l in range(smol.cfg.n_layers))
    print(f"TL's attribution recipe: hook_z gradients vs incl_bwd=True's, worst {w:.3g} of max (bound 1e-5)")
    assert w < 1e-5 and len(cache) == smol.cfg.n_layers
    # an editing forward hook and a backward hook: refused when the backward runs
    smol.add_hook("blocks.2.attn.hook_z", lambda a, h: a * 0)
    smol.add_hook("blocks.3.attn.hook_z", lambda g, h: None, "bwd")
    try:
        lp_top64(smol(toks[:1])).backward()
        raise AssertionError("an edited forward's backward was not refused")
    except RuntimeError as e:
        assert "edited blocks.2.attn.hook_z" in str(e), e
    smol.reset_hooks()
    # a backward hook removed before the backward does not run (TL: reset_hooks_end=True)
    ran = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        lg = smol.run_with_hooks(toks[:1], bwd_hooks=[("hook_embed", lambda g, h: ran.append(1))])
    assert any("removes the backward hooks" in str(x.message) for x in w)
    lp_top64(lg).backward() if lg.requires_grad else None
    assert ran == []
    return worst


def drop_timings(r):
    return {k: v for k, v in r.items() if k not in ("timings", "elapsed_s")} if isinstance(r, dict) else r


def check_every_call():
    ids_np = np.asarray(smol.to_tokens(CLEAN, prepend_bos=False).numpy())
    ids = torch.from_numpy(ids_np.copy())
    alice, bob = smol.to_single_token(" Alice"), smol.to_single_token(" Bob")
    calls = []

    def call(name, fn, want_tensor=True):
        r = fn()
        if want_tensor:
            assert isinstance(r, T), (name, type(r))
        calls.append(name)
        return r

    lg = call("__call__", lambda: smol(ids))
    assert np.array_equal(lg.numpy(), smol(ids_np).numpy())
    lg2, cache = call("run_with_cache", lambda: smol.run_with_cache(ids), False)
    assert isinstance(lg2, T) and isinstance(cache["z", 3], T) and np.array_equal(lg2.numpy(), lg.numpy())
    call("run_with_hooks", lambda: smol.run_with_hooks(ids, fwd_hooks=[("blocks.1.hook_resid_pre", lambda a, h: a * 1.0)]))
    edited = smol.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_z", lambda a, h: torch.zeros_like(a))])
    edited_np = smol.run_with_hooks(ids_np, fwd_hooks=[("blocks.1.attn.hook_z", lambda a, h: np.zeros(a.shape, np.float32))])
    assert np.array_equal(edited.numpy(), edited_np.numpy()) and not np.array_equal(edited.numpy(), lg.numpy())
    call("loss", lambda: smol.loss(lg, ids, per_token=True))
    call("lm_cross_entropy_loss", lambda: utils.lm_cross_entropy_loss(lg, ids))
    mean = call("return_type='loss'", lambda: smol(ids, return_type="loss"))  # TL's 0-d tensor
    assert mean.shape == () and mean.dtype == torch.float32 and abs(mean.item() - smol.loss(lg.numpy(), ids_np).item()) == 0
    # TL's computation in torch against numpy's float64: equal in float64, within 1e-4 in float32
    # (torch's float32 log_softmax over 49152 logits: 1.7e-5 measured)
    assert abs(float(utils.lm_cross_entropy_loss(lg.double(), ids)) - smol.loss(lg.numpy(), ids_np)) < 1e-9
    assert abs(float(utils.lm_cross_entropy_loss(lg, ids)) - smol.loss(lg.numpy(), ids_np)) < 1e-4
    call("to_str_tokens", lambda: smol.to_str_tokens(ids), False)
    assert smol.to_string(ids[0]) == CLEAN
    call("tokens_to_residual_directions", lambda: smol.tokens_to_residual_directions(ids[0, -3:]))
    assert smol.get_token_position(torch.tensor(bob), ids) == smol.get_token_position(bob, ids_np)
    g = call("generate", lambda: smol.generate(ids, max_new_tokens=3, return_type="tokens"))
    assert g[0, :ids.shape[1]].tolist() == ids[0].tolist()
    r = call("attribute", lambda: smol.attribute(ids, method="gradient", target=torch.tensor(alice)), False)
    assert isinstance(r["scores"], T) and np.array_equal(r["scores"].numpy(), smol.attribute(CLEAN, method="gradient", target=alice)["scores"].numpy())
    a = call("ablate", lambda: smol.ablate(ids, target=torch.tensor(alice)), False)
    assert a == smol.ablate(CLEAN, target=alice)
    cids = torch.from_numpy(np.asarray(smol.to_tokens(CORRUPT, prepend_bos=False).numpy()).copy())
    p = call("patch", lambda: smol.patch(ids, cids, answer=torch.tensor(bob), wrong=torch.tensor([alice])), False)
    assert p["results"] == smol.patch(CLEAN, CORRUPT, answer=bob, wrong=alice)["results"]
    c = call("circuit", lambda: smol.circuit(ids, cids, answer=torch.tensor(bob), wrong=torch.tensor(alice)), False)
    assert np.array_equal(np.asarray(c["scores"]), np.asarray(smol.circuit(CLEAN, CORRUPT, answer=bob, wrong=alice)["scores"]), equal_nan=True)
    for name in ("inspect", "faithfulness", "heads", "qk_attribution"):
        args = (ids,) if name != "qk_attribution" else (ids, 3, 0)
        r1 = call(name, lambda: getattr(smol, name)(*args), False)
        r2 = getattr(smol, name)(*((CLEAN,) + args[1:]))
        assert str(drop_timings(r1)) == str(drop_timings(r2)), name
    call("view", lambda: smol.view(ids), False)
    call("compare", lambda: smol.compare(ids, other_text=cids), False)
    # the cache methods with tensors in
    stack, labels = cache.decompose_resid(layer=-1, return_labels=True, pos_slice=torch.tensor(-1))
    assert isinstance(stack, T)
    calls.append("decompose_resid")
    s = call("apply_ln_to_stack", lambda: cache.apply_ln_to_stack(stack, layer=-1, pos_slice=-1))
    la = call("logit_attrs", lambda: cache.logit_attrs(stack, tokens=torch.tensor(alice), incorrect_tokens=torch.tensor(bob),
                                                       pos_slice=-1))
    assert np.allclose(la.numpy(), cache.logit_attrs(stack.numpy(), tokens=alice, incorrect_tokens=bob, pos_slice=-1).numpy())
    call("accumulated_resid", lambda: cache.accumulated_resid(layer=-1, pos_slice=torch.tensor([0, 2])))
    call("stack_head_results", lambda: cache.stack_head_results(layer=-1, pos_slice=(0, 3)))
    call("stack_activation", lambda: cache.stack_activation("pattern"))
    call("FactoredMatrix", lambda: smol.OV[3, 0].AB @ torch.ones(smol.cfg.d_model))
    call("viz.attention_patterns", lambda: attnscope.viz.attention_patterns(smol.to_str_tokens(ids), cache["pattern", 2][0]),
         False)
    call("tokenizer", lambda: smol.tokenizer(CLEAN, return_tensors="pt")["input_ids"])
    assert smol.tokenizer.decode(ids[0]) == CLEAN
    del s
    print(f"every public call took torch inputs: {', '.join(calls)}")


def check_bad_input():
    ids = smol.to_tokens(CLEAN, prepend_bos=False)
    before = smol(ids).numpy().copy()
    cases = [
        ("float tokens", lambda: smol(ids.float()), ValueError, "dtype"),
        ("tokens off the CPU", lambda: smol(torch.empty(1, 4, dtype=torch.int64, device="meta")), ValueError, "CPU"),
        ("target off the CPU", lambda: smol.ablate(CLEAN, target=torch.empty((), dtype=torch.int64, device="meta")),
         ValueError, "CPU"),
        ("hook: wrong shape", lambda: smol.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_z", lambda a, h: a[:, :2])]),
         ValueError, "shape"),
        ("hook: float64", lambda: smol.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_z", lambda a, h: a.double())]),
         TypeError, "float64"),
        ("hook: NaN", lambda: smol.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_z", lambda a, h: a * float("nan"))]),
         ValueError, "non-finite"),
        ("hook: off the CPU", lambda: smol.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_z", lambda a, h: a.to("meta"))]),
         ValueError, "CPU"),
        ("hook: raises", lambda: smol.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_z", lambda a, h: 1 / 0)]),
         ZeroDivisionError, "division"),
        ("backward hook: a point without a gradient", lambda: smol.ln_final.hook_scale.add_hook(lambda g, h: None, "bwd"),
         ValueError, "no gradient"),
    ]
    for label, fn, kind, words in cases:
        try:
            fn()
        except kind as e:
            assert words in str(e), (label, e)
            print(f"bad input, {label}: {type(e).__name__}: {str(e)[:150]}")
        else:
            raise AssertionError(f"{label}: no {kind.__name__}")
        assert all(not hp.fwd_hooks and not hp.bwd_hooks for hp in smol.hook_dict.values()), label
        assert np.array_equal(smol(ids).numpy(), before), label


def time_torch_vs_numpy():
    ids = smol.to_tokens(CLEAN * 4, prepend_bos=False)
    ids_np = ids.numpy().copy()
    hook = [("blocks.5.attn.hook_z", lambda a, h: None)]
    calls = {"run_with_cache": lambda x: smol.run_with_cache(x, names_filter="hook_pattern"),
             "run_with_hooks": lambda x: smol.run_with_hooks(x, fwd_hooks=hook)}
    for name, fn in calls.items():
        best = {}
        for kind, x in (("numpy", ids_np), ("torch", ids)) * 3:
            t0 = time.perf_counter()
            fn(x)
            best[kind] = min(best.get(kind, 1e9), time.perf_counter() - t0)
        print(f"timing {name} ({ids.shape[1]} tokens, best of 3): torch inputs {best['torch'] * 1e3:.1f} ms, "
              f"numpy inputs {best['numpy'] * 1e3:.1f} ms")


check_every_call()
check_backward_hooks()
check_bad_input()
time_torch_vs_numpy()
print("torch", torch.__version__, file=sys.stderr)
