"""Progress on stderr for work that takes more than a moment: one status line, only on a terminal.

Commands wrap their slow steps::

    from . import _progress as progress

    with progress.phase("loading checkpoint"):
        model = load_checkpoint(path)
    for target in progress.steps(targets, "inspecting"):   # "inspecting 2/7: gpt2"
        ...
    with progress.phase("timing") as ph:
        run(progress=ph.update)                              # "timing: rms fwd 256x4096"

The status line appears after :data:`DELAY` seconds (quick work shows nothing), counts the
elapsed seconds, and is erased when the phase ends, so what stays on the screen is the command's
result. Nothing is written when stderr is not a terminal (pipes, files, CI logs) unless
``NORMATLAS_PROGRESS=1``, which then writes plain lines, one whenever the text changed and at most every
:data:`LINE_EVERY` seconds (a log of a long background run: ``NORMATLAS_PROGRESS=1 normatlas experiments run
... 2> run.log``); ``NORMATLAS_PROGRESS=0`` silences it on a terminal too. Phases nest:
the line shows ``outer: inner``. :func:`emit` erases the line before it prints a result.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import IO, TypeVar

__all__ = ["DELAY", "LINE_EVERY", "Phase", "clear", "enabled", "phase", "steps"]

T = TypeVar("T")
DELAY = 0.5  # seconds before a phase shows itself
LINE_EVERY = 30.0  # seconds between two lines when the stream is not a terminal
_TICK = 0.25


def enabled(stream: IO[str] | None = None) -> bool:
    """Whether progress is shown on ``stream`` (default stderr): ``$NORMATLAS_PROGRESS`` (1 / 0) when set,
    else whether it is a terminal."""
    env = os.environ.get("NORMATLAS_PROGRESS", "").strip().lower()
    if env in ("1", "yes", "true", "always"):
        return True
    if env in ("0", "no", "false", "never"):
        return False
    return _isatty(sys.stderr if stream is None else stream)


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Phase:
    """A running phase: :meth:`update` changes its detail text (e.g. the current item)."""

    def __init__(self, message: str) -> None:
        self.message, self.detail, self.start = message, "", time.monotonic()

    def update(self, detail: str) -> None:
        self.detail = str(detail)
        _status.redraw()

    def text(self) -> str:
        return f"{self.message}: {self.detail}" if self.detail else self.message


class _Status:
    """The one status line: a stack of phases redrawn by a ticker thread."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.stack: list[Phase] = []
        self.stream: IO[str] | None = None
        self.shown = False
        self.thread: threading.Thread | None = None
        self.tty = True
        self.last_line: tuple[float, str] = (-math.inf, "")

    def push(self, ph: Phase, stream: IO[str]) -> None:
        with self.lock:
            self.stack.append(ph)
            self.stream = stream
            self.tty = _isatty(stream)
            if self.thread is None:  # one idle daemon ticker for the process, started on first use
                self.thread = threading.Thread(target=self._tick, name="normatlas-progress", daemon=True)
                self.thread.start()

    def pop(self, ph: Phase) -> None:
        with self.lock:
            if ph in self.stack:
                self.stack.remove(ph)
            if self.stack:
                self.redraw()
            else:
                self.clear()

    def _tick(self) -> None:
        while True:
            time.sleep(_TICK)
            self.redraw()

    def redraw(self) -> None:
        with self.lock:
            if not self.stack or self.stream is None:
                return
            first = self.stack[0]
            elapsed = time.monotonic() - first.start
            if elapsed < DELAY:
                return
            if not self.tty:  # a log: whole lines, when the text changed, at most every LINE_EVERY seconds
                text = ": ".join(p.text() for p in self.stack)
                now = time.monotonic()
                if text == self.last_line[1] or now - self.last_line[0] < LINE_EVERY:
                    return
                self.last_line = (now, text)
                self._write(f"{text} ... {elapsed:.0f} s\n")
                return
            text = ": ".join(p.text() for p in self.stack) + f" ... {elapsed:.0f} s"
            width = shutil.get_terminal_size((100, 24)).columns - 1
            if len(text) > width:
                text = text[: max(0, width - 3)] + "..."
            if self._write("\r" + text + "\x1b[K"):
                self.shown = True

    def _write(self, text: str) -> bool:
        assert self.stream is not None
        try:
            self.stream.write(text)
            self.stream.flush()
            return True
        except (OSError, ValueError):  # a closed or broken stderr: progress is never worth an error
            self.stack.clear()
            return False

    def clear(self) -> None:
        with self.lock:
            if self.shown and self.stream is not None and self.tty:
                try:
                    self.stream.write("\r\x1b[K")
                    self.stream.flush()
                except (OSError, ValueError):
                    pass
            self.shown = False


_status = _Status()


@contextmanager
def phase(message: str, *, stream: IO[str] | None = None) -> Iterator[Phase]:
    """Show ``message`` (and the elapsed seconds) on stderr while the block runs; erased when it ends.

    Yields a :class:`Phase` whose ``update(detail)`` shows ``message: detail``. Does nothing but
    yield when progress is not :func:`enabled`."""
    ph = Phase(message)
    out = sys.stderr if stream is None else stream
    if not enabled(out):
        yield ph
        return
    _status.push(ph, out)
    try:
        yield ph
    finally:
        _status.pop(ph)


def steps(
    items: Iterable[T], message: str, *, total: int | None = None, label: Callable[[T], str] = str
) -> Iterator[T]:
    """Iterate ``items`` inside a :func:`phase` showing ``message i/n: label(item)``."""
    if total is None:
        try:
            total = len(items)  # type: ignore[arg-type]
        except TypeError:
            total = None
    with phase(message) as ph:
        for i, item in enumerate(items, 1):
            ph.update(f"{i}/{total}: {label(item)}" if total is not None else f"{i}: {label(item)}")
            yield item


def clear() -> None:
    """Erase the status line (before printing a result to the same terminal); phases redraw it."""
    _status.clear()
