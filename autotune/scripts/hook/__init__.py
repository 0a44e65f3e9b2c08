"""The folder a script trial puts first on ``PYTHONPATH``: its ``sitecustomize`` loads the measurement."""
