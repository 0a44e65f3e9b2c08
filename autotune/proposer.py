"""Which config to measure next: a safe baseline, retries, then TPE, never a known or implied failure.

The sampler runs on a throw-away in-memory copy of the study (the *mirror*): its proposals
that are already measured, or implied to run out of memory, are told back to the mirror and
another is asked for, so the real study only ever holds configs that were really measured.
"""

from __future__ import annotations

import random
import warnings
from typing import TYPE_CHECKING, Any

from autotune.knobs import TrialConfig
from autotune.storage import quiet_optuna
from autotune.study import measured

if TYPE_CHECKING:
    import optuna

    from autotune.device import DeviceInfo
    from autotune.space import SearchSpace
    from autotune.summary import TrialRecord
    from autotune.workload import Workload

__all__ = ["Proposer", "implied_too_big", "implied_fits"]

_ASKS_PER_PROPOSAL = 24   # mirror proposals tried before falling back to a neighbour of the best


class Proposer:
    def __init__(self, space: SearchSpace, workload: Workload, device: DeviceInfo, *, seed: int = 0) -> None:
        self.space = space
        self.choices = space.choices(workload, device)
        self.candidates = space.candidates(workload, device)
        self._runnable = set(self.candidates)
        self._seed = seed

    def suggest(self, trial: optuna.Trial) -> TrialConfig:
        """Define-by-run: the config of ``trial``'s parameters (fixed ones when it was enqueued)."""
        return self.space.config_of({name: trial.suggest_categorical(name, list(values))
                                     for name, values in self.choices.items()})

    def params_of(self, config: TrialConfig) -> dict[str, Any]:
        return self.space.params_of(config)

    def baseline(self) -> TrialConfig:
        """The config most likely to fit: smallest micro batch, checkpointing on, no ZeRO where allowed.

        Precision and LoRA take the space's first value: the one the user listed first.
        """
        def risk(config: TrialConfig) -> tuple[Any, ...]:
            return (config.micro_batch, not config.checkpointing, config.uses_deepspeed,
                    self.choices["precision"].index(config.precision),
                    self.choices["lora"].index(self.params_of(config)["lora"]))
        return min(self.candidates, key=risk)

    def next_config(self, study: optuna.Study, records: list[TrialRecord]) -> TrialConfig | None:
        """The next config to measure, or None when every runnable config is measured or implied."""
        done = {r.config for r in measured(records)}
        done |= {r.config for r in records if r.status in ("running", "skipped")}
        too_big = [r.config for r in records
                   if r.status in ("oom", "skipped") or (r.status == "ok" and not r.fits)]
        open_configs = [c for c in self.candidates if c not in done and not implied_too_big(c, too_big)]
        if not open_configs:
            return None
        retry = next((r.config for r in records if r.status == "interrupted" and r.config in open_configs), None)
        if retry is not None:
            return retry
        if not measured(records) and self.baseline() in open_configs:
            return self.baseline()
        proposal = self._from_sampler(study, set(open_configs), too_big)
        if proposal is not None:
            return proposal
        rng = random.Random(self._seed + len(records))
        return rng.choice(self._neighbours(records, open_configs) or open_configs)

    # -- sampling --------------------------------------------------------------------------------
    def _from_sampler(self, study: optuna.Study, open_configs: set[TrialConfig],
                      too_big: list[TrialConfig]) -> TrialConfig | None:
        import optuna
        from optuna.trial import TrialState

        finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler = optuna.samplers.TPESampler(
                seed=self._seed + len(finished), multivariate=True, group=True,
                n_startup_trials=min(10, max(3, len(self.candidates) // 10)))
            with quiet_optuna():
                mirror = optuna.create_study(direction="maximize", sampler=sampler)
            mirror.add_trials(finished)
            for _ in range(_ASKS_PER_PROPOSAL):
                trial = mirror.ask()
                config = self.suggest(trial)
                if config in open_configs:
                    return config
                if config in self._runnable and implied_too_big(config, too_big):
                    trial.set_constraint("memory", 1.0)  # teach the mirror: this region runs out
                    mirror.tell(trial, state=TrialState.PRUNED)
                else:  # measured already, or cannot run here
                    mirror.tell(trial, state=TrialState.FAIL)
        return None

    def _neighbours(self, records: list[TrialRecord], open_configs: list[TrialConfig]) -> list[TrialConfig]:
        """Open configs one knob away from the fastest that fits: local search when TPE insists on it."""
        from autotune.study import ranking

        ranked = ranking(records)
        if not ranked:
            return []
        best = self.params_of(ranked[0].config)
        return [c for c in open_configs
                if sum(v != best[k] for k, v in self.params_of(c).items()) == 1]


def implied_fits(config: TrialConfig, fitting: list[TrialConfig]) -> bool:
    """A smaller micro batch with the same other knobs as a config that fit needs less memory."""
    return any(config.micro_batch <= known.micro_batch and config.replace(micro_batch=known.micro_batch) == known
               for known in fitting)


def implied_too_big(config: TrialConfig, too_big: list[TrialConfig]) -> bool:
    """A larger micro batch with the same other knobs as a config that did not fit needs more memory."""
    return any(config.micro_batch > known.micro_batch and config.replace(micro_batch=known.micro_batch) == known
               for known in too_big)
