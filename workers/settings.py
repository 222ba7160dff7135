"""The settings of the engine commands (`generate`, `serve`), typed: what the command line asks
for, parsed once at the CLI (`workers.cli`, `workers.server.cli`) and handed whole to the library
(`workers.launch`, `workers.loading`, `workers.server.launch`), which never sees an argparse
namespace.

Importing this module imports only the standard library (the parsers use its choices).
"""
from __future__ import annotations

ATTENTION_BACKENDS = ("torch", "flashinfer")
"""Attention of the ragged forwards (prefill): `--attention-backend`, `EngineConfig.attention_backend`."""
MLP_SCATTERS = ("reduce_scatter", "all_reduce")
"""How MLP outputs return to the DP replicas: `--mlp-scatter`, `ModelParallel.scatter`."""
