"""``--max-time``'s clock: how long the search may go on, and whether a re-run still fits in the time left."""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from autotune.search.outlook import Outlook

__all__ = ["Clock", "SEARCH_SHARE", "CONFIRM_RESERVE"]

SEARCH_SHARE = 0.8  # under --max-time, the search's share of it at most: the rest confirms the winner
CONFIRM_RESERVE = 2.5  # ... and at least this many trials' time is left for the re-runs (the leader's and one more)


class Clock:
    """``--max-time``: the whole call's wall time. The search stops when its share is spent, or when the
    next trial (timed as the median one so far) would overrun it; re-runs then take the rest."""

    def __init__(self, max_time_s: float | None) -> None:
        self.max_time_s = max_time_s
        self.started = time.monotonic()
        self.trial_seconds: list[float] = []
        self.rerun_seconds: list[float] = []

    @contextlib.contextmanager
    def timing(self, *, rerun: bool = False) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            (self.rerun_seconds if rerun else self.trial_seconds).append(time.monotonic() - start)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def out_of_time(self) -> bool:
        """Whether the next trial (timed as the median one so far) would eat into the confirmation's time."""
        if self.max_time_s is None:
            return False
        next_trial = statistics.median(self.trial_seconds) if self.trial_seconds else 0.0
        reserve = max(CONFIRM_RESERVE * next_trial, self.max_time_s * (1 - SEARCH_SHARE))
        return self.elapsed() + next_trial + reserve > self.max_time_s

    def search_over(self, outlook: Outlook) -> str | None:
        """Why the search must stop now to leave the confirmation its time; None while it need not."""
        if not self.out_of_time():
            return None
        assert self.max_time_s is not None
        return (
            f"--max-time {self.max_time_s:g} s: the search stopped at {self.elapsed():.0f} s to leave the rest "
            f"for confirming the best; {outlook.untried} configs stayed untried ({outlook.describe()})"
        )

    def hurried(self) -> bool:
        """Under --max-time, ranking does not trace on until it settles: a proposal measures what one
        ranking pass reached (each family is traced when its frontier is first estimated)."""
        return self.max_time_s is not None

    def holds_a_rerun(self) -> bool:
        """Whether one more re-run (timed as the longest so far) ends before --max-time."""
        if self.max_time_s is None:
            return True
        longest = max(self.rerun_seconds, default=0.0)
        return self.elapsed() + longest <= self.max_time_s
