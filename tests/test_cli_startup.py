"""The command's start: ``--version`` and ``--help`` import no command module and no torch / transformers, every
``normatlas SUB --help`` exits 0 without them, and its help fits 100 columns.

Import checks, not wall-clock ones: ``python -X importtime`` names every module a process imports (on stderr, one
``import time: self | cumulative | name`` line each), so the assertions hold on a loaded machine as on an idle one.
Before: every call imported all command modules, torch with them (~3 s before ``--version`` answered).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import normatlas
from normatlas.cli import TABLE

SRC = str(Path(normatlas.__file__).resolve().parents[1])  # the package under test, for subprocesses
HEAVY = ("torch", "transformers", "safetensors", "numpy", "matplotlib")  # none of them needed to print help
WIDTH = 100


def _run(*argv: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """``python -X importtime -m normatlas ARGV`` at COLUMNS=100; returns the process and the modules it imported."""
    env = dict(os.environ, PYTHONPATH=SRC, COLUMNS=str(WIDTH), HF_HUB_OFFLINE="1", NORMATLAS_PROGRESS="0")
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "normatlas", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    imported.discard("package")  # the header line: "import time: self [us] | cumulative | imported package"
    return proc, imported


def _heavy(imported: set[str]) -> list[str]:
    return sorted(m for m in imported if m.split(".")[0] in HEAVY)


@pytest.mark.parametrize("flag", ["--version", "--help"])
def test_version_and_help_import_no_command_and_no_torch(flag: str) -> None:
    proc, imported = _run(flag)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip(), "printed nothing"
    assert _heavy(imported) == [], f"normatlas {flag} imported {_heavy(imported)[:10]}"
    commands = sorted(m for m in imported if m.startswith("normatlas.cli.") and not m.startswith("normatlas.cli._"))
    assert commands == [], f"normatlas {flag} imported command modules {commands}"
    if flag == "--help":
        listed = re.findall(r"^    (\S+)", proc.stdout, flags=re.MULTILINE)  # argparse indents each command by 4
        assert listed == [e.name for e in TABLE], proc.stdout  # every row of the table, in its order


@pytest.mark.parametrize("name", [e.name for e in TABLE])
def test_every_command_help_exits_0_fits_100_columns_and_imports_no_torch(name: str) -> None:
    proc, imported = _run(name, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: normatlas {name}")
    long = [line for line in proc.stdout.splitlines() if len(line) > WIDTH]
    assert long == [], f"normatlas {name} --help: {len(long)} lines over {WIDTH} columns, e.g. {long[0]!r}"
    assert _heavy(imported) == [], f"normatlas {name} --help imported {_heavy(imported)[:10]}"
    module = next(e.module for e in TABLE if e.name == name)
    others = {f"normatlas.cli.{e.module}" for e in TABLE if e.module != module} & imported
    assert others == set(), f"normatlas {name} --help imported other commands' modules {sorted(others)}"
