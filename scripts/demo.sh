#!/usr/bin/env bash
# The main job on the bundled default, CPU only, no download: generate phased acceptance traces
# for 2 ranks and replay them through the adaptive policy and the real per-round consensus on
# 2 gloo ranks under torchrun. Prints the summary; decisions go to runs/demo/decisions.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
out=runs/demo
rm -rf "$out/traces"
.venv/bin/python -m scripts.gen.make_traces --ranks 2 --rounds 600 --out "$out/traces" --seed "${SEED:-0}"
OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 -m adaptive_dist consensus \
  --trace "$out/traces" --policy ema --out "$out/decisions.jsonl" "$@"
echo "decisions: $out/decisions.jsonl"
