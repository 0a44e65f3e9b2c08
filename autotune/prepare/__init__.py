"""What a config does to a model: LoRA adapters, activation checkpointing (and, next, the loss,
attention and compile), applied the same way in trials and in users' jobs, and the facts about a
model that say which of them it can take, found before any trial.

May import ``config`` and ``models``; trials and the estimator use it.
"""
