"""The read-only views of the page: placements, the model matrix, the papers and the experiment results.

Every view is the library's own value turned into JSON: a placement's drawing data is its
:class:`~normatlas.blocks.Placement` fields (the slots of each :class:`~normatlas.blocks.Sublayer`,
``kind``, ``describe()``), the matrix is :func:`normatlas.atlas.models` with a provenance badge per
design field derived from the record's ``status`` and value, the papers are
:func:`normatlas.atlas.papers.papers` grouped by question, and the experiments are the
``result.json`` files :func:`normatlas.experiments.runner.run_experiment` writes.
"""

from __future__ import annotations

import csv
import enum
import inspect
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..atlas import DESIGN_FIELDS as TYPED_FIELDS
from ..atlas import MODEL_FIELDS, UNCLEAR, models
from ..atlas.papers import PAPER_GROUPS, paper, paper_link, paper_row, papers
from ..blocks import PRESETS, Placement, Sublayer
from ..experiments.runner import RESULT_FIELDS, load_result

__all__ = [
    "DESIGN_FIELDS",
    "FACET_FIELDS",
    "PROFILE_EXPERIMENTS",
    "experiments_view",
    "models_view",
    "papers_view",
    "placement_data",
    "placements_view",
]

#: the experiments whose per-depth series the Placements page draws beside each scheme
PROFILE_EXPERIMENTS = ("variance-depth", "gradient-depth")
#: the record fields that state a design choice, each given a provenance badge: the typed fields
#: (:data:`normatlas.atlas.DESIGN_FIELDS`) and the free-text residual
DESIGN_FIELDS = (*TYPED_FIELDS, "residual")
#: the fields a facet filters on: each value spelled once (the typed ones are enum values)
FACET_FIELDS = ("family", "kind", *TYPED_FIELDS)
_STATUS_BADGE = {"code": "code", "paper": "paper", "essay": "guide", UNCLEAR: "unclear"}
_PAPER_SOURCE = re.compile(r"\bpaper:\s*([a-z0-9_]+)")
_TRANSFORMERS_FILE = re.compile(r"transformers (models/[\w/]+\.py)")
NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
MAX_SERIES_ROWS = 2000


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Sublayer):
        d: dict[str, Any] = {f.name: getattr(value, f.name) for f in fields(value)}
        return d | {"slots": list(value.slots), "kind": value.kind.value}
    return value


def placement_data(p: Placement) -> dict[str, Any]:
    """A placement's drawing data: every field of the value, with each sublayer's slots and kind."""
    data = {f.name: _plain(getattr(p, f.name)) for f in fields(p)}
    return data | {
        "kind": p.kind.value,
        "kinds": [k.value for k in p.kinds],
        "equation": p.describe(),
        "has_norm": p.has_norm,
    }


def placements_view(experiments: Path | None) -> dict[str, Any]:
    """``GET /api/placements``: every preset of ``PRESETS`` with its docstring drawing and measured profiles."""
    profiles = _profiles(experiments)
    out = []
    for name, factory in PRESETS.items():
        p = factory()
        out.append(
            placement_data(p)
            | {"preset": name, "doc": inspect.getdoc(factory) or "", "profiles": profiles.get(p.name, {})}
        )
    return {"placements": out, "profile_experiments": list(PROFILE_EXPERIMENTS)}


def _provenance(rec: dict[str, Any]) -> dict[str, str | None]:
    """Per design field: where its value comes from (``code`` / ``paper`` / ``guide`` / ``unclear``), None if unset.
    A typed field of a record linked to transformers model types is ``code``: ``matrix --check`` compares every one
    of them with the inspected code (tests/test_atlas_data.py keeps that at zero disagreements)."""
    badge = _STATUS_BADGE[rec["status"]]
    if badge == "guide" and "arxiv" in rec["source"].lower():
        badge = "paper"
    out: dict[str, str | None] = {}
    for f in DESIGN_FIELDS:
        value = rec[f]
        checked = bool(rec["hf_model_types"]) and f in TYPED_FIELDS
        out[f] = None if value is None else "unclear" if value == UNCLEAR else "code" if checked else badge
    return out


def _source_link(source: str) -> str | None:
    cited = _PAPER_SOURCE.search(source)
    if cited is not None:
        try:
            return paper_link(paper(cited.group(1)))
        except (KeyError, ValueError):
            return None
    match = _TRANSFORMERS_FILE.search(source)
    if match is None:
        return None
    return f"https://github.com/huggingface/transformers/blob/main/src/transformers/{match.group(1)}"


def models_view() -> dict[str, Any]:
    """``GET /api/models``: every record, with its per-field provenance and a link to the code it was read from."""
    recs = [
        r | {"provenance": _provenance(r), "source_link": _source_link(r["source"])}
        for r in models()  # models() validates every record
    ]
    facets = {f: sorted({str(r[f]) for r in recs if r[f] is not None}) for f in FACET_FIELDS}
    return {"fields": list(MODEL_FIELDS), "design_fields": list(DESIGN_FIELDS), "facets": facets, "models": recs}


def papers_view() -> dict[str, Any]:
    """``GET /api/papers``: the bibliography grouped by the question each paper answers, in the essay's order."""
    rows = [paper_row(r) for r in papers()]
    groups = [{"question": g, "papers": [r for r in rows if r["group"] == g]} for g in PAPER_GROUPS]
    return {"groups": [g for g in groups if g["papers"]], "count": len(rows)}


def _result_folders(root: Path | None) -> list[Path]:
    if root is None or not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and NAME.fullmatch(p.name) and (p / "result.json").is_file())


def _series(folder: Path, files: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in files:
        if not name.endswith(".csv") or not (folder / name).is_file():
            continue
        with (folder / name).open(newline="") as f:
            rows = list(csv.reader(f))
        if rows:
            out[name.removesuffix(".csv")] = {"columns": rows[0], "rows": rows[1 : MAX_SERIES_ROWS + 1]}
    return out


def experiments_view(root: Path | None) -> dict[str, Any]:
    """``GET /api/experiments``: each ``result.json`` under ``root``, its figures' URLs and its CSV series."""
    results, errors = [], []
    for folder in _result_folders(root):
        try:
            rec = load_result(folder)
        except (ValueError, OSError) as exc:  # a malformed result is reported, never fatal
            errors.append({"name": folder.name, "error": str(exc)})
            continue
        files = [f for f in rec.get("files", []) if isinstance(f, str)]
        figures = {
            ext: f"/experiments/{folder.name}/figure.{ext}"
            for ext in ("svg", "png")
            if (folder / f"figure.{ext}").is_file()
        }
        results.append({k: rec[k] for k in RESULT_FIELDS} | {"figures": figures, "series": _series(folder, files)})
    results.sort(key=lambda r: (r["number"] if isinstance(r["number"], int) else 1 << 30, r["name"]))
    return {
        "folder": str(root) if root is not None else None,
        "fields": list(RESULT_FIELDS),
        "results": results,
        "errors": errors,
    }


def _profiles(root: Path | None) -> dict[str, dict[str, Any]]:
    """Per placement name: the per-depth series of the profile experiments.

    A profile series is a CSV with a ``placement`` column (the :attr:`Placement.name`), a ``layer`` or
    ``depth`` column and numeric value columns; each placement gets its rows, one list per value column.
    """
    out: dict[str, dict[str, Any]] = {}
    for folder in _result_folders(root):
        if folder.name not in PROFILE_EXPERIMENTS:
            continue
        try:
            rec = load_result(folder)
        except (ValueError, OSError):
            continue
        for key, table in _series(folder, [f for f in rec["files"] if isinstance(f, str)]).items():
            _add_profile(out, folder.name, key, table, bool(rec["holds"]))
    return out


def _number(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _add_profile(out: dict[str, dict[str, Any]], exp: str, key: str, table: dict[str, Any], holds: bool) -> None:
    """One CSV of a profile experiment into ``out[placement][exp]`` as ``points`` rows ``[x, y per column]``.

    Long form: a ``placement`` column (the preset's name), a ``layer`` / ``depth`` column, numeric value columns,
    and optional text columns (``stage``: init / trained) that qualify each value column (``variance
    (trained)``); a ``label`` column is ignored. Wide form: a ``layer`` / ``depth`` column and one value column
    per preset name (``pre_ln``, ``post_ln``)."""
    cols, rows = table["columns"], table["rows"]
    x_col = next((c for c in ("layer", "depth") if c in cols), None)
    if x_col is None:
        return
    xi = cols.index(x_col)
    found: dict[str, dict[str, dict[float, float]]] = {}  # placement -> column -> x -> y

    def add(placement: str, column: str, x: Any, y: Any) -> None:
        xv, yv = _number(x), _number(y)
        if xv is not None and yv is not None:
            found.setdefault(placement, {}).setdefault(column, {})[xv] = yv

    if "placement" not in cols:
        for ci, c in enumerate(cols):
            if c in PRESETS:
                for r in rows:
                    add(c, key, r[xi], r[ci])
    else:
        pi = cols.index("placement")
        rest = [i for i in range(len(cols)) if i not in (pi, xi) and cols[i] != "label"]
        text = [i for i in rest if any(_number(r[i]) is None for r in rows)]
        for r in rows:
            tag = ", ".join(str(r[i]) for i in text)
            for i in rest:
                if i not in text:
                    add(str(r[pi]), f"{cols[i]} ({tag})" if tag else cols[i], r[xi], r[i])
    for placement, series in found.items():
        columns = list(series)
        xs = sorted(set.intersection(*(set(v) for v in series.values())))
        points = [[x, *(series[c][x] for c in columns)] for x in xs]
        out.setdefault(placement, {}).setdefault(exp, {  # an experiment's first profile CSV is its drawing
            "series": key, "x": x_col, "columns": columns, "points": points, "holds": holds,
        })  # fmt: skip
