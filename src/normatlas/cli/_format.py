"""Readable tables, JSON and CSV for command output.

Every command prints its result through :func:`emit`: one or more :class:`Section` s (rows of typed
values: ``bool``, ``int``, ``float``, ``None``, ``str``, lists of those) plus optional ``meta`` (typed
scalars about the whole result) and ``notes`` (sentences). ``--format json`` is then always one valid
JSON document with the values' own types; ``table`` renders them for a reader; ``csv`` writes the rows.

Tables fit the output width (:func:`output_width`: ``$COLUMNS``, else the terminal's width, else
100 columns): long cells wrap at spaces and after ``_ - / . ,`` and are shortened with ``...``
after a few lines (the whole text stays in JSON and CSV); a table too wide even so is turned
(one column per row) when it has few rows, or printed as one ``field: value`` block per row.
A section's ``group`` column is printed once per value, as a sub-heading over its rows.
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from .._io import dumps, jsonable

__all__ = [
    "DEFAULT_WIDTH",
    "FORMATS",
    "Section",
    "add_format_option",
    "emit",
    "format_rows",
    "format_table",
    "output_width",
    "render",
]

FORMATS = ("table", "json", "csv")
DEFAULT_WIDTH = 100  # when the output is not a terminal and $COLUMNS is unset
MIN_WIDTH = 20
_GAP = "  "
_CELL_LINES = 3  # a table cell wraps onto at most this many lines, then is shortened
_RECORD_LINES = 8  # the same for a value in the field: value layout
_TRANSPOSE_ROWS = 12  # a too-wide table with at most this many rows is printed turned


@dataclass(frozen=True)
class Section:
    """One table of a command's result: ``key`` names it in JSON, ``title`` heads it in a table.

    ``group``: a column whose value is printed once, as a sub-heading above the rows that share it
    (gathered in first-seen order), instead of on every row (tables only; JSON and CSV keep it in every row).
    """

    key: str
    rows: Sequence[Mapping[str, object]]
    title: str | None = None
    columns: Sequence[str] | None = field(default=None)  # default: the keys of every row, in first-seen order
    group: str | None = None


def _columns(section: Section) -> list[str]:
    if section.columns is not None:
        return list(section.columns)
    cols: dict[str, None] = {}
    for row in section.rows:
        cols.update(dict.fromkeys(row))
    return list(cols)


def output_width(stream: IO[str] | None = None) -> int:
    """Columns available to a table: ``$COLUMNS`` when set, the terminal's width when ``stream`` (default
    stdout) is a terminal, else :data:`DEFAULT_WIDTH`; never below ``MIN_WIDTH``."""
    env = os.environ.get("COLUMNS", "").strip()
    if env.isdigit() and int(env) > 0:
        return max(MIN_WIDTH, int(env))
    stream = sys.stdout if stream is None else stream
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        tty = False
    if tty:
        return max(MIN_WIDTH, shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns)
    return DEFAULT_WIDTH


def _number(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return str(value)
    if value == 0:
        return "0"
    if 1e4 <= abs(value) < 1e9:
        return f"{value:.0f}"
    return f"{value:.4g}"


def _cell(value: object) -> str:
    """A value as a reader sees it: rounded floats, yes / no, '-' for None and empty, lists joined."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        return ", ".join(_cell(v) for v in value) if value else "-"
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={_cell(v)}" for k, v in value.items()) if value else "-"
    enum_value = getattr(value, "value", None)
    if isinstance(enum_value, (str, int)) and not isinstance(value, (str, int)):
        return str(enum_value)
    return " ".join(str(value).split("\n")).replace("\t", " ")


# ---------------------------------------------------------------------------------------------- wrapping
_TOKENS = re.compile(r"\s+|[^\s_/.,\-]+[_/.,\-]*|[_/.,\-]+")


def _chunks(text: str) -> list[str]:
    return [t for t in _TOKENS.findall(text) if not t.isspace()]


def wrap(text: str, width: int, max_lines: int | None = None) -> list[str]:
    """``text`` in lines of at most ``width`` characters: breaks at spaces, then after ``_ - / . ,``,
    then anywhere; beyond ``max_lines`` the last kept line ends in ``...``."""
    width = max(1, width)
    lines: list[str] = []
    cur, space = "", False
    for tok in _TOKENS.findall(text):
        if tok.isspace():
            space = bool(cur)
            continue
        join = (" " if space else "") + tok
        space = False
        if len(cur) + len(join) <= width:
            cur += join
            continue
        if len(tok) <= width:
            lines.append(cur)
            cur = tok
            continue
        room = width - len(cur) - (1 if join != tok else 0)
        if cur and room >= 4:  # fill the line before breaking a long token
            cur += join[: len(join) - len(tok)] + tok[:room]
            tok = tok[room:]
        if cur:
            lines.append(cur)
        while len(tok) > width:
            lines.append(tok[:width])
            tok = tok[width:]
        cur = tok
    lines.append(cur)
    lines = [ln for ln in lines if ln] or [""]
    if max_lines is not None and len(lines) > max_lines:
        lines = lines[:max_lines]
        last = lines[-1]
        lines[-1] = (last[: max(0, width - 3)].rstrip() + "...")[:width] if width >= 3 else last[:width]
    return lines


def _floor(texts: Sequence[str]) -> int:
    """The narrowest width a column should get before its words break: its longest unbreakable piece."""
    return max((len(t) for s in texts for t in _chunks(s)), default=1)


def _fit(natural: list[int], floor: list[int], avail: int) -> list[int] | None:
    """Column widths within ``avail`` (max-min fair, none below its floor), or None when they cannot fit."""
    if sum(natural) <= avail:
        return natural
    floor = [min(f, n) for f, n in zip(floor, natural, strict=True)]
    if sum(floor) > avail:
        return None
    lo, hi = 0, max(natural)
    while lo < hi:  # the highest water level whose widths fit
        mid = (lo + hi + 1) // 2
        if sum(min(n, max(f, mid)) for n, f in zip(natural, floor, strict=True)) <= avail:
            lo = mid
        else:
            hi = mid - 1
    widths = [min(n, max(f, lo)) for n, f in zip(natural, floor, strict=True)]
    spare = avail - sum(widths)
    for i in range(len(widths)):
        if spare and widths[i] < natural[i]:
            widths[i] += 1
            spare -= 1
    return widths


def _grid(
    header: list[str], body: list[list[str]], width: int, indent: str = "", cap: int = 24
) -> list[list[str]] | None:
    """The header (with its rule) and each row as lines within ``width``: ``[header lines, row 0 lines, ...]``,
    or None when the columns cannot fit without breaking words longer than ``cap``."""
    avail = width - len(indent) - len(_GAP) * (len(header) - 1)
    if avail < 3 * len(header):
        return None
    cols = list(zip(header, *body, strict=True)) if body else [(h,) for h in header]
    natural = [max(1, *(len(c) for c in col)) for col in cols]
    floor = [min(_floor(col), cap) for col in cols]
    if sum(natural) > avail:  # let the headers wrap first: a column as wide as its cells (or its header's words)
        natural = [max(1, _floor(col[:1]), *(len(c) for c in col[1:])) for col in cols]
    widths = _fit(natural, floor, avail)
    if widths is None:
        return None

    def lines_of(cells: Sequence[str], max_lines: int | None) -> list[str]:
        wrapped = [wrap(c, w, max_lines) for c, w in zip(cells, widths, strict=True)]
        height = max(len(w) for w in wrapped)
        return [
            (
                indent + _GAP.join((w[i] if i < len(w) else "").ljust(n) for w, n in zip(wrapped, widths, strict=True))
            ).rstrip()
            for i in range(height)
        ]

    head = [*lines_of(header, None), indent + _GAP.join("-" * w for w in widths)]
    return [head, *(lines_of(row, _CELL_LINES) for row in body)]


def _records(cols: list[str], body: list[list[str]], width: int, indent: str = "") -> list[str]:
    """One ``field: value`` block per row, blocks apart by a blank line."""
    keyw = min(max(len(c) for c in cols) + 1, max(8, (width - len(indent)) // 3))
    out: list[str] = []
    for n, row in enumerate(body):
        if n:
            out.append("")
        for col, cell in zip(cols, row, strict=True):
            label = col + ":"
            valw = width - len(indent) - keyw - 1
            if len(label) > keyw or valw < 8:  # the label on its own line, the value under it
                out += [indent + ln for ln in wrap(label, width - len(indent))]
                out += [indent + "  " + ln for ln in wrap(cell, width - len(indent) - 2, _RECORD_LINES)]
                continue
            vals = wrap(cell, valw, _RECORD_LINES)
            out.append((indent + label.ljust(keyw) + " " + vals[0]).rstrip())
            out += [indent + " " * (keyw + 1) + v for v in vals[1:]]
    return out


def _body(cols: list[str], rows: Sequence[Mapping[str, object]]) -> list[list[str]]:
    return [[_cell(r.get(c)) for c in cols] for r in rows]


def _table(header: list[str], body: list[list[str]], width: int, indent: str = "") -> list[list[str]] | None:
    """:func:`_grid` breaking as few words as it can: unbroken up to 24 characters, then 16, then 12; turned
    (one column per row) when it has few rows and fits better so; then words of 10 and 8; else None."""
    turn = 1 < len(body) <= _TRANSPOSE_ROWS and len(header) > 1
    turned = ([header[0], *(r[0] for r in body)], [[c, *(r[i] for r in body)] for i, c in enumerate(header) if i])
    for cap in (24, 16, 12):
        grid = _grid(header, body, width, indent, cap)
        if grid is not None:
            return grid
    for cap in (24, 16, 12) if turn else ():
        grid = _grid(*turned, width, indent, cap)
        if grid is not None:
            return grid
    for cap in (10, 8):
        grid = _grid(header, body, width, indent, cap)
        if grid is not None:
            return grid
    return None


def _layout(cols: list[str], rows: Sequence[Mapping[str, object]], width: int, indent: str = "") -> list[str]:
    body = _body(cols, rows)
    grid = _table(cols, body, width, indent)
    if grid is None:
        return _records(cols, body, width, indent)
    return [line for lines in grid for line in lines]


def format_table(
    rows: Sequence[Mapping[str, object]],
    title: str | None = None,
    columns: Sequence[str] | None = None,
    *,
    group: str | None = None,
    width: int | None = None,
) -> str:
    """A plain-text table with a header rule that fits ``width`` (default :func:`output_width`)."""
    width = output_width() if width is None else max(1, width)
    out = wrap(title, width) if title else []
    if not rows:
        return "\n".join([*out, "(no rows)"])
    cols = _columns(Section("rows", rows, title, columns))
    if group is None or group not in cols:
        return "\n".join(out + _layout(cols, rows, width))
    rest = [c for c in cols if c != group] or [group]
    runs: list[tuple[object, list[int]]] = []  # (group value, indices of its rows), in first-seen order
    for i, r in enumerate(rows):
        run = next((members for value, members in runs if value == r.get(group)), None)
        if run is None:
            runs.append((r.get(group), [i]))
        else:
            run.append(i)
    body = _body(rest, rows)
    grid = None
    for cap in (24, 16, 12, 10, 8):  # one header and one set of widths for every group
        grid = grid or _grid(rest, body, width, "  ", cap)
    if grid is not None:
        out += grid[0]
    for n, (value, members) in enumerate(runs):
        out += ([""] if n else []) + wrap(f"{group}: {_cell(value)}", width)
        if grid is not None:
            out += [line for i in members for line in grid[i + 1]]
        else:
            out += _records(rest, [body[i] for i in members], width, "  ")
    return "\n".join(out)


def render(
    sections: Sequence[Section],
    fmt: str = "table",
    *,
    meta: Mapping[str, object] | None = None,
    notes: Sequence[str] = (),
    width: int | None = None,
) -> str:
    """The text :func:`emit` prints."""
    if fmt == "json":
        doc: dict[str, object] = dict(meta or {})
        for s in sections:
            doc[s.key] = [dict(r) for r in s.rows]
        if notes:
            doc["notes"] = list(notes)
        return dumps(doc, indent=2)
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
        width = output_width() if width is None else max(1, width)
        parts = []
        if meta:
            parts.append(_records(list(meta), [[_cell(v) for v in meta.values()]], width))
        for s in sections:
            parts.append(format_table(s.rows, s.title, s.columns, group=s.group, width=width).splitlines())
        if notes:
            parts.append([line for n in notes for line in _note(n, width)])
        return "\n\n".join("\n".join(p) for p in parts)
    raise ValueError(f"format={fmt!r} is not one of {', '.join(map(repr, FORMATS))}")


def _note(text: str, width: int) -> list[str]:
    lines = wrap(text, max(1, width - 6))
    return ["note: " + lines[0], *("      " + ln for ln in lines[1:])]


def _csv_value(value: object) -> object:
    if isinstance(value, (list, tuple, set, frozenset)):
        return ";".join(str(_csv_value(v)) for v in value)
    if value is None:
        return ""
    if isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value)):
        return value
    if isinstance(value, float):
        return str(value)  # nan, inf: what a spreadsheet reads back
    return jsonable(value)


def emit(
    sections: Sequence[Section],
    fmt: str = "table",
    *,
    meta: Mapping[str, object] | None = None,
    notes: Sequence[str] = (),
    stream: IO[str] | None = None,
) -> None:
    """Print a command's whole result once: one JSON document, one CSV, or titled tables."""
    from . import _progress

    out = sys.stdout if stream is None else stream
    text = render(sections, fmt, meta=meta, notes=notes, width=output_width(out) if fmt == "table" else None)
    _progress.clear()
    print(text, file=out, flush=True)


def format_rows(rows: Sequence[Mapping[str, object]], fmt: str = "table", title: str | None = None) -> str:
    """Render one section's rows as ``table``, ``json`` (a list) or ``csv``."""
    if fmt == "json":
        return dumps([dict(r) for r in rows], indent=2)
    return render([Section("rows", rows, title)], fmt)


def add_format_option(parser: object) -> None:
    """``--format table|json|csv``, and ``--json`` as the alias of ``--format json``."""
    parser.add_argument(  # type: ignore[attr-defined]
        "--format", choices=FORMATS, default="table", help="output format (default: table)"
    )
    parser.add_argument(  # type: ignore[attr-defined]
        "--json", dest="format", action="store_const", const="json", help="the same as --format json"
    )
