"""The fit rule of an estimate (autotune.estimate.fit): the limit the headroom leaves, reserved bytes on
CUDA (live tensors on a CPU) within it, and on a named card what nvidia-smi shows within its memory."""

from __future__ import annotations

import pytest

from autotune.config.device import DeviceInfo
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.estimate.fit import card_budget, estimate_fits, estimated_device, memory_limit
from autotune.estimate.results import MemoryEstimate

MiB = 2**20
CARD = Workload(model="builtin:gpt2-tiny", device="cuda", gpu="H100-80GB")
HERE = Workload(model="builtin:gpt2-tiny", device="cpu")


def _estimate(peak: int, *, reserved: int | None = None, shown: int | None = None) -> MemoryEstimate:
    return MemoryEstimate(
        config=TrialConfig(),
        predicted_peak_bytes=peak,
        parameters_bytes=peak,
        gradients_bytes=0,
        optimizer_state_bytes=0,
        activations_bytes=0,
        temporaries_bytes=0,
        overhead_bytes=None,
        method="test",
        seconds=0.0,
        predicted_reserved_bytes=reserved,
        predicted_device_bytes=shown,
    )


def test_the_limit_is_the_budget_less_the_headroom() -> None:
    assert memory_limit(1000 * MiB, 0.1) == 900 * MiB
    assert memory_limit(None, 0.1) is None


def test_no_limit_says_nothing_of_the_fit() -> None:
    assert estimate_fits(_estimate(10 * MiB), limit_bytes=None, workload=HERE, device=None) is None


def test_a_cpu_estimate_fits_on_its_live_tensors() -> None:
    assert estimate_fits(_estimate(100 * MiB), limit_bytes=100 * MiB, workload=HERE, device=None) is True
    assert estimate_fits(_estimate(100 * MiB + 1), limit_bytes=100 * MiB, workload=HERE, device=None) is False


def test_a_cuda_estimate_fits_on_what_the_allocator_reserves() -> None:
    estimate = _estimate(10 * MiB, reserved=120 * MiB)
    assert estimate_fits(estimate, limit_bytes=100 * MiB, workload=HERE, device=None) is False
    assert estimate_fits(estimate, limit_bytes=120 * MiB, workload=HERE, device=None) is True


def test_on_a_named_card_what_nvidia_smi_shows_must_fit_its_memory_too() -> None:
    card = estimated_device(CARD)
    assert card is not None and card.total_memory_bytes is not None
    total = card.total_memory_bytes
    within = _estimate(10 * MiB, reserved=50 * MiB, shown=total)
    beyond = _estimate(10 * MiB, reserved=50 * MiB, shown=total + 1)
    assert estimate_fits(within, limit_bytes=total, workload=CARD, device=card) is True
    assert estimate_fits(beyond, limit_bytes=total, workload=CARD, device=card) is False
    # Without a named card the nvidia-smi figure is the typical one, not checked against a card's memory.
    assert estimate_fits(beyond, limit_bytes=total, workload=HERE, device=card) is True


def test_a_named_cards_budget_is_its_memory_unless_less_is_asked() -> None:
    card = DeviceInfo("cuda", "H100-80GB", 1, 80 * 2**30, bf16=True, fp16_deepspeed=True)
    assert card_budget(None, card) == 80 * 2**30
    assert card_budget(40 * 2**30, card) == 40 * 2**30
    with pytest.raises(ConfigError, match=r"^--memory-budget 81.0 GiB is more than H100-80GB's 80.0 GiB"):
        card_budget(81 * 2**30, card)


def test_the_device_estimated_for_is_the_named_card_with_the_workloads_ranks() -> None:
    device = estimated_device(CARD.replace(nproc=2))
    assert device is not None and device.type == "cuda" and device.name == "H100-80GB" and device.count == 2
