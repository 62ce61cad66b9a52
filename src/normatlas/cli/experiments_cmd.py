"""``normatlas experiments list | run NAME... | report``: the guide's quantitative claims, each measured here.

``run`` runs each experiment at ``--seeds N`` seeds (default 3, from ``--seed``) and ``--scale quick|default|paper``
(``--quick`` is ``--scale quick``), writes ``DIR/NAME/result.json``, ``figure.png`` / ``.svg`` and one CSV per series
(see :mod:`normatlas.experiments.runner`) and prints one verdict line per experiment: ``holds``, ``does not hold``
or ``inconclusive``, with the deciding clause's spread over seeds and its margin. Each seed's outcome is cached
under ``DIR/NAME/seeds/``, so a killed run continues where it stopped (``--fresh`` reruns every seed); ``--jobs N``
runs the seeds the cache lacks in N worker processes first (:mod:`normatlas.experiments.pool`), ``--plan`` lists
them and the estimated hours without running anything. A claim that
does not hold is a result, not an error: the exit code is 0 either way; a crash or a bad argument exits non-zero.
``report`` writes ``DIR/report.md`` and ``DIR/report.html`` from the ``result.json`` files found under ``DIR``; a
file it cannot read is named and the rest are shown.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from . import CliError, nonnegative_int, positive_int
from . import _progress as progress
from ._format import Section, add_format_option, emit

DEFAULT_OUT = Path("experiments-out")
SCALES = ("quick", "default", "paper")


def configure_experiments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    ls = sub.add_parser("list", help="every experiment: name, claim, its rule, runtime per seed at each scale")
    add_format_option(ls)
    run = sub.add_parser("run", help="run experiments over seeds and write result.json, figures and CSV per series")
    run.add_argument("names", nargs="+", metavar="NAME", help="experiment names (see `experiments list`), or all")
    run.add_argument(
        "--scale", choices=SCALES, default=None,
        help="quick: seconds (the tests); default: about a minute per seed; paper: the deep, long runs the claims "
        "are about (see `experiments list` for each estimate)",
    )  # fmt: skip
    run.add_argument("--quick", action="store_true", help="the same as --scale quick")
    run.add_argument("--seeds", type=positive_int, default=3, help="how many seeds, from --seed on (default 3)")
    run.add_argument("--seed", type=nonnegative_int, default=0, help="the first seed (default 0)")
    run.add_argument("--fresh", action="store_true", help="rerun every seed instead of reading cached ones")
    run.add_argument(
        "--jobs", type=positive_int, default=1, metavar="N",
        help="run the seeds the cache lacks in N worker processes at once (CPUs / N torch threads each; default 1: "
        "one after another in this process), then decide every verdict from the cache",
    )  # fmt: skip
    run.add_argument(
        "--plan", action="store_true",
        help="run nothing: list which seeds are cached for this code and which would run, with estimated seconds",
    )  # fmt: skip
    run.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: ./{DEFAULT_OUT})")
    add_format_option(run)
    rep = sub.add_parser("report", help="write DIR/report.md and DIR/report.html from the result.json files")
    rep.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"the folder of the results (default: ./{DEFAULT_OUT})"
    )
    rep.add_argument(
        "--scale", choices=("quick", "default", "paper"), default=None,
        help="report each experiment's latest result at this scale (DIR/report-SCALE.md); default: the latest run",
    )  # fmt: skip
    add_format_option(rep)


def experiments(args: argparse.Namespace) -> int:
    action = {"list": _list, "run": _run, "report": _report}[args.action]
    return action(args)


def _list(args: argparse.Namespace) -> int:
    from ..experiments import experiments as found
    from ..experiments.base import Scale

    rows = [
        {
            "number": e.number, "name": e.name, "claim": e.claim, "rule": e.expected,
            **{f"{s.value}_s": e.estimate_s(s) for s in Scale},
        }
        for e in found()
    ]  # fmt: skip
    note = "runtime in seconds per seed at each scale, measured on an idle 2-core CPU (paper: estimated)"
    emit([Section("experiments", rows, f"{len(rows)} experiments ({note})")], args.format)
    return 0


def selected(names: list[str]) -> list[str]:
    """The experiment names asked for, in the order given (``all``: every experiment); a CliError names the
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


def scale_of(args: argparse.Namespace) -> str:
    """``--scale``, with ``--quick`` as its alias (the two disagreeing is an error)."""
    if args.quick and args.scale not in (None, "quick"):
        raise CliError(f"--quick is --scale quick, but --scale {args.scale} was given too")
    return "quick" if args.quick else (args.scale or "default")


def _run(args: argparse.Namespace) -> int:
    from ..experiments import experiment
    from ..experiments.report import deciding_clause, margin, spread
    from ..experiments.runner import run_experiment

    names = selected(args.names)
    scale = scale_of(args)
    seeds = tuple(range(args.seed, args.seed + args.seeds))
    if args.plan:
        return _plan(args, names, scale, seeds)
    ran = _fill_in_workers(args, names, scale, seeds) if args.jobs > 1 else {}
    rows = []
    for i, name in enumerate(names, 1):
        exp = experiment(name)
        command = f"normatlas experiments run {name} --scale {scale} --seed {args.seed} --seeds {args.seeds}"
        command += f" --out {shlex.quote(str(args.out))}"
        here = [s for n, s in ran if n == name]
        with progress.phase(f"experiment {i}/{len(names)}: {name}") as ph:
            rec = run_experiment(
                exp, args.out, scale=scale, seeds=seeds, progress=ph.update, command=command,
                fresh=args.fresh and args.jobs == 1, ran_elsewhere=here,
            )  # fmt: skip
        c = deciding_clause(rec)
        rows.append({
            "name": name, "verdict": rec["verdict"], "deciding": spread(c), "margin": margin(c),
            "seconds": rec["seconds"], "cached_seeds": rec["cached_seeds"], "folder": str(args.out / name),
        })  # fmt: skip
        if args.format == "table":
            progress.clear()
            cached = f", {len(rec['cached_seeds'])} seed(s) cached" if rec["cached_seeds"] else ""
            print(f"{name}: {rec['verdict']} ({spread(c)}; margin {margin(c)}; {rec['seconds']:.1f} s{cached})")
            for why in rec["reasons"]:
                print(f"  - {why}")
            sys.stdout.flush()
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("holds", "does not hold", "inconclusive")}
    meta = {**counts, "total": len(rows), "scale": scale, "seeds": list(seeds)}
    summary = (
        f"of {len(rows)} claims: {counts['holds']} hold, {counts['does not hold']} do not hold, "
        f"{counts['inconclusive']} inconclusive ({scale} scale, seeds {seeds[0]}..{seeds[-1]}); results in {args.out}"
    )
    if args.format == "table":
        print(summary)
    else:
        emit([Section("experiments", rows, summary)], args.format, meta=meta)
    return 0


def _fill_in_workers(
    args: argparse.Namespace, names: list[str], scale: str, seeds: tuple[int, ...]
) -> dict[tuple[str, int], float]:
    """``--jobs N``: the seed runs the cache lacks, in N worker processes (seconds per (name, seed))."""
    from ..experiments import experiment
    from ..experiments.pool import fill_cache, seed_tasks

    tasks = seed_tasks([experiment(n) for n in names], args.out, scale=scale, seeds=seeds, fresh=args.fresh)
    with progress.phase(f"seed runs in {args.jobs} workers") as ph:
        try:
            return fill_cache(tasks, args.out, scale=scale, jobs=args.jobs, fresh=args.fresh, progress=ph.update)
        except RuntimeError as exc:
            raise CliError(f"{exc} (the seeds that finished are cached: run the same command again to go on)") from None


def _plan(args: argparse.Namespace, names: list[str], scale: str, seeds: tuple[int, ...]) -> int:
    from ..experiments import experiment
    from ..experiments.runner import plan_seeds

    rows, total, runs = [], 0.0, 0
    for name in names:
        plans = plan_seeds(experiment(name), args.out, scale=scale, seeds=seeds, fresh=args.fresh)
        todo, seconds = [p.seed for p in plans if not p.cached], sum(p.estimate_s for p in plans)
        rows.append({
            "name": name, "cached_seeds": [p.seed for p in plans if p.cached], "to_run": todo, "estimate_s": seconds
        })  # fmt: skip
        total, runs = total + seconds, runs + len(todo)
    wall = total
    if args.jobs > 1:
        from ..experiments.pool import makespan, seed_tasks

        exps = [experiment(n) for n in names]
        wall = makespan(seed_tasks(exps, args.out, scale=scale, seeds=seeds, fresh=args.fresh), args.jobs)
        wall *= max(1.0, args.jobs / (os.cpu_count() or 1))  # more workers than CPUs share them
    how = "one seed after another" if args.jobs == 1 else f"as {args.jobs} workers, roughly,"
    summary = (
        f"{runs} of {len(rows) * len(seeds)} seed runs to do ({scale} scale, seeds {seeds[0]}..{seeds[-1]}, cache in "
        f"{args.out}): about {wall / 3600:.1f} h {how} on an idle 2-core CPU; nothing was run"
    )
    meta = {"scale": scale, "seeds": list(seeds), "seconds": total, "jobs": args.jobs, "wall_s": wall}
    emit([Section("plan", rows, summary)], args.format, meta=meta)
    return 0


def _report(args: argparse.Namespace) -> int:
    from ..experiments.report import write_report

    if not args.out.is_dir():
        raise CliError(f"--out {args.out}: no such folder (run `normatlas experiments run ... --out DIR` first)")
    try:
        md, html, records, problems = write_report(args.out, args.scale)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    rows = [{"name": r["name"], "verdict": r["verdict"], "scale": r["scale"], "seconds": r["seconds"]} for r in records]
    rows += [{"name": str(p), "verdict": f"unreadable: {why}", "scale": "", "seconds": ""} for p, why in problems]
    emit([Section("report", rows, f"wrote {md} and {html}")], args.format)
    return 0
