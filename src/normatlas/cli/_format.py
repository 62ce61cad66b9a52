"""Readable tables, JSON and CSV for command output."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping, Sequence

__all__ = ["format_rows", "format_table"]


def format_table(rows: Sequence[Mapping[str, object]], title: str | None = None) -> str:
    """A plain-text table with a header rule; columns are the keys of the first row."""
    if not rows:
        return (title + "\n" if title else "") + "(no rows)"
    cols = list(rows[0].keys())
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))
    out = [title] if title else []
    out += [line.rstrip(), "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(out)


def format_rows(rows: Sequence[Mapping[str, object]], fmt: str = "table", title: str | None = None) -> str:
    """Render rows as ``table``, ``json`` or ``csv``."""
    if fmt == "json":
        return json.dumps(list(rows), indent=2, default=str)
    if fmt == "csv":
        buf = io.StringIO()
        if rows:
            writer = csv.DictWriter(buf, fieldnames=list(rows[0].keys()), lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        return buf.getvalue().rstrip("\n")
    if fmt == "table":
        return format_table(rows, title)
    raise ValueError(f"format={fmt!r} is not one of 'table', 'json', 'csv'")


def add_format_option(parser: object) -> None:
    parser.add_argument(  # type: ignore[attr-defined]
        "--format", choices=("table", "json", "csv"), default="table", help="output format (default: table)"
    )
