"""The trial spec: what crosses into a trial's process, typed on both sides of the JSON."""

from __future__ import annotations

import pytest

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.trial.spec import TrialSpec


def test_a_spec_reads_back_as_written(tmp_path):
    spec = TrialSpec(
        workload=Workload(model="builtin:gpt2-tiny", global_batch=16, nproc=2),
        config=TrialConfig(micro_batch=4, checkpointing=True, loss="chunked"),
        device_type="cpu",
        memory_budget_bytes=2**30,
        warmup_steps=2,
        measure_steps=3,
        cpu_cores=[0, 1],
        task="causal-lm",
    )
    spec.write(tmp_path / "spec.json")
    again = TrialSpec.read(tmp_path / "spec.json")
    assert again == spec
    assert again.grad_accum_steps == 2  # 16 / (4 x 2 ranks)


def test_a_spec_with_a_field_this_release_does_not_know_is_refused(tmp_path):
    spec = TrialSpec(
        workload=Workload(),
        config=TrialConfig(),
        device_type="cpu",
        memory_budget_bytes=None,
        warmup_steps=1,
        measure_steps=3,
    )
    data = {**spec.to_dict(), "pipeline_chunks": 4}
    with pytest.raises(ValueError, match="unknown fields \\['pipeline_chunks'\\]"):
        TrialSpec.from_dict(data)
