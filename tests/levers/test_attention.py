"""--attention: Transformers' attn_implementation as a knob, refused where it cannot run."""

from __future__ import annotations

import re

import commands
import pytest
import torch

import autotune
from autotune.config.device import detect_device
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.levers.attention import attention_refusal
from autotune.models.sources import build_model
from autotune.prepare.workload_facts import WorkloadFacts
from autotune.search.presets import load_space

LONG = Workload(model="builtin:llama-tiny", seq_len=256, global_batch=4)


def test_eager_attention_keeps_the_scores_sdpa_does_not_and_the_estimator_predicts_both():
    from autotune.estimate.client import predict_memory
    from autotune.trial.runner import run_trial

    configs = [TrialConfig(micro_batch=4, attention=a) for a in ("sdpa", "eager")]
    results = [run_trial(LONG, c, warmup_steps=1, measure_steps=1) for c in configs]
    assert all(r.ok for r in results), [r.error for r in results]
    sdpa, eager = results
    assert eager.peak_memory_bytes > 1.1 * sdpa.peak_memory_bytes  # 4 x heads x 256 x 256 scores per layer
    assert eager.final_loss == pytest.approx(sdpa.final_loss, abs=1e-3)  # the same maths
    for config, result in zip(configs, results, strict=True):
        assert predict_memory(LONG, config).predicted_peak_bytes == pytest.approx(result.peak_memory_bytes, rel=0.05)


@pytest.mark.parametrize(
    ("attention", "reason"),
    [
        ("flash_attention_2", "runs on CUDA GPUs only"),
        ("flex_attention", "has no backward on a CPU"),
        ("flux", "is not known; use one of auto, eager, sdpa, flash_attention_2, flex_attention"),
    ],
)
@pytest.mark.slow
def test_what_this_cpu_cannot_run_is_refused_in_one_line_before_a_trial(tmp_path, attention, reason):
    proc = commands.autotune(
        "trial",
        "--model",
        "builtin:llama-tiny",
        "--seq-len",
        "32",
        "--global-batch",
        "2",
        "--attention",
        attention,
        "--json",
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--attention" in lines[0] and attention in lines[0] and reason in lines[0]
    assert not list(tmp_path.iterdir())  # nothing written


def test_what_the_model_cannot_take_is_refused_before_a_trial():
    assert "GPT2LMHeadModel (--model builtin:gpt2-tiny) does not support it" in attention_refusal(
        "flex_attention", WorkloadFacts(Workload(model="builtin:gpt2-tiny"), task="causal-lm")
    )
    assert (
        attention_refusal("flex_attention", WorkloadFacts(Workload(model="builtin:llama-tiny"), task="causal-lm"))
        is None
    )
    assert "is a factory's" in attention_refusal(
        "eager", WorkloadFacts(Workload(model="factories:mlp"), task="causal-lm")
    )


def test_the_full_space_keeps_what_runs_here_and_says_what_it_drops():
    space = load_space("full")
    cpu = detect_device("cpu")
    assert space.choices(LONG, cpu)["attention"] == ("auto", "eager")
    dropped = space.dropped_knobs(LONG, cpu)
    assert any(line.startswith("--attention flash_attention_2 runs on CUDA GPUs only") for line in dropped)
    assert any(line.startswith("--attention flex_attention has no backward on a CPU") for line in dropped)


def test_prepare_and_the_exports_set_the_kernel_the_trials_ran(tmp_path):
    from autotune.output.exporters import export_config

    config = TrialConfig(micro_batch=2, attention="eager")
    assert config.describe() == "mb=2 fp32 attn=eager"
    header = export_config(config, LONG, fmt="yaml", device_type="cpu")
    line = re.search(r"`(model = autotune\.prepare\(.*?\))`", header)
    assert line is not None and 'attn_implementation="eager"' in header
    model = build_model(LONG, task="causal-lm", device=torch.device("cpu"))
    assert model.config._attn_implementation == "sdpa"  # the model's own default
    exec(line.group(1), {"autotune": autotune, "model": model}, scope := {})
    assert scope["model"].config._attn_implementation == "eager"
    with pytest.raises(ConfigError, match=r"--attention eager: the model has no set_attn_implementation"):
        autotune.prepare(torch.nn.Linear(2, 2), attention="eager")
