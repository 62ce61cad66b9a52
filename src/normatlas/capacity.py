"""Memory and disk, measured before a large allocation or write.

A size that cannot fit is refused up front in one line naming the size and what is there, instead of an
allocation traceback after minutes of building or a ``SafetensorError`` from a full disk half-way through a write.
Estimates are estimates: :func:`check_memory` refuses only what clearly does not fit (the need above what the
system reports available), so a borderline case still runs and may fail as before.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

__all__ = ["available_memory", "check_disk", "check_memory", "human_bytes"]


def human_bytes(n: float) -> str:
    """``n`` bytes as a short decimal size: ``512 B``, ``3.2 MB``, ``224.4 GB``."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _cgroup_limit() -> int | None:
    """This process's cgroup (v2) memory limit less its usage, or None without one."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(int(limit) - used, 0)


def available_memory(device: str = "cpu") -> int | None:
    """Bytes that can be allocated now: a CUDA device's free memory, else the system's ``MemAvailable`` (within a
    cgroup limit, if any); None where the platform does not say."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0]) if torch.cuda.is_available() else None
    found: int | None = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    if found is None:
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            found = None
    cgroup = _cgroup_limit()
    return found if cgroup is None else cgroup if found is None else min(found, cgroup)


def check_memory(need: int, what: str, device: str = "cpu") -> None:
    """A ValueError of one line when ``need`` bytes clearly do not fit: ``{what} needs about N; M is available``."""
    have = available_memory(device)
    if have is not None and need > have:
        where = "" if device == "cpu" else f" on {device}"
        raise ValueError(f"{what} needs about {human_bytes(need)} of memory; {human_bytes(have)} is available{where}")


def check_disk(folder: str | os.PathLike[str], need: int, what: str = "writing") -> None:
    """An OSError (ENOSPC) of one line when the disk holding ``folder`` (or its nearest existing parent) has less
    than ``need`` bytes free, naming the folder, the size needed and the space free."""
    probe = Path(folder).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return  # a disk that cannot say: the write itself reports what goes wrong
    if need > free:
        raise OSError(
            errno.ENOSPC,
            f"not enough disk space in {folder}: {what} needs about {human_bytes(need)}, "
            f"{human_bytes(free)} is free; nothing was written",
        )
