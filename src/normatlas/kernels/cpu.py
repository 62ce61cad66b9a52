"""Build, cache and load the C++ CPU kernels (``csrc/``).

Method: ``torch.utils.cpp_extension.load`` compiles three translation units with
``-O3 -march=native -fopenmp`` (vectorised loops, fp32 accumulation, bf16/fp16 in and out),
in parallel under ninja: ``norm_kernels.cpp`` (the row kernels: only ATen's thread pool and
the c10 scalar types; the longest, ~27 s alone here), ``norm_ops.cpp`` (tensors and the C++ autograd
Function, ~21 s) and ``norm_bind.cpp`` (the pybind11 module, ~12 s): 31-34 s in all on 2 cores. The shared object
goes into a per-user cache directory keyed by a hash of the sources, the flags, the torch
version and the CPU's instruction-set flags. Later processes load the cached shared
object in well under a second. The first-call cost (compile or load) is measured and
reported by :func:`build_info`; when no compiler is present, or the build fails, or
``NORMATLAS_KERNELS=eager``, :func:`extension` returns None and the callers use the
eager torch fallback.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

__all__ = ["SOURCES", "build", "build_info", "cache_dir", "extension"]

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
SOURCES = (_CSRC / "norm_ops.cpp", _CSRC / "norm_bind.cpp", _CSRC / "norm_kernels.cpp")
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")
_LDFLAGS = ("-fopenmp",)
_lock = threading.Lock()
_state: dict[str, Any] = {"tried": False, "module": None, "info": {}}


def cache_dir() -> Path:
    """Where compiled kernels live: ``$NORMATLAS_CACHE``, else ``$XDG_CACHE_HOME/normatlas``, else ~/.cache."""
    root = os.environ.get("NORMATLAS_CACHE")
    if root:
        return Path(root) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "normatlas" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _key(source: str) -> str:
    parts = [source, " ".join(_CFLAGS), torch.__version__, platform.machine(), _cpu_flags()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def extension() -> ModuleType | None:
    """The compiled kernel module, building it on the first call; None when unavailable."""
    if _state["tried"]:
        return _state["module"]
    with _lock:
        if _state["tried"]:
            return _state["module"]
        _state["module"] = _build()
        _state["tried"] = True
    return _state["module"]


def build(name: str, build_dir: Path, extra_cflags: tuple[str, ...] = ()) -> ModuleType:
    """Compile the kernels into ``build_dir`` as the Python module ``name`` (raises when the build fails)."""
    from torch.utils.cpp_extension import load

    build_dir.mkdir(parents=True, exist_ok=True)
    return load(
        name=name,
        sources=[str(p) for p in SOURCES],
        extra_cflags=[*_CFLAGS, *extra_cflags],
        extra_ldflags=list(_LDFLAGS),
        extra_include_paths=[str(_CSRC)],
        build_directory=str(build_dir),
        verbose=False,
    )


def _build() -> ModuleType | None:
    if os.environ.get("NORMATLAS_KERNELS", "auto").lower() == "eager":
        _state["info"] = {"backend": "eager", "reason": "NORMATLAS_KERNELS=eager"}
        return None
    # the key covers every file the build reads (the sources and the headers they include)
    key = _key("\n".join(p.read_text() for p in sorted(_CSRC.glob("*.[ch]*"))))
    build_dir = cache_dir() / f"norm_cpu_{key}"
    name = f"normatlas_norm_cpu_{key}"
    cached = any(build_dir.glob("*.so"))
    start = time.perf_counter()
    try:
        module = build(name, build_dir)
    except Exception as exc:  # no compiler, no ninja, a failed build: fall back to eager torch
        seconds = time.perf_counter() - start
        _state["info"] = {"backend": "eager", "reason": f"{type(exc).__name__}: {exc}"[:300], "seconds": seconds}
        log.warning("normatlas: C++ CPU kernels unavailable (%s); using the eager fallback", type(exc).__name__)
        return None
    seconds = time.perf_counter() - start
    _state["info"] = {"backend": "cpp", "cached": cached, "seconds": round(seconds, 3), "path": str(build_dir),
                      "vector_isa": module.vector_kernels() or "none"}  # fmt: skip
    if not cached:
        log.warning("normatlas: compiled the C++ CPU kernels in %.1f s (cached in %s)", seconds, build_dir)
    return module


def build_info() -> dict[str, Any]:
    """How the CPU kernels were obtained: backend, whether from cache, first-call seconds, path, and the
    instruction set of their vector row kernels (``avx512``, ``avx2``, or ``none``: the generic templates)."""
    extension()
    return dict(_state["info"])
