"""#59: attnscope against real TransformerLens on the same weights, with and without TL's weight
processing, cell by cell (cells.assert_cells), each bound a small factor above what it measures.
TL 4's `TransformerBridge.boot_transformers` + `enable_compatibility_mode` (what TL's own demos
use; it needs torch >= 2.6 and transformers >= 5.9) runs offline on the Hugging Face model
transformers builds from the same GGUF, dequantized to float32.

CI runs it: bindings/python/tests/tl_env.sh makes `target/tlenv` (torch, transformers and
transformer-lens 4.3.0 from PyPI, pinned by .ci/tlenv-pins.txt) and tests/python.rs
(`transformer_lens_comparison_passes`) runs this file there with `ATTNSCOPE_REQUIRE_TL=1`.
Without TL the module is skipped with the reason (conftest.py does not even collect it), and
`ATTNSCOPE_REQUIRE_TL=1` turns the skip into a failure. `ATTNSCOPE_TL_MODELS` (comma-separated
aliases) picks the models: SmolLM2 and the default model unless it says otherwise, each loaded
processed and not, one (model, mode) at a time."""

import gc
import importlib.metadata
import os

import numpy as np
import pytest

import attnscope
from cells import assert_cells

try:
    import torch
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer
except ImportError as e:  # pragma: no cover - depends on the environment
    if os.environ.get("ATTNSCOPE_REQUIRE_TL") == "1":
        raise
    pytest.skip(f"real TransformerLens >= 4 is not installed ({e}): the comparison with it did NOT run "
                "(bindings/python/tests/tl_env.sh installs it)", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("numpy_results")

TL_VERSION = importlib.metadata.version("transformer-lens")
MODELS = os.environ.get("ATTNSCOPE_TL_MODELS", "smollm2-135m,qwen2.5-coder-0.5b").split(",")
TEXT = "The cat sat on the mat because it was"
MODES = ("no_processing", "processed")
# the bounds, each 1.5-5x what it measures (TL 4.3, transformers 5.25, torch 2.15; AMX exact
# kernels), relative to the reference's largest |value|; the ceilings are 1e-4
# (activations, logits) and 1e-5 (weights)
BOUNDS = {
    #                     hooks  logits weights methods patterns (processed vs not)
    "smollm2-135m":       (5e-5, 2e-5, 3e-7, 4e-5, 1e-6),  # 1.59e-5, 6.3e-6, 7.3e-8, 1.26e-5, 0
    # 6.75e-5, 5.2e-6, 0 unprocessed / 2.3e-7 processed (b_O), 8.7e-6, 4.3e-6
    "qwen2.5-coder-0.5b": (1e-4, 2e-5, 1e-6, 4e-5, 2e-5),
}
# TL's weights by attnscope's names (TL 4's bridge gives W_K/W_V one per KV head: attnscope's _W_K)
WEIGHTS = {"W_Q": "W_Q", "W_K": "_W_K", "W_V": "_W_V", "W_O": "W_O", "b_Q": "b_Q", "b_K": "_b_K",
           "b_V": "_b_V", "b_O": "b_O", "W_in": "W_in", "W_gate": "W_gate", "W_out": "W_out",
           "W_U": "W_U", "b_U": "b_U", "W_E": "W_E"}


def _bound(alias: str, what: str) -> float:
    return BOUNDS[alias][("hooks", "logits", "weights", "methods", "patterns").index(what)]


def _hf(gguf: str, tied: bool):
    """The tokenizer and float32 model transformers builds from the GGUF."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder, name = os.path.split(gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    if tied and hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr():
        hf.lm_head.weight = hf.model.embed_tokens.weight  # a tied GGUF has no lm_head of its own
    return tok, hf


def _tl_run(hf_pair, ids, mode: str) -> dict:
    """TL's logits and cache (and numpy copies of its activations) on `ids`, processed as `mode`
    says."""
    tok, hf = hf_pair
    b = TransformerBridge.boot_transformers("local", hf_model=hf, tokenizer=tok, device="cpu")
    b.enable_compatibility_mode(disable_warnings=True, no_processing=(mode == "no_processing"))
    with torch.no_grad():
        logits, cache = b.run_with_cache(torch.tensor([ids]))
    acts = {k: v.detach().float().numpy() for k, v in cache.items() if isinstance(v, torch.Tensor)}
    return {"logits": logits.numpy(), "acts": acts, "cache": cache, "cfg": b.cfg, "bridge": b}


def _tl_weights(b):
    """(attnscope's name, TL's weight as numpy), one at a time (memory: TL builds each stacked
    over the layers; the default model's together are ~2 GB)."""
    for tl, ours in WEIGHTS.items():
        try:
            yield ours, getattr(b, tl).detach().float().numpy()
        except AttributeError:  # a bias the checkpoint does not have (TL raises for it)
            pass
    ones = torch.ones(b.cfg.d_model)  # a folded norm may have no weight: ones
    for norm in ("ln1", "ln2"):
        yield f"{norm}.w", torch.stack([getattr(getattr(blk, norm), "w", ones) for blk in b.blocks]).detach().numpy()
    yield "ln_final.w", getattr(b.ln_final, "w", ones).detach().numpy()


# one (model, mode) at a time: pytest runs every test of a run before the next loads, and each is
# let go before the next (both modes of a model at once peaked at 16.0 GB on the default model)
RUNS = [(alias, mode) for alias in MODELS for mode in MODES]


@pytest.fixture(scope="module", params=RUNS, ids=[f"{a}-{m}" for a, m in RUNS])
def run(request):
    """(alias, mode, attnscope model, token ids, its logits, its cache, TL's run) for one model
    loaded both ways: processed is from_pretrained's default and TL's own."""
    alias, mode = request.param
    gguf = os.path.join(os.environ.get("ATTNSCOPE_CACHE", os.path.expanduser("~/.cache/attnscope")),
                        "models", f"{alias}.gguf")
    if not os.path.exists(gguf):
        pytest.fail(f"{gguf} is missing: fetch {alias} first (attnscope fetch {alias})")
    torch.set_num_threads(2)
    m = _load(alias, mode)
    ids = [int(t) for t in m.to_tokens(TEXT)[0]]
    logits, cache = m.run_with_cache(np.array([ids]))
    # TL 4's bridge processes the HF model it wraps in place: a fresh one per run
    tl = _tl_run(_hf(gguf, m.facts["tied_embeddings"]), ids, mode)
    yield alias, mode, m, ids, logits, cache, tl
    del m, cache, tl
    gc.collect()


def _load(alias: str, mode: str):
    return (attnscope.HookedModel.from_pretrained if mode == "processed"
            else attnscope.HookedModel.from_pretrained_no_processing)(alias)


@pytest.fixture
def say(capsys):
    """print past pytest's capture: each check's worst difference shows in CI's log without -s
    (which would also print every assert_cells line)."""
    def _say(line: str):
        with capsys.disabled():
            print(line)
    return _say


def _rel(label: str, got, want, bound: float) -> float:
    """assert_cells within `bound` of the reference's largest |value|; the worst difference
    relative to it. Masked (-inf) cells must be masked in both, and are left out. A large array
    (W_E, W_U: 136M cells on Qwen2.5) is compared in slices of its first axes, each cell once,
    against the whole array's largest value (float64 copies of the whole would not fit)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (label, got.shape, want.shape)
    masked = np.isneginf(want)
    assert np.array_equal(masked, np.isneginf(got)), f"{label}: the masked cells differ"
    if masked.any():
        got, want = np.where(masked, 0.0, got), np.where(masked, 0.0, want)
    if want.size == 0:  # e.g. stack_head_results(layer=0): no heads before layer 0, in both
        return 0.0
    scale = float(np.abs(want).max())
    if want.size <= 1 << 24:
        worst = assert_cells(label, got, want, rel_max=bound)
    else:
        rows = got.reshape(-1, got.shape[-1]) if got.ndim > 1 else got.reshape(1, -1)
        ref = want.reshape(rows.shape)
        step = max(1, (1 << 22) // rows.shape[1])
        worst = max(assert_cells(f"{label} rows {a}:{a + step} of {len(rows)}", rows[a:a + step], ref[a:a + step],
                                 atol=bound * scale) for a in range(0, len(rows), step))
    return worst / scale if scale > 0 else worst


def test_every_hook_point_matches_transformer_lens(run, say):
    alias, mode, m, _, _, cache, tl = run
    compared, worst = 0, (0.0, "")
    for name, want in tl["acts"].items():
        if name not in cache.cache_dict:
            continue  # TL 4's own component hooks (hook_in/hook_out, rotary cos/sin): not TL 3's
        worst = max(worst, (_rel(f"{alias} {mode} {name}", cache[name], want, _bound(alias, "hooks")), name))
        compared += 1
    # every hook point attnscope captures is among them: 25 per block and the global ones
    assert compared >= 20 * len(m.blocks), compared
    say(f"\n{alias} {mode}: {compared} hook points, worst relative difference {worst[0]:.3g} ({worst[1]})")


def test_logits_match_transformer_lens(run, say):
    alias, mode, _, _, logits, _, tl = run
    r = _rel(f"{alias} {mode} logits", logits, tl["logits"], _bound(alias, "logits"))
    say(f"\n{alias} {mode}: logits' worst difference relative to the largest {r:.3g}")


def test_weights_match_transformer_lens(run, say):
    alias, mode, m, _, _, _, tl = run
    worst, n = (0.0, ""), 0
    for name, want in _tl_weights(tl["bridge"]):
        worst = max(worst, (_rel(f"{alias} {mode} {name}", m._weight(name), want, _bound(alias, "weights")), name))
        n += 1
    say(f"\n{alias} {mode}: {n} weights, worst relative difference {worst[0]:.3g} ({worst[1]})")


def test_processing_leaves_the_attention_exact(run, say):
    """The patterns do not move with the processing (this run's against attnscope's other load):
    layer 0's bit for bit, the later layers' within float32 rounding (fold_value_biases adds the
    same numbers in another order)."""
    alias, mode, m, ids, _, cache, _ = run
    other_mode = MODES[1 - MODES.index(mode)]
    _, other = _load(alias, other_mode).run_with_cache(np.array([ids]), names_filter=lambda n: n.endswith("hook_pattern"))
    np.testing.assert_array_equal(cache["pattern", 0], other["pattern", 0])
    worst = max(assert_cells(f"{alias} pattern {l} {mode} vs {other_mode}", cache["pattern", l], other["pattern", l],
                             atol=_bound(alias, "patterns")) for l in range(len(m.blocks)))
    say(f"\n{alias} {mode}: patterns against {other_mode}, worst difference {worst:.3g}")


def _cache_cases(n_layers: int):
    """(method, kwargs) over every layer / pos_slice / incl_* argument form of TL's cache methods,
    negatives included."""
    mid = n_layers // 2
    slices = (None, -1, 0, (1, 4), [0, 2, 3])
    for layer in (None, -1, 0, mid, n_layers):
        for pos in slices:
            for kw in (dict(), dict(incl_mid=True), dict(apply_ln=True)):
                yield "accumulated_resid", dict(layer=layer, pos_slice=pos, **kw)
            for kw in (dict(), dict(mode="attn"), dict(mode="mlp"), dict(apply_ln=True), dict(incl_embeds=False)):
                if layer == 0 and kw.get("incl_embeds") is False:
                    continue  # nothing to stack: TL fails inside torch.stack, attnscope names it
                yield "decompose_resid", dict(layer=layer, pos_slice=pos, **kw)
        yield "accumulated_resid", dict(layer=mid, mlp_input=True, apply_ln=True)
        yield "decompose_resid", dict(layer=mid, mlp_input=True, apply_ln=True)
    for layer in (-1, 0, mid):
        for pos in slices:
            for kw in (dict(), dict(incl_remainder=True), dict(apply_ln=True)):
                if layer == 0 and kw.get("incl_remainder"):
                    # TL takes resid_post[layer - 1] = resid_post[-1], the final stream; the rest
                    # of the stream before layer 0 is the embedding (attnscope's, tested below)
                    continue
                yield "stack_head_results", dict(layer=layer, pos_slice=pos, **kw)


def test_every_cache_method_argument_means_what_it_means_in_transformer_lens(run, say):
    """accumulated_resid, decompose_resid, stack_head_results (and apply_ln_to_stack through
    them) against TL's ActivationCache on the same run, labels and values, for every layer /
    pos_slice / incl_* form."""
    alias, mode, m, _, _, cache, tl = run
    n, worst = 0, (0.0, "")
    for method, kw in _cache_cases(m.cfg.n_layers):
        got, got_labels = getattr(cache, method)(return_labels=True, **kw)
        want, want_labels = getattr(tl["cache"], method)(return_labels=True, **kw)
        assert got_labels == want_labels, (method, kw)
        label = f"{alias} {method}({kw})"
        worst = max(worst, (_rel(label, got, want.detach().float().numpy(), _bound(alias, "methods")), label))
        n += 1
    say(f"\n{alias} {mode}: {n} cache-method calls, worst relative difference {worst[0]:.3g} ({worst[1]})")


def test_direct_logit_attribution_recipe_gives_the_logit(run, say):
    """TL's recipe: decompose_resid(layer=-1) -> apply_ln_to_stack(layer=-1, pos_slice=-1) ->
    @ W_U[:, token] gives TL's sum, which is the token's logit at the last position with the
    processed weights (the recipe needs fold_ln: unprocessed, TL's sum is not the logit either),
    and logit_attrs gives TL's numbers (unprocessed, with the final norm's weight applied)."""
    alias, mode, m, _, logits, cache, tl = run
    tok = int(np.argmax(logits[0, -1]))
    stack = cache.decompose_resid(layer=-1, pos_slice=-1)
    scaled = np.asarray(cache.apply_ln_to_stack(stack, layer=-1, pos_slice=-1))
    total = (scaled.astype(np.float64) @ m.W_U[:, tok].astype(np.float64)).sum() + float(m.b_U[tok])
    tl_stack = tl["cache"].decompose_resid(layer=-1, pos_slice=-1)
    tl_scaled = tl["cache"].apply_ln_to_stack(tl_stack, layer=-1, pos_slice=-1).detach().double().numpy()
    b, other = tl["bridge"], (tok + 1) % m.cfg.d_vocab
    u = b.W_U[:, [tok, other]].detach().double().numpy()  # the two columns: W_U is 0.5 GB on Qwen2.5
    tl_b_U = getattr(b, "b_U", None)  # TL raises for a bias the checkpoint lacks
    tl_total = (tl_scaled @ u[:, 0]).sum() + (float(tl_b_U[tok]) if tl_b_U is not None else 0.0)
    r = _rel(f"{alias} {mode} DLA recipe vs TL's", [total], [tl_total], _bound(alias, "methods"))
    say(f"\n{alias} {mode}: DLA recipe {total:.6f}, TL's {tl_total:.6f} ({r:.3g} of it), the logit {float(logits[0, -1, tok]):.6f}")
    if mode == "processed":
        assert_cells(f"{alias} DLA recipe vs the logit", [total], [logits[0, -1, tok]], atol=2e-5)
    got = np.asarray(cache.logit_attrs(stack, tok, other, pos_slice=-1))
    if mode == "processed":
        want = tl["cache"].logit_attrs(tl_stack, tok, other, pos_slice=-1).detach().numpy()
    else:  # attnscope applies the final norm's weight, so the parts add up to the logit; TL's
        # unprocessed logit_attrs leaves it out (its docs warn that the result is then misleading)
        want = tl_scaled @ ((u[:, 0] - u[:, 1]) * b.ln_final.w.detach().double().numpy())
    r = _rel(f"{alias} logit_attrs", got, want, _bound(alias, "methods"))
    say(f"\n{alias} {mode}: logit_attrs' worst difference relative to the largest {r:.3g}")
    rest = np.asarray(cache.stack_head_results(layer=0, incl_remainder=True))
    assert rest.shape[0] == 1 and np.array_equal(rest[0], cache["blocks.0.hook_resid_pre"])


KEYS = ["embed", "hook_embed", ("attn", 5), ("pattern", -1), ("scale", 1, "ln1"), ("normalized", 2, "ln2"),
        "scale", "normalized", ("resid_pre", 3), ("resid_pre", 3, "b"), "z3", ("q", 0, "attn"), ("k", 2),
        ("v", -2), ("attn_scores", 4), ("post", 4), ("pre", 4, "m"), ("mlp_out", 4), ("attn_out", -1),
        ("resid_post", -1), ("rot_q", 1), ("key", 2), ("query", 2), ("value", 2), ("attn_logits", 3),
        ("mlp_pre", 1), ("mlp_post", 1), ("pre_linear", 2), "blocks.3.attn.hook_z", "ln_final.hook_scale",
        ("pattern", 0, "attn"), ("resid_mid", -3, "block")]


def test_every_cache_key_form_means_what_it_means_in_transformer_lens(run, say):
    """cache[key] for TL's key forms (short names, aliases, (name, layer[, layer_type]), negative
    layers) gives what TL's ActivationCache gives for the same key on the same run."""
    alias, mode, _, _, _, cache, tl = run
    worst = (0.0, "")
    for key in KEYS:
        want = tl["cache"][key].detach().float().numpy()
        worst = max(worst, (_rel(f"{alias} cache[{key!r}]", cache[key], want, _bound(alias, "hooks")), repr(key)))
    say(f"\n{alias} {mode}: {len(KEYS)} cache key forms, worst relative difference {worst[0]:.3g} (cache[{worst[1]}])")
    with pytest.raises(KeyError, match="close ones"):
        cache["blocks.3.attn.hook_zz"]


CFG = ("normalization_type positional_embedding_type act_fn eps d_vocab_out gated_mlp final_rms uses_rms_norm "
       "attn_only tokenizer_prepends_bos tokenizer_appends_eos use_attn_result parallel_attn_mlp n_key_value_heads "
       "d_head d_model d_mlp n_ctx d_vocab n_layers n_heads device").split()


def test_config_fields_have_transformer_lens_values(run):
    """cfg's TransformerLens fields equal TL's for the same model (TL 4's bridge reports
    rotary_base 10000 and rotary_dim None for every family: attnscope gives the model's own;
    original_architecture is None in TL for a model handed over as hf_model)."""
    alias, mode, m, _, _, _, tl = run
    diff = {f: (getattr(m.cfg, f), getattr(tl["cfg"], f)) for f in CFG if getattr(m.cfg, f) != getattr(tl["cfg"], f)}
    assert not diff, (alias, mode, diff)


def test_test_prompt_prints_transformer_lens_ranks(run, capsys):
    """utils.test_prompt: the same tokenization, answer ranks and top tokens as TL's own."""
    from transformer_lens import utilities as tl_utils  # TL 4: utilities (utils before 4.0)

    alias, mode, m, _, _, _, tl = run
    for answer in ("mat", ["mat", "floor", "chair"]):
        tl_utils.test_prompt("The cat sat on the", answer, tl["bridge"], prepend_bos=False, top_k=5)
        want = capsys.readouterr().out.splitlines()
        attnscope.utils.test_prompt("The cat sat on the", answer, m, prepend_bos=False, top_k=5)
        got = capsys.readouterr().out.splitlines()
        assert got[-1] == want[-1] and got[:2] == want[:2]
        tops = [line.rsplit("Token: ", 1)[1] for line in got if line.startswith("Top ")]
        assert tops == [line.rsplit("Token: ", 1)[1] for line in want if line.startswith("Top ")]
    with capsys.disabled():
        print(f"\n{alias} {mode}: test_prompt's ranks equal TL's: {got[-1]}")
