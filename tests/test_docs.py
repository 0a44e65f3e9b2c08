"""The documentation says what the code does: the CLI reference is the commands' own help, the API
reference names every public name, and the README stays short, lists the site's pages and quotes a real run."""

from __future__ import annotations

import difflib
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

import autotune

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _gen_cli():
    spec = importlib.util.spec_from_file_location("gen_cli", ROOT / "docs" / "gen_cli.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    return [page for value in nav.values() for page in _nav_pages(value)]


def test_the_cli_reference_is_the_commands_own_help() -> None:
    gen = _gen_cli()
    page, help_ = gen.PAGE.read_text(), gen.render()
    if page != help_:
        diff = difflib.unified_diff(page.splitlines(True), help_.splitlines(True), "the page", "the --help", n=0)
        pytest.fail(
            f"{gen.PAGE.relative_to(ROOT)} disagrees with the commands' --help: run `{gen.COMMAND}` and commit "
            f"the page\n{''.join(diff)[:3000]}"
        )


def test_the_api_reference_documents_every_public_name() -> None:
    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    # `::: autotune.find`, or the defining module for a name griffe cannot follow: `::: autotune.prepare.apply.prepare`
    documented = set(re.findall(r"^::: autotune\.(?:[\w.]+\.)?(\w+)$", page, re.M))
    missing = sorted(set(autotune.__all__) - documented)
    assert not missing, f"docs/reference/api.md lacks a `::: autotune.NAME` entry for {missing}"


def test_every_page_is_in_the_nav_and_listed_in_the_readme() -> None:
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(nav) == pages, "mkdocs.yml's nav and the pages in docs/ differ"
    unlisted = [page for page in pages if f"docs/{page}" not in README]
    assert not unlisted, f"README.md does not link these pages of the site: {unlisted}"


def test_the_readme_is_two_screens_and_keeps_the_ci_test_command() -> None:
    assert len(README.splitlines()) <= 200
    command = "python -m pytest -q -n 2 --dist loadfile"
    assert f"\n{command}\n" in README
    assert f"\n{command}\n" in (ROOT / ".ci" / "run").read_text()  # .ci/run runs the README's test command


def test_the_readmes_quick_start_output_is_the_recorded_run() -> None:
    """Every line of the README's `$ autotune find` block is in bench/results/find_cpu.txt, in that order."""
    block = re.search(r"```text\n(\$ autotune find .*?)```", README, re.S)
    assert block is not None, "README.md has no ```text block starting with `$ autotune find`"
    recorded = iter((ROOT / "bench" / "results" / "find_cpu.txt").read_text().splitlines())
    for line in block.group(1).splitlines():
        if line.strip() == "...":  # lines left out of the README
            continue
        assert any(line.rstrip() == r.rstrip() for r in recorded), f"not in bench/results/find_cpu.txt: {line!r}"
