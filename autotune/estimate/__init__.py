"""Peak memory without running: the real training step traced on fake tensors, split into parts,
with ZeRO's per-rank arithmetic, served by a long-lived estimate process. May import ``config``,
``models``, ``prepare`` and ``trial`` (the engines it traces and the memory tracker).
"""
