"""One page of every experiment's result: ``DIR/report.md`` and ``DIR/report.html``, from the ``result.json`` files.

The page is written from the files alone (the web atlas reads the same ones): a summary table (verdict, the
deciding clause's median over seeds with its spread against the threshold, its margin), then for each result its
claim, the guide's words, the anchor paper and what it reports, the rule, the verdict with every clause's numbers
and the sentences explaining a verdict other than ``holds``, the measured numbers of the figure's seed, the figure
(linked relatively, ``NAME/figure.png``), the notes, the run's metadata and the command that reproduces it. A
``result.json`` that cannot be read (truncated, malformed, missing fields) is named on the page with the reason;
the rest are shown. The HTML is self-contained apart from the figure files: inline CSS, no script, nothing fetched.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._io import atomic_write
from .base import Scale
from .runner import load_result, scale_folder

__all__ = ["find_results", "read_results", "render_html", "render_markdown", "write_report"]


def read_results(
    out: str | os.PathLike[str], scale: Scale | str | None = None
) -> tuple[list[dict[str, Any]], list[tuple[Path, str]]]:
    """Every ``out/*/result.json`` read back (ordered by experiment number), and each file that could not be read
    with the reason. With ``scale``, each experiment's latest result at that scale (``out/*/scales/<scale>/``)."""
    root = Path(out)
    if not root.is_dir():
        raise FileNotFoundError(f"out={str(root)!r} is not a folder")
    pattern = "*/result.json" if scale is None else f"*/{scale_folder('', scale).as_posix()}/result.json"
    records, problems = [], []
    for p in sorted(root.glob(pattern)):
        try:
            records.append(load_result(p.parent))
        except (OSError, ValueError) as exc:
            problems.append((p, str(exc)))
    return sorted(records, key=lambda r: (r["number"], r["name"])), problems


def find_results(out: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The readable results of :func:`read_results` (the unreadable ones left out)."""
    return read_results(out)[0]


def _value(v: Any) -> str:
    if v is None:  # a NaN or inf measured is written as null (normatlas._io)
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def _cell(text: str) -> str:
    """Text for a Markdown table cell: a '|' (as in ||W||) would end the cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _num(x: Any) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def deciding_clause(rec: dict[str, Any]) -> dict[str, Any]:
    """The clause the verdict turns on: the first that does not hold, else the first inconclusive, else the one
    with the smallest worst-seed margin relative to its threshold."""
    clauses = rec["clauses"]
    for wanted in ("does not hold", "inconclusive"):
        for c in clauses:
            if c["verdict"] == wanted:
                return c

    def rel(c: dict[str, Any]) -> float:
        m = c["margin_min"]
        return float("inf") if m is None else m / max(abs(c["threshold"]), 1e-12)

    return min(clauses, key=rel)


def spread(c: dict[str, Any]) -> str:
    """``statistic: median [min, max] vs > threshold``."""
    div = f", diverged at seeds {c['diverged_seeds']}" if c["diverged_seeds"] else ""
    return (
        f"{c['statistic']} {_num(c['median'])} [{_num(c['min'])}, {_num(c['max'])}] "
        f"vs {c['direction']} {c['threshold']:g}{div}"
    )


def margin(c: dict[str, Any]) -> str:
    return f"{_num(c['margin_min'])} .. {_num(c['margin_max'])}"


def _verdict(rec: dict[str, Any]) -> str:
    return f"{rec['verdict']} ({rec['scale']} scale, seeds {_value(rec['seeds'])}, {rec['seconds']} s)"


def _summary(records: list[dict[str, Any]]) -> str:
    plural = {"holds": "hold", "does not hold": "do not hold", "inconclusive": "inconclusive"}
    counts = {v: sum(r["verdict"] == v for r in records) for v in plural}
    words = (f"{n} {v if n == 1 else plural[v]}" for v, n in counts.items())
    return f"Of {len(records)} claim{'' if len(records) == 1 else 's'}: " + ", ".join(words) + "."


def _run_line(rec: dict[str, Any]) -> str:
    run = rec["run"]
    ran = run.get("seeds_run_in_workers")
    workers = f"; run in worker processes before this wall: {_value(ran)}" if ran else ""
    return (
        f"torch {run.get('torch')}, Python {run.get('python')}, {run.get('threads')} threads on "
        f"{run.get('cpu')} ({run.get('cpu_count')} CPUs); wall {run.get('wall_s')} s (cached seeds: "
        f"{_value(rec['cached_seeds']) or 'none'}{workers}), peak memory {run.get('peak_rss_mib')} MiB"
    )


def _figure_src(r: dict[str, Any], scale: Scale | None) -> str:
    """The figure's path relative to the report: the latest run's, or the one kept for ``scale``."""
    return f"{r['name']}/figure.png" if scale is None else f"{r['name']}/scales/{scale.value}/figure.png"


def render_markdown(
    records: list[dict[str, Any]], problems: Sequence[tuple[Path, str]] = (), scale: Scale | None = None
) -> str:
    """The Markdown page: a summary table, the unreadable files, then one section per result (figures of
    ``scale``'s kept results when given)."""
    lines = ["# normatlas experiments", "", _summary(records), ""]
    lines += ["| # | experiment | verdict | deciding clause: median [min, max] vs threshold | margin (min .. max) |"]
    lines += ["|---|---|---|---|---|"]
    for r in records:
        c = deciding_clause(r)
        lines += [
            f"| {r['number']} | [{r['name']}](#{r['name']}) | {_cell(_verdict(r))} | {_cell(spread(c))} "
            f"| {_cell(margin(c))} |"
        ]
    if problems:
        lines += ["", "**Results that could not be read:**", ""]
        lines += [f"- `{p}`: {_cell(why)}" for p, why in problems]
    for r in records:
        lines += ["", f'<a id="{r["name"]}"></a>', f"## {r['number']}. {r['title']}", ""]
        lines += [f"**Claim.** {r['claim']}", "", f"> {r['guide_words']}", ""]
        lines += [f"**Anchor** `{r['anchor']}`: {r['anchor_reports']}", "", f"**Rule.** {r['expected']}", ""]
        lines += [f"**Verdict:** {_verdict(r)}", ""]
        lines += [f"- {_cell(why)}" for why in r["reasons"]]
        lines += [
            "",
            "| clause | verdict | median [min, max] vs threshold | margin (min .. max) |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {_cell(c['says'])} | {c['verdict']} | {_cell(spread(c))} | {_cell(margin(c))} |" for c in r["clauses"]
        ]
        lines += ["", f"| measured (seed {r['seeds'][0]}) | value |", "|---|---|"]
        lines += [f"| {_cell(k)} | {_cell(_value(v))} |" for k, v in r["measured"].items()]
        lines += ["", f"![{r['name']}]({_figure_src(r, scale)})", ""]
        if r["notes"]:
            lines += [f"*Notes.* {r['notes']}", ""]
        lines += ["```", r["command"], "```", _run_line(r)]
    return "\n".join(lines) + "\n"


_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;line-height:1.45}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
.holds{color:#0a6b2b;font-weight:600}.no{color:#a11;font-weight:600}.inconclusive{color:#8a5a00;font-weight:600}
img{max-width:100%;border:1px solid #eee}.bad{color:#a11}
blockquote{color:#444;border-left:3px solid #ccc;margin-left:0;padding-left:1em}code,pre{background:#f5f5f5}"""


def _cls(verdict: str) -> str:
    return {"holds": "holds", "does not hold": "no"}.get(verdict, "inconclusive")


def _html_section(r: dict[str, Any], scale: Scale | None = None) -> list[str]:
    e = html.escape
    rows = "".join(f"<tr><td>{e(str(k))}</td><td>{e(_value(v))}</td></tr>" for k, v in r["measured"].items())
    crow = "".join(
        f'<tr><td>{e(c["says"])}</td><td class="{_cls(c["verdict"])}">{e(c["verdict"])}</td>'
        f"<td>{e(spread(c))}</td><td>{e(margin(c))}</td></tr>"
        for c in r["clauses"]
    )
    out = [f'<section id="{e(r["name"])}"><h2>{r["number"]}. {e(r["title"])}</h2>']
    out += [f"<p><b>Claim.</b> {e(r['claim'])}</p>", f"<blockquote>{e(r['guide_words'])}</blockquote>"]
    out += [f"<p><b>Anchor</b> <code>{e(r['anchor'])}</code>: {e(r['anchor_reports'])}</p>"]
    out += [f"<p><b>Rule.</b> {e(r['expected'])}</p>"]
    out += [f'<p class="{_cls(r["verdict"])}">Verdict: {e(_verdict(r))}</p>']
    if r["reasons"]:
        out += ["<ul>" + "".join(f"<li>{e(why)}</li>" for why in r["reasons"]) + "</ul>"]
    out += ["<table><tr><th>clause</th><th>verdict</th><th>median [min, max] vs threshold</th><th>margin</th></tr>"]
    out[-1] += crow + "</table>"
    out += [f"<table><tr><th>measured (seed {r['seeds'][0]})</th><th>value</th></tr>{rows}</table>"]
    out += [f'<img src="{e(_figure_src(r, scale))}" alt="{e(r["title"])}">']
    if r["notes"]:
        out += [f"<p><i>Notes.</i> {e(r['notes'])}</p>"]
    out += [f"<pre>{e(r['command'])}</pre><p>{e(_run_line(r))}</p></section>"]
    return out


def render_html(
    records: list[dict[str, Any]], problems: Sequence[tuple[Path, str]] = (), scale: Scale | None = None
) -> str:
    """The HTML page: the same content as :func:`render_markdown`, with inline CSS and no script."""
    e = html.escape
    head = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">', "<title>normatlas experiments</title>"]
    head += [f"<style>{_CSS}</style></head><body>", "<h1>normatlas experiments</h1>"]
    head += [f"<p>{e(_summary(records))}</p>", "<table><tr><th>#</th><th>experiment</th><th>verdict</th>"]
    head[-1] += "<th>deciding clause: median [min, max] vs threshold</th><th>margin</th></tr>"
    for r in records:
        c = deciding_clause(r)
        head += [
            f'<tr><td>{r["number"]}</td><td><a href="#{e(r["name"])}">{e(r["name"])}</a></td>'
            f'<td class="{_cls(r["verdict"])}">{e(_verdict(r))}</td><td>{e(spread(c))}</td><td>{e(margin(c))}</td></tr>'
        ]
    head += ["</table>"]
    if problems:
        head += ['<p class="bad">Results that could not be read:</p><ul>']
        head += [f"<li><code>{e(str(p))}</code>: {e(why)}</li>" for p, why in problems] + ["</ul>"]
    body = [line for r in records for line in _html_section(r, scale)]
    return "\n".join([*head, *body, "</body></html>"]) + "\n"


def write_report(
    out: str | os.PathLike[str], scale: Scale | str | None = None
) -> tuple[Path, Path, list[dict[str, Any]], list[tuple[Path, str]]]:
    """Write ``out/report.md`` and ``out/report.html`` (``report-<scale>.*`` from each experiment's latest result at
    ``scale`` when given); returns their paths, the records used and the files that could not be read. A ValueError
    when ``out`` holds no readable result."""
    root = Path(out)
    scale = None if scale is None else Scale.parse(scale)
    records, problems = read_results(root, scale)
    if not records:
        bad = "; ".join(f"{p}: {why}" for p, why in problems)
        where = "*/result.json" if scale is None else f"*/scales/{scale.value}/result.json"
        raise ValueError(
            f"out={str(root)!r} holds no readable {where} (run `normatlas experiments run` first)"
            + (f"; unreadable: {bad}" if bad else "")
        )
    paths = []
    stem = "report" if scale is None else f"report-{scale.value}"
    pages = (
        (f"{stem}.md", render_markdown(records, problems, scale)),
        (f"{stem}.html", render_html(records, problems, scale)),
    )
    for name, text in pages:
        path = root / name
        atomic_write(path, text)
        paths.append(path)
    return paths[0], paths[1], records, problems
