"""The Triton kernels compiled for a real GPU target (sm_90) without a GPU: they compile, keep to registers, and read
and write rows in 128-bit vectors, with enough warps resident per SM to keep memory busy.

The interpreter tests (test_kernels_triton.py) check the arithmetic; they run the kernels as numpy and cannot see
any of this. The compile runs in a subprocess because this process may have imported triton under
``TRITON_INTERPRET=1`` (test_kernels_triton.py sets it), which turns every kernel into an interpreted function.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

# (rows, n, dtype, case index): QK-norm's head dims; hidden 4096 / 8192 (one block both ways); 64 KiB rows (one
# forward block of 32 warps, the backward in column tiles); 262,144 (chunks); RMSNorm, LayerNorm + add + bias, Llama
CONFIGS = [
    (65536, 64, "bfloat16", 0),
    (32768, 128, "float16", 1),
    (4096, 4096, "bfloat16", 0),
    (4096, 4096, "float32", 1),
    (2048, 8192, "bfloat16", 1),
    (512, 32768, "bfloat16", 1),
    (1024, 16384, "float32", 2),
    (256, 262144, "bfloat16", 0),
]

_SCRIPT = """
import json, sys, torch
from normatlas.kernels import triton_aot, triton_kernels
out = []
for rows, n, dtype, case in json.loads(sys.argv[1]):
    for b in triton_aot.compile_norm(rows, n, getattr(torch, dtype), triton_kernels.CASES[case], "sm_90"):
        out.append(b.row())
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def builds() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(CONFIGS)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_launch_compiles_for_sm90_without_spills(builds: list[dict]) -> None:
    kinds = {(b["rows"], b["n"], b["dtype"], b["op"]) for b in builds}
    assert {(r, n, d, op) for r, n, d, _ in CONFIGS for op in ("fwd", "bwd")} <= kinds
    assert [b for b in builds if b["local_bytes"]] == []
    assert {b["kernel"] for b in builds} == {"_fwd_kernel", "_bwd_kernel", "_bwd_rowdot_kernel"}


def test_rows_move_in_128_bit_vectors(builds: list[dict]) -> None:
    """Rows whose width is a multiple of 16 start 16-byte aligned, and Triton is told so (its divisibility
    specialisation): every kernel reading or writing row data does it with 128-bit loads / stores, and none with
    loads narrower than 32 bits (which would be a half-precision element at a time)."""
    for b in builds:
        loads = [int(w) for w in b["loads"].split("/")]
        stores = [int(w) for w in b["stores"].split("/")]
        assert 128 in loads and min(loads) >= 32, b
        if b["kernel"] != "_bwd_rowdot_kernel":  # it writes two fp32 scalars per row, no row data
            assert 128 in stores and min(stores) >= 32, b


def test_enough_warps_stay_resident(builds: list[dict]) -> None:
    """A memory-bound kernel needs many loads in flight: at least 16 of an SM's 64 warp slots hold this launch's
    warps, and the grid gives every SM work; the backward's persistent grid is one wave (its programs walk the
    rows; a second wave would leave most SMs idle while it ran)."""
    for b in builds:
        assert b["resident_warps"] >= 16, b
        assert b["programs"] >= 132, b
        if b["kernel"] == "_bwd_kernel":
            assert b["waves"] <= 1.0, b


def test_wide_rows_stay_in_one_block_up_to_the_spill_limit(builds: list[dict]) -> None:
    """The forward keeps rows of up to 64 KiB in registers (one read of x), the backward up to 8192 features."""
    by = {(b["n"], b["op"], b["kernel"]): b for b in builds}
    assert by[(32768, "fwd", "_fwd_kernel")]["block"] == 32768
    assert by[(16384, "fwd", "_fwd_kernel")]["block"] == 16384
    assert (32768, "bwd", "_bwd_rowdot_kernel") in by
    assert by[(8192, "bwd", "_bwd_kernel")]["block"] == 8192
    assert by[(262144, "fwd", "_fwd_kernel")]["block"] == 8192


_LAUNCH_FINDS_WARMED = """
import sys, torch
from pathlib import Path
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from normatlas.kernels import triton_aot, triton_kernels as tk

cache = Path(sys.argv[1])
cfgs = [triton_aot.Config(20000, 128, torch.float16, tk.CASES[1]), triton_aot.Config(3, 40000, torch.float32)]
triton_aot.warm(cfgs[:1], "sm_90", jobs=1)


class OfflineH100:  # what JITFunction.run asks of the driver, for a launch compiled but not run (warmup)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)


class Warmup:
    def __call__(self, kernel, grid, *args, **kwargs): kernel.warmup(*args, grid=grid, **kwargs)
    def blocks_per_sm(self, kernel, *args, **kwargs): return 2


driver.set_active(OfflineH100())
for c in cfgs:
    before = {p.name for p in cache.iterdir()}
    center, eps_mode, before_gain, opw, l2, has_res, has_bias = c.case
    x = torch.empty(c.rows, c.n, dtype=c.dtype)
    r = torch.empty_like(x) if has_res else None
    w, b = torch.empty(c.n, dtype=c.dtype), (torch.empty(c.n, dtype=c.dtype) if has_bias else None)
    _, h, st = tk.norm_fwd(x, r, w, b, 1e-6, center, eps_mode, before_gain, opw, l2, launch=Warmup())
    tk.norm_bwd(torch.empty_like(x), h if has_res else x, w, st, r, center, before_gain, opw, l2, True, has_bias,
                launch=Warmup(), sm_count=132)
    print(len({p.name for p in cache.iterdir()} - before))
"""


def test_a_launch_finds_the_kernels_warm_compiled(tmp_path) -> None:
    """benchmarks/gpu_warm.py's premise: a launch (JITFunction.run, through a driver that reports an H100 and never
    runs anything) computes the cache key triton_aot.warm compiled under, so it compiles nothing new; the
    configuration left out of the warm-up shows the check can tell (its three kernels compile at launch)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _LAUNCH_FINDS_WARMED, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["0", "3"]


def test_gpu_warm_covers_the_launches_of_the_device_run() -> None:
    """benchmarks/gpu_warm.py collects its configurations from the test module and gpu_bench.py themselves."""
    from .scripts import BENCHMARKS, load_benchmark

    warm = load_benchmark("gpu_warm")
    shapes = {(c.rows, c.n) for c in warm.configs()}
    bench = warm._load(BENCHMARKS / "gpu_bench.py", "gpu_bench")
    assert {s for s in bench.CORRECTNESS_SHAPES if s[0]} <= shapes
    assert {(bench.speed_rows(n, torch.bfloat16), n) for n in [bench.QK_HIDDEN, *bench.HIDDEN]} <= shapes
    assert ((2**31) // 262144 + 2, 262144) in shapes  # the int64 test
