"""The project's seed models estimated at their real shapes on this CPU, against the arithmetic.

    python bench/seed_models.py [--out bench/results/seed_models_cpu.json]

mT5-base (seq2seq-lm, 512 source and target tokens), XLM-RoBERTa-large (masked LM, 256 tokens) and
ResNet-50 (224 px images), at micro batch 8, 16 and 32, fp32 and bf16 autocast, checkpointing off
and on (Transformers' ResNet cannot checkpoint: its rows say so instead): ``autotune estimate``'s
prediction (fake tensors, no memory) of each, and its model states
checked against the textbook arithmetic for full fine-tuning with torch autocast: 4 bytes per
parameter of weights, 4 of gradients and 8 of Adam's m and v (16 bytes per parameter in all).
Ψ is counted on the model the installed Transformers builds (on the meta device, apart from the
estimator's own build), with the published count beside it: they differ for mT5, whose untied LM
head (192M of its published 582M) Transformers 5 ties to the embeddings.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.estimate.client import predict_memory

MODELS = [  # (preset, workload fields, published parameters)
    ("mt5-base", dict(seq_len=512, target_len=512), 582_401_280),
    ("xlm-roberta-large", dict(seq_len=256), 560_142_482),
    ("resnet-50", dict(image_size=224), 25_557_032),
]
BYTES_PER_PARAM = (4, 4, 8)  # fp32 weights, gradients, Adam m + v: autocast keeps every state in fp32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/seed_models_cpu.json"))
    args = parser.parse_args()
    rows = []
    for preset, fields, published in MODELS:
        psi = _parameters(preset)
        expected = [b * psi for b in BYTES_PER_PARAM]
        for precision in ("fp32", "bf16"):
            for checkpointing in (False, True):
                for micro_batch in (8, 16, 32):
                    workload = Workload(model=f"builtin:{preset}", global_batch=micro_batch, device="cpu", **fields)
                    config = TrialConfig(micro_batch=micro_batch, precision=precision, checkpointing=checkpointing)
                    started = time.perf_counter()
                    try:
                        estimate = predict_memory(workload, config)
                    except ConfigError as exc:  # refused before any estimate: said, not guessed
                        rows.append({"model": preset, "config": config.describe(), "refused": str(exc)})
                        print(f"{preset:<18} {config.describe():<22} refused: {exc}", flush=True)
                        continue
                    seconds = time.perf_counter() - started
                    got = [estimate.parameters_bytes, estimate.gradients_bytes, estimate.optimizer_state_bytes]
                    parts = estimate.parts()
                    assert sum(parts.values()) == estimate.predicted_peak_bytes, parts
                    error = sum(got) / sum(expected) - 1
                    rows.append(
                        {
                            "model": preset,
                            "workload": workload.to_dict(),
                            "config": config.describe(),
                            "parameters": psi,
                            "parameters_published": published,
                            "seconds": seconds,
                            "estimate": estimate.to_dict(),
                            "expected_model_states": expected,
                            "estimated_model_states": got,
                            "model_states_relative_error": error,
                        }
                    )
                    print(
                        f"{preset:<18} {config.describe():<22} {seconds:5.1f} s  peak "
                        f"{estimate.predicted_peak_bytes / 2**30:6.2f} GiB  model states {sum(got) / 2**30:5.2f} "
                        f"GiB vs arithmetic {sum(expected) / 2**30:5.2f} GiB ({error:+.2%})",
                        flush=True,
                    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    worst = max(abs(r["model_states_relative_error"]) for r in rows if "refused" not in r)
    args.out.write_text(
        json.dumps(
            {"command": "python bench/seed_models.py", "max_abs_model_states_error": worst, "rows": rows}, indent=2
        )
        + "\n"
    )
    print(
        f"{sum('refused' not in r for r in rows)} estimates; model states within {worst:.2%} of 16 bytes per parameter"
    )


def _parameters(preset: str) -> int:
    import torch

    from autotune.models.presets import PRESETS
    from autotune.models.sources import build_model

    model = build_model(Workload(model=f"builtin:{preset}"), task=PRESETS[preset].task, device=torch.device("meta"))
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    main()
