"""Write docs/reference/cli.md from the commands' own help: ``python docs/gen_cli.py``.

Each command's usage line, description and options are what ``autotune COMMAND --help`` prints,
taken from the Click objects Typer builds (so no terminal width, colour or box drawing gets in).
``tests/test_docs.py`` renders the page again and fails when the committed one differs.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "cli.md"
COMMAND = "python docs/gen_cli.py"


def _escape(text: str) -> str:
    """Markdown-escape help text outside its `code spans`, and keep it on one table row."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    return "".join(p if p.startswith("`") else re.sub(r"([\\*_<>|\[\]])", r"\\\1", p) for p in parts)


def _paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]


def render() -> str:
    import click
    import typer

    from autotune.cli import app

    group = typer.main.get_command(app)
    root = click.Context(group, info_name="autotune")
    names = [n for n in group.list_commands(root) if not group.get_command(root, n).hidden]  # type: ignore[union-attr]
    lines = [
        "# CLI reference",
        "",
        f"<!-- Generated from the commands' own help by `{COMMAND}`; do not edit by hand. -->",
        "",
        "What `autotune COMMAND --help` prints, command by command. Every command also takes `--help`.",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    for name in names:
        command = group.get_command(root, name)
        assert command is not None
        summary = _paragraphs(command.help or "")[0]
        lines.append(f"| [`{name}`](#autotune-{name}) | {_escape(summary)} |")
    for name in names:
        command = group.get_command(root, name)
        assert command is not None
        ctx = click.Context(command, info_name=name, parent=root)
        lines += ["", f"## autotune {name}", "", "```text", command.get_usage(ctx), "```", ""]
        for paragraph in _paragraphs(command.help or ""):
            lines += [_escape(paragraph), ""]
        rows = [p.get_help_record(ctx) for p in command.get_params(ctx) if p.name != "help"]
        rows = [r for r in rows if r is not None]
        if rows:
            lines += ["| option | help |", "|---|---|"]
            lines += [f"| `{flags}` | {_escape(help_)} |" for flags, help_ in rows]
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(render())
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this checkout's autotune, whichever one is installed
    sys.exit(main())
