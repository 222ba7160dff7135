#!/usr/bin/env bash
# Run the test suite (CPU; GPU tests skip cleanly without GPUs) in parallel on 2 workers.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit/test_policy.py -k ladder`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
ADAPTIVE_DIST_REQUIRE_SGLANG=1 exec .venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" -q "$@"
