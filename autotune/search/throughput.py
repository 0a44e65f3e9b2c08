"""How fast a config should train, before and after some were measured: the driver's ranking.

The prior is the step-time model's prediction (:mod:`autotune.estimate.step_time`): the config's
traced operators against this device's measured roofline, so a knob is worth what it does to this
model's step on this device, with no hand-set factor. A config whose family has no traced step yet
(no estimator: script mode, or a model it cannot trace) sits at the mean of the predicted ones, with
only the micro batch's saturation ``mb / (mb + 2)`` telling its sizes apart. Measurements correct
the prior: a ridge regression, in log space, of what was measured over the prior on one indicator
per knob value and on the saturation term, so one surprising trial moves the ranking half-way,
several agreeing trials move it all the way. Only the order matters: the driver measures the config
predicted fastest among those that should fit.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig

__all__ = ["ThroughputModel"]

SATURATION_BATCH = 2.0  # per-rank micro batch at which throughput reaches half its plateau
RIDGE = 0.5  # pull of the prior: a correction is shrunk by RIDGE / (RIDGE + evidence)


class ThroughputModel:
    """Predicted log tokens/s of configs, from the prior and the measured trials."""

    def __init__(
        self,
        params_of: Callable[[TrialConfig], dict[str, Any]],
        predicted: Callable[[TrialConfig], float | None] | None = None,
        configs: Sequence[TrialConfig] = (),
    ) -> None:
        """``predicted(config)``: the step-time model's log throughput of ``config`` (None where it has
        none); ``configs``: those to rank, whose predicted ones place the rest (at their mean)."""
        self._params_of = params_of
        self._predicted = predicted or (lambda config: None)
        gaps = [p - self._saturation(c) for c in configs if (p := self._predicted(c)) is not None]
        self._unpredicted = sum(gaps) / len(gaps) if gaps else 0.0
        self._features: list[tuple[str, Any]] = []
        self._weights: list[float] = []
        self._intercept = 0.0

    def prior(self, config: TrialConfig) -> float:
        predicted = self._predicted(config)
        return predicted if predicted is not None else self._unpredicted + self._saturation(config)

    def predict(self, config: TrialConfig) -> float:
        """log tokens/s up to a constant: comparable between configs, not a figure to report."""
        x = self._vector(config)
        return self.prior(config) + self._intercept + sum(w * v for w, v in zip(self._weights, x, strict=True))

    def fit(self, measured: list[tuple[TrialConfig, float]]) -> ThroughputModel:
        """Correct the prior with (config, tokens/s) pairs of trials that trained."""
        import numpy as np

        points = [(c, t) for c, t in measured if t and t > 0]
        if not points:
            return self
        self._features = sorted(
            {(k, repr(v)) for c, _ in points for k, v in self._params_of(c).items() if k != "micro_batch"}
        ) + [("saturation", "")]
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
        return [
            self._saturation(config) if name == "saturation" else float((name, value) in params)
            for name, value in self._features
        ]

    @staticmethod
    def _saturation(config: TrialConfig) -> float:
        return math.log(config.micro_batch / (config.micro_batch + SATURATION_BATCH))
