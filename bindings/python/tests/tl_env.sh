#!/usr/bin/env bash
# Makes target/tlenv, the Python with real TransformerLens 4.3 that bindings/python/tests/test_tl_real.py
# compares attnscope with (tests/python.rs runs it there; .ci/run runs this script): torch 2.15,
# transformers 5.25 and transformer-lens 4.3.0 from PyPI, every package pinned by .ci/tlenv-pins.txt,
# and attnscope from the wheel in target/wheels (built here when there is none, as .ci/run builds it
# once for target/pyenv and this environment). target/pyenv stays without torch.
# Usage: bash bindings/python/tests/tl_env.sh && cargo test --release --test python transformer_lens
set -euo pipefail
cd "$(dirname "$0")/../../.."
say() { echo "== [$(date -u +%T)] $*"; }
wheel=(target/wheels/attnscope-*.whl)
if [[ ! -e ${wheel[0]} ]]; then
  say "the attnscope wheel (maturin; reuses this workspace's release build)"
  python3 -m pip wheel -q --no-deps ./bindings/python -w target/wheels
  wheel=(target/wheels/attnscope-*.whl)
fi
if (( ${#wheel[@]} != 1 )); then
  echo "tl_env.sh: more than one wheel in target/wheels (${wheel[*]}): remove the old ones" >&2
  exit 2
fi
say "real TransformerLens in target/tlenv (bindings/python/tests/test_tl_real.py)"
python3 -m venv target/tlenv
# exactly the pinned set, without triton (1 GB: torch's compiler for GPUs, which neither TL nor the
# tests use on the CPU; torch imports without it), and without pip's cache (torch's and CUDA's
# wheels would take ~3 GB more there): CI machines can be short of disk (a CI run ran out of it here)
grep -v -E '^(#|triton==)' .ci/tlenv-pins.txt > target/tlenv-pins.txt
target/tlenv/bin/python -m pip install -q --no-cache-dir --no-deps -r target/tlenv-pins.txt
target/tlenv/bin/python -m pip install -q --force-reinstall --no-deps "${wheel[0]}"
target/tlenv/bin/python -c 'import importlib.metadata as m; print(*(f"{p} {m.version(p)}" for p in ("transformer-lens", "transformers", "torch", "numpy", "attnscope")), sep=", ")'
