"""One config measured in its own process: the runner (a fresh process per trial, real timeouts),
the trial server that forks ranks, the child and its training engines, the step timing, the
CPU memory tracker, failure classes and the TrialResult; also the device's speed per precision.
May import ``config``, ``models`` and ``prepare``.
"""
