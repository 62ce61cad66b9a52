"""The command line: a table from subcommand to a typed, importable Python function.

Each module in this package registers its subcommands with :func:`command`
(every non-underscore module here is imported when the parser is built).
Modules import their heavy dependencies inside the command function, so
``normatlas --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["COMMANDS", "CliError", "Command", "command", "main"]


class CliError(Exception):
    """An error the CLI reports as one line and a non-zero exit, never a traceback."""


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def command(
    name: str, help: str, configure: Callable[[argparse.ArgumentParser], None] = lambda p: None
) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    """Register ``run(args) -> exit code`` as subcommand ``name``."""

    def register(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        if name in COMMANDS:
            raise RuntimeError(f"subcommand {name!r} registered twice")
        COMMANDS[name] = Command(name, help, configure, run)
        return run

    return register


def build_parser() -> argparse.ArgumentParser:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    parser = argparse.ArgumentParser(
        prog="normatlas", description="The geometry of normalization, as working software."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.configure(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args))
    except (CliError, ValueError, TypeError, FileNotFoundError) as exc:
        print(f"normatlas {args.command}: error: {exc}", file=sys.stderr)
        return 2
