"""Generators: the bundled pair's training, random-weight checkpoints, acceptance traces
(`python -m scripts.gen.NAME --help`)."""
