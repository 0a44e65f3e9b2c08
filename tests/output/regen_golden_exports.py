"""The golden exports: every format of three stored studies, as ``autotune export`` writes them today.

    python tests/output/regen_golden_exports.py            # tests/data/golden_exports/ from the stored studies
    python tests/output/regen_golden_exports.py --studies  # first rebuild tests/data/golden_studies/ too

``tests/output/test_golden_exports.py`` exports each study of ``tests/data/golden_studies/`` in each format and
compares the bytes with these files. Run this only when an export is meant to change (a new key, a fixed value),
and read the diff before committing it; a refactoring must leave every file as it is.

The studies are real studies written by the real tuner (:func:`autotune.search.tuner.tune`: the question, the model's
facts, the simple answer, the search, the interleaved re-runs and the answer trial), on a CPU, whose trials are
answered from a table instead of run (:class:`Scripted`): the same answers every time, in seconds. Rebuilding
them is only needed when what a study stores changes; their trials' times, workers and the device's name then
differ, which no export reads.

- ``plain``: full fine-tuning on one rank; its answer is mb=8 bf16 ckpt (mb=8 without checkpointing runs out).
- ``lora``: LoRA adapters of rank 16 on every linear layer over an NF4 base (QLoRA), the peft and bnb formats.
- ``zero``: ZeRO-3 over 2 ranks: the DeepSpeed config, Accelerate's two files, Lightning's refusal on a CPU.

Each format is written with ``-o <format>.<ext>`` from a folder of its own (relative, so the Accelerate YAML names
its DeepSpeed companion by a relative path), with the command's stderr (the file written and what is trained) in
``<format>.stderr``; a format the config cannot take is its one-line refusal in ``<format>.error`` (exit 2).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
STUDIES = TESTS / "data" / "golden_studies"
EXPORTS = TESTS / "data" / "golden_exports"
NAMES = ("plain", "lora", "zero")
# The file each format is written to: the format's name and the extension its default file name has.
EXTENSIONS = {
    "json": "json",
    "yaml": "yaml",
    "deepspeed": "json",
    "hf": "json",
    "accelerate": "yaml",
    "lightning": "yaml",
    "peft": "json",
    "bnb": "json",
    "launch": "sh",
    "torchtitan": "toml",
}
BUDGET = 2**30


def storage_of(name: str, folder: Path = STUDIES) -> str:
    return f"sqlite:///{folder / f'{name}.db'}"


# -- the studies -----------------------------------------------------------------------------------------------
SPACES = {
    "plain": (
        "description: golden study - full fine-tuning\nn_trials: 12\npatience: 12\nknobs:\n"
        "  micro_batch: [2, 4, 8]\n  precision: [fp32, bf16]\n  checkpointing: [false, true]\n  lora_rank: [off]\n"
    ),
    "lora": (
        "description: golden study - LoRA over a quantized base\nn_trials: 12\npatience: 12\nknobs:\n"
        "  micro_batch: [4, 8]\n  precision: [bf16]\n  checkpointing: [false]\n  lora_rank: [16]\n"
        "  lora_targets: [default, all-linear]\n  quantize_base: [off, nf4]\n"
    ),
    "zero": (
        "description: golden study - ZeRO over two ranks\nn_trials: 12\npatience: 12\nknobs:\n"
        "  micro_batch: [2, 4]\n  precision: [fp32, bf16]\n  checkpointing: [false, true]\n  zero_stage: [2, 3]\n"
        "  lora_rank: [off]\n"
    ),
}


def _workload(name: str):
    from autotune.config.workload import Workload

    nproc = 2 if name == "zero" else 1
    return Workload(model="builtin:gpt2-tiny", seq_len=64, global_batch=16, nproc=nproc, device="cpu")


def _figure(name: str, config) -> float | str:
    """Tokens/s of each config (or "oom"): a fixed table, so the search and its answer are the same every time.
    Every factor is a power of two's fraction, so the figures and their medians are exact in binary."""
    tokens = 1024.0 * config.micro_batch * (1.5 if config.precision == "bf16" else 1.0)
    if name == "plain" and config.micro_batch == 8 and not config.checkpointing:
        return "oom"
    tokens *= 0.75 if config.checkpointing else 1.0
    tokens *= 2.0 if config.lora_targets else 1.0
    tokens *= 1.5 if config.quantize_base == "nf4" else 1.0
    tokens *= 1.25 if config.zero_stage == 3 else 1.0
    return tokens


class Scripted:
    """Trials answered from :func:`_figure` (a re-run 1/16 slower than the first), no estimates, no probe."""

    def __init__(self, name: str) -> None:
        self.name = name

    def run(self, workload, config, *, measure_steps, **_):
        from autotune.trial.result import TrialResult, TrialStatus

        figure = _figure(self.name, config)
        peak = 2**20 * (8 + 2 * config.micro_batch)
        if figure == "oom":
            return TrialResult(config=config, status=TrialStatus.OOM, peak_memory_bytes=BUDGET, error="out of memory")
        assert isinstance(figure, float)
        tokens = figure * (0.9375 if measure_steps > 3 else 1.0)
        return TrialResult(
            config=config,
            status=TrialStatus.OK,
            tokens_per_s=tokens,
            samples_per_s=tokens / workload.seq_len,
            step_time_median_s=workload.global_batch * workload.seq_len / tokens,
            step_time_spread=0.02,
            measured_steps=measure_steps,
            grad_accum_steps=config.grad_accum_steps(workload),
            peak_memory_bytes=peak,
            peak_allocated_bytes=peak,
            device="cpu",
            world_size=workload.nproc,
            memory_budget_bytes=BUDGET,
        )

    def estimate(self, workload, config):
        return None

    def probe(self, precisions):
        return None


def build_studies(folder: Path) -> None:
    """Write the three studies into ``folder`` (``NAME.db``), replacing what is there.

    Each space is read from a file named relatively (``golden-NAME.yaml``) in a temporary directory made the
    current one, because the study stores the space's name as it was given: no path of this machine in it."""
    from autotune.search.presets import load_space
    from autotune.search.tuner import tune

    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    here = Path.cwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            for name in NAMES:
                (folder / f"{name}.db").unlink(missing_ok=True)
                Path(f"golden-{name}.yaml").write_text(SPACES[name])
                tune(
                    study=name,
                    workload=_workload(name),
                    space=load_space(f"golden-{name}.yaml"),
                    memory_budget_bytes=BUDGET,
                    storage=storage_of(name, folder),
                    estimate=False,
                    backend=Scripted(name),
                )
                (folder / f"{name}.proposals.lock").unlink(missing_ok=True)  # the workers' lock, not the study
                _compact(folder / f"{name}.db")
        finally:
            os.chdir(here)


def _compact(path: Path) -> None:
    import sqlite3

    with sqlite3.connect(path) as db:
        db.execute("VACUUM")
    path.chmod(0o644)


# -- the exports -----------------------------------------------------------------------------------------------
def export(name: str, fmt: str, work: Path, studies: Path = STUDIES) -> dict[str, bytes]:
    """Every file ``autotune export --format fmt -o fmt.ext`` writes in ``work`` for the study ``name``, and its
    stderr (``fmt.stderr``), or its refusal (``fmt.error``), by file name."""
    from autotune.output.exporters import FORMATS

    assert set(EXTENSIONS) == set(FORMATS), "a new export format: give it its extension here and regenerate"
    work.mkdir(parents=True, exist_ok=True)
    before = set(work.iterdir())
    target = f"{fmt}.{EXTENSIONS[fmt]}"
    proc = subprocess.run(
        [sys.executable, "-m", "autotune", "export", "--study", name, "--format", fmt, "-o", target]
        + ["--storage", storage_of(name, studies)],
        cwd=work,
        capture_output=True,
        timeout=300,
    )
    if proc.returncode == 2:
        assert not set(work.iterdir()) - before, proc.stderr
        return {f"{fmt}.error": proc.stderr}
    assert proc.returncode == 0, proc.stderr.decode()
    files = {p.name: p.read_bytes() for p in sorted(set(work.iterdir()) - before)}
    return {**files, f"{fmt}.stderr": proc.stderr}


def copy_studies(dest: Path) -> Path:
    """The stored studies copied into ``dest`` (read there, so that no export can touch the committed files)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        shutil.copyfile(STUDIES / f"{name}.db", dest / f"{name}.db")
    return dest


def exports(name: str, work: Path, studies: Path = STUDIES) -> dict[str, bytes]:
    """Every format of the study ``name``: its files by name."""
    from autotune.output.exporters import FORMATS

    files: dict[str, bytes] = {}
    for fmt in FORMATS:
        files.update(export(name, fmt, work / fmt, studies))
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--studies", action="store_true", help="rebuild tests/data/golden_studies/ first")
    args = parser.parse_args()
    if args.studies:
        build_studies(STUDIES)
    with tempfile.TemporaryDirectory() as tmp:
        studies = copy_studies(Path(tmp) / "studies")
        for name in NAMES:
            files = exports(name, Path(tmp) / name, studies)
            shutil.rmtree(EXPORTS / name, ignore_errors=True)
            (EXPORTS / name).mkdir(parents=True)
            for file, data in files.items():
                (EXPORTS / name / file).write_bytes(data)
            print(f"{EXPORTS.relative_to(TESTS.parent) / name}: {', '.join(sorted(files))}")


if __name__ == "__main__":
    main()
