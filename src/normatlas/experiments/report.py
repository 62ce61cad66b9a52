"""One page of every experiment's result: ``DIR/report.md`` and ``DIR/report.html``, from the ``result.json`` files.

The page is written from the files alone (the web atlas reads the same ones): for each result its claim, the
guide's words, the anchor paper and what it reports, the expected relation, the verdict, the measured numbers,
the figure (linked relatively, ``NAME/figure.png``), the notes and the command that reproduces it. The HTML is
self-contained apart from those figure files: inline CSS, no script, nothing fetched.
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any

from .runner import load_result

__all__ = ["find_results", "render_html", "render_markdown", "write_report"]


def find_results(out: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every ``out/*/result.json`` read back (checked for every field), ordered by experiment number."""
    root = Path(out)
    if not root.is_dir():
        raise FileNotFoundError(f"out={str(root)!r} is not a folder")
    records = [load_result(p.parent) for p in sorted(root.glob("*/result.json"))]
    return sorted(records, key=lambda r: (r["number"], r["name"]))


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return str(v)


def _cell(text: str) -> str:
    """Text for a Markdown table cell: a '|' (as in ||W||) would end the cell."""
    return text.replace("|", "\\|")


def _verdict(rec: dict[str, Any]) -> str:
    mode = "quick mode" if rec["quick"] else "full mode"
    return f"{'holds' if rec['holds'] else 'does NOT hold'} ({mode}, seed {rec['seed']}, {rec['seconds']} s)"


def render_markdown(records: list[dict[str, Any]]) -> str:
    """The Markdown page: a summary table, then one section per result."""
    held = sum(bool(r["holds"]) for r in records)
    lines = ["# normatlas experiments", "", f"{held} of {len(records)} claims hold.", ""]
    lines += ["| # | experiment | claim | verdict |", "|---|---|---|---|"]
    lines += [f"| {r['number']} | [{r['name']}](#{r['name']}) | {_cell(r['claim'])} | {_verdict(r)} |" for r in records]
    for r in records:
        lines += ["", f'<a id="{r["name"]}"></a>', f"## {r['number']}. {r['title']}", ""]
        lines += [f"**Claim.** {r['claim']}", "", f"> {r['guide_words']}", ""]
        lines += [f"**Anchor** `{r['anchor']}`: {r['anchor_reports']}", "", f"**Expected.** {r['expected']}", ""]
        lines += [f"**Verdict:** {_verdict(r)}", "", "| measured | value |", "|---|---|"]
        lines += [f"| {_cell(k)} | {_cell(_value(v))} |" for k, v in r["measured"].items()]
        lines += ["", f"![{r['name']}]({r['name']}/figure.png)", ""]
        if r["notes"]:
            lines += [f"*Notes.* {r['notes']}", ""]
        lines += ["```", r["command"], "```", f"torch {r['torch']}, {r['machine']}"]
    return "\n".join(lines) + "\n"


_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;line-height:1.45}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
.ok{color:#0a6b2b;font-weight:600}.no{color:#a11;font-weight:600}img{max-width:100%;border:1px solid #eee}
blockquote{color:#444;border-left:3px solid #ccc;margin-left:0;padding-left:1em}code,pre{background:#f5f5f5}"""


def _html_section(r: dict[str, Any]) -> list[str]:
    e = html.escape
    cls = "ok" if r["holds"] else "no"
    rows = "".join(f"<tr><td>{e(str(k))}</td><td>{e(_value(v))}</td></tr>" for k, v in r["measured"].items())
    out = [f'<section id="{e(r["name"])}"><h2>{r["number"]}. {e(r["title"])}</h2>']
    out += [f"<p><b>Claim.</b> {e(r['claim'])}</p>", f"<blockquote>{e(r['guide_words'])}</blockquote>"]
    out += [f"<p><b>Anchor</b> <code>{e(r['anchor'])}</code>: {e(r['anchor_reports'])}</p>"]
    out += [f"<p><b>Expected.</b> {e(r['expected'])}</p>", f'<p class="{cls}">Verdict: {e(_verdict(r))}</p>']
    out += [f"<table><tr><th>measured</th><th>value</th></tr>{rows}</table>"]
    out += [f'<img src="{e(r["name"])}/figure.png" alt="{e(r["title"])}">']
    if r["notes"]:
        out += [f"<p><i>Notes.</i> {e(r['notes'])}</p>"]
    out += [f"<pre>{e(r['command'])}</pre><p>torch {e(r['torch'])}, {e(r['machine'])}</p></section>"]
    return out


def render_html(records: list[dict[str, Any]]) -> str:
    """The HTML page: the same content as :func:`render_markdown`, with inline CSS and no script."""
    e = html.escape
    held = sum(bool(r["holds"]) for r in records)
    head = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">', "<title>normatlas experiments</title>"]
    head += [f"<style>{_CSS}</style></head><body>", "<h1>normatlas experiments</h1>"]
    head += [f"<p>{held} of {len(records)} claims hold.</p>", "<table><tr><th>#</th><th>experiment</th>"]
    head[-1] += "<th>claim</th><th>verdict</th></tr>"
    for r in records:
        cls = "ok" if r["holds"] else "no"
        head += [
            f'<tr><td>{r["number"]}</td><td><a href="#{e(r["name"])}">{e(r["name"])}</a></td>'
            f'<td>{e(r["claim"])}</td><td class="{cls}">{e(_verdict(r))}</td></tr>'
        ]
    head += ["</table>"]
    body = [line for r in records for line in _html_section(r)]
    return "\n".join([*head, *body, "</body></html>"]) + "\n"


def write_report(out: str | os.PathLike[str]) -> tuple[Path, Path, list[dict[str, Any]]]:
    """Write ``out/report.md`` and ``out/report.html``; returns their paths and the records used.
    A ValueError when ``out`` holds no result."""
    root = Path(out)
    records = find_results(root)
    if not records:
        raise ValueError(f"out={str(root)!r} holds no */result.json (run `normatlas experiments run` first)")
    paths = []
    for name, text in (("report.md", render_markdown(records)), ("report.html", render_html(records))):
        path = root / name
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
        paths.append(path)
    return paths[0], paths[1], records
