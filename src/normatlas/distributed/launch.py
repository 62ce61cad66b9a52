"""Run a function on N local gloo processes (``torch.multiprocessing`` spawn) and collect what each returns.

For tests, benchmarks and examples on one machine: each process joins a fresh ``gloo`` process group on a free
port, runs ``fn(rank, world_size, *args)`` and sends its (picklable) return value back; the parent returns the
values in rank order, or raises a RuntimeError carrying the first failing rank's traceback.
"""

from __future__ import annotations

import gc
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "spawn"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            queue.put((rank, True, fn(rank, world, *args)))
        finally:
            # free what fn left in reference cycles (meshes, DTensors) before the group, so the group is not freed
            # during interpreter shutdown, where gloo's worker threads can abort the process
            gc.collect()
            dist.destroy_process_group()
    except BaseException:  # report any failure to the parent instead of hanging it
        queue.put((rank, False, traceback.format_exc()))


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0, threads: int = 1) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, ...)]``, each run in its own gloo process.

    ``fn`` must be importable by name (a module-level function). ``threads``: intra-op threads per process (1
    keeps N processes from oversubscribing a small machine). ``timeout``: seconds to wait for all results.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= 64:
        raise ValueError(f"world_size={world_size!r} must be an integer in [1, 64]")
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be a module-level callable")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, threads), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failure: str | None = None
    import time

    deadline = time.monotonic() + timeout
    while len(results) < world_size and failure is None:
        if not queue.empty():
            rank, ok, value = queue.get()
            if ok:
                results[rank] = value
            else:
                failure = f"rank {rank} failed:\n{value}"
        elif time.monotonic() > deadline:
            failure = f"timed out after {timeout:g} s with results from ranks {sorted(results)}"
        elif any(p.exitcode not in (None, 0) for p in procs) and queue.empty():
            failure = "a worker died: exit codes " + ", ".join(str(p.exitcode) for p in procs)
        else:
            time.sleep(0.02)
    for p in procs:
        if failure is not None and p.is_alive():
            p.terminate()
        p.join(timeout=30)
    if failure is not None:
        raise RuntimeError(failure)
    return [results[r] for r in range(world_size)]
