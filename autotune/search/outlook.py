"""What the open configs may still bring, against the best measured: the stop on evidence's figures
(:class:`Outlook`), and the views of the trials it is worked out from."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig
    from autotune.study.summary import TrialRecord

__all__ = ["Outlook", "Value", "MEASUREMENT_NOISE", "WAIVE_FACTOR", "best_fitting", "measured_throughputs"]

# An unmeasured value predicted this many times below the best (its error included) is not measured: 10x is
# past the largest miss seen of a traced step on a CPU (a 16-bit step the roofline put 8x too slow).
WAIVE_FACTOR = 10.0
MEASUREMENT_NOISE = 0.03  # two short trials of one config differ by about this much on a quiet machine

Value = tuple[str, str]  # (knob, repr of its value)


@dataclasses.dataclass(frozen=True)
class Outlook:
    """What the open configs may still bring, against the best measured: the stop on evidence."""

    best: float  # throughput of the fastest config measured that fits; 0 before one
    top: TrialConfig | None  # the open config predicted fastest among those that should fit
    predicted: float | None  # its throughput by the corrected model, in the trials' unit
    error: float | None  # a bound on the model's error in log throughput (ThroughputModel.error_bound); None before it
    owed: frozenset[Value]  # knob values a measurement is owed for
    untried: int  # open configs not known to run out of memory
    # Knob values never measured whose configs are all predicted far below the best (the model's error
    # included, see Proposer.far_below): value -> the most any of them may reach, over the best.
    waived: tuple[tuple[Value, float], ...] = ()
    # Configs left out because they only add recompute to one that fits (see recomputes_more_than_fitting).
    recompute_only: int = 0

    @property
    def upper(self) -> float | None:
        """The top open config's throughput at the model's error above its prediction."""
        if self.predicted is None or self.error is None:
            return None
        return self.predicted * math.exp(self.error)

    @property
    def settled(self) -> bool:
        """Nothing owed, and no open config can beat the best by more than the noise."""
        upper = self.upper
        return not self.owed and self.best > 0 and upper is not None and upper <= self.best * (1 + MEASUREMENT_NOISE)

    def waived_text(self) -> str:
        """The values left unmeasured because the levers cannot pay here, in words ('' when none)."""
        if not self.waived:
            return ""
        values = ", ".join(f"{k}={v.strip(chr(39))}" for (k, v), _ in self.waived)
        most = max(ratio for _, ratio in self.waived)
        return (
            f"{values} not measured: predicted at most {most:.0%} of the best on this device "
            f"(the model's error included), {WAIVE_FACTOR:g}x short of paying"
        )

    def recompute_text(self) -> str:
        """The configs left untried because they recompute a fitting config's work, in words ('' when none)."""
        if not self.recompute_only:
            return ""
        return (
            f"{self.recompute_only} configs not measured: each checkpoints more layers than one that fits, "
            "all else the same (its work and a recompute, no memory it needs)"
        )

    def describe(self) -> str:
        """How sure the best so far is, in words."""
        if self.owed:
            return "owed a first measurement: " + ", ".join(sorted(f"{k}={v.strip(chr(39))}" for k, v in self.owed))
        if self.top is None or self.best <= 0:
            return "nothing open predicted to fit"
        if self.upper is None:
            return f"too few trials to bound the {self.untried} untried configs"
        gain = self.upper / self.best - 1
        if gain <= MEASUREMENT_NOISE:
            return f"no untried config predicted to beat it by more than the noise ({gain:+.0%} at best)"
        return f"an untried config may be up to {gain:+.0%} faster ({self.top.describe()})"


def best_fitting(records: list[TrialRecord]) -> float:
    """Throughput of the fastest measured config that fits; 0 before one."""
    return max((r.throughput or 0.0 for r in records if r.fits), default=0.0)


def measured_throughputs(records: list[TrialRecord]) -> list[tuple[TrialConfig, float]]:
    """(config, throughput) of the trials that trained with a figure: what corrects the model."""
    return [(r.config, r.throughput) for r in records if r.status == "ok" and r.throughput]
