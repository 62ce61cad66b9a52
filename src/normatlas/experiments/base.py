"""The experiment contract: a claim of the guide, the rule that decides it, the code that measures it.

An :class:`Experiment` is a value: its name, the claim in one line, the guide's own words, the anchor paper (its
key in ``normatlas/data/papers.json``) with the number that paper reports, the :class:`~.verdict.VerdictRule`
that decides the claim (fixed in the experiment's file, before anything runs), runtime estimates per seed at
each :class:`Scale`, and ``run``: a function of a :class:`RunContext` (one seed, one scale) that returns an
:class:`Outcome` (the per-seed statistics the rule reads, the measured numbers, the raw series and a matplotlib
figure). :func:`normatlas.experiments.runner.run_experiment` runs it at every seed, caches each seed's outcome on
disk, applies the rule over the seeds and writes ``result.json``, ``figure.png`` / ``figure.svg`` and one CSV
per series.

The words of every claim (its number, title, one-line claim, the guide's words, the anchor and what the anchor
reports) are data, ``normatlas/data/claims.json`` (read by :func:`claim`); an experiment's file names its claim
with :meth:`Experiment.declare` and holds the rule and the measurement.

An experiment never retries or tunes until its claim holds: the rule is data, and the runner applies it.
:class:`Scale` sizes the work: ``quick`` (seconds: the test suite), ``default`` (a minute or so per seed on
2 cores) and ``paper`` (the deep models and long runs the claims are about; an estimate per experiment).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from .verdict import Diverged, Statistic, VerdictRule

__all__ = ["Claim", "Experiment", "Outcome", "RunContext", "Scale", "Series", "claim", "claims"]

Scalar = float | int | str | bool | None


class Scale(Enum):
    """How much work a run does (the string is the CLI's ``--scale`` value)."""

    QUICK = "quick"
    DEFAULT = "default"
    PAPER = "paper"

    @classmethod
    def parse(cls, value: Scale | str) -> Scale:
        if isinstance(value, Scale):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"scale={value!r} is not one of {[s.value for s in cls]}") from None


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
    """What ``Experiment.run`` returns for one seed.

    ``statistics``: the numbers the experiment's rule reads, one per clause (a float, or a
    :class:`~.verdict.Diverged` naming what went non-finite and at which step). ``measured``: every number a
    reader needs beside them (JSON scalars or short lists of them). ``series``: the raw data of the figure, one
    CSV each. ``figure``: a matplotlib Figure whose title states the claim, with labelled axes (units) and a
    legend. ``notes``: anything a reader needs to judge the verdict (the scale, what differs from the paper).
    """

    statistics: Mapping[str, Statistic]
    measured: dict[str, Any]
    series: Mapping[str, Series]
    figure: Any
    notes: str = ""


@dataclass
class RunContext:
    """What one seed of an experiment is run with. ``size(default, quick, paper=)`` picks a count by scale;
    ``progress(msg)`` reports a step on stderr (the CLI's status line); ``shared`` is where trained sets that
    several experiments read are cached (``None``: train in memory)."""

    scale: Scale
    seed: int
    progress: Callable[[str], None] = field(default=lambda msg: None)
    threads: int | None = None
    shared: Path | None = None  # a folder for what several experiments train once (the runner's DIR/_shared)

    def __post_init__(self) -> None:
        self.scale = Scale.parse(self.scale)

    @property
    def quick(self) -> bool:
        return self.scale is Scale.QUICK

    def size(self, default: int, quick: int, paper: int | None = None) -> int:
        """``quick`` at quick scale, ``paper`` at paper scale (``default`` when the paper scale needs no more),
        ``default`` otherwise."""
        if self.scale is Scale.QUICK:
            return quick
        if self.scale is Scale.PAPER and paper is not None:
            return paper
        return default

    def pick(self, default: Any, quick: Any, paper: Any = None) -> Any:
        """:meth:`size` for any value (a tuple of widths, a list of learning rates)."""
        if self.scale is Scale.QUICK:
            return quick
        return paper if self.scale is Scale.PAPER and paper is not None else default

    def generator(self, offset: int = 0) -> torch.Generator:
        """A CPU generator seeded from ``seed`` (``offset`` gives independent streams)."""
        return torch.Generator().manual_seed(self.seed * 1_000_003 + offset)

    @property
    def flag(self) -> str:
        """The scale as CLI flags, for figure captions (empty at the default scale)."""
        return "" if self.scale is Scale.DEFAULT else f" --scale {self.scale.value}"


def diverged_or(value: float, log_diverged_at: int | None, what: str) -> Statistic:
    """``value``, or a :class:`~.verdict.Diverged` for ``what`` at ``log_diverged_at`` when that run diverged."""
    if log_diverged_at is not None:
        return Diverged(what, log_diverged_at)
    return value


@dataclass(frozen=True)
class Claim:
    """A claim's words, as ``normatlas/data/claims.json`` holds them."""

    name: str
    number: int
    title: str
    claim: str
    guide_words: str
    anchor: str
    anchor_reports: str


CLAIM_FIELDS = ("name", "number", "title", "claim", "guide_words", "anchor", "anchor_reports")


@cache
def claims() -> tuple[Claim, ...]:
    """Every claim of ``normatlas/data/claims.json``, in its number order; a ValueError names a malformed entry."""
    path = resources.files("normatlas").joinpath("data").joinpath("claims.json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    rows = data.get("claims") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected an object with a list 'claims'")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or sorted(row) != sorted(CLAIM_FIELDS):
            raise ValueError(f"{path}: claims[{i}] must have exactly the fields {list(CLAIM_FIELDS)}")
        bad = [k for k in CLAIM_FIELDS if not isinstance(row[k], int if k == "number" else str)]
        if bad:
            raise ValueError(f"{path}: claims[{i}] ({row.get('name')!r}): wrong type for {bad}")
        out.append(Claim(**row))
    names, numbers = [c.name for c in out], [c.number for c in out]
    if len(set(names)) != len(names) or len(set(numbers)) != len(numbers):
        raise ValueError(f"{path}: claim names and numbers must be unique")
    return tuple(sorted(out, key=lambda c: c.number))


def claim(name: str) -> Claim:
    """The claim called ``name``; a ValueError lists the known names otherwise."""
    found = {c.name: c for c in claims()}.get(name)
    if found is None:
        raise ValueError(f"claim={name!r} is not in normatlas/data/claims.json: {[c.name for c in claims()]}")
    return found


@dataclass(frozen=True)
class Experiment(Claim):
    """One claim of the guide (its words, as :class:`Claim`) and how it is measured and decided (see the module
    docstring).

    ``estimates_s``: seconds per seed at each scale, measured on an idle 2-core CPU (paper scale: an estimate)."""

    rule: VerdictRule
    estimates_s: Mapping[Scale, float]
    run: Callable[[RunContext], Outcome]
    depends: tuple[str, ...] = ()  # modules (dotted names) whose source also keys the seed cache (shared sets)

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").isalnum() or self.name != self.name.lower():
            raise ValueError(f"Experiment.name={self.name!r} must be lower-case words joined by '-'")
        for f in ("title", "claim", "guide_words", "anchor"):
            if not getattr(self, f):
                raise ValueError(f"Experiment {self.name!r}: {f} is empty")
        if not isinstance(self.rule, VerdictRule):
            raise TypeError(f"Experiment {self.name!r}: rule={self.rule!r} must be a VerdictRule")
        if set(self.estimates_s) != set(Scale):
            raise ValueError(f"Experiment {self.name!r}: estimates_s needs every scale {[s.value for s in Scale]}")
        for scale, v in self.estimates_s.items():
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"Experiment {self.name!r}: estimates_s[{scale.value}]={v!r} must be seconds > 0")

    @property
    def expected(self) -> str:
        """The rule in words: what must hold at every seed."""
        return self.rule.describe()

    @classmethod
    def declare(
        cls,
        name: str,
        *,
        rule: VerdictRule,
        estimates_s: Mapping[Scale, float],
        run: Callable[[RunContext], Outcome],
        depends: tuple[str, ...] = (),
    ) -> Experiment:
        """The experiment measuring the claim ``name`` of ``normatlas/data/claims.json`` (its words come from
        there) with ``rule``, ``estimates_s``, ``run`` and ``depends`` as in the constructor."""
        return cls(**asdict(claim(name)), rule=rule, estimates_s=estimates_s, run=run, depends=depends)

    def estimate_s(self, scale: Scale) -> float:
        return float(self.estimates_s[scale])


def estimates(default: float, quick: float, paper: float) -> dict[Scale, float]:
    """``Experiment.estimates_s`` by keyword: seconds per seed at each scale."""
    return {Scale.DEFAULT: default, Scale.QUICK: quick, Scale.PAPER: paper}
