"""Confirming the answer: which measured configs re-run, how their interleaved re-runs are paired, and
when a challenger may replace the answer held so far. Pure rules over the study's records and the re-runs'
results; the tuner runs the re-runs (:func:`autotune.search.tuner.tune`).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING

from autotune.levers import LEVERS
from autotune.study.records import ranking

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig
    from autotune.study.summary import TrialRecord
    from autotune.trial.result import TrialResult

CONFIRM_ROUNDS = 2  # interleaved re-runs per contender (A B A B): paired under the same conditions
CONTENDER_BAND = 0.3  # the widest noise band: candidates whose first figure is this close to the top one's
NOISE_FLOOR = 0.05  # the narrowest: two first figures of one config differ by this much on a quiet machine
MAX_CONTENDERS = 4  # ... at most this many (plus the simple answer and the answer decided before)
# The top config's twins one knob apart (the same micro batch) join when their first figure is this close: the
# re-runs then prove each lever the top one adopted. First figures of one config in fresh processes lie 6-16%
# apart on a shared machine, where each run's own step times spread 1-3% (bench/results/rerun_spread_cpu.txt).
TWIN_BAND = 0.2
MAX_TWINS = 2
# A lead in every interleaved round wider than first figures of one config lie apart is proven in one round: paired
# in one round, two configs of one speed read at most 13% apart there; a second round would only spend the time.
DECISIVE_LEAD = TWIN_BAND
_KNOB_OF = {name: lever.name for lever in LEVERS for name in lever.fields}  # a lever's fields are one knob
CONFIRM_NOISE = 0.03  # a lead under 3% in some round is "within noise"


def held_answer(records: list[TrialRecord], simple: int | None) -> TrialRecord | None:
    """The answer held so far: the one interleaved re-runs decided, else the simple answer, else (no ramp)
    the fastest first figure. A first figure alone never replaces a held answer."""
    ranked = ranking(records)
    decided = next((r for r in ranked if r.decided_rank == 0), None)
    return decided or next((r for r in ranked if r.number == simple), None) or next(iter(ranked), None)


def worth_another_round(contenders: list[TrialRecord], runs: dict[int, list[TrialResult]], limit: int) -> bool:
    """Whether the rounds so far leave a lead a further round could settle: the leader by paired figures was
    behind another contender in some round, and their paired figures lie more than ``CONFIRM_NOISE`` apart.
    Two configs the rounds call within the noise of each other are as good an answer either way: a third round
    would most likely call them so again."""
    held = held_up(contenders, runs, limit)
    scores, _ = paired_scores(held, runs)
    if len(scores) < 2:
        return False
    leader = max(scores, key=scores.__getitem__)

    def disagree(number: int) -> bool:
        both = range(min(len(runs[leader]), len(runs[number])))
        return any((runs[leader][i].throughput or 0.0) <= (runs[number][i].throughput or 0.0) for i in both)

    return any(disagree(n) and scores[leader] / scores[n] - 1 > CONFIRM_NOISE for n in scores if n != leader)


def still_racing(
    contenders: list[TrialRecord], runs: dict[int, list[TrialResult]], limit: int, incumbent: int | None
) -> list[TrialRecord]:
    """The contenders worth another round: the held answer ``incumbent`` and every challenger that was ahead
    of it in each round so far. A challenger replaces the held answer only by beating it in every round
    (:func:`proven_order`), so one round lost ends its challenge, and timing it again could change nothing.
    A held answer some challenger beat decisively (:func:`decisively_ahead`) is out: the challengers race on
    among themselves. While the held answer has not held up (it did not fit or train in a re-run), all race on."""
    held = {r.number for r in held_up(contenders, runs, limit)}
    if incumbent not in held:
        return [r for r in contenders if r.number in held or not runs[r.number]]
    challengers = [
        r
        for r in contenders
        if r.number != incumbent and r.number in held and all(x > 0 for x in round_leads(runs, r.number, incumbent))
    ]
    if any(decisively_ahead(runs, r.number, incumbent) for r in challengers):
        return challengers
    return [r for r in contenders if r.number == incumbent] + challengers


def decisively_ahead(runs: dict[int, list[TrialResult]], number: int, other: int) -> bool:
    """Whether ``number`` led ``other`` by more than ``DECISIVE_LEAD`` in every round both ran, one at least."""
    leads = round_leads(runs, number, other)
    return bool(leads) and min(leads) > DECISIVE_LEAD


def held_up(contenders: list[TrialRecord], runs: dict[int, list[TrialResult]], limit: int) -> list[TrialRecord]:
    """The contenders every re-run of which trained and fit."""
    return [r for r in contenders if runs[r.number] and all(holds(x, limit) for x in runs[r.number])]


def paired_scores(held: list[TrialRecord], runs: dict[int, list[TrialResult]]) -> tuple[dict[int, float], int]:
    """Each contender's figure over its round's geometric mean (over the contenders that ran that round), the
    median over the rounds it ran; and the most rounds any ran. A contender out of the race after a round
    (:func:`still_racing`) is scored over the rounds it ran."""
    rounds = max((len(runs[r.number]) for r in held), default=0)
    round_means = [
        statistics.geometric_mean([runs[r.number][i].throughput or 1e-9 for r in held if len(runs[r.number]) > i])
        for i in range(rounds)
    ]
    scores: dict[int, float] = {}
    for record in held:
        paired = [(x.throughput or 0.0) / round_means[i] for i, x in enumerate(runs[record.number])]
        scores[record.number] = statistics.median(paired) if paired else 0.0
    return scores, rounds


def contenders_of(records: list[TrialRecord], *, simple: int | None) -> list[TrialRecord]:
    """The candidates a re-run should compare, the held answer first (:func:`held_answer`: the decided one,
    else the simple answer), then the simple answer, then the top first figure and every first figure within
    the measured noise band of it (:func:`noise_band`), at most ``MAX_CONTENDERS`` of those, then the top one's
    measured twins one knob apart within ``TWIN_BAND`` (:func:`one_knob_apart`), at most ``MAX_TWINS``.

    A twin tells whether a lever the top config adopted pays: a chunked loss or a fused optimizer taken on one
    lucky first figure is re-run beside the same config without it, not only beside the simple answer."""
    ranked = ranking(records)
    if not ranked:
        return []
    by_first = sorted(ranked, key=lambda r: -(r.throughput or 0.0))
    top = by_first[0].throughput or 0.0
    band = noise_band(records)
    close = [r for r in by_first if (r.throughput or 0.0) * (1 + band) >= top][:MAX_CONTENDERS]
    twins = [
        r
        for r in by_first[1:]
        if one_knob_apart(r.config, by_first[0].config) and (r.throughput or 0.0) * (1 + TWIN_BAND) >= top
    ][:MAX_TWINS]
    held = held_answer(records, simple)
    kept = [r for r in ranked if r.number == simple or r.decided_rank == 0]
    chosen = {r.number: r for r in [*([held] if held else []), *kept, *close, *twins]}
    return list(chosen.values())


def one_knob_apart(config: TrialConfig, other: TrialConfig) -> bool:
    """The same micro batch, and one other knob at another value: what sets their figures apart is that knob. A
    lever's fields are one knob (checkpointing every 2nd layer against none differs in two fields)."""
    if config.micro_batch != other.micro_batch:
        return False
    differ = {
        _KNOB_OF.get(f.name, f.name)
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != getattr(other, f.name)
    }
    return len(differ) == 1


def noise_band(records: list[TrialRecord]) -> float:
    """How far apart two first figures of one config may lie here: twice the median step-time spread the
    trials measured (IQR over median), at least ``NOISE_FLOOR``, at most ``CONTENDER_BAND``."""
    spreads = [r.step_time_spread for r in records if r.status == "ok" and r.step_time_spread is not None]
    measured_spread = statistics.median(spreads) if spreads else 0.0
    return min(CONTENDER_BAND, max(NOISE_FLOOR, 2 * measured_spread))


def proven_order(order: list[int], runs: dict[int, list[TrialResult]], incumbent: int | None) -> list[int]:
    """``order`` (by paired scores) with the held answer ``incumbent`` first unless a contender beat it in
    every interleaved round they both ran, two rounds at least, by more than ``CONFIRM_NOISE`` over those rounds
    (the median of its leads), or in one round by more than ``DECISIVE_LEAD``: a lead within the noise does not
    replace it. Two configs of one speed would otherwise swap on coin flips, and the answer read behind the simple
    one as often as ahead."""
    if incumbent not in order:
        return order

    def beats(number: int) -> bool:
        leads = round_leads(runs, number, incumbent)
        proven = len(leads) >= CONFIRM_ROUNDS and min(leads) > 0 and statistics.median(leads) > CONFIRM_NOISE
        return proven or decisively_ahead(runs, number, incumbent)

    others = [n for n in order if n != incumbent]
    return [n for n in others if beats(n)] + [incumbent] + [n for n in others if not beats(n)]


def round_leads(runs: dict[int, list[TrialResult]], number: int, other: int) -> list[float]:
    """``number``'s lead over ``other`` in each interleaved round both ran (0.05: 5% ahead)."""
    both = min(len(runs[number]), len(runs[other]))
    return [(runs[number][i].throughput or 0.0) / (runs[other][i].throughput or 1e-9) - 1 for i in range(both)]


def holds(result: TrialResult, limit: int) -> bool:
    return result.ok and result.peak_memory_bytes is not None and result.peak_memory_bytes <= limit


def certainty(
    order: list[int],
    runs: dict[int, list[TrialResult]],
    by_number: dict[int, TrialRecord],
    *,
    held: int | None = None,
) -> str | None:
    """How sure the answer is, in words: its lead over the runner-up in the paired rounds both ran. Where the
    answer is the one held (``held``) and the runner-up led it in every round, within the margin
    (:func:`proven_order`), it says why the held one stays."""
    if not order:
        return None
    if len(order) == 1:
        return (
            "the only candidate that held up on its re-run"
            if len(by_number) > 1
            else "the one candidate; re-run to check it fits, no runner-up close enough to compare"
        )
    winner, runner_up = order[0], order[1]
    leads = round_leads(runs, winner, runner_up)
    rounds = len(leads)
    wins = sum(lead > 0 for lead in leads)
    spread = f"{min(leads):+.0%} to {max(leads):+.0%}" if len(leads) > 1 else f"{leads[0]:+.0%}"
    clear = wins == rounds and min(leads) > CONFIRM_NOISE
    proven = rounds >= CONFIRM_ROUNDS or min(leads) > DECISIVE_LEAD
    verdict = "clearly faster than" if clear and proven else "ahead of" if clear else "within noise of"
    kept = (
        "; held: a challenger replaces it only by leading it in every round, two at least, by more than 3%"
        if winner == held and rounds and wins == 0
        else ""
    )
    return (
        f"{verdict} the runner-up {by_number[runner_up].config.describe()} in interleaved re-runs: "
        f"ahead in {wins} of {rounds} rounds ({spread}){kept}"
    )
