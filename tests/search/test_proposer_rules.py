"""The proposer's rules that save trials and estimates: the estimator's margin follows its measured
error, a straight line settles sizes clearly under the limit, and evidence before a known slower config."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable

import pytest
from step_toys import TOY_CPU, toy_costs, toy_step_s

from autotune.config.device import DeviceInfo
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.results import MemoryEstimate
from autotune.estimate.step_costs import OpCost, StepCosts
from autotune.estimate.step_time import matmul_speedups
from autotune.search.presets import load_space
from autotune.search.proposer import Proposer
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
        return _toy_estimate(config, toy_costs(flops[config.checkpointing]), activations)

    return _toy_proposer(tmp_path / "space.yaml", estimate)


def _toy_proposer(space: Path, estimator: Callable[[TrialConfig], MemoryEstimate]) -> Proposer:
    """A proposer of ``space`` for global batch 16 under a 50 MiB limit (5% margin), timed on the toy CPU."""
    proposer = Proposer(
        load_space(str(space)), Workload(global_batch=16), CPU, estimator=estimator, limit_bytes=50 * MiB, margin=0.05
    )
    proposer.profile = TOY_CPU
    return proposer


def _toy_estimate(config: TrialConfig, step_costs: StepCosts, activations: int = 4 * MiB) -> MemoryEstimate:
    """4 MiB of model states and ``activations`` bytes, with ``step_costs`` as the traced step."""
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
        step_costs=step_costs,
    )


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


def _slow_fp16_proposer(tmp_path, knobs: str, per_sample_mib: Callable[[TrialConfig], float]) -> Proposer:
    """A toy proposer of ``knobs`` (see :func:`_toy_proposer`) on the toy CPU with fp16 matmuls 100x slower than
    fp32's, its exact estimator holding ``per_sample_mib(config)`` MiB of activations a sample."""
    (tmp_path / "space.yaml").write_text("knobs:\n" + knobs)
    slow_fp16 = dataclasses.replace(TOY_CPU, matmul_flops={"float32": 1000.0, "float16": 10.0})

    def estimate(config: TrialConfig) -> MemoryEstimate:
        dtype = "float16" if config.precision == "fp16" else "float32"
        ops = tuple(dataclasses.replace(op, dtype=dtype) for op in toy_costs(100).ops)
        activations = int(config.micro_batch * per_sample_mib(config) * MiB)
        return _toy_estimate(config, dataclasses.replace(toy_costs(100), ops=ops), activations)

    proposer = _toy_proposer(tmp_path / "space.yaml", estimate)
    proposer.profile = slow_fp16
    proposer.precision_speed = matmul_speedups(slow_fp16, ("fp32", "fp16"))
    return proposer


def _fp32_trials(sizes: tuple[int, ...], *, per_sample_mib: float, skipped: int) -> list[TrialRecord]:
    """fp32 trials of ``sizes`` at the toy step's throughput, each peaking (as predicted) at 4 MiB of states and
    ``per_sample_mib`` a sample; then micro batch ``skipped`` recorded as skipped at 84 MiB."""
    records = [
        dataclasses.replace(
            _measured(
                TrialConfig(micro_batch=mb),
                16 * 128 / toy_step_s(100, 16, mb),
                4 + per_sample_mib * mb,
                4 + per_sample_mib * mb,
            ),
            number=i,
        )
        for i, mb in enumerate(sizes)
    ]
    too_big = _measured(TrialConfig(micro_batch=skipped), 0, 84, 84)
    return records + [dataclasses.replace(too_big, status="skipped", fits=False, number=len(sizes))]


def test_a_config_predicted_over_the_limit_runs_only_while_the_estimator_may_be_high(tmp_path):
    # No checkpointing: mb=4 is predicted 50.4 MiB, 0.8% over the 50 MiB limit (within the 5% margin): its
    # chance to fit (0.84, the margin's share left) times its speed still beats mb=2's (2.0 s a step against
    # 2.4: 0.83x).
    asked: list[TrialConfig] = []
    proposer = _proposer(tmp_path, "[2, 4, 8]", {False: 11.6, True: 4}, asked)
    assert proposer.next_config([]) == TrialConfig(micro_batch=4)  # nothing measured: the estimate may be high
    # A trial measured what the estimator predicted: on this workload it is not high, so 50.4 MiB will not fit.
    ckpt = TrialConfig(micro_batch=8, checkpointing=True)
    records = [_measured(ckpt, 100.0, peak_mib=36, predicted_mib=36)]
    assert proposer.next_config(records) == TrialConfig(micro_batch=2)
    # Had it measured 10% under its prediction, the margin stays (up to 5%) and mb=4 is still worth a trial.
    records = [_measured(ckpt, 100.0, peak_mib=36 / 1.1, predicted_mib=36)]
    assert proposer.next_config(records) == TrialConfig(micro_batch=4)


def test_a_config_predicted_under_the_limit_goes_before_a_gamble_it_nearly_matches(tmp_path):
    # mb=4 predicted 51.5 MiB, 3% over the limit: a chance of 0.4 to fit (the 5% margin's share left), which
    # makes mb=2 (predicted 27.75 MiB, 0.83x its speed) the better bet: an answer first.
    asked: list[TrialConfig] = []
    proposer = _proposer(tmp_path, "[2, 4, 8]", {False: 11.875, True: 4}, asked)
    assert proposer.next_config([]) == TrialConfig(micro_batch=2)
    assert TrialConfig(micro_batch=4) not in proposer.take_ruled_out()  # not skipped: it stays open


def test_a_checkpointed_family_is_ranked_by_its_plain_twins_trace_before_its_own(tmp_path):
    """The step of a checkpointed family is the plain family's step with the layers' forward run again (the
    operators the trace marked in a layer): no trace of its own is needed to rank it."""
    from autotune.estimate.step_time import predict_step_time

    asked: list[TrialConfig] = []
    proposer = _proposer(tmp_path, "[2, 4, 8]", {False: 1, True: 1}, asked)
    costs = StepCosts(
        (
            OpCost("forward", "matmul", "mm", "float32", 60.0, 0.0, 0.0, 1.0, in_layer=True),
            OpCost("forward", "matmul", "mm", "float32", 40.0, 0.0, 0.0, 1.0),
        ),
        100 / 3,
        layers_marked=True,
    )
    plain = proposer._memory.estimator(TrialConfig(micro_batch=4))
    proposer._memory.estimates[plain.config] = plain
    proposer._memory.traced[TrialConfig(micro_batch=1)] = dataclasses.replace(plain, step_costs=costs)
    ckpt = TrialConfig(micro_batch=8, checkpointing=True)
    rerun = dataclasses.replace(plain, config=ckpt, step_costs=costs.with_forward_rerun(1.0))
    expected = predict_step_time(rerun, Workload(global_batch=16), TOY_CPU)
    assert proposer._prior.predicted(ckpt) == math.log(expected.samples_per_s)
    assert TrialConfig(micro_batch=1, checkpointing=True) not in proposer._memory.traced


def test_no_estimate_is_spent_on_a_family_predicted_within_the_noise_of_a_config_known_to_fit(tmp_path):
    """Checkpointing mb=4 is predicted 1% faster than plain mb=2 (2.376 s a step against 2.4: its twin reruns
    11 FLOPs a sample, one more operator a micro step, over half the micro steps): a trial could not tell
    the two apart, so plain mb=2, known to fit, is measured without estimating the checkpointed family; if
    it disappoints, the other ranks above it again."""
    asked: list[TrialConfig] = []
    proposer = _proposer(tmp_path, "[2, 4]", {False: 20, True: 4}, asked)
    plain_estimate = proposer._memory.estimator

    def estimate(config: TrialConfig):
        made = plain_estimate(config)
        costs = StepCosts(
            (
                OpCost("forward", "matmul", "mm", "float32", 11.0, 0.0, 0.0, 1.0, in_layer=True),
                OpCost("forward", "matmul", "mm", "float32", 89.0, 0.0, 0.0, 1.0),
            ),
            100 / 3,
            layers_marked=True,
        )
        return dataclasses.replace(made, step_costs=costs)

    proposer._memory.estimator = estimate
    assert proposer.next_config([]) == TrialConfig(micro_batch=2)
    assert all(not config.checkpointing for config in asked), asked


def test_before_any_trace_the_lora_family_is_traced_first(tmp_path):
    """Every family is level before a trace: the first trace goes to the one doing the least work by
    construction (LoRA: no weight gradients of the frozen base), not to the space's first."""
    (tmp_path / "space.yaml").write_text("knobs:\n  micro_batch: [2, 4]\n  lora_rank: [null, 8]\n")
    asked: list[TrialConfig] = []

    def estimate(config: TrialConfig) -> MemoryEstimate:
        asked.append(config)
        return _toy_estimate(config, toy_costs(100))

    proposer = _toy_proposer(tmp_path / "space.yaml", estimate)
    proposer.next_config([])
    assert asked[0].lora_rank == 8


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
    # 7 MiB a sample without checkpointing (mb=8: 60 MiB, over the 50 MiB limit), 3 with it (mb=8: 28 MiB).
    proposer = _proposer(tmp_path, "[2, 4, 8]", {False: 7, True: 3}, asked)
    records = [_measured(TrialConfig(micro_batch=4), 100.0, peak_mib=32, predicted_mib=32)]
    # Predicted, scaled to the 100 measured at mb=4 (2.0 s a step): mb=2 without checkpointing 2.4 s (83
    # tok/s), with checkpointing mb=8 2.6 s (77): neither beats it. Checkpointing was never measured (only
    # the model says it is slower), so its config goes first, at the size only it lets fit, not the smaller
    # micro batch of the family already measured. (Checkpointing at mb <= 4 only adds a recompute to a
    # config that fits: never measured.)
    assert proposer.next_config(records) == TrialConfig(micro_batch=8, checkpointing=True)
    # Once checkpointing is measured, the ranking alone decides again.
    records.append(_measured(TrialConfig(micro_batch=8, checkpointing=True), 75.0, peak_mib=28, predicted_mib=28))
    assert proposer.next_config(records) == TrialConfig(micro_batch=2)


def test_the_study_records_as_skipped_only_what_is_over_the_skip_margin(tmp_path):
    """A ruled-out config the estimate puts within the 5% margin stays a candidate: no trial is asked
    for it (an asked trial never told would stay RUNNING in the study)."""
    import optuna

    from autotune.search.progress import Silent
    from autotune.search.study_trials import Oracle, record_ruled_out

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

    proposer._memory.ruled_out = [within, over]
    record_ruled_out(study, proposer, Oracle(Backend(), Workload(global_batch=16)), [], Silent())
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
        assert abs(proposer._prior.predicted(ckpt) - proposer._prior.predicted(plain) - math.log(expected)) < 1e-9


def test_full_fine_tuning_is_placed_below_a_traced_lora_family_by_the_weight_gradients_it_adds(tmp_path):
    (tmp_path / "space.yaml").write_text("knobs:\n  micro_batch: [4]\n  lora_rank: [null, 8]\n")
    proposer = Proposer(load_space(str(tmp_path / "space.yaml")), Workload(global_batch=16), CPU)
    proposer.profile = TOY_CPU
    lora_costs = StepCosts(
        (
            OpCost("forward", "matmul", "mm", "float32", 100.0, 0.0, 0.0, 1.0),
            OpCost("backward", "matmul", "mm", "float32", 100.0, 0.0, 0.0, 1.0),
        ),
        100.0,
        trainable_parameters=10,
        parameters=1000,
    )
    lora = TrialConfig(micro_batch=4, lora_rank=8)
    proposer._memory.traced[lora.replace(micro_batch=1)] = _toy_estimate(lora, lora_costs)
    # A step of 16 x 300 FLOPs (the base's weight gradients added) + 4 micro steps x 3 operators x 0.05 s,
    # against LoRA's 16 x 200 + 4 x 2 x 0.05.
    full = TrialConfig(micro_batch=4)
    ratio = math.exp(proposer._prior.placed(full) - proposer._prior.predicted(lora))
    assert ratio == pytest.approx((3.2 + 0.4) / (4.8 + 0.6))


def test_out_of_time_the_proposer_makes_no_new_estimate(tmp_path):
    """Under --max-time, once the next trial would eat into the confirmation's time, no family is traced on
    the way to a proposal (a ranking pass over untraced families cost 25 s of 3-s traces past a 60-s limit)."""
    asked: list[TrialConfig] = []
    proposer = _proposer(tmp_path, "[2, 4, 8]", {False: 4, True: 2}, asked)
    proposer.out_of_time = lambda: True
    assert proposer.next_config([]) is None
    proposer.outlook([])  # the outlook is made without estimates too
    assert asked == []
    # A size measured to fit is still proposable without an estimate: its smaller sizes are implied to fit.
    records = [_measured(TrialConfig(micro_batch=8), 100.0, peak_mib=36, predicted_mib=36)]
    assert proposer.next_config(records) in (TrialConfig(micro_batch=4), TrialConfig(micro_batch=2))
    assert asked == []


def test_more_checkpointing_than_a_config_that_fits_is_never_measured(tmp_path):
    """Checkpointing buys memory with a recompute: at a micro batch that fits without it (or with fewer layers
    checkpointed), a checkpointed config does that config's work and more. Only where the lighter config does
    not fit is it open, and the search's answer says how many it left out and why."""
    (tmp_path / "space.yaml").write_text("knobs:\n  micro_batch: [2, 4, 8]\n  checkpointing: [false, every-2, true]\n")
    proposer = _toy_proposer(tmp_path / "space.yaml", lambda c: _toy_estimate(c, toy_costs(100)))
    plain = TrialConfig(micro_batch=4)
    every_2 = plain.replace(checkpointing=True, checkpoint_every=2)
    full = plain.replace(checkpointing=True)
    records = [_measured(plain, 1000, 40, 40)]
    open_configs = set(proposer._open_configs(records))
    # mb=4 fits without it, and so does mb=2 (smaller): their checkpointed twins only add a recompute.
    for mb in (2, 4):
        assert every_2.replace(micro_batch=mb) not in open_configs
        assert full.replace(micro_batch=mb) not in open_configs
    # mb=8 without checkpointing is not known to fit: checkpointing may be what lets it fit.
    assert every_2.replace(micro_batch=8) in open_configs and full.replace(micro_batch=8) in open_configs
    assert proposer.outlook(records).recompute_only == 4
    # every-2 fitting at mb=8 leaves out full checkpointing there, which recomputes more layers.
    records.append(dataclasses.replace(_measured(every_2.replace(micro_batch=8), 1100, 45, 45), number=1))
    open_configs = set(proposer._open_configs(records))
    assert full.replace(micro_batch=8) not in open_configs
    assert "5 configs not measured: each checkpoints more layers than one that fits" in (
        proposer.outlook(records).recompute_text()
    )


def test_checkpointing_with_activation_offload_is_measured_even_where_the_plain_config_fits():
    """With activation offload, checkpointing moves only the checkpoints' inputs: less traffic than without it,
    so it may be faster and is not left out."""
    from autotune.search.memory_bounds import recomputes_more_than_fitting

    plain = TrialConfig(micro_batch=4, activation_offload=True)
    checkpointed = plain.replace(checkpointing=True)
    assert not recomputes_more_than_fitting(checkpointed, [plain], {plain, checkpointed})
    without_offload = checkpointed.replace(activation_offload=False)
    offered = {plain.replace(activation_offload=False), without_offload}
    assert recomputes_more_than_fitting(without_offload, [plain.replace(activation_offload=False)], offered)
    # The lighter config must be one the search could answer: not offered, it does not dominate.
    assert not recomputes_more_than_fitting(
        without_offload, [plain.replace(activation_offload=False)], {without_offload}
    )


def test_a_value_held_only_by_configs_of_a_waived_value_is_not_owed(tmp_path):
    """fp16 on a device whose 16-bit matmuls are 100x slower is waived (predicted far below the best). With
    checkpointing at fp32 only repeating configs that fit (mb <= 8), and mb=16 predicted over the limit with or
    without it, every open config holding checkpointing that may fit is an fp16 one: measuring it there is a
    slow trial about a config the answer cannot be, so it is waived too, not owed."""
    knobs = "  micro_batch: [1, 2, 4, 8, 16]\n  precision: [fp32, fp16]\n  checkpointing: [false, true]\n"
    # mb=16: 60 or 84 MiB, over the 50 MiB limit
    proposer = _slow_fp16_proposer(tmp_path, knobs, lambda config: 3.5 if config.checkpointing else 5.0)
    records = _fp32_trials((1, 2, 4, 8), per_sample_mib=5, skipped=16)
    proposer.outlook(records)  # ranks, and so estimates the fp32 checkpointed family's frontier
    outlook = proposer.outlook(records)
    waived = dict(outlook.waived)
    assert set(waived) == {("precision", "'fp16'"), ("checkpointing", "True")}
    assert all(ratio < 0.1 for ratio in waived.values())
    assert not outlook.owed and outlook.settled  # the search ends: nothing open may beat the best


def test_two_trials_bound_the_error_enough_to_waive_a_precision_many_times_slower(tmp_path):
    """Only mb=1 and mb=2 fit (mb=4 is predicted over the limit): two trials, too few for the model's
    error (MIN_HELD_OUT), but enough to bound it (ThroughputModel.error_bound, at least 2x). fp16, 100x
    slower in matmuls here, is predicted far below the best even at that bound: the search ends
    without its slow trial, rather than measuring it because the error was not yet known."""
    proposer = _slow_fp16_proposer(tmp_path, "  micro_batch: [1, 2, 4]\n  precision: [fp32, fp16]\n", lambda c: 20)
    records = _fp32_trials((1, 2), per_sample_mib=20, skipped=4)
    proposer.outlook(records)  # ranks, and so traces the fp16 family
    outlook = proposer.outlook(records)
    assert dict(outlook.waived).keys() == {("precision", "'fp16'")}
    assert not outlook.owed and outlook.settled
    # One trial bounds nothing: fp16 stays owed, and the search goes on to measure it.
    alone = proposer.outlook(records[1:])
    assert ("precision", "'fp16'") in alone.owed and not alone.settled
