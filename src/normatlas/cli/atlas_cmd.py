"""``normatlas matrix`` and ``normatlas papers``: the essay's model matrix and bibliography."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from . import CliError, command
from ._format import add_format_option, format_rows

_TABLE_COLS = ("name", "family", "year", "operator", "placement", "qk_norm", "vision_tower_norm", "connector", "status")


def _configure_matrix(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", help="family name contains this (e.g. Gemma, Qwen)")
    p.add_argument("--operator", help="layernorm, rmsnorm, none, unclear, ...")
    p.add_argument("--placement", help="pre, post, peri, res-post, parallel, none, mix, unclear")
    p.add_argument("--qk-norm", dest="qk_norm", help="none, yes, per-head, flattened, unclear")
    p.add_argument("--search", help="free-text search over every field")
    p.add_argument("--all-fields", action="store_true", help="every field (JSON/CSV always have them)")
    p.add_argument(
        "--check",
        action="store_true",
        help="reconcile with the dataflow inspected from transformers' code (tiny models, offline)",
    )
    p.add_argument("--from", dest="from_file", help="with --check: use a sweep JSON from `inspect --all-transformers`")
    p.add_argument("--agreements", action="store_true", help="with --check: also list agreements")
    add_format_option(p)


@command("matrix", "the essay's model matrix: operator, placement, QK-norm, VLM tower and connector", _configure_matrix)
def matrix(args: argparse.Namespace) -> int:
    from .. import atlas

    if args.check:
        return _check(args)
    rows = atlas.filter_models(
        family=args.family, operator=args.operator, placement=args.placement, qk_norm=args.qk_norm, query=args.search
    )
    if args.format == "table" and not args.all_fields:
        rows = [{k: ("-" if r[k] is None else r[k]) for k in _TABLE_COLS} for r in rows]
    elif args.format == "csv":
        rows = [{k: ";".join(v) if isinstance(v, list) else v for k, v in r.items()} for r in rows]
    print(format_rows(rows, args.format, title=f"{len(rows)} models"))
    return 0


def _check(args: argparse.Namespace) -> int:
    import warnings

    from .. import atlas

    warnings.filterwarnings("ignore")
    source: Any
    if args.from_file:
        source = _read_sweep(args.from_file)
    else:
        from ..inspect import inspect_target

        cache: dict[str, dict[str, Any]] = {}

        def source(mt: str) -> dict[str, Any]:
            if mt not in cache:
                cache[mt] = inspect_target(mt, probe=False).summary_row()
            return cache[mt]

    rows = atlas.check(source, include_agreements=args.agreements)
    if args.format == "table":
        rows = [{k: v for k, v in r.items() if k != "source"} for r in rows]
    print(format_rows(rows, args.format, title="curated matrix vs inspected dataflow"))
    return 0


_SWEEP_SHAPE = (
    "it must be a JSON list of objects, one per model type, each with a string 'model' key "
    "(the transformers_matrix.json that `normatlas inspect --all-transformers` writes)"
)
_JSON_TYPE = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def _json_type(value: object) -> str:
    return "null" if value is None else _JSON_TYPE.get(type(value), type(value).__name__)


def _read_sweep(name: str) -> dict[str, dict[str, Any]]:
    """The sweep file of ``--from`` as ``{model type: summary row}``; CliError when it is malformed."""
    path = Path(name)
    if not path.is_file():
        raise CliError(f"--from {name}: no such file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CliError(f"--from {name}: not JSON ({exc}); {_SWEEP_SHAPE}") from exc
    if not isinstance(data, list):
        raise CliError(f"--from {name}: holds a JSON {_json_type(data)}; {_SWEEP_SHAPE}")
    rows: dict[str, dict[str, Any]] = {}
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise CliError(f"--from {name}: entry {i} is a JSON {_json_type(row)}; {_SWEEP_SHAPE}")
        if not isinstance(row.get("model"), str):
            raise CliError(f"--from {name}: entry {i} has no string 'model' (got {row.get('model')!r}); {_SWEEP_SHAPE}")
        rows[row["model"]] = row
    return rows


def _configure_papers(p: argparse.ArgumentParser) -> None:
    p.add_argument("--question", help="group or question contains this (e.g. 'attention', 'removed')")
    p.add_argument("--search", help="free-text search over every field")
    add_format_option(p)


@command("papers", "the essay's bibliography, grouped by the question each paper answers", _configure_papers)
def papers(args: argparse.Namespace) -> int:
    from .. import atlas

    rows = atlas.filter_papers(group=args.question, query=args.search)
    if args.format == "table":
        rows = [
            {
                "group": r["group"],
                "paper": r["named_as"][:60],
                "year": r["year"] or "-",
                "arXiv": r["arxiv"] or "(unverified)",
            }
            for r in rows
        ]
    print(format_rows(rows, args.format, title=f"{len(rows)} papers"))
    return 0
