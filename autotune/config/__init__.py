"""What is asked: the workload (model, task, sequence length, batch, ranks, device), the knobs of
one training configuration (TrialConfig) and the device it runs on, with DeepSpeed's reading of a
config. Imports nothing of autotune but errors, sizes and the levers (``TrialConfig`` is composed of their
fields).
"""
