"""`autotune find --space lean` where only a quantized base fits, as a user runs it, and its exports loaded.

    python bench/find_lean.py [--out bench/results/find_lean_cpu.json]

The model is a 2-layer Llama whose linear layers hold most of its weights (hidden 256, MLP 1,024, a
512-token vocabulary: ``bench/data/llama-wide.json``), at 16 tokens of one sample, against a 4 MiB budget
(3.6 MiB after the 10% headroom). LoRA on the bf16 base needs 4.6 MiB at its leanest and full fine-tuning
far more, so only LoRA on an NF4 or int8 base fits. The run records the answer, how many trials ran and
how long the whole find took; then the hf export is loaded by TrainingArguments, the peft export by
LoraConfig and the bnb export by BitsAndBytesConfig. A run takes about 10 minutes on this 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--model", "bench/data/llama-wide.json", "--seq-len", "16", "--global-batch", "1", "--memory-budget", "4MiB"]


def _autotune(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "autotune", *args], cwd=ROOT, capture_output=True, text=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/find_lean_cpu.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        storage = f"sqlite:///{work / 'lean.db'}"
        started = time.perf_counter()
        proc = _autotune("find", *FLAGS, "--space", "lean", "--storage", storage, "--json")
        seconds = time.perf_counter() - started
        if proc.returncode != 0:
            sys.exit(f"find failed: {proc.stderr.strip().splitlines()[-1]}")
        answer = json.loads(proc.stdout)
        statuses: dict[str, int] = {}
        for trial in answer["trials"]:
            statuses[trial["status"]] = statuses.get(trial["status"], 0) + 1
        loaded = {}
        for fmt, name in (("hf", "hf.json"), ("peft", "adapter"), ("bnb", "bnb.json")):
            out = str(work / name)
            export = _autotune("export", "--study", answer["study"], "--storage", storage, "--format", fmt, "-o", out)
            loaded[fmt] = export.returncode == 0 and _loads(fmt, Path(out))
    best = answer["best"]
    row = {
        "command": "autotune find " + " ".join(FLAGS) + " --space lean",
        "seconds": round(seconds, 1),
        "answer": best["describe"],
        "answer_config": best["config"],
        "tokens_per_s": best.get("tokens_per_s"),
        "peak_memory_bytes": best.get("peak_memory_bytes"),
        "trials_by_status": statuses,
        "exports_loaded": loaded,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(row, indent=2) + "\n")
    print(json.dumps(row, indent=2))


def _loads(fmt: str, path: Path) -> bool:
    """Whether the library that reads ``fmt`` loads the file."""
    if fmt == "hf":
        from transformers import TrainingArguments

        TrainingArguments(output_dir=str(path.parent / "out"), report_to=[], **json.loads(path.read_text()))
    elif fmt == "peft":
        from peft import LoraConfig

        LoraConfig.from_pretrained(str(path))
    else:
        from transformers import BitsAndBytesConfig

        BitsAndBytesConfig(**json.loads(path.read_text()))
    return True


if __name__ == "__main__":
    main()
