"""Diagnostics and one-off probes (`python -m scripts.diag.NAME --help`)."""
