"""Where a model comes from: built-in presets, a config file or directory, a Hub id from the local
cache, or a factory; the task a model trains for and the synthetic batches it is fed. Random
weights, directly on the trial's device. May import ``config``.
"""
