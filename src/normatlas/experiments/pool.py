"""Seeds in parallel: the seed runs a request still needs, spread over worker processes, into the seed cache.

``normatlas experiments run ... --jobs N`` first asks :func:`~.runner.plan_seeds` which (experiment, seed) runs
the cache lacks, runs them in ``N`` worker processes (``torch`` threads per worker: the CPUs over ``N``, at least
one), each into the same per-seed cache a single process writes, and then decides every verdict from the cache
in the calling process, as a plain ``run`` reading back a finished run does. The numbers are those of a
one-process run at the same thread count: a seed is the same computation wherever it runs.

Experiments that read one shared trained set (the same ``Experiment.depends``, e.g. the depth claims' set) run
one after another for a seed, in one worker, so the set is trained once per seed and never by two processes at
once. Tasks start longest first (by the experiments' estimates), which keeps the workers busy to the end. A seed
that fails stops the request with an error naming the experiment and the seed; the seeds already finished stay
cached, so the same command run again continues from them. Each task runs in a fresh process (no state left
by one experiment reaches the next).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import experiment
from .base import Experiment, Scale
from .runner import plan_seeds, run_seed

__all__ = ["SeedTask", "fill_cache", "makespan", "seed_tasks", "worker_threads"]


@dataclass(frozen=True)
class SeedTask:
    """The runs one worker does in order: ``names`` (experiments sharing what ``depends`` names) at ``seed``."""

    names: tuple[str, ...]
    seed: int
    estimate_s: float

    def label(self) -> str:
        return f"{' + '.join(self.names)} seed {self.seed}"


def seed_tasks(
    exps: Sequence[Experiment], out: str | os.PathLike[str], *, scale: Scale | str, seeds: Sequence[int],
    fresh: bool = False,
) -> list[SeedTask]:  # fmt: skip
    """The seed runs the cache under ``out`` lacks for ``exps`` (all of them when ``fresh``), grouped so that
    experiments with the same non-empty ``depends`` share one task per seed, longest task first."""
    groups: dict[tuple[Any, int], list[tuple[str, float]]] = {}
    for exp in exps:
        for p in plan_seeds(exp, out, scale=scale, seeds=seeds, fresh=fresh):
            if not p.cached:
                key = (exp.depends or exp.name, p.seed)
                groups.setdefault(key, []).append((exp.name, p.estimate_s))
    tasks = [SeedTask(tuple(n for n, _ in runs), seed, sum(t for _, t in runs)) for (_, seed), runs in groups.items()]
    return sorted(tasks, key=lambda t: -t.estimate_s)


def makespan(tasks: Sequence[SeedTask], jobs: int) -> float:
    """Estimated wall seconds of ``tasks`` run in order on ``jobs`` workers, each task starting on the first free
    worker (the estimates are per seed on an idle 2-core CPU, so more workers than cores only shares them)."""
    free = [0.0] * max(1, jobs)
    for t in tasks:
        i = free.index(min(free))
        free[i] += t.estimate_s
    return max(free)


def worker_threads(jobs: int) -> int:
    """Torch threads per worker when ``jobs`` workers share this machine's CPUs (at least one)."""
    return max(1, (os.cpu_count() or 1) // jobs)


_messages: Any = None  # the worker's end of the progress queue (set by _init in each worker)


def _init(messages: Any, threads: int) -> None:
    import torch

    global _messages
    _messages = messages
    torch.set_num_threads(threads)


def _work(names: tuple[str, ...], out: str, scale: str, seed: int, fresh: bool) -> dict[str, float]:
    """Run one task in a worker; returns seconds per experiment."""
    seconds = {}
    for name in names:

        def say(msg: str, name: str = name) -> None:
            _messages.put((name, seed, msg))

        start = time.perf_counter()
        run_seed(experiment(name), out, scale=scale, seed=seed, progress=say, fresh=fresh)
        seconds[name] = time.perf_counter() - start
    return seconds


def fill_cache(
    tasks: Sequence[SeedTask], out: str | os.PathLike[str], *, scale: Scale | str, jobs: int, fresh: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[tuple[str, int], float]:  # fmt: skip
    """Run ``tasks`` in ``jobs`` worker processes into the seed cache under ``out`` (at most ``jobs`` at once, in
    the order given, each in a fresh process); returns seconds per (experiment, seed).

    A task that fails starts no new ones: those running finish (their seeds are cached), then a RuntimeError names
    the failed experiment and seed. An interrupt (Ctrl-C) stops the workers at once; a seed they had not finished
    leaves no outcome, so it is run again next time."""
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError(f"jobs={jobs!r} must be an integer >= 1")
    scale = Scale.parse(scale)
    report = progress or (lambda msg: None)
    if not tasks:
        return {}
    ctx = multiprocessing.get_context("spawn")  # no forked torch state (threads, allocator) in the workers
    messages = ctx.Queue()
    latest: dict[tuple[str, int], str] = {}
    done: dict[tuple[str, int], float] = {}
    total = sum(len(t.names) for t in tasks)
    stop = threading.Event()

    def show() -> None:
        running = "; ".join(f"{n} seed {s}: {m}" for (n, s), m in latest.items() if (n, s) not in done)
        report(f"{len(done)}/{total} seed runs done, {jobs} workers" + (f" | {running}" if running else ""))

    def drain() -> None:
        while not stop.is_set():
            try:
                name, seed, msg = messages.get(timeout=0.2)
            except queue.Empty:
                continue
            except (EOFError, OSError, ValueError):
                return
            latest[(name, seed)] = msg
            show()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    todo, failed = list(tasks), None
    try:
        with ctx.Pool(jobs, _init, (messages, worker_threads(jobs)), maxtasksperchild=1) as pool:
            running: dict[Any, SeedTask] = {}
            while todo or running:
                while todo and failed is None and len(running) < jobs:
                    t = todo.pop(0)
                    running[pool.apply_async(_work, (t.names, str(Path(out)), scale.value, t.seed, fresh))] = t
                if not running:
                    break
                for r in [r for r in running if r.ready()]:
                    task = running.pop(r)
                    try:
                        seconds = r.get()
                    except Exception as exc:
                        failed = failed or RuntimeError(
                            f"{task.label()} failed in a worker: {type(exc).__name__}: {exc}"
                        )
                        continue
                    done.update({(n, task.seed): s for n, s in seconds.items()})
                    show()
                time.sleep(0.2)
    finally:  # leaving the with-block terminated the workers (at once, on an interrupt)
        stop.set()
        reader.join(timeout=2)
        messages.close()
    if failed is not None:
        raise failed
    return done
