"""`autotune find` on the new tasks, as a user runs it: a tiny T5 (seq2seq-lm), a tiny ViT (image-cls)
and the factory of docs/guides/models.md that returns (model, make_batch) with images as its input; each answer
exported and loaded by the library that reads it.

    python bench/find_tasks.py [--out bench/results/find_tasks_cpu.json]

Each find searches micro batch 2, 4, 8 (fp32) and LoRA rank 8 against a 1 GiB budget, two timed steps a
trial. The Transformers export (TrainingArguments keyword arguments) is loaded by TrainingArguments;
the peft export of a LoRA answer is loaded by LoraConfig; the JSON export is applied by autotune.prepare
to the model the workload builds (every answer). A run takes a few minutes on this 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPACE = "knobs:\n  micro_batch: [2, 4, 8]\n  precision: [fp32]\n  checkpointing: [false]\n  lora_rank: [null, 8]\n"
CASES = [  # (label, --model, extra workload flags)
    ("t5-tiny", "builtin:t5-tiny", ["--seq-len", "32", "--target-len", "16"]),
    ("vit-tiny", "builtin:vit-tiny", []),
    ("factory with make_batch (README's convnet)", "my_vision:convnet", []),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/find_tasks_cpu.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "space.yaml").write_text(SPACE)
        guide = (ROOT / "docs" / "guides" / "models.md").read_text()
        example = re.search(r"```python\n( *# my_vision\.py.*?)\n *```", guide, re.S).group(1)
        (work / "my_vision.py").write_text(textwrap.dedent(example))
        for label, model, flags in CASES:
            started = time.perf_counter()
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "autotune",
                    "find",
                    "--model",
                    model,
                    *flags,
                    "--global-batch",
                    "8",
                    "--space",
                    "space.yaml",
                    "--memory-budget",
                    "1GiB",
                    "--steps",
                    "2",
                    "--json",
                ],
                cwd=work,
                capture_output=True,
                text=True,
                timeout=1800,
            )
            seconds = time.perf_counter() - started
            if proc.returncode != 0:
                raise SystemExit(f"{label}: find exited {proc.returncode}\n{proc.stderr[-3000:]}")
            result = json.loads(proc.stdout)
            best = result["best"]
            loaded = _load_exports(work, result["study"], best)
            rows.append(
                {
                    "case": label,
                    "model": model,
                    "seconds": seconds,
                    "study": result["study"],
                    "n_trials": result["n_trials"],
                    "best": best,
                    "exports_loaded": loaded,
                    "trials": [
                        {
                            k: t[k]
                            for k in (
                                "config",
                                "status",
                                "throughput_unit",
                                "tokens_per_s",
                                "samples_per_s",
                                "peak_memory_bytes",
                            )
                        }
                        for t in result["trials"]
                    ],
                }
            )
            figure = best["tokens_per_s"] if best["throughput_unit"] == "tokens/s" else best["samples_per_s"]
            print(
                f"{label:<44} {seconds:6.1f} s  {result['n_trials']} trials  best {best['describe']} "
                f"{figure:,.1f} {best['throughput_unit']}; exports loaded: {', '.join(loaded)}",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "python bench/find_tasks.py", "rows": rows}, indent=2) + "\n")


def _load_exports(work: Path, study: str, best: dict) -> list[str]:
    """Export the answer in each format its config can take and load each with its library."""
    loaded = []
    for fmt, name in (("json", "config.json"), ("hf", "training_args.json"), ("peft", "adapter")):
        if fmt == "peft" and best["config"].get("lora_rank") is None:
            continue
        proc = subprocess.run(
            [sys.executable, "-m", "autotune", "export", "--study", study, "--format", fmt, "-o", name],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode != 0:
            raise SystemExit(f"export {fmt}: {proc.stderr[-2000:]}")
        check = _CHECKS[fmt].format(path=str(work / name))
        out = subprocess.run([sys.executable, "-c", check], cwd=work, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise SystemExit(f"loading the {fmt} export: {out.stderr[-2000:]}")
        loaded.append(fmt)
    return loaded


_CHECKS = {
    "json": (
        "import json, torch, autotune; from autotune.config.workload import Workload; "
        "from autotune.models.sources import build_model, resolve_task; "
        "w = Workload.from_dict(json.load(open({path!r}))['workload']); "
        "autotune.prepare(build_model(w, task=resolve_task(w), device=torch.device('cpu')), {path!r})"
    ),
    "hf": (
        "import json; from transformers import TrainingArguments; "
        "TrainingArguments(**{{'output_dir': 'out', **json.load(open({path!r}))}})"
    ),
    "peft": "from peft import LoraConfig; LoraConfig.from_pretrained({path!r})",
}


if __name__ == "__main__":
    main()
