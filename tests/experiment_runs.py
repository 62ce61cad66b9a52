"""Each experiment run once per test session in quick mode (seed 0), shared by the experiment test files.

:func:`quick_run` runs an experiment through :func:`~normatlas.experiments.runner.run_experiment` into a
temporary folder and keeps the record, the folder and the :class:`~normatlas.experiments.Outcome` the
experiment returned (captured by wrapping its ``run``), so the files can be checked against the series.
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
def quick_run(name: str) -> QuickRun:
    exp = experiment(name)
    seen: list[Outcome] = []

    def capture(ctx: RunContext) -> Outcome:
        seen.append(exp.run(ctx))
        return seen[-1]

    record = run_experiment(replace(exp, run=capture), _ROOT, quick=True, seed=0)
    return QuickRun(record, _ROOT / name, seen[0])
