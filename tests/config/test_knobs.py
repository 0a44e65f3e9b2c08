import json

import pytest

from autotune.config.device import DeviceInfo
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError, WorkloadError


def test_accumulation_is_derived_from_global_batch_and_ranks():
    assert TrialConfig(micro_batch=4).grad_accum_steps(Workload(global_batch=32)) == 8
    assert TrialConfig(micro_batch=4).grad_accum_steps(Workload(global_batch=32, nproc=2)) == 4


def test_indivisible_micro_batch_names_both_flags():
    with pytest.raises(ConfigError, match=r"--micro-batch 3 .* --global-batch 32"):
        TrialConfig(micro_batch=3).grad_accum_steps(Workload(global_batch=32))


def test_round_trip_through_json_keeps_equality():
    config = TrialConfig(
        micro_batch=2,
        precision="bf16",
        checkpointing=True,
        lora_rank=8,
        lora_targets=("q_proj", "v_proj"),
        zero_stage=3,
        offload="optimizer+params",
    )
    again = TrialConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and hash(again) == hash(config)


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(micro_batch=0), "--micro-batch"),
        (dict(precision="fp8"), "--precision"),
        (dict(offload="optimizer"), "--offload optimizer needs ZeRO"),
        (dict(zero_stage=0, offload="optimizer"), "--offload optimizer needs ZeRO"),
        (dict(zero_stage=2, offload="optimizer+params"), "--zero-stage 3"),
        (dict(lora_alpha=16), "--lora-alpha is set but LoRA is off"),
        (dict(lora_rank=0), "--lora-rank"),
        (dict(zero_stage=4), "--zero-stage"),
        (dict(offload="disk"), "--offload"),
    ],
)
def test_nonsense_is_refused_with_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        TrialConfig(**kwargs)


CPU = DeviceInfo("cpu", "test cpu", 1, None, bf16=True, fp16_deepspeed=False)
GPU = DeviceInfo("cuda", "test gpu", 1, 80 * 2**30, bf16=True, fp16_deepspeed=True)
OLD_GPU = DeviceInfo("cuda", "old gpu", 1, 16 * 2**30, bf16=False, fp16_deepspeed=True)


def test_device_dependent_refusals():
    workload = Workload(global_batch=8)
    with pytest.raises(ConfigError, match="tf32 only exists on CUDA"):
        TrialConfig(precision="tf32").validate_for(workload, CPU)
    TrialConfig(precision="tf32").validate_for(workload, GPU)
    with pytest.raises(ConfigError, match="fp16 with --zero-stage"):
        TrialConfig(precision="fp16", zero_stage=2).validate_for(workload, CPU)
    TrialConfig(precision="fp16", zero_stage=2).validate_for(workload, GPU)
    with pytest.raises(ConfigError, match="old gpu has no bfloat16"):
        TrialConfig(precision="bf16").validate_for(workload, OLD_GPU)
    with pytest.raises(ConfigError, match="does not divide"):
        TrialConfig(micro_batch=8).validate_for(Workload(global_batch=8, nproc=2), CPU)


def test_unknown_knob_in_a_dict_is_named():
    with pytest.raises(ConfigError, match="unknown knob"):
        TrialConfig.from_dict({"micro_batch": 1, "batch": 2})


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(global_batch=0), "--global-batch"),
        (dict(nproc=3, global_batch=16), "--nproc 3"),
        (dict(task="translation"), "--task"),
        (dict(device="tpu"), "--device"),
        (dict(seq_len=-1), "--seq-len"),
    ],
)
def test_bad_workloads_name_the_flag(kwargs, flag):
    with pytest.raises(WorkloadError, match=flag):
        Workload(**kwargs)


def test_more_ranks_than_gpus_are_refused_before_anything_starts():
    from autotune.errors import WorkloadError as Refused
    from autotune.trial import runner

    with pytest.raises(Refused, match="--nproc 2 needs 2 GPUs; 1 visible"):
        runner.run_trial(Workload(nproc=2, global_batch=4), TrialConfig(micro_batch=2), device=GPU)


def test_a_trial_over_several_nodes_runs_only_in_a_slurm_job_of_as_many():
    from autotune.errors import WorkloadError as Refused
    from autotune.trial import runner

    two_nodes = Workload(nproc=2, nodes=2, global_batch=4)
    with pytest.raises(Refused, match="--nodes 2: this trial would start its ranks on 1 node.*--executor slurm"):
        runner.run_trial(two_nodes, TrialConfig(micro_batch=2), device=CPU)
    one_node_job = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "vm", "SLURM_JOB_NUM_NODES": "1"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in one_node_job.items():
            patch.setenv(name, value)
        with pytest.raises(Refused, match="--nodes 2: .* on 1 node.*a SLURM job of 2 nodes"):
            runner.run_trial(two_nodes, TrialConfig(micro_batch=2), device=CPU, srun=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(nproc=1, nodes=2), "--nodes 2 with --nproc 1: each node runs at least one rank; use --nproc 2"),
        (dict(nproc=3, nodes=2, global_batch=12), "--nproc 3 does not divide over --nodes 2"),
        (dict(nodes=0), "--nodes 0 must be a whole number of at least 1"),
    ],
)
def test_nodes_that_cannot_share_the_ranks_are_refused(kwargs, message):
    with pytest.raises(WorkloadError, match=message):
        Workload(**kwargs)
    assert Workload(nproc=4, nodes=2).ranks_per_node == 2


def test_a_workload_on_one_node_stores_as_before_nodes_and_two_nodes_round_trip():
    assert "nodes" not in Workload(nproc=4).to_dict()  # a one-node study's question, byte for byte
    two = Workload(nproc=4, nodes=2)
    assert two.to_dict()["nodes"] == 2 and Workload.from_dict(two.to_dict()) == two
