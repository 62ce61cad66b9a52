"""Inspect every image-text model type of the installed transformers whole, and count how far each gets.

The types are the ones ``normatlas inspect`` treats as image-text models (:func:`normatlas.factory.is_vlm_type`).
Each is built tiny offline (:func:`normatlas.factory.build_vlm`), given its synthetic image + text batch
(:func:`~normatlas.factory.vlm_inputs`) and inspected (:func:`normatlas.inspect.vlm.inspect_vlm`), in a
forked child killed after ``--timeout`` seconds. One line per type says where it stopped:

* ``ok``: the three parts were read (the line shows tower / connector / injection / language model);
* ``ok (parts unread)``: the run was split, but the tower's or the language model's operator or placement was not
  found (``none`` / ``unknown``: the reading, not the run, stopped short);
* ``failed build``: the model or its inputs could not be made from the config (``build:`` / ``inputs:`` says which);
* ``failed run``: the recorded forward raised on the batch;
* ``failed read``: the run was recorded but splitting or reading it raised;
* ``died``: the child was killed after the timeout, or crashed (its exit code given).

    PYTHONPATH=src HF_HUB_OFFLINE=1 nice python benchmarks/vlm_sweep.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import csv
import re
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from normatlas._io import atomic_write, dumps
from normatlas.inspect.sweep import run_isolated

COLUMNS = ["model", "status", "tower", "connector", "connector_norm", "injection", "lm", "reason", "seconds"]
STATUSES = ("ok", "ok (parts unread)", "failed build", "failed run", "failed read", "died")


def _why(exc: BaseException) -> str:
    """The exception's type and its first non-blank line (a missing package's ImportError starts with a newline)."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}"[:240]


# the address-space cap of each child: a config that stays huge after shrinking fails, not the host
LIMITS = {"memory_gb": 4.0}


def limit_child() -> None:
    """A sweep child's limits: the address-space cap (:data:`LIMITS`) and one intra-op thread."""
    import resource

    import torch

    cap = int(LIMITS["memory_gb"] * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    torch.set_num_threads(1)


def build_feed_inspect(
    mt: str,
    columns: list[str],
    build: Any,
    feed: Any,
    inspect: Any,
    *,
    build_failures: tuple[tuple[str, str], tuple[str, str]],
    describe: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """``inspect(model, inputs)`` of ``model = build(mt)`` and ``inputs = feed(model)``, warnings silenced, each step
    guarded: ``(report, row)``, or ``(None, the row of the step that failed)``, the row ``columns`` blank but
    ``model``. ``build_failures``: the status and the reason's prefix when ``build``, and when ``feed``, raises; a
    failed inspection is ``failed run`` (the recorded forward raised: its cause) or ``failed read``.
    ``describe(inputs)``: columns the row takes once the inputs are made (before ``inspect``, which may consume
    them). Shared with ``vision_sweep.py``."""
    from normatlas.inspect import UntraceableModel

    (build_status, build_prefix), (feed_status, feed_prefix) = build_failures
    row: dict[str, Any] = {c: "" for c in columns} | {"model": mt}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = build(mt)
        except Exception as exc:  # a per-architecture row, by design
            return None, row | {"status": build_status, "reason": build_prefix + _why(exc)}
        try:
            inputs = feed(model)
        except Exception as exc:
            return None, row | {"status": feed_status, "reason": feed_prefix + _why(exc)}
        row = row | (describe(inputs) if describe is not None else {})
        try:
            return inspect(model, inputs), row
        except UntraceableModel as exc:  # raised only when the recorded forward itself fails
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            return None, row | {"status": "failed run", "reason": _why(cause)}
        except Exception as exc:
            return None, row | {"status": "failed read", "reason": _why(exc)}


def one(mt: str) -> dict[str, Any]:
    """Build, feed and inspect one image-text model type; the row never raises."""
    limit_child()
    from normatlas.factory import build_vlm, vlm_inputs
    from normatlas.inspect.vlm import inspect_vlm

    rep, row = build_feed_inspect(
        mt,
        COLUMNS,
        build_vlm,
        vlm_inputs,
        lambda model, inputs: inspect_vlm(model, inputs, name=mt, probe=False),
        build_failures=(("failed build", "build: "), ("failed build", "inputs: ")),
    )
    if rep is None:
        return row
    s = rep.summary_row()
    unread = [f"{part} {s[key]}" for part, key in (("tower", "tower"), ("lm", "lm")) if _unread(s[key])]
    return row | {
        "status": "ok (parts unread)" if unread else "ok",
        "reason": "; ".join(unread),
        "tower": s["tower"] + (f" final {s['tower final']}" if s["tower final"] != "none" else ""),
        "connector": s["connector"],
        "connector_norm": s["connector norm"],
        "injection": s["injection"],
        "lm": f"{s['lm']} qk {s['lm qk_norm']}",
    }


def _unread(part: str) -> bool:
    """An operator / placement pair with no norm or no placement found (the run went through, the reading did not)."""
    operator, _, placement = part.partition(" ")
    return operator == "none" or placement in ("unknown", "none")


def isolated(mt: str, timeout: float, fn: Any = None, columns: list[str] = COLUMNS) -> dict[str, Any]:
    """``fn(mt)`` (default :func:`one`) in a forked child; a ``died`` row when it timed out or crashed."""
    try:
        row, why = run_isolated(fn or one, mt, timeout)
    except EOFError:  # the child died before sending its row (a crash of the interpreter)
        row, why = None, "the child exited without a row"
    return row or {c: "" for c in columns} | {"model": mt, "status": "died", "reason": why}


def reason_group(reason: str) -> str:
    """A failure's reason with numbers, shapes, quoted names and class names dropped, for grouping."""
    text = re.sub(r"\b(?![A-Za-z]*Error\b)[A-Z][A-Za-z0-9_]*[A-Z][A-Za-z0-9_]*\b", "<class>", reason)
    text = re.sub(r"'[^']*'", "'...'", text)
    text = re.sub(r"\([^()]*\)|\[[^\[\]]*\]", "(...)", text)
    return re.sub(r"\d+", "N", text)[:110]


def main() -> None:
    from normatlas.factory import is_vlm_type

    sweep_main(__doc__, "image-text types", 180.0, is_vlm_type, one, "vlm_sweep", COLUMNS, STATUSES)


def sweep_main(
    doc: str,
    what: str,
    timeout: float,
    is_type: Any,
    fn: Any,
    name: str,
    columns: list[str],
    statuses: tuple[str, ...],
) -> None:
    """The command line of a sweep over the installed transformers' model types that ``is_type`` accepts (``--out``,
    ``--timeout``, ``--only``, ``--memory-gb``), each run by ``fn`` in a forked child; shared with
    ``vision_sweep.py``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--timeout", type=float, default=timeout, help="seconds per model type")
    ap.add_argument("--only", nargs="*", help=f"model types (default: every one of the {what})")
    ap.add_argument("--memory-gb", type=float, default=LIMITS["memory_gb"], help="address-space cap per model type")
    args = ap.parse_args()
    LIMITS["memory_gb"] = args.memory_gb
    import transformers  # noqa: F401  (imported once, before forking)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    # imported before forking, so every child runs the code the sweep started with
    import normatlas.factory
    import normatlas.inspect.stages
    import normatlas.inspect.vision
    import normatlas.inspect.vlm  # noqa: F401

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        types = args.only or [mt for mt in sorted(CONFIG_MAPPING_NAMES) if is_type(mt)]
    run(types, fn, name, what, columns, statuses, args.timeout, Path(args.out))


def run(
    types: list[str],
    fn: Any,
    name: str,
    what: str,
    columns: list[str],
    statuses: tuple[str, ...],
    timeout: float,
    out: Path,
) -> list[dict[str, Any]]:
    """Run ``fn`` on every type in a forked child, print a line per type and the counts per status and per
    failure reason, and write ``out/name.json`` and ``out/name.csv``; shared with ``vision_sweep.py``."""
    rows = []
    for i, mt in enumerate(types):
        t0 = time.perf_counter()
        row = isolated(mt, timeout, fn, columns)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        ok = row["status"].startswith("ok")
        detail = " | ".join(str(row[c]) for c in columns[2:-2]) if ok else row["reason"][:160]
        print(f"[{i + 1}/{len(types)}] {mt}: {row['status']}  {detail}  ({row['seconds']} s)", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / f"{name}.json", dumps(rows, indent=1))
    with (out / f"{name}.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    counts = Counter(r["status"] for r in rows)
    print(f"{len(rows)} {what}: " + ", ".join(f"{counts[s]} {s}" for s in statuses))
    for reason, n in Counter(reason_group(r["reason"]) for r in rows if not r["status"].startswith("ok")).most_common():
        print(f"{n:4d}  {reason}")
    return rows


if __name__ == "__main__":
    main()
