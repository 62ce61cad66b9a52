"""Run an experiment and write what it measured: ``DIR/NAME/result.json``, ``figure.png`` / ``.svg``
and ``<series>.csv``.

The run is seeded (torch's global generator and the context's generators), single-process, and its
wall time is measured around ``Experiment.run`` only. ``result.json`` holds the claim and the guide's
words, the anchor paper and the number it reports, the expected relation, the measured numbers, the
verdict (``holds``), the seed, the mode, the seconds and the command that reproduces it. Files are
written to a temporary name first and renamed, so a crashed run never leaves a half-written result.
"""

from __future__ import annotations

import csv
import functools
import json
import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .base import Experiment, Outcome, RunContext

__all__ = ["RESULT_FIELDS", "load_result", "run_experiment", "use_agg"]

RESULT_FIELDS = (
    "name", "number", "title", "claim", "guide_words", "anchor", "anchor_reports", "expected",
    "measured", "holds", "notes", "seed", "quick", "seconds", "command", "files", "torch", "machine",
)  # fmt: skip


def use_agg() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (no display here), imported lazily."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("the experiments draw with matplotlib: pip install matplotlib") from exc
    return plt


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _jsonable(value.tolist())
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if hasattr(value, "item"):
        return _jsonable(value.item())
    raise TypeError(f"measured value {value!r} of type {type(value).__name__} is not a JSON scalar or list")


def _atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_csv(path: Path, columns: tuple[str, ...], rows: Any) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows(rows)


def run_experiment(
    exp: Experiment,
    out: str | os.PathLike[str],
    *,
    quick: bool = False,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """Run ``exp`` and write its files under ``out/exp.name``; returns the result record."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed={seed!r} must be an integer >= 0")
    plt = use_agg()
    folder = Path(out) / exp.name
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    ctx = RunContext(quick=quick, seed=seed, progress=progress or (lambda msg: None))
    start = time.perf_counter()
    outcome = exp.run(ctx)
    seconds = time.perf_counter() - start
    if not isinstance(outcome, Outcome):
        raise TypeError(f"{exp.name}: run returned {type(outcome).__name__}, not an Outcome")
    files = []
    for key, series in outcome.series.items():
        name = f"{key}.csv"
        _atomic_write(folder / name, functools.partial(_write_csv, columns=series.columns, rows=series.rows))
        files.append(name)
    for ext in ("png", "svg"):
        name = f"figure.{ext}"
        _atomic_write(
            folder / name, functools.partial(outcome.figure.savefig, format=ext, dpi=120, bbox_inches="tight")
        )
        files.append(name)
    plt.close(outcome.figure)
    record = {
        "name": exp.name, "number": exp.number, "title": exp.title, "claim": exp.claim,
        "guide_words": exp.guide_words, "anchor": exp.anchor, "anchor_reports": exp.anchor_reports,
        "expected": exp.expected, "measured": _jsonable(outcome.measured), "holds": bool(outcome.holds),
        "notes": outcome.notes, "seed": seed, "quick": quick, "seconds": round(seconds, 2),
        "command": command or f"normatlas experiments run {exp.name}{' --quick' if quick else ''} --seed {seed}",
        "files": files, "torch": torch.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
    }  # fmt: skip
    text = json.dumps(record, indent=2) + "\n"
    _atomic_write(folder / "result.json", lambda p: p.write_text(text))
    return record


def load_result(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """A ``result.json`` read back, checked to have every field."""
    path = Path(folder) / "result.json"
    record = json.loads(path.read_text())
    missing = [f for f in RESULT_FIELDS if f not in record]
    if missing:
        raise ValueError(f"{path} lacks the fields {missing}")
    return record
