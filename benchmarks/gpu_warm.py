"""Compile, on every CPU at once, the Triton kernels a GPU session will launch, before it launches them.

    python benchmarks/gpu_warm.py              # the target of the local GPU (else sm_90), one process per CPU
    python benchmarks/gpu_warm.py --list       # how many distinct launches, without compiling

A launch compiles its kernel on first use, one at a time: here (2 cores shared with other work) `gpu_bench.py`'s
correctness step alone took 318 s cold for its 250 distinct kernels. The device run (`gpu_session.sh`) would spend
much of its few minutes compiling: the Triton tests on CUDA and `gpu_bench.py` launch about 600 distinct kernels
between them. This script compiles the same kernels first, one process per CPU, with `normatlas.kernels.triton_aot`
(Triton's own binder, so the cache key is the one a launch computes) into Triton's on-disk cache, where the launches
then find them; what it misses compiles at launch as before. Here all 627 launches took 477 s with 2 processes
(about 1.5 s each, SASS listings included, since dropped): at that rate about a minute on a 16-core host
(an estimate, not measured).

The configurations come from the places that launch: tests/test_kernels_triton.py (``configs()``) and
benchmarks/gpu_bench.py (its correctness shapes and its speed step's ops, shapes and rows).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[1]
try:  # run from a checkout without installing the package
    import normatlas  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "src"))

# (center, eps_mode, before_gain, one_plus_w, l2, residual, bias) of the speed step's "ours" providers
SPEED_OPS = {
    "rms": [(False, 0, False, False, False, False, False), (False, 0, True, False, False, False, False)],
    "layer": [(True, 0, False, False, False, False, True)],
    "add_rms": [(False, 0, False, False, False, True, False)],
}


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def configs(quick: bool = False) -> list:
    from normatlas.kernels import triton_kernels
    from normatlas.kernels.triton_aot import Config

    bench = _load(ROOT / "benchmarks" / "gpu_bench.py", "gpu_bench")
    out = list(_load(ROOT / "tests" / "test_kernels_triton.py", "test_kernels_triton").configs())
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    out += [Config(r, n, d, c) for d in dtypes for r, n in bench.CORRECTNESS_SHAPES for c in triton_kernels.CASES]
    hidden = bench.QUICK_HIDDEN if quick else bench.HIDDEN
    for op, cases in SPEED_OPS.items():
        for d in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32):
            for n in [bench.QK_HIDDEN, *hidden] if op == "rms" else hidden:
                out += [Config(bench.speed_rows(n, d), n, d, c) for c in cases]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="sm_80 / sm_90 (default: the local GPU's, else sm_90)")
    p.add_argument("--jobs", type=int, default=os.cpu_count(), help="compiling processes (default: one per CPU)")
    p.add_argument("--quick", action="store_true", help="only what gpu_bench.py --quick launches in its speed step")
    p.add_argument("--list", action="store_true", help="count the distinct launches and stop")
    a = p.parse_args(argv)
    from normatlas.kernels import triton_aot

    target = a.target
    if target is None:
        target = "sm_90"
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            target = f"sm_{major}{minor}"
    if target not in triton_aot.TARGETS:
        print(f"gpu_warm: no occupancy table for {target} (have {sorted(triton_aot.TARGETS)}); nothing compiled")
        return 2
    cfgs = configs(a.quick)
    distinct = {c.compact() for c in cfgs if c.rows}
    print(f"# {len(cfgs)} configurations, {len(distinct)} distinct compiled shapes; target {target}")
    if a.list:
        return 0
    start = time.perf_counter()
    launches, failures = triton_aot.warm(cfgs, target, a.jobs)
    print(f"# compiled {launches} launches into Triton's cache in {time.perf_counter() - start:.0f} s with "
          f"{a.jobs} processes; {len(failures)} failures")  # fmt: skip
    for f in failures[:20]:
        print(f"  FAIL {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
