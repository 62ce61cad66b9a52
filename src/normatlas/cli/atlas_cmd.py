"""``normatlas matrix`` and ``normatlas papers``: the essay's model matrix and bibliography."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .._io import read_json
from . import CliError, one_of
from . import _progress as progress
from ._format import Section, add_format_option, emit

_TABLE_COLS = ("name", "family", "year", "operator", "placement", "qk_norm", "vision_tower_norm", "connector", "status")
_FILTERS = ("family", "operator", "placement", "qk_norm", "search")


def configure_matrix(p: argparse.ArgumentParser) -> None:
    from ..atlas import OPERATORS, PLACEMENTS, QK_NORMS

    p.add_argument("--family", help="family name contains this (e.g. Gemma, Qwen)")
    p.add_argument("--operator", type=one_of(OPERATORS), help=", ".join(OPERATORS))
    p.add_argument("--placement", type=one_of(PLACEMENTS), help=", ".join(PLACEMENTS))
    p.add_argument("--qk-norm", dest="qk_norm", type=one_of(QK_NORMS), help=", ".join(QK_NORMS))
    p.add_argument("--search", help="free-text search over every field")
    p.add_argument("--all-fields", action="store_true", help="every field in the table (JSON/CSV always have them)")
    p.add_argument(
        "--check",
        action="store_true",
        help="reconcile with the dataflow inspected from transformers' code (tiny models, offline)",
    )
    p.add_argument("--from", dest="from_file", help="with --check: use a sweep JSON from `inspect --all-transformers`")
    p.add_argument("--agreements", action="store_true", help="with --check: also list agreements")
    add_format_option(p)


def matrix(args: argparse.Namespace) -> int:
    from .. import atlas

    if args.check:
        given = [f"--{f.replace('_', '-')}" for f in _FILTERS if getattr(args, f) is not None]
        given += ["--all-fields"] if args.all_fields else []
        if given:
            raise CliError(f"{', '.join(given)}: not with --check (it reconciles every record of the matrix)")
        return _check(args)
    for flag, value in (("--from", args.from_file), ("--agreements", args.agreements or None)):
        if value is not None:
            raise CliError(f"{flag} needs --check")
    rows = atlas.filter_models(
        family=args.family, operator=args.operator, placement=args.placement, qk_norm=args.qk_norm, query=args.search
    )
    cols = None if args.all_fields or args.format != "table" else _TABLE_COLS
    emit([Section("models", rows, f"{len(rows)} models", cols)], args.format)
    return 0


def _check(args: argparse.Namespace) -> int:
    import warnings

    from .. import atlas

    warnings.filterwarnings("ignore")
    source: Any
    with progress.phase("inspecting transformers' code") as ph:
        if args.from_file:
            source = _read_sweep(args.from_file)
        else:
            cache: dict[str, dict[str, Any]] = {}

            def source(mt: str) -> dict[str, Any]:
                if mt not in cache:
                    ph.update(f"{mt} ({len(cache) + 1} built)")
                    cache[mt] = inspected_row(mt)
                return cache[mt]

        rows = atlas.check(source, include_agreements=args.agreements)
    cols = ("model", "hf_model_type", "field", "curated", "inspected", "verdict") if args.format == "table" else None
    emit([Section("checks", rows, "curated matrix vs inspected dataflow", cols)], args.format)
    return 0


def inspected_row(model_type: str) -> dict[str, Any]:
    """What ``matrix --check`` compares a record with: an image-text model type run whole on an image + text
    (its tower and connector checked too), an image encoder on an image (a tower whose only norms are batch
    statistics reads as ``batchnorm``), any other model type on tokens."""
    from ..factory import is_vision_type, is_vlm_type
    from ..inspect import inspect_target, inspect_vision_target
    from ..inspect.vlm import inspect_vlm_target

    if is_vlm_type(model_type):
        return inspect_vlm_target(model_type, probe=False).check_row()
    if is_vision_type(model_type):
        rep = inspect_vision_target(model_type, probe=False)
        row = rep.summary_row()
        if rep.operator.value == "none" and rep.batch_stat_norms:
            row["operator"] = "batchnorm"
        return row
    return inspect_target(model_type, probe=False).summary_row()


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
        data = read_json(path)
    except ValueError as exc:
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


def configure_papers(p: argparse.ArgumentParser) -> None:
    p.add_argument("--question", help="group or question contains this (e.g. 'attention', 'removed')")
    p.add_argument("--search", help="free-text search over every field")
    status = p.add_mutually_exclusive_group()
    status.add_argument(
        "--verified",
        dest="verified",
        action="store_const",
        const=True,
        help="only papers whose title and id a public page confirmed",
    )
    status.add_argument(
        "--unverified",
        dest="verified",
        action="store_const",
        const=False,
        help="only papers that could not be confirmed (and why)",
    )
    p.add_argument(
        "--links",
        action="store_true",
        help="table: each paper's link and its title-search fallback (JSON/CSV always have them)",
    )
    add_format_option(p)


def _paper_cell(rec: dict[str, Any]) -> str:
    """The title where confirmed, else how the essay names it, else the question it answers."""
    return str(rec["title"] or rec["named_as"] or rec["question"])


def papers(args: argparse.Namespace) -> int:
    from ..atlas.papers import filter_papers, paper_row

    rows = [paper_row(r) for r in filter_papers(group=args.question, query=args.search, verified=args.verified)]
    title = f"{len(rows)} papers, {sum(r['verified'] is not None for r in rows)} verified"
    section = Section("papers", rows, title)
    notes: list[str] = []
    if args.format == "table":  # each group once, as a heading over its papers
        if args.links:
            table = [{"group": r["group"], "paper": _paper_cell(r), "link": r["link"]} for r in rows]
            notes.append("each link's title-search fallback is the 'search' field of --format json or csv")
        else:
            table = [
                {
                    "group": r["group"],
                    "paper": _paper_cell(r),
                    "year": r["year"],
                    "arXiv": r["arxiv"],
                    "verified": r["verified"] is not None,
                }
                for r in rows
            ]
        section = Section("papers", table, title, group="group")
    elif args.links:
        raise CliError("--links only changes the table (JSON and CSV always carry link and search)")
    emit([section], args.format, notes=notes)
    return 0
