"""The optimizer levers of lean fine-tuning: 8-bit AdamW, Adafactor and the
step inside backward, run for real on this CPU, predicted by the estimator, refused where they mean nothing."""

from __future__ import annotations

import commands
import pytest
import torch
from refusals import trial_refusal

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.client import predict_memory
from autotune.levers.optimizer import StepInBackward, build_optimizer
from autotune.trial.runner import run_trial

# Short sequences and one sample: the model states, not the activations, set the peak (at the optimizer step),
# which is where these levers act.
STATES_DOMINATE = Workload(model="builtin:gpt2-tiny", seq_len=16, global_batch=1)
LEVERS = [
    TrialConfig(optimizer="adamw-8bit"),
    TrialConfig(optimizer="adafactor"),
    TrialConfig(optimizer_in_backward=True),
    TrialConfig(optimizer="adafactor", optimizer_in_backward=True),
]


@pytest.fixture(scope="module")
def plain():
    result = run_trial(STATES_DOMINATE, TrialConfig(), warmup_steps=1, measure_steps=1)
    assert result.ok, result.error
    return result


@pytest.mark.parametrize("config", LEVERS, ids=[c.describe() for c in LEVERS])
def test_each_lever_trains_here_below_the_plain_peak_and_as_predicted(plain, config):
    measured = run_trial(STATES_DOMINATE, config, warmup_steps=1, measure_steps=1)
    assert measured.ok, measured.error
    assert measured.peak_memory_bytes < plain.peak_memory_bytes, (measured.peak_memory_bytes, plain.peak_memory_bytes)
    predicted = predict_memory(STATES_DOMINATE, config)
    error = predicted.predicted_peak_bytes / measured.peak_memory_bytes - 1
    assert abs(error) <= 0.05, (predicted.to_dict(), measured.peak_memory_bytes)
    assert predicted.optimizer_state_bytes == measured.optimizer_state_bytes
    if config.optimizer_in_backward:
        assert predicted.gradients_bytes == 0  # each gradient is freed by the step that used it
    else:
        assert predicted.optimizer_state_bytes < plain.optimizer_state_bytes / 3  # 8 bits, or factored moments
    expected = {"adamw-8bit": "torchao.optim.AdamW8bit", "adafactor": "transformers.optimization.Adafactor"}
    assert measured.optimizer.startswith(expected.get(config.optimizer, "torch.optim.AdamW")), measured.optimizer


def test_the_step_inside_backward_is_the_same_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    twin = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    twin.load_state_dict(model.state_dict())
    after = build_optimizer(model.parameters(), TrialConfig(), lr=0.01)
    inside = build_optimizer(twin.parameters(), TrialConfig(optimizer_in_backward=True), lr=0.01)
    assert isinstance(inside, StepInBackward)
    x = torch.randn(4, 8)
    for _ in range(3):
        model(x).pow(2).sum().backward()
        after.step()
        after.zero_grad()
        twin(x).pow(2).sum().backward()
        assert all(p.grad is None for p in twin.parameters())  # freed by the step inside the backward
        inside.step()  # finds nothing left to step: a loop's usual lines stay as they were
        inside.zero_grad()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def _refusal(*args: str, without: tuple[str, ...] = ()) -> str:
    return trial_refusal(*args, model="builtin:gpt2-tiny", without=without)


@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2():
    refusal = _refusal("--global-batch", "16", "--micro-batch", "4", "--optimizer-in-backward", "on")
    assert "4 accumulation steps" in refusal and "use --micro-batch 16" in refusal
    assert "before DDP has averaged" in _refusal("--nproc", "2", "--micro-batch", "8", "--optimizer-in-backward", "on")
    assert "loss scaling" in _refusal("--micro-batch", "16", "--precision", "fp16", "--optimizer-in-backward", "on")
    assert "DeepSpeed builds and steps its own" in _refusal("--optimizer", "adafactor", "--zero-stage", "2")
    assert "is not known; use one of adamw, adamw-8bit, adafactor" in _refusal("--optimizer", "lion")
    assert "fused is PyTorch AdamW's kernel" in _refusal("--optimizer", "adafactor", "--fused-optimizer", "on")


@pytest.mark.slow
def test_adamw_8bit_without_a_library_names_the_packages_to_install():
    # A Python where neither torchao nor bitsandbytes can be found, as on a machine without them.
    refusal = _refusal("--optimizer", "adamw-8bit", without=("torchao", "bitsandbytes"))
    assert "pip install torchao" in refusal and "bitsandbytes" in refusal


LEAN_FULL_FINE_TUNING = """\
description: the lean space's optimizer levers, full fine-tuning only
n_trials: 12
knobs:
  micro_batch: [1]
  precision: [fp32]
  optimizer: [adamw, adamw-8bit, adafactor]
  optimizer_in_backward: [false, true]
"""


@pytest.mark.slow
@pytest.mark.usefixtures("_fresh_accelerate_state")
def test_find_answers_with_a_lean_optimizer_where_adamw_does_not_fit_and_its_export_trains(tmp_path):
    from transformers import Trainer, TrainingArguments

    from autotune.models.batches import synthetic_batch
    from autotune.models.sources import build_model

    # 10 MiB: plain AdamW (14.1 MiB), 8-bit (13.6) and AdamW inside backward (12.0) run out; Adafactor fits.
    (tmp_path / "lean.yaml").write_text(LEAN_FULL_FINE_TUNING)
    args = ["--model", "builtin:gpt2-tiny", "--seq-len", "16", "--global-batch", "1", "--memory-budget", "10MiB"]
    proc = commands.autotune("find", *args, "--space", "lean.yaml", "--json", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    import json

    answer = json.loads(proc.stdout)
    best = TrialConfig.from_dict(answer["best"]["config"])
    assert best.optimizer == "adafactor", best.describe()
    statuses = {
        t["config"]["optimizer"]: t["status"] for t in answer["trials"] if not t["config"]["optimizer_in_backward"]
    }
    assert statuses.get("adamw") in (None, "oom", "skipped"), statuses  # never an answer: it does not fit
    if best.optimizer_in_backward:
        return  # the Trainer has no step inside backward: the hf export refuses it (test_bad_input covers it)
    export = commands.autotune(
        "export", "--study", answer["study"], "--format", "hf", "-o", "hf.json", cwd=tmp_path, timeout=300
    )
    assert export.returncode == 0, export.stderr
    kwargs = json.loads((tmp_path / "hf.json").read_text())
    assert kwargs["optim"] == "adafactor"
    workload = Workload(model="builtin:gpt2-tiny", seq_len=16, global_batch=1)
    model = build_model(workload, task="causal-lm", device=torch.device("cpu"))
    batch = synthetic_batch(model, task="causal-lm", micro_batch=1, seq_len=16, device=torch.device("cpu"))
    sample = {k: v[0] for k, v in batch.items()}
    training = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, report_to=[], **kwargs)
    trainer = Trainer(model=model, args=training, train_dataset=[sample])
    assert type(trainer.create_optimizer()).__name__ == "Adafactor"
    assert trainer.train().global_step == 1
