"""The C++ kernels built for narrower instruction sets still compute the core's function (slow: two builds).

The fast path is compiled with ``-march=native``; on this machine that selects the AVX-512 row kernels with the
AVX512_BF16 conversions. These tests rebuild the same source without AVX512_BF16 (integer round-to-nearest-even
bf16 stores) and without AVX-512 at all (the generic, compiler-vectorised templates), so neither fallback can rot
unseen, and check forward, residual sum and backward against the core on odd row lengths.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from normatlas import CastOrder, NormSpec
from normatlas.functional import normalize
from normatlas.kernels import cpu

pytestmark = pytest.mark.slow

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


@pytest.mark.parametrize("flags", [["-mno-avx512bf16"], ["-mno-avx512f"]], ids=["no-avx512bf16", "no-avx512"])
def test_narrower_isa_builds_match_the_core(flags: list[str], tmp_path: Path) -> None:
    if cpu.extension() is None:
        pytest.skip("no C++ toolchain")
    name = "normatlas_isa_" + flags[0].strip("-").replace("-", "_")
    ext = cpu.build(name, tmp_path, tuple(flags))
    # without AVX-512 the generic templates run; without only AVX512_BF16 the vector kernels stay (integer rounding)
    native = cpu.extension()
    assert ext.vector_kernels() is (flags[0] != "-mno-avx512f" and native is not None and native.vector_kernels())
    gen = torch.Generator().manual_seed(0)
    for dtype, tol in TOL.items():
        for n in (7, 123, 1000):
            for center, before in ((False, False), (True, False), (False, True), (True, True)):
                if before and dtype == torch.float32:
                    continue  # BEFORE_GAIN equals AFTER_GAIN in fp32; the spec maps it to the same kernel
                x, r = (torch.randn(9, n, generator=gen).to(dtype) for _ in range(2))
                w = (torch.rand(n, generator=gen) + 0.5).to(dtype)
                b = torch.randn(n, generator=gen).to(dtype) if center else None
                xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
                y, h = ext.norm(xs, r, ws, b, 1e-5, center, 0, before, False, False, n)
                spec = NormSpec(center=center, bias=center, eps=1e-5,
                                cast_order=CastOrder.BEFORE_GAIN if before else CastOrder.AFTER_GAIN)  # fmt: skip
                torch.testing.assert_close(h, x + r, atol=0, rtol=0)
                torch.testing.assert_close(y, normalize(x + r, spec, w, b), atol=tol, rtol=tol)
                gy = torch.randn(9, n, generator=gen).to(dtype)
                gx, gw = torch.autograd.grad(y, [xs, ws], gy)
                xd, wd = (x + r).double().requires_grad_(True), w.double().requires_grad_(True)
                bd = None if b is None else b.double()
                gxd, gwd = torch.autograd.grad(normalize(xd, spec, wd, bd), [xd, wd], gy.double())
                torch.testing.assert_close(gx.double(), gxd, atol=4 * tol * (1 + gxd.abs().max().item()), rtol=4 * tol)
                torch.testing.assert_close(gw.double(), gwd, atol=4 * tol * (1 + gwd.abs().max().item()), rtol=4 * tol)
        want = (x.float() * 0.5 * w.float()).to(dtype)
        torch.testing.assert_close(ext.affine_floor(x, w, 0.5), want, atol=tol, rtol=tol)
