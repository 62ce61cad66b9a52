"""The command line: one explicit table (:data:`TABLE`) from subcommand to a typed, importable function.

Each row names the module in this package, its ``run(args: argparse.Namespace) -> int`` and its
``configure(parser) -> None``, and the one-line help; ``normatlas --help`` lists the rows in this order.
A new subcommand is a function pair in a module here and one row below. ``normatlas --help`` lists the rows
without importing a command module, ``normatlas SUB`` imports only SUB's, and every module here imports its heavy
dependencies (torch, transformers) inside its run function, so ``--help`` and ``--version`` answer in a fraction
of a second and ``SUB --help`` too (tests/test_cli_startup.py holds them to it).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import math
import os
import signal
import sys
import textwrap
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COMMANDS",
    "TABLE",
    "CliError",
    "Command",
    "Entry",
    "HelpFormatter",
    "add_attention_option",
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


@dataclass(frozen=True)
class Entry:
    """One row of :data:`TABLE`: ``normatlas NAME`` runs ``normatlas.cli.MODULE.RUN``; CONFIGURE builds its options."""

    name: str
    module: str
    run: str
    configure: str
    help: str

    def load(self) -> Command:
        mod = importlib.import_module(f"{__name__}.{self.module}")
        return Command(self.name, self.help, getattr(mod, self.configure), getattr(mod, self.run))


TABLE: tuple[Entry, ...] = (
    Entry(
        "demo",
        "demo",
        "demo",
        "configure_demo",
        "the taxonomy table, then every preset checked against its torch / HF peer",
    ),
    Entry(
        "axes",
        "axes",
        "axes",
        "configure_axes",
        "print which reduced axes name which normalization layer (vision and sequence)",
    ),
    Entry(
        "inspect",
        "inspect_cmd",
        "inspect_cmd",
        "configure_inspect",
        "report a model's normalization design, derived from its traced dataflow",
    ),
    Entry(
        "port",
        "port_cmd",
        "port_cmd",
        "configure_port",
        "port a transformers decoder into our Block from its dataflow (no key map); --check proves it",
    ),
    Entry(
        "matrix",
        "atlas_cmd",
        "matrix",
        "configure_matrix",
        "the essay's model matrix: operator, placement, QK-norm, VLM tower and connector",
    ),
    Entry(
        "papers",
        "atlas_cmd",
        "papers",
        "configure_papers",
        "the essay's bibliography, grouped by the question each paper answers",
    ),
    Entry(
        "diagnose",
        "diagnose",
        "diagnose",
        "configure_diagnose",
        "per-layer residual stats, attention entropy and massive activations on real weights",
    ),
    Entry(
        "fold",
        "surgery",
        "fold",
        "configure_fold",
        "fold norm gains into their linear consumers (FlashNorm), proven before writing",
    ),
    Entry(
        "absorb",
        "surgery",
        "absorb",
        "configure_absorb",
        "absorb post-branch RMSNorms, rms frozen on calibration text",
    ),
    Entry(
        "convert",
        "surgery",
        "convert",
        "configure_convert",
        "convert normalization: ln-rms, gain (w <-> 1+w), eps, bn-fold, bn-frozen; proven first",
    ),
    Entry(
        "verify",
        "surgery",
        "verify",
        "configure_verify",
        "load a surgery output back and compare it with the original on probe inputs",
    ),
    Entry(
        "lens",
        "tools_cmd",
        "lens",
        "configure_lens",
        "logit lens: each layer's stream decoded through the model's own final norm and head (--tuned refits it)",
    ),
    Entry(
        "prune",
        "tools_cmd",
        "prune",
        "configure_prune",
        "score layers by how little they turn the stream, drop the k lowest, measure the loss, write proven",
    ),
    Entry(
        "embeddings",
        "tools_cmd",
        "embeddings",
        "configure_embeddings",
        "the norm of every token's embedding: outliers and special tokens flagged",
    ),
    Entry(
        "outliers",
        "tools_cmd",
        "outliers",
        "configure_outliers",
        "massive activations and int8/fp8 error at each norm's input and output; SmoothQuant-style fold proven",
    ),
    Entry(
        "cost",
        "tools_cmd",
        "cost",
        "configure_cost",
        "what normalization costs: QK-norm vs soft-capping vs neither around sdpa, and each placement, as ratios",
    ),
    Entry(
        "zoo",
        "tools_cmd",
        "zoo",
        "configure_zoo",
        "train and save a small model for the tools (byte-llama: a LlamaForCausalLM on stdlib sources)",
    ),
    Entry(
        "bench",
        "bench",
        "bench",
        "configure_bench",
        "time the fused norm kernels against torch, HF-style eager and torch.compile",
    ),
    Entry(
        "serve",
        "serve_cmd",
        "serve",
        "configure_serve",
        "the atlas as a local web page: axes, placements, matrix, papers, inspect, experiments",
    ),
    Entry(
        "kernels",
        "kernels_cmd",
        "kernels",
        "configure_kernels",
        "build the C++ CPU kernels once (shared by every checkout and venv), or show them",
    ),
    Entry(
        "experiments",
        "experiments_cmd",
        "experiments",
        "configure_experiments",
        "the guide's quantitative claims, each measured on real data with a figure: list, run, report",
    ),
)

_NAMES = frozenset(e.name for e in TABLE)
COMMANDS: dict[str, Command] = {}  # the rows of the table loaded so far (tests may add entries)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, wrapped to the terminal (``COLUMNS``), with the line breaks of a description or epilog kept.

    Each line of the text is wrapped on its own, its continuation lines indented as it is, so an epilog can be a
    paragraph and an indented list (``exit codes:``, then one code a line) and still fit the width. (argparse's
    default joins every line into one paragraph; its Raw formatters keep lines of any length.)"""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines = []
        for line in text.splitlines():
            body = line.lstrip()
            pad = indent + line[: len(line) - len(body)]
            lines.append(textwrap.fill(body, width, initial_indent=pad, subsequent_indent=pad) if body else "")
        return "\n".join(lines)


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


ATTENTION_CHOICES = ("eager", "sdpa", "flex_attention")  # factory/attention.py's ATTENTION_IMPLEMENTATIONS (no import)


def add_attention_option(p: argparse.ArgumentParser) -> None:
    """``--attn-implementation``: the attention transformers models are built with (default: transformers' own
    choice, as ``from_pretrained`` makes it: sdpa where the model supports it)."""
    p.add_argument(
        "--attn-implementation",
        type=one_of(ATTENTION_CHOICES),
        default=None,
        metavar="{" + ",".join(ATTENTION_CHOICES) + "}",
        help="build transformers models with this attention (default: transformers' default, sdpa where supported)",
    )


def _run(args: argparse.Namespace) -> int:
    attn = getattr(args, "attn_implementation", None)
    if attn is None:
        return int(args._run(args))
    from ..factory import attention_implementation

    with attention_implementation(attn):
        return int(args._run(args))


def _command_in(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (``normatlas`` itself takes only
    ``-h`` / ``--help`` and ``--version``, neither with a value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``normatlas`` parser: one sub-parser per row of :data:`TABLE` (and per test entry of :data:`COMMANDS`).

    Only the sub-parsers named in ``commands`` (every one when None) are configured, which imports their modules;
    the others carry their name and help from the table alone. :func:`main` configures just the command it runs,
    so ``normatlas --help`` imports no command module and ``normatlas SUB`` only SUB's."""
    from .. import __version__

    wanted = {e.name for e in TABLE} | set(COMMANDS) if commands is None else set(commands)
    for entry in TABLE:
        if entry.name in wanted and entry.name not in COMMANDS:
            COMMANDS[entry.name] = entry.load()
    parser = argparse.ArgumentParser(
        prog="normatlas",
        description="The geometry of normalization, as working software.",
        epilog="`normatlas COMMAND --help` for a command's options; every command takes --format table|json|csv.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"normatlas {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    rows = [(e.name, e.help) for e in TABLE] + [(c.name, c.help) for c in COMMANDS.values() if c.name not in _NAMES]
    for name, text in rows:
        p = sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)
        if name in wanted and name in COMMANDS:
            COMMANDS[name].configure(p)
            p.set_defaults(_run=COMMANDS[name].run)
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
        command = _command_in(argv)
        parser = build_parser([command] if command else [])  # imports only the module of the command run
        if not argv:
            parser.print_help()
            return 0
        args = parser.parse_args(argv)
        name = f"normatlas {args.command}"
        code = _run(args)
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
