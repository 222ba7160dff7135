#!/usr/bin/env bash
# Create (or reuse) .venv with everything the project needs: the CPU build of torch, the package
# itself (editable) and the test tools. Safe to run again; it reinstalls only when pyproject.toml
# changed. Override the torch requirement with TORCH_SPEC (default torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
stamp=.venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
if [ ! -f "$stamp" ]; then
  echo "[setup] installing $TORCH_SPEC and adaptive_dist[test] into .venv (first run only)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "$TORCH_SPEC"
  .venv/bin/python -m pip install -q -e ".[test]"
  # SGLang's serving benchmark, run unmodified by the serving tests: its 0.4.x wheel imports
  # without the rest of sglang's runtime (no torch build of its own, no CUDA)
  .venv/bin/python -m pip install -q --no-deps "${SGLANG_SPEC:-sglang==0.4.10.post2}"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
