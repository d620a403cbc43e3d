"""TransformerLens's API beyond the hooks: the weights in TL's shapes (W_Q ... W_U), stop_at_layer,
and batches of padded texts. The weights are checked against the hooks they make (on SmolLM2, a
llama GGUF whose q/k rows llama.cpp interleaves, and Qwen2.5, with q/k/v biases), q and k against
Hugging Face transformers (tests/golden/qk_layer3.npz), batches against each text run alone."""

from pathlib import Path

import numpy as np
import pytest

import attnscope
from cells import assert_cells

ROOT = Path(__file__).resolve().parents[3]
QK = np.load(ROOT / "tests" / "golden" / "qk_layer3.npz")
TEXT = "The cat sat on the mat because it was tired"


pytestmark = pytest.mark.usefixtures("numpy_results")


@pytest.mark.parametrize("which", ["smol", "qwen"])
def test_q_and_k_hooks_are_in_hugging_faces_row_order(which, request):
    m = request.getfixturevalue(which)
    ids = QK[f"{which}_ids"]
    assert m.to_tokens(TEXT)[0].tolist() == ids.tolist()
    _, cache = m.run_with_cache(ids, names_filter=["blocks.3.attn.hook_q", "blocks.3.attn.hook_k"])
    n = len(ids)
    q, k = cache["q", 3][0].reshape(n, -1), cache["k", 3][0].reshape(n, -1)
    # transformers on the dequantized file: measured within 1e-6 of the largest value (up to ~27)
    for name, got in (("q", q), ("k", k)):
        want = QK[f"{which}_{name}"]
        bound = 5e-6 * max(1.0, np.abs(want).max())
        assert_cells(f"{which} blocks.3 hook_{name} [position, head x d_head] vs transformers", got, want, atol=bound)


@pytest.mark.parametrize("which", ["smol", "qwen"])
def test_weights_in_transformerlens_shapes_make_the_hooks(which, request):
    m = request.getfixturevalue(which)
    c = m.cfg
    L, H, G, dh, dm, ff = c.n_layers, c.n_heads, c.n_key_value_heads, c.d_head, c.d_model, c.d_mlp
    assert m.W_Q.shape == (L, H, dm, dh) and m.W_K.shape == (L, H, dm, dh) and m.W_V.shape == (L, H, dm, dh)
    assert m.W_O.shape == (L, H, dh, dm) and m.b_Q.shape == (L, H, dh) and m.b_K.shape == (L, H, dh)
    assert m.b_O.shape == (L, dm) and m.W_in.shape == (L, dm, ff) and m.W_gate.shape == (L, dm, ff)
    assert m.W_out.shape == (L, ff, dm) and m.b_in.shape == (L, ff) and m.b_out.shape == (L, dm)
    assert m.W_E.shape == (c.d_vocab, dm) and m.W_U.shape == (dm, c.d_vocab) and m.b_U.shape == (c.d_vocab,)
    # GQA: TransformerLens repeats each KV set for its query heads (repeat_interleave)
    kv = m.blocks[3].attn._W_K
    assert kv.shape == (G, dm, dh)
    assert np.array_equal(m.W_K[3, H - 1], kv[G - 1]) and np.array_equal(m.W_K[3, 0], kv[0])
    assert np.array_equal(m.blocks[3].attn.W_Q, m.W_Q[3]) and np.array_equal(m.blocks[3].mlp.W_out, m.W_out[3])
    # Qwen has q/k/v biases, SmolLM2 none
    assert (np.abs(m.b_Q).max() > 0) == (which == "qwen")
    layer = 3
    ids = QK[f"{which}_ids"]
    logits, cache = m.run_with_cache(ids, names_filter=lambda n: n.startswith(f"blocks.{layer}.") or n == "hook_embed"
                                     or n.startswith("ln_final"))
    x = cache[f"blocks.{layer}.ln1.hook_normalized"][0] * m.blocks[layer].ln1.w
    tol = lambda ref: 1e-5 * max(1.0, np.abs(ref).max()) * 10  # noqa: E731  (float32 sums of ~900 terms)
    q = np.einsum("pd,hde->phe", x, m.W_Q[layer]) + m.b_Q[layer]
    assert_cells(f"{which} q from the weights", cache["q", layer][0], q, atol=tol(q))
    k = np.einsum("pd,hde->phe", x, m.blocks[layer].attn._W_K) + m.blocks[layer].attn._b_K
    assert_cells(f"{which} k from the weights", cache["k", layer][0], k, atol=tol(k))
    v = np.einsum("pd,hde->phe", x, m.blocks[layer].attn._W_V) + m.blocks[layer].attn._b_V
    assert_cells(f"{which} v from the weights", cache["v", layer][0], v, atol=tol(v))
    # z @ W_O summed over heads plus b_O is the attention output (no post-norm here)
    out = np.einsum("phe,hed->pd", cache["z", layer][0], m.W_O[layer]) + m.b_O[layer]
    assert_cells(f"{which} out from the weights", cache["attn_out", layer][0], out, atol=tol(out))
    # the MLP: gate, up, down
    y = cache[f"blocks.{layer}.ln2.hook_normalized"][0] * m.blocks[layer].ln2.w
    pre = y @ m.W_gate[layer]
    assert_cells(f"{which} pre from the weights", cache[f"blocks.{layer}.mlp.hook_pre"][0], pre, atol=tol(pre))
    lin = y @ m.W_in[layer] + m.b_in[layer]
    assert_cells(f"{which} lin from the weights", cache[f"blocks.{layer}.mlp.hook_pre_linear"][0], lin, atol=tol(lin))
    mo = cache[f"blocks.{layer}.mlp.hook_post"][0] @ m.W_out[layer] + m.b_out[layer]
    assert_cells(f"{which} mo from the weights", cache[f"blocks.{layer}.hook_mlp_out"][0], mo, atol=tol(mo))
    # the embeddings and the unembedding
    assert np.array_equal(m.W_E[ids], cache["hook_embed"][0])
    final = cache["ln_final.hook_normalized"][0] * m.ln_final.w
    lg = final @ m.W_U + m.b_U
    assert_cells(f"{which} lg from the weights", logits[0], lg, atol=tol(lg))
    with pytest.raises(AttributeError, match="no learned positions"):
        m.W_pos
    with pytest.raises(AttributeError, match="RMSNorm"):
        m.blocks[0].ln1.b


def test_unimplemented_processing_is_refused_not_ignored():
    with pytest.raises(NotImplementedError, match="refactor_factored_attn_matrices"):
        attnscope.HookedModel.from_pretrained("smollm2-135m", refactor_factored_attn_matrices=True)
    with pytest.raises(ValueError, match="center_unembed=True.*no_processing"):
        attnscope.HookedModel.from_pretrained_no_processing("smollm2-135m", center_unembed=True)
    with pytest.raises(NotImplementedError, match="encoder"):
        attnscope.HookedModel.from_pretrained("all-minilm-l6-v2", fold_ln=True)
    with pytest.raises(NotImplementedError, match="Gemma"):
        attnscope.HookedModel.from_pretrained("gemma3-270m", center_unembed=True)
    with pytest.raises(ValueError, match="CPU"):
        attnscope.HookedModel.from_pretrained("smollm2-135m", device="cuda")


def test_stop_at_layer_returns_the_residual_before_that_block(smol):
    ids = smol.to_tokens(TEXT)
    n = smol.cfg.n_layers
    _, full = smol.run_with_cache(ids, names_filter=["hook_resid_pre", f"blocks.{n - 1}.hook_resid_post"])
    for s in (0, 1, 5, n - 1):
        r = smol(ids, stop_at_layer=s)
        assert r.shape == (1, ids.shape[1], smol.cfg.d_model)
        assert np.array_equal(r, full["resid_pre", s])
    assert np.array_equal(smol(ids, stop_at_layer=-1), full["resid_pre", n - 1])  # TL's blocks[:-1]
    assert np.array_equal(smol(ids, stop_at_layer=n), full[f"blocks.{n - 1}.hook_resid_post"])
    # whatever return_type says, the residual (as TL)
    assert np.array_equal(smol(ids, return_type="loss", stop_at_layer=2), full["resid_pre", 2])
    # the cache holds what ran before the stop; the hooks of later blocks do not run
    r, cache = smol.run_with_cache(ids, names_filter=["hook_resid_pre", "hook_z"], stop_at_layer=4)
    assert np.array_equal(r, full["resid_pre", 4])
    assert sorted(cache.keys()) == sorted([f"blocks.{l}.hook_resid_pre" for l in range(4)]
                                          + [f"blocks.{l}.attn.hook_z" for l in range(4)])
    seen = []

    def note(a, hook):
        seen.append(hook.name)

    def double(a, hook):
        a *= 2
    r = smol.run_with_hooks(ids, fwd_hooks=[(lambda name: name.endswith("hook_resid_pre"), note),
                                             ("blocks.3.hook_resid_pre", double), ("ln_final.hook_normalized", note)],
                            stop_at_layer=3)
    assert seen == [f"blocks.{l}.hook_resid_pre" for l in range(3)]
    assert np.array_equal(r, full["resid_pre", 3])  # block 3's hook did not run
    # an edit before the stop shows in the residual
    r = smol.run_with_hooks(ids, fwd_hooks=[("blocks.1.hook_resid_pre", double)], stop_at_layer=2)
    assert not np.allclose(r, full["resid_pre", 2], atol=1e-3)
    for bad in (n + 1, -n - 1):
        with pytest.raises(ValueError, match="stop_at_layer"):
            smol(ids, stop_at_layer=bad)


def test_a_padded_batch_equals_each_text_alone(qwen):
    texts = ["The cat sat", "Hà Nội là thủ đô của Việt Nam.", "A"]
    toks = qwen.to_tokens(texts)
    lens = [qwen.to_tokens(t).shape[1] for t in texts]
    assert toks.shape == (3, max(lens)) and toks.dtype == np.int64
    pad = qwen.cfg.pad_token_id
    assert pad is not None
    for i, t in enumerate(texts):  # padded on the right, TransformerLens's default
        assert toks[i, :lens[i]].tolist() == qwen.to_tokens(t)[0].tolist()
        assert (toks[i, lens[i]:] == pad).all()
    with pytest.raises(NotImplementedError, match="right"):
        qwen.to_tokens(texts, padding_side="left")
    names = ["blocks.2.attn.hook_pattern", "blocks.5.hook_resid_post", "blocks.1.attn.hook_z"]
    logits, cache = qwen.run_with_cache(texts, names_filter=names)
    assert logits.shape == (3, toks.shape[1], qwen.cfg.d_vocab)
    assert cache["pattern", 2].shape == (3, qwen.cfg.n_heads, toks.shape[1], toks.shape[1])
    for i, t in enumerate(texts):
        alone_lg, alone = qwen.run_with_cache(t, names_filter=names)
        k = lens[i]
        # a row's real tokens: exactly the text alone (causal attention, right padding)
        assert np.array_equal(logits[i, :k], alone_lg[0])
        assert np.array_equal(cache["pattern", 2][i, :, :k, :k], alone["pattern", 2][0])
        assert np.array_equal(cache["z", 1][i, :k], alone["z", 1][0])
        # pad positions: the padded row as it stands (TransformerLens without an attention mask)
        row_lg, row = qwen.run_with_cache(toks[i], names_filter=names)
        assert np.array_equal(logits[i], row_lg[0]) and np.array_equal(cache["resid_post", 5][i], row["resid_post", 5][0])
    # a [b, n] array is the same batch; model() too
    assert np.array_equal(qwen(toks), logits)
    # the loss: TL's mean over every row and position; with the attention mask, real tokens only
    per = qwen(toks, return_type="loss", loss_per_token=True)
    assert per.shape == (3, toks.shape[1] - 1)
    mean = qwen(toks, return_type="loss")
    # TL's 0-d float32 (a tensor under torch: `.item()` works, Main_Demo's cell 14)
    assert isinstance(mean, np.ndarray) and mean.shape == () and mean.dtype == np.float32
    assert np.isclose(mean, float(per.mean()), rtol=1e-6)
    mask = (np.arange(toks.shape[1])[None] < np.asarray(lens)[:, None]).astype(np.int64)
    masked = qwen(toks, return_type="loss", attention_mask=mask)
    alone = [qwen(t, return_type="loss", loss_per_token=True)[0] for t in texts if qwen.to_tokens(t).shape[1] > 1]
    assert np.isclose(masked, float(np.concatenate(alone).mean()), rtol=1e-5)
    with pytest.raises(NotImplementedError, match="attention_mask"):
        qwen(toks, attention_mask=mask)
    with pytest.raises(ValueError, match="batch of one"):
        qwen.run_with_cache(texts, names_filter=names, remove_batch_dim=True)


def test_hooks_see_the_whole_batch(smol):
    texts = ["The cat sat on the mat", "When Mary and John went to the store, John gave"]
    toks = smol.to_tokens(texts)
    shapes = []

    def look(a, hook):
        shapes.append((hook.name, tuple(a.shape)))

    def ablate_head(a, hook):
        a[:, :, 4] = 0  # head 4 of every row

    out = smol.run_with_hooks(texts, fwd_hooks=[("blocks.2.attn.hook_z", look), ("blocks.2.attn.hook_z", ablate_head),
                                                ("blocks.3.attn.hook_pattern", look)])
    n = toks.shape[1]
    assert shapes == [("blocks.2.attn.hook_z", (2, n, smol.cfg.n_heads, smol.cfg.d_head)),
                      ("blocks.3.attn.hook_pattern", (2, smol.cfg.n_heads, n, n))]
    for i in range(2):
        alone = smol.run_with_hooks(toks[i], fwd_hooks=[("blocks.2.attn.hook_z", ablate_head)])
        assert np.array_equal(out[i], alone[0])

    # patching between rows, as the IOI demos do: row 1's resid_pre at layer 4 into row 0
    def patch(a, hook):
        a[0] = a[1]
        return a
    patched = smol.run_with_hooks(toks, fwd_hooks=[("blocks.4.hook_resid_pre", patch)])
    assert np.allclose(patched[0], patched[1], atol=1e-4)
    # an exception in a hook is raised as it was, whatever row met it
    def boom(a, hook):
        raise KeyError("from the hook")
    with pytest.raises(KeyError, match="from the hook"):
        smol.run_with_hooks(toks, fwd_hooks=[("blocks.1.hook_resid_post", boom)])
    # and the model still runs afterwards
    assert np.array_equal(smol(toks), np.stack([smol(toks[0])[0], smol(toks[1])[0]]))


def test_a_batch_runs_as_one_stacked_forward(smol):
    """A batch with no attention-map edit runs as one forward over the stacked rows (the native
    ``run_batch``): every hook, the logits, an edit of every row at once and stop_at_layer give
    each row's own forward, bit for bit; an attention map's edit goes row by row in lockstep."""
    texts = ["The cat sat on the mat", "When Mary and John went to the store, John gave", "A"]
    toks = smol.to_tokens(texts)
    b, n = toks.shape
    calls = []
    real = smol._m
    class Spy:  # counts the native calls, then hands them on
        def __getattr__(self, name):
            f = getattr(real, name)
            def call(*a, **k):
                calls.append(name)
                return f(*a, **k)
            return call
    smol._m = Spy()
    try:
        logits, cache = smol.run_with_cache(toks)
        assert calls == ["run_batch"]
        seen = []

        def ablate(a, hook):
            seen.append(tuple(a.shape))
            a[:, :, 4] = 0  # head 4 of every row
            a[1] += 0.5 * a[0]  # and row 0 into row 1: the edit sees the batch
        edited = smol.run_with_hooks(toks, fwd_hooks=[("blocks.2.attn.hook_z", ablate)])
        assert seen == [(b, n, smol.cfg.n_heads, smol.cfg.d_head)] and calls[-1] == "run_batch"
        stopped = smol(toks, stop_at_layer=5)
        assert stopped.shape == (b, n, smol.cfg.d_model) and calls[-1] == "run_batch"
        last = smol.run_with_cache(toks, names_filter="hook_resid_post", logits="last")[0]
        assert last.shape == (b, 1, smol.cfg.d_vocab)
        # an attention map's edit: each row's forward, meeting at the map
        calls.clear()
        smol.run_with_hooks(toks, fwd_hooks=[("blocks.3.attn.hook_pattern", lambda a, hook: None)])
        assert calls == ["run"] * b
        calls.clear()
        rot = smol.run_with_hooks(toks, fwd_hooks=[("blocks.3.attn.hook_rot_k", lambda a, hook: None)])
        assert calls == ["run"] * b and np.array_equal(rot, logits)
    finally:
        smol._m = real
    assert len(cache) == len(smol.hook_names())
    z = None
    for i in range(b):
        lg, alone = smol.run_with_cache(toks[i])
        assert np.array_equal(logits[i], lg[0])
        for name, arr in alone.items():
            assert np.array_equal(cache[name][i], arr[0]), name
        if i == 0:
            z = alone["z", 2][0].copy()
            z[:, 4] = 0
        def ablate_row(a, hook, i=i):
            a[:, :, 4] = 0
            if i == 1:
                a[0] += 0.5 * z
        assert np.array_equal(edited[i], smol.run_with_hooks(toks[i], fwd_hooks=[("blocks.2.attn.hook_z", ablate_row)])[0])
        assert np.array_equal(stopped[i], smol(toks[i], stop_at_layer=5)[0])
        assert np.array_equal(last[i, 0], lg[0, -1])


def test_device_and_loss_fn_as_transformerlens_names_them(smol):
    assert smol.cfg.device == "cpu"
    toks = smol.to_tokens(["The cat sat on the mat", "A dog"])
    lg = smol(toks)
    per = smol.loss_fn(lg, toks, per_token=True)
    assert per.shape == (2, toks.shape[1] - 1)
    assert np.isclose(float(per.mean()), smol(toks, return_type="loss"), rtol=1e-6)


def test_ov_and_qk_circuits_as_factored_matrices(smol):
    """model.OV / model.QK are TransformerLens's FactoredMatrix of the unprocessed weights: the
    product, its SVD, eigenvalues and norm agree with the dense matrix computed in float64."""
    ov = smol.OV
    L, H, d = smol.cfg.n_layers, smol.cfg.n_heads, smol.cfg.d_model
    assert ov.shape == (L, H, d, d) and ov.mdim == smol.cfg.d_head
    W_V, W_O = np.asarray(smol.W_V, dtype=np.float64), np.asarray(smol.W_O, dtype=np.float64)
    dense = W_V[1, 4] @ W_O[1, 4]
    one = ov[1, 4]
    assert one.shape == (d, d)
    assert np.allclose(np.asarray(one.AB), dense, atol=1e-5 * np.abs(dense).max())
    U, S, Vh = (np.asarray(x, dtype=np.float64) for x in one.svd())
    assert U.shape == (d, smol.cfg.d_head) and S.shape == (smol.cfg.d_head,)
    assert np.allclose(U @ np.diag(S) @ Vh.T, dense, atol=1e-4 * np.abs(dense).max())
    assert np.allclose(S, np.linalg.svd(dense, compute_uv=False)[: len(S)], rtol=1e-3, atol=1e-5 * S.max())
    assert np.isclose(float(one.norm()), np.linalg.norm(dense), rtol=1e-4)
    # the eigenvalues of BA are AB's non-zero ones
    ev = np.sort_complex(np.asarray(one.eigenvalues).astype(np.complex128))
    dense_ev = np.linalg.eigvals(dense)
    dense_ev = np.sort_complex(dense_ev[np.argsort(-np.abs(dense_ev))[: len(ev)]])
    assert np.allclose(ev, dense_ev, atol=1e-3 * np.abs(dense_ev).max())
    # products with arrays and the transpose
    x = np.random.default_rng(0).standard_normal(d).astype(np.float32)
    assert np.allclose(np.asarray(one @ x), x.astype(np.float64) @ dense.T, atol=1e-4 * np.abs(dense).max() * np.abs(x).sum())
    assert np.allclose(np.asarray(one.T.AB), dense.T, atol=1e-5 * np.abs(dense).max())
    qk = smol.QK[2, 0]
    W_Q, W_K = np.asarray(smol.W_Q, dtype=np.float64), np.asarray(smol.W_K, dtype=np.float64)
    want = W_Q[2, 0] @ W_K[2, 0].T
    assert np.allclose(np.asarray(qk.AB), want, atol=1e-5 * np.abs(want).max())
    with pytest.raises(IndexError, match="leading dims"):
        ov[1, 4, 0]


def test_the_full_ov_circuit_keeps_the_embeddings_apart(smol):
    """``W_E @ model.OV @ W_U`` (TL's full OV circuit, Main_Demo's cell 48): TL folds W_E into A and
    W_U into B (factors of 2 x 3.4 GB on SmolLM2); here they stay apart until A or B is read, and
    the eigenvalues, BA and corners, computed through W_U @ W_E, equal TL's products in float64."""
    W_E, W_U = np.asarray(smol.W_E), np.asarray(smol.W_U)
    full = W_E @ smol.OV @ W_U
    V, d, m = smol.cfg.d_vocab, smol.cfg.d_model, smol.cfg.d_head
    assert full.shape == (smol.cfg.n_layers, smol.cfg.n_heads, V, V) and full.mdim == m
    assert not full._folded and repr(full) == f"FactoredMatrix: Shape({full.shape}), Hidden Dim({m})"
    one = full[2, 5]  # indexing keeps them apart too
    assert one.shape == (V, V) and not one._folded
    W_V, W_O = np.asarray(smol.W_V, dtype=np.float64)[2, 5], np.asarray(smol.W_O, dtype=np.float64)[2, 5]
    E, U = W_E.astype(np.float64), W_U.astype(np.float64)
    A, B = E @ W_V, W_O @ U  # TL's factors
    ba = B @ A
    assert np.allclose(np.asarray(one.BA), ba, atol=1e-4 * np.abs(ba).max())
    ev = np.sort_complex(np.asarray(one.eigenvalues).astype(np.complex128))
    assert np.allclose(ev, np.sort_complex(np.linalg.eigvals(ba)), atol=1e-4 * np.abs(ev).max())
    assert full.eigenvalues.shape == (smol.cfg.n_layers, smol.cfg.n_heads, m) and not full._folded
    corner = A[:4] @ B[:, :4]
    assert np.allclose(np.asarray(one.get_corner(4)), corner, atol=1e-4 * np.abs(corner).max())
    # a vector on either side, and the transpose, without folding
    x = np.random.default_rng(1).standard_normal(V).astype(np.float32)
    want = A @ (B @ x.astype(np.float64))
    assert np.allclose(np.asarray(one @ x), want, atol=1e-4 * np.abs(want).max())
    want = (x.astype(np.float64) @ A) @ B
    assert np.allclose(np.asarray(x @ one), want, atol=1e-4 * np.abs(want).max())
    t = one.T
    assert t.shape == (V, V) and np.allclose(np.asarray(t.get_corner(3)), corner[:3, :3].T, atol=1e-4 * np.abs(corner).max())
    # A and B are TL's once read
    assert np.allclose(np.asarray(one.A), A, atol=1e-4 * np.abs(A).max())
    assert np.allclose(np.asarray(one.B), B, atol=1e-4 * np.abs(B).max())
    assert set(one._folded) == {"A", "B"}


def test_cache_keys_in_transformer_lens_forms(smol):
    """#59: TL's key forms resolve to the hook names (compared with TL's own cache in
    test_tl_real.py); unknown keys raise a KeyError naming the close ones."""
    _, cache = smol.run_with_cache("The cat sat on the mat")
    n = smol.cfg.n_layers
    forms = {"embed": "hook_embed", ("attn", 5): "blocks.5.attn.hook_pattern",
             ("pattern", -1): f"blocks.{n - 1}.attn.hook_pattern", ("scale", 1, "ln1"): "blocks.1.ln1.hook_scale",
             "scale": "ln_final.hook_scale", "z3": "blocks.3.attn.hook_z", ("pre", 4, "m"): "blocks.4.mlp.hook_pre",
             ("resid_pre", 3, "b"): "blocks.3.hook_resid_pre", ("value", -2): f"blocks.{n - 2}.attn.hook_v",
             ("attn.hook_z", 3): "blocks.3.attn.hook_z", ("ln2.hook_normalized", 2): "blocks.2.ln2.hook_normalized"}
    for key, name in forms.items():
        assert np.array_equal(np.asarray(cache[key]), np.asarray(cache[name])), key
    with pytest.raises(KeyError, match="close ones.*blocks.3.attn.hook_z"):
        cache["blocks.3.attn.hook_zz"]
    with pytest.raises(KeyError, match="no hook 'patern'.*pattern"):
        cache["patern", 2]
    with pytest.raises(KeyError, match="out of range"):
        cache["z", n]


def test_config_has_transformer_lens_fields(smol):
    """#59: HookedTransformerConfig's fields (compared with TL's in test_tl_real.py)."""
    c = smol.cfg
    assert (c.normalization_type, c.positional_embedding_type, c.act_fn, c.original_architecture) == (
        "RMS", "rotary", "silu", "LlamaForCausalLM")
    assert (c.gated_mlp, c.final_rms, c.attn_only, c.tokenizer_prepends_bos, c.d_vocab_out) == (True, True, False, False, 49152)
    assert (c.rotary_base, c.rotary_dim, c.dtype, c.device) == (100000.0, 64, "float32", "cpu")
    assert abs(c.eps - 1e-5) < 1e-9


def test_utils_helpers_as_transformer_lens_has_them(smol, capsys):
    """#59: utils.test_prompt prints TL's table and ranks (compared with TL's own in
    test_tl_real.py); to_numpy, get_device."""
    attnscope.utils.test_prompt("The capital of France is", ["Paris", "London"], smol, top_k=2)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Tokenized prompt: ['The', ' capital', ' of', ' France', ' is']"
    assert out[-1] == "Ranks of the answer tokens: [[(' Paris', 0), (' London', 2)]]"
    assert sum(line.startswith("Top ") for line in out) == 2
    assert attnscope.utils.get_device() == "cpu"
    assert np.array_equal(attnscope.utils.to_numpy([1, 2]), np.array([1, 2]))


@pytest.mark.parametrize("family,act,cls", [
    ("gemma", "gelu_pytorch_tanh", "GemmaForCausalLM"), ("seed_oss", "silu", "SeedOssForCausalLM"),
    ("gpt2", "gelu_new", "GPT2LMHeadModel"), ("qwen3", "silu", "Qwen3ForCausalLM")])
def test_config_act_fn_and_class_come_from_the_family_registry(family, act, cls):
    """act_fn and original_architecture for every family (the engine's registry names them; a
    table of the Python side's own once left Gemma's and Seed-OSS's as None)."""
    m = attnscope.HookedTransformer.from_pretrained_no_processing(str(ROOT / "tests" / "golden" / "arch" / family))
    assert (m.cfg.act_fn, m.cfg.original_architecture) == (act, cls)
