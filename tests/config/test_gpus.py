"""The named cards (``--gpu``): lookup, the hint for a near miss, and the card torchtitan's published runs used."""

from __future__ import annotations

import pytest

from autotune.config.gpus import gpu_spec
from autotune.errors import WorkloadError
from autotune.estimate.step_time import card_profile


@pytest.mark.parametrize(
    ("typed", "hint"),
    [
        ("H100-96GB", "H100-96GB-HBM2e"),  # the start of a card's name: that card
        ("h100", "H100-80GB"),  # the chip alone: its first card
        ("a100", "A100-40GB"),
        ("H200-141GB", "H200"),
    ],
)
def test_a_near_miss_names_the_card_meant(typed, hint):
    with pytest.raises(WorkloadError, match=rf"^--gpu '{typed}' is not a known card \(did you mean {hint}\?\)"):
        gpu_spec(typed)


def test_torchtitans_h100_is_the_80gb_sxm_chip_on_hbm2e():
    """torchtitan's Grand Teton H100 (96GB HBM2e at 2.4 TB/s, 500 W, 8 a host on 400 Gb/s a GPU): timed as the
    H100 SXM's matmuls (its peak is not published, the SXM's sustained rate is taken) on its own memory."""
    titan, sxm = gpu_spec("h100-96gb-hbm2e"), gpu_spec("H100-80GB")
    assert titan.name == "H100-96GB-HBM2e" and titan.compute_capability == (9, 0)
    assert titan.memory_bytes == 97_871 * 2**20 and titan.memory_bandwidth == 2.4e12
    assert (titan.gpus_per_node, titan.network_bandwidth) == (8, 50e9)
    fast, slow = card_profile(sxm), card_profile(titan)
    assert slow.matmul_flops == fast.matmul_flops and slow.peak_flops == fast.peak_flops
    assert slow.memory_bandwidth == pytest.approx(fast.memory_bandwidth * 2.4 / 3.35)
