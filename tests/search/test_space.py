"""Search spaces: every preset loads, the schema refuses bad files by name, and the proposer's rules (each lever's
axis on its own: tests/levers/test_axes.py)."""

from __future__ import annotations

import json

import pytest

from autotune.config.device import DeviceInfo
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.estimate.results import MemoryEstimate
from autotune.search.memory_bounds import implied_too_big
from autotune.search.presets import load_space, preset_names
from autotune.search.proposer import Proposer
from autotune.search.space import SearchSpace
from autotune.study.summary import TrialRecord

CPU = DeviceInfo("cpu", "test-cpu", 1, 16 * 2**30, bf16=True, fp16_deepspeed=False)
GPU = DeviceInfo("cuda", "test-gpu", 2, 80 * 2**30, bf16=True, fp16_deepspeed=True)


@pytest.mark.parametrize(
    "name",  # full: some 90,000 configs on two ranks of a GPU, each built and validated
    ["default", pytest.param("full", marks=pytest.mark.slow), "lora", "quick", "sharding", "zero"],
)
def test_every_preset_loads_and_round_trips_its_configs(name):
    assert name in preset_names()
    space = load_space(name)
    # sharding on one CPU rank: sharding over one rank saves nothing, offloading to the CPU neither
    sharding = name in ("sharding", "zero")
    for device, nproc in ((CPU, 1), (CPU, 2), (GPU, 2)) if not sharding else ((CPU, 2), (GPU, 1), (GPU, 2)):
        workload = Workload(global_batch=16, nproc=nproc)
        configs = space.candidates(workload, device)
        assert configs, f"{name} has nothing to run on {device.type}"
        assert len(set(configs)) == len(configs)
        for config in configs:
            config.validate_for(workload, device)
            assert space.config_of(space.params_of(config)) == config


def test_presets_move_precision_and_lora_only_where_they_say():
    default, lora, quick = (load_space(n).candidates(Workload(), GPU) for n in ("default", "lora", "quick"))
    assert not any(c.uses_lora for c in default + quick)
    assert all(c.uses_lora for c in lora)
    assert {c.precision for c in default} == {"fp32", "tf32", "bf16", "fp16"}
    assert len(quick) < len(default) and load_space("quick").n_trials < load_space("default").n_trials


def test_zero_only_where_it_means_something_for_the_rank_count():
    space = load_space("default")
    one_rank = space.candidates(Workload(nproc=1), GPU)
    two_ranks = space.candidates(Workload(nproc=2), GPU)
    assert all(c.offload != "none" for c in one_rank if c.uses_deepspeed)  # sharding over one rank saves nothing
    assert any(c.zero_stage == 2 and c.offload == "none" for c in two_ranks)
    assert {c.micro_batch for c in two_ranks} == {1, 2, 4, 8}  # divisors of 16 / 2 ranks


def test_offload_means_nothing_when_the_device_is_the_cpu():
    space = load_space("default")
    on_cpu = space.candidates(Workload(nproc=2), CPU)
    assert {c.offload for c in on_cpu} == {"none"} and any(c.zero_stage == 3 for c in on_cpu)
    assert {c.offload for c in space.candidates(Workload(nproc=2), GPU)} == {"none", "optimizer", "optimizer+params"}
    assert all(not c.uses_deepspeed for c in space.candidates(Workload(nproc=1), CPU))  # nothing left to shard
    offload = (
        "offload optimizer, optimizer+params: the device is the CPU, and offloading from the CPU to the CPU "
        "changes nothing"
    )
    assert offload in space.dropped_knobs(Workload(nproc=2), CPU)
    assert not any(line.startswith("offload") for line in space.dropped_knobs(Workload(nproc=2), GPU))
    with pytest.raises(
        ConfigError,
        match=r"zero: .*no pair means something on 1 rank\(s\) of a cpu .*offloading to the "
        r"CPU changes nothing\); add off to zero_stage",
    ):
        load_space("zero").candidates(Workload(nproc=1), CPU)


@pytest.mark.slow
def test_missing_checkpointing_reads_the_model_class_without_building_a_model():
    from autotune.prepare.model_facts import missing_checkpointing

    assert missing_checkpointing(Workload(model="builtin:llama2-7b")) is None  # a 7B model: no time to build it
    assert missing_checkpointing(Workload(model="factories:mlp", seq_len=8)) == (
        "the model from --model factories:mlp has no activation_checkpointing_enable() "
        "or gradient_checkpointing_enable()"
    )
    assert missing_checkpointing(Workload(model="factories:broken", seq_len=8)) is None  # unknown: its trials say


def test_a_users_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "n_trials: 4\nknobs:\n  micro_batch: [2, 4]\n  checkpointing: [on, off]\n"
        "  lora_rank: [off, 8]\n  lora_targets: ['q_proj,v_proj']\n"
    )
    space = load_space(str(path))
    configs = space.candidates(Workload(model="builtin:llama-tiny"), CPU)
    assert space.n_trials == 4 and len(configs) == 8
    assert {c.lora_targets for c in configs if c.uses_lora} == {("q_proj", "v_proj")}


@pytest.mark.parametrize(
    "text, message",
    [
        ("knobs:\n  micro_batchs: [1]\n", "unknown knob 'micro_batchs'; knobs: micro_batch, precision"),
        (
            "knobs:\n  precision: [fp8]\n",
            "knobs.precision: 'fp8' is not allowed; allowed: a list of fp32, tf32, fp16, bf16",
        ),
        ("knobs:\n  micro_batch: [0]\n", "knobs.micro_batch: 0 is not allowed"),
        ("knobs:\n  zero_stage: [4]\n", "knobs.zero_stage: 4 is not allowed; allowed: a list of off, 0, 1, 2, 3"),
        ("knobs:\n  checkpointing: [maybe]\n", "knobs.checkpointing: 'maybe' is not allowed"),
        ("knobs:\n  lora_rank: [8]\n  lora_alpha: [16, 32]\n", "knobs.lora_alpha: [16, 32] is not allowed"),
        ("knobs:\n  offload: []\n", "knobs.offload is empty"),
        ("knob:\n  precision: [fp32]\n", "unknown key 'knob'; allowed: description, knobs, n_trials, patience"),
        ("n_trials: 0\nknobs:\n  precision: [fp32]\n", "n_trials: 0 must be a whole number of at least 1"),
        ("- fp32\n", "a search space is a mapping"),
        ("knobs: [\n", "not valid YAML (line"),
    ],
)
def test_bad_files_are_refused_naming_the_file_and_the_key(tmp_path, text, message):
    path = tmp_path / "space.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_space(str(path))
    assert str(path) in str(info.value) and message in str(info.value)


def test_values_that_cannot_run_here_are_refused_when_the_workload_is_known(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("knobs:\n  micro_batch: [3]\n")
    with pytest.raises(ConfigError, match=r"micro_batch \[3\] do not divide the per-rank batch 16"):
        load_space(str(path)).candidates(Workload(global_batch=16), CPU)
    path.write_text("knobs:\n  precision: [tf32]\n")
    with pytest.raises(ConfigError, match="none of them trains on test-cpu"):
        load_space(str(path)).candidates(Workload(), CPU)


def test_unknown_preset_and_missing_file():
    presets = "default, full, lean, lora, parallel, quick, sharding, zero"
    with pytest.raises(ConfigError, match=f"--space nope: no such preset; use one of {presets}"):
        load_space("nope")
    with pytest.raises(ConfigError, match="--space missing.yaml: no such file"):
        load_space("missing.yaml")


# -- the proposer ----------------------------------------------------------------------------------
def _record(
    number: int, config: TrialConfig, status: str, *, tokens: float | None = None, fits: bool = False
) -> TrialRecord:
    return TrialRecord(number=number, config=config, status=status, tokens_per_s=tokens, fits=fits)


def test_implied_out_of_memory():
    oom = TrialConfig(micro_batch=4)
    assert implied_too_big(TrialConfig(micro_batch=8), [oom])
    assert not implied_too_big(TrialConfig(micro_batch=2), [oom])
    assert not implied_too_big(TrialConfig(micro_batch=8, checkpointing=True), [oom])  # other knobs differ


def _proposer(tmp_path, text: str, **kwargs) -> Proposer:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return Proposer(load_space(str(path)), Workload(global_batch=16), CPU, **kwargs)


TWO_KNOBS = "knobs:\n  micro_batch: [2, 4, 8, 16]\n  checkpointing: [false, true]\n"


def test_without_an_estimator_the_proposer_bisects_micro_batches_retries_and_never_repeats(tmp_path):
    proposer = _proposer(tmp_path, TWO_KNOBS)
    # Nothing known: the family ranked first (no checkpointing) is bisected: the middle size first.
    assert proposer.next_config([]) == TrialConfig(micro_batch=4)

    interrupted = TrialConfig(micro_batch=8)
    records = [
        _record(0, TrialConfig(micro_batch=4), "ok", tokens=10, fits=True),
        _record(1, interrupted, "interrupted"),
    ]
    assert proposer.next_config(records) == interrupted

    # mb=4 fit, so the bisection goes up: mb=8 (between the fit and the unknown top).
    records = [_record(0, TrialConfig(micro_batch=4), "ok", tokens=10, fits=True)]
    assert proposer.next_config(records) == TrialConfig(micro_batch=8)
    # mb=8 ran out of memory: mb=16 is implied, never proposed; the frontier of no-ckpt is known.
    records.append(_record(1, TrialConfig(micro_batch=8), "oom"))
    seen = {r.config for r in records}
    while (config := proposer.next_config(records)) is not None:
        assert config not in seen and config != TrialConfig(micro_batch=16)
        seen.add(config)
        fits = config.micro_batch <= 8
        records.append(_record(len(records), config, "ok" if fits else "oom", tokens=config.micro_batch, fits=fits))
    assert TrialConfig(micro_batch=16, checkpointing=True) in seen


def test_with_an_estimator_the_first_proposal_is_the_frontier_of_the_fastest_family(tmp_path):
    from step_toys import TOY_CPU, toy_costs

    MiB = 2**20
    asked = []

    def estimate(config: TrialConfig) -> MemoryEstimate:  # 4 MiB of states; a sample: 10 MiB, 4 with ckpt
        asked.append(config)
        per_sample = (4 if config.checkpointing else 10) * MiB
        return MemoryEstimate(
            config=config,
            predicted_peak_bytes=4 * MiB + config.micro_batch * per_sample,
            parameters_bytes=MiB,
            gradients_bytes=MiB,
            optimizer_state_bytes=2 * MiB,
            activations_bytes=config.micro_batch * per_sample,
            temporaries_bytes=0,
            overhead_bytes=None,
            method="test",
            seconds=0.0,
            step_costs=toy_costs(120 if config.checkpointing else 100),
        )

    proposer = _proposer(tmp_path, TWO_KNOBS, estimator=estimate, limit_bytes=50 * MiB, margin=0.05)
    proposer.profile = TOY_CPU
    # no ckpt: mb=4 (44 MiB) fits, mb=8 (84) does not. Ranked against ckpt's frontier mb=8 (36 MiB),
    # the toy traced steps put no-ckpt mb=4 first (2.0 s a step against 2.12: the recompute costs more
    # than the larger micro batch saves; no-ckpt mb=2 would take 2.4 s).
    assert proposer.next_config([]) == TrialConfig(micro_batch=4)
    # One estimate per family, each its middle size (mb=4), traced to rank it; the straight line through
    # the first puts mb=8 (84 MiB) clearly over the limit, so it is not estimated.
    assert asked == [TrialConfig(micro_batch=4), TrialConfig(micro_batch=4, checkpointing=True)]
    # It ran out of memory anyway (an under-estimate): the estimator's frontier gives way to the trial.
    records = [_record(0, TrialConfig(micro_batch=4), "oom")]
    assert proposer.next_config(records) == TrialConfig(micro_batch=8, checkpointing=True)
    # Measured: checkpointing ran 3x faster than the model expects; its family goes first from now on.
    records.append(_record(1, TrialConfig(micro_batch=8, checkpointing=True), "ok", tokens=300, fits=True))
    records.append(_record(2, TrialConfig(micro_batch=2), "ok", tokens=50, fits=True))
    assert proposer.next_config(records) == TrialConfig(micro_batch=4, checkpointing=True)
    calls = len(asked)
    proposer.next_config(records)
    assert len(asked) == calls  # each estimate is asked once


def test_the_throughput_model_starts_from_the_step_time_model_and_follows_the_measurements(tmp_path):
    import math

    from autotune.search.throughput import ThroughputModel

    space = _proposer(tmp_path, TWO_KNOBS).space
    plain, ckpt = TrialConfig(micro_batch=4), TrialConfig(micro_batch=4, checkpointing=True)
    predicted = {plain: math.log(100.0), ckpt: math.log(75.0)}  # the step-time model's figures
    configs = [plain, ckpt, TrialConfig(micro_batch=8)]
    model = ThroughputModel(space.params_of, predicted.get, configs)
    assert model.predict(plain) == math.log(100.0) and model.predict(ckpt) == math.log(75.0)
    # Not predicted (no traced step): at the mean of the predicted ones, its micro batch's saturation aside.
    assert model.prior(TrialConfig(micro_batch=8)) > model.prior(TrialConfig(micro_batch=2))
    unpredicted = ThroughputModel(space.params_of)  # no model at all: nothing assumed
    assert unpredicted.predict(ckpt) == unpredicted.predict(plain)
    # Measured: checkpointing ran faster than the plain step at every size (some models do).
    model.fit(
        [
            (TrialConfig(micro_batch=2), 100.0),
            (TrialConfig(micro_batch=2, checkpointing=True), 300.0),
            (TrialConfig(micro_batch=8), 150.0),
            (TrialConfig(micro_batch=8, checkpointing=True), 450.0),
        ]
    )
    assert model.predict(ckpt) > model.predict(plain)


def test_a_space_none_of_whose_configs_can_run_here_says_why(tmp_path):
    from autotune.config.workload import Workload
    from autotune.errors import ConfigError
    from autotune.search.presets import load_space

    (tmp_path / "fp16_zero.yaml").write_text("knobs:\n  micro_batch: [2]\n  precision: [fp16]\n  zero_stage: [2]\n")
    space = load_space(tmp_path / "fp16_zero.yaml")
    with pytest.raises(ConfigError, match="no config of this space can run here: --precision fp16 with --zero-stage"):
        space.candidates(Workload(model="builtin:gpt2-tiny", nproc=2), CPU)
    assert space.candidates(Workload(model="builtin:gpt2-tiny", nproc=2), GPU)  # where DeepSpeed trains fp16


@pytest.mark.parametrize("name", preset_names())
def test_a_stored_space_rebuilds_to_the_same_search(name):
    space = load_space(name)
    again = SearchSpace.from_dict(json.loads(json.dumps(space.to_dict())))  # as a study stores it
    assert again == space and again.digest == space.digest


def test_the_sharding_space_offers_zero_and_fsdp_side_by_side_and_zero_is_its_old_name():
    space = load_space("sharding")
    assert load_space("zero").digest == space.digest and load_space("zero").name == "zero"
    two_cpu_ranks = space.candidates(Workload(nproc=2), CPU)
    assert {c.fsdp for c in two_cpu_ranks} == {None, "full", "grad-op"}
    assert not any(c.uses_fsdp and c.uses_deepspeed for c in two_cpu_ranks)
    assert {c.offload for c in two_cpu_ranks if c.uses_fsdp} == {"none"}  # on a CPU, offload changes nothing
    one_gpu = space.candidates(Workload(nproc=1), GPU)
    assert {c.offload for c in one_gpu if c.uses_fsdp} == {"optimizer+params"}  # one rank: only with offload
    # The default space on several ranks includes FSDP; on one CPU rank it says why not.
    assert any(c.uses_fsdp for c in load_space("default").candidates(Workload(nproc=2), CPU))
    assert any(
        line.startswith("fsdp full, grad-op: on one rank FSDP shards nothing")
        for line in load_space("default").dropped_knobs(Workload(nproc=1), CPU)
    )


def test_the_sharding_and_parallel_spaces_shard_hybrid_only_past_one_node():
    """Hybrid sharding shards within a node and replicates across nodes: on one node there is nothing to
    replicate across, so the presets offer it only to a workload of several nodes."""
    from autotune.config.device import detect_device

    cpu = detect_device("cpu")
    for name in ("sharding", "parallel"):
        space = load_space(name)
        one = Workload(model="builtin:llama-tiny", seq_len=64, global_batch=8, nproc=4)
        two = one.replace(nodes=2)
        assert not [c for c in space.candidates(one, cpu) if c.fsdp == "hybrid"]
        hybrid = [c for c in space.candidates(two, cpu) if c.fsdp == "hybrid"]
        assert hybrid and all(c.shard_degree(two) == 2 for c in hybrid)  # the default group: one node's ranks


def test_an_empty_zero_stage_beside_fsdp_modes_is_a_space_of_fsdp_alone(tmp_path):
    """zero_stage's off is the config that shards nothing: a space lists it unless it says ``zero_stage: []`` beside
    an FSDP mode, and an empty list with nothing beside it is refused, naming the knob."""
    only = tmp_path / "only.yaml"
    only.write_text("knobs:\n  micro_batch: [2]\n  zero_stage: []\n  fsdp: [full, hybrid]\n")
    space = load_space(str(only))
    two_nodes = Workload(model="builtin:llama-tiny", seq_len=64, global_batch=8, nproc=4, nodes=2)
    assert {c.fsdp for c in space.candidates(two_nodes, CPU)} == {"full", "hybrid"}  # no DDP config among them
    assert SearchSpace.from_dict(json.loads(json.dumps(space.to_dict()))) == space  # as a study stores it
    for fsdp in ("[off]", "[]"):
        bare = tmp_path / "bare.yaml"
        bare.write_text(f"knobs:\n  micro_batch: [2]\n  zero_stage: []\n  fsdp: {fsdp}\n")
        with pytest.raises(ConfigError, match=r"knobs\.(zero_stage|fsdp) is empty; allowed: a list of off"):
            load_space(str(bare))


def test_a_source_checkout_that_is_not_installed_finds_its_presets(tmp_path):
    # A checkout on PYTHONPATH has search_spaces/ at its top, not the package autotune.search_spaces
    # that an install maps it to: the presets are found there (the GPU machine runs autotune so).
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    shutil.copytree(root / "autotune", tmp_path / "autotune")
    shutil.copytree(root / "search_spaces", tmp_path / "search_spaces")
    code = (
        "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
        f"sys.path.insert(0, {str(tmp_path)!r}); "
        "import autotune, importlib.util; assert importlib.util.find_spec('autotune.search_spaces') is None; "
        "from autotune.search.presets import load_space, preset_names; "
        "print(autotune.__file__, preset_names(), load_space('quick').name)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(str(tmp_path)), proc.stdout
    assert "'default'" in proc.stdout and proc.stdout.rstrip().endswith("quick")


@pytest.mark.parametrize(("name", "device", "nproc"), [("full", CPU, 1), ("lean", GPU, 2), ("default", CPU, 2)])
def test_candidates_are_the_products_configs_that_pass_every_check_in_its_order(name, device, nproc):
    # The enumeration skips what a refusal's fields decide (autotune/search/candidates.py): it must keep
    # exactly what building and checking every config of the product keeps, in the same order.
    import itertools

    space, workload = load_space(name), Workload(global_batch=16, nproc=nproc)
    choices, every = space.choices(workload, device), []
    for combo in itertools.product(*choices.values()):
        try:
            config = space.config_of(dict(zip(choices, combo, strict=True)))
            config.validate_for(workload, device)
        except ConfigError:
            continue
        every.append(config)
    assert 100 < len(every) < len(list(itertools.product(*choices.values())))  # some refused, many kept
    assert space.candidates(workload, device) == every
