"""Build once, cache and load the C++ CPU kernels (``csrc/``).

Method: ``torch.utils.cpp_extension.load`` compiles three translation units with
``-O3 -march=native -fopenmp`` in parallel under ninja: ``norm_kernels.cpp`` (the row kernels),
``norm_ops.cpp`` (tensors and the C++ autograd Function) and ``norm_bind.cpp`` (the pybind11 module):
31-34 s in all on 2 cores. That happens once per machine, not once per process:

- **The key** is a hash of everything that changes the binary and nothing that does not: the sources
  and headers (their bytes, not their paths), the flags, the torch version and build, the Python ABI,
  the compiler's identity and the CPU's instruction-set flags (``-march=native``). Two checkouts or venvs
  of the same sources share one cache entry.
- **The cache entry** ``<cache_dir>/norm_cpu_<key>/`` holds the shared object and ``build.json`` (how long
  the build took, when, with what, and the shared object's ``size`` and ``sha256``). A later process checks the
  file against that record and then loads it directly (no ninja, no build file to compare; well under a second).
  A file that does not match (truncated: loading it would kill the process with SIGBUS; empty; changed), or that
  does not load, is removed with one warning line: an explicit build rebuilds it at once, the drop-in modules run
  the reference path until ``normatlas kernels build``. An entry written before the record existed is checked
  by its ELF headers instead (every segment and section table inside the file).
- **Building** happens under a file lock in a private temporary folder; the shared object is moved into
  place atomically, so two processes building at once never see a partial file and the second one loads
  what the first built. Temporary folders left by a killed build are removed by the next build.

Who builds: ``normatlas kernels build`` (``make demo`` / ``make test`` run it during setup), or any
explicit fused entry point (``normatlas.kernels.fused_*``, ``backend="fused"``). The default
``backend="auto"`` of the drop-in modules never compiles: :func:`loaded` returns the cached build or
None, and the caller runs the reference path (a one-time warning says how to build).
``NORMATLAS_KERNELS=eager`` turns the extension off entirely.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from .._io import atomic_write, dumps, read_json

__all__ = ["SOURCES", "build", "build_info", "cache_dir", "damage", "ensure_built", "extension", "loaded"]

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
SOURCES = (_CSRC / "norm_ops.cpp", _CSRC / "norm_bind.cpp", _CSRC / "norm_kernels.cpp")
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")
_LDFLAGS = ("-fopenmp",)
BUILD_HINT = "build them once per machine with `normatlas kernels build`"
_lock = threading.Lock()
# module: the loaded extension; info: what build_info() reports; final: True once nothing more will be tried
_state: dict[str, Any] = {"module": None, "info": {}, "final": False, "warned": False}


def cache_dir() -> Path:
    """Where compiled kernels live: ``$NORMATLAS_CACHE/kernels``, else ``$XDG_CACHE_HOME/normatlas/kernels``,
    else ``~/.cache/normatlas/kernels``."""
    root = os.environ.get("NORMATLAS_CACHE")
    if root:
        return Path(root) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "normatlas" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[-1].split()))
    except OSError:
        pass
    return platform.processor()


@functools.lru_cache(maxsize=1)
def _compiler() -> str:
    """The C++ compiler cpp_extension uses (``$CXX``, else ``c++``) and its version line, or why it is absent."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{cxx}: unavailable ({type(exc).__name__})"
    return f"{cxx}: {(out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else out.returncode}"


@functools.lru_cache(maxsize=1)
def _key() -> str:
    """A hash of what changes the binary: source bytes, flags, torch, Python ABI, compiler, CPU flags."""
    h = hashlib.sha256()
    for p in sorted(_CSRC.glob("*.[ch]*")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    parts = [
        " ".join(_CFLAGS), " ".join(_LDFLAGS), torch.__version__, str(torch.version.git_version),
        f"{sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')}", platform.machine(),
        _compiler(), _cpu_flags(),
    ]  # fmt: skip
    h.update("\n".join(parts).encode())
    return h.hexdigest()[:16]


def _entry() -> tuple[str, Path]:
    key = _key()
    return f"normatlas_norm_cpu_{key}", cache_dir() / f"norm_cpu_{key}"


def build(name: str, build_dir: Path, extra_cflags: tuple[str, ...] = ()) -> ModuleType:
    """Compile the kernels into ``build_dir`` as the Python module ``name`` (raises when the build fails).

    The low-level step, also used by the tests that build other instruction-set variants; the cached,
    locked build is :func:`ensure_built`."""
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


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _read_meta(folder: Path) -> dict[str, Any]:
    try:
        meta = read_json(folder / "build.json")
        return meta if isinstance(meta, dict) else {}
    except (OSError, ValueError):
        return {}


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _elf_damage(so: Path, size: int) -> str | None:
    """Why a 64-bit little-endian ELF file is cut short (a loaded segment or a header table past its end), or None;
    other formats and platforms are not checked here."""
    if not sys.platform.startswith("linux"):
        return None
    with open(so, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF":
            return "it is not an ELF shared object"
        if len(head) < 64 or head[4] != 2 or head[5] != 1:
            return None if len(head) == 64 else "its ELF header is cut short"
        phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
        if max(phoff + phentsize * phnum, shoff + shentsize * shnum) > size:
            return f"it is cut short ({size} bytes; its ELF header tables end further on)"
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    for i in range(phnum):
        kind, _, offset, _, _, filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
        if kind == 1 and offset + filesz > size:  # PT_LOAD
            return f"it is cut short ({size} bytes; a loaded segment ends at byte {offset + filesz})"
    return None


def damage(so: Path, meta: dict[str, Any]) -> str | None:
    """Why the cached shared object ``so`` must not be loaded, or None when it is the file the build wrote: its size
    and sha256 against ``build.json``'s record, else (an entry from before the record) its ELF headers."""
    size = so.stat().st_size
    if size == 0:
        return "the file is empty"
    want_size, want_sha = meta.get("size"), meta.get("sha256")
    if isinstance(want_size, int) and isinstance(want_sha, str):
        if size != want_size:
            return f"it has {size} bytes where the build wrote {want_size}"
        if _digest(so) != want_sha:
            return "its sha256 is not the one the build recorded"
        return None
    return _elf_damage(so, size)


def _discard(folder: Path, so: Path, why: str, locked: bool) -> None:
    """Remove a damaged cache entry (under the build lock, so a build finishing now is not removed) and note why."""
    lock = contextlib.nullcontext() if locked else _file_lock(cache_dir() / f"norm_cpu_{_key()}.lock")
    with lock:
        if so.is_file() and damage(so, _read_meta(folder)) is None and not why.startswith("it does not load"):
            return  # replaced by a whole build while we waited
        for f in (so, folder / "build.json"):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
    _state["damaged"] = f"{so}: {why}"


def _load_cached(locked: bool = False) -> ModuleType | None:
    """The cached build, imported (None when there is none, or when it was damaged and is now removed: see
    :func:`damage`); records how long the load took. ``locked``: the caller holds the build lock."""
    name, folder = _entry()
    so = folder / f"{name}.so"
    if not so.is_file():
        return None
    start = time.perf_counter()
    module = sys.modules.get(name)
    if module is None:
        try:
            why = damage(so, _read_meta(folder))
        except OSError as exc:
            why = f"it cannot be read ({exc.strerror or exc})"
        if why is not None:
            _discard(folder, so, why, locked)
            return None
        try:
            module = _import(name, so)
        except Exception as exc:  # another torch build, a damaged file the checks missed
            _discard(folder, so, f"it does not load ({type(exc).__name__}: {str(exc)[:160]})", locked)
            return None
    meta = _read_meta(folder)
    _state["info"] = {
        "backend": "cpp", "source": "cache", "cached": True, "seconds": round(time.perf_counter() - start, 3),
        "build_seconds": meta.get("seconds"), "built_at": meta.get("built_at"), "path": str(folder),
        "key": _key(), "vector_isa": module.vector_kernels() or "none",
    }  # fmt: skip
    return module


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            import fcntl
        except ImportError:  # not POSIX: the atomic rename still keeps a reader from a partial file
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_stale_builds(root: Path) -> None:
    """Temporary build folders whose process is gone (a killed build)."""
    for d in root.glob(".build-*"):
        try:
            pid = int(d.name.rsplit("-", 1)[-1])
            os.kill(pid, 0)
        except (ValueError, ProcessLookupError):
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:
            pass


def _build_into_cache() -> ModuleType:
    name, folder = _entry()
    with _file_lock(cache_dir() / f"norm_cpu_{_key()}.lock"):
        cached = _load_cached(locked=True)  # another process may have built it while we waited
        if cached is not None:
            return cached
        _remove_stale_builds(cache_dir())
        log.warning("normatlas: compiling the C++ CPU kernels once for this machine (30-90 s; cached in %s)", folder)
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{_key()}-", dir=cache_dir()))
        tmp = tmp.rename(tmp.with_name(f"{tmp.name}-{os.getpid()}"))
        start = time.perf_counter()
        try:
            module = build(name, tmp)
            seconds = time.perf_counter() - start
            folder.mkdir(parents=True, exist_ok=True)
            built = tmp / f"{name}.so"
            meta = {"key": _key(), "seconds": round(seconds, 1), "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "torch": torch.__version__, "compiler": _compiler(), "cflags": list(_CFLAGS),
                    "size": built.stat().st_size, "sha256": _digest(built)}  # fmt: skip
            atomic_write(folder / "build.json", dumps(meta, indent=2))
            atomic_write(folder / f"{name}.so", functools.partial(shutil.copyfile, built))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _state["info"] = {
        "backend": "cpp", "source": "built", "cached": False, "seconds": round(seconds, 3),
        "build_seconds": round(seconds, 1), "built_at": meta["built_at"], "path": str(folder), "key": _key(),
        "vector_isa": module.vector_kernels() or "none",
    }  # fmt: skip
    log.warning("normatlas: compiled the C++ CPU kernels in %.1f s (cached in %s)", seconds, folder)
    return module


def _disabled() -> bool:
    return os.environ.get("NORMATLAS_KERNELS", "auto").lower() == "eager"


def extension(build: bool = True) -> ModuleType | None:
    """The compiled kernel module, or None when unavailable.

    From the cache when it is there; otherwise built now (once, under a lock) when ``build`` is True, else
    None (the caller runs the reference path; :func:`build_info` says why and :data:`BUILD_HINT` how to fix it).
    """
    if _state["module"] is not None or _state["final"]:
        return _state["module"]
    with _lock:
        if _state["module"] is not None or _state["final"]:
            return _state["module"]
        if _disabled():
            _state["info"] = {"backend": "eager", "reason": "NORMATLAS_KERNELS=eager"}
            _state["final"] = True
            return None
        module = _load_cached()
        damaged = _state.pop("damaged", None)
        if damaged is not None and build:
            log.warning("normatlas: removed the damaged cached C++ kernels (%s); rebuilding", damaged)
        elif damaged is not None:
            _state["info"] = {"backend": "eager", "reason": f"removed the damaged cached C++ kernels ({damaged}); "
                              f"the drop-in modules run the reference path; {BUILD_HINT}"}  # fmt: skip
            _state["warned"] = True  # this line says how to build: loaded() need not say it again
            log.warning("normatlas: %s", _state["info"]["reason"])
            return None
        if module is None and build:
            try:
                module = _build_into_cache()
            except Exception as exc:  # no compiler, no ninja, a failed build: fall back to eager torch
                _state["info"] = {"backend": "eager", "reason": f"{type(exc).__name__}: {exc}"[:300]}
                _state["final"] = True
                log.warning("normatlas: C++ CPU kernels unavailable (%s); using the eager fallback", type(exc).__name__)
                return None
        if module is None:
            _state["info"] = {"backend": "eager", "reason": f"the C++ kernels are not built; {BUILD_HINT}"}
            return None
        _state["module"] = module
        return module


def loaded() -> ModuleType | None:
    """The kernel module if it is built (from the cache), never compiling; warns once when it is not."""
    module = extension(build=False)
    if module is None and not _state["warned"] and not _state["final"]:
        _state["warned"] = True
        log.warning("normatlas: the C++ CPU kernels are not built, so the drop-in modules run the reference path; %s",
                    BUILD_HINT)  # fmt: skip
    return module


def ensure_built() -> dict[str, Any]:
    """Build (or load) the kernels now; return :func:`build_info`. Raises RuntimeError when they cannot be built."""
    if extension(build=True) is None:
        raise RuntimeError(f"the C++ CPU kernels cannot be used: {_state['info'].get('reason')}")
    return build_info()


def build_info() -> dict[str, Any]:
    """How the CPU kernels were obtained, never compiling: ``backend`` (``cpp`` or ``eager``); for ``cpp``,
    ``source`` (``cache``: loaded from an earlier build; ``built``: compiled by this process), ``seconds`` (this
    process's load or build time), ``build_seconds`` / ``built_at`` (the build's), ``path``, ``key`` and
    ``vector_isa`` (``avx512``, ``avx2``, or ``none``: the generic templates); for ``eager``, ``reason``."""
    extension(build=False)
    return dict(_state["info"])
