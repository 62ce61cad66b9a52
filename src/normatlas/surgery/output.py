"""Where a surgery may write, checked before any heavy work, and the safety net around the write itself.

* The output may not be the input, lie inside it, or contain it (symlinks resolved).
* An existing non-empty output is replaced only with ``force`` and only when an earlier normatlas write
  created it: its marker is :data:`MANIFEST` (``normatlas_surgery.json`` with ``"format":
  "normatlas-surgery/..."``). An arbitrary folder is never replaced.
* The nearest existing folder above the output must take a new folder (probed by creating one), so a
  read-only location is refused before loading anything.
* A write goes into ``.NAME.tmp-XXXX`` beside the target, holding :data:`WRITING` (the writer's pid) until it
  is renamed into place. Ctrl-C or SIGTERM during the write removes it (:func:`interruptible`); after a
  SIGKILL or a power cut the next write to the same place removes it, and says so (:func:`check_output`).
* Modes follow the umask, as ``cp`` does: folders ``0o777 & ~umask``, files ``0o666 & ~umask`` (``tempfile``
  would give ``0o700`` / ``0o600``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from .._io import read_json

__all__ = ["MANIFEST", "WRITING", "OutputPlan", "check_output", "dir_mode", "file_mode", "interruptible"]

MANIFEST = "normatlas_surgery.json"
WRITING = ".normatlas-writing"  # inside a temporary folder only: {"pid": ...} of the process writing it


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def dir_mode() -> int:
    return 0o777 & ~_umask()


def file_mode(source_mode: int = 0o666) -> int:
    return source_mode & 0o777 & ~_umask()


@dataclass
class OutputPlan:
    """A checked output location: ``target`` (resolved), whether it replaces an earlier normatlas output, and
    the stale temporary folders of earlier interrupted writes that were removed (one sentence each)."""

    target: Path
    replaces: bool
    removed: list[str] = field(default_factory=list)


def is_normatlas_output(folder: Path) -> bool:
    """True when ``folder`` holds the marker an earlier normatlas write leaves."""
    try:
        data = read_json(folder / MANIFEST)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and str(data.get("format", "")).startswith("normatlas-surgery/")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _writer_pid(folder: Path) -> int | None:
    try:
        pid = read_json(folder / WRITING)["pid"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if isinstance(pid, int) else None


def _clean_stale(target: Path) -> list[str]:
    """Remove our temporary folders left beside ``target`` by a writer that no longer runs; refuse while one
    still runs. A folder without our :data:`WRITING` file is not ours and is left alone."""
    removed: list[str] = []
    parent = target.parent
    if not parent.is_dir():
        return removed
    for entry in sorted(parent.glob(f".{target.name}.tmp-*")):
        pid = _writer_pid(entry) if entry.is_dir() and not entry.is_symlink() else None
        if pid is None:
            continue
        if _alive(pid) and pid != os.getpid():
            raise ValueError(f"output={str(target)!r}: another write to it is in progress (pid {pid}, {entry})")
        shutil.rmtree(entry)
        removed.append(f"removed {entry}, the temporary folder of an interrupted earlier write (pid {pid})")
    for entry in sorted(parent.glob(f".{target.name}.old-*")):
        pid_text = entry.name.rsplit("-", 1)[-1]
        if not (pid_text.isdigit() and entry.is_dir() and is_normatlas_output(entry)) or _alive(int(pid_text)):
            continue
        if target.exists():
            shutil.rmtree(entry)
            removed.append(f"removed {entry}, the previous output set aside by an interrupted replace")
        else:
            os.replace(entry, target)
            removed.append(f"restored {target} from {entry}, set aside by an interrupted replace")
    return removed


def _probe_writable(folder: Path, target: Path) -> None:
    try:
        probe = tempfile.mkdtemp(prefix=f".{target.name}.probe-", dir=folder)
        os.rmdir(probe)
    except OSError as exc:
        raise PermissionError(
            f"output={str(target)!r}: cannot create a folder in {folder} ({exc.strerror or exc})"
        ) from exc


def check_output(
    out: str | os.PathLike[str],
    *,
    source: str | os.PathLike[str] | None = None,
    force: bool = False,
    force_hint: str = "force=True",
) -> OutputPlan:
    """Validate ``out`` as the output of a write from ``source`` (the input checkpoint), before any heavy work,
    and remove stale temporary folders of our own earlier interrupted writes there. ``force_hint`` names the
    switch in messages (``--force`` at the CLI)."""
    target = Path(out).resolve()
    if source is not None:
        src = Path(source).resolve()
        if target == src:
            raise ValueError(f"output={str(out)!r} is the input checkpoint itself; choose a new folder")
        if src in target.parents:
            raise ValueError(
                f"output={str(out)!r} lies inside the input checkpoint {str(src)!r}; choose a folder outside it"
            )
        if target in src.parents:
            raise ValueError(f"output={str(out)!r} contains the input checkpoint {str(src)!r}; choose a new folder")
    for parent in target.parents:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"output={str(out)!r}: {str(parent)!r} is a file, not a folder")
    replaces = False
    if target.exists():
        if not target.is_dir():
            raise ValueError(f"output={str(out)!r} exists and is not a folder; pass a folder path to write into")
        if any(target.iterdir()):
            if not is_normatlas_output(target):
                raise ValueError(
                    f"output={str(out)!r} exists, is not empty and was not written by normatlas (no {MANIFEST}); "
                    f"choose a new folder ({force_hint} replaces only an earlier normatlas output)"
                )
            if not force:
                raise ValueError(
                    f"output={str(out)!r} holds an earlier normatlas output; pass {force_hint} to replace it"
                )
        replaces = True
    _probe_writable(next(p for p in target.parents if p.exists()), target)
    return OutputPlan(target, replaces, _clean_stale(target))


class Terminated(SystemExit):
    """Raised in the writing thread when SIGTERM / SIGHUP arrives during a write, so the temporary folder is
    removed on the way out; the process then exits with 128 + the signal number."""


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """During the block, SIGTERM and SIGHUP raise :class:`Terminated` (Ctrl-C already raises
    KeyboardInterrupt), so ``finally`` clauses run. Outside the main thread nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Terminated(128 + signum)

    signals = [s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None]
    old = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
