"""Readable tables, JSON and CSV for command output.

Every command prints its result through :func:`emit`: one or more :class:`Section` s (rows of typed
values: ``bool``, ``int``, ``float``, ``None``, ``str``, lists of those) plus optional ``meta`` (typed
scalars about the whole result) and ``notes`` (sentences). ``--format json`` is then always one valid
JSON document with the values' own types; ``table`` renders them for a reader; ``csv`` writes the rows.
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

__all__ = ["FORMATS", "Section", "add_format_option", "emit", "format_rows", "format_table", "render"]

FORMATS = ("table", "json", "csv")


@dataclass(frozen=True)
class Section:
    """One table of a command's result: ``key`` names it in JSON, ``title`` heads it in a table."""

    key: str
    rows: Sequence[Mapping[str, object]]
    title: str | None = None
    columns: Sequence[str] | None = field(default=None)  # default: the keys of every row, in first-seen order


def _columns(section: Section) -> list[str]:
    if section.columns is not None:
        return list(section.columns)
    cols: dict[str, None] = {}
    for row in section.rows:
        cols.update(dict.fromkeys(row))
    return list(cols)


def _cell(value: object) -> str:
    """A value as a reader sees it: rounded floats, yes / no, '-' for None, lists joined."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}"
    if isinstance(value, (list, tuple, set, frozenset)):
        return ", ".join(_cell(v) for v in value) if value else "-"
    return str(value)


def _jsonable(value: Any) -> Any:
    """Typed JSON values: non-finite floats become null (JSON has no NaN), enums their value, paths str."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    enum_value = getattr(value, "value", None)
    if isinstance(enum_value, (str, int)):
        return enum_value
    return str(value)


def format_table(
    rows: Sequence[Mapping[str, object]], title: str | None = None, columns: Sequence[str] | None = None
) -> str:
    """A plain-text table with a header rule."""
    section = Section("rows", rows, title, columns)
    if not rows:
        return (title + "\n" if title else "") + "(no rows)"
    cols = _columns(section)
    cells = [[_cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))
    out = [title] if title else []
    out += [line.rstrip(), "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(out)


def render(
    sections: Sequence[Section],
    fmt: str = "table",
    *,
    meta: Mapping[str, object] | None = None,
    notes: Sequence[str] = (),
) -> str:
    """The text :func:`emit` prints."""
    if fmt == "json":
        doc: dict[str, object] = dict(meta or {})
        for s in sections:
            doc[s.key] = [dict(r) for r in s.rows]
        if notes:
            doc["notes"] = list(notes)
        return json.dumps(_jsonable(doc), indent=2, allow_nan=False)
    if fmt == "csv":
        buf = io.StringIO()
        several = len(sections) > 1
        cols: dict[str, None] = {}
        for s in sections:
            cols.update(dict.fromkeys(_columns(s)))
        names = (["section"] if several else []) + list(cols)
        writer = csv.DictWriter(buf, fieldnames=names, lineterminator="\n", extrasaction="ignore")
        writer.writeheader()
        for s in sections:
            for r in s.rows:
                row = {k: _csv_value(v) for k, v in r.items()}
                writer.writerow({"section": s.key, **row} if several else row)
        return buf.getvalue().rstrip("\n")
    if fmt == "table":
        parts = []
        if meta:
            parts.append("\n".join(f"{k}: {_cell(v)}" for k, v in meta.items()))
        parts += [format_table(s.rows, s.title, s.columns) for s in sections]
        parts += [f"note: {n}" for n in notes]
        return "\n".join(parts)
    raise ValueError(f"format={fmt!r} is not one of {', '.join(map(repr, FORMATS))}")


def _csv_value(value: object) -> object:
    if isinstance(value, (list, tuple, set, frozenset)):
        return ";".join(str(v) for v in value)
    return "" if value is None else value


def emit(
    sections: Sequence[Section],
    fmt: str = "table",
    *,
    meta: Mapping[str, object] | None = None,
    notes: Sequence[str] = (),
    stream: IO[str] | None = None,
) -> None:
    """Print a command's whole result once: one JSON document, one CSV, or titled tables."""
    print(render(sections, fmt, meta=meta, notes=notes), file=stream or sys.stdout)


def format_rows(rows: Sequence[Mapping[str, object]], fmt: str = "table", title: str | None = None) -> str:
    """Render one section's rows as ``table``, ``json`` (a list) or ``csv``."""
    if fmt == "json":
        return json.dumps(_jsonable([dict(r) for r in rows]), indent=2, allow_nan=False)
    return render([Section("rows", rows, title)], fmt)


def add_format_option(parser: object) -> None:
    parser.add_argument(  # type: ignore[attr-defined]
        "--format", choices=FORMATS, default="table", help="output format (default: table)"
    )
