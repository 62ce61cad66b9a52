"""Compile the Triton kernels for a GPU target without a GPU, and report what the compiler made of each launch.

Triton's interpreter (the suite's correctness check on CPU) runs the kernels as numpy: it cannot say whether a
kernel compiles for a GPU, how many registers it takes, whether it spills, or whether its loads are vectorised. This
module answers those on any machine with Triton installed: each launch that :func:`~normatlas.kernels.triton_kernels.
norm_fwd` / ``norm_bwd`` would make for a shape is specialised by Triton's own binder (argument types, 16-byte
alignment and divisibility, constexprs, ``num_warps``: the same key a launch on the GPU compiles), compiled to a cubin
for the target by the bundled ``ptxas``, and read back with the bundled ``cuobjdump``: registers, local memory
(spills), shared memory, the widths of the global loads and stores in the SASS, and from those the blocks each SM
keeps resident and the launch's waves. Figures about speed still need a GPU (``benchmarks/gpu_session.sh``).

It needs a process in which Triton was imported without ``TRITON_INTERPRET=1``::

    python -m normatlas.kernels.triton_aot              # the sweep, for sm_90 (H100 / H200)
    python -m normatlas.kernels.triton_aot --target sm_80 --csv results/triton_aot.csv
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from normatlas.kernels import triton_kernels

__all__ = ["TARGETS", "Build", "Config", "Target", "compile_norm", "main", "sweep", "warm"]


@dataclass(frozen=True)
class Target:
    """An NVIDIA GPU's compute capability and the per-SM limits occupancy is computed from."""

    name: str
    capability: int
    sm_count: int  # of the part the backward's grid is sized for
    max_warps: int  # resident warps per SM
    max_blocks: int  # resident blocks per SM
    shared_bytes: int  # shared memory per SM
    registers: int = 65536  # 32-bit registers per SM
    reg_unit: int = 256  # registers are allocated per warp in units of this many
    block_reserved_shared: int = 1024  # shared memory the hardware reserves per resident block


TARGETS: dict[str, Target] = {
    "sm_80": Target("sm_80 (A100)", 80, 108, 64, 32, 164 * 1024),
    "sm_90": Target("sm_90 (H100 / H200)", 90, 132, 64, 32, 228 * 1024),
}


@dataclass(frozen=True)
class Build:
    """One compiled launch: what it is, and what ptxas made of it."""

    op: str  # "fwd" / "bwd"
    kernel: str
    dtype: str
    rows: int
    n: int
    case: str  # the flag combination, as triton_kernels.CASES names it
    grid: tuple[int, ...]
    constexprs: dict[str, Any] = field(compare=False)
    num_warps: int
    registers: int
    local_bytes: int  # local memory per thread: spills (0 means none)
    shared_bytes: int
    loads: tuple[int, ...]  # widths in bits of the global loads in the SASS
    stores: tuple[int, ...]
    blocks_per_sm: int  # the most the SM can hold (registers, warps, shared memory, blocks)
    sm_count: int  # the target's

    @property
    def programs(self) -> int:
        return math.prod(self.grid)

    @property
    def resident_warps(self) -> int:
        """Warps of this launch on each SM in its first wave: the SM's capacity, or fewer when the grid is small."""
        return min(self.blocks_per_sm, -(-self.programs // self.sm_count)) * self.num_warps

    @property
    def waves(self) -> float:
        return self.programs / max(1, self.blocks_per_sm * self.sm_count)

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("constexprs")
        d["block"] = self.constexprs.get("BLOCK")
        d["rows_per_program"] = self.constexprs.get("ROWS")
        d["grid"] = "x".join(map(str, self.grid))
        d["loads"] = "/".join(map(str, self.loads))
        d["stores"] = "/".join(map(str, self.stores))
        d["programs"] = self.programs
        d["resident_warps"] = self.resident_warps
        d["waves"] = round(self.waves, 2)
        return d


_WIDTH = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128}


def _widths(sass: str, op: str) -> tuple[int, ...]:
    """The widths of the global ``LDG`` (and ``LDGSTS``: global to shared, the pipelined loads) or ``STG``
    instructions in a SASS listing (no width modifier: 32 bits)."""
    found = set()
    ops = "LDG|LDGSTS" if op == "LDG" else op
    for mods in re.findall(rf"\b(?:{ops})\.E((?:\.\w+)*)", sass):
        width = 32
        for m in mods.split(".")[1:]:
            width = _WIDTH.get(m, width)
        found.add(width)
    return tuple(sorted(found))


def _tool(name: str) -> str:
    from triton import knobs

    return str(getattr(knobs.nvidia, name).path)


class _Compiler:
    """A ``launch`` for :mod:`triton_kernels` that compiles for ``target`` instead of running."""

    def __init__(
        self, target: Target, op: str, dtype: torch.dtype, rows: int, n: int, case: str, tmp: Path, sass: bool = True
    ):
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.triton = triton
        self.gpu = GPUTarget("cuda", target.capability, 32)
        self.backend = make_backend(self.gpu)
        self.target, self.op, self.dtype, self.rows, self.n, self.case, self.tmp = target, op, dtype, rows, n, case, tmp
        self.sass = sass  # False: no SASS listing, so no load / store widths (warm-up compiles need none)
        self.builds: list[Build] = []

    def blocks_per_sm(self, kernel: Any, *args: Any, **kwargs: Any) -> int:
        return max(1, self._compile(kernel, (1,), args, kwargs).blocks_per_sm)

    def __call__(self, kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        self.builds.append(self._compile(kernel, grid, args, kwargs))

    def _compile(self, kernel: Any, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> Build:
        from triton import knobs
        from triton.compiler import ASTSource
        from triton.runtime.jit import create_function_from_signature

        # Triton's own binder: the signature, the alignment / divisibility attributes and the constexprs a launch of
        # these arguments on the GPU would compile with (private API, checked against Triton 3.9), with the options
        # JITFunction.run adds to every launch, so the compiled kernel's cache key is the launch's own
        kwargs = dict(kwargs)
        kwargs["debug"] = kwargs.get("debug", getattr(kernel, "debug", None)) or knobs.runtime.debug
        for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
            if hasattr(knobs.compilation, name):
                kwargs[name] = getattr(knobs.compilation, name)
        binder = create_function_from_signature(kernel.signature, kernel.params, self.backend)
        bound, spec, opts = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(self.backend, kwargs, bound, spec, opts)
        compiled = self.triton.compile(
            ASTSource(kernel, signature, constexprs, attrs), target=self.gpu, options=options.__dict__
        )
        cubin = self.tmp / f"{kernel.__name__}.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        tool = _tool("cuobjdump")
        usage = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
        sass = ""
        if self.sass:
            sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout

        def field_of(name: str) -> int:
            m = re.search(rf"\b{name}:(\d+)", usage)
            if m is None:
                raise RuntimeError(f"cuobjdump -res-usage gave no {name} for {kernel.__name__}: {usage!r}")
            return int(m.group(1))

        # shared memory: the dynamic part Triton asks for at launch (the reduction scratch and the pipeline's
        # buffers) plus the static part in the cubin, which for sm_90 is the 1 KiB the hardware reserves per block
        # (for sm_80 the cubin leaves it out, and the occupancy adds it)
        regs, local = field_of("REG"), field_of("LOCAL") + field_of("STACK")
        static = field_of("SHARED")
        shared = static + int(compiled.metadata.shared)
        reserved = max(0, self.target.block_reserved_shared - static)
        warps = int(options.num_warps)
        names = [p.name for p in kernel.params]
        consts = {names[k[0]]: v for k, v in constexprs.items() if len(k) == 1}
        t = self.target
        return Build(
            op=self.op, kernel=kernel.__name__, dtype=str(self.dtype).removeprefix("torch."), rows=self.rows,
            n=self.n, case=self.case, grid=tuple(int(g) for g in grid), constexprs=consts, num_warps=warps,
            registers=regs, local_bytes=local, shared_bytes=shared, loads=_widths(sass, "LDG"),
            stores=_widths(sass, "STG"), sm_count=t.sm_count,
            blocks_per_sm=triton_kernels.occupancy(warps, regs, shared, sm_registers=t.registers, sm_warps=t.max_warps,
                                                   sm_blocks=t.max_blocks, sm_shared=t.shared_bytes,
                                                   reg_unit=t.reg_unit, block_shared=reserved),
        )  # fmt: skip


CASE_NAMES = {
    triton_kernels.CASES[0]: "rms",
    triton_kernels.CASES[1]: "layer+add+bias",
    triton_kernels.CASES[2]: "llama(1+w)+add",
    triton_kernels.CASES[3]: "layer clamp-eps",
    triton_kernels.CASES[4]: "l2",
}


def compile_norm(
    rows: int, n: int, dtype: torch.dtype, case: tuple = triton_kernels.CASES[0], target: Target | str = "sm_90",
    param_dtype: torch.dtype | None = None, has_weight: bool = True, sass: bool = True,
) -> list[Build]:  # fmt: skip
    """Compile the launches of a forward and a backward of ``rows x n`` in ``dtype`` for ``target``.

    The weight (unless ``has_weight`` is false) and the bias (where the case has one) are in ``param_dtype`` (default:
    ``dtype``); the tensors are allocated uninitialised on the CPU, as only their dtypes and addresses reach the
    compiler. ``sass=False`` skips the SASS listing (the builds then report no load / store widths).
    """
    if not triton_kernels.HAS_TRITON:
        raise RuntimeError("triton is not installed")
    if triton_kernels.interpreted():
        raise RuntimeError(
            "the Triton kernels were built for the interpreter (TRITON_INTERPRET=1 when triton was imported); "
            "compile for a GPU target in a process without it, e.g. `python -m normatlas.kernels.triton_aot`"
        )
    if isinstance(target, str):
        if target not in TARGETS:
            raise ValueError(f"target must be one of {sorted(TARGETS)}, got {target!r}")
        target = TARGETS[target]
    center, eps_mode, before, one_plus_w, l2, has_res, has_bias = case
    name = CASE_NAMES.get(case, str(case))
    x = torch.empty(rows, n, dtype=dtype)
    res = torch.empty_like(x) if has_res else None
    pdt = param_dtype or dtype
    w = torch.empty(n, dtype=pdt) if has_weight else None
    b = torch.empty(n, dtype=pdt) if has_bias else None
    with tempfile.TemporaryDirectory() as tmp:
        fwd = _Compiler(target, "fwd", dtype, rows, n, name, Path(tmp), sass)
        _, h, stats = triton_kernels.norm_fwd(x, res, w, b, 1e-6, center, eps_mode, before, one_plus_w, l2, launch=fwd)
        bwd = _Compiler(target, "bwd", dtype, rows, n, name, Path(tmp), sass)
        triton_kernels.norm_bwd(
            torch.empty_like(x), h if has_res else x, w, stats, res, center, before, one_plus_w, l2, has_weight,
            has_bias, launch=bwd, sm_count=target.sm_count,
        )  # fmt: skip
    return fwd.builds + bwd.builds


@dataclass(frozen=True)
class Config:
    """One call of the Triton forward and backward: shape, dtypes and the flag case."""

    rows: int
    n: int
    dtype: torch.dtype
    case: tuple = triton_kernels.CASES[0]
    param_dtype: torch.dtype | None = None
    has_weight: bool = True

    def compact(self) -> Config:
        """The same compiled kernels from a few rows: a launch's specialisation sees the row count only as 1, a
        multiple of 16 or neither (the grid is not part of it), so 2^31 elements' worth of rows needs no memory."""
        r = self.rows
        return dataclasses.replace(self, rows=r if r <= 32 else 16 + r % 16)


def _compile_config(cfg: Config, target: str) -> int:
    return len(compile_norm(cfg.rows, cfg.n, cfg.dtype, cfg.case, target, cfg.param_dtype, cfg.has_weight, False))


def warm(configs: Iterable[Config], target: str = "sm_90", jobs: int | None = None) -> tuple[int, list[str]]:
    """Compile every launch of ``configs`` for ``target`` in ``jobs`` processes (default: one per CPU), which leaves
    them in Triton's on-disk cache: a later launch of the same kernels on a GPU of that target loads them instead of
    compiling one at a time (about half a second each). Returns (launches compiled, failures)."""
    import concurrent.futures
    import multiprocessing
    import os

    uniq = sorted({c.compact() for c in configs if c.rows}, key=repr)
    os.environ.pop("TRITON_INTERPRET", None)  # the workers must compile, not interpret
    launches, failures = 0, []
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs or os.cpu_count(), mp_context=ctx) as pool:
        futures = {pool.submit(_compile_config, c, target): c for c in uniq}
        for fut in concurrent.futures.as_completed(futures):
            try:
                launches += fut.result()
            except Exception as exc:  # reported, and the launch will compile (or fail) on the GPU as it would have
                failures.append(f"{futures[fut]}: {type(exc).__name__}: {exc}"[:300])
    return launches, failures


# rows x n: QK-norm's head dims over many rows, then benchmarks/gpu_bench.py's hidden sizes with its row counts (each
# bf16 tensor 128 MiB) and 32,768 (the widest single-block forward row)
GPU_BENCH_HIDDEN = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 262144)
SHAPES: tuple[tuple[int, int], ...] = ((65536, 64), (32768, 128), *(((64 << 20) // n, n) for n in GPU_BENCH_HIDDEN))
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def sweep(
    target: Target | str = "sm_90", shapes: Iterable[tuple[int, int]] = SHAPES, dtypes: Iterable[torch.dtype] = DTYPES,
    cases: Iterable[tuple] = triton_kernels.CASES,
) -> list[Build]:  # fmt: skip
    """Every shape x dtype x case, forward and backward."""
    out: list[Build] = []
    for case in cases:
        for dtype in dtypes:
            for rows, n in shapes:
                out += compile_norm(rows, n, dtype, case, target)
    return out


def _table(builds: Sequence[Build]) -> str:
    head = ("op", "kernel", "dtype", "rows x n", "case", "block", "rows/prog", "warps", "regs", "local", "loads",
            "stores", "blocks/SM", "warps/SM", "waves")  # fmt: skip
    lines = [head]
    for b in builds:
        lines.append((
            b.op, b.kernel.strip("_"), b.dtype, f"{b.rows}x{b.n}", b.case, str(b.constexprs.get("BLOCK")),
            str(b.constexprs.get("ROWS", "")), str(b.num_warps), str(b.registers), str(b.local_bytes),
            "/".join(map(str, b.loads)), "/".join(map(str, b.stores)), str(b.blocks_per_sm), str(b.resident_warps),
            f"{b.waves:.2f}",
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m normatlas.kernels.triton_aot", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="sm_90", choices=sorted(TARGETS))
    p.add_argument("--dtype", action="append", choices=["bfloat16", "float16", "float32"],
                   help="repeatable; default: all three")  # fmt: skip
    p.add_argument("--case", action="append", choices=sorted(CASE_NAMES.values()), help="repeatable; default: all")
    p.add_argument("--csv", type=Path, help="also write the table as CSV here")
    a = p.parse_args(argv)
    target = TARGETS[a.target]
    dtypes = [getattr(torch, d) for d in a.dtype] if a.dtype else DTYPES
    cases = [c for c, nm in CASE_NAMES.items() if not a.case or nm in a.case]
    builds = sweep(target, dtypes=dtypes, cases=cases)
    import triton

    print(
        f"# Triton {triton.__version__}, target {target.name}, {target.sm_count} SMs; {len(builds)} launches compiled"
    )
    print(_table(builds))
    spills = [b for b in builds if b.local_bytes]
    print(f"# launches with local memory (spills): {len(spills)}")
    if a.csv:
        a.csv.parent.mkdir(parents=True, exist_ok=True)
        rows = [b.row() for b in builds]
        with a.csv.open("w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
        print(f"# wrote {a.csv}")
    return 1 if spills else 0


if __name__ == "__main__":
    sys.exit(main())
