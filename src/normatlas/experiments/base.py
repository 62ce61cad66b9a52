"""The experiment contract: a claim of the guide, the code that measures it, and what it wrote.

An :class:`Experiment` is a value: its name, the claim in one line, the guide's own words, the
anchor paper (its key in ``normatlas/data/papers.json``) with the number that paper reports, the
expected direction or relation, a runtime estimate, and ``run``: a function of a
:class:`RunContext` that returns an :class:`Outcome` (the measured numbers, the verdict, the raw
series and a matplotlib figure). :func:`normatlas.experiments.runner.run_experiment` times it,
seeds it and writes ``result.json``, ``figure.png`` / ``figure.svg`` and one CSV per series.

A verdict is computed from what was measured, against a relation fixed before the run: an
experiment never retries or tunes until its claim holds. ``--quick`` shrinks the work (fewer
steps, smaller models) so the test suite can check every claim's direction in seconds; a claim
that does not hold at quick scale says so exactly as at full scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Experiment", "Outcome", "RunContext", "Series"]

Scalar = float | int | str | bool | None


@dataclass(frozen=True)
class Series:
    """One table of raw numbers behind a figure: ``columns`` names, ``rows`` of equal length."""

    columns: tuple[str, ...]
    rows: Sequence[Sequence[Scalar]]

    def __post_init__(self) -> None:
        if not self.columns:
            raise ValueError("Series.columns must name at least one column")
        for i, row in enumerate(self.rows):
            if len(row) != len(self.columns):
                raise ValueError(f"Series row {i} has {len(row)} values but columns={self.columns!r}")

    @classmethod
    def of(cls, **columns: Sequence[Scalar]) -> Series:
        """Columns given by name: ``Series.of(step=[0, 1], loss=[2.3, 2.1])``."""
        lengths = {len(v) for v in columns.values()}
        if len(lengths) > 1:
            raise ValueError(f"Series.of columns differ in length: { {k: len(v) for k, v in columns.items()} }")
        return cls(tuple(columns), list(zip(*columns.values(), strict=True)))


@dataclass
class Outcome:
    """What ``Experiment.run`` returns.

    ``measured``: the numbers the verdict rests on (JSON scalars or short lists of them).
    ``holds``: the verdict, computed from ``measured`` against ``Experiment.expected``.
    ``series``: the raw data of the figure, one CSV each. ``figure``: a matplotlib Figure whose title
    states the claim, with labelled axes (units) and a legend. ``notes``: anything a reader needs to
    judge the verdict (the scale, what differs from the paper's setting).
    """

    measured: dict[str, Any]
    holds: bool
    series: Mapping[str, Series]
    figure: Any
    notes: str = ""


@dataclass
class RunContext:
    """What an experiment is run with. ``size(full, quick)`` picks a count by mode; ``progress(msg)``
    reports a step on stderr (the CLI's status line)."""

    quick: bool
    seed: int
    progress: Callable[[str], None] = field(default=lambda msg: None)
    threads: int | None = None

    def size(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    def generator(self, offset: int = 0) -> torch.Generator:
        """A CPU generator seeded from ``seed`` (``offset`` gives independent streams)."""
        return torch.Generator().manual_seed(self.seed * 1_000_003 + offset)


@dataclass(frozen=True)
class Experiment:
    """One claim of the guide and how it is measured (see the module docstring)."""

    name: str
    number: int
    title: str
    claim: str
    guide_words: str
    anchor: str
    anchor_reports: str
    expected: str
    estimate_s: float
    quick_estimate_s: float
    run: Callable[[RunContext], Outcome]

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").isalnum() or self.name != self.name.lower():
            raise ValueError(f"Experiment.name={self.name!r} must be lower-case words joined by '-'")
        for f in ("title", "claim", "guide_words", "anchor", "expected"):
            if not getattr(self, f):
                raise ValueError(f"Experiment {self.name!r}: {f} is empty")
        for f in ("estimate_s", "quick_estimate_s"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"Experiment {self.name!r}: {f}={v!r} must be a positive number of seconds")
