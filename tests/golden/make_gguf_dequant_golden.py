"""Golden dequantization: each GGUF block type as gguf-py (llama.cpp's Python package) reads it.
Blocks are gguf-py's own quantization of random values where it has one, else random bytes with
sane f16 scales. Output: tests/golden/gguf_dequant.json.
Run: ~/.hfenv/bin/python tests/golden/make_gguf_dequant_golden.py tests/golden/gguf_dequant.json"""
import json, sys, numpy as np, gguf
from gguf import GGMLQuantizationType as T
from gguf import quants
rng = np.random.default_rng(20261203)
import importlib.metadata as md
out = {"producer": f"gguf-py {md.version('gguf')} (gguf.quants.quantize / dequantize), numpy {np.__version__}", "types": {}}
# byte offsets of the f16 scales in each block, to keep them finite and sane
f16_at = {T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
          T.IQ4_NL: [0], T.IQ4_XS: [0]}
for t in [T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]:
    bs, ts = gguf.GGML_QUANT_SIZES[t]
    n = 256  # one K-block, eight 32-blocks
    x = (rng.standard_normal((1, n)) * 0.05).astype(np.float32)
    how = "quantized"
    try:
        q = quants.quantize(x, t)
    except (NotImplementedError, quants.QuantError, Exception) as e:
        how = "random bytes"
        nb = n // bs
        q = rng.integers(0, 256, size=(nb, ts), dtype=np.uint8)
        for off in f16_at.get(t, []):
            d = np.array([rng.uniform(0.001, 0.02)], dtype=np.float16).view(np.uint8)
            q[:, off:off + 2] = d
        q = q.reshape(1, -1)
    raw = np.ascontiguousarray(q).view(np.uint8).reshape(-1)
    deq = quants.dequantize(np.ascontiguousarray(q), t).astype(np.float32).reshape(-1)
    assert deq.size == n and np.all(np.isfinite(deq)), t
    out["types"][t.name] = {"type_id": int(t), "block": bs, "bytes_per_block": ts, "blocks": how,
                            "hex": raw.tobytes().hex(), "values": [float(str(v)) for v in deq]}
    print(t.name, how, raw.size, "bytes", file=sys.stderr)
json.dump(out, open(sys.argv[1], "w"), separators=(",", ":"))
