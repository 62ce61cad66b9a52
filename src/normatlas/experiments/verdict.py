"""Verdicts over seeds: a rule fixed in the experiment's file before it runs, applied to per-seed statistics.

An experiment's :class:`VerdictRule` is a tuple of :class:`Clause` values. Each clause names one statistic the
experiment measures at every seed (a float, or a :class:`Diverged` when the run it rests on went non-finite), a
:class:`Direction` and a threshold: ``ratio_no_bn_over_bn > 1``. Over the seeds a clause

- **holds** when every seed clears the threshold (the minimum over seeds, for ``>``),
- **does not hold** when no seed does (the maximum fails it),
- is **inconclusive** when the threshold lies inside the seed spread, when a seed could not test it
  (:class:`Untested`: e.g. the instability it watches never happened), or when a seed diverged and the clause's
  :class:`OnDivergence` says that leaves the set-up untested at that seed.

The claim holds when every clause holds; it does not hold when any clause does not (each such clause is named
in a sentence); otherwise it is inconclusive. A NaN never enters a comparison: :func:`as_statistic` turns every
non-finite number into a :class:`Diverged`, which the clause's ``on_divergence`` decides.

Each clause's **margin** at a seed is how far the statistic clears the threshold, in the statistic's units
(positive: passes). The record keeps it per seed with its minimum and maximum.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = [
    "Clause", "Direction", "Diverged", "OnDivergence", "Statistic", "Untested", "Verdict", "VerdictRule",
    "as_statistic", "decide",
]  # fmt: skip


class Verdict(Enum):
    """The claim's verdict over seeds (the string is its spelling in result.json and on the CLI)."""

    HOLDS = "holds"
    DOES_NOT_HOLD = "does not hold"
    INCONCLUSIVE = "inconclusive"


class Direction(Enum):
    """Which side of the threshold passes: ``ABOVE`` is ``statistic > threshold``, ``BELOW`` is ``<``."""

    ABOVE = ">"
    BELOW = "<"


class OnDivergence(Enum):
    """What a diverged seed means for a clause.

    ``UNTESTED``: the clause's set-up could not be tested at that seed, so the clause is at best inconclusive;
    ``FAILS``: divergence contradicts the clause (e.g. "trains stably"); ``PASSES``: divergence is what the
    clause predicts (e.g. "Post-LN without warm-up diverges")."""

    UNTESTED = "untested"
    FAILS = "fails"
    PASSES = "passes"


@dataclass(frozen=True)
class Diverged:
    """A run went non-finite: ``what`` diverged (a sentence fragment) and at which training ``step`` (``None``
    when no step applies, e.g. a statistic that came out NaN)."""

    what: str
    step: int | None = None

    def __post_init__(self) -> None:
        if not self.what:
            raise ValueError("Diverged.what must say what diverged")
        if self.step is not None and (not isinstance(self.step, int) or isinstance(self.step, bool) or self.step < 0):
            raise ValueError(f"Diverged.step={self.step!r} must be None or an integer >= 0")

    def sentence(self) -> str:
        return f"{self.what} is not finite" if self.step is None else f"{self.what} diverged at step {self.step}"

    def to_json(self) -> dict[str, Any]:
        return {"diverged": self.what, "step": self.step}


@dataclass(frozen=True)
class Untested:
    """The seed's run could not test the clause for a reason other than divergence (``why``, a sentence: "the
    high-LR run never spiked, so there was nothing to warn of"). A clause with an untested seed is at best
    inconclusive."""

    why: str

    def __post_init__(self) -> None:
        if not self.why:
            raise ValueError("Untested.why must say why the seed could not test the clause")

    def sentence(self) -> str:
        return self.why

    def to_json(self) -> dict[str, Any]:
        return {"untested": self.why}


Statistic = float | Diverged | Untested


def as_statistic(value: Any, what: str = "the statistic") -> Statistic:
    """A float, or a :class:`Diverged` when ``value`` already is one or is not finite (a NaN is never compared)."""
    if isinstance(value, (Diverged, Untested)):
        return value
    if isinstance(value, bool) or (not isinstance(value, (int, float)) and not hasattr(value, "__float__")):
        raise TypeError(f"statistic {what!r}={value!r} must be a number or Diverged, not {type(value).__name__}")
    x = float(value)
    return x if math.isfinite(x) else Diverged(f"{what} ({x})")


@dataclass(frozen=True)
class Clause:
    """One comparison of the claim: ``statistic`` (a key of ``Outcome.statistics``) ``direction`` ``threshold``.
    ``says`` is the clause in words ("BN's gradient changes less along the step than no BN's")."""

    statistic: str
    direction: Direction
    threshold: float
    says: str
    on_divergence: OnDivergence = OnDivergence.UNTESTED

    def __post_init__(self) -> None:
        if not self.statistic or not self.says:
            raise ValueError(f"Clause(statistic={self.statistic!r}, says={self.says!r}): both must be non-empty")
        if not isinstance(self.direction, Direction):
            raise TypeError(f"Clause.direction={self.direction!r} must be a Direction ({list(Direction)})")
        if not isinstance(self.on_divergence, OnDivergence):
            raise TypeError(f"Clause.on_divergence={self.on_divergence!r} must be an OnDivergence")
        if isinstance(self.threshold, bool) or not math.isfinite(float(self.threshold)):
            raise ValueError(f"Clause {self.statistic!r}: threshold={self.threshold!r} must be a finite number")

    def relation(self) -> str:
        return f"{self.statistic} {self.direction.value} {self.threshold:g}"

    def margin(self, value: float) -> float:
        """How far ``value`` clears the threshold (positive: passes), in the statistic's units."""
        return value - self.threshold if self.direction is Direction.ABOVE else self.threshold - value


@dataclass(frozen=True)
class VerdictRule:
    """The claim's clauses, all of which must hold (see the module docstring for the rule over seeds)."""

    clauses: tuple[Clause, ...]

    def __post_init__(self) -> None:
        if not self.clauses or not all(isinstance(c, Clause) for c in self.clauses):
            raise ValueError(f"VerdictRule.clauses={self.clauses!r} must be a non-empty tuple of Clause")
        names = [c.statistic for c in self.clauses]
        if len(set(names)) != len(names):
            raise ValueError(f"VerdictRule: a statistic is used by two clauses: {names}")

    @property
    def statistics(self) -> tuple[str, ...]:
        return tuple(c.statistic for c in self.clauses)

    def describe(self) -> str:
        """The rule in one line, for the experiment's ``expected`` text and the docs."""
        return "; ".join(f"{c.says} ({c.relation()})" for c in self.clauses)


def _num(x: float) -> str:
    return f"{x:.4g}"


def _clause_record(clause: Clause, seeds: Sequence[int], values: Sequence[Statistic]) -> dict[str, Any]:
    tested = [(s, v) for s, v in zip(seeds, values, strict=True) if isinstance(v, float)]
    diverged = [(s, v) for s, v in zip(seeds, values, strict=True) if isinstance(v, Diverged)]
    margins = [clause.margin(v) for _, v in tested]
    passes = [m > 0 for m in margins]
    div = clause.on_divergence
    untested: list[tuple[int, Diverged | Untested]] = [
        (s, v) for s, v in zip(seeds, values, strict=True) if isinstance(v, Untested)
    ]
    untested += diverged if div is OnDivergence.UNTESTED else []
    passes += [div is OnDivergence.PASSES] * (len(diverged) - len(untested))
    nums = [v for _, v in tested]
    why = ""
    if untested or not passes:
        verdict = Verdict.INCONCLUSIVE
        why = f"{clause.says}: " + "; ".join(
            f"seed {s}: {v.sentence()}, so the set-up could not be tested there" for s, v in untested
        )
    elif all(passes):
        verdict = Verdict.HOLDS
    elif not any(passes):
        verdict = Verdict.DOES_NOT_HOLD
        why = f"{clause.says} failed at every seed: wanted {clause.relation()}"
        if nums:
            best = max(nums) if clause.direction is Direction.ABOVE else min(nums)
            why += f", best seed {_num(best)}"
        if diverged:
            why += "; " + "; ".join(f"seed {s}: {v.sentence()}" for s, v in diverged)
    else:
        verdict = Verdict.INCONCLUSIVE
        lo, hi = (min(nums), max(nums)) if nums else (math.nan, math.nan)
        why = f"{clause.says}: the threshold {clause.threshold:g} lies inside the seed spread [{_num(lo)}, {_num(hi)}]"
    per_seed: dict[str, Any] = {
        str(s): (v if isinstance(v, float) else v.to_json()) for s, v in zip(seeds, values, strict=True)
    }
    return {
        "statistic": clause.statistic, "says": clause.says, "direction": clause.direction.value,
        "threshold": clause.threshold, "on_divergence": clause.on_divergence.value, "per_seed": per_seed,
        "min": min(nums) if nums else None, "median": statistics.median(nums) if nums else None,
        "max": max(nums) if nums else None, "margin_min": min(margins) if margins else None,
        "margin_max": max(margins) if margins else None, "diverged_seeds": [s for s, _ in diverged],
        "untested_seeds": [s for s, v in untested if isinstance(v, Untested)],
        "verdict": verdict.value, "why": why,
    }  # fmt: skip


def decide(
    rule: VerdictRule, seeds: Sequence[int], per_seed: Sequence[Mapping[str, Any]]
) -> tuple[Verdict, list[dict[str, Any]], list[str]]:
    """The claim's verdict over ``seeds`` (``per_seed[i]`` is seed ``seeds[i]``'s statistics), one JSON record per
    clause, and the sentences that explain a verdict other than ``holds`` (which clause failed, or why a clause
    could not decide). Every statistic of the rule must be present at every seed (a KeyError names it)."""
    if len(seeds) != len(per_seed) or not seeds:
        raise ValueError(f"decide: {len(seeds)} seeds but {len(per_seed)} sets of statistics (need >= 1)")
    clauses = []
    for clause in rule.clauses:
        values = []
        for seed, stats in zip(seeds, per_seed, strict=True):
            if clause.statistic not in stats:
                raise KeyError(f"seed {seed} lacks the statistic {clause.statistic!r} (has {sorted(stats)})")
            values.append(as_statistic(stats[clause.statistic], clause.statistic))
        clauses.append(_clause_record(clause, seeds, values))
    verdicts = [Verdict(c["verdict"]) for c in clauses]
    if Verdict.DOES_NOT_HOLD in verdicts:
        verdict = Verdict.DOES_NOT_HOLD
    elif Verdict.INCONCLUSIVE in verdicts:
        verdict = Verdict.INCONCLUSIVE
    else:
        verdict = Verdict.HOLDS
    reasons = [c["why"] for c in clauses if c["verdict"] != Verdict.HOLDS.value and c["why"]]
    return verdict, clauses, reasons
