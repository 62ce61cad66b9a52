"""The C++ kernels built for narrower instruction sets still compute the core's function (slow: three builds).

The fast path is compiled with ``-march=native``; on this machine that selects the explicit-vector row kernels
with AVX-512 masks and the AVX512_BF16 conversions. These tests rebuild the same source without AVX512_BF16
(integer round-to-nearest-even bf16 stores), without AVX-512 (the same vector kernels on AVX2 + FMA + F16C, with
AVX2 masks and 16-bit tails through a buffer) and without AVX2 (the generic, compiler-vectorised templates), so no
fallback can rot unseen, and check forward, residual sum and backward against the core on odd row lengths; the
AVX2 build must also equal the native one bit for bit.
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


def _cpu_has(flag: str) -> bool:
    try:
        return any(flag in line.split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("flags"))  # fmt: skip
    except OSError:
        return False


# (flags, the vector ISA that build must report on a CPU with AVX-512 and AVX2)
BUILDS = [(["-mno-avx512bf16"], "avx512"), (["-mno-avx512f"], "avx2"), (["-mno-avx2"], "")]


@pytest.mark.parametrize("flags,isa", BUILDS, ids=["no-avx512bf16", "no-avx512", "no-avx2"])
def test_narrower_isa_builds_match_the_core(flags: list[str], isa: str, tmp_path: Path) -> None:
    native = cpu.extension()
    if native is None:
        pytest.skip("no C++ toolchain")
    if native.vector_kernels() != "avx512" or not _cpu_has("avx2"):
        pytest.skip("the builds' expected ISAs assume a CPU with AVX-512 and AVX2")
    name = "normatlas_isa_" + flags[0].strip("-").replace("-", "_")
    ext = cpu.build(name, tmp_path, tuple(flags))
    assert ext.vector_kernels() == isa
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


def test_avx2_build_equals_the_native_one_bit_for_bit(tmp_path: Path) -> None:
    """The AVX2 masks and 16-bit tail buffers compute exactly what the AVX-512 masks do: every variant, odd widths
    (tails of 1-7), forward, residual sum and backward."""
    native = cpu.extension()
    if native is None or native.vector_kernels() != "avx512" or not _cpu_has("avx2"):
        pytest.skip("needs a CPU with AVX-512 and AVX2")
    avx2 = cpu.build("normatlas_isa_avx2_exact", tmp_path, ("-mno-avx512f",))
    assert avx2.vector_kernels() == "avx2"
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in (1, 7, 13, 123, 4100):
            x, r, gy = (torch.randn(5, n, generator=gen).to(dtype) for _ in range(3))
            x[0, 0] = float("nan")  # a quiet NaN through the rounding
            w = (torch.rand(n, generator=gen) + 0.5).to(dtype)
            b = torch.randn(n, generator=gen).to(dtype)
            for center, before, one_plus_w, weight, bias in ((False, False, False, w, None), (True, False, False, w, b),
                                                             (False, True, False, w, None), (True, True, True, w, b),
                                                             (True, False, False, None, None),
                                                             (False, False, False, w.float(), None)):  # fmt: skip
                if before and weight is not None and weight.dtype != dtype:
                    continue
                outs = []
                for ext in (native, avx2):
                    y, h, st = ext.norm_fwd(x, r, weight, bias, 1e-5, center, 0, before, one_plus_w, False, n)
                    dx, dg, db = ext.norm_bwd(gy, h, weight, st, gy, center, before, one_plus_w, False,
                                              weight is not None, bias is not None, n)  # fmt: skip
                    outs.append([y, h, st, dx, dg, db])
                for a, e in zip(*outs, strict=True):  # the bytes, so NaN payloads count too
                    assert torch.equal(a.contiguous().view(torch.uint8), e.contiguous().view(torch.uint8)), (
                        dtype, n, center, before, one_plus_w)  # fmt: skip
