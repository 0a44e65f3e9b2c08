"""FSDP in a user's job: the exported config, applied with ``autotune.prepare`` under torchrun,
shards the user's own model as the trial sharded its own; the libraries' exports say where they
cannot run FSDP instead of training something else."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.output.exporters import export_config

WORKLOAD = Workload(model="builtin:llama-tiny", seq_len=32, global_batch=4, nproc=2)
CONFIG = TrialConfig(micro_batch=2, precision="bf16", fsdp="full")

# A user's script: their own model and loop, nothing of autotune's but prepare().
_JOB = textwrap.dedent("""
    import math, sys
    import torch, torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM
    import autotune

    dist.init_process_group("gloo")
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, vocab_size=500))
    whole = sum(p.numel() for p in model.parameters())
    model = autotune.prepare(model, sys.argv[1])
    mine = sum(p.to_local().numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 500, (2, 32))
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if dist.get_rank() == 0:
        finite = all(map(math.isfinite, losses))
        print("RESULT", type(model).__name__, mine * 2 == whole, finite, losses[-1] < losses[0])
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_the_json_export_applied_with_prepare_under_torchrun_shards_and_trains(tmp_path):
    export = tmp_path / "config.json"
    export.write_text(export_config(CONFIG, WORKLOAD, fmt="json", device_type="cpu"))
    (tmp_path / "job.py").write_text(_JOB)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "job.py", str(export)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "RESULT FSDPLlamaForCausalLM True True True" in proc.stdout, proc.stderr[-3000:]


def test_prepare_without_a_process_group_says_how_to_get_one():
    import torch

    with pytest.raises(ConfigError, match="run the job under torchrun and call torch.distributed.init_process_group"):
        import autotune

        autotune.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4)), CONFIG)


@pytest.mark.parametrize("fmt", ["hf", "accelerate", "lightning"])
def test_library_exports_of_fsdp_on_a_cpu_are_refused_with_the_way_that_works(fmt):
    with pytest.raises(
        ConfigError,
        match=rf"--format {fmt}: this config shards with --fsdp full on a cpu, where .* "
        r"does not run FSDP \(it needs GPUs\); export --format json",
    ):
        export_config(CONFIG, WORKLOAD, fmt=fmt, device_type="cpu")
    assert json.loads(export_config(CONFIG, WORKLOAD, fmt="json", device_type="cpu"))["config"]["fsdp"] == "full"


# Accelerate runs FSDP on GPUs only: its export, launched as a user launches it, on one GPU with
# FSDP's CPU offload (one rank shards nothing without it).
_ACCELERATE_JOB = textwrap.dedent("""
    import math, torch
    from accelerate import Accelerator
    from transformers import LlamaConfig, LlamaForCausalLM

    accelerator = Accelerator()
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, vocab_size=500))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, 500, (2, 32), device=accelerator.device)
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    print("RESULT", accelerator.distributed_type, type(model).__name__, all(map(math.isfinite, losses)))
""")


@pytest.mark.gpu
def test_the_accelerate_export_of_an_fsdp_config_trains_fsdp_on_a_gpu(tmp_path):
    config = TrialConfig(micro_batch=2, precision="bf16", fsdp="full", offload="optimizer+params")
    workload = Workload(model="builtin:llama-tiny", seq_len=32, global_batch=2, nproc=1)
    (tmp_path / "accelerate.yaml").write_text(export_config(config, workload, fmt="accelerate", device_type="cuda"))
    (tmp_path / "job.py").write_text(_ACCELERATE_JOB)
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate.yaml", "job.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "RESULT DistributedType.FSDP FSDPLlamaForCausalLM True" in proc.stdout, proc.stderr[-3000:]
