"""The engine of one rank: model, KV cache, attention backends, EAGLE worker, scheduler, engine.

Imports `collectives` and `adaptive_dist`; nothing below imports `workers`.
"""
