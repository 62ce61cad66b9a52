"""Run an experiment at every seed and write what it measured: ``DIR/NAME/result.json``, ``figure.png`` / ``.svg``
and ``<series>.csv``, with each seed's own files cached under ``DIR/NAME/seeds/<scale>-seed<S>/``.

Each seed is run seeded (torch's global generator and the context's generators), single-process, and timed around
``Experiment.run`` only. A seed's folder is complete once its ``outcome.json`` exists (written last, atomically),
so a killed run continues from its cache: the seeds already done are read back, not rerun, as long as the
experiment's code (its module and the modules it ``depends`` on, as syntax trees: docstrings, comments and layout
do not count), the scale and the torch version are unchanged (its cache ``key``). The verdict over the
seeds is the experiment's :class:`~.verdict.VerdictRule` applied by :func:`~.verdict.decide`.

``result.json`` holds the claim and the guide's words, the anchor paper and the number it reports, the rule, the
verdict with each clause's statistic per seed, its min / median / max, threshold and margin, the sentences that
explain a verdict other than ``holds``, the measured numbers per seed, the seeds, the scale, the run's metadata
(threads, CPU model, torch and Python versions, wall time, peak memory) and the command that reproduces it. The
top-level CSVs and figure are the first seed's; ``figure.png`` carries the verdict over the seeds above it.
Every file is written to a temporary name first and renamed, so a crashed run never leaves a half-written one.
"""

from __future__ import annotations

import ast
import csv
import functools
import hashlib
import importlib
import inspect
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._io import atomic_write, dumps, jsonable, read_json
from .base import Experiment, Outcome, RunContext, Scale
from .verdict import Diverged, Untested, Verdict, as_statistic, decide

__all__ = [
    "DEFAULT_SEEDS", "RESULT_FIELDS", "SeedPlan", "load_result", "machine_info", "plan_seeds", "run_experiment",
    "run_seed", "scale_folder", "statistic_from_json", "use_agg",
]  # fmt: skip

DEFAULT_SEEDS = (0, 1, 2)
RESULT_FIELDS = (
    "name", "number", "title", "claim", "guide_words", "anchor", "anchor_reports", "expected", "verdict",
    "holds", "reasons", "clauses", "measured", "measured_per_seed", "notes", "seeds", "scale", "quick",
    "seconds", "seconds_per_seed", "cached_seeds", "command", "files", "torch", "machine", "run",
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


def statistic_from_json(value: Any) -> Any:
    """A statistic as ``outcome.json`` / ``result.json`` spell it, back as a number, Diverged or Untested."""
    if isinstance(value, dict) and "diverged" in value:
        return Diverged(value["diverged"], value.get("step"))
    if isinstance(value, dict) and "untested" in value:
        return Untested(value["untested"])
    return value


def _save_figure(figure: Any, ext: str, path: Path) -> None:
    figure.savefig(path, format=ext, dpi=120, bbox_inches="tight")


def _write_csv(path: Path, columns: tuple[str, ...], rows: Any) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows(rows)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_rss_mib() -> float | None:
    """This process's peak resident memory so far (``ru_maxrss``), in MiB; None where ``resource`` is missing."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1 << 20 if sys.platform == "darwin" else 1 << 10), 1)  # bytes on macOS, KiB on Linux


def machine_info() -> dict[str, Any]:
    """What the numbers depend on beyond the seed: threads, CPU model and count, torch and Python versions."""
    return {
        "threads": torch.get_num_threads(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
        "machine": platform.machine(), "torch": torch.__version__, "python": platform.python_version(),
    }  # fmt: skip


def _code_only(text: str) -> str:
    """``text``'s syntax tree without docstrings, comments, line numbers or layout: an edit to those is not a
    change of what the experiment computes, so it keeps the cache."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            if doc and isinstance(first.value.value, str):  # type: ignore[attr-defined]
                node.body = node.body[1:] or [ast.Pass()]
    return ast.dump(tree)


def _source_hash(exp: Experiment, *, legacy: bool = False) -> str:
    """The hash of the code the experiment's numbers come from: its module and ``exp.depends`` (``legacy``: their
    raw text, the key of caches written before stop 42, still read so that kept evidence survives the change)."""
    text = ""
    for name in (getattr(exp.run, "__module__", ""), *exp.depends):
        module = sys.modules.get(name) or (importlib.import_module(name) if name in exp.depends else None)
        try:
            source = inspect.getsource(module) if module is not None else repr(exp.rule)
        except (OSError, TypeError):
            source = repr(exp.rule)
        text += source if legacy or module is None else _code_only(source)
    return hashlib.sha256((text + repr(exp.rule)).encode()).hexdigest()[:16]


def _cache_key(exp: Experiment, scale: Scale, seed: int, *, legacy: bool = False) -> dict[str, Any]:
    return {
        "name": exp.name,
        "scale": scale.value,
        "seed": seed,
        "source": _source_hash(exp, legacy=legacy),
        "torch": torch.__version__,
    }


def _seed_folder(folder: Path, scale: Scale, seed: int) -> Path:
    return folder / "seeds" / f"{scale.value}-seed{seed}"


def _cached(path: Path, *keys: dict[str, Any]) -> dict[str, Any] | None:
    """The seed's cached outcome when complete and made by the same code at the same scale (its key one of
    ``keys``), else None."""
    try:
        rec = json.loads((path / "outcome.json").read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(rec, dict) and rec.get("key") in keys and (path / "figure.png").is_file()
    return rec if ok else None


def _lookup(exp: Experiment, path: Path, scale: Scale, seed: int) -> dict[str, Any] | None:
    return _cached(path, _cache_key(exp, scale, seed), _cache_key(exp, scale, seed, legacy=True))


@dataclass(frozen=True)
class SeedPlan:
    """What ``run_experiment`` would do for one seed: read it from the cache or run it (``estimate_s`` seconds,
    the experiment's estimate at the scale on an idle 2-core CPU; 0 when cached)."""

    name: str
    seed: int
    cached: bool
    estimate_s: float


def plan_seeds(
    exp: Experiment, out: str | os.PathLike[str], *, scale: Scale | str = Scale.DEFAULT,
    seeds: Sequence[int] = DEFAULT_SEEDS, fresh: bool = False,
) -> list[SeedPlan]:  # fmt: skip
    """Which seeds of ``exp`` under ``out`` are cached for the code and torch of this process, and which would
    run; nothing is run or written."""
    scale = Scale.parse(scale)
    folder = Path(out) / exp.name
    plans = []
    for seed in seeds:
        hit = not fresh and _lookup(exp, _seed_folder(folder, scale, seed), scale, seed) is not None
        plans.append(SeedPlan(exp.name, seed, hit, 0.0 if hit else exp.estimate_s(scale)))
    return plans


def run_seed(
    exp: Experiment,
    out: str | os.PathLike[str],
    *,
    scale: Scale | str,
    seed: int,
    progress: Callable[[str], None] | None = None,
    fresh: bool = False,
) -> tuple[dict[str, Any], bool]:
    """One seed of ``exp`` under ``out``: its cached outcome record when the cache holds it for this code (and
    not ``fresh``), else the record of running it now, written to the cache; and whether it came from the cache."""
    scale = Scale.parse(scale)
    path = _seed_folder(Path(out) / exp.name, scale, seed)
    rec = None if fresh else _lookup(exp, path, scale, seed)
    if rec is not None:
        (progress or (lambda msg: None))("read from the cache")
        return rec, True
    if path.exists():
        shutil.rmtree(path)
    return _run_seed(exp, path, scale, seed, progress or (lambda msg: None), _cache_key(exp, scale, seed)), False


def _run_seed(
    exp: Experiment, path: Path, scale: Scale, seed: int, progress: Callable[[str], None], key: dict[str, Any]
) -> dict[str, Any]:
    plt = use_agg()
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    ctx = RunContext(scale=scale, seed=seed, progress=progress, shared=path.parents[2] / "_shared")
    start = time.perf_counter()
    outcome = exp.run(ctx)
    seconds = time.perf_counter() - start
    if not isinstance(outcome, Outcome):
        raise TypeError(f"{exp.name}: run returned {type(outcome).__name__}, not an Outcome")
    missing = [s for s in exp.rule.statistics if s not in outcome.statistics]
    if missing:
        raise ValueError(f"{exp.name} seed {seed}: the rule reads {missing}, which the outcome's statistics lack")
    stats = {k: as_statistic(outcome.statistics[k], k) for k in exp.rule.statistics}
    files = []
    for name, series in outcome.series.items():
        atomic_write(path / f"{name}.csv", functools.partial(_write_csv, columns=series.columns, rows=series.rows))
        files.append(f"{name}.csv")
    for ext in ("png", "svg"):
        atomic_write(path / f"figure.{ext}", functools.partial(_save_figure, outcome.figure, ext))
    plt.close(outcome.figure)
    rec = {
        "key": key, "statistics": jsonable(stats, strict=True), "measured": jsonable(outcome.measured, strict=True),
        "notes": outcome.notes, "seconds": round(seconds, 2), "peak_rss_mib": peak_rss_mib(),
        "threads": torch.get_num_threads(), "csv": files,
    }  # fmt: skip
    atomic_write(path / "outcome.json", dumps(rec, indent=2) + "\n")
    return rec


def _banner(verdict: Verdict, clauses: list[dict[str, Any]], seeds: Sequence[int], scale: Scale) -> list[str]:
    def num(x: Any) -> str:
        return "n/a" if x is None else f"{x:.3g}"

    lines = [f"verdict over seeds {', '.join(map(str, seeds))} ({scale.value} scale): {verdict.value.upper()}"]
    for c in clauses:
        div = f"; diverged at seeds {c['diverged_seeds']}" if c["diverged_seeds"] else ""
        lines.append(
            f"[{c['verdict']}] {c['statistic']} {c['direction']} {c['threshold']:g}: median {num(c['median'])} "
            f"[min {num(c['min'])}, max {num(c['max'])}], margin [{num(c['margin_min'])}, {num(c['margin_max'])}]{div}"
        )
    return lines


def _stamp_png(src: Path, dst: Path, lines: list[str], verdict: Verdict) -> None:
    """``src`` with the verdict lines above it (pixels copied 1:1, so nothing is resampled)."""
    plt = use_agg()
    img = plt.imread(src)
    h, w = img.shape[:2]
    dpi, line_px = 120, 17
    head = 12 + line_px * len(lines)
    width = max(w, 800)
    fig = plt.figure(figsize=(width / dpi, (h + head) / dpi), dpi=dpi)
    fig.figimage(img, xo=0, yo=0)
    color = {Verdict.HOLDS: "#0a6b2b", Verdict.DOES_NOT_HOLD: "#a11111", Verdict.INCONCLUSIVE: "#8a5a00"}[verdict]
    for i, line in enumerate(lines):
        y = 1 - (8 + line_px * (i + 0.5)) / (h + head)
        fig.text(6 / width, y, line, va="center", fontsize=10 if i == 0 else 7.5, color=color if i == 0 else "0.2",
                 weight="bold" if i == 0 else "normal", family="monospace" if i else None)  # fmt: skip
    atomic_write(dst, lambda p: fig.savefig(p, format="png", dpi=dpi))
    plt.close(fig)


def _seed_progress(report: Callable[[str], None], prefix: str, msg: str) -> None:
    report(f"{prefix}: {msg}")


def run_experiment(
    exp: Experiment,
    out: str | os.PathLike[str],
    *,
    scale: Scale | str = Scale.DEFAULT,
    seeds: Sequence[int] = DEFAULT_SEEDS,
    progress: Callable[[str], None] | None = None,
    command: str | None = None,
    fresh: bool = False,
    ran_elsewhere: Sequence[int] = (),
) -> dict[str, Any]:
    """Run ``exp`` at every seed of ``seeds`` (reading back seeds cached by an earlier run unless ``fresh``),
    decide its verdict and write its files under ``out/exp.name``; returns the result record. ``ran_elsewhere``:
    seeds this same command has just run into the cache (worker processes, :mod:`.pool`), which the record does
    not count as ``cached_seeds``."""
    scale = Scale.parse(scale)
    seeds = tuple(seeds)
    for s in seeds:
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise ValueError(f"seed={s!r} must be an integer >= 0")
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds={seeds!r} must be one or more distinct integers")
    report = progress or (lambda msg: None)
    folder = Path(out) / exp.name
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    per_seed, cached = [], []
    for i, seed in enumerate(seeds, 1):
        step = functools.partial(_seed_progress, report, f"seed {seed} ({i}/{len(seeds)})")
        rec, hit = run_seed(exp, out, scale=scale, seed=seed, progress=step, fresh=fresh)
        if hit and seed not in ran_elsewhere:
            cached.append(seed)
        per_seed.append(rec)
    wall = time.perf_counter() - start
    stats = [{k: statistic_from_json(v) for k, v in r["statistics"].items()} for r in per_seed]
    verdict, clauses, reasons = decide(exp.rule, seeds, stats)
    first = _seed_folder(folder, scale, seeds[0])
    files = []
    for name in per_seed[0]["csv"]:
        atomic_write(folder / name, functools.partial(shutil.copyfile, first / name))
        files.append(name)
    _stamp_png(first / "figure.png", folder / "figure.png", _banner(verdict, clauses, seeds, scale), verdict)
    files.append("figure.png")
    if (first / "figure.svg").is_file():  # a kept cache may hold the PNG only (docs/results keeps no SVG)
        atomic_write(folder / "figure.svg", functools.partial(shutil.copyfile, first / "figure.svg"))
        files.append("figure.svg")
    flags = "" if scale is Scale.DEFAULT else f" --scale {scale.value}"
    if seeds != DEFAULT_SEEDS:
        flags += (
            f" --seed {seeds[0]} --seeds {len(seeds)}" if seeds == tuple(range(seeds[0], seeds[0] + len(seeds))) else ""
        )
    record = {
        "name": exp.name, "number": exp.number, "title": exp.title, "claim": exp.claim,
        "guide_words": exp.guide_words, "anchor": exp.anchor, "anchor_reports": exp.anchor_reports,
        "expected": exp.expected, "verdict": verdict.value, "holds": verdict is Verdict.HOLDS, "reasons": reasons,
        "clauses": clauses, "measured": per_seed[0]["measured"],
        "measured_per_seed": {str(s): r["measured"] for s, r in zip(seeds, per_seed, strict=True)},
        "notes": per_seed[0]["notes"], "seeds": list(seeds), "scale": scale.value, "quick": scale is Scale.QUICK,
        "seconds": round(sum(r["seconds"] for r in per_seed), 2),
        "seconds_per_seed": {str(s): r["seconds"] for s, r in zip(seeds, per_seed, strict=True)},
        "cached_seeds": cached, "command": command or f"normatlas experiments run {exp.name}{flags}",
        "files": files, "torch": torch.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "run": {
            **machine_info(), "wall_s": round(wall, 2), "peak_rss_mib": peak_rss_mib(),
            "seeds_run_in_workers": [s for s in seeds if s in ran_elsewhere],
            "threads_per_seed": {str(s): r.get("threads") for s, r in zip(seeds, per_seed, strict=True)},
            "peak_rss_mib_per_seed": {str(s): r.get("peak_rss_mib") for s, r in zip(seeds, per_seed, strict=True)},
        },
    }  # fmt: skip
    text = dumps(record, indent=2) + "\n"
    at_scale = scale_folder(folder, scale)  # this scale's own copy: a later run at another scale keeps it
    at_scale.mkdir(parents=True, exist_ok=True)
    for name in files:
        atomic_write(at_scale / name, (folder / name).read_bytes())
    atomic_write(at_scale / "result.json", text)
    atomic_write(folder / "result.json", text)
    return record


def scale_folder(folder: str | os.PathLike[str], scale: Scale | str) -> Path:
    """Where an experiment's result at one scale is kept (``DIR/NAME/scales/<scale>/``): ``DIR/NAME/result.json``
    is the latest run at any scale, this folder the latest at ``scale``."""
    return Path(folder) / "scales" / Scale.parse(scale).value


_TEXT = ((str,), None, "a string")
# each field of a result.json: (the types it may have, the type of each item of a list, what to say it must be)
_FIELD_TYPES: dict[str, tuple[tuple[type, ...], type | tuple[type, ...] | None, str]] = {
    **{f: _TEXT for f in ("name", "title", "claim", "guide_words", "anchor", "anchor_reports", "expected", "verdict",
                          "scale", "command", "torch", "machine")},
    "notes": ((str, type(None)), None, "a string or null"),
    "number": ((int,), None, "an integer"),
    "holds": ((bool,), None, "true or false"), "quick": ((bool,), None, "true or false"),
    "seconds": ((int, float), None, "a number"),
    "reasons": ((list,), str, "a list of strings"), "files": ((list,), str, "a list of strings"),
    "clauses": ((list,), dict, "a list of objects"),
    "seeds": ((list,), int, "a list of integers"), "cached_seeds": ((list,), int, "a list of integers"),
    **{f: ((dict,), None, "an object") for f in ("measured", "measured_per_seed", "seconds_per_seed", "run")},
}  # fmt: skip


_NUMBER = ((int, float, type(None)), None, "a number or null")
# each field of a clause (verdict.decide's records) the report reads
_CLAUSE_TYPES: dict[str, tuple[tuple[type, ...], type | tuple[type, ...] | None, str]] = {
    **{f: _TEXT for f in ("statistic", "says", "direction", "verdict")},
    "threshold": ((int, float), None, "a number"),
    **{f: _NUMBER for f in ("min", "median", "max", "margin_min", "margin_max")},
    "per_seed": ((dict,), None, "an object"),
}


def _check_types(path: Path, where: str, record: Any, table: dict[str, Any]) -> None:
    """A ValueError naming the file, the field and its value when ``record`` lacks a field of ``table`` or holds
    a value of another type there."""
    if not isinstance(record, dict):
        raise ValueError(f"{path}: {where.rstrip('.')}={_short(record)} must be an object")
    for field, (kinds, items, what) in table.items():
        if field not in record:
            raise ValueError(f"{path}: {where}{field} is missing")
        value = record[field]
        wrong = not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)
        if not wrong and items is not None:
            wrong = not all(isinstance(v, items) and not (isinstance(v, bool) and items is int) for v in value)
        if wrong:
            raise ValueError(f"{path}: {where}{field}={_short(value)} must be {what}")
    if "verdict" in table and record["verdict"] not in {v.value for v in Verdict}:
        raise ValueError(f"{path}: {where}verdict={record['verdict']!r} is not one of {[v.value for v in Verdict]}")


def _short(value: Any) -> str:
    text = dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def load_result(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """A ``result.json`` read back, checked to have every field; a ValueError names the file otherwise."""
    path = Path(folder) / "result.json"
    record = read_json(path)
    if not isinstance(record, dict):
        raise ValueError(f"{path} holds a {type(record).__name__}, not a result object")
    missing = [f for f in RESULT_FIELDS if f not in record]
    if missing:
        raise ValueError(f"{path} lacks the fields {missing}")
    _check_types(path, "", record, _FIELD_TYPES)
    for i, clause in enumerate(record["clauses"]):
        _check_types(path, f"clauses[{i}].", clause, _CLAUSE_TYPES)
    return record
