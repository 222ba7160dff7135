"""The project's scripts, run as modules from the repository root (`python -m scripts.bench.adaptive
--help`; under torchrun: `torchrun --nproc-per-node 2 -m scripts.bench.dp ...`):

- `scripts.bench`: the benchmarks, and `scripts.bench.common`, what they share;
- `scripts.diag`: diagnostics and one-off probes;
- `scripts.gen`: generators (the bundled pair's training, random-weight checkpoints, traces).

The shell scripts beside them (`setup_env.sh`, `test.sh`, `gpu_check.sh`, `demo.sh`) run with
`bash scripts/NAME.sh`.
"""
