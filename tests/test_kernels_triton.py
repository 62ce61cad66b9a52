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
# (center, eps_mode, before_gain, one_plus_w, l2, residual, bias): RMSNorm, LayerNorm+add, Llama order, ...
CASES = [
    (False, 0, False, False, False, False, False),
    (True, 0, False, False, False, True, True),
    (False, 1, True, True, False, True, False),
    (True, 2, False, False, False, False, True),
    (False, 0, False, False, True, False, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,n", [(7, 37), (5, 256), (2, 8200), (0, 16)], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
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
    src = h if has_res else x
    flags = (center, before, one_plus_w, l2, True, has_bias)
    got = triton_kernels.norm_bwd(dy, src, w, st, r, *flags)
    want = ops.eager_bwd(dy, src, w, st, r, *flags)
    for a, e, what in zip(got, want, ("dx", "dgain", "dbias"), strict=False):
        scale = max(1.0, float(e.abs().max())) if e.numel() else 1.0
        torch.testing.assert_close(a.float(), e.float(), atol=TOL[dtype]["atol"] * scale, rtol=TOL[dtype]["rtol"],
                                   msg=what)  # fmt: skip


def test_short_rows_pack_several_per_program() -> None:
    """QK-norm's head dim: a 64-wide row fills a quarter of a block, so programs take several rows."""
    block, rows_per_prog, single = triton_kernels._blocks(64, 1000)
    assert single and rows_per_prog > 1 and block == 64
    block, rows_per_prog, single = triton_kernels._blocks(262144, 4)
    assert not single and rows_per_prog == 1 and block == triton_kernels.MAX_FUSED


@pytest.mark.gpu
def test_int64_offsets_beyond_2_31_elements() -> None:  # pragma: no cover - needs ~9 GB of GPU memory
    n = 262144
    rows = (2**31) // n + 2
    x = torch.ones(rows, n, device="cuda", dtype=torch.bfloat16)
    y, _, _ = triton_kernels.norm_fwd(x, None, None, None, 1e-6, False, 0, False, False, False)
    assert torch.all(y[-1] == 1)
