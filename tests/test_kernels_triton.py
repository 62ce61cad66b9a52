"""The Triton kernels under Triton's CPU interpreter (fp32 and fp16, small shapes), and on CUDA when present.

``TRITON_INTERPRET=1`` must be set before triton is imported, so this module sets it when no
GPU is present; the kernels then run as numpy on the CPU and are checked against the eager
reference arithmetic (which the CPU tests check against the core's reference path).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from normatlas.kernels import ops, triton_kernels

pytestmark = pytest.mark.skipif(
    not triton_kernels.interpreted() and not torch.cuda.is_available(),
    reason="triton was imported before TRITON_INTERPRET=1 could be set, and there is no GPU",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3}}


def _backward_matches_eager(
    dy: torch.Tensor, src: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, st: torch.Tensor,
    dres: torch.Tensor | None, case: tuple, tol: dict, sm_count: int | None = None,
) -> None:  # fmt: skip
    """The Triton backward's dx, dgain and dbias against the eager reference's, scaled to each output's size."""
    center, _, before, one_plus_w, l2, _, _ = case
    flags = (center, before, one_plus_w, l2, w is not None, b is not None)
    got = triton_kernels.norm_bwd(dy, src, w, st, dres, *flags, sm_count=sm_count)
    want = ops.eager_bwd(dy, src, w, st, dres, *flags)
    for a, e, what in zip(got, want, ("dx", "dgain", "dbias"), strict=False):
        scale = max(1.0, float(e.abs().max())) if e.numel() else 1.0
        torch.testing.assert_close(a.float(), e.float(), atol=tol["atol"] * scale, rtol=tol["rtol"], msg=what)


# the shapes each test runs, also read by benchmarks/gpu_warm.py (configs() below) to compile them ahead on a GPU
DTYPES = [torch.float32, torch.float16]
EAGER_SHAPES = [(7, 37), (5, 256), (2, 8200), (2, 33000), (0, 16)]
WEIGHT_SHAPES = [(5, 256), (2, 8200)]
FAR_N = [8200, 40000]
BENCH_SHAPES = [(3, 40), (2, 8200), (0, 16)]
INT64_SHAPE = ((2**31) // 262144 + 2, 262144)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", EAGER_SHAPES, ids=str)
@pytest.mark.parametrize("case", triton_kernels.CASES, ids=str)
def test_triton_matches_eager(case: tuple, rows: int, n: int, dtype: torch.dtype) -> None:
    center, eps_mode, before, one_plus_w, l2, has_res, has_bias = case
    gen = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=gen).to(dtype).to(DEVICE)
    x, dy = mk(rows, n), mk(rows, n)
    r = mk(rows, n) if has_res else None
    w, b = mk(n), (mk(n) if has_bias else None)
    args = (1e-3, center, eps_mode, before, one_plus_w, l2)
    y, h, st = triton_kernels.norm_fwd(x, r, w, b, *args)
    ye, he, ste = ops.eager_fwd(x, r, w, b, *args)
    torch.testing.assert_close(y, ye, **TOL[dtype])
    torch.testing.assert_close(st, ste, atol=1e-5, rtol=1e-5)
    if has_res:
        torch.testing.assert_close(h, he, atol=0, rtol=0)
    _backward_matches_eager(dy, h if has_res else x, w, b, st, r, case, TOL[dtype])


@pytest.mark.parametrize("weight", ["none", "float32"])
@pytest.mark.parametrize("rows,n", WEIGHT_SHAPES, ids=str)
@pytest.mark.parametrize("case", triton_kernels.CASES, ids=str)
def test_triton_reads_the_weight_in_its_own_dtype(case: tuple, rows: int, n: int, weight: str) -> None:
    """The kernels read the weight and bias as they are (no conversion kernel per call): no weight at all, or an fp32
    weight and bias beside an fp16 input, including ``1 + w`` rounded in the weight's dtype for Llama's order."""
    center, eps_mode, before, one_plus_w, l2, has_res, has_bias = case
    gen = torch.Generator().manual_seed(1)
    mk = lambda *s, dtype=torch.float16: torch.randn(*s, generator=gen).to(dtype).to(DEVICE)
    x, dy = mk(rows, n), mk(rows, n)
    r = mk(rows, n) if has_res else None
    w = None if weight == "none" else mk(n, dtype=torch.float32)
    b = mk(n, dtype=torch.float32) if has_bias else None
    args = (1e-3, center, eps_mode, before, one_plus_w, l2)
    y, h, st = triton_kernels.norm_fwd(x, r, w, b, *args)
    ye, _, _ = ops.eager_fwd(x, r, w, b, *args)
    torch.testing.assert_close(y, ye, **TOL[torch.float16])
    _backward_matches_eager(dy, h if has_res else x, w, b, st, r, case, TOL[torch.float16])


MANY_TILES = (
    [(c, 100, 256, 1) for c in range(3)] + [(c, 301, 40, None) for c in range(3)] + [(0, 60, 8200, 8), (1, 60, 8200, 8)]
)


@pytest.mark.parametrize("case_index,rows,n,sm_count", MANY_TILES, ids=str)
def test_triton_backward_over_many_tiles_and_programs(case_index: int, rows: int, n: int, sm_count: int | None) -> None:
    """Programs that walk several tiles (ragged last tile, masked rows) and several programs' partial rows."""
    case = triton_kernels.CASES[case_index]
    center, eps_mode, before, one_plus_w, l2, has_res, has_bias = case
    plan = triton_kernels._bwd_plan(n, rows, 4, has_res, 1 + has_bias)
    programs = plan.programs(sm_count or triton_kernels._sm_count(torch.device(DEVICE)), 2)
    assert programs > 1 and (plan.tiles > programs or plan.rows > 1), (plan, programs)
    gen = torch.Generator().manual_seed(2)
    mk = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)
    x, dy = mk(rows, n), mk(rows, n)
    r = mk(rows, n) if has_res else None
    w, b = mk(n), (mk(n) if has_bias else None)
    _, h, st = triton_kernels.norm_fwd(x, r, w, b, 1e-3, center, eps_mode, before, one_plus_w, l2)
    _backward_matches_eager(dy, h if has_res else x, w, b, st, r, case, TOL[torch.float32], sm_count)


@pytest.mark.parametrize("n", FAR_N, ids=str)
def test_layernorm_statistics_of_rows_far_from_zero(n: int) -> None:
    """Mean 1000, std 1: a row in one block (two passes in registers) and one streamed in chunks (each chunk's mean
    and centred sum of squares merged, Chan et al.) both keep the variance, where sum(x^2) - n mean^2 in fp32 would
    lose it all; checked against float64."""
    gen = torch.Generator().manual_seed(3)
    x = (1000 + torch.randn(3, n, generator=gen, dtype=torch.float64)).float()
    _, _, st = triton_kernels.norm_fwd(x.to(DEVICE), None, None, None, 1e-6, True, 0, False, False, False)
    xd = x.double()
    mean, var = xd.mean(-1), xd.var(-1, unbiased=False)
    torch.testing.assert_close(st[:, 0].double().cpu(), mean, rtol=1e-7, atol=0)
    torch.testing.assert_close(st[:, 1].double().cpu(), (var + 1e-6).rsqrt(), rtol=2e-5, atol=0)


def test_occupancy_of_an_sm() -> None:
    """Resident blocks per SM from registers (allocated per warp in 256s), warps, blocks and shared memory (H100)."""
    occ = triton_kernels.occupancy
    assert occ(16, 63, 33896) == 2  # 63 -> 64 registers: 2048 a warp, 32,768 a block, two fit in 65,536
    assert occ(16, 65, 0) == 1  # 65 -> 72: 2304 a warp, 36,864 a block
    assert occ(1, 36, 0) == 32  # the block limit
    assert occ(4, 32, 0) == 16  # the warp limit: 64 / 4
    assert occ(4, 32, 100 * 1024) == 2  # shared memory: 228 KiB over 101 KiB
    assert occ(32, 64, 0) == 1 and occ(32, 72, 0) == 0  # a block that cannot launch at all


def test_short_rows_pack_several_per_program() -> None:
    """QK-norm's head dim: a 64-wide row fills a quarter of a block, so programs take several rows."""
    block, rows_per_prog, single = triton_kernels._blocks(64, 32768)
    assert single and rows_per_prog > 1 and block == 64
    block, rows_per_prog, single = triton_kernels._blocks(32768, 32768)
    assert single and rows_per_prog == 1 and block == 32768
    block, rows_per_prog, single = triton_kernels._blocks(32769, 32768)
    assert not single and rows_per_prog == 1 and block == triton_kernels.MAX_FUSED


@pytest.mark.gpu
def test_int64_offsets_beyond_2_31_elements() -> None:  # pragma: no cover - needs ~9 GB of GPU memory
    rows, n = INT64_SHAPE
    x = torch.ones(rows, n, device="cuda", dtype=torch.bfloat16)
    y, _, _ = triton_kernels.norm_fwd(x, None, None, None, 1e-6, False, 0, False, False, False)
    assert torch.all(y[-1] == 1)


def _gpu_bench():
    # imported here: benchmarks/gpu_warm.py loads this file as a plain module (no package) for configs()
    from .scripts import load_benchmark

    return load_benchmark("gpu_bench")


def test_gpu_bench_correctness_step_runs_here() -> None:
    """The GPU script's first step, on this device (the interpreter without a GPU), finds no failure."""
    bench = _gpu_bench()
    assert bench.correctness(DEVICE, shapes=BENCH_SHAPES, int64=False) == []


def test_gpu_bench_correctness_step_catches_a_wrong_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _gpu_bench()
    real = triton_kernels.norm_fwd

    def off_by_a_bit(*args, **kwargs):
        y, h, st = real(*args, **kwargs)
        return y * 1.01, h, st

    monkeypatch.setattr(triton_kernels, "norm_fwd", off_by_a_bit)
    failures = bench.correctness(DEVICE, shapes=[(3, 40)], int64=False)
    assert failures and all("forward y" in f for f in failures if "forward" in f)


def test_gpu_bench_targets_from_rows() -> None:
    bench = _gpu_bench()
    row = {"op": "rms", "dtype": "bfloat16", "hidden": 4096}
    rows = [
        {**row, "mode": "fwd", "provider": "ours", "ms": 1.0, "of_copy_bw": 0.9},
        {**row, "mode": "fwd", "provider": "liger", "ms": 0.8, "of_copy_bw": 1.1},
        {**row, "mode": "bwd", "provider": "ours", "ms": 2.0, "of_copy_bw": 0.5},
    ]
    got = {t["target"]: t["met"] for t in bench.targets(rows)}
    assert got == {
        "rms fwd bf16 4096: of copy bandwidth": "yes",
        "rms fwd bfloat16 4096: Liger time / ours": "NO",
        "rms bwd bf16 4096: of copy bandwidth": "NO",
    }


def configs() -> list:
    """Every (shape, dtype, flags) this module launches the kernels with on CUDA, for benchmarks/gpu_warm.py."""
    from normatlas.kernels.triton_aot import Config

    cases, out = triton_kernels.CASES, []
    out += [Config(r, n, d, c) for d in DTYPES for r, n in EAGER_SHAPES for c in cases]
    for r, n in WEIGHT_SHAPES:
        for c in cases:
            out += [Config(r, n, torch.float16, c, torch.float32), Config(r, n, torch.float16, c, torch.float32, False)]
    out += [Config(r, n, torch.float32, cases[i]) for i, r, n, _ in MANY_TILES]
    out += [Config(3, n, torch.float32, (True, 0, False, False, False, False, False), None, False) for n in FAR_N]
    out += [Config(*INT64_SHAPE, torch.bfloat16, cases[0], None, False)]
    dtypes = (torch.float32, torch.bfloat16, torch.float16)  # the bench's correctness step on CUDA
    out += [Config(r, n, d, c) for d in dtypes for r, n in BENCH_SHAPES for c in cases]
    return out
