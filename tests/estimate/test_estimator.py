"""The estimator against the CPU tracker: predicted peaks of real trials' configs, two architectures.

Estimates run as the tuner runs them: each in a fresh process (``predict_memory``)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.client import predict_memory
from autotune.estimate.results import MemoryEstimate
from autotune.estimate.zero_states import ZERO3_MAX_LIVE_PARAMETERS, zero_model_states
from autotune.trial.runner import run_trial

CASES = [
    ("builtin:gpt2-deep-tiny", 1, TrialConfig(micro_batch=2)),
    ("builtin:gpt2-deep-tiny", 1, TrialConfig(micro_batch=8, checkpointing=True)),
    ("builtin:llama-tiny", 1, TrialConfig(micro_batch=4, lora_rank=8)),
    ("builtin:llama-tiny", 1, TrialConfig(micro_batch=4, precision="bf16", checkpointing=True)),
    # selective checkpointing: what it keeps and what its backward reruns, through the trace's own policy
    (
        "builtin:llama-tiny",
        1,
        TrialConfig(micro_batch=4, precision="bf16", checkpointing=True, checkpoint_selective=True),
    ),
    ("builtin:gpt2-deep-tiny", 1, TrialConfig(micro_batch=8, checkpointing=True, checkpoint_selective=True)),
    # float8 Linear layers (torchao): their casts and what the float8 matmuls keep
    ("builtin:llama-tiny", 1, TrialConfig(micro_batch=4, precision="bf16", float8=True)),
    ("builtin:bert-tiny", 1, TrialConfig(micro_batch=4)),
    ("builtin:bert-tiny", 1, TrialConfig(micro_batch=4, checkpointing=True)),
    ("builtin:bert-tiny", 1, TrialConfig(micro_batch=4, lora_rank=8)),
    ("builtin:bert-mlm-tiny", 1, TrialConfig(micro_batch=4)),
    ("builtin:bert-mlm-tiny", 1, TrialConfig(micro_batch=4, checkpointing=True)),
    ("builtin:bert-mlm-tiny", 1, TrialConfig(micro_batch=4, lora_rank=8)),
    ("builtin:t5-tiny", 1, TrialConfig(micro_batch=4)),
    ("builtin:t5-tiny", 1, TrialConfig(micro_batch=4, checkpointing=True)),
    ("builtin:t5-tiny", 1, TrialConfig(micro_batch=4, lora_rank=8, precision="bf16")),
    ("builtin:vit-tiny", 1, TrialConfig(micro_batch=8)),
    ("builtin:vit-tiny", 1, TrialConfig(micro_batch=8, checkpointing=True)),
    ("builtin:vit-tiny", 1, TrialConfig(micro_batch=8, lora_rank=8)),
    ("builtin:resnet-tiny", 1, TrialConfig(micro_batch=8, precision="bf16")),
    ("factories:convnet", 1, TrialConfig(micro_batch=8)),
    # Two real ranks: DDP's buckets, and DeepSpeed's own ZeRO optimizer against the arithmetic.
    ("builtin:llama-tiny", 2, TrialConfig(micro_batch=2)),
    ("builtin:llama-tiny", 2, TrialConfig(micro_batch=2, precision="bf16", zero_stage=2)),
    ("builtin:gpt2-deep-tiny", 2, TrialConfig(micro_batch=2, zero_stage=3)),
]


# The two-rank cases start two ranks and DeepSpeed: in the slow part.
@pytest.mark.parametrize(
    "model, nproc, config",
    [pytest.param(*case, marks=[pytest.mark.slow] if case[1] > 1 else []) for case in CASES],
    ids=[f"{m}-n{n}-{c.describe()}" for m, n, c in CASES],
)
def test_predicted_peak_is_within_5_percent_of_the_measured_one(model, nproc, config):
    workload = Workload(model=model, seq_len=64, global_batch=8, nproc=nproc)
    predicted = predict_memory(workload, config)
    measured = run_trial(workload, config, warmup_steps=1, measure_steps=1)
    assert measured.ok, measured.error
    error = predicted.predicted_peak_bytes / measured.peak_memory_bytes - 1
    assert abs(error) <= 0.05, (predicted.to_dict(), measured.peak_memory_bytes)
    assert sum(predicted.parts().values()) == predicted.predicted_peak_bytes and predicted.overhead_bytes is None


def test_checkpointed_layers_keep_no_mask_that_the_real_step_skips():
    # Transformers skips the causal mask for unpacked rows, which it cannot see on fake tensors (was +0.8%).
    workload = Workload(model="builtin:llama-tiny", seq_len=256, global_batch=8)
    config = TrialConfig(micro_batch=8, checkpointing=True)
    predicted = predict_memory(workload, config)
    measured = run_trial(workload, config, warmup_steps=1, measure_steps=1)
    assert measured.ok, measured.error
    assert abs(predicted.predicted_peak_bytes / measured.peak_memory_bytes - 1) <= 0.002


def test_model_states_of_a_traced_step():
    workload = Workload(model="builtin:gpt2-tiny", seq_len=32, global_batch=8)
    full = predict_memory(workload, TrialConfig(micro_batch=4))
    params = full.parameters_bytes // 4  # fp32
    assert full.gradients_bytes == 4 * params and full.optimizer_state_bytes == 8 * params  # Adam m + v
    lora = predict_memory(workload, TrialConfig(micro_batch=4, lora_rank=8))
    assert lora.gradients_bytes < full.gradients_bytes / 20  # only the adapters train
    ddp = predict_memory(workload.replace(nproc=2), TrialConfig(micro_batch=4))
    assert ddp.gradients_bytes == 2 * full.gradients_bytes  # DDP's buckets copy every gradient


PARTS_CASES = [  # one micro-step per optimizer step: the peak falls inside the backward
    ("builtin:gpt2-deep-tiny", 1, TrialConfig(micro_batch=8)),  # whole states + activations were 0.2% over the peak
    ("builtin:bert-tiny", 1, TrialConfig(micro_batch=8, precision="bf16")),  # 1.6% over
    ("builtin:gpt2-deep-tiny", 1, TrialConfig(micro_batch=8, checkpointing=True)),
    ("builtin:llama-tiny", 1, TrialConfig(micro_batch=8, lora_rank=8, precision="bf16")),
    ("builtin:llama-tiny", 2, TrialConfig(micro_batch=4)),
    ("builtin:llama-tiny", 2, TrialConfig(micro_batch=4, precision="bf16", zero_stage=2, checkpointing=True)),
    ("builtin:gpt2-deep-tiny", 2, TrialConfig(micro_batch=4, zero_stage=3)),
]


@pytest.mark.parametrize(
    "model, nproc, config", PARTS_CASES, ids=[f"{m}-n{n}-{c.describe()}" for m, n, c in PARTS_CASES]
)
def test_the_parts_add_up_to_the_peak_as_live_at_that_moment(model, nproc, config):
    workload = Workload(model=model, seq_len=128, global_batch=8 * nproc, nproc=nproc)
    estimate = predict_memory(workload, config)
    parts = estimate.parts()
    assert sum(parts.values()) == estimate.predicted_peak_bytes, parts
    assert estimate.activations_bytes >= 0 and estimate.temporaries_bytes >= 0, parts
    assert estimate.not_live_at_peak_bytes <= 0, parts
    if config.checkpointing and nproc == 1:  # peaks in the backward's recomputation, before the last gradients
        assert estimate.not_live_at_peak_bytes < 0, parts


def test_an_estimate_stored_before_the_parts_added_up_loads_with_the_remainder_named():
    stored = {
        "config": TrialConfig(micro_batch=2).to_dict(),
        "describe": "mb=2 fp32",
        "predicted_peak_bytes": 1000,
        "parameters_bytes": 300,
        "gradients_bytes": 300,
        "optimizer_state_bytes": 400,
        "activations_bytes": 200,
        "temporaries_bytes": 0,
        "overhead_bytes": None,
        "method": "fake-tensor training step",
        "seconds": 1.0,
    }
    estimate = MemoryEstimate.from_dict(stored)
    assert estimate.not_live_at_peak_bytes == -200 and sum(estimate.parts().values()) == 1000
    assert MemoryEstimate.from_dict(estimate.to_dict()) == estimate


def test_a_cpu_workload_is_traced_with_cpu_kernels():
    estimate = predict_memory(
        Workload(model="builtin:gpt2-tiny", seq_len=32, global_batch=4, device="cpu"), TrialConfig(micro_batch=4)
    )
    assert estimate.traced_device == "cpu" and estimate.device_note is None


ATTENTION_CASES = [  # CUDA would run: flash (16-bit, no mask), memory-efficient (fp32), flash for an encoder
    ("builtin:gpt2-deep-tiny", TrialConfig(micro_batch=4, precision="bf16")),
    ("builtin:gpt2-deep-tiny", TrialConfig(micro_batch=4)),
    ("builtin:bert-tiny", TrialConfig(micro_batch=4, precision="bf16", checkpointing=True)),
]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a GPU here traces on fake CUDA tensors (tests/test_estimator_gpu.py)"
)
@pytest.mark.parametrize("model, config", ATTENTION_CASES, ids=[f"{m}-{c.describe()}" for m, c in ATTENTION_CASES])
def test_a_cuda_workload_without_a_gpu_keeps_no_attention_scores_and_says_so(model, config):
    cpu = Workload(model=model, seq_len=256, global_batch=4, device="cpu")
    on_cpu = predict_memory(cpu, config)
    on_cuda = predict_memory(cpu.replace(device="cuda"), config)
    assert on_cuda.traced_device == "cpu" and "no CUDA GPU here" in on_cuda.device_note
    assert sum(on_cuda.parts().values()) == on_cuda.predicted_peak_bytes
    # The CPU's attention with dropout keeps the s x s scores per head and layer (fp32 at least); CUDA's does not.
    layers, heads = (6, 4) if "gpt2" in model else (2, 4)
    scores = layers * config.micro_batch * heads * 256**2 * 4
    if not config.checkpointing:  # checkpointing keeps no layer's scores: only the peak's layer's, recomputed
        assert on_cuda.activations_bytes <= on_cpu.activations_bytes - scores
    assert on_cuda.predicted_peak_bytes < on_cpu.predicted_peak_bytes - 256**2 * 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU here traces on fake CUDA tensors")
def test_cuda_attention_is_the_kernel_cuda_picks():
    # Llama: grouped-query attention, no mask, no attention dropout. bf16: CUDA runs flash, which keeps
    # what the CPU's fused kernel keeps. fp32: flash takes no fp32 and PyTorch 2.13's memory-efficient
    # kernel no grouped heads, so CUDA runs math attention, which keeps the s x s weights.
    workload = Workload(model="builtin:llama-tiny", seq_len=128, global_batch=4, device="cpu")
    on_cuda = {}
    for precision in ("fp32", "bf16"):
        config = TrialConfig(micro_batch=4, precision=precision)
        on_cpu = predict_memory(workload, config).predicted_peak_bytes
        on_cuda[precision] = predict_memory(workload.replace(device="cuda"), config)
        if precision == "bf16":
            assert abs(on_cuda[precision].predicted_peak_bytes / on_cpu - 1) < 0.001, (on_cpu, on_cuda)
        else:  # at least one layer's fp32 weights more: micro batch x heads x seq x seq x 4 bytes
            assert on_cuda[precision].predicted_peak_bytes - on_cpu >= 4 * 4 * 128 * 128 * 4
    assert on_cuda["bf16"].attention_kernels == {"flash": 2} and on_cuda["fp32"].attention_kernels == {"math": 2}


PSI = 1_000_000  # parameters, all trainable
MODEL = SimpleNamespace(total_params=PSI, trainable_params=PSI)


@pytest.mark.parametrize(
    "stage, precision, offload, on_cpu, expected",
    [
        # (parameters, gradients, optimizer state, step-time extra) in bytes per parameter, 8 ranks
        (1, "bf16", "none", False, (2, 2, 12 / 8, 4 / 8)),
        (2, "bf16", "none", False, (2, 2 / 8, 12 / 8, 4 / 8)),  # DeepSpeed's 2 + 18/N at the step
        (3, "bf16", "none", False, (2 / 8, 2 / 8, 12 / 8, 4 / 8)),
        (2, "fp32", "none", False, (4, 4 / 8, 12 / 8, 0)),  # the fp32 master is a clone even in fp32
        (2, "bf16", "optimizer", False, (2, 2 / 8, 0, 0)),
        (3, "bf16", "optimizer+params", False, (0, 2 / 8, 0, 0)),
        (2, "bf16", "optimizer", True, (2, 2 / 8, (12 + 2 + 4) / 8, 4 / 8)),  # a CPU device keeps it all
    ],
)
def test_zero_model_states_follow_deepspeed(stage, precision, offload, on_cpu, expected):
    config = TrialConfig(micro_batch=1, precision=precision, zero_stage=stage, offload=offload)
    states = zero_model_states(MODEL, config, 8, offload_stays=on_cpu)
    assert states == tuple(int(b * PSI) for b in expected)


def test_zero3_keeps_deepspeeds_live_parameter_default():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert DeepSpeedZeroConfig().max_live_parameters == ZERO3_MAX_LIVE_PARAMETERS


def _estimate_command(capfd, *args: str) -> subprocess.CompletedProcess[str]:
    """`autotune estimate ARGS` through the CLI's entry point (autotune.cli.main, what `python -m autotune` runs) in
    this process, whose estimate server the other tests here started already: a new interpreter paid its imports and
    a server of its own (~5 s) twice here. `autotune estimate` as a real process: tests/models/test_model_cli.py."""
    from autotune.cli import main

    capfd.readouterr()
    code = main(["estimate", *args])
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["autotune", "estimate", *args], code, out, err)


@pytest.mark.slow
def test_estimate_command_json_lines(capfd):
    proc = _estimate_command(
        capfd,
        "--model",
        "builtin:gpt2-tiny",
        "--seq-len",
        "32",
        "--micro-batch",
        "4",
        "--memory-budget",
        "8MiB",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert {
        "config",
        "predicted_peak_bytes",
        "parameters_bytes",
        "gradients_bytes",
        "optimizer_state_bytes",
        "activations_bytes",
        "temporaries_bytes",
        "traced_device",
        "device_note",
    } <= result.keys()
    assert result["fits"] is False and result["predicted_peak_bytes"] > 8 * 2**20
    parts = (
        "parameters_bytes",
        "gradients_bytes",
        "optimizer_state_bytes",
        "activations_bytes",
        "temporaries_bytes",
        "not_live_at_peak_bytes",
    )
    assert sum(result[k] for k in parts) == result["predicted_peak_bytes"]


@pytest.mark.slow
def test_estimate_command_table_adds_up(capfd):
    proc = _estimate_command(
        capfd,
        "--model",
        "builtin:gpt2-deep-tiny",
        "--seq-len",
        "64",
        "--global-batch",
        "8",
        "--micro-batch",
        "8",
        "--checkpointing",
        "on",
    )
    assert proc.returncode == 0, proc.stderr
    header, row = proc.stdout.splitlines()[:2]
    assert header.split()[-9:] == [
        "params",
        "grads",
        "optimizer",
        "activations",
        "temporaries",
        "not",
        "live",
        "step",
        "tokens/s",
    ]
    assert row.split()[5] == "=" and row.split()[-5].startswith("-")  # the negative part, shown
    assert row.split()[-2] == "s" and float(row.split()[-3]) > 0  # the step predicted on this CPU, probed
    assert proc.stdout.splitlines()[-2] == "traced with CPU kernels"
    assert "timed against this CPU" in proc.stdout.splitlines()[-1]


@pytest.mark.slow
def test_the_traced_step_counts_its_flops_and_checkpointing_s_recompute():
    """FLOPs per sample: 6 x matmul weights x tokens plus attention's 2 x 6 x layers x s^2 x d,
    the textbook count, exactly; checkpointing every layer adds one more forward of the layers."""

    workload = Workload(model="builtin:gpt2-deep-tiny", seq_len=128, global_batch=8)
    plain = predict_memory(workload, TrialConfig(micro_batch=2)).flops_per_sample
    layers, d, s, vocab = 6, 128, 128, 512  # the preset's shape
    weights = layers * 12 * d * d + vocab * d  # attention (4 d^2) and MLP (8 d^2) per layer, and the LM head
    assert plain == 6 * weights * s + 12 * layers * s * s * d
    assert predict_memory(workload, TrialConfig(micro_batch=4)).flops_per_sample == plain  # per sample
    recompute = predict_memory(workload, TrialConfig(micro_batch=2, checkpointing=True)).flops_per_sample - plain
    assert recompute == 2 * layers * (12 * d * d * s + 2 * s * s * d)  # one forward of every layer again


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_a_cuda_estimate_with_activation_offload_keeps_the_saved_activations_on_the_host(checkpointing):
    # A causal LM whose activations outweigh its model states (seq 512, 8 samples), traced for an A100.
    workload = Workload(model="builtin:llama-tiny", seq_len=512, global_batch=8, device="cuda", gpu="A100-80GB")
    config = TrialConfig(micro_batch=8, precision="bf16", checkpointing=checkpointing)
    kept = predict_memory(workload, config)
    moved = predict_memory(workload, config.replace(activation_offload=True))
    assert moved.predicted_peak_bytes < kept.predicted_peak_bytes
    # The allocator reserves in segments (2 MiB, 20 MiB, ...): on a model this small, the same ones, or fewer.
    assert moved.predicted_reserved_bytes <= kept.predicted_reserved_bytes
    assert moved.predicted_device_bytes <= kept.predicted_device_bytes
    # What the forward saved is on the host at the peak (tensors under 1 KiB stay); what the backward copies
    # back, one node's inputs at a time, is among the temporaries; the model states do not move.
    assert moved.activations_bytes < 0.01 * kept.activations_bytes, (moved.to_dict(), kept.to_dict())
    assert moved.temporaries_bytes >= kept.temporaries_bytes
    assert moved.parameters_bytes + moved.optimizer_state_bytes == kept.parameters_bytes + kept.optimizer_state_bytes
    assert sum(moved.parts().values()) == moved.predicted_peak_bytes


def test_activation_offload_is_refused_for_a_cpu_workloads_estimate():
    with pytest.raises(Exception, match="--activation-offload on .* on a cpu device"):
        predict_memory(Workload(model="builtin:llama-tiny", device="cpu"), TrialConfig(activation_offload=True))


@pytest.mark.parametrize("in_backward", [False, True], ids=["step-after", "step-in-bwd"])
@pytest.mark.slow
def test_on_cuda_the_8_bit_step_is_one_kernel_like_fused_adamw(in_backward):
    # Model states set the peak here (one sample of 16 tokens): the optimizer step's temporaries show.
    cuda = Workload(model="builtin:gpt2-tiny", seq_len=16, global_batch=1, device="cuda", gpu="A100-80GB")
    fused = predict_memory(cuda, TrialConfig(fused_optimizer=True, optimizer_in_backward=in_backward))
    eight_bit = predict_memory(cuda, TrialConfig(optimizer="adamw-8bit", optimizer_in_backward=in_backward))
    # bitsandbytes' kernel and torchao's compiled step allocate nothing but their state, as fused AdamW: the same
    # step but for the state's bytes (the trace runs torchao's step eagerly, its temporaries left out).
    assert eight_bit.optimizer_state_bytes < fused.optimizer_state_bytes / 3
    # (but for the step counters' scalars, which each optimizer keeps in its own way).
    without_state = eight_bit.predicted_peak_bytes - eight_bit.optimizer_state_bytes
    assert without_state == pytest.approx(fused.predicted_peak_bytes - fused.optimizer_state_bytes, abs=256)
    # On a CPU the trial steps torchao's AdamW8bit eagerly (tests/trial/test_optimizers.py measures it): kept there.
    on_cpu = predict_memory(cuda.replace(device="cpu", gpu=None), eight_bit.config)
    assert on_cpu.temporaries_bytes > eight_bit.temporaries_bytes


@pytest.mark.slow
def test_a_trace_without_adapters_leaves_peft_unimported():
    # The estimate server imports PEFT only before a trace that may make adapters (LoRA's, a factory's):
    # a trace without them must not import it in every forked estimate instead.
    code = (
        "import sys\n"
        "from autotune.config.knobs import TrialConfig\n"
        "from autotune.config.workload import Workload\n"
        "from autotune.estimate.trace import estimate_memory, may_hold_adapters\n"
        "w = Workload(model='builtin:gpt2-tiny', seq_len=32, global_batch=4)\n"
        "estimate_memory(w, TrialConfig(micro_batch=2, checkpointing=True))\n"
        "print('peft' in sys.modules)\n"
        "factory, plain = w.replace(model='factories:tiny'), TrialConfig(micro_batch=2)\n"
        "print(may_hold_adapters(w, plain.replace(lora_rank=4)), may_hold_adapters(factory, plain))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["False", "True", "True"], out.stderr[-2000:]


@pytest.mark.slow
def test_a_trace_after_the_servers_preloads_imports_no_transformers_module():
    # The estimate server imports a model's module, the tracer's and an optimizer's library before it forks a
    # trace; each forked trace imported them again before (1.6 of a tiny model's 2.0 s estimate).
    code = (
        "import sys\n"
        "from autotune.config.knobs import TrialConfig\n"
        "from autotune.config.workload import Workload\n"
        "from autotune.estimate.trace import prepare_tracing, trace_step\n"
        "from autotune.estimate.worker import _preload_for\n"
        "w = Workload(model='builtin:gpt2-tiny', seq_len=32, global_batch=4)\n"
        "config = TrialConfig(micro_batch=2, optimizer='adafactor')\n"
        "prepare_tracing(); _preload_for(w, config)\n"
        "before = set(sys.modules)\n"
        "trace_step(w, config)\n"
        "new = set(sys.modules) - before\n"
        "print(sorted(m for m in new if m.startswith(('transformers', 'torch.distributed.tensor'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["[]"], (out.stdout, out.stderr[-2000:])


@pytest.mark.slow
def test_where_a_gpu_is_visible_the_estimate_server_leaves_peft_and_optimizer_libraries_to_the_traces():
    # bitsandbytes (under PEFT and Adafactor's module) initialises CUDA as it imports: a trace forked after that
    # could not run on fake CUDA tensors. The model's module is imported still.
    code = (
        "import sys, torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "from autotune.config.knobs import TrialConfig\n"
        "from autotune.config.workload import Workload\n"
        "from autotune.estimate.worker import _preload_for\n"
        "w = Workload(model='builtin:gpt2-tiny', seq_len=32, global_batch=4)\n"
        "_preload_for(w, TrialConfig(micro_batch=2, optimizer='adafactor', lora_rank=8))\n"
        "print('transformers.models.gpt2.modeling_gpt2' in sys.modules, 'peft' in sys.modules,\n"
        "      'transformers.optimization' in sys.modules, 'bitsandbytes' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["True", "False", "False", "False"], (out.stdout, out.stderr[-2000:])
