#!/usr/bin/env bash
# The whole GPU suite in one go (for the device machine: 2 x H200, python3 with torch + CUDA):
# GPU tests, multi-rank NCCL tests, the consensus benchmark on NCCL and gloo, a consensus-only
# run on NCCL, and (when present) the engine's GPU benchmark. Prints a short table last.
#   bash scripts/gpu_check.sh [OUTDIR]       (OUTDIR defaults to $OUT or runs/gpu)
# SKIP_BENCH=1 runs only the tests and checks; SKIP_ENGINE=1 leaves out the engine's steps.
# Wheels for packages the machine lacks (flashinfer, tvm-ffi) are taken from .whl/ if present.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-runs/gpu}}
mkdir -p "$OUTDIR/res"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
declare -A STATUS
step() {  # step NAME CMD... : run, log, remember the exit status
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUTDIR/res/$name.log" | tail -n 25
  local rc=${PIPESTATUS[0]}
  STATUS[$name]="rc=$rc $((SECONDS - t0))s"
}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  # flashinfer kernels built ahead (nvcc, sm_90a) skip its ~90 s JIT compile on first use
  if [ -d .whl/aot ] && [ -d /tmp/site/flashinfer ]; then
    mkdir -p /tmp/site/flashinfer/data/aot && cp -r .whl/aot/* /tmp/site/flashinfer/data/aot/
  fi
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"

python3 scripts/make_traces.py --ranks 2 --rounds 600 --out "$OUTDIR/res/traces" --seed 7 >/dev/null
step gpu_tests python3 -m pytest -q -m gpu ${GPU_TESTS:-tests} -p no:cacheprovider
step consensus_nccl torchrun --nproc-per-node 2 -m adaptive_dist consensus \
  --trace "$OUTDIR/res/traces" --policy ema --out "$OUTDIR/res/decisions_nccl.jsonl" --no-progress
if [ "${SKIP_BENCH:-0}" != 1 ]; then
step bench_consensus_nccl torchrun --nproc-per-node 2 scripts/bench_consensus.py --rounds 3000 \
  --out "$OUTDIR/res/consensus_nccl"
step bench_consensus_gloo torchrun --nproc-per-node 2 scripts/bench_consensus.py --rounds 3000 \
  --backend gloo --out "$OUTDIR/res/consensus_gloo"
fi
if [ "${SKIP_ENGINE:-0}" != 1 ]; then
  [ "${SKIP_BENCH:-0}" != 1 ] && step bench_engine timeout 300 python3 scripts/bench_engine.py \
    --device cuda --out "$OUTDIR/res/engine" --max-seconds "${BENCH_SECONDS:-150}"
  P='def parse_config(path):\n'
  step tp2_graphs_vs_tp1 bash -c "python3 -m workers generate --device cuda --eager --prompt '$P' \
      --steps 3 --max-new-tokens 40 --json | tail -1 > /tmp/tp1.json && \
    torchrun --nproc-per-node 2 -m workers generate --tp 2 --device cuda --adaptive --prompt '$P' \
      --max-new-tokens 40 --json | tail -1 > /tmp/tp2.json && \
    python3 -c \"import json,sys; a=json.load(open('/tmp/tp1.json')); b=json.load(open('/tmp/tp2.json')); \
ok=a['outputs'][0]['token_ids']==b['outputs'][0]['token_ids']; \
print('tp1 eager == tp2 adaptive graphs:', ok, 'graph rounds', b['graph_rounds'], '/', b['rounds']); sys.exit(0 if ok else 1)\""
fi
rm -rf "$OUTDIR/res/traces"
tar -czf "$OUTDIR/gpu_results.tar.gz" -C "$OUTDIR" res && rm -rf "$OUTDIR/res"
echo
echo "step                     status"
for k in "${!STATUS[@]}"; do printf '%-24s %s\n' "$k" "${STATUS[$k]}"; done | sort
