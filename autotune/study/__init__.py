"""Where results live: the Optuna storage (SQLite or a server), reading a study back into trial
records and a summary, and the answer's bookkeeping. May import ``config``, ``models``, ``prepare``
and ``trial`` (TrialResult); never the search that writes it.
"""
