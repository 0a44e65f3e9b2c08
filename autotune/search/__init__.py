"""Which config next: search spaces, the proposer and its throughput model, the tuner loop that
measures, confirms and decides, worker processes, and grids of every config. May import every
folder below it (``config`` to ``study``), never ``output``.
"""
