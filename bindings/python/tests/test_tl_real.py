"""#59: attnscope against real TransformerLens on the same weights, with and without TL's weight
processing. TransformerLens 4 (`TransformerBridge.boot_transformers` + `enable_compatibility_mode`,
what TL's own demos use) runs offline on the Hugging Face model transformers builds from the same
GGUF, dequantized to float32.

Runs when `transformer_lens` and `torch` import; without them the module is skipped with the
reason, and `ATTNSCOPE_REQUIRE_TL=1` (CI) turns the skip into a failure. SmolLM2 by default;
`ATTNSCOPE_TL_MODELS=smollm2-135m,qwen2.5-coder-0.5b` adds the default model (slower)."""

import copy
import os

import numpy as np
import pytest

import attnscope

try:
    import torch
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer
except ImportError as e:  # pragma: no cover - depends on the environment
    if os.environ.get("ATTNSCOPE_REQUIRE_TL") == "1":
        raise
    pytest.skip(f"real TransformerLens is not installed ({e}): the comparison with it did NOT run",
                allow_module_level=True)

pytestmark = pytest.mark.usefixtures("numpy_results")

MODELS = os.environ.get("ATTNSCOPE_TL_MODELS", "smollm2-135m").split(",")
TEXT = "The cat sat on the mat because it was"
PROCESS = dict(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)
MODES = ("no_processing", "processed")
# TL's weights by attnscope's names (TL 4's bridge gives W_K/W_V one per KV head: attnscope's _W_K)
WEIGHTS = {"W_Q": "W_Q", "W_K": "_W_K", "W_V": "_W_V", "W_O": "W_O", "b_Q": "b_Q", "b_K": "_b_K",
           "b_V": "_b_V", "b_O": "b_O", "W_in": "W_in", "W_gate": "W_gate", "W_out": "W_out",
           "W_U": "W_U", "b_U": "b_U", "W_E": "W_E"}


def _tl_run(gguf: str, ids, mode: str) -> dict:
    """TL's logits, cache and weights (numpy) on `ids`, processed as `mode` says."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder, name = os.path.split(gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    b = TransformerBridge.boot_transformers("local", hf_model=hf, tokenizer=tok, device="cpu")
    b.enable_compatibility_mode(disable_warnings=True, no_processing=(mode == "no_processing"))
    with torch.no_grad():
        logits, cache = b.run_with_cache(torch.tensor([ids]))
    acts = {k: v.detach().float().numpy() for k, v in cache.items() if isinstance(v, torch.Tensor)}
    weights = {}
    for tl, ours in WEIGHTS.items():
        try:
            weights[ours] = getattr(b, tl).detach().float().numpy()
        except AttributeError:  # a bias the checkpoint does not have (TL raises for it)
            pass
    for norm in ("ln1", "ln2"):
        weights[f"{norm}.w"] = torch.stack([getattr(blk, norm).w for blk in b.blocks]).detach().numpy()
    weights["ln_final.w"] = b.ln_final.w.detach().numpy()
    return {"logits": logits.numpy(), "acts": acts, "weights": weights, "cache": cache, "cfg": b.cfg, "bridge": b}


@pytest.fixture(scope="module", params=MODELS)
def pair(request):
    """(alias, {mode: (attnscope model, its logits, its cache, TL's run)})."""
    alias = request.param
    gguf = os.path.join(os.environ.get("ATTNSCOPE_CACHE", os.path.expanduser("~/.cache/attnscope")),
                        "models", f"{alias}.gguf")
    if not os.path.exists(gguf):
        pytest.fail(f"{gguf} is missing: fetch {alias} first (attnscope fetch {alias})")
    torch.set_num_threads(2)
    runs = {}
    for mode in MODES:
        kw = PROCESS if mode == "processed" else {}
        m = attnscope.HookedModel.from_pretrained(alias, **kw)
        ids = [int(t) for t in m.to_tokens(TEXT)[0]]
        logits, cache = m.run_with_cache(np.array([ids]))
        runs[mode] = (m, logits, cache, _tl_run(gguf, ids, mode))
    return alias, runs


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    """The largest difference relative to the largest |value| of `want`; masked (-inf) cells must
    be masked in both."""
    assert got.shape == want.shape, (got.shape, want.shape)
    assert not np.isnan(want).any() and not np.isnan(got).any(), "a NaN cell"
    fin = np.isfinite(want)
    assert np.array_equal(fin, np.isfinite(got)), "the masked cells differ"
    scale = float(np.abs(want[fin]).max()) if fin.any() else 0.0
    diff = float(np.abs(got[fin].astype(np.float64) - want[fin]).max()) if fin.any() else 0.0
    return diff / scale if scale > 0 else diff


@pytest.mark.parametrize("mode", MODES)
def test_every_hook_point_matches_transformer_lens(pair, mode):
    alias, runs = pair
    _, _, cache, tl = runs[mode]
    compared, worst = 0, (0.0, "")
    for name, want in tl["acts"].items():
        if name not in cache.cache_dict:
            continue  # TL 4's own component hooks (hook_in/hook_out, rotary cos/sin): not TL 3's
        r = _rel(np.asarray(cache[name]), want)
        worst = max(worst, (r, name))
        compared += 1
    # every hook point attnscope captures is among them: 25 per block and the global ones
    assert compared >= 20 * len(runs[mode][0].blocks), compared
    print(f"\n{alias} {mode}: {compared} hook points, worst relative difference {worst[0]:.3g} ({worst[1]})")
    assert worst[0] <= 1e-4, worst


@pytest.mark.parametrize("mode", MODES)
def test_logits_match_transformer_lens(pair, mode):
    alias, runs = pair
    _, logits, _, tl = runs[mode]
    r = _rel(np.asarray(logits), tl["logits"])
    print(f"\n{alias} {mode}: logits' worst difference relative to the largest {r:.3g}")
    assert r <= 1e-4


@pytest.mark.parametrize("mode", MODES)
def test_weights_match_transformer_lens(pair, mode):
    alias, runs = pair
    m, _, _, tl = runs[mode]
    worst = (0.0, "")
    for name, want in tl["weights"].items():
        worst = max(worst, (_rel(m._weight(name), want), name))
    print(f"\n{alias} {mode}: {len(tl['weights'])} weights, worst relative difference {worst[0]:.3g} ({worst[1]})")
    assert worst[0] <= 1e-5, worst


def test_processing_leaves_the_attention_exact(pair):
    """The patterns do not move with the processing: layer 0's bit for bit, the later layers'
    within float32 rounding (fold_value_biases adds the same numbers in another order)."""
    alias, runs = pair
    (m, _, raw, _), (_, _, proc, _) = runs["no_processing"], runs["processed"]
    np.testing.assert_array_equal(raw["pattern", 0], proc["pattern", 0])
    worst = max(float(np.abs(raw["pattern", l] - proc["pattern", l]).max()) for l in range(len(m.blocks)))
    print(f"\n{alias}: processed vs unprocessed patterns, worst difference {worst:.3g}")
    assert worst <= 1e-5, worst


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


def test_every_cache_method_argument_means_what_it_means_in_transformer_lens(pair):
    """accumulated_resid, decompose_resid, stack_head_results (and apply_ln_to_stack through
    them) against TL's ActivationCache on the same run (processed: TL's default), labels and
    values, for every layer / pos_slice / incl_* form."""
    alias, runs = pair
    m, _, cache, tl = runs["processed"]
    n, worst = 0, (0.0, "")
    for method, kw in _cache_cases(m.cfg.n_layers):
        got, got_labels = getattr(cache, method)(return_labels=True, **kw)
        want, want_labels = getattr(tl["cache"], method)(return_labels=True, **kw)
        assert got_labels == want_labels, (method, kw)
        worst = max(worst, (_rel(np.asarray(got), want.detach().float().numpy()), f"{method}({kw})"))
        n += 1
    print(f"\n{alias}: {n} cache-method calls, worst relative difference {worst[0]:.3g} ({worst[1]})")
    assert worst[0] <= 1e-4, worst


def test_direct_logit_attribution_recipe_gives_the_logit(pair):
    """TL's recipe: decompose_resid(layer=-1) -> apply_ln_to_stack(layer=-1, pos_slice=-1) ->
    @ W_U[:, token] sums to the token's logit at the last position (processed weights), and
    logit_attrs gives TL's numbers."""
    alias, runs = pair
    m, logits, cache, tl = runs["processed"]
    tok = int(np.argmax(logits[0, -1]))
    stack = cache.decompose_resid(layer=-1, pos_slice=-1)
    scaled = np.asarray(cache.apply_ln_to_stack(stack, layer=-1, pos_slice=-1))
    total = float((scaled @ m.W_U[:, tok]).sum())
    print(f"\n{alias}: DLA recipe {total:.5f} vs the logit {float(logits[0, -1, tok]):.5f}")
    assert abs(total - float(logits[0, -1, tok])) <= 1e-4 * float(np.abs(logits).max())
    other = (tok + 1) % m.cfg.d_vocab
    got = np.asarray(cache.logit_attrs(stack, tok, other, pos_slice=-1))
    tl_stack = tl["cache"].decompose_resid(layer=-1, pos_slice=-1)
    want = tl["cache"].logit_attrs(tl_stack, tok, other, pos_slice=-1).detach().numpy()
    assert _rel(got, want) <= 1e-4
    rest = np.asarray(cache.stack_head_results(layer=0, incl_remainder=True))
    assert rest.shape[0] == 1 and np.array_equal(rest[0], cache["blocks.0.hook_resid_pre"])


KEYS = ["embed", "hook_embed", ("attn", 5), ("pattern", -1), ("scale", 1, "ln1"), ("normalized", 2, "ln2"),
        "scale", "normalized", ("resid_pre", 3), ("resid_pre", 3, "b"), "z3", ("q", 0, "attn"), ("k", 2),
        ("v", -2), ("attn_scores", 4), ("post", 4), ("pre", 4, "m"), ("mlp_out", 4), ("attn_out", -1),
        ("resid_post", -1), ("rot_q", 1), ("key", 2), ("query", 2), ("value", 2), ("attn_logits", 3),
        ("mlp_pre", 1), ("mlp_post", 1), ("pre_linear", 2), "blocks.3.attn.hook_z", "ln_final.hook_scale",
        ("pattern", 0, "attn"), ("resid_mid", -3, "block")]


def test_every_cache_key_form_means_what_it_means_in_transformer_lens(pair):
    """cache[key] for TL's key forms (short names, aliases, (name, layer[, layer_type]), negative
    layers) gives what TL's ActivationCache gives for the same key on the same run."""
    alias, runs = pair
    _, _, cache, tl = runs["processed"]
    for key in KEYS:
        want = tl["cache"][key].detach().float().numpy()
        assert _rel(np.asarray(cache[key]), want) <= 1e-4, key
    with pytest.raises(KeyError, match="close ones"):
        cache["blocks.3.attn.hook_zz"]


CFG = ("normalization_type positional_embedding_type act_fn eps d_vocab_out gated_mlp final_rms uses_rms_norm "
       "attn_only tokenizer_prepends_bos tokenizer_appends_eos use_attn_result parallel_attn_mlp n_key_value_heads "
       "d_head d_model d_mlp n_ctx d_vocab n_layers n_heads device").split()


def test_config_fields_have_transformer_lens_values(pair):
    """cfg's TransformerLens fields equal TL's for the same model (TL 4's bridge reports
    rotary_base 10000 and rotary_dim None for every family: attnscope gives the model's own;
    original_architecture is None in TL for a model handed over as hf_model)."""
    alias, runs = pair
    for mode in MODES:
        m, tl_cfg = runs[mode][0], runs[mode][3]["cfg"]
        diff = {f: (getattr(m.cfg, f), getattr(tl_cfg, f)) for f in CFG if getattr(m.cfg, f) != getattr(tl_cfg, f)}
        assert not diff, (mode, diff)


def test_test_prompt_prints_transformer_lens_ranks(pair, capsys):
    """utils.test_prompt: the same tokenization, answer ranks and top tokens as TL's own."""
    from transformer_lens import utilities as tl_utils  # TL 4: utilities (utils before 4.0)
    alias, runs = pair
    m, _, _, tl = runs["processed"]
    for answer in ("mat", ["mat", "floor", "chair"]):
        tl_utils.test_prompt("The cat sat on the", answer, tl["bridge"], prepend_bos=False, top_k=5)
        want = capsys.readouterr().out.splitlines()
        attnscope.utils.test_prompt("The cat sat on the", answer, m, prepend_bos=False, top_k=5)
        got = capsys.readouterr().out.splitlines()
        assert got[-1] == want[-1] and got[:2] == want[:2]
        tops = [line.rsplit("Token: ", 1)[1] for line in got if line.startswith("Top ")]
        assert tops == [line.rsplit("Token: ", 1)[1] for line in want if line.startswith("Top ")]
    with capsys.disabled():
        print(f"\n{alias}: test_prompt's ranks equal TL's: {got[-1]}")
