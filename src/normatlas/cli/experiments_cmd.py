"""``normatlas experiments list | run NAME... | report``: the guide's quantitative claims, each measured here.

``run`` writes ``DIR/NAME/result.json``, ``figure.png`` / ``.svg`` and one CSV per series (see
:mod:`normatlas.experiments.runner`) and prints one verdict line per experiment. A claim that does not hold is a
result, not an error: the exit code is 0 either way; a crash or a bad argument exits non-zero. ``report`` writes
``DIR/report.md`` and ``DIR/report.html`` from the ``result.json`` files found under ``DIR``.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from . import CliError, nonnegative_int
from . import _progress as progress
from ._format import Section, add_format_option, emit

DEFAULT_OUT = Path("experiments-out")


def configure_experiments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    ls = sub.add_parser("list", help="every experiment: name, claim, runtime estimate (full and --quick)")
    add_format_option(ls)
    run = sub.add_parser("run", help="run experiments and write result.json, figure.png/.svg and CSV per series")
    run.add_argument("names", nargs="+", metavar="NAME", help="experiment names (see `experiments list`), or all")
    run.add_argument("--quick", action="store_true", help="a few seconds each: smaller models, fewer steps")
    run.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: ./{DEFAULT_OUT})")
    run.add_argument("--seed", type=nonnegative_int, default=0, help="the seed of every generator (default 0)")
    add_format_option(run)
    rep = sub.add_parser("report", help="write DIR/report.md and DIR/report.html from the result.json files")
    rep.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"the folder of the results (default: ./{DEFAULT_OUT})"
    )
    add_format_option(rep)


def experiments(args: argparse.Namespace) -> int:
    action = {"list": _list, "run": _run, "report": _report}[args.action]
    return action(args)


def _list(args: argparse.Namespace) -> int:
    from ..experiments import experiments as found

    rows = [
        {"number": e.number, "name": e.name, "claim": e.claim, "full": e.estimate_s, "quick": e.quick_estimate_s}
        for e in found()
    ]
    emit(
        [
            Section(
                "experiments",
                rows,
                f"{len(rows)} experiments (runtime in seconds, full and --quick, measured on an idle 2-core CPU)",
            )
        ],
        args.format,
    )
    return 0


def selected(names: list[str]) -> list[str]:
    """The experiment names asked for, in the order given (``all``: every experiment); a ValueError names the
    unknown ones and lists the known."""
    from ..experiments import experiments as found

    known = [e.name for e in found()]
    if "all" in names:
        if len(names) > 1:
            raise CliError(f"names={names!r}: 'all' stands alone")
        return known
    unknown = [n for n in names if n not in known]
    if unknown:
        raise CliError(f"unknown experiment(s) {unknown}; known: {', '.join(known)} (or all)")
    return list(dict.fromkeys(names))


def _run(args: argparse.Namespace) -> int:
    from ..experiments import experiment
    from ..experiments.runner import run_experiment

    names = selected(args.names)
    rows = []
    for i, name in enumerate(names, 1):
        exp = experiment(name)
        command = f"normatlas experiments run {name}{' --quick' if args.quick else ''} --seed {args.seed}"
        command += f" --out {shlex.quote(str(args.out))}"
        with progress.phase(f"experiment {i}/{len(names)}: {name}") as ph:
            rec = run_experiment(exp, args.out, quick=args.quick, seed=args.seed, progress=ph.update, command=command)
        rows.append({"name": name, "holds": rec["holds"], "seconds": rec["seconds"], "folder": str(args.out / name)})
        if args.format == "table":
            progress.clear()
            verdict = "holds" if rec["holds"] else "does NOT hold"
            print(f"{name}: {verdict} ({rec['seconds']:.1f} s) -> {args.out / name}", flush=True)
    held = sum(r["holds"] for r in rows)
    meta = {"held": held, "total": len(rows), "quick": args.quick, "seed": args.seed}
    summary = f"{held} of {len(rows)} claims hold{' (quick mode)' if args.quick else ''}; results in {args.out}"
    if args.format == "table":
        print(summary)
    else:
        emit([Section("experiments", rows, summary)], args.format, meta=meta)
    return 0


def _report(args: argparse.Namespace) -> int:
    from ..experiments.report import write_report

    if not args.out.is_dir():
        raise CliError(f"--out {args.out}: no such folder (run `normatlas experiments run ... --out DIR` first)")
    md, html, records = write_report(args.out)
    rows = [{"name": r["name"], "holds": r["holds"], "quick": r["quick"], "seconds": r["seconds"]} for r in records]
    emit([Section("report", rows, f"wrote {md} and {html}")], args.format)
    return 0
