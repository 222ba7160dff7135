#!/usr/bin/env bash
# The whole GPU suite in one go (for the device machine: 2 x H200, python3 with torch + CUDA):
# multi-rank NCCL tests (consensus, DP attention with CUDA graphs), the GPU engine tests (graphs,
# flashinfer, device-side sampling), the consensus cost on each channel, the DP-attention benchmark,
# and `generate --dp 2` against one process. Prints a short table last.
#   bash scripts/gpu_check.sh [OUTDIR]       (OUTDIR defaults to $OUT or runs/gpu)
# STEPS="a b" runs only those steps (names below); BENCH_REPEATS sets the benchmarks' repeats;
# ADAPTIVE_ARGS adds arguments to both bench_adaptive runs (e.g. "--new-tokens 256 --set ...");
# SERVE_K narrows the GPU serving tests (a pytest -k expression).
# Wheels for packages the machine lacks (flashinfer, tvm-ffi, pyzmq, the server stack) are taken
# from .whl/ if present; flashinfer's compiled kernels are restored from .gpu/flashinfer_cache.tar
# and saved back to OUTDIR when they changed (the first use compiles for about 90 s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-runs/gpu}}
mkdir -p "$OUTDIR/res"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
declare -A STATUS
ORDER=()
want() { [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" $1 "* ]]; }
step() {  # step NAME CMD... : run, log, remember the exit status
  local name=$1; shift
  want "$name" || return 0
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUTDIR/res/$name.log" | tail -n 30
  local rc=${PIPESTATUS[0]}
  STATUS[$name]="rc=$rc $((SECONDS - t0))s"
  ORDER+=("$name")
}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi}
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
[ -f .gpu/flashinfer_cache.tar ] && tar -xf .gpu/flashinfer_cache.tar -C "$FLASHINFER_WORKSPACE_BASE"
CACHE_BEFORE=$(find "$FLASHINFER_WORKSPACE_BASE" -type f | wc -l)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# the package itself (its entry points register `generate` and `serve` with `python -m adaptive_dist`)
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
  || echo "note: pip install -e . failed; plug-in commands (generate, serve) will be missing"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"

step gpu_multirank python3 -m pytest -q tests/gpu/test_multirank.py -p no:cacheprovider
step bench_dp timeout 240 torchrun --nproc-per-node 2 -m scripts.bench.dp --dp 2 --device cuda \
  --batch 8 --new-tokens 64 --repeats "${BENCH_REPEATS:-3}" --out "$OUTDIR/res/bench_dp"
P='def parse_config(path):\n'
step generate_dp2 bash -c "python3 -m adaptive_dist generate --device cuda --eager --no-spec \
    --prompts tests/data/prompts_dp.jsonl --max-new-tokens 40 --json | tail -1 > /tmp/one.json && \
  torchrun --nproc-per-node 2 -m adaptive_dist generate --dp 2 --device cuda --adaptive \
    --prompts tests/data/prompts_dp.jsonl --max-new-tokens 40 --json | tail -1 > /tmp/dp2.json && \
  python3 -c \"import json,sys; a=json.load(open('/tmp/one.json')); b=json.load(open('/tmp/dp2.json')); \
ok=[x['token_ids'] for x in a['outputs']]==[x['token_ids'] for x in b['outputs']]; \
print('one process no-spec == dp2 adaptive graphs:', ok, 'graph rounds', b['graph_rounds'], '/', b['rounds'], \
'per replica', b['dp_ranks']); sys.exit(0 if ok else 1)\""
step generate_dp2_flashinfer bash -c "python3 -m adaptive_dist generate --device cuda --eager \
    --attention-backend flashinfer --no-spec --prompts tests/data/prompts_dp.jsonl --max-new-tokens 40 \
    --json | tail -1 > /tmp/one_fi.json && torchrun --nproc-per-node 2 -m adaptive_dist generate --dp 2 \
    --device cuda --attention-backend flashinfer --adaptive --prompts tests/data/prompts_dp.jsonl \
    --max-new-tokens 40 --json | tail -1 > /tmp/dp2_fi.json && python3 -c \"import json,sys; \
a=json.load(open('/tmp/one_fi.json')); b=json.load(open('/tmp/dp2_fi.json')); \
same=[x['token_ids']==y['token_ids'] for x,y in zip(a['outputs'],b['outputs'])]; \
print('flashinfer prefill: one process no-spec == dp2 adaptive graphs, per prompt:', same); \
sys.exit(0 if all(same) else 1)\""
step serve_gpu env ADAPTIVE_DIST_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider \
  tests/multirank/test_serve_cluster.py tests/unit/test_serve_api.py \
  -k "${SERVE_K:-reference or greedy or bad_requests or client_gone or rank_death}"
step serve_matrix timeout 420 python3 -m scripts.bench.serve_matrix --nproc 2 \
  --serve "--dp 2 --device cuda" --concurrency 4 32 --repeats "${BENCH_REPEATS:-3}" \
  --out "$OUTDIR/res/serve_matrix"
step gpu_engine python3 -m pytest -q tests/gpu/test_engine.py tests/gpu/test_torch_backend.py \
  tests/gpu/test_spec_decode_gpu.py tests/gpu/test_moe_gpu.py tests/unit/test_kernels.py \
  tests/unit/test_moe.py -p no:cacheprovider
# the hot path, before and after, in one call: BEFORE (a tree exported to .gpu/before, e.g.
# `git archive <ref> collectives adaptive_dist workers/*.py workers/attention workers/model
# workers/server | tar -x -C .gpu/before`) against this tree
# (.gpu/hotpath_before.json: a 'before' run kept from an earlier call, used as it is);
# `python3 -P`: the current directory (this tree) is not put first on the path, so `workers`
# and its packages come from .gpu/before and only `scripts` from here (through PYTHONPATH)
if [ -f .gpu/hotpath_before.json ]; then
  mkdir -p "$OUTDIR/res/hotpath" && cp .gpu/hotpath_before.json "$OUTDIR/res/hotpath/before.json"
elif [ -d .gpu/before/workers ]; then
  step hotpath_before env PYTHONPATH=$PWD/.gpu/before:$PYTHONPATH python3 -P -m scripts.bench.hotpath \
    --overlap off \
    --device cuda --label before --model workers/assets/tiny_pair --out "$OUTDIR/res/hotpath" \
    --batches ${HOTPATH_BATCHES:-1 16 64} --modes ${HOTPATH_BEFORE_MODES:-nospec 1 3 7}
fi
# (after: overlapped rounds, and the same depths serial, interleaved in one process; whole runs
# and steady decode windows; HOTPATH_MODES narrows the modes)
step hotpath_after timeout 420 python3 -m scripts.bench.hotpath --device cuda --label after \
  --overlap on --modes ${HOTPATH_MODES:-nospec 1 3 7 nospec+serial 1+serial 3+serial 7+serial} \
  --batches ${HOTPATH_BATCHES:-1 16 64} --out "$OUTDIR/res/hotpath"
# host work per round on this machine's CPU (graphs, overlap), per part, static depths 0/1/3/7
step host_cuda python3 -m scripts.bench.host --device cuda --batch 16 --tokens 256 \
  --repeats "${BENCH_REPEATS:-3}" --out "$OUTDIR/res/host_cuda"
# the issue's yardstick (scripts.bench.engine, float16, CUDA graphs), serial and overlapped interleaved
step engine_overlap bash -c "for r in \$(seq ${BENCH_REPEATS:-3}); do for o in off on; do \
  python3 -m scripts.bench.engine --device cuda --variants torch/graphs --new-tokens 48 \
  --overlap \$o --out $OUTDIR/res/engine_overlap/\${o}_\$r | tail -n 8 || exit 1; done; done"
[ -f "$OUTDIR/res/hotpath/before.json" ] && step hotpath_table python3 -m scripts.bench.hotpath \
  --merge "$OUTDIR/res/hotpath/before.json" "$OUTDIR/res/hotpath/after.json" --out "$OUTDIR/res/hotpath"
# adaptive against static depth (issue: goodput): one GPU, then heterogeneous DP on two
step diag_continuous python3 -m scripts.diag.continuous cuda 16 "$OUTDIR/res/diag_continuous/diag.json"
# a depth-0 round of a speculating engine against a headless one, per catch-up interval
step host_probe python3 -m scripts.diag.host_probe --seconds "${HOST_PROBE_SECONDS:-30}" \
  --out "$OUTDIR/res/host_probe"
step bench_depth0 python3 -m scripts.bench.depth0 --device cuda --repeats "${BENCH_REPEATS:-5}" \
  --out "$OUTDIR/res/bench_depth0"
# the padded prefill's and a round's kernels (torch.profiler) and graph replays, head or not
step profile_prefill python3 -m scripts.diag.profile_prefill --device cuda --out "$OUTDIR/res/profile_prefill"
# sampled rounds: the uniforms in torch operations against the fused kernel (same tokens)
step bench_sampling python3 -m scripts.bench.sampling --device cuda --repeats "${BENCH_REPEATS:-5}" \
  --out "$OUTDIR/res/bench_sampling"
step bench_depth0_8b python3 -m scripts.bench.depth0 --device cuda --shape llama3-8b --iters 10 \
  --repeats 3 --no-engine --out "$OUTDIR/res/bench_depth0_8b"
step bench_adaptive timeout "${ADAPTIVE_TIMEOUT:-400}" python3 -m scripts.bench.adaptive --device cuda \
  --batches ${ADAPTIVE_BATCHES:-1 16 64} --repeats "${BENCH_REPEATS:-3}" ${ADAPTIVE_ARGS:-} \
  --out "$OUTDIR/res/bench_adaptive"
step bench_adaptive_dp2 timeout "${ADAPTIVE_TIMEOUT:-400}" torchrun --nproc-per-node 2 \
  -m scripts.bench.adaptive --dp 2 --device cuda --workloads heterogeneous transition \
  --batches ${ADAPTIVE_BATCHES:-1 16 64} --repeats "${BENCH_REPEATS:-3}" ${ADAPTIVE_ARGS:-} \
  --out "$OUTDIR/res/bench_adaptive_dp2"
# production shapes without a download: an 8B-shaped target + EAGLE-3-shaped head (random bf16)
step model_shapes bash -c "for l in tp2 dp2; do timeout 280 torchrun --nproc-per-node 2 \
  -m scripts.bench.model_shapes --layout \$l --out $OUTDIR/res/model_shapes || exit 1; done"
# one GPU: the 8B-shaped table and the Qwen3-30B-A3B-shaped MoE table; the fused MoE layer's floor
step model_shapes_1gpu bash -c "for sh in llama3-8b qwen3-30b-a3b; do timeout 280 python3 \
  -m scripts.bench.model_shapes --layout tp1 --shape \$sh --out $OUTDIR/res/model_shapes || exit 1; done"
step moe_layer timeout 200 python3 -m scripts.bench.moe_layer --out "$OUTDIR/res/moe_layer"
step bench_consensus bash -c "for ch in control device; do torchrun --nproc-per-node 2 \
  -m scripts.bench.consensus --rounds 3000 --channel \$ch --out $OUTDIR/res/consensus_\$ch || exit 1; done"
if [ "$(find "$FLASHINFER_WORKSPACE_BASE" -type f | wc -l)" != "$CACHE_BEFORE" ]; then
  tar -cf "$OUTDIR/flashinfer_cache.tar" -C "$FLASHINFER_WORKSPACE_BASE" .
fi
tar -czf "$OUTDIR/gpu_results.tar.gz" -C "$OUTDIR" res && rm -rf "$OUTDIR/res"
echo
echo "step                     status"
for k in "${ORDER[@]}"; do printf '%-24s %s\n' "$k" "${STATUS[$k]}"; done
