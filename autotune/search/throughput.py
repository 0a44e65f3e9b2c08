"""How fast a config should train, before and after some were measured: the driver's ranking.

The prior is the step-time model's prediction (:mod:`autotune.estimate.step_time`): the config's
traced operators against this device's measured roofline, so a knob is worth what it does to this
model's step on this device, with no hand-set factor. A config whose family has no traced step yet
(not yet, no estimator: script mode, or a model it cannot trace) sits at the mean of the predicted ones,
with the micro batch's saturation ``mb / (mb + 2)`` telling its sizes apart and its precision's matmul
speed (the device probe's) telling its precision apart. Measurements correct
the prior: a ridge regression, in log space, of what was measured over the prior on one indicator
per knob value and on the saturation term, so one surprising trial moves the ranking half-way,
several agreeing trials move it all the way. The precision is the exception: its prior factor is the
device probe's matmul speed, evidence about matmuls and not about this step, so once a step in a
precision has been measured the measurement alone sets that precision's factor (a negligible ridge).

The model also says how far to trust it: :meth:`ThroughputModel.error` is the spread of its
leave-one-out residuals, which is what the driver's stop on evidence adds to a prediction.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig

__all__ = ["ThroughputModel"]

SATURATION_BATCH = 2.0  # per-rank micro batch at which throughput reaches half its plateau
RIDGE = 0.5  # pull of the prior: a correction is shrunk by RIDGE / (RIDGE + evidence)
MEASURED_RIDGE = 1e-3  # a measured precision's pull: enough to keep the fit solvable, too weak to matter
UNTRUSTED_PRIORS = ("precision",)  # knobs whose prior counts only until a step with the value is measured
MIN_HELD_OUT = 4  # trials the error needs, each predicted without itself, before it means anything
MAX_LEVERAGE = 0.9  # a trial that alone sets its feature cannot be predicted without itself
# Until MIN_HELD_OUT trials tell the error, a bound on it (ThroughputModel.error_bound) no tighter than this factor.
PROVISIONAL_ERROR_FACTOR = 2.0


class ThroughputModel:
    """Predicted log tokens/s of configs, from the prior and the measured trials."""

    def __init__(
        self,
        params_of: Callable[[TrialConfig], dict[str, Any]],
        predicted: Callable[[TrialConfig], float | None] | None = None,
        configs: Sequence[TrialConfig] = (),
        unpredicted_factor: Callable[[TrialConfig], float] | None = None,
        placed: Callable[[TrialConfig], float | None] | None = None,
    ) -> None:
        """``predicted(config)``: the step-time model's log throughput of ``config`` (None where it has
        none); ``configs``: those to rank, whose predicted ones place the rest (at their mean);
        ``unpredicted_factor(config)``: a log factor the rest carry beside the micro batch's saturation
        (the device probe's matmul speed of their precision); ``placed(config)``: where the caller places
        one of the rest itself (log throughput; None: at the mean)."""
        self._params_of = params_of
        self._predicted = predicted or (lambda config: None)
        self._factor = unpredicted_factor or (lambda config: 0.0)
        self._placed = placed or (lambda config: None)
        gaps = [p - self._saturation(c) - self._factor(c) for c in configs if (p := self._predicted(c)) is not None]
        self._unpredicted = sum(gaps) / len(gaps) if gaps else 0.0
        self._features: list[tuple[str, Any]] = []
        self._weights: list[float] = []
        self._intercept = 0.0
        self._error: float | None = None
        self._provisional: float | None = None

    def prior(self, config: TrialConfig) -> float:
        predicted = self._predicted(config)
        if predicted is not None:
            return predicted
        placed = self._placed(config)
        if placed is not None:
            return placed
        return self._unpredicted + self._saturation(config) + self._factor(config)

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
        penalty = np.diag([MEASURED_RIDGE if name in UNTRUSTED_PRIORS else RIDGE for name, _ in self._features])
        inverse = np.linalg.inv(Xc.T @ Xc + penalty)
        w = inverse @ Xc.T @ yc
        self._weights = [float(v) for v in w]
        self._intercept = float(y_mean - x_mean @ w)
        # Leave-one-out residuals without refitting: a ridge's residual over (1 - leverage).
        leverage = np.einsum("ij,jk,ik->i", Xc, inverse, Xc) + 1 / len(points)
        residuals = yc - Xc @ w
        held_out = [r / (1 - h) for r, h in zip(residuals, leverage, strict=True) if h <= MAX_LEVERAGE]
        if len(held_out) >= MIN_HELD_OUT:
            self._error = float(np.sqrt(np.mean(np.square(held_out))))
        if len(points) >= 2:  # how far apart the prior's misses of two measured configs lie: its error between them
            misses = [math.log(t) - self.prior(c) for c, t in points]
            self._provisional = max(max(misses) - min(misses), math.log(PROVISIONAL_ERROR_FACTOR))
        return self

    def error(self) -> float | None:
        """How far a prediction of a measured knob value may be off, in log throughput: the root mean
        square of the trials' residuals, each predicted by the fit without itself; None before
        ``MIN_HELD_OUT`` such trials."""
        return self._error

    def error_bound(self) -> float | None:
        """:meth:`error` once it is known; before, from two measured trials, the widest disagreement between
        the prior's misses of them (what the prior got wrong between two configs), at least
        ``PROVISIONAL_ERROR_FACTOR``: enough to tell a config many times below the best (a 16-bit step on a
        CPU without 16-bit matmuls) from one that may pay, not to rank neighbours. None before two trials."""
        return self._error if self._error is not None else self._provisional

    def _vector(self, config: TrialConfig) -> list[float]:
        params = {(k, repr(v)) for k, v in self._params_of(config).items() if k != "micro_batch"}
        return [
            self._saturation(config) if name == "saturation" else float((name, value) in params)
            for name, value in self._features
        ]

    @staticmethod
    def _saturation(config: TrialConfig) -> float:
        return math.log(config.micro_batch / (config.micro_batch + SATURATION_BATCH))
