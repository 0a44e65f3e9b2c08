"""The Typer app every command registers on, and the entry point of the console script and of
``python -m autotune``: every error autotune raises on purpose, and every usage error, ends as one
line on stderr and exit status 2.
"""

from __future__ import annotations

import logging
import sys

import typer

from autotune.errors import AutotuneError

__all__ = ["app", "main", "run", "INTERRUPTED"]

# torchao (8-bit AdamW) warns on import about each CUDA-only kernel library it cannot load, and torch's pytree
# about the Enums torchao registers: noise on every command once it is installed (Transformers imports it).
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
# bitsandbytes (a quantized base) warns on import, on a CPU with bf16 instructions, that its optional inference
# kernel package is missing: training never uses that kernel.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

app = typer.Typer(
    name="autotune",
    help="Find the fastest training configuration of a PyTorch model that fits on this hardware.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script and ``python -m autotune``."""
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="autotune", standalone_mode=False)
    except AutotuneError as exc:
        print(f"autotune: error: {exc}", file=sys.stderr)
        return 2
    except typer.TyperException as exc:  # Click's usage errors: unknown flag, bad value, ...
        ctx = getattr(exc, "ctx", None)
        where = f"autotune {ctx.info_name}" if ctx is not None and ctx.info_name != "autotune" else "autotune"
        message = " ".join(exc.format_message().split())
        print(f"{where}: error: {message}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    if code == INTERRUPTED:  # Typer turns Ctrl-C into this exit status, silently
        print(
            "autotune: interrupted (a study carries on where it stopped: run the same command again)", file=sys.stderr
        )
    return code if isinstance(code, int) else 0


def run() -> None:
    from autotune.cli.servers import this_is_the_command

    this_is_the_command()
    sys.exit(main())
