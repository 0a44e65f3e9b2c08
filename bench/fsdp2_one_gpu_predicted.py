"""autotune's predictions for the FSDP2 configs that ``bench/fsdp2_one_gpu.py`` measured on a card, side by side.

    python bench/fsdp2_one_gpu_predicted.py     # reads results/fsdp2_one_gpu_NVIDIA_H200.json, writes ..._predicted.txt

Each measured config (a 3B Llama, FSDP2 over a world of one rank, bf16 parameters with fp32 masters) is traced
here for the card (``--gpu H200``) and its allocated and reserved peaks are set against
``max_memory_allocated`` / ``max_memory_reserved``. autotune refuses FSDP on one rank, since it shards nothing
there; the card ran it, so this bench lifts that one refusal for these configs. ``reshard_after_forward`` True is
``--fsdp full`` and False is ``--fsdp grad-op``. A bf16 reduce has no knob: those rows are listed, not predicted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MEASURED = ROOT / "bench" / "results" / "fsdp2_one_gpu_NVIDIA_H200.json"
MODEL = "bench/data/published/llama-3.2-3b.json"
GiB = 2**30


def main() -> None:
    measured = json.loads(MEASURED.read_text())
    lines = [
        "# python bench/fsdp2_one_gpu_predicted.py",
        f"measured: {MEASURED.relative_to(ROOT)} ({measured['command']}); predicted here for --gpu H200",
        "config | allocated: predicted / measured (error) | reserved: predicted / measured (error)",
    ]
    for row in measured["results"]:
        spec, cuda = row["config"], row["cuda"]
        if spec["reduce_dtype"] != "float32":
            lines.append(f"{spec['label']} | not predicted: a {spec['reduce_dtype']} reduce has no autotune knob")
            continue
        label, estimate = predict(spec)
        allocated = _pair(estimate.predicted_peak_bytes, cuda["max_allocated"])
        reserved = _pair(estimate.predicted_reserved_bytes, cuda["max_reserved"])
        lines.append(f"{spec['label']} ({label}) | {allocated} | {reserved}")
        print(lines[-1], flush=True)
    out = ROOT / "bench" / "results" / "fsdp2_one_gpu_predicted.txt"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def predict(spec: dict[str, Any]) -> tuple[str, Any]:
    """A measured config (a row's ``config`` in the results JSON) as autotune's label and its estimate for the card,
    traced in this process with the one-rank refusal lifted (also what ``tests/estimate/test_cuda_traces.py`` runs)."""
    import autotune.config.knobs as knobs
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.estimate.trace import estimate_memory

    checked = knobs.TrialConfig.validate_for

    def one_rank_fsdp_allowed(self: TrialConfig, workload: Workload, *args: Any, **kwargs: Any) -> None:
        if not (self.uses_fsdp and workload.nproc == 1):
            checked(self, workload, *args, **kwargs)

    workload = Workload(
        model=MODEL, seq_len=spec["seq_len"], global_batch=spec["micro_batch"], nproc=1, device="cuda", gpu="H200"
    )
    config = TrialConfig(
        micro_batch=spec["micro_batch"],
        precision="bf16",
        checkpointing=spec["checkpointing"],
        fsdp="full" if spec["reshard_after_forward"] else "grad-op",
    )
    knobs.TrialConfig.validate_for = one_rank_fsdp_allowed  # type: ignore[method-assign]  # lifted while it traces
    try:
        return config.describe(), estimate_memory(workload, config)
    finally:
        knobs.TrialConfig.validate_for = checked  # type: ignore[method-assign]  # restored


def _pair(predicted: int, measured: int) -> str:
    return f"{predicted / GiB:.2f} GiB / {measured / GiB:.2f} GiB ({predicted / measured - 1:+.1%})"


if __name__ == "__main__":
    main()
