"""The device probe's rounds: the best of three per precision, except a precision far slower than fp32, which
one round measures (on a CPU that emulates 16-bit matmuls, each of its rounds took half a second)."""

from __future__ import annotations

from autotune.trial import device_probe


def test_a_precision_far_slower_than_fp32_is_measured_in_one_round(monkeypatch):
    calls: list[str] = []
    rates = {"fp32": 100.0, "bf16": 1.0, "fp16": 60.0}  # bf16 emulated: 100x slower; fp16 within reach

    def rate(torch, device, precision, size):
        calls.append(precision)
        return rates[precision]

    monkeypatch.setattr(device_probe, "_matmul_rate", rate)
    speeds = device_probe.relative_matmul_speed("cpu", ["fp32", "bf16", "fp16"])
    assert speeds == {"fp32": 1.0, "bf16": 0.01, "fp16": 0.6}
    assert calls.count("bf16") == 1 and calls.count("fp32") == calls.count("fp16") == device_probe._ROUNDS


def test_the_roofline_measures_a_far_slower_dtype_in_one_round(monkeypatch):
    calls: list[str] = []

    def rate(torch, device, precision, size):
        calls.append(precision)
        return {"fp32": 100.0, "bf16": 1.0, "fp16": 1.0}[precision]

    monkeypatch.setattr(device_probe, "_matmul_rate", rate)
    profile = device_probe.measure_profile("cpu", between_ranks=False)
    assert calls.count("bf16") == calls.count("fp16") == 1 and calls.count("fp32") == device_probe._ROUNDS
    assert profile["matmul_flops"]["bfloat16"] * 100 == profile["matmul_flops"]["float32"]
