"""bench/gpu_check.sh, rehearsed on the CPU: the script a lent GPU machine runs first works end to end."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from bench_modules import bench_module

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_gpu_check_rehearses_every_config_on_the_cpu(tmp_path):
    import importlib.util

    gpu_check = bench_module("gpu_check")
    out = tmp_path / "gpu_check.txt"
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--rehearse", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# bash bench/gpu_check.sh --rehearse")
    assert lines[-1].startswith("rehearsal: on the GPU machine")
    for label, flags in gpu_check.CONFIGS:
        (row,) = [line for line in lines if line.startswith(f"{label} |")]
        if "nf4" in flags and importlib.util.find_spec("bitsandbytes") is None:
            assert "not run: bitsandbytes not installed" in row
            continue
        # Predicted and measured, each a size: the estimate and the trial both ran.
        allocated = row.split(" | ")[1]
        assert allocated.count("GiB") == 2 and "(" in allocated, row
    # The plan beside the measurement and the estimate: its first config planned (for a named card) in a rehearsal.
    for index, (label, _) in enumerate(gpu_check.CONFIGS):
        (plan,) = [line for line in lines if line.startswith(f"{label} (plan) | ")]
        assert plan.split(" | ")[1].count("GiB") == 3 if index == 0 else "planned on the GPU" in plan, plan
    # torchtune's rows: each one's flags made (and checked against its config); one estimated and measured, with the
    # memory history asked for (inert on a CPU, as the line says).
    for key in gpu_check.TORCHTUNE_ROWS:
        (flags,) = [line for line in lines if line.startswith(f"{key} (")]
        assert "--precision bf16-true --checkpointing on --loss chunked-kept" in flags, flags
        assert "--compile" not in flags and "--activation-offload" not in flags, flags  # CUDA only
        (row,) = [line for line in lines if line.startswith(f"{key} | ")]
        if key != gpu_check.REHEARSED_TORCHTUNE_ROW:
            assert "not run: on the GPU only" in row, row
            continue
        assert row.split(" | ")[1].count("GiB") == 2, row
        after = lines[lines.index(flags) + 1 :]
        assert after[0].startswith("  history: none on a CPU (AUTOTUNE_CUDA_MEMORY_HISTORY is inert there)"), after[0]
        assert after[1].startswith("  the estimate's parts: parameters "), after[1]
    # The real search ran and answered (on the CPU, a tiny Llama in 6 s of search).
    (found,) = [line for line in lines if line.startswith("find --model builtin:llama-tiny")]
    assert "answer mb=" in found and "tokens/s" in found, found
