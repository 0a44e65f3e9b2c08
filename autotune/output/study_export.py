"""A study's best config exported (``autotune export``, ``find --export``): the format checked, its
text, the files ``-o`` names (each written whole), and the lines said beside every export: what is
trained and, for a study of the user's own command, the line that trains with it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.errors import ConfigError

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.study.summary import StudySummary

__all__ = ["check_format", "export_text", "write_export", "trains_line", "train_with"]


def check_format(fmt: str) -> None:
    from autotune.output.exporters import FORMATS

    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is not known; use one of {', '.join(FORMATS)}")


def export_text(summary: StudySummary, fmt: str) -> str:
    """The best config of ``summary`` in ``fmt``, as one text (the formats of one file)."""
    from autotune.output.exporters import export_config

    assert summary.best is not None  # the caller checked that there is an answer
    return export_config(
        summary.best.config,
        summary.workload,
        fmt=fmt,
        device_type=summary.device["type"],
        summary=_export_summary(summary),
    )


def write_export(summary: StudySummary, fmt: str, output: str | None) -> list[str]:
    """Write the export where ``-o`` says; return the paths written, the export's own file first.

    ``-o`` naming a directory (one that exists, or a name ending in /) gets the format's usual file
    name inside it; so does any name for ``--format peft`` that does not end in .json, since PEFT
    loads adapter_config.json from a directory (``LoraConfig.from_pretrained(dir)``). Each file is
    replaced whole or not at all, and no temporary file is left behind; a companion file (the
    DeepSpeed config an Accelerate YAML names) is written before the file that names it.
    """
    from autotune.output.exporters import DEFAULT_FILENAMES, export_files

    assert summary.best is not None  # the caller checked that there is an answer
    path = Path(output or DEFAULT_FILENAMES[fmt])
    if output is not None and (
        path.is_dir() or output.endswith(("/", os.sep)) or fmt == "peft" and path.suffix.lower() != ".json"
    ):
        path = path / DEFAULT_FILENAMES[fmt]
    files = export_files(
        summary.best.config,
        summary.workload,
        path,
        fmt=fmt,
        device_type=summary.device["type"],
        summary=_export_summary(summary),
    )
    for file, _ in files:
        if file.is_dir():  # e.g. -o out/ where out/ds_config.json is itself a directory
            raise ConfigError(f"-o {output or path}: {file} is a directory; name a file to write, e.g. -o {path}.new")
    for file, text in reversed(files):
        _write_whole(file, text, output=output or str(path), mode=0o755 if fmt == "launch" else 0o644)
    return [str(file) for file, _ in files]


def trains_line(config: TrialConfig, fmt: str, workload: Workload | None = None) -> str:
    """Precision and LoRA change what is trained: say so beside every export (with the workload,
    also which layers LoRA adapts)."""
    from autotune.output.exporters import in_code
    from autotune.study.summary import what_is_trained

    line = f"trains: {what_is_trained(config, workload)['note']}"
    if config.uses_lora and fmt != "peft":
        line += " (the adapters: autotune export --format peft)"
    return "\n".join([line, *in_code(config, workload)])


def train_with(summary: StudySummary, export: str | None) -> str | None:
    """For a study of the user's command: the line that trains it with the answer (given its export)."""
    if not summary.command:
        return None
    from autotune.scripts.runner import command_with_config

    return command_with_config(summary.command, export or "autotune.json")


def _export_summary(summary: StudySummary) -> dict[str, Any]:
    """What an export says of the study it came from (keys in json/yaml, header comments in YAML)."""
    best = summary.best
    assert best is not None
    return {
        "study": summary.name,
        "tokens_per_s": best.confirmed_tokens_per_s,
        "samples_per_s": best.confirmed_samples_per_s,
        "peak_memory_bytes": best.confirmed_peak_memory_bytes,
        "memory_budget_bytes": summary.memory_budget_bytes,
    }


def _write_whole(path: Path, text: str, *, output: str, mode: int = 0o644) -> None:
    """``path`` replaced by ``text`` whole or not at all (never a half-written config)."""
    import tempfile

    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise ConfigError(
            f"-o {output}: cannot write {path}: {exc.strerror or exc}; name a file in a directory you can write to"
        ) from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
