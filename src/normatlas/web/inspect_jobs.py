"""Inspection as a job: ``POST /api/inspect`` starts (or joins) one and answers at once; ``GET /api/inspect/job/ID``
reports its phase, the seconds so far and, once done, the report.

One worker thread runs the jobs one at a time, first come first served, and at most :data:`MAX_QUEUED` wait
(a request for one more target gets :class:`~.inspect_api.Busy`, 503 with ``Retry-After``). A request for a target
whose job is queued or running joins that job; a finished report stays cached for the server's lifetime (a request
for it answers the finished job, ``cached``); a failed job stays readable, and a new request for its target starts
a fresh job (the page's retry).

The phases are timed by the server's monotonic clock, so the page reports what the inspection cost, not a promise:

- ``queued``: waiting for the worker;
- ``building``: imports, the tiny model built (or the checkpoint loaded) and any trial forward the build runs;
- ``tracing``: the recorded forward pass, from the first module call made under a ``TorchFunctionMode`` (the
  dataflow recorder's) until that call returns; seen through torch's global module hooks, on the worker's thread;
- ``reading``: the dataflow analysis, the perturbation probe and the page's report;
- then ``done`` (with ``result``) or ``failed`` (with ``error`` and the ``status`` the failure would answer).

A model that cannot be traced is read by the probe alone, with no ``tracing`` phase.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules import module as nn_module

from .inspect_api import Busy, Targets, Unreadable, run_target

__all__ = ["MAX_DONE_OWN", "MAX_FAILED", "MAX_QUEUED", "Inspector", "Job", "Phase", "job_id"]

MAX_QUEUED = 4  # jobs waiting for the worker; one more distinct target is refused (503)
MAX_FAILED = 32  # failed jobs kept for reading; the oldest go first
MAX_DONE_OWN = 64  # finished jobs with their own runner (the page's tools, keyed by free text) kept cached
_ID_HEX = 16


class Phase(enum.Enum):
    """Where a job is; the order of the members is the order a job passes them."""

    QUEUED = "queued"
    BUILDING = "building"
    TRACING = "tracing"
    READING = "reading"
    DONE = "done"
    FAILED = "failed"


_ORDER = {p: i for i, p in enumerate(Phase)}
_FINISHED = (Phase.DONE, Phase.FAILED)


def job_id(text: str) -> str:
    """``text`` if it is a job id (16 lowercase hex digits), else ``ValueError``."""
    if len(text) != _ID_HEX or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"job id {text[:40]!r} must be {_ID_HEX} lowercase hex digits")
    return text


@dataclass
class Job:
    """One inspection: its target, the monotonic time each phase began, and its outcome."""

    id: str
    key: str
    target: str  # the CLI target (a model type or an absolute folder path)
    name: str  # the target as the page names it (a model type, a folder relative to the root)
    created: float
    marks: list[tuple[Phase, float]] = field(default_factory=list)
    ended: float | None = None
    runner: Callable[[str], dict[str, Any]] | None = None  # the job's own runner (a tool's); None: the inspector's
    result: dict[str, Any] | None = None
    error: str | None = None
    status: int | None = None

    @property
    def phase(self) -> Phase:
        return self.marks[-1][0]

    def enter(self, phase: Phase, now: float) -> None:
        """Move on to ``phase`` (never back; a finished job stays finished)."""
        if _ORDER[phase] > _ORDER[self.phase] and self.phase not in _FINISHED:
            self.marks.append((phase, now))
            if phase in _FINISHED:
                self.ended = now

    def view(self, now: float, ahead: int = 0) -> dict[str, Any]:
        """The job as the API answers it: ``state``, ``elapsed`` (seconds since it was asked for, until it finished),
        ``phases`` (each passed phase and its seconds), ``ahead`` (jobs before a queued one), and ``result`` or
        ``error`` / ``status``."""
        end = self.ended if self.ended is not None else now
        stops = [t for _, t in self.marks[1:]] + [end]
        spans = [(p, t, stop) for (p, t), stop in zip(self.marks, stops, strict=True)]
        doc: dict[str, Any] = {
            "job": self.id,
            "target": self.name,
            "state": self.phase.value,
            "elapsed": round(end - self.created, 3),
            "phases": [{"phase": p.value, "seconds": round(b - a, 3)} for p, a, b in spans if p not in _FINISHED],
        }
        if self.phase is Phase.QUEUED:
            doc["ahead"] = ahead
        if self.result is not None:
            doc["result"] = self.result
        if self.error is not None:
            doc |= {"error": self.error, "status": self.status}
        return doc


def _recording() -> bool:
    """Whether a ``TorchFunctionMode`` is active on this thread (the dataflow recorder runs the model under one)."""
    stack = getattr(torch.overrides, "_get_current_function_mode_stack", None)
    return bool(stack()) if stack is not None else False


@contextlib.contextmanager
def _phases(enter: Callable[[Phase], None]) -> Iterator[None]:
    """Global module hooks that, on this thread only, mark ``tracing`` at the first module call made under a
    ``TorchFunctionMode`` and ``reading`` when that outermost call returns."""
    me = threading.get_ident()
    state = {"depth": 0, "tracing": False, "done": False}

    def pre(mod: Any, args: Any) -> None:
        if threading.get_ident() != me or state["done"]:
            return
        if state["tracing"]:
            state["depth"] += 1
        elif _recording():
            state["tracing"], state["depth"] = True, 1
            enter(Phase.TRACING)

    def post(mod: Any, args: Any, out: Any) -> None:
        if threading.get_ident() != me or not state["tracing"] or state["done"]:
            return
        state["depth"] -= 1
        if state["depth"] == 0:
            state["done"] = True
            enter(Phase.READING)

    handles = [
        nn_module.register_module_forward_pre_hook(pre),
        nn_module.register_module_forward_hook(post, always_call=True),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class Inspector:
    """The page's inspections: targets checked at once, jobs run one at a time on one worker thread (started with
    the inspector; it first imports transformers' config table, which checking a model type needs), reports cached
    per target. ``runner`` (a CLI target -> the page's report) is :func:`.inspect_api.run_target`."""

    def __init__(self, root: Path, runner: Callable[[str], dict[str, Any]] = run_target) -> None:
        self.targets = Targets(root)
        self.root = self.targets.root
        self.runner = runner
        self._lock = threading.Condition()
        self._jobs: dict[str, Job] = {}  # by id: every done job, the queued and running ones, the last failed ones
        self._by_key: dict[str, Job] = {}  # the latest job of each target
        self._queue: collections.deque[Job] = collections.deque()
        self._failed: collections.deque[str] = collections.deque()
        self._done_own: collections.deque[str] = collections.deque()  # finished jobs with their own runner
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="normatlas-inspect", daemon=True)
        self._worker.start()

    def folders(self) -> list[str]:
        return self.targets.folders()

    def start(
        self, body: Any, targets: Any = None, runner: Callable[[str], dict[str, Any]] | None = None
    ) -> tuple[dict[str, Any], bool]:
        """Start (or join) the inspection of a request body's target: (the job's view with ``joined`` and ``cached``,
        whether it has finished). Validation errors are raised at once (400 / 403 / 404). ``targets`` (an object
        with the :meth:`.inspect_api.Targets.target` method) and ``runner`` replace the inspector's own for this
        request: the page's tools (:mod:`.tools_api`) run as jobs of the same queue and worker this way."""
        key, target, name = (targets or self.targets).target(body)
        now = time.monotonic()
        with self._lock:
            job = self._by_key.get(key)
            if job is not None and job.phase is not Phase.FAILED:
                finished = job.phase is Phase.DONE
                return job.view(now, self._ahead(job)) | {"joined": not finished, "cached": finished}, finished
            if len(self._queue) >= MAX_QUEUED:
                raise Busy(f"{len(self._queue)} inspections are waiting already; try again in a few seconds")
            job = Job(secrets.token_hex(_ID_HEX // 2), key, target, name, now, [(Phase.QUEUED, now)], runner=runner)
            self._jobs[job.id] = job
            self._by_key[key] = job
            self._queue.append(job)
            self._lock.notify_all()
            return job.view(now, self._ahead(job)) | {"joined": False, "cached": False}, False

    def job(self, ident: str) -> dict[str, Any]:
        """The view of job ``ident`` (``FileNotFoundError``, 404, for an unknown or forgotten id)."""
        job_id(ident)
        with self._lock:
            job = self._jobs.get(ident)
            if job is None:
                raise FileNotFoundError(f"no inspection job {ident}; it may have failed long ago: POST again")
            return job.view(time.monotonic(), self._ahead(job))

    def pending(self) -> int:
        """How many jobs are queued or running."""
        with self._lock:
            return len(self._queue) + (1 if self._running() else 0)

    def close(self) -> None:
        """Stop the worker once its current job ends (queued jobs are dropped)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def _ahead(self, job: Job) -> int:
        return sum(1 for j in self._queue if j.created < job.created) + (
            1 if job.phase is Phase.QUEUED and self._running() else 0
        )

    def _running(self) -> bool:
        return any(j.phase not in (Phase.QUEUED, *_FINISHED) for j in self._by_key.values())

    def _enter(self, job: Job, phase: Phase) -> None:
        with self._lock:
            job.enter(phase, time.monotonic())

    def _work(self) -> None:
        # the model-type check needs transformers' config table: imported here, not in a request (1-2 s)
        with contextlib.suppress(ImportError):  # a request will say what is missing
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: F401
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                job.enter(Phase.BUILDING, time.monotonic())
            try:
                with _phases(functools.partial(self._enter, job)):
                    result = (job.runner or self.runner)(job.target)
            except Unreadable as exc:
                self._fail(job, str(exc), 422)
            except Exception as exc:  # a bug of normatlas or of a model build: named, as a 500 would be
                self._fail(job, f"{type(exc).__name__}: {str(exc)[:300]}", 500)
            else:
                with self._lock:
                    job.enter(Phase.READING, time.monotonic())  # a probe-only report has no tracing phase
                    job.result = result
                    job.enter(Phase.DONE, time.monotonic())
                    if job.runner is not None:  # a tool's result: keyed by a free text, so only the last few stay
                        self._done_own.append(job.id)
                        while len(self._done_own) > MAX_DONE_OWN:
                            old = self._jobs.pop(self._done_own.popleft(), None)
                            if old is not None and self._by_key.get(old.key) is old:
                                del self._by_key[old.key]

    def _fail(self, job: Job, message: str, status: int) -> None:
        with self._lock:
            job.error, job.status = message, status
            job.enter(Phase.FAILED, time.monotonic())
            self._failed.append(job.id)
            while len(self._failed) > MAX_FAILED:
                old = self._failed.popleft()
                self._jobs.pop(old, None)
