"""The Python package on the real models, against the golden numbers in tests/golden (Hugging Face
transformers, eager attention, float32) and against the CLI's own JSON. Run by `cargo test --release`
(tests/python.rs) with ATTNSCOPE_BIN set to the built binary."""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import attnscope
from cells import assert_cells

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = ROOT / "tests" / "golden"
SENTENCE = "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc."
BIN = os.environ.get("ATTNSCOPE_BIN", str(ROOT / "target" / "release" / "attnscope"))


def golden_ids(prefix):
    g = json.loads((GOLDEN / f"{prefix}_transformers.json").read_text())
    return g


def test_config_in_transformerlens_names(qwen):
    c = qwen.cfg
    assert (c.n_layers, c.n_heads, c.n_key_value_heads, c.d_head, c.d_model, c.d_vocab) == (24, 14, 2, 64, 896, 151936)
    assert c.n_ctx == 32768 and c.default_prepend_bos is False


def test_tokens_match_the_reference(qwen):
    g = golden_ids("qwen")
    ids = qwen.to_tokens(SENTENCE)
    assert ids.dtype == np.int64 and ids.shape == (1, len(g["token_ids"]))
    assert ids[0].tolist() == g["token_ids"]
    assert qwen.to_string(ids) == [SENTENCE] and qwen.to_string(ids[0]) == SENTENCE  # as TransformerLens: a list for 2-D
    assert len(qwen.to_str_tokens(SENTENCE)) == ids.shape[1]


def test_every_pattern_within_1e4_of_transformers(qwen):
    logits, cache = qwen.run_with_cache(SENTENCE, names_filter="hook_pattern")
    want = np.load(GOLDEN / "qwen_transformers_attn_full.npy")  # [24, 14, 18, 18]
    got = cache.stack_activation("pattern")[:, 0]
    assert_cells("qwen: every pattern [layer, head, query, key]", got, want, atol=1e-4)
    # rows sum to 1, masked weights are exactly 0
    assert np.abs(got.sum(-1) - 1).max() < 1e-5
    assert np.triu(got, 1).max() == 0.0
    # the next-token top-5 of the reference
    g = golden_ids("qwen")
    top5 = np.argsort(-logits[0, -1])[:5].tolist()
    assert top5 == [t["id"] for t in g["next_token_top5"]]


def test_gemma3_bos_and_patterns():
    gemma = attnscope.HookedModel.from_pretrained_no_processing("gemma3-270m")
    g = golden_ids("gemma")
    assert gemma.cfg.default_prepend_bos is True and gemma.cfg.d_head == 256
    ids = gemma.to_tokens(SENTENCE)
    assert ids[0].tolist() == g["token_ids"] and ids[0, 0] == 2
    assert gemma.to_str_tokens(SENTENCE)[:2] == ["<bos>", "H"]
    assert gemma.to_tokens(SENTENCE, prepend_bos=False)[0].tolist() == g["token_ids"][1:]
    logits, cache = gemma.run_with_cache(SENTENCE, names_filter="hook_pattern")
    want = np.load(GOLDEN / "gemma_transformers_attn_full.npy")  # [18, 4, 19, 19]
    got = cache.stack_activation("pattern")[:, 0]
    assert_cells("gemma: every pattern [layer, head, query, key]", got, want, atol=2e-5)
    assert np.argsort(-logits[0, -1])[:5].tolist() == [t["id"] for t in g["next_token_top5"]]
    # a model loaded without its BOS leaves it out of every text
    plain = attnscope.HookedModel.from_pretrained_no_processing("gemma3-270m", default_prepend_bos=False)
    assert plain.cfg.default_prepend_bos is False
    assert plain.to_tokens(SENTENCE)[0].tolist() == g["token_ids"][1:]
    assert plain.to_tokens(SENTENCE, prepend_bos=True)[0].tolist() == g["token_ids"]


def test_smollm_head_average_within_1e4(smol):
    want = np.load(GOLDEN / "smol_transformers_attn_headavg.npy")  # [30, n, n]
    g = golden_ids("smol")
    _, cache = smol.run_with_cache(np.asarray(g["token_ids"]), names_filter=lambda n: n.endswith("hook_pattern"), logits=None)
    got = np.stack([cache["pattern", l][0].mean(0) for l in range(30)])
    assert_cells("smol: head-averaged patterns [layer, query, key]", got, want, atol=2e-5)


def test_cache_names_shapes_and_indexing(qwen):
    names = ["hook_q", "hook_k", "hook_v", "hook_z", "hook_resid_pre", "blocks.3.attn.hook_attn_scores", "blocks.-1.hook_resid_post"]
    with pytest.raises(ValueError, match="unknown hook name"):
        qwen.run_with_cache("the hat", names_filter=["blocks.x.hook_q"])
    logits, cache = qwen.run_with_cache("the hat sat", names_filter=names, logits="last")
    n = qwen.to_tokens("the hat sat").shape[1]
    assert logits.shape == (1, 1, 151936)
    assert cache["q", 0].shape == (1, n, 14, 64) and cache["z", 5].shape == (1, n, 14, 64)
    assert cache["k", -1].shape == (1, n, 2, 64) and cache["blocks.23.attn.hook_v"].shape == (1, n, 2, 64)
    # blocks.-1 in a filter is the last layer
    assert cache["resid_pre", 0].shape == (1, n, 896) and cache["blocks.23.hook_resid_post"].shape == (1, n, 896)
    assert cache["attn_scores", 3].shape == (1, 14, n, n) and np.isneginf(cache["attn_scores", 3][0, 0, 0, 1])
    # memory follows the filter: exactly what was asked
    assert len(cache) == 4 * 24 + 24 + 1 + 1
    assert "blocks.3.attn.hook_pattern" not in cache
    with pytest.raises(KeyError):
        cache["pattern", 3]
    with pytest.raises(KeyError):
        cache["q", 24]
    assert cache["q", -24] is cache["q", 0] or np.shares_memory(cache["q", -24], cache["q", 0])
    items = dict(cache.items())
    assert set(items) == set(cache.keys()) and len(items) == len(cache)
    stacked = cache.stack_activation("resid_pre")
    assert stacked.shape == (24, 1, n, 896)
    cache.remove_batch_dim()
    assert cache["q", 0].shape == (n, 14, 64)
    _, c2 = qwen.run_with_cache("the hat sat", names_filter="blocks.2.attn.hook_pattern", remove_batch_dim=True, logits=None)
    assert list(c2.keys()) == ["blocks.2.attn.hook_pattern"] and c2["pattern", 2].shape == (14, n, n)


def test_arrays_are_the_engines_buffers_without_a_copy(qwen):
    _, cache = qwen.run_with_cache("the hat sat on the mat", names_filter="hook_pattern", logits=None)
    a = cache["pattern", 0]
    assert not a.flags.owndata
    # follow the views down to the memory's owner: a Rust buffer, not a numpy allocation
    base = a
    while isinstance(base, np.ndarray):
        assert not base.flags.owndata, "some array in the chain owns a copy"
        base = base.base
    assert "SliceContainer" in type(base).__name__, type(base)
    assert np.shares_memory(a, cache["blocks.0.attn.hook_pattern"])
    # a standard buffer: what torch.from_numpy and memoryview take
    assert memoryview(a).nbytes == a.nbytes and a.flags.c_contiguous and a.flags.writeable


def test_inputs_text_ids_and_lists(qwen):
    ids = qwen.to_tokens("the hat sat")
    a, _ = qwen.run_with_cache("the hat sat", names_filter=[], logits="last")
    b, _ = qwen.run_with_cache(ids, names_filter=[], logits="last")
    c, _ = qwen.run_with_cache(ids[0].tolist(), names_filter=[], logits="last")
    assert np.array_equal(a, b) and np.array_equal(a, c)
    # a list of texts is a batch, padded on the right (test_tl_api.py checks it against each text alone)
    _, both = qwen.run_with_cache(["the hat", "a cat sat down"], names_filter="hook_pattern", logits=None)
    assert both["pattern", 0].shape[0] == 2
    assert both["pattern", 0].shape[-1] == qwen.to_tokens("a cat sat down").shape[1]
    full = qwen("the hat sat")
    assert full.shape == (1, ids.shape[1], 151936) and np.allclose(full[0, -1], a[0, -1], atol=1e-5)


def cli_json(*args):
    out = subprocess.run([BIN, *args, "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def strip_timings(v):
    if isinstance(v, dict):
        return {k: strip_timings(x) for k, x in v.items() if k not in ("timings", "forward_s", "attention_s", "total_s", "peak_rss_bytes", "load_seconds")}
    if isinstance(v, list):
        return [strip_timings(x) for x in v]
    return v


def assert_same(a, b, where="", rel=1e-6):
    """Equal structure and values; floats within `rel` of each other. The typed calls give each
    f32 as the Python float of that value, the CLI's JSON its shortest decimal (or its f64 digits),
    so the two agree to f32's precision, not bit for bit."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}", rel)
    elif isinstance(a, (list, tuple)):
        # a Rust tuple comes as a Python tuple, JSON's as a list
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]", rel)
    elif isinstance(a, float) or isinstance(b, float):
        assert abs(a - b) <= rel * max(1.0, abs(a), abs(b)), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_inspect_faithfulness_sinks_equal_the_cli(qwen, smol):
    py = qwen.inspect(SENTENCE, layer=5, heads="0,3")
    cli = cli_json("inspect", "--model", "qwen2.5-coder-0.5b", "--text", SENTENCE, "--layer", "5", "--heads", "0,3")
    assert_same(strip_timings(py), strip_timings(cli))
    assert py["heads"][0]["head"] == 0 and len(py["layers"]) == 24
    # and against transformers, not only against the CLI it runs: the last layer's per-head top-3
    # for the last query and the sink profile of every layer
    g = golden_ids("qwen")
    last = qwen.inspect(SENTENCE, layer=23, heads="all")
    top3 = g["last_layer_head_top3_lastq"]
    assert len(top3) >= 4
    got, want = {}, {}
    for h in last["heads"]:
        ref = top3.get(str(h["head"]))
        if ref is None:
            continue
        assert [t["pos"] for t in h["top"][:3]] == [t["pos"] for t in ref], h["head"]
        got.update({(h["head"], i): t["weight"] for i, t in enumerate(h["top"][:3])})
        want.update({(h["head"], i): t["weight"] for i, t in enumerate(ref)})
    # the reference's weights are rounded to 4 decimals: their 5e-5, and the weights' own 5.8e-5
    assert_cells("qwen: the last layer's top-3 weights [head, rank]", got, want, atol=1.1e-4)
    sinks = [row["sink_query"] for row in last["layers"]]
    assert_cells("qwen: the last query's sink profile [layer]", sinks, g["sink_share_lastq_full"], atol=2e-5)
    f = smol.faithfulness("The capital of France is", target=" Paris")
    g = json.loads((GOLDEN / "smol_faithfulness.json").read_text())
    assert f["target"]["token"] == " Paris"
    assert_cells("smol faithfulness: log p of the target", f["target"]["logprob"], g["target_logprob"], atol=2e-5)
    assert [t["id"] for t in f["tokens"]] == g["token_ids"]
    cli = cli_json("faithfulness", "--model", "smollm2-135m", "--text", "The capital of France is", "--target", " Paris")
    assert_same(f, cli)
    with pytest.raises(ValueError, match="target"):
        smol.faithfulness("The capital of France is", target=" Paris is")
    s = smol.sinks(max_tokens=256)
    assert s["n_tokens"] == 256 and len(s["layers"]) == 30 and s["model"]
    cli = cli_json("sinks", "--model", "smollm2-135m", "--max-tokens", "256")
    assert_same(strip_timings(s), strip_timings(cli))
    s2 = smol.sinks(text="the hat sat on the mat. " * 20)
    assert s2["n_tokens"] > 100


def test_texts_are_bounded(smol, tmp_path):
    """Issue #56: a text larger than the model's context can need (64 bytes a token, plus 64 KiB:
    589,824 bytes for SmolLM2's 8,192 tokens) is refused before it is tokenized; sinks(file=)
    reads a long file only as far as max_tokens can reach, the tokens those of the whole text."""
    with pytest.raises(ValueError, match="589824"):
        smol.inspect("the hat " * 80_000)
    long = tmp_path / "long.txt"
    long.write_text("the hat sat on the mat. " * 100_000, encoding="utf-8")
    a = smol.sinks(file=long, max_tokens=128)
    b = smol.sinks(text="the hat sat on the mat. " * 40, max_tokens=128)
    assert a["n_tokens"] == b["n_tokens"] == 128
    assert a["layers"] == b["layers"]


def test_compare_and_norms(qwen, tmp_path):
    # two texts: side A's rows are the reference attention of the shared sentence
    other = "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Nam."
    r = qwen.compare(SENTENCE, other_text=other, html=tmp_path / "cmp.html")
    want = np.load(GOLDEN / "qwen_transformers_attn_lastrow.npy")
    assert r["mode"] == "texts" and r["a"]["rows"].shape == want.shape
    assert r["a"]["rows"].dtype == np.float32
    cli = cli_json("compare", "--model", "qwen2.5-coder-0.5b", "--text", SENTENCE, "--text", other)
    assert_same({**r, **{k: {**r[k], "rows": r[k]["rows"].tolist()} for k in ("a", "b")}}, cli)
    assert_cells("qwen compare: side A rows [layer, head, key]", r["a"]["rows"], want, atol=1e-4)
    js = np.asarray(r["js"])
    assert js.shape == (24, 14) and (js >= 0).all() and (js <= 1).all() and js.max() > 1e-4
    assert (tmp_path / "cmp.html").stat().st_size > 1000
    # the same model against itself: nothing changes
    same = qwen.compare(SENTENCE, other=qwen)
    assert same["mode"] == "models" and np.asarray(same["js"]).max() == 0.0
    assert same["a"]["label"] == same["b"]["label"] == "model qwen2.5-coder-0.5b"
    with pytest.raises(ValueError):
        qwen.compare(SENTENCE)
    with pytest.raises(ValueError, match="top"):
        qwen.compare(SENTENCE, other_text=other, top=0)
    with pytest.raises(ValueError, match="query"):
        qwen.compare(SENTENCE, other_text=other, query=100)
    # norm-based attention in inspect: per head α·‖W_O v‖ equals the golden numbers of transformers
    norms = np.load(GOLDEN / "qwen_norms_lastrow.npy")
    ins = qwen.inspect(SENTENCE, layer=23, heads="all", layers="0,23")
    assert len(ins["heads"]) == 14
    for h in ins["heads"]:
        assert_cells(f"qwen inspect: norms of head 23.{h['head']} [key]", h["norms"], norms[23, h["head"]], rel_max=1e-4)
    assert_cells("qwen inspect: whole-layer norms of layer 23 [key]", ins["layers"][23]["norms"], norms[23, 14], rel_max=1e-4)


def test_heads_equal_the_cli(smol):
    py = smol.heads(random_repeat=20, seed=4)
    cli = cli_json("heads", "--model", "smollm2-135m", "--random-repeat", "20", "--seed", "4")
    assert_same(py, cli)
    assert len(py["roles"]["induction"]) == 30 and len(py["tokens"]) == 40
    # and against the attention itself: a head's sink score is its mean weight on the first token
    # over every query (TransformerLens's detector: Σ A⊙P / Σ A), from run_with_cache's patterns
    _, cache = smol.run_with_cache(np.asarray(py["tokens"]), names_filter="hook_pattern", logits=None)
    for layer in (0, 15, 29):
        p = cache["pattern", layer][0]  # [head, q, k]
        want = p[:, :, 0].mean(axis=1)
        got = np.asarray(py["roles"]["sink"][layer])
        assert_cells(f"smol heads: sink score of layer {layer} [head]", got, want, atol=1e-6)
    assert smol.heads("the hat the hat")["texts"] == 1


def test_corpus_and_capture(smol, tmp_path):
    texts = ["The cat sat on the mat.", "Hà Nội là thủ đô của Việt Nam."]
    agg = smol.corpus(texts)
    assert agg["sentences"] == 2 and len(agg["layers"]) == 30
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert_same(agg, cli_json("corpus", "--model", "smollm2-135m", "--file", str(tmp_path / "texts.txt")))
    # shards with record files, merged: the aggregate of one run
    parts = [tmp_path / f"s{i}.jsonl" for i in (0, 1)]
    for i, p in enumerate(parts):
        smol.corpus(texts, shard=f"{i}/2", out=p)
    assert_same(attnscope.corpus_merge(parts), agg)
    with pytest.raises(ValueError, match="shard"):
        smol.corpus(texts, shard="2/2")
    with pytest.raises(ValueError, match="limit"):
        smol.corpus(texts, limit=-1)
    out = tmp_path / "cap.npz"
    msg = smol.capture("the hat sat", out, layers="0,1")
    assert out.exists() and "wrote" in msg
    z = np.load(out)
    _, cache = smol.run_with_cache("the hat sat", names_filter=["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"], logits=None)
    assert np.array_equal(z["blocks.1.attn.hook_pattern"], cache["pattern", 1][0])
    with pytest.raises(FileExistsError):
        smol.capture("the hat sat", out)


def test_low_memory_gives_the_same_patterns(qwen):
    # the projections multiplied from the file's quantized blocks: the packed projections' numbers
    low = attnscope.HookedModel.from_pretrained_no_processing("qwen2.5-coder-0.5b", memory="low")
    la, a = low.run_with_cache(SENTENCE, names_filter="hook_pattern")
    lb, b = qwen.run_with_cache(SENTENCE, names_filter="hook_pattern")
    # bit for bit against the f32 panels; on a CPU with AMX the default holds the projections as
    # the tiles' integers and scales, which round differently (1.8e-5 measured)
    assert np.abs(a.stack_activation("pattern") - b.stack_activation("pattern")).max() < 5e-5
    assert np.abs(la - lb).max() < 1e-3
    want = np.load(GOLDEN / "qwen_transformers_attn_full.npy")
    assert_cells("qwen memory=low: every pattern [layer, head, query, key]", a.stack_activation("pattern")[:, 0], want, atol=1e-4)
    with pytest.raises(ValueError, match="memory"):
        attnscope.HookedModel.from_pretrained("qwen2.5-coder-0.5b", memory="tiny")
    with pytest.raises(ValueError, match="precision exact"):
        attnscope.HookedModel.from_pretrained("qwen2.5-coder-0.5b", precision="fast", memory="low")


def test_errors_are_python_exceptions(qwen):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        attnscope.HookedModel.from_pretrained("/nonexistent/model.gguf")
    with pytest.raises(ValueError, match="precision"):
        attnscope.HookedModel.from_pretrained("qwen2.5-coder-0.5b", precision="half")
    with pytest.raises(ValueError, match="empty"):
        qwen.run_with_cache("   ")
    with pytest.raises(ValueError, match="unknown hook"):
        qwen.run_with_cache("the hat", names_filter="hook_nothing")
    with pytest.raises(ValueError, match="layer 40 is out of range"):
        qwen.inspect("the hat", layer=40)
    with pytest.raises(ValueError, match="out of range"):
        qwen.to_string([10**9])
    with pytest.raises(ValueError, match="shape"):
        attnscope.viz.attention_heads(np.ones((2, 3)), ["a", "b"])


# The engine's call blocked in native code until another thread's Python has run: it reads its
# texts from a FIFO that only that thread writes. A call that kept the GIL would hang (the writer
# could never run); the subprocess's timeout turns that hang into a failure, and is no measure of
# speed: the run takes a second or two.
GIL_PROBE = """
import json, sys, threading
import attnscope
fifo, texts = sys.argv[1], sys.argv[2:]
model = attnscope.HookedModel.from_pretrained("smollm2-135m")
done = {}
worker = threading.Thread(target=lambda: done.update(agg=model.corpus(fifo)))
worker.start()
# this thread writes the texts the worker's engine call is waiting for: it runs only because
# that call let go of the GIL (and the same call then runs the forwards over these texts)
with open(fifo, "w", encoding="utf-8") as f:
    f.write("\\n".join(texts) + "\\n")
worker.join()
print(json.dumps(done["agg"]))
"""


def test_the_gil_is_released_during_a_forward(smol, tmp_path):
    fifo = tmp_path / "texts.txt"
    os.mkfifo(fifo)
    texts = ["the hat sat on the mat", "one two three four", "Hà Nội là thủ đô của Việt Nam."]
    try:
        r = subprocess.run([sys.executable, "-c", GIL_PROBE, str(fifo), *texts], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the engine held the GIL: the thread that writes its input never ran ({e.stderr})")
    assert r.returncode == 0, r.stderr
    # the forwards ran over exactly what the other thread wrote
    assert json.loads(r.stdout) == json.loads(json.dumps(smol.corpus(texts)))


def test_ctrl_c_interrupts_a_long_run(smol, tmp_path):
    # Ctrl-C pressed once the engine is inside its call (it has opened the FIFO it reads its
    # texts from, so the other end's open returns), before it has its texts: the signal is
    # pending before the first layer ends, and the engine itself stops there and says so
    # ("interrupted"). A KeyboardInterrupt raised by Python after a run that ignored the signal
    # would have no such message.
    fifo = tmp_path / "texts.txt"
    os.mkfifo(fifo)
    pressed = []

    def press():
        with open(fifo, "w", encoding="utf-8") as f:
            os.kill(os.getpid(), signal.SIGINT)
            pressed.append(True)
            f.write("the hat sat on the mat\n" * 4)

    presser = threading.Thread(target=press)
    presser.start()
    try:
        with pytest.raises(KeyboardInterrupt) as raised:
            smol.corpus(fifo)
    finally:
        presser.join()
    assert pressed and "interrupted" in str(raised.value), repr(raised.value)
    # the engine is usable again at once: the signal was taken, not left pending
    assert smol.corpus(["the hat sat on the mat"])["sentences"] == 1


def test_a_signal_handlers_exception_is_raised_as_it_was(smol):
    # a SIGALRM handler's exception while the engine runs (a notebook harness's cell timeout)
    # comes out as itself, not as a KeyboardInterrupt, and the engine stops at the next layer
    class Late(Exception):
        pass

    def alarm(signum, frame):
        raise Late("the cell's time is up")

    ids = np.array([[1] + [504, 2644, 2643, 335, 260, 1171] * 300])
    old = signal.signal(signal.SIGALRM, alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Late, match="time is up"):
            smol(ids, return_type=None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    # nothing is left pending: the next call runs
    assert smol(ids[:, :5]).shape == (1, 5, smol.cfg.d_vocab)


def test_views_in_a_notebook(qwen, tmp_path):
    _, cache = qwen.run_with_cache("the hat sat on the mat", names_filter="hook_pattern", logits=None)
    toks = qwen.to_str_tokens("the hat sat on the mat")
    v1 = attnscope.viz.attention_heads(cache["pattern", 0][0], toks)
    v2 = qwen.view("the hat sat on the mat")
    h1, h2 = v1._repr_html_(), v2._repr_html_()
    assert "<iframe" in h1 and 'srcdoc="' in h1
    assert v1.id != v2.id
    for v in (v1, v2):
        assert "http://" not in v.html.replace("http://www.w3.org", "") and "https://" not in v.html
        assert "require(" not in v.html
    saved = v2.save(tmp_path / "view.html")
    assert Path(saved).read_text(encoding="utf-8") == v2.html
    # issue #56: save() replaced any file; now only with overwrite=True, never half a page
    with pytest.raises(FileExistsError, match="overwrite=True"):
        v1.save(tmp_path / "view.html")
    assert Path(saved).read_text(encoding="utf-8") == v2.html
    v1.save(tmp_path / "view.html", overwrite=True)
    assert Path(saved).read_text(encoding="utf-8") == v1.html
    with pytest.raises(ValueError, match="does not exist"):
        v1.save(tmp_path / "no-such-folder" / "view.html")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["view.html"]
    # both views in one page, opened in a real browser (when one is here)
    nb = tmp_path / "notebook.html"
    nb.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{h1}<p>text between cells</p>{h2}</body></html>", encoding="utf-8")
    found = subprocess.run(["sh", str(ROOT / "tests/browser/find-browser.sh")], capture_output=True, text=True)
    if found.returncode != 0:
        if os.environ.get("ATTNSCOPE_REQUIRE_BROWSER") == "1":
            pytest.fail(found.stderr)
        pytest.skip("no browser: " + found.stderr.strip())
    shot = ROOT / "target" / "browser-artifacts"
    shot.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["node", str(ROOT / "tests/browser/notebook.mjs"), str(nb), "2", str(shot / "notebook.png")],
                       capture_output=True, text=True, env={**os.environ, "CHROMIUM": found.stdout.strip()})
    assert r.returncode == 0, r.stdout + r.stderr


def test_view_with_the_ablation_panel(smol):
    text = "The capital of France is"
    v = smol.view(text, ablate="mean", target=" Paris")
    at = v.html.index("const D = ") + len("const D = ")
    d, _ = json.JSONDecoder().raw_decode(v.html[at:])
    want = smol.ablate(text, method="mean", target=" Paris")
    assert d["ablation"]["target"] == want["target"] and d["ablation"]["method"] == "mean"
    assert_same(d["ablation"]["heads"], want["heads"])
    assert_same(d["ablation"]["correlations"], want["correlations"])
    assert smol.view(text)._repr_html_() and "selectHead" in v.html
    with pytest.raises(ValueError, match="zero.*mean"):
        smol.view(text, ablate="half")
    with pytest.raises(ValueError, match="--ablate"):
        smol.view(text, target=" Paris")


# --- interventions: TransformerLens's editing hooks, against transformers with torch hooks ----

def _interventions(prefix):
    return json.loads((GOLDEN / f"{prefix}_interventions.json").read_text())


def test_run_with_hooks_zero_ablation_matches_transformers(smol):
    """A TransformerLens user's head ablation (hook_z, edited in place) gives transformers' numbers."""
    ref = _interventions("smol")["ablation"]
    ids = smol.to_tokens(ref["text"])
    base = smol(ids)[0, -1]
    base_lp = base - np.log(np.exp(base - base.max()).sum()) - base.max()
    target = ref["target_id"]
    assert int(base.argmax()) == target
    assert_cells("smol: baseline log p", float(base_lp[target]), ref["baseline_logprob"], atol=1e-4)
    # three heads of the grid (tests/interventions.rs checks every head through the library)
    got, want = {}, {}
    for layer, head in [(0, 0), (7, 3), (29, 8)]:
        def ablate(z, hook):
            assert hook.name == f"blocks.{layer}.attn.hook_z" and hook.layer() == layer
            assert z.shape == (1, ids.shape[1], smol.cfg.n_heads, smol.cfg.d_head)
            z[:, :, head, :] = 0.0
        lg = smol.run_with_hooks(ids, fwd_hooks=[(attnscope.utils.get_act_name("z", layer), ablate)])[0, -1]
        lp = lg - np.log(np.exp(lg - lg.max()).sum()) - lg.max()
        got[layer, head] = float(lp[target] - base_lp[target])
        want[layer, head] = ref["zero"][layer][head]
    assert_cells("smol run_with_hooks: zero ablation's Δ log p [layer, head]", got, want, atol=1e-4)


def test_run_with_hooks_patching_matches_transformers(smol):
    """Activation patching as TransformerLens users write it: cache the clean run, return the
    patched hook_resid_pre from a hook."""
    ref = _interventions("smol")["patching"]
    clean, corrupt = smol.to_tokens(ref["clean"]), smol.to_tokens(ref["corrupt"])
    _, cache = smol.run_with_cache(clean, names_filter=lambda n: n.endswith("hook_resid_pre"))
    # three cells of the grid (tests/interventions.rs checks every one through the library)
    got, want = {}, {}
    for layer, pos in [(0, 9), (5, 9), (12, 13)]:
        def patch(resid, hook):
            out = resid.copy()
            out[:, pos, :] = cache[hook.name][:, pos, :]
            return out
        lg = smol.run_with_hooks(corrupt, fwd_hooks=[(f"blocks.{layer}.hook_resid_pre", patch)])[0, -1]
        got[layer, pos] = float(lg[ref["answer_id"]] - lg[ref["wrong_id"]])
        want[layer, pos] = ref["patched_logit_diff"][layer][pos]
    assert_cells("smol run_with_hooks: patched logit difference [layer, position]", got, want, atol=1e-4)


def test_hooks_context_add_hook_pattern_edits_and_loss(smol):
    text = "The cat sat on the mat"
    ids = smol.to_tokens(text)
    clean = smol(ids)
    # a context's hooks apply to run_with_cache too, and are gone after it
    seen = []
    with smol.hooks(fwd_hooks=[(lambda n: n.endswith("hook_resid_mid"), lambda x, h: seen.append(h.name))]):
        _, cache = smol.run_with_cache(ids, names_filter="hook_resid_mid")
    assert len(seen) == smol.cfg.n_layers and len(cache) == smol.cfg.n_layers
    assert np.array_equal(smol(ids), clean)
    # add_hook until reset_hooks
    smol.add_hook("blocks.3.attn.hook_pattern", lambda p, h: None)
    try:
        assert np.array_equal(smol(ids), clean)  # a hook that only reads changes no bit
    finally:
        smol.reset_hooks()  # the model is shared by the whole run

    # attention knocked out to the first token only, from layer 2's pattern: the cache sees the edit
    def to_first(p, hook):
        p[:] = 0.0
        p[..., 0] = 1.0
    with smol.hooks(fwd_hooks=[("blocks.2.attn.hook_pattern", to_first)]):
        lg, cache = smol.run_with_cache(ids, names_filter=["blocks.2.attn.hook_pattern", "blocks.2.attn.hook_z", "blocks.2.attn.hook_v"])
    assert np.all(cache["pattern", 2][..., 0] == 1.0)
    v = cache["blocks.2.attn.hook_v"][0]  # [pos, kv_head, d_head]
    z = cache["blocks.2.attn.hook_z"][0]  # [pos, head, d_head]
    group = smol.cfg.n_heads // smol.cfg.n_key_value_heads
    for h in range(smol.cfg.n_heads):
        assert np.allclose(z[:, h], v[0, h // group][np.newaxis], atol=1e-6)
    assert not np.allclose(lg, clean, atol=1e-3)
    # loss: TransformerLens's mean next-token cross-entropy
    lg, loss = smol.run_with_hooks(ids, return_type="both")
    lp = lg[0] - np.log(np.exp(lg[0] - lg[0].max(-1, keepdims=True)).sum(-1, keepdims=True)) - lg[0].max(-1, keepdims=True)
    want = -np.mean([lp[i, ids[0, i + 1]] for i in range(ids.shape[1] - 1)])
    assert abs(loss - want) < 1e-4 and smol(ids, return_type="loss") == pytest.approx(loss, abs=1e-6)
    assert smol.run_with_hooks(ids, return_type=None) is None


def test_hooks_belong_to_their_thread_and_interleaved_blocks_leave_none(smol):
    """#56: two threads' hooks() blocks, ordered by events (A enters, B enters, A exits, B exits).
    Inside A's block B's plain forward is unedited; B's own block runs B's hook alone, also after A
    has left; afterwards a plain forward equals the unhooked logits bit for bit (the context once
    saved and restored the whole hook list, so the interleaved exits left A's hook installed)."""
    ids = smol.to_tokens("The cat sat on the mat")
    clean = smol(ids)

    def to_first(p, hook):
        p[:] = 0.0
        p[..., 0] = 1.0

    def zero(x, hook):
        x[:] = 0.0
    a_hooks = [("blocks.2.attn.hook_pattern", to_first)]
    b_hooks = [("blocks.1.hook_mlp_out", zero)]
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    got, errors = {}, []

    def wait(e):
        assert e.wait(300), "the other thread did not get there"

    def a():
        try:
            with smol.hooks(fwd_hooks=a_hooks):
                got["a"] = smol(ids)
                a_in.set()
                wait(b_in)
            a_out.set()
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            a_in.set(), a_out.set()

    def b():
        try:
            wait(a_in)
            got["b plain in A's block"] = smol(ids)
            with smol.hooks(fwd_hooks=b_hooks):
                b_in.set()
                wait(a_out)
                got["b after A left"] = smol(ids)
        except BaseException as e:
            errors.append(e)
            b_in.set()
    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert np.array_equal(got["b plain in A's block"], clean), "a plain forward in B saw A's hook"
    assert not np.allclose(got["a"], clean, atol=1e-3), "A's hook did not edit A's forward"
    assert np.array_equal(got["b after A left"], smol.run_with_hooks(ids, fwd_hooks=b_hooks)), \
        "B's block did not run B's hook alone"
    assert np.array_equal(smol(ids), clean), "a hook was left installed"
    assert smol._fwd_hooks == []
    # in one thread, TransformerLens's semantics: a block removes its own hooks only
    keep = ("blocks.3.attn.hook_pattern", lambda p, h: None)
    with smol.hooks(fwd_hooks=a_hooks):
        smol.add_hook(*keep)
    try:
        assert smol._fwd_hooks == [keep] and np.array_equal(smol(ids), clean)
    finally:
        smol.reset_hooks()


def test_bad_arguments_get_messages_not_conversion_errors(smol):
    """#56: a negative token id, ragged token lists and names_filter=3 raised the conversion's own
    errors (OverflowError, numpy's inhomogeneous shape, 'int' object is not iterable); an empty
    text for patch was told to use --text; equal clean and corrupted logit differences gave
    recovered = nan."""
    with pytest.raises(ValueError, match=r"token id -1 at position 1 is out of range; valid: 0\.\."):
        smol([1, -1, 2])
    with pytest.raises(ValueError, match=r"token id -5 at position 0 of row 1 is out of range"):
        smol.run_with_cache(np.array([[1, 2], [-5, 3]]))
    with pytest.raises(ValueError, match=r"token lists of different lengths \[3, 2\]"):
        smol.run_with_cache([[1, 2, 3], [4, 5]])
    with pytest.raises(TypeError, match="names_filter=3"):
        smol.run_with_cache("The cat", names_filter=3)
    with pytest.raises(ValueError, match="clean is empty"):
        smol.patch("  ", "The cat sat")
    with pytest.raises(ValueError, match="the same logit difference"):
        smol.patch("The cat sat", "The cat sat", answer=" on", wrong=" in")


def test_corpus_merge_gives_epsilon_as_the_cli_prints_it(tmp_path):
    """#56: the typed merge (what attnscope.distributed.corpus returns) gave epsilon as the f32's
    exact value, 0.30000001192092896, where `corpus --json` prints 0.3."""
    rec = tmp_path / "rec.jsonl"
    subprocess.run([BIN, "corpus", "-m", "smollm2-135m", "--limit", "2", "--out", str(rec)], check=True, capture_output=True)
    cli = json.loads(subprocess.run([BIN, "corpus", "merge", str(rec), "--json"], check=True, capture_output=True).stdout)
    py = attnscope._native.corpus_merge([str(rec)], 0.3)
    assert cli["epsilon"] == 0.3 and py["epsilon"] == 0.3
    assert_same(py, cli)


def test_hook_errors_are_python_exceptions(smol):
    ids = smol.to_tokens("The cat sat")
    with pytest.raises(ValueError, match="unknown hook name 'blocks.0.hook_nope'"):
        smol.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_nope", lambda x, h: None)])
    with pytest.raises(ValueError, match="shape"):
        smol.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, h: x[:, :1])])
    with pytest.raises(TypeError, match="dtype float64"):
        smol.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, h: x.astype(np.float64))])

    def nan(x, h):
        x[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="blocks.1.attn.hook_z.*non-finite"):
        smol.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_z", nan)])

    class Boom(Exception):
        pass

    def boom(x, h):
        raise Boom("from the hook")
    with pytest.raises(Boom, match="from the hook"):
        smol.run_with_hooks(ids, fwd_hooks=[("blocks.1.hook_mlp_out", boom)])
    with pytest.raises(RuntimeError, match="blocks.1.hook_mlp_out.*import torch"), pytest.warns(UserWarning, match="reset"):
        smol.run_with_hooks(ids, bwd_hooks=[("blocks.1.hook_mlp_out", boom)])  # no torch here
    # a failed run leaves no hook behind
    assert np.array_equal(smol(ids), smol(ids))
    assert attnscope.utils.get_act_name("pattern", 3) == "blocks.3.attn.hook_pattern"
    assert attnscope.utils.get_act_name("resid_pre", 0) == "blocks.0.hook_resid_pre"
    assert attnscope.utils.get_act_name("embed") == "hook_embed"
    assert attnscope.utils.get_act_name("scale") == "ln_final.hook_scale"
    assert attnscope.utils.get_act_name("normalized", 2, "ln1") == "blocks.2.ln1.hook_normalized"
    assert attnscope.utils.get_act_name("result", 4) == "blocks.4.attn.hook_result"
    assert attnscope.utils.get_act_name("pre_linear", 1) == "blocks.1.mlp.hook_pre_linear"
    with pytest.raises(ValueError, match="no hook 'resid'"):
        attnscope.utils.get_act_name("resid", 1)
    assert smol.to_single_token(" cat") == int(smol.to_tokens(" cat")[0, 0])
    assert smol.to_string(np.array([[1, 2], [3, 4]])) == [smol.to_string([1, 2]), smol.to_string([3, 4])]


def test_ablate_and_patch_equal_the_cli(smol):
    r = smol.ablate("The cat sat on the mat", method="mean")
    cli = json.loads(subprocess.run([BIN, "ablate", "-m", "smollm2-135m", "--text", "The cat sat on the mat", "--method", "mean",
                                     "--json"], check=True, capture_output=True).stdout)
    assert len(r["heads"]) == smol.cfg.n_layers * smol.cfg.n_heads
    assert_same(r, cli)
    clean = "When Mary and John went to the store, John gave a drink to"
    corrupt = "When Mary and John went to the store, Mary gave a drink to"
    p = smol.patch(clean, corrupt, hook="z")
    assert {"clean_logit_diff", "corrupt_logit_diff", "results"} <= set(p) and "head" in p["results"][0]
    cli = json.loads(subprocess.run([BIN, "patch", "-m", "smollm2-135m", "--clean", clean, "--corrupt", corrupt,
                                     "--hook", "z", "--json"], check=True, capture_output=True).stdout)
    assert_same(p, cli)
    # bad arguments are Python exceptions naming them, not CLI usage
    with pytest.raises(ValueError, match="hook"):
        smol.patch(clean, corrupt, hook="nope")
    with pytest.raises(ValueError, match="answer"):
        smol.patch(clean, corrupt, answer="next")
    with pytest.raises(ValueError, match="position"):
        smol.ablate("The cat sat", positions="40")
    with pytest.raises(ValueError, match="random"):
        smol.heads(random_repeat=0)
    with pytest.raises(ValueError, match="top"):
        smol.sinks(text="the cat", top=0)


def test_direct_logit_attribution_as_transformerlens_users_write_it(qwen):
    """stack_head_results → apply_ln_to_stack → logit_attrs gives `attnscope dla`'s per-head
    numbers; decompose_resid adds up to the final residual, and its attributions to the logit."""
    logits, cache = qwen.run_with_cache(SENTENCE)
    answer = int(logits[0, -1].argmax())
    heads, labels = cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
    # TL's pos_slice=-1 drops the position axis (#59)
    assert heads.shape == (24 * 14, 1, 896) and labels[:2] == ["L0H0", "L0H1"]
    attrs = cache.logit_attrs(heads, answer, pos_slice=-1)[:, 0]  # TL: it applies the final norm itself
    cli = json.loads(subprocess.run([BIN, "dla", "--text", SENTENCE, "--json"], check=True, capture_output=True).stdout)
    assert cli["answer"]["id"] == answer
    want = np.asarray([h["dla"] for h in cli["heads"]])
    assert_cells("qwen logit_attrs against `attnscope dla` [layer x head]", attrs, want, atol=1e-6)
    parts, names = cache.decompose_resid(return_labels=True)
    assert names[0] == "embed" and names[1:3] == ["0_attn_out", "0_mlp_out"] and len(names) == 1 + 2 * 24
    final = cache["blocks.23.hook_resid_post"]
    assert np.abs(parts.sum(0) - final).max() < 1e-3 * (1 + np.abs(final).max())
    last = cache.decompose_resid(pos_slice=-1)
    total = cache.logit_attrs(last, answer, pos_slice=-1)[:, 0].sum()
    assert abs(total - float(logits[0, -1, answer])) < 1e-2
    acc = cache.accumulated_resid(incl_mid=True)
    assert acc.shape == (2 * 24 + 1, 1, len(cache["pattern", 0, "attn"][0, 0]), 896)
    # a block's own norm: the components over ln1's (ln2's) scale of the run, which for the
    # block's input itself is ln1.hook_normalized (ln2's for resid_mid)
    x3, mid3 = np.asarray(cache["resid_pre", 3]), np.asarray(cache["resid_mid", 3])
    by_ln1 = np.asarray(cache.apply_ln_to_stack(x3[None], layer=3))[0]
    assert np.allclose(by_ln1, np.asarray(cache["blocks.3.ln1.hook_normalized"]), rtol=1e-4, atol=1e-5)
    by_ln2 = np.asarray(cache.apply_ln_to_stack(mid3[None], layer=3, mlp_input=True))[0]
    assert np.allclose(by_ln2, np.asarray(cache["blocks.3.ln2.hook_normalized"]), rtol=1e-4, atol=1e-5)
    assert np.array_equal(np.asarray(cache.apply_ln_to_stack(last, layer=-1, pos_slice=-1)),
                          np.asarray(cache.apply_ln_to_stack(last, pos_slice=-1)))
    with pytest.raises(ValueError, match="out of range"):
        cache.apply_ln_to_stack(x3[None], layer=24 + 1)
    # tokens_to_residual_directions is W_U's column, for one token or an array of them
    W_U = np.asarray(qwen.W_U)
    d = np.asarray(qwen.tokens_to_residual_directions(answer))
    assert d.shape == (896,) and np.array_equal(d, W_U[:, answer])
    two = np.asarray(qwen.tokens_to_residual_directions(np.array([[answer, 5]])))
    assert two.shape == (1, 2, 896) and np.array_equal(two[0, 1], W_U[:, 5])


def test_results_follow_the_array_type(smol, monkeypatch):
    """With torch imported (a stand-in here: the suite runs without torch), results and hook
    activations are torch tensors sharing the engine's memory; set_array_type("numpy") forces
    numpy. The real torch was tried by hand (see docs/commands/interventions.md)."""
    import types

    class Tensor:
        def __init__(self, a):
            self.a = a
            self.shape = a.shape

        def __setitem__(self, k, v):
            self.a[k] = v

        def detach(self):
            return self

        def cpu(self):
            return self

        def numpy(self):
            return self.a

    fake = types.ModuleType("torch")
    fake.from_numpy = Tensor
    monkeypatch.setitem(sys.modules, "torch", fake)
    ids = smol.to_tokens("The cat sat")
    assert isinstance(ids, Tensor)
    seen = []

    def zero_head(z, hook):
        seen.append(type(z))
        z[:, :, 0, :] = 0.0  # through the tensor, into the engine's buffer

    lg = smol.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_z", zero_head)])
    assert isinstance(lg, Tensor) and seen == [Tensor]
    _, cache = smol.run_with_cache(ids, names_filter="blocks.1.attn.hook_z")
    assert isinstance(cache["z", 1], Tensor)
    attnscope.set_array_type("numpy")
    try:
        lg2 = smol.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_z", zero_head)])
        assert isinstance(lg2, np.ndarray) and np.array_equal(lg2, lg.a) and seen[-1] is np.ndarray
        assert not np.array_equal(lg2, smol(ids))  # the edit through the tensor took effect
    finally:
        attnscope.set_array_type("auto")
    with pytest.raises(ValueError, match="array type"):
        attnscope.set_array_type("jax")


def test_hooks_outside_attention(smol):
    """hook_embed, the norms' hook_scale / hook_normalized, mlp.hook_pre_linear and
    attn.hook_result, in TransformerLens's names and shapes; edits at them act as they say."""
    ids = smol.to_tokens("The cat sat on the mat")
    n, d, H = ids.shape[1], smol.cfg.d_model, smol.cfg.n_heads
    names = smol.hook_names()
    assert names[0] == "hook_embed" and "hook_pos_embed" not in names
    assert names[-2:] == ["ln_final.hook_scale", "ln_final.hook_normalized"]
    assert "blocks.3.attn.hook_result" in names and "blocks.3.ln2.hook_normalized" in names
    want = ["hook_embed", "blocks.0.hook_resid_pre", "blocks.0.ln1.hook_scale", "blocks.0.ln1.hook_normalized",
            "blocks.2.attn.hook_result", "blocks.2.hook_attn_out", "blocks.1.mlp.hook_pre_linear",
            "ln_final.hook_scale", "ln_final.hook_normalized", f"blocks.{smol.cfg.n_layers - 1}.hook_resid_post"]
    logits, cache = smol.run_with_cache(ids, names_filter=want)
    E, x0 = np.asarray(cache["hook_embed"]), np.asarray(cache["blocks.0.hook_resid_pre"])
    assert E.shape == (1, n, d) and np.array_equal(E, x0)
    s, y = np.asarray(cache["blocks.0.ln1.hook_scale"]), np.asarray(cache["blocks.0.ln1.hook_normalized"])
    assert s.shape == (1, n, 1) and y.shape == (1, n, d)
    assert np.allclose(y * s, x0, rtol=1e-4, atol=1e-5)
    r = np.asarray(cache["result", 2])
    assert r.shape == (1, n, H, d)
    assert np.allclose(r.sum(axis=2), np.asarray(cache["attn_out", 2]), rtol=1e-4, atol=1e-4)
    assert np.asarray(cache["blocks.1.mlp.hook_pre_linear"]).shape == (1, n, smol.cfg.d_mlp)
    last = np.asarray(cache["resid_post", -1])
    sf = np.sqrt((last.astype(np.float64) ** 2).mean(-1, keepdims=True) + smol._m.final_norm()[2])
    assert np.allclose(np.asarray(cache["ln_final.hook_scale"]), sf, rtol=1e-4)
    # reading them changes no bit (hook_attn_out and hook_mlp_out included: read, W_O's and
    # W_down's products still accumulate into the residual as they do without a hook)
    assert np.array_equal(np.asarray(logits), np.asarray(smol(ids)))
    mlp_read, _ = smol.run_with_cache(ids, names_filter=lambda n: n.endswith("hook_mlp_out"))
    assert np.array_equal(np.asarray(mlp_read), np.asarray(smol(ids)))
    # the final norm zeroed leaves logits of 0 (no output bias)

    def zero(a, hook):
        a[...] = 0
    out = np.asarray(smol.run_with_hooks(ids, fwd_hooks=[("ln_final.hook_normalized", zero)]))
    assert np.all(out == 0)
    # zeroing head 3's result at layer 2 is zeroing its z
    def zero_result(a, hook):
        a[:, :, 3] = 0
    def zero_z(a, hook):
        a[:, :, 3] = 0
    by_result = np.asarray(smol.run_with_hooks(ids, fwd_hooks=[("blocks.2.attn.hook_result", zero_result)]))
    by_z = np.asarray(smol.run_with_hooks(ids, fwd_hooks=[("blocks.2.attn.hook_z", zero_z)]))
    assert np.allclose(by_result, by_z, atol=1e-4) and not np.allclose(by_z, np.asarray(logits), atol=1e-3)
    with pytest.raises(ValueError, match="no learned positions"):
        smol.run_with_cache(ids, names_filter="hook_pos_embed")
    with pytest.raises(ValueError, match="hook_embed"):
        smol.run_with_hooks(ids, fwd_hooks=[("hook_embd", zero)])


def test_attribute_grad_x_input_against_autograd(smol):
    """model.attribute (the library, not the CLI) against torch autograd's gradient × input on the
    lesson sentence (tests/golden/smol_gradients.json), and its bad input."""
    ref = json.loads((GOLDEN / "smol_gradients.json").read_text())["texts"]["lesson"]
    sentence = "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc."
    r = smol.attribute(sentence, method="grad-x-input")
    assert list(r["token_ids"]) == ref["token_ids"]
    assert r["target"]["id"] == ref["target_id"] and r["method"] == "grad-x-input"
    assert_cells("smol attribute: log p of the target", r["logprob"], ref["logprob"], atol=1e-4)
    want = np.asarray(ref["grad_input_gxi"])
    assert r["scores"].dtype == np.float32
    assert len(r["tokens"]) == len(want) and isinstance(r["tokens"][0], str)
    assert_cells("smol attribute: grad-x-input [token] vs autograd", r["scores"], want, rel_max=3e-4)
    with pytest.raises(ValueError, match="unknown attribution method"):
        smol.attribute(sentence, method="saliency")
    with pytest.raises(ValueError, match="steps"):
        smol.attribute(sentence, method="integrated-gradients", steps=0)
    with pytest.raises(ValueError, match="--target"):
        smol.attribute(sentence, method="gradient", target=" Hà Nội")


def test_attribute_mixing_and_lrp_against_references(smol):
    """model.attribute's attnlrp (against the authors' lxt), value-zeroing and alti-logit (against
    torch hooks on transformers) on the lesson sentence (tests/golden/mixing/smol.json)."""
    ref = json.loads((GOLDEN / "mixing" / "smol.json").read_text())
    sentence = "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc."
    for method, key in [("attnlrp", "attnlrp"), ("value-zeroing", "value_zeroing_rollout_last"),
                        ("alti-logit", "alti_logit")]:
        r = smol.attribute(sentence, method=method)
        assert list(r["token_ids"]) == ref["token_ids"] and r["method"] == method
        assert_cells(f"smol attribute {method} [token] vs the reference", r["scores"], ref[key], rel_max=2e-5)
    r = smol.attribute(sentence, method="attnlrp")
    assert r["metric"] == "logit"
    # within 2e-5 of max(|logit|, 1), as tests/mixing.rs asserts
    bound = 2e-5 * max(1.0, abs(ref["attnlrp_logit"]))
    assert_cells("smol attnlrp: the logit vs lxt's", r["value"], ref["attnlrp_logit"], atol=bound)
    assert_cells("smol attnlrp: the conservation error vs lxt's", r["conservation_error"],
                 sum(ref["attnlrp"]) - ref["attnlrp_logit"], atol=bound)
    assert len(smol.attribute(sentence, method="alti-logit")["layers"]) == smol.cfg.n_layers
