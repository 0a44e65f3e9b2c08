"""Replay search strategies against a measured grid: how many trials, and how much of the grid's
trial time, each spends before it has measured a config within 2% of the best one that fits.

    python bench/search.py --grid bench/data/GRID.jsonl --memory-budget SIZE [--seeds N] [--json]
                           [--strategies driver,tpe,...]

Besides the cost to 2%, each strategy's *answer quality*: the best fitting config it measured
(what it would answer) over the grid's optimum, the median and the worst over seeds.

Nothing is trained: a trial returns its grid line's result and costs the seconds that line
recorded (``trial_seconds``). The driver's device probe (matmul speed per precision) is read from
``GRID.probe.json`` beside the grid, written by probing this machine the first time (the grids
were measured here). The step-time model's device profile is the one ``autotune grid`` measured
beside the grid before its trials (``GRID.roofline.json``; for an older grid, this CPU's, probed at
the start, with the grid's 16-bit matmul speeds); it times each config from the traced operators
its grid line's estimate holds (``autotune grid --re-estimate`` adds them to an older grid).
A config fits when it trained and its recorded peak is under the
budget minus the tuner's 10% headroom; a recorded peak over the budget replays as an OOM, so one
grid measured with a generous budget replays at any smaller one. Strategies:

* ``driver``: the tuner's own driver (``autotune.search.tuner.tune``, the real code, given a backend
  that answers trials and memory estimates from the grid), default settings; it is
  deterministic, so it runs once;
* ``tpe``: Optuna's TPESampler with defaults on the same parameters (an OOM is pruned, a repeat
  proposal is paid again: a plain Optuna loop re-runs it);
* ``random``: configs in random order, each once;
* ``grid``: every config in the space's order;
* ``deepspeed``: DeepSpeed-autotuner style: ZeRO stages in order (other knobs at the space's first
  values), per stage micro batches upward until one does not fit, then up to 3 below the largest;
* ``lightning``: Lightning's batch-size finder style: micro batch 1, 2, 4, ... with every other
  knob fixed until one does not fit.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import optuna

from autotune.config.device import detect_device
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.results import MemoryEstimate
from autotune.estimate.trace import trace_key
from autotune.search.grid import read_grid
from autotune.search.presets import load_space
from autotune.search.space import SearchSpace
from autotune.sizes import parse_size
from autotune.study.storage import quiet_optuna
from autotune.trial.result import TrialResult, TrialStatus

HEADROOM = 0.10
WITHIN = 0.02


class Grid:
    def __init__(self, path: Path, budget: int, space: SearchSpace) -> None:
        lines = list(read_grid(path))
        if not lines:
            sys.exit(f"--grid {path}: no lines")
        self.workload = Workload.from_dict(lines[0]["workload"])
        # A space narrower than the grid's replays the slice of the grid it covers.
        wanted = set(space.candidates(self.workload, detect_device(self.workload.device)))
        lines = [line for line in lines if TrialConfig.from_dict(line["config"]) in wanted]
        if not lines:
            sys.exit(f"--space {space.name}: none of its configs is in --grid {path}")
        self.path = path
        self.budget = budget
        self.limit = budget * (1 - HEADROOM)
        self.lines = {TrialConfig.from_dict(line["config"]): line for line in lines}
        self.total_seconds = sum(line["trial_seconds"] for line in lines)
        fitting = [self.tokens(c) for c in self.configs() if self.fits(c)]
        if not fitting:
            sys.exit(f"no config of {path} fits under --memory-budget {budget} B")
        self.best = max(fitting)
        self.probe = _device_probe(path, space.precision)

    def configs(self) -> list[TrialConfig]:
        return list(self.lines)

    def line(self, config: TrialConfig) -> dict[str, Any] | None:
        return self.lines.get(config)

    def fits(self, config: TrialConfig) -> bool:
        line = self.line(config)
        return bool(line) and line["status"] == "ok" and (line["peak_memory_bytes"] or 0) <= self.limit

    def tokens(self, config: TrialConfig) -> float:
        line = self.line(config)
        return (line or {}).get("tokens_per_s") or 0.0

    def result(self, config: TrialConfig) -> TrialResult:
        """The trial as the tuner's runner would return it under this budget."""
        line = self.line(config)
        if line is None:  # not in the grid: cannot run here
            return TrialResult(config=config, status=TrialStatus.ERROR, error="not in the grid")
        result = TrialResult.from_dict(line)
        if result.ok and (result.peak_memory_bytes or 0) > self.budget:
            result = result.replace(
                status=TrialStatus.OOM, tokens_per_s=None, samples_per_s=None, error="over the replayed --memory-budget"
            )
        return result


def _device_probe(grid_path: Path, precisions: tuple[str, ...]) -> dict[str, float] | None:
    """The matmul speed per precision of the machine the grid was measured on (see the module doc)."""
    from autotune.trial.device_probe import probe_precisions

    if len(precisions) < 2:
        return None
    path = grid_path.with_suffix(".probe.json")
    if not path.exists():
        speeds = probe_precisions("cpu", ["fp32", "tf32", "bf16", "fp16"])
        path.write_text(json.dumps(speeds, indent=1) + "\n")
    return json.loads(path.read_text())


_THIS_CPU: dict[bool, dict[str, Any]] = {}  # between_ranks -> this CPU's probed profile


def grid_roofline(
    grid_path: Path, probe: dict[str, float] | None, *, between_ranks: bool = True
) -> tuple[dict[str, Any] | None, str]:
    """The step-time model's device profile for a grid, and where it comes from: the one measured
    beside it before its trials (``GRID.roofline.json``, written by ``autotune grid``); for a grid
    without one, this CPU's, probed once per run, its 16-bit matmul speeds set to the grid machine's,
    relative to fp32, where the grid's probe file has them (only the order of configs matters).
    ``between_ranks``: the probe also times a collective between ranks (what only several ranks need)."""
    from autotune.search.grid import roofline_path
    from autotune.trial.device_probe import probe_profile

    if roofline_path(grid_path).exists():
        return json.loads(roofline_path(grid_path).read_text()), "the grid machine's roofline, probed before its trials"
    if between_ranks not in _THIS_CPU:
        _THIS_CPU[between_ranks] = probe_profile("cpu", between_ranks=between_ranks) or {}
    if not _THIS_CPU[between_ranks]:
        return None, "none: the device probe failed"
    profile = json.loads(json.dumps(_THIS_CPU[between_ranks]))
    flops = profile["matmul_flops"]
    scaled = []
    for precision, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
        if probe and precision in probe and "float32" in flops:
            flops[dtype] = flops["float32"] * probe[precision]
            scaled.append(f"{precision} {probe[precision]:.3g}x")
    how = "this machine's probed profile" + (
        f", bf16/fp16 matmuls set to fp32's x the grid machine's probe ({', '.join(scaled)})" if scaled else " as it is"
    )
    return profile, how


class Tally:
    """What a strategy spent, in order, and when a config within 2% of the best was first measured.

    ``seconds`` counts trials and, for the driver, its memory estimates (each at the seconds
    its grid line recorded through a warm estimate server, plus starting the server once). An
    estimate whose step was traced for an earlier one (another ZeRO stage or offload of it, its
    compile or tf32 twin) is arithmetic on the server's kept trace: it costs nothing here.
    """

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.trials = 0
        self.estimates = 0
        self.seconds = 0.0
        self.found_at: tuple[int, float] | None = None
        self.best_measured = 0.0  # tokens/s of the fastest fitting config measured: the answer
        self._traced: set[str] = set()

    @property
    def quality(self) -> float:
        return self.best_measured / self.grid.best

    def measure(self, config: TrialConfig) -> TrialResult:
        line = self.grid.line(config)
        self.trials += 1
        self.seconds += line["trial_seconds"] if line else 0.0
        if (
            self.found_at is None
            and self.grid.fits(config)
            and self.grid.tokens(config) >= (1 - WITHIN) * self.grid.best
        ):
            self.found_at = (self.trials, self.seconds)
        if self.grid.fits(config):
            self.best_measured = max(self.best_measured, self.grid.tokens(config))
        return self.grid.result(config)

    def estimate(self, config: TrialConfig) -> MemoryEstimate | None:
        line = self.grid.line(config)
        if line is None or "estimate" not in line:
            return None  # a grid without estimates: the driver runs as with --no-estimate
        key = trace_key(self.grid.workload, config)
        if key not in self._traced:
            self._traced.add(key)
            self.seconds += line["estimate_seconds"] + (line["estimator_start_s"] if not self.estimates else 0.0)
        self.estimates += 1
        return MemoryEstimate.from_dict(line["estimate"]) if "predicted_peak_bytes" in line["estimate"] else None


class GridBackend:
    """The tuner's trials and estimates, answered from the grid and charged to a tally."""

    def __init__(self, tally: Tally, probe: dict[str, float] | None = None) -> None:
        self.tally = tally
        self._probe = probe
        self._grid_path = tally.grid.path

    def probe(self, precisions: list[str]) -> dict[str, float] | None:
        return {p: v for p, v in self._probe.items() if p in precisions} if self._probe else None

    def profile(self, *, between_ranks: bool = True, **_: Any) -> dict[str, Any] | None:
        return grid_roofline(self._grid_path, self._probe, between_ranks=between_ranks)[0]

    def run(self, workload: Workload, config: TrialConfig, **_: Any) -> TrialResult:
        return self.tally.measure(config)

    def estimate(self, workload: Workload, config: TrialConfig) -> MemoryEstimate | None:
        return self.tally.estimate(config)


# -- strategies ---------------------------------------------------------------------------------
def driver(grid: Grid, space: SearchSpace, seed: int) -> Tally:
    """The tuner's own driver, as ``autotune tune`` runs it (the winner's re-run comes after the search)."""
    from autotune.search.tuner import tune

    tally = Tally(grid)
    with tempfile.TemporaryDirectory() as tmp:
        tune(
            study="replay",
            workload=grid.workload,
            space=space,
            memory_budget_bytes=grid.budget,
            storage=f"sqlite:///{tmp}/replay.db",
            confirm=False,
            backend=GridBackend(tally, grid.probe),
        )
    return tally


def tpe(grid: Grid, space: SearchSpace, seed: int) -> Tally:
    tally = Tally(grid)
    choices = space.choices(grid.workload, detect_device(grid.workload.device))

    def objective(trial: optuna.Trial) -> float:
        config = space.config_of(
            {name: trial.suggest_categorical(name, list(values)) for name, values in choices.items()}
        )
        result = tally.measure(config)
        if not grid.fits(config) or not result.ok:
            raise optuna.TrialPruned()
        return result.tokens_per_s or 0.0

    with quiet_optuna():
        study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
        study.optimize(objective, n_trials=len(grid.lines), catch=())
    return tally


def random_order(grid: Grid, space: SearchSpace, seed: int) -> Tally:
    tally = Tally(grid)
    configs = grid.configs()
    random.Random(seed).shuffle(configs)
    for config in configs:
        tally.measure(config)
    return tally


def exhaustive(grid: Grid, space: SearchSpace, seed: int) -> Tally:
    tally = Tally(grid)
    for config in space.candidates(grid.workload, detect_device(grid.workload.device)):
        tally.measure(config)
    return tally


def _fixed_knobs(grid: Grid, space: SearchSpace) -> dict[str, Any]:
    """Every knob but micro batch and ZeRO at the space's first value; checkpointing off if offered."""
    choices = space.choices(grid.workload, detect_device(grid.workload.device))
    fixed = {name: values[0] for name, values in choices.items()}
    if False in choices["checkpointing"]:
        fixed["checkpointing"] = False
    return fixed


def deepspeed_style(grid: Grid, space: SearchSpace, seed: int) -> Tally:
    tally = Tally(grid)
    choices = space.choices(grid.workload, detect_device(grid.workload.device))
    fixed = _fixed_knobs(grid, space)
    measured: set[TrialConfig] = set()

    def run(params: dict[str, Any]) -> bool:
        config = space.config_of(params)
        if config not in measured:
            measured.add(config)
            tally.measure(config)
        return grid.fits(config)

    sizes = sorted(choices["micro_batch"])
    for zero in choices["zero"]:
        largest = None
        for size in sizes:
            if not run({**fixed, "zero": zero, "micro_batch": size}):
                break
            largest = size
        if largest is None:
            continue
        below = [s for s in sizes if s < largest][-3:]
        for size in below:
            run({**fixed, "zero": zero, "micro_batch": size})
    return tally


def lightning_style(grid: Grid, space: SearchSpace, seed: int) -> Tally:
    tally = Tally(grid)
    choices = space.choices(grid.workload, detect_device(grid.workload.device))
    fixed = _fixed_knobs(grid, space)
    for size in sorted(choices["micro_batch"]):
        config = space.config_of({**fixed, "micro_batch": size})
        tally.measure(config)
        if not grid.fits(config):
            break
    return tally


STRATEGIES: dict[str, tuple[Callable[[Grid, SearchSpace, int], Tally], bool]] = {
    # name: (strategy, whether it depends on the seed)
    "driver": (driver, False),
    "tpe": (tpe, True),
    "random": (random_order, True),
    "grid": (exhaustive, False),
    "deepspeed": (deepspeed_style, False),
    "lightning": (lightning_style, False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=Path, required=True)
    parser.add_argument("--memory-budget", required=True)
    parser.add_argument(
        "--space",
        help="the space the grid measured (default: the .yaml next to the grid); "
        "a narrower one replays its slice of the grid",
    )
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--strategies", default=",".join(STRATEGIES), help="comma-separated, of " + ", ".join(STRATEGIES)
    )
    args = parser.parse_args()
    space = load_space(args.space or args.grid.with_suffix(".yaml"))
    grid = Grid(args.grid, parse_size(args.memory_budget), space)
    results = {}
    for name, (strategy, seeded) in STRATEGIES.items():
        if name not in args.strategies.split(","):
            continue
        tallies = [strategy(grid, space, seed) for seed in (range(args.seeds) if seeded else [0])]
        found = [t.found_at for t in tallies if t.found_at is not None]
        results[name] = {
            "trials_to_2pct": statistics.median(f[0] for f in found) if found else None,
            "cost_fraction": statistics.median(f[1] for f in found) / grid.total_seconds if found else None,
            "found_ratio": len(found) / len(tallies),
            "trials_run": statistics.median(t.trials for t in tallies),
            "estimates": statistics.median(t.estimates for t in tallies),
            "spent_fraction": statistics.median(t.seconds for t in tallies) / grid.total_seconds,
            "quality": statistics.median(t.quality for t in tallies),
            "worst_quality": min(t.quality for t in tallies),
        }
    if args.json:
        print(
            json.dumps(
                {
                    "grid": str(args.grid),
                    "configs": len(grid.lines),
                    "best_tokens_per_s": grid.best,
                    "strategies": results,
                }
            )
        )
        return
    print(
        f"{args.grid}: {len(grid.lines)} configs, {grid.total_seconds:.0f} trial-seconds, best fitting "
        f"{grid.best:,.1f} tokens/s; budget {grid.budget} B"
    )
    print(
        f"{'strategy':<10} {'trials to 2%':>13} {'cost fraction':>14} {'found':>6} {'trials run':>11} "
        f"{'estimates':>10} {'spent':>7} {'answer/optimum (worst)':>23}"
    )
    for name, r in results.items():
        trials = f"{r['trials_to_2pct']:g}" if r["trials_to_2pct"] is not None else "-"
        cost = f"{r['cost_fraction']:.1%}" if r["cost_fraction"] is not None else "-"
        print(
            f"{name:<10} {trials:>13} {cost:>14} {r['found_ratio']:>6.0%} {r['trials_run']:>11g} "
            f"{r['estimates']:>10g} {r['spent_fraction']:>7.1%} "
            f"{r['quality']:>15.3f} ({r['worst_quality']:.3f})"
        )


if __name__ == "__main__":
    main()
