"""The search spaces by name: the presets shipped with autotune, their former names, and YAML files."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from autotune.errors import ConfigError
from autotune.search.space import SearchSpace, parse_space

__all__ = ["is_preset", "load_space", "preset_names"]

# A preset's former name -> the preset it became (studies made under the old name still resume).
_ALIASES = {"zero": "sharding"}


def preset_names() -> list[str]:
    files = [p.name.removesuffix(".yaml") for p in _preset_dir().iterdir() if p.name.endswith(".yaml")]
    return sorted([*files, *_ALIASES])


def is_preset(name: str) -> bool:
    """Whether a space's name is a preset's (a file's name is its path)."""
    return name in preset_names()


def load_space(name_or_path: str | Path) -> SearchSpace:
    """A preset by name (``default``, ``full``, ``lora``, ``quick``, ``sharding`` or its old name ``zero``)
    or a YAML file by path."""
    import yaml

    text_name = str(name_or_path)
    path = Path(text_name)
    if not text_name.endswith((".yaml", ".yml")) and "/" not in text_name:
        path = _preset_dir() / f"{_ALIASES.get(text_name, text_name)}.yaml"
        if not path.is_file():
            raise ConfigError(
                f"--space {text_name}: no such preset; use one of {', '.join(preset_names())} or a path to a .yaml file"
            )
        label = text_name
    else:
        if not path.is_file():
            raise ConfigError(f"--space {text_name}: no such file")
        label = str(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{label}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    return parse_space(data, label)


def _preset_dir() -> Path:
    # Shipped as package data (pyproject maps search_spaces/ to autotune.search_spaces); a source checkout on
    # PYTHONPATH, not installed, has only the folder at the repository's top.
    try:
        return Path(str(resources.files("autotune.search_spaces")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "search_spaces"
