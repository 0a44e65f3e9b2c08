"""The proposer's rules that save trials and estimates: the estimator's margin follows its measured
error, a straight line settles sizes clearly under the limit, and evidence before a known slower config."""

from __future__ import annotations

import math

from step_toys import TOY_CPU, toy_costs, toy_step_s

from autotune.config.device import DeviceInfo
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.estimator import MemoryEstimate
from autotune.search.proposer import Proposer
from autotune.search.space import load_space
from autotune.study.summary import TrialRecord

CPU = DeviceInfo("cpu", "test-cpu", 1, 16 * 2**30, bf16=True, fp16_deepspeed=False)
MiB = 2**20


def _proposer(
    tmp_path,
    sizes: str,
    per_sample_mib: dict[bool, float],
    asked: list[TrialConfig],
    flops: dict[bool, int] | None = None,
) -> Proposer:
    """Checkpointing off/on; an exact estimator: 4 MiB of states and ``per_sample_mib[checkpointing]`` a sample,
    and a toy traced step of ``flops[checkpointing]`` FLOPs a sample (100 and 150 unless given) timed on
    the toy CPU (tests/step_toys.py): at global batch 16, no checkpointing mb=4 takes 2.0 s, mb=2 2.4 s;
    checkpointing mb=8 2.6 s."""
    flops = flops or {False: 100, True: 150}
    (tmp_path / "space.yaml").write_text(f"knobs:\n  micro_batch: {sizes}\n  checkpointing: [false, true]\n")

    def estimate(config: TrialConfig) -> MemoryEstimate:
        asked.append(config)
        activations = int(config.micro_batch * per_sample_mib[config.checkpointing] * MiB)
        return MemoryEstimate(
            config=config,
            predicted_peak_bytes=4 * MiB + activations,
            parameters_bytes=MiB,
            gradients_bytes=MiB,
            optimizer_state_bytes=2 * MiB,
            activations_bytes=activations,
            temporaries_bytes=0,
            overhead_bytes=None,
            method="test",
            seconds=0.0,
            step_costs=toy_costs(flops[config.checkpointing]),
        )

    proposer = Proposer(
        load_space(str(tmp_path / "space.yaml")),
        Workload(global_batch=16),
        CPU,
        estimator=estimate,
        limit_bytes=50 * MiB,
        margin=0.05,
    )
    proposer.profile = TOY_CPU
    return proposer


def _measured(config: TrialConfig, tokens: float, peak_mib: float, predicted_mib: float) -> TrialRecord:
    return TrialRecord(
        number=0,
        config=config,
        status="ok",
        tokens_per_s=tokens,
        fits=peak_mib <= 50,
        peak_memory_bytes=int(peak_mib * MiB),
        predicted_peak_bytes=int(predicted_mib * MiB),
    )


def test_a_config_predicted_over_the_limit_runs_only_while_the_estimator_may_be_high(tmp_path):
    # No checkpointing: mb=4 is predicted 51.5 MiB, 3% over the 50 MiB limit (within the 5% margin).
    asked: list[TrialConfig] = []
    proposer = _proposer(tmp_path, "[2, 4, 8]", {False: 11.875, True: 4}, asked)
    assert proposer.next_config([]) == TrialConfig(micro_batch=4)  # nothing measured: the estimate may be high
    # A trial measured what the estimator predicted: on this workload it is not high, so 51.5 MiB will not fit.
    ckpt = TrialConfig(micro_batch=8, checkpointing=True)
    records = [_measured(ckpt, 100.0, peak_mib=36, predicted_mib=36)]
    assert proposer.next_config(records) == TrialConfig(micro_batch=2)
    # Had it measured 10% under its prediction, the margin stays (up to 5%) and mb=4 is still worth a trial.
    records = [_measured(ckpt, 100.0, peak_mib=36 / 1.1, predicted_mib=36)]
    assert proposer.next_config(records) == TrialConfig(micro_batch=4)


def test_the_straight_line_settles_sizes_clearly_under_the_limit_without_an_estimate(tmp_path):
    # No checkpointing: 20 MiB a sample (mb=4: 84 MiB, over; mb=2: 44, clearly under). With: 4 MiB a
    # sample (mb=4: 20; mb=8: 36, clearly under; mb=16: 68, clearly over). A cheap recompute (110 FLOPs a
    # sample against 100): checkpointing mb=8 (1.96 s a step) beats no checkpointing mb=2 (2.4 s).
    asked: list[TrialConfig] = []
    proposer = _proposer(tmp_path, "[1, 2, 4, 8, 16]", {False: 20, True: 4}, asked, {False: 100, True: 110})
    assert proposer.next_config([]) == TrialConfig(micro_batch=8, checkpointing=True)
    # One estimate per family: each middle size; the line through it decides the rest.
    assert asked == [TrialConfig(micro_batch=4), TrialConfig(micro_batch=4, checkpointing=True)]


def test_when_no_config_is_predicted_faster_than_the_best_an_unmeasured_value_goes_first(tmp_path):
    asked: list[TrialConfig] = []
    proposer = _proposer(tmp_path, "[2, 4]", {False: 1, True: 1}, asked)  # everything fits
    records = [_measured(TrialConfig(micro_batch=4), 100.0, peak_mib=8, predicted_mib=8)]
    # Predicted, scaled to the 100 measured at mb=4 (2.0 s a step): mb=2 without checkpointing 2.4 s (83
    # tok/s), with checkpointing mb=4 2.8 s (71): neither beats it. Checkpointing was never measured (only
    # the model says it is slower), so its config goes first, not the smaller micro batch of the family
    # already measured.
    assert proposer.next_config(records) == TrialConfig(micro_batch=4, checkpointing=True)
    # Once checkpointing is measured, the ranking alone decides again.
    records.append(_measured(TrialConfig(micro_batch=4, checkpointing=True), 70.0, peak_mib=8, predicted_mib=8))
    assert proposer.next_config(records) == TrialConfig(micro_batch=2)


def test_the_study_records_as_skipped_only_what_is_over_the_skip_margin(tmp_path):
    """A ruled-out config the estimate puts within the 5% margin stays a candidate: no trial is asked
    for it (an asked trial never told would stay RUNNING in the study)."""
    import optuna

    from autotune.search.tuner import _Oracle, _record_ruled_out, _Silent

    asked: list[TrialConfig] = []
    proposer = _proposer(tmp_path, "[1, 2, 4, 8]", {False: 10.0, True: 2.0}, asked)
    study = optuna.create_study(study_name="s", directions=["maximize"])
    study.set_user_attr("autotune", {"memory_budget_bytes": 50 * MiB, "headroom": 0.0})
    within, over = TrialConfig(micro_batch=4), TrialConfig(micro_batch=8)
    predicted = {within: 52 * MiB, over: 84 * MiB}  # 4% and 68% over the 50 MiB limit

    class Backend:
        def estimate(self, workload, config):
            return MemoryEstimate(
                config=config,
                predicted_peak_bytes=predicted[config],
                parameters_bytes=0,
                gradients_bytes=0,
                optimizer_state_bytes=0,
                activations_bytes=0,
                temporaries_bytes=0,
                overhead_bytes=None,
                method="test",
                seconds=0.0,
            )

    proposer._ruled_out = [within, over]
    _record_ruled_out(study, proposer, _Oracle(Backend(), Workload(global_batch=16)), [], _Silent())
    trials = study.get_trials(deepcopy=False)
    assert [(t.state.name, t.user_attrs.get("status"), t.user_attrs["config"]["micro_batch"]) for t in trials] == [
        ("PRUNED", "skipped", 8)
    ]


def test_checkpointing_is_ranked_by_the_recompute_its_traced_step_holds(tmp_path):
    # The families of the test above: no checkpointing fits up to mb=2, checkpointing up to mb=8. With
    # a cheap recompute checkpointing mb=8 goes first (1.96 s a step against 2.4); with an expensive one
    # (250 FLOPs a sample against 100: 4.2 s) no checkpointing mb=2 does.
    for flops, first in (
        ({False: 100, True: 110}, TrialConfig(micro_batch=8, checkpointing=True)),
        ({False: 100, True: 250}, TrialConfig(micro_batch=2)),
    ):
        (tmp_path / str(flops[True])).mkdir()
        proposer = _proposer(tmp_path / str(flops[True]), "[1, 2, 4, 8, 16]", {False: 20, True: 4}, [], flops)
        assert proposer.next_config([]) == first, flops
        ckpt, plain = TrialConfig(micro_batch=8, checkpointing=True), TrialConfig(micro_batch=2)
        expected = toy_step_s(flops[False], 16, 2) / toy_step_s(flops[True], 16, 8)
        assert (
            abs(proposer._predicted_throughput(ckpt) - proposer._predicted_throughput(plain) - math.log(expected))
            < 1e-9
        )
