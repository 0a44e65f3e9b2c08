"""``autotune show``: every trial of a study and its best config."""

from __future__ import annotations

import json
from typing import Optional

from autotune.cli.options import command


@command
def show(study: str, storage: Optional[str], as_json: bool) -> int:
    """Every trial of a study (config, status, tokens/s, peak memory) and its best config."""
    from autotune.study.records import load_summary

    summary = load_summary(study=study, storage=storage)
    if as_json:
        print(json.dumps(summary.to_dict()))
        return 0
    from autotune.output.render import print_summary

    print_summary(summary)
    return 0
