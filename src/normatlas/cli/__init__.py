"""The command line: a table from subcommand to a typed, importable Python function.

Each module in this package registers its subcommands with :func:`command`
(every non-underscore module here is imported when the parser is built).
Modules import their heavy dependencies inside the command function, so
``normatlas --help`` stays fast.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import math
import os
import pkgutil
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COMMANDS",
    "CliError",
    "Command",
    "command",
    "describe_error",
    "is_user_error",
    "main",
    "nonnegative_float",
    "nonnegative_int",
    "one_of",
    "positive_float",
    "positive_int",
]


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


def _number_arg(kind: type, cond: Callable[[float], bool], rule: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not math.isfinite(value) or not cond(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    parse.__name__ = f"{kind.__name__} {rule}"  # argparse names the type in its messages
    return parse


# argparse ``type=`` functions: ``--min-time -1`` is refused as "argument --min-time: must be >= 0, got -1"
positive_float = _number_arg(float, lambda v: v > 0, "a finite number > 0")
nonnegative_float = _number_arg(float, lambda v: v >= 0, "a finite number >= 0")
positive_int = _number_arg(int, lambda v: v >= 1, "an integer >= 1")
nonnegative_int = _number_arg(int, lambda v: v >= 0, "an integer >= 0")


def one_of(allowed: Sequence[str]) -> Callable[[str], str]:
    """argparse ``type=``: one of ``allowed``, matched case-insensitively, returned as written in ``allowed``."""
    lookup = {a.lower(): a for a in allowed}

    def parse(text: str) -> str:
        if text.lower() not in lookup:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(allowed)}")
        return lookup[text.lower()]

    parse.__name__ = "choice"
    return parse


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    parser = argparse.ArgumentParser(
        prog="normatlas",
        description="The geometry of normalization, as working software.",
        epilog="`normatlas COMMAND --help` for a command's options; every command takes --format table|json|csv.",
    )
    parser.add_argument("--version", action="version", version=f"normatlas {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.configure(p)
        p.set_defaults(_run=cmd.run)
    return parser


# OSErrors that are about the user's files and disks, not about this program
_ERRNO_NAMES = "ENOENT EACCES EPERM EISDIR ENOTDIR EEXIST ENOTEMPTY ENOSPC EROFS EDQUOT ENAMETOOLONG EFBIG EXDEV"
_USER_ERRNOS = frozenset(getattr(errno, name) for name in _ERRNO_NAMES.split() if hasattr(errno, name))
_USER_ERRORS = (CliError, ValueError, TypeError, OSError)


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is reported as one line (a bad argument, file or disk) rather than a traceback (a bug).

    CliError, ValueError (json.JSONDecodeError too), TypeError, FileNotFoundError, PermissionError,
    IsADirectoryError, NotADirectoryError, FileExistsError, and OSErrors of a full, read-only or
    missing disk or path are the user's; every other exception type is a bug of normatlas."""
    if isinstance(exc, (CliError, ValueError, TypeError)):
        return True
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)):
        return True
    return isinstance(exc, OSError) and exc.errno in _USER_ERRNOS


def describe_error(exc: BaseException) -> str:
    """A user error as one line of text, without the exception's type name."""
    if isinstance(exc, OSError) and exc.strerror and not isinstance(exc, CliError):
        text = exc.strerror
        if exc.filename is not None:
            text += f": {exc.filename}"
        if exc.filename2 is not None:
            text += f" -> {exc.filename2}"
    elif isinstance(exc, json.JSONDecodeError):
        text = f"not valid JSON ({exc})"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) or type(exc).__name__


def _quiet_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (captured in tests)
        pass


def _isatty(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``normatlas ARGV``; returns the exit code.

    0 done; 1 the result is a failure (a check that did not pass); 2 a user error, printed as one line
    ``normatlas COMMAND: error: ...`` (argparse's own usage errors exit 2 through SystemExit); 130
    interrupted (Ctrl-C); 141 stdout closed early (``| head``). A bug shows its traceback, as does every
    error with ``NORMATLAS_TRACEBACK=1``. Bare ``normatlas`` prints the help and exits 0.
    """
    from . import _progress

    # the commands show their own phases (cli/_progress.py); transformers' and the hub's tqdm bars would print
    # beside them, and into logs as one long line (set HF_HUB_DISABLE_PROGRESS_BARS=0 to keep them)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    name = "normatlas"
    try:
        parser = build_parser()
        if not argv:
            parser.print_help()
            return 0
        args = parser.parse_args(argv)
        name = f"normatlas {args.command}"
        code = int(args._run(args))
        sys.stdout.flush()  # a closed pipe shows up here, inside the handlers below
        return code
    except KeyboardInterrupt:
        _progress.clear()
        print(("\n" if _isatty(sys.stderr) else "") + f"{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _quiet_stdout()
        return 128 + getattr(signal, "SIGPIPE", 13)
    except _USER_ERRORS as exc:
        if not is_user_error(exc) or os.environ.get("NORMATLAS_TRACEBACK", "") not in ("", "0"):
            raise
        _progress.clear()
        print(f"{name}: error: {describe_error(exc)}", file=sys.stderr)
        return 2
