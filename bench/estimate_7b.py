"""A 7B Llama-shaped model estimated on this CPU: seconds, no memory, and model states by arithmetic.

    python bench/estimate_7b.py [--out bench/results/estimate_7b_cpu.json]

Checks the estimator's model-state parts against the textbook arithmetic (Ψ parameters,
N ranks): full fine-tuning with torch autocast (fp32 weights, gradients and Adam m, v):
4 + 4 + 8 = 16 bytes per parameter; DeepSpeed mixed precision (16-bit weights and gradients,
fp32 master + m + v): 2 + 2 + 12 = 16 bytes per parameter, divided over N ranks per ZeRO stage.
Ψ is counted from the config's shapes, independently of the model the estimator builds.
Each row also lists the peak's parts, which add up to it: whole model states, the activations
and temporaries live at the peak, and the model states not allocated yet at that moment.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.client import predict_memory

CASES = [  # (label, config, ranks, expected bytes per parameter: params, grads, optimizer)
    ("full fine-tuning, bf16 autocast", TrialConfig(micro_batch=1, precision="bf16", checkpointing=True), 1, (4, 4, 8)),
    (
        "ZeRO-2, bf16, 8 ranks",
        TrialConfig(micro_batch=1, precision="bf16", checkpointing=True, zero_stage=2),
        8,
        (2, 2 / 8, 12 / 8),
    ),
    (
        "ZeRO-3, bf16, 8 ranks",
        TrialConfig(micro_batch=1, precision="bf16", checkpointing=True, zero_stage=3),
        8,
        (2 / 8, 2 / 8, 12 / 8),
    ),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/estimate_7b_cpu.json"))
    args = parser.parse_args()
    rows = []
    for label, config, ranks, per_param in CASES:
        workload = Workload(model="builtin:llama2-7b", seq_len=512, global_batch=8 * ranks, nproc=ranks)
        started = time.perf_counter()
        estimate = predict_memory(workload, config)
        seconds = time.perf_counter() - started
        psi = _parameters(workload)
        expected = [int(b * psi) for b in per_param]
        got = [estimate.parameters_bytes, estimate.gradients_bytes, estimate.optimizer_state_bytes]
        parts = estimate.parts()
        assert sum(parts.values()) == estimate.predicted_peak_bytes, parts
        rows.append(
            {
                "case": label,
                "parameters": psi,
                "seconds": seconds,
                "estimate": estimate.to_dict(),
                "expected_model_states": expected,
                "estimated_model_states": got,
                "model_states_relative_error": sum(got) / sum(expected) - 1,
            }
        )
        print(
            f"{label:<32} {seconds:5.1f} s  peak {estimate.predicted_peak_bytes / 2**30:6.2f} GiB  model states "
            f"{sum(got) / 2**30:6.2f} GiB vs arithmetic {sum(expected) / 2**30:6.2f} GiB "
            f"({sum(got) / psi:.2f} B/param, error {sum(got) / sum(expected) - 1:+.2%})\n    = "
            + " + ".join(f"{name} {size / 2**30:.2f}" for name, size in parts.items())
            + " GiB",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "python bench/estimate_7b.py", "rows": rows}, indent=2) + "\n")


def _parameters(workload: Workload) -> int:
    """Ψ from the config's shapes alone: Llama-2 7B's own count."""
    from autotune.models.sources import load_hf_config, parse_model_source

    c = load_hf_config(parse_model_source(workload.model))
    h, i, layers, v = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    per_layer = 4 * h * h + 3 * h * i + 2 * h  # q, k, v, o; gate, up, down; two RMSNorms
    return layers * per_layer + 2 * v * h + h  # embeddings, untied lm_head, final norm


if __name__ == "__main__":
    main()
