#!/usr/bin/env bash
# Installs real TransformerLens into target/torchenv (made as .ci/run makes it) for
# bindings/python/tests/test_tl_real.py. Not run by CI (yet): on Debian's torch 1.13 only TL 2.16.1
# installs, and there the comparison fails two checks and peaks at ~17 GB (see #59's note).
# Usage: bash bindings/python/tests/tl_env.sh && ATTNSCOPE_REQUIRE_TL=1 PYTHONPATH=<dir with attnscope>
#        target/torchenv/bin/python -m pytest -q bindings/python/tests/test_tl_real.py
set -euo pipefail
cd "$(dirname "$0")/../../.."
say() { echo "== $*"; }
say "real TransformerLens in the torch environment (bindings/python/tests/test_tl_real.py)"
# TL 4 (what TL's demos use now) needs torch >= 2.6 and Debian's is 1.13: TL 2.16.1, whose
# HookedTransformer TL 3 and 4 keep, installed with --no-deps (it pins torch >= 2.6 but runs on
# 1.13) beside its real dependencies and transformers 4.46.3 (the last that enables torch 1.x,
# with the GGUF loader); the pins keep Debian's torch and numpy (no second torch, no numpy 2)
pins=target/torchenv-pins.txt
target/torchenv/bin/python -c 'import torch, numpy; print("torch==" + torch.__version__.split("+")[0]); print("numpy==" + numpy.__version__)' > $pins
cat .ci/torchenv-pins.txt >> $pins
target/torchenv/bin/python -m pip install -q --no-deps transformer-lens==2.16.1
target/torchenv/bin/python -m pip install -q -c $pins transformers accelerate gguf datasets pyarrow wandb pytest \
  beartype better-abc fancy-einsum jaxtyping pandas rich sentencepiece typeguard transformers-stream-generator
target/torchenv/bin/python -c 'import torch, transformers, transformer_lens; print("TransformerLens", transformer_lens.__version__ if hasattr(transformer_lens, "__version__") else "2.16.1", "transformers", transformers.__version__, "torch", torch.__version__)'
