"""Every fused Triton kernel compiles for the GPU (sm_90, the H200), checked on a machine without
one: triton's interpreter, which the other kernel tests use on a CPU, accepts code the GPU compiler
refuses (jit helpers defined inside ``_kernels()``, loop state that changes type), so a kernel can
pass every CPU test and fail on the first GPU run. One subprocess (the interpreter is off there)
compiles each kernel for a few dtypes through triton's own ptxas."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the fused kernels need triton (pip install triton)")

ROOT = Path(__file__).resolve().parents[2]

COMPILE = r'''
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from workers import kernels, moe_kernels

INT_PTRS = {"pages_ptr", "cached_ptr", "slots_ptr", "qo_ptr", "draft_ptr", "arg_ptr", "nd_ptr",
            "accept_ptr", "tokens_ptr", "tok_ptr", "rows_ptr", "lag_ptr", "ring_tok_ptr",
            "seed_ptr", "counter_ptr", "block_expert_ptr", "ids_ptr"}
FLOAT_ARGS = {"eps", "scale"}
# kernel: [(float pointer type, constexprs), ...]
CASES = {
    "rms_norm": [("fp16", dict(HAS_DELTA=True, BLOCK=256)), ("fp32", dict(HAS_DELTA=False, BLOCK=64))],
    "rope": [("bf16", dict(BLOCK_T=8, BLOCK_H=16, BLOCK=16)), ("fp32", dict(BLOCK_T=1, BLOCK_H=64, BLOCK=64))],
    "qk_norm_rope": [("bf16", dict(BLOCK_T=1, BLOCK_H=64, BLOCK=64)), ("fp32", dict(BLOCK_T=4, BLOCK_H=8, BLOCK=16))],
    "silu_mul": [("fp16", dict(BLOCK=1024))],
    "padded_attention": [("fp16", dict(PAGE=16, BLOCK_D=32, BLOCK_N=64)),
                         ("fp64", dict(PAGE=16, BLOCK_D=16, BLOCK_N=64))],
    "padded_attention_tiled": [("fp16", dict(PAGE=16, BLOCK_W=32, GROUPS=2, BLOCK_D=32, BLOCK_N=64, IEEE=False)),
                               ("bf16", dict(PAGE=16, BLOCK_W=16, GROUPS=4, BLOCK_D=128, BLOCK_N=64, IEEE=False)),
                               ("fp32", dict(PAGE=16, BLOCK_W=64, GROUPS=1, BLOCK_D=16, BLOCK_N=64, IEEE=True))],
    "padded_attention_split": [("bf16", dict(PAGE=16, BLOCK_W=2, GROUPS=8, BLOCK_D=128, BLOCK_N=64, IEEE=False)),
                               ("fp16", dict(PAGE=16, BLOCK_W=8, GROUPS=4, BLOCK_D=64, BLOCK_N=64, IEEE=False)),
                               ("fp32", dict(PAGE=16, BLOCK_W=16, GROUPS=1, BLOCK_D=128, BLOCK_N=64, IEEE=True))],
    "padded_attention_merge": [("bf16", dict(BLOCK_S=64, BLOCK_D=128)), ("fp32", dict(BLOCK_S=128, BLOCK_D=64))],
    "tree_attention": [("fp16", dict(PAGE=16, BLOCK_D=128, BLOCK_N=64, BLOCK_M=16, HAS_LIVE=True)),
                       ("fp64", dict(PAGE=16, BLOCK_D=16, BLOCK_N=64, BLOCK_M=64, HAS_LIVE=False))],
    "tree_attention_tiled": [("bf16", dict(PAGE=16, BLOCK_W=8, GROUPS=4, BLOCK_D=128, BLOCK_N=64, BLOCK_M=16, HAS_LIVE=True, SPLIT=True, IEEE=False)),
                             ("fp16", dict(PAGE=16, BLOCK_W=16, GROUPS=4, BLOCK_D=128, BLOCK_N=64, BLOCK_M=16, HAS_LIVE=False, SPLIT=False, IEEE=False)),
                             ("fp32", dict(PAGE=16, BLOCK_W=16, GROUPS=1, BLOCK_D=64, BLOCK_N=64, BLOCK_M=64, HAS_LIVE=True, SPLIT=True, IEEE=True))],
    "store_kv": [("fp16", dict(PADDED=True, PAGE=16, BLOCK_T=16, BLOCK_H=4, BLOCK_D=32)),
                 ("fp32", dict(PADDED=False, PAGE=16, BLOCK_T=2, BLOCK_H=8, BLOCK_D=128))],
    "greedy_accept": [("fp32", dict(BLOCK_S=8))],
    "one_hot": [("fp32", dict(BLOCK=1024))],
    "lag_append": [("fp16", dict(BLOCK_D=256))],
    "uniforms": [("fp32", dict(BLOCK=8))],
    "gate_up": [("bf16", dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, IEEE=False)),
                ("fp32", dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, IEEE=True))],
    "down": [("bf16", dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, IEEE=False)),
             ("fp32", dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, IEEE=True))],
    "pair_gate_up": [("bf16", dict(BLOCK_N=16, BLOCK_K=256)),
                     ("fp32", dict(BLOCK_N=16, BLOCK_K=256))],
    "pair_down": [("bf16", dict(BLOCK_N=16, BLOCK_K=256)),
                  ("fp32", dict(BLOCK_N=16, BLOCK_K=256))],
    "align": [("i64", dict(BLOCK=16, EXPERTS=128, CHUNK=64))],
    # align_multi's passes: counts_ptr, starts_ptr int32 (the case's type), the rest int64
    "align_count": [("i32", dict(EXPERTS=128, CHUNK=64))],
    "align_scan": [("i32", dict(BLOCK=16, EXPERTS=128, ROWS=64))],
    "align_scatter": [("i32", dict(EXPERTS=128, CHUNK=64))],
    "route": [("bf16", dict(EXPERTS=128, K=8, NORM=True)), ("fp32", dict(EXPERTS=16, K=4, NORM=False))],
    "combine": [("bf16", dict(HAS_SHARED=True, NORM=True, BLOCK=2048)),
                ("fp32", dict(HAS_SHARED=False, NORM=False, BLOCK=64))],
}
out = {}
found = {**vars(kernels._kernels()), **vars(moe_kernels._kernels())}
for name in sorted(found):
    fn = found[name]
    for ftype, const in CASES.get(name, [(None, None)]):
        key = f"{name}/{ftype}"
        if const is None:
            out[key] = "no case: add one to CASES"
            continue
        sig = {}
        for arg, p in inspect.signature(fn.fn).parameters.items():
            if arg in const:
                sig[arg] = "constexpr"
            elif arg.endswith("_ptr"):
                sig[arg] = "*i64" if arg in INT_PTRS else f"*{ftype}"
            else:
                sig[arg] = "fp32" if arg in FLOAT_ARGS else "i32"
        try:
            triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4})
            out[key] = "ok"
        except Exception as e:  # noqa: BLE001 - reported by name
            out[key] = f"{type(e).__name__}: {str(e)[-400:]}"
print(json.dumps(out))
'''


def test_every_kernel_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, "-c", COMPILE], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    if run.returncode != 0 and "ptxas" in run.stderr:
        pytest.skip(f"triton cannot compile for CUDA here: {run.stderr[-300:]}")
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    failed = {k: v for k, v in results.items() if v != "ok"}
    assert not failed, failed
    assert len(results) >= 10
