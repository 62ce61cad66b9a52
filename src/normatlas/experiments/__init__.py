"""The guide's quantitative claims, each reproduced by one experiment with a figure.

``normatlas experiments list / run / report`` on the CLI. Every module named ``eNN_<name>.py`` in this
package defines one :class:`~normatlas.experiments.base.Experiment` as ``EXPERIMENT``;
:func:`experiments` finds them (in their number order), so adding a claim is adding a file.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from functools import cache

from .base import Experiment, Outcome, RunContext, Series

__all__ = ["Experiment", "Outcome", "RunContext", "Series", "experiment", "experiments"]

_MODULE = re.compile(r"e\d\d_[a-z0-9_]+$")


@cache
def experiments() -> tuple[Experiment, ...]:
    """Every experiment of the package, ordered by number."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        if _MODULE.match(info.name):
            module = importlib.import_module(f"{__name__}.{info.name}")
            exp = getattr(module, "EXPERIMENT", None)
            if not isinstance(exp, Experiment):
                raise TypeError(f"{module.__name__} must define EXPERIMENT = Experiment.declare(...)")
            found.append(exp)
    names = [e.name for e in found]
    if len(set(names)) != len(names):
        raise ValueError(f"experiment names repeat: {sorted(names)}")
    return tuple(sorted(found, key=lambda e: e.number))


def experiment(name: str) -> Experiment:
    """The experiment called ``name``; a ValueError lists the known names otherwise."""
    for e in experiments():
        if e.name == name:
            return e
    raise ValueError(f"experiment={name!r} is not one of {[e.name for e in experiments()]}")
