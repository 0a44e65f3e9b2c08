"""How fast a config should train, before and after some were measured: the driver's ranking.

tokens/s is modelled as a product: a prior factor per knob value (what each knob usually costs
or buys on this kind of device) times the micro batch's saturation ``mb / (mb + 2)`` (larger
micro batches fill the device better, with diminishing returns). Measurements correct it: a
ridge regression, in log space, of what was measured over the prior on one indicator per knob
value and on the saturation term, so one surprising trial moves the ranking half-way, several
agreeing trials move it all the way. Only the order matters: the driver measures the config
predicted fastest among those that should fit.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig

__all__ = ["ThroughputModel"]

SATURATION_BATCH = 2.0   # per-rank micro batch at which throughput reaches half its plateau
RIDGE = 0.5              # pull of the prior: a correction is shrunk by RIDGE / (RIDGE + evidence)

# Prior factors. They only order the first proposals; measured trials override them.
_CHECKPOINTING = 0.7     # the forward runs again inside the backward; used where no traced step counted it
_CHUNKED_LOSS = 0.95     # the LM head's matmul runs again inside the backward
_COMPILE = 1.1          # fused kernels, fewer launches; its compile time is never in tokens/s
_FUSED_OPTIMIZER = 1.03  # one kernel over all parameters: the optimizer step is a small part of a step
_ATTENTION = {"eager": 0.9, "flash_attention_2": 1.1}  # eager materialises the s x s scores; auto, sdpa, flex: 1
_LORA = 1.1              # no gradients for the frozen weights, a tiny optimizer
_ZERO = {0: 0.98, 1: 0.97, 2: 0.93, 3: 0.8}       # more communication per step (on several ranks)
_OFFLOAD = {"none": 1.0, "optimizer": 0.5, "optimizer+params": 0.3}  # the step runs on the host
# Precision: the device's own matmul speed per dtype (autotune.trial.device_probe), square-rooted: a
# training step is not all matmuls (norms, softmax, casts and the optimizer are not sped up).
# Without a probe nothing is assumed: every precision starts equal and trials tell them apart.
_PRECISION_WEIGHT = 0.5
_PRECISION_RANGE = (0.1, 10.0)


class ThroughputModel:
    """Predicted log tokens/s of configs, from the prior and the measured trials."""

    def __init__(self, params_of: Callable[[TrialConfig], dict[str, Any]],
                 precision_speed: dict[str, float] | None = None,
                 recompute_factor: Callable[[TrialConfig], float | None] | None = None) -> None:
        """``recompute_factor``: a checkpointing config's compute without recomputation over its
        compute with it, counted on traced steps (None where not counted: the constant prior)."""
        self._params_of = params_of
        self._recompute_factor = recompute_factor
        low, high = _PRECISION_RANGE
        self._precision = {p: min(max(speed, low), high) ** _PRECISION_WEIGHT
                           for p, speed in (precision_speed or {}).items()}
        self._features: list[tuple[str, Any]] = []
        self._weights: list[float] = []
        self._intercept = 0.0

    def prior(self, config: TrialConfig) -> float:
        factor = self._precision.get(config.precision, 1.0) * _OFFLOAD.get(config.offload, 1.0)
        counted = self._recompute_factor(config) if config.checkpointing and self._recompute_factor else None
        if counted is not None:
            factor *= counted
        elif config.checkpointing:  # every N-th layer recomputes 1/N of what checkpointing every layer does
            factor *= 1 - (1 - _CHECKPOINTING) / config.checkpoint_every
        if config.loss_chunks is not None:
            factor *= _CHUNKED_LOSS
        if config.fused_optimizer:
            factor *= _FUSED_OPTIMIZER
        factor *= _ATTENTION.get(config.attention, 1.0)
        if config.compile:
            factor *= _COMPILE
        if config.uses_lora:
            factor *= _LORA
        if config.zero_stage is not None:
            factor *= _ZERO.get(config.zero_stage, 1.0)
        return math.log(factor) + self._saturation(config)

    def predict(self, config: TrialConfig) -> float:
        """log tokens/s up to a constant: comparable between configs, not a figure to report."""
        x = self._vector(config)
        return self.prior(config) + self._intercept + sum(w * v for w, v in zip(self._weights, x))

    def fit(self, measured: list[tuple[TrialConfig, float]]) -> ThroughputModel:
        """Correct the prior with (config, tokens/s) pairs of trials that trained."""
        import numpy as np

        points = [(c, t) for c, t in measured if t and t > 0]
        if not points:
            return self
        self._features = sorted({(k, repr(v)) for c, _ in points for k, v in self._params_of(c).items()
                                 if k != "micro_batch"}) + [("saturation", "")]
        X = np.array([self._vector(c) for c, _ in points])
        y = np.array([math.log(t) - self.prior(c) for c, t in points])
        # Unpenalised intercept: centre, solve the ridge, put the mean back.
        x_mean, y_mean = X.mean(axis=0), y.mean()
        Xc, yc = X - x_mean, y - y_mean
        w = np.linalg.solve(Xc.T @ Xc + RIDGE * np.eye(X.shape[1]), Xc.T @ yc)
        self._weights = [float(v) for v in w]
        self._intercept = float(y_mean - x_mean @ w)
        return self

    def _vector(self, config: TrialConfig) -> list[float]:
        params = {(k, repr(v)) for k, v in self._params_of(config).items() if k != "micro_batch"}
        return [self._saturation(config) if name == "saturation" else float((name, value) in params)
                for name, value in self._features]

    @staticmethod
    def _saturation(config: TrialConfig) -> float:
        return math.log(config.micro_batch / (config.micro_batch + SATURATION_BATCH))
