"""Each experiment run once per test session at quick scale and seed 0, shared by the experiment test files.

:func:`quick_run` runs an experiment through :func:`~normatlas.experiments.runner.run_experiment` into a
temporary folder and keeps the record, the folder and the :class:`~normatlas.experiments.Outcome` the
experiment returned (captured by wrapping its ``run``), so the files can be checked against the series. One
seed keeps the suite fast; the verdicts over three seeds are asserted only where they are stable
(``test_experiments_verdicts.py``).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

from normatlas.experiments import Outcome, RunContext, experiment
from normatlas.experiments.runner import run_experiment

_ROOT = Path(tempfile.mkdtemp(prefix="normatlas-experiments-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


@dataclass(frozen=True)
class QuickRun:
    record: dict[str, Any]
    folder: Path
    outcome: Outcome


@cache
def quick_run(name: str, seeds: tuple[int, ...] = (0,)) -> QuickRun:
    """``name`` at quick scale and ``seeds`` (each tuple of seeds has its own folder)."""
    exp = experiment(name)
    seen: list[Outcome] = []

    def capture(ctx: RunContext) -> Outcome:
        seen.append(exp.run(ctx))
        return seen[-1]

    root = _ROOT / "-".join(map(str, seeds))
    record = run_experiment(replace(exp, run=capture), root, scale="quick", seeds=seeds)
    return QuickRun(record, root / name, seen[0])
