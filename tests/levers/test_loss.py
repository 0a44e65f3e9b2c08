"""The chunked losses: the same loss and gradients as the model's own, without the full logits in fp32."""

from __future__ import annotations

import re
import subprocess
import sys

import commands
import pytest
import torch

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.estimate.client import predict_memory
from autotune.levers import LORA
from autotune.levers.loss import chunk_loss, chunked_loss_refusal, plain_loss
from autotune.models.sources import build_model
from autotune.prepare.workload_facts import WorkloadFacts
from autotune.search.presets import load_space
from autotune.trial.runner import run_trial

VOCAB_32K = Workload(model="builtin:llama-tiny-32k", seq_len=128, global_batch=8)


def _loss_and_grads(model_name: str, loss: str, *, lora: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    workload = Workload(model=model_name, seq_len=32, global_batch=4)
    torch.manual_seed(0)
    model = build_model(workload, task="causal-lm", device=torch.device("cpu"))
    if lora:
        model = LORA.adapt(model, TrialConfig(lora_rank=4), WorkloadFacts(workload, task="causal-lm", built=model))
    config = TrialConfig(micro_batch=4, loss=loss)
    if config.loss_chunks is not None:
        chunk_loss(model, config.loss_chunks, keep_logits=config.loss_keeps_logits)
    elif loss == "plain":
        plain_loss(model)
    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "model_name,lora", [("builtin:llama-tiny", False), ("builtin:gpt2-tiny", False), ("builtin:gpt2-tiny", True)]
)
def test_the_chunked_loss_and_its_gradients_are_the_models_own(model_name, lora):
    # GPT-2 ties its LM head to the embeddings; under LoRA the head sits inside PEFT's wrapper.
    standard, grads = _loss_and_grads(model_name, "standard", lora=lora)
    # 3 slices do not divide the 128 tokens evenly
    for loss in ("chunked", "chunked:3", "chunked-kept", "chunked-kept:3"):
        chunked, chunked_grads = _loss_and_grads(model_name, loss, lora=lora)
        assert chunked == pytest.approx(standard, abs=5e-4)
        assert chunked_grads.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _down_to_the_head(loss: torch.Tensor) -> list[str]:
    """The backward's nodes from the loss to the LM head's matmul, along their first inputs."""
    names, node = [], loss.grad_fn
    while node is not None and node.name() != "MmBackward0":
        names.append(node.name())
        node = node.next_functions[0][0]
    return names


def test_the_plain_loss_is_the_models_own_in_fp32_and_its_logits_type_in_bf16():
    standard, grads = _loss_and_grads("builtin:llama-tiny", "standard")
    plain, plain_grads = _loss_and_grads("builtin:llama-tiny", "plain")
    assert plain == pytest.approx(standard, abs=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(plain_grads[name], grad, msg=name)
    # In bf16 it keeps bf16 log-probabilities (no fp32 upcast), and holds the logits until the next call.
    model = build_model(Workload(model="builtin:llama-tiny", seq_len=32), task="causal-lm", device=torch.device("cpu"))
    model = model.to(torch.bfloat16)
    ids = torch.randint(0, 512, (2, 32))
    assert "ToCopyBackward0" in _down_to_the_head(model(input_ids=ids, labels=ids).loss)  # Transformers' upcast
    plain_loss(model)
    loss = model(input_ids=ids, labels=ids).loss
    assert loss.dtype == torch.bfloat16 and "ToCopyBackward0" not in _down_to_the_head(loss)
    held = model.loss_function.held
    assert held.dtype == torch.bfloat16 and held.shape == (2, 32, model.config.vocab_size)
    model(input_ids=ids, labels=ids)
    assert model.loss_function.held is not held


@pytest.mark.slow  # three real trials and three estimates: ~45 s on a busy 2-core machine
def test_chunked_loss_cuts_the_measured_peak_of_a_32k_vocabulary_and_the_estimator_predicts_both():
    peaks = {}
    for loss in ("standard", "chunked", "chunked-kept"):
        config = TrialConfig(micro_batch=8, loss=loss)
        result = run_trial(VOCAB_32K, config, measure_steps=1)
        assert result.ok, result.error
        estimate = predict_memory(VOCAB_32K, config)
        assert estimate.predicted_peak_bytes == pytest.approx(result.peak_memory_bytes, rel=0.05)
        peaks[loss] = result.peak_memory_bytes
    assert peaks["chunked"] <= 0.6 * peaks["standard"]  # the logits (8 x 128 x 32k, fp32) and their gradient
    # Keeping the slices' logits (fp32 here: the model computes in fp32) costs them once, not the
    # standard loss's logits, log-softmax and gradient together.
    assert peaks["chunked"] < peaks["chunked-kept"] < peaks["standard"]


def test_the_chunked_loss_is_refused_where_it_means_nothing():
    bert = Workload(model="builtin:bert-tiny")
    assert "causal LM" in chunked_loss_refusal(WorkloadFacts(bert, task="seq-cls"))
    assert "factory" in chunked_loss_refusal(WorkloadFacts(Workload(model="factories:tiny"), task="causal-lm"))
    assert chunked_loss_refusal(WorkloadFacts(VOCAB_32K, task="causal-lm")) is None
    with pytest.raises(ConfigError, match="--loss chunked is a causal LM's loss"):
        run_trial(bert, TrialConfig(loss="chunked"))
    with pytest.raises(ConfigError, match="no lm_head and loss_function"):
        chunk_loss(torch.nn.Linear(2, 2))
    for bad in ("chunky", "chunked:1", "chunked:x", "chunked-kept:1", "kept", 8):
        with pytest.raises(ConfigError, match="--loss"):
            TrialConfig(loss=bad)


def test_a_space_searches_the_loss_where_it_applies_and_says_where_not(tmp_path):
    from autotune.config.device import detect_device

    cpu = detect_device("cpu")
    full = load_space("full")
    assert set(full.choices(VOCAB_32K, cpu)["loss"]) == {"standard", "chunked"}
    bert = Workload(model="builtin:bert-tiny")
    assert full.choices(bert, cpu)["loss"] == ("standard",)
    assert any(
        line.startswith("loss chunked: --loss chunked is a causal LM's loss") for line in full.dropped_knobs(bert, cpu)
    )
    # A space without the knob is the space it was before the knob existed: its studies still resume.
    (tmp_path / "old.yaml").write_text("knobs:\n  micro_batch: [1, 2]\n")
    (tmp_path / "same.yaml").write_text("knobs:\n  micro_batch: [1, 2]\n  loss: [standard]\n")
    assert load_space(tmp_path / "old.yaml").digest == load_space(tmp_path / "same.yaml").digest
    old_config = TrialConfig(micro_batch=2).to_dict()
    del old_config["loss"]  # as stored before the knob
    assert TrialConfig.from_dict(old_config) == TrialConfig(micro_batch=2)


@pytest.mark.slow
def test_exports_say_how_to_apply_the_chunked_loss(tmp_path):
    from autotune.output.exporters import export_config

    config = TrialConfig(micro_batch=8, loss="chunked:16")
    assert config.describe() == "mb=8 fp32 chunked-loss:16"
    header = export_config(config, VOCAB_32K, fmt="yaml", device_type="cpu")
    line = re.search(r"`(model = autotune\.prepare\(.*?\))`", header)
    assert line is not None, header
    assert '"loss": "chunked:16"' in export_config(config, VOCAB_32K, fmt="json", device_type="cpu")
    # The line in the header is code a job can run: it trains the model the trials measured.
    code = (
        "import torch, autotune; from autotune.config.workload import Workload; from autotune.models.sources import "
        "build_model\n"
        "model = build_model(Workload(model='builtin:llama-tiny-32k'), task='causal-lm', device=torch.device('cpu'))\n"
        f"{line.group(1)}\n"
        "assert type(model.loss_function).__name__ == '_ChunkedCrossEntropy'\n"
        "ids = torch.randint(0, 32000, (2, 16)); model(input_ids=ids, labels=ids).loss.backward()\n"
        "print('trained')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "trained", proc.stderr[-1000:]
    kept = TrialConfig(micro_batch=8, loss="chunked-kept")
    assert kept.describe() == "mb=8 fp32 chunked-kept-loss"
    assert 'autotune.prepare(model, loss="chunked-kept:8")' in export_config(
        kept, VOCAB_32K, fmt="yaml", device_type="cpu"
    )


@pytest.mark.slow  # a real find: 2 trials and a confirmation, ~40 s on a busy 2-core machine
def test_find_picks_the_chunked_loss_where_the_standard_loss_does_not_fit(tmp_path):
    import json

    # Predicted peaks (exact on this CPU) at seq 64: standard 230/296 MiB at mb 4/8, chunked
    # 183/162 MiB; the limit is 210 MiB less 10% headroom = 189 MiB, so only the chunked loss fits.
    (tmp_path / "space.yaml").write_text(
        "knobs:\n  micro_batch: [4, 8]\n  precision: [fp32]\n  checkpointing: [false]\n  loss: [standard, chunked]\n"
    )
    proc = commands.autotune(
        "find",
        "--model",
        "builtin:llama-tiny-32k",
        "--seq-len",
        "64",
        "--global-batch",
        "8",
        "--space",
        "space.yaml",
        "--steps",
        "1",
        "--memory-budget",
        "210MiB",
        "--export",
        "yaml",
        "-o",
        "job.yaml",
        "--json",
        cwd=tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    best = result["best"]
    assert best["config"]["loss"] == "chunked"
    assert best["peak_memory_bytes"] <= 189 * 2**20  # what the confirmation measured
    assert all(t["config"]["loss"] == "chunked" for t in result["trials"] if t["status"] == "ok")
    assert 'autotune.prepare(model, loss="chunked:8")' in (tmp_path / "job.yaml").read_text()


def test_the_kept_logits_stay_where_they_are_under_outer_saved_tensor_hooks():
    # Activation offload is such a pair of hooks around the forward: the slices' logits, which the backward
    # needs first, are not handed to it (torchtune's offload leaves its head and loss out likewise).
    workload = Workload(model="builtin:llama-tiny", seq_len=32, global_batch=4)
    model = build_model(workload, task="causal-lm", device=torch.device("cpu"))
    chunk_loss(model, 4, keep_logits=True)
    vocab = model.config.vocab_size
    packed: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tuple(tensor.shape))
        return tensor

    ids = torch.randint(0, vocab, (4, 32), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert packed, "the layers' activations go to the outer hooks"
    assert not any(shape and shape[-1] == vocab for shape in packed)


def test_the_kept_logits_loss_is_the_same_worked_on_blocks_of_rows(monkeypatch):
    # Its fp32 work runs a block of rows at a time; blocks of 5 rows split each slice unevenly.
    import autotune.levers.loss as loss_module

    standard, grads = _loss_and_grads("builtin:llama-tiny", "standard")
    monkeypatch.setattr(loss_module, "_FP32_BLOCK_BYTES", 5 * 4 * 512)
    kept, kept_grads = _loss_and_grads("builtin:llama-tiny", "chunked-kept")
    assert kept == pytest.approx(standard, abs=5e-4)
    for name, grad in grads.items():
        torch.testing.assert_close(kept_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
