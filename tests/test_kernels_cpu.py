"""The fused CPU kernels against the core's reference path, forward and backward, every served spec."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from normatlas import Axis, CastOrder, EpsPlacement, Gain, GainConvention, Layout, Norm, NormSpec, RMSNorm, Scale
from normatlas.functional import normalize
from normatlas.kernels import (
    FusedAddRMSNorm,
    FusedLayerNorm,
    FusedNorm,
    FusedRMSNorm,
    build_info,
    cpu,
    dispatch,
    fused_add_layer_norm,
    fused_add_rms_norm,
    fused_layer_norm,
    fused_normalize,
    fused_rms_norm,
    ops,
    qk_rms_norm,
    unsupported,
)
from normatlas.kernels.dispatch import Kernel, qk_route

TOL = {
    torch.float64: {"atol": 1e-10, "rtol": 1e-10},
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}

RMS = NormSpec(center=False, bias=False, eps=1e-6)
LN = NormSpec(eps=1e-5)
SPECS = {
    "rms": RMS,
    "rms_1+w": RMS.with_(gain_convention=GainConvention.ONE_PLUS_W),
    "rms_before_gain": RMS.with_(cast_order=CastOrder.BEFORE_GAIN),
    "rms_no_affine": RMS.with_(gain=Gain.NONE),
    "rms_eps_outside": RMS.with_(eps_placement=EpsPlacement.OUTSIDE_SQRT, eps=1e-3),
    "rms_clamp": RMS.with_(eps_placement=EpsPlacement.CLAMP, eps=1e-3),
    "rms_eps_none": RMS.with_(eps=None),
    "l2": RMS.with_(scale=Scale.L2),
    "ln": LN,
    "ln_no_bias": LN.with_(bias=False),
    "ln_no_affine": LN.with_(gain=Gain.NONE, bias=False),
    "ln_before_gain": LN.with_(cast_order=CastOrder.BEFORE_GAIN),
    "ln_eps_outside": LN.with_(eps_placement=EpsPlacement.OUTSIDE_SQRT),
    "ln_2d_features": LN.with_(feature_ndim=2),
}
SHAPES = [(5, 123, 123), (1, 1, 1023), (0, 7, 64), (9, 7), (2, 4100), (37, 2051)]  # the last: backward tiles with tails


@pytest.fixture(scope="session", autouse=True)
def _built() -> None:
    """Compile (or load from the user cache) the extension once per session."""
    build_info()


def _params(spec: NormSpec, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator):
    fshape = shape[len(shape) - spec.feature_ndim :]
    w = b = None
    if spec.gain is Gain.PER_FEATURE:
        base = 0.0 if spec.gain_convention is GainConvention.ONE_PLUS_W else 1.0
        w = (torch.randn(fshape, generator=gen, dtype=torch.float64) * 0.5 + base).to(dtype)
    if spec.bias:
        b = (torch.randn(fshape, generator=gen, dtype=torch.float64) * 0.5).to(dtype)
    return w, b


def _leaves(*ts):
    return [t.detach().clone().requires_grad_(True) if t is not None else None for t in ts]


def _grads(out, inputs, gy):
    leaves = [t for t in inputs if t is not None]
    gs = torch.autograd.grad(out, leaves, gy, allow_unused=True)
    it = iter(gs)
    return [next(it) if t is not None else None for t in inputs]


def _close(a, b, dtype, name):
    if a is None and b is None:
        return
    scale = max(1.0, float(b.detach().abs().max())) if b.numel() else 1.0
    tol = TOL[dtype]
    torch.testing.assert_close(a.double(), b.double(), atol=tol["atol"] * scale, rtol=tol["rtol"], msg=name)


# fp16 runs without the residual add; bf16 covers the add's rounding
DTYPE_ADD = [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False), (torch.bfloat16, True),
             (torch.float16, False)]  # fmt: skip


@pytest.mark.parametrize("dtype,add", DTYPE_ADD, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(SPECS))
def test_matches_reference_fwd_bwd(name: str, shape: tuple[int, ...], dtype: torch.dtype, add: bool) -> None:
    spec = SPECS[name]
    assert unsupported(spec, torch.empty(shape, dtype=dtype)) is None
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.5).to(dtype)
    r = (torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype) if add else None
    w, b = _params(spec, shape, dtype, gen)
    gy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)

    xs, rs, ws, bs = _leaves(x, r, w, b)
    if add:
        y, h = fused_normalize(xs, spec, ws, bs, residual=rs)
        torch.testing.assert_close(h, x + r, atol=0, rtol=0)  # the residual sum, rounded like torch's add
        loss_inputs = [xs, rs, ws, bs]
    else:
        y = fused_normalize(xs, spec, ws, bs)
        loss_inputs = [xs, None, ws, bs]
    grads = _grads(y, loss_inputs, gy)

    # the core's reference path in the same dtype (forward), and in float64 (forward and backward)
    h_in = x + r if add else x
    torch.testing.assert_close(y, normalize(h_in, spec, w, b), **TOL[dtype])
    xd, rd, wd, bd = _leaves(*(t.double() if t is not None else None for t in (x, r, w, b)))
    yd = normalize(xd + rd if add else xd, spec, wd, bd)
    _close(y, yd, dtype, "forward")
    ref = _grads(yd, [xd, rd if add else None, wd, bd], gy.double())
    for got, want, what in zip(grads, ref, ("dx", "dresidual", "dweight", "dbias"), strict=False):
        _close(got, want, dtype, what)


GRADCHECK = [(n, False) for n in ("rms", "rms_1+w", "rms_eps_outside", "rms_clamp", "l2", "ln", "ln_no_affine",
                                   "ln_2d_features")] + [("rms", True), ("ln", True)]  # fmt: skip


@pytest.mark.parametrize("name,add", GRADCHECK, ids=str)
def test_gradcheck_float64(name: str, add: bool) -> None:
    spec = SPECS[name]
    gen = torch.Generator().manual_seed(2)
    shape = (2, 3, 5)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) + 0.3
    r = torch.randn(shape, generator=gen, dtype=torch.float64)
    w, b = _params(spec, shape, torch.float64, gen)
    inputs = [t.requires_grad_(True) for t in (x, r, w, b) if t is not None]

    def f(*args):
        it = iter(args)
        xa, ra = next(it), next(it)
        wa = next(it) if w is not None else None
        ba = next(it) if b is not None else None
        return fused_normalize(xa, spec, wa, ba, residual=ra) if add else fused_normalize(xa + 0 * ra, spec, wa, ba)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_fallback_equals_compiled_kernel(dtype: torch.dtype) -> None:
    """The no-compiler fallback computes what the C++ kernel does, forward and backward."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 96, generator=gen).to(dtype)
    r = torch.randn(7, 96, generator=gen).to(dtype)
    w = torch.randn(96, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    for center, eps_mode, before in [(False, 0, False), (True, 0, False), (False, 1, True), (True, 2, False)]:
        args = (1e-3, center, eps_mode, before, False, False)
        y, h, st_ = ops.fused_norm_fwd(x, r, w, b, *args)
        ye, he, ste = ops.eager_fwd(x, r, w, b, *args)
        torch.testing.assert_close(y, ye, **TOL[dtype])
        torch.testing.assert_close(h, he, atol=0, rtol=0)
        torch.testing.assert_close(st_, ste, atol=1e-5, rtol=1e-5)
        dy = torch.randn(7, 96, generator=gen).to(dtype)
        got = ops.fused_norm_bwd(dy, h, w, st_, dy, center, before, False, False, True, True)
        want = ops.eager_bwd(dy, h, w, st_, dy, center, before, False, False, True, True)
        for a, e in zip(got, want, strict=False):
            torch.testing.assert_close(a.float(), e.float(), atol=TOL[dtype]["atol"] * 10, rtol=TOL[dtype]["rtol"])


def test_torch_functional_signatures_match_peers() -> None:
    gen = torch.Generator().manual_seed(4)
    x, r = torch.randn(4, 9, 64, generator=gen), torch.randn(4, 9, 64, generator=gen)
    w, b = torch.randn(64, generator=gen), torch.randn(64, generator=gen)
    torch.testing.assert_close(fused_rms_norm(x, 64, w, 1e-6), F.rms_norm(x, (64,), w, 1e-6), **TOL[torch.float32])
    torch.testing.assert_close(fused_rms_norm(x, 64), F.rms_norm(x, (64,)), **TOL[torch.float32])
    torch.testing.assert_close(fused_layer_norm(x, 64, w, b), F.layer_norm(x, (64,), w, b), **TOL[torch.float32])
    y, h = fused_add_rms_norm(x, r, 64, w, 1e-6)
    torch.testing.assert_close(y, F.rms_norm(x + r, (64,), w, 1e-6), **TOL[torch.float32])
    y, h = fused_add_layer_norm(x, r, 64, w, b)
    torch.testing.assert_close(y, F.layer_norm(x + r, (64,), w, b), **TOL[torch.float32])
    torch.testing.assert_close(h, x + r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cast_order", [CastOrder.AFTER_GAIN, CastOrder.BEFORE_GAIN])
def test_qk_norm_many_short_rows(dtype: torch.dtype, cast_order: CastOrder) -> None:
    """QK-norm over many short rows: the one-launch inference path equals two fused calls bit for bit, and
    matches the core; with autograd (two calls) the gradients reach q, k and both gains."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 33, 8, 64, generator=gen).to(dtype)  # GQA: 8 q heads, 2 kv heads, 33 positions
    k = torch.randn(2, 33, 2, 64, generator=gen).to(dtype)
    wq, wk = (torch.randn(64, generator=gen).to(dtype) for _ in range(2))
    with torch.no_grad():
        qo, ko = qk_rms_norm(q, k, wq, wk, 1e-6, cast_order=cast_order)
        assert cpu.extension() is None or qk_route(q, k, wq, wk, 1e-6, cast_order).kernel is Kernel.PAIR  # one launch
    two = (
        fused_rms_norm(q, 64, wq, 1e-6, cast_order=cast_order),
        fused_rms_norm(k, 64, wk, 1e-6, cast_order=cast_order),
    )
    assert torch.equal(qo, two[0]) and torch.equal(ko, two[1])
    spec = RMS.with_(cast_order=cast_order)
    torch.testing.assert_close(qo, normalize(q, spec, wq), **TOL[dtype])
    torch.testing.assert_close(ko, normalize(k, spec, wk), **TOL[dtype])
    leaves = [t.clone().requires_grad_(True) for t in (q, k, wq, wk)]
    qg, kg = qk_rms_norm(*leaves, 1e-6, cast_order=cast_order)
    torch.testing.assert_close(qg, qo, atol=0, rtol=0)
    grads = torch.autograd.grad((qg.float().sum() + kg.float().pow(2).sum()), leaves)
    assert all(g is not None and g.shape == t.shape for g, t in zip(grads, leaves, strict=True))


def test_qk_norm_one_launch_edge_cases() -> None:
    """No gains, a single decode token, and mismatched head dims (which fall back to two calls)."""
    gen = torch.Generator().manual_seed(8)
    q, k = torch.randn(1, 32, 1, 128, generator=gen), torch.randn(1, 8, 1, 128, generator=gen)
    with torch.no_grad():
        qo, ko = qk_rms_norm(q, k, None, None, None)
    torch.testing.assert_close(qo, F.rms_norm(q, (128,)), **TOL[torch.float32])
    torch.testing.assert_close(ko, F.rms_norm(k, (128,)), **TOL[torch.float32])
    k2 = torch.randn(1, 8, 1, 64, generator=gen)
    with torch.no_grad():
        _, ko2 = qk_rms_norm(q, k2, torch.ones(128), torch.ones(64), 1e-6)
    torch.testing.assert_close(ko2, F.rms_norm(k2, (64,), torch.ones(64), 1e-6), **TOL[torch.float32])


def test_modules_drop_in_and_fused_refuses_what_it_cannot_serve() -> None:
    gen = torch.Generator().manual_seed(6)
    peer = torch.nn.RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        peer.weight.copy_(torch.randn(48, generator=gen))
    ours = FusedRMSNorm(48, eps=1e-6)
    ours.load_state_dict(peer.state_dict())
    x = torch.randn(3, 5, 48, generator=gen)
    torch.testing.assert_close(ours(x), peer(x), **TOL[torch.float32])
    ln = FusedLayerNorm(48)
    torch.testing.assert_close(ln(x), F.layer_norm(x, (48,), ln.weight, ln.bias), **TOL[torch.float32])
    mask = torch.rand(3, 5, 48, generator=gen) > 0.3  # a mask is not served: backend="fused" says so
    with pytest.raises(ValueError, match="backend='fused' cannot run a masked norm"):
        ours(x, mask)
    auto, ref = RMSNorm(48, eps=1e-6), RMSNorm(48, eps=1e-6, backend="reference")
    auto.load_state_dict(peer.state_dict())
    ref.load_state_dict(peer.state_dict())
    torch.testing.assert_close(auto(x, mask), ref(x, mask), rtol=0, atol=0)  # auto: the reference path runs
    add = FusedAddRMSNorm(48, eps=1e-6)
    r = torch.randn(3, 5, 48, generator=gen)
    y, _h = add(x, r)
    torch.testing.assert_close(y, F.rms_norm(x + r, (48,), add.weight, 1e-6), **TOL[torch.float32])
    gn_spec = NormSpec(layout=Layout.NC_ANY, reduce=frozenset({Axis.FEATURE, Axis.POSITION}), groups=4)
    assert unsupported(gn_spec, torch.empty(2, 8, 3)) is not None
    with pytest.raises(ValueError, match="backend='fused' cannot run this norm: the kernels normalize over"):
        FusedNorm(gn_spec, 8)
    gn = Norm(gn_spec, 8)  # auto: the reference path
    xc = torch.randn(2, 8, 3, generator=gen)
    torch.testing.assert_close(gn(xc), normalize(xc, gn_spec, gn.weight, gn.bias), rtol=0, atol=0)


def test_compiles_fullgraph_without_recompiling() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    layer = FusedAddRMSNorm(32, eps=1e-6)
    fn = torch.compile(layer, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    for rows in (3, 7, 11):
        x = torch.randn(rows, 5, 32, requires_grad=True)
        r = torch.randn(rows, 5, 32)
        y, h = fn(x, r)
        (y.sum() + h.pow(2).sum()).backward()
        ye, _he = layer(x.detach(), r)
        torch.testing.assert_close(y, ye)
        assert x.grad is not None and x.grad.shape == x.shape
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames[-1] == frames[0]  # no per-shape recompilation


def test_bad_inputs_name_the_parameter() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, torch.randn(2, 9), 8)
    with pytest.raises(TypeError, match="residual"):
        fused_add_rms_norm(x, torch.randn(2, 8, dtype=torch.float64), 8)
    with pytest.raises(ValueError, match="weight"):
        fused_rms_norm(x, 8, torch.randn(7))
    spec = SPECS["rms"].with_(cast_order=CastOrder.BEFORE_GAIN)
    reason = unsupported(spec, x.bfloat16(), torch.ones(8))
    assert reason is not None and "weight" in reason


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64])
def test_non_float_weights_raise_type_error_naming_them(dtype: torch.dtype) -> None:
    """The C++ fast path, the checked path (under torch.compile) and the QK pair all name the parameter."""
    x, ones, bad = torch.randn(3, 8), torch.ones(8), torch.ones(8, dtype=dtype)
    calls = {
        "weight": lambda: fused_rms_norm(x, 8, bad),
        "bias": lambda: fused_layer_norm(x, 8, ones, bad),
        "k_weight": lambda: qk_rms_norm(x, x, ones, bad),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=rf"{name} has dtype"):
            call()
    compiled = torch.compile(lambda t, w: fused_rms_norm(t, 8, w), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"TypeError.*weight has dtype .*floating-point"):  # dynamo wraps it
        compiled(x, bad)


@given(a=st.floats(0.01, 100.0), c=st.floats(-10.0, 10.0), seed=st.integers(0, 2**16))
def test_invariances(a: float, c: float, seed: int) -> None:
    """Essay: Norm(a x) == Norm(x); LN(x + c) == LN(x) while RMSNorm is not re-centring invariant."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 33, generator=gen, dtype=torch.float64)
    tiny = 1e-300
    for spec in (SPECS["rms"].with_(eps=tiny), SPECS["ln"].with_(eps=tiny)):
        torch.testing.assert_close(fused_normalize(a * x, spec), fused_normalize(x, spec))
    ln = SPECS["ln"].with_(eps=tiny)
    torch.testing.assert_close(fused_normalize(x + c, ln), fused_normalize(x, ln))
    if abs(c) > 0.1:
        rms = SPECS["rms"].with_(eps=tiny)
        assert not torch.allclose(fused_normalize(x + c, rms), fused_normalize(x, rms))


def test_layer_norm_gradient_is_orthogonal_to_ones_and_xhat() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 40, generator=gen, dtype=torch.float64, requires_grad=True)
    spec = SPECS["ln_no_affine"].with_(eps=1e-300)
    y = fused_normalize(x, spec)
    (dx,) = torch.autograd.grad(y, x, torch.randn(6, 40, generator=gen, dtype=torch.float64))
    xhat = y.detach()
    torch.testing.assert_close(dx.sum(-1), torch.zeros(6, dtype=torch.float64), atol=1e-10, rtol=0)
    torch.testing.assert_close((dx * xhat).sum(-1), torch.zeros(6, dtype=torch.float64), atol=1e-7, rtol=0)


def _fast(spec: NormSpec, x: torch.Tensor, r: Any, w: Any, b: Any, fshape: Any) -> Any:
    """The cached C++ plan's answer (``Kernel.PLAN``'s handle): ``[y, h]``, or None where it declines."""
    plan = dispatch.plan(spec, x.dtype)
    return None if plan is None else plan(x, r, w, b, fshape)


def test_fast_path_equals_checked_path_and_keeps_autograd() -> None:
    """The cached C++ plan (eager hot path) and the checked custom-op path agree, values and gradients."""
    from normatlas.kernels import api

    gen = torch.Generator().manual_seed(8)
    for spec in (SPECS["rms"], SPECS["ln"], SPECS["rms_1+w"], SPECS["ln_2d_features"]):
        shape = (3, 4, 6, 10)
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        r = torch.randn(shape, generator=gen, dtype=torch.float64)
        w, b = _params(spec, shape, torch.float64, gen)
        gy = torch.randn(shape, generator=gen, dtype=torch.float64)
        xs, rs, ws, bs = _leaves(x, r, w, b)
        fast = _fast(spec, xs, rs, ws, bs, None)
        assert fast is not None
        xc, rc, wc, bc = _leaves(x, r, w, b)
        # the checked path on the custom op (what torch.compile traces), with the trailing dims flattened
        k = spec.feature_ndim
        flat = (*shape[: len(shape) - k], -1)
        a = api.kernel_args(spec, x.dtype)
        scalars = (a.eps, a.center, a.eps_mode, a.before_gain, a.one_plus_w, a.l2)
        y2, h2, _ = api.fused_norm(
            xc.reshape(flat), rc.reshape(flat), wc.reshape(-1) if wc is not None else None,
            bc.reshape(-1) if bc is not None else None, *scalars,
        )  # fmt: skip
        torch.testing.assert_close(fast[0], y2.reshape(shape), atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(fast[1], h2.reshape(shape), atol=0, rtol=0)
        g_fast = _grads((fast[0] * gy).sum() + fast[1].pow(2).sum(), [xs, rs, ws, bs], None)
        g_slow = _grads((y2.reshape(shape) * gy).sum() + h2.pow(2).sum(), [xc, rc, wc, bc], None)
        for gf, gs, what in zip(g_fast, g_slow, ("dx", "dresidual", "dweight", "dbias"), strict=True):
            if gs is None:
                assert gf is None, what
            else:
                torch.testing.assert_close(gf, gs, atol=1e-10, rtol=1e-10, msg=what)


def test_fast_path_declines_what_the_checked_path_must_see() -> None:
    """The C++ plan's checks: anything off the CPU or shaped / typed unlike what the plan serves returns None, so
    the checked path raises its informative error or falls back; what it serves runs."""

    if cpu.extension() is None:
        pytest.skip("no compiled kernels")
    x, r, w, b = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8), torch.randn(8)
    ln, rms = SPECS["ln"], SPECS["rms"]
    served = [(ln, x, None, w, b, (8,)), (ln, x, r, w, b, None), (rms, x, r, w, None, (8,)),
              (SPECS["ln_no_affine"], x, None, None, None, None),
              (SPECS["rms_before_gain"], x.bfloat16(), None, w.bfloat16(), None, None),
              (rms, x.bfloat16(), None, w, None, None)]  # fmt: skip
    for spec, xi, ri, wi, bi, fs in served:
        out = _fast(spec, xi, ri, wi, bi, fs)
        assert out is not None and out[0].shape == xi.shape
    declined = {
        "trailing dims unlike normalized_shape": (ln, x, None, w, b, (16,)),
        "fewer dims than the features": (SPECS["ln_2d_features"], torch.randn(8), None, None, None, None),
        "weight of another shape": (ln, x, None, torch.randn(7), b, None),
        "weight the spec does not use": (SPECS["ln_no_affine"], x, None, w, None, None),
        "1 + w without the weight": (SPECS["rms_1+w"], x, None, None, None, None),
        "fp32 weight under the cast before the gain": (SPECS["rms_before_gain"], x.bfloat16(), None, w, None, None),
        "bias of another shape": (ln, x, None, w, torch.randn(2, 4), None),
        "residual of another shape": (ln, x, torch.randn(8), w, b, None),
        "residual of another dtype": (ln, x, r.double(), w, b, None),
        "no features": (ln, torch.randn(3, 0), None, torch.randn(0), torch.randn(0), None),
        "input off the CPU": (ln, torch.empty(3, 8, device="meta"), None, w, b, None),
        "weight off the CPU": (ln, x, None, torch.empty(8, device="meta"), b, None),
        "residual off the CPU": (ln, x, torch.empty(3, 8, device="meta"), w, b, None),
    }
    for what, (spec, xi, ri, wi, bi, fs) in declined.items():
        assert _fast(spec, xi, ri, wi, bi, fs) is None, what


def test_fast_path_gradients_only_where_needed() -> None:
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(5, 16, generator=gen, requires_grad=True)
    w = torch.randn(16, generator=gen)  # a frozen weight: no gradient computed or returned
    b = torch.randn(16, generator=gen, requires_grad=True)
    y = fused_layer_norm(x, 16, w, b)
    y.sum().backward()
    assert x.grad is not None and b.grad is not None and w.grad is None
    torch.testing.assert_close(b.grad, torch.full((16,), 5.0))
    with torch.no_grad():
        assert fused_rms_norm(x, 16, w).grad_fn is None
    y = fused_rms_norm(x, 16, w.requires_grad_(True))
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=False)
    assert gx.shape == x.shape
    y = fused_rms_norm(x, 16, w)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def test_normalized_shape_must_match_the_input() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="normalized_shape"):
        fused_rms_norm(x, 16)
    with pytest.raises(ValueError, match="normalized_shape"):
        fused_layer_norm(x, [2, 4])
    with pytest.raises(ValueError, match="trailing dims"):
        FusedRMSNorm(16)(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [3, 16, 100, 512, 513, 2051])
@pytest.mark.parametrize("name", ["rms", "rms_eps_outside", "rms_clamp", "ln", "ln_before_gain"])
def test_rows_are_batch_invariant(name: str, n: int, dtype: torch.dtype) -> None:
    """A row's output and statistics are the same bits computed alone or among any others (short rows take their
    statistics 8 rows at a time, longer ones a row at a time), with and without the residual add; zero rows too."""
    spec = SPECS[name]
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(29, n, generator=gen, dtype=torch.float64) * 3 + 0.5).to(dtype)
    x[4] = 0
    r = torch.randn(29, n, generator=gen, dtype=torch.float64).to(dtype)
    w, b = _params(spec, (n,), dtype, gen)
    y_all, h_all = fused_normalize(x, spec, w, b, residual=r)
    y_plain = fused_normalize(x, spec, w, b)
    for i in (0, 4, 7, 8, 13, 28):
        y_i, h_i = fused_normalize(x[i : i + 1], spec, w, b, residual=r[i : i + 1])
        assert torch.equal(y_all[i : i + 1], y_i) and torch.equal(h_all[i : i + 1], h_i), i
        assert torch.equal(y_plain[i : i + 1], fused_normalize(x[i : i + 1], spec, w, b)), i
        assert torch.equal(y_plain[i:], fused_normalize(x[i:], spec, w, b)), i  # groups starting at another row


@pytest.mark.parametrize("case", ["offset_1e4", "massive_activation", "tiny_spread_1e3"])
def test_layer_norm_statistics_as_accurate_as_torch(case: str) -> None:
    """The fp32 LayerNorm statistics (corrected two-pass) stay within 2x torch's own error against float64.

    The hard rows for a one-pass sum of squares: a large common offset, one massive channel (the essay's massive
    activations), and a tiny spread around a large mean.
    """
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 4097 if case == "offset_1e4" else 1000, generator=gen, dtype=torch.float64)
    if case == "offset_1e4":
        x = x + 1e4
    elif case == "massive_activation":
        x[:, 7] = 3e3
    else:
        x = x * 1e-2 + 1e3
    x32 = x.float()
    n = x.shape[-1]
    truth = torch.nn.functional.layer_norm(x32.double(), (n,), eps=1e-5)
    ours = (fused_layer_norm(x32, n, eps=1e-5).double() - truth).abs().max().item()
    peer = (torch.nn.functional.layer_norm(x32, (n,), eps=1e-5).double() - truth).abs().max().item()
    assert ours <= 2 * peer + 1e-6, (ours, peer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_affine_floor_is_the_output_pass(dtype: torch.dtype) -> None:
    """The benchmark's floor (``y = x * s * w`` row by row) computes what it claims, odd row lengths included."""
    ext = cpu.extension()
    if ext is None:
        pytest.skip("no C++ kernels")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 3, 123, generator=gen).to(dtype)
    w = torch.rand(123, generator=gen).to(dtype)
    want = (x.float() * 0.5 * w.float()).to(dtype)
    torch.testing.assert_close(ext.affine_floor(x, w, 0.5), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec_name", ["rms", "rms_before_gain", "ln", "ln_before_gain", "rms_1+w"])
def test_half_parameters_equal_their_fp32_upcasts(dtype: torch.dtype, spec_name: str) -> None:
    """Half-precision gains and biases are read in their own dtype over a few rows (decode) and converted once per
    thread over many: either way the results equal those with the same values given in fp32 bit for bit, forward
    (with and without a residual) and backward (dx, dgain, dbias), odd widths and several threads included; a mixed
    pair (half gain, fp32 bias) too."""
    spec = SPECS[spec_name]
    gen = torch.Generator().manual_seed(17)
    for rows, n in ((1, 37), (4, 1000), (3, 4104), (5, 37), (64, 1000)):
        x = torch.randn(rows, n, generator=gen).to(dtype)
        r = torch.randn(rows, n, generator=gen).to(dtype)
        w = (torch.rand(n, generator=gen) + 0.5).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype) if spec.bias else None
        gy = torch.randn(rows, n, generator=gen).to(dtype)
        half = (w, b)
        pairs = [(w.float(), None if b is None else b.float())]
        if b is not None:
            pairs.append((w, b.float()))
        if spec.cast_order is CastOrder.BEFORE_GAIN:
            pairs = []  # fp32 parameters with a half input take the reference path under BEFORE_GAIN
        want = None
        for params in [half, *pairs]:
            xs, ws = x.clone().requires_grad_(True), params[0].clone().requires_grad_(True)
            bs = None if params[1] is None else params[1].clone().requires_grad_(True)
            y = fused_normalize(xs, spec, ws, bs)
            y2, h2 = fused_normalize(x, spec, params[0], params[1], residual=r)
            grads = torch.autograd.grad(y, [t for t in (xs, ws, bs) if t is not None], gy)
            got = [y, y2, h2, *[g.to(dtype) for g in grads]]  # a gain gradient comes back in the gain's dtype
            if want is None:
                want = got
                torch.testing.assert_close(y, normalize(x, spec, w, b), **TOL[dtype])
                continue
            for a, e in zip(got, want, strict=True):
                assert torch.equal(a, e), (spec_name, rows, n, [p.dtype for p in params if p is not None])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(37, 2051), (300, 256), (1030, 4100)], ids=["tiled", "short-rows", "streaming"])
@pytest.mark.parametrize("center", [False, True], ids=["rms", "ln"])
def test_llama_order_gain_gradient_uses_the_rounded_x_hat(dtype: torch.dtype, shape: tuple[int, int],
                                                          center: bool) -> None:  # fmt: skip
    """With the cast before the gain (y = g * x_hat.to(dtype)) dgain sums dy * x_hat rounded to the input dtype, on
    the tiled (from cache) and the streaming (> 8 MiB) backward alike. Against float64 sums of the kernel's own
    statistics, tight enough that the unrounded x_hat (off by up to half an ulp of bf16 per element) fails."""
    ext = cpu.extension()
    if ext is None:
        pytest.skip("no C++ extension")
    rows, n = shape
    gen = torch.Generator().manual_seed(13)
    x, gy = (torch.randn(rows, n, generator=gen).to(dtype) for _ in range(2))
    w, b = (torch.rand(n, generator=gen) + 0.5).to(dtype), torch.randn(n, generator=gen).to(dtype)
    bias = b if center else None
    _, _, stats = ext.norm_fwd(x, None, w, bias, 1e-6, center, 0, True, False, False, n)
    _, dg, db = ext.norm_bwd(gy, x, w, stats, None, center, True, False, False, True, center, n)
    xhat = (x.float() - stats[:, :1]) * stats[:, 1:2]  # the kernel's fp32 x_hat
    rounded = (gy.double() * xhat.to(dtype).double()).sum(0)
    unrounded = (gy.double() * xhat.double()).sum(0)
    tol = 4e-6 * (gy.double().abs() * xhat.abs().double()).sum(0).max().item()  # fp32 accumulation
    assert (dg.double() - rounded).abs().max().item() < tol
    assert (unrounded - rounded).abs().max().item() > 5 * tol  # the check can tell the two apart
    if center:
        torch.testing.assert_close(db.double(), gy.double().sum(0), atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1024, 1000])
def test_streaming_path_matches_reference(dtype: torch.dtype, n: int) -> None:
    """Inputs over 8 MiB take the streaming path (next-row prefetch, non-temporal stores on line-aligned rows;
    n=1000 leaves most rows unaligned): forward, residual sum and backward still match the core."""
    rows = (9 << 20) // (n * torch.finfo(dtype).bits // 8) + 1
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(rows, n, generator=gen).to(dtype)
    r = torch.randn(rows, n, generator=gen).to(dtype)
    w = (torch.rand(n, generator=gen) + 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    for spec, bias in ((RMS, None), (LN, b)):
        xs, rs = x.clone().requires_grad_(True), r.clone().requires_grad_(True)
        y, h = fused_normalize(xs, spec, w, bias, residual=rs)
        torch.testing.assert_close(h, x + r, atol=0, rtol=0)
        torch.testing.assert_close(y, normalize(x + r, spec, w, bias), **TOL[dtype])
        gy = torch.randn(rows, n, generator=gen).to(dtype)
        (gx,) = torch.autograd.grad(y, [xs], gy)
        href = (x + r).float().requires_grad_(True)
        (gref,) = torch.autograd.grad(normalize(href, spec, w.float(), None if bias is None else bias.float()), [href],
                                      gy.float())  # fmt: skip
        torch.testing.assert_close(gx.float(), gref, **TOL[dtype])
        # the gain / bias gradients of the streaming backward (its partial sums, kept per thread), against float64
        xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        leaves = [xs, ws] + ([bias.clone().requires_grad_(True)] if bias is not None else [])
        got = torch.autograd.grad(fused_normalize(xs, spec, *leaves[1:]), leaves, gy)
        xd, wd = x.double().requires_grad_(True), w.double().requires_grad_(True)
        ref_leaves = [xd, wd] + ([bias.double().requires_grad_(True)] if bias is not None else [])
        want = torch.autograd.grad(normalize(xd, spec, *ref_leaves[1:]), ref_leaves, gy.double())
        for a, e, what in zip(got[1:], want[1:], ("dweight", "dbias"), strict=False):
            _close(a, e, dtype, what)  # returned in the parameter's dtype


@pytest.mark.parametrize("dres", [False, True], ids=["", "dres"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [100, 1024, 2051])
@pytest.mark.parametrize("name", ["rms", "rms_before_gain", "ln", "ln_before_gain"])
def test_backward_rows_are_batch_invariant(name: str, n: int, dtype: torch.dtype, dres: bool) -> None:
    """A row's dx is the same bits whether its batch takes the tiled backward (from cache) or the row-by-row one
    (inputs over 8 MiB), as its tile's first row, inside a tile or in the last, ragged one, with or without the
    residual's gradient added: both paths sum a row alike (bf16 in the lane order of its 16-element blocks) and give
    each element the same arithmetic."""
    ext = cpu.extension()
    if ext is None:
        pytest.skip("no C++ extension")
    spec = SPECS[name]
    rows = (9 << 20) // (2 * n * torch.finfo(dtype).bits // 8) + 1  # x and dy together over 8 MiB
    gen = torch.Generator().manual_seed(17)
    x, gy = (torch.randn(rows, n, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    dr = torch.randn(rows, n, generator=gen, dtype=torch.float64).to(dtype) if dres else None
    w, b = _params(spec, (n,), dtype, gen)
    center, before = spec.center, spec.cast_order is CastOrder.BEFORE_GAIN
    _, _, stats = ext.norm_fwd(x, None, w, b, spec.eps, center, 0, before, False, False, n)

    def dx(lo: int, hi: int) -> torch.Tensor:
        return ext.norm_bwd(gy[lo:hi], x[lo:hi], w, stats[lo:hi], None if dr is None else dr[lo:hi], center, before,
                            False, False, True, b is not None, n)[0]  # fmt: skip

    full = dx(0, rows)
    for lo, hi in ((0, 1), (5, 42), (rows - 19, rows)):
        assert torch.equal(full[lo:hi], dx(lo, hi)), (lo, hi)


@pytest.mark.parametrize("n", [1000, 1024])
def test_streaming_gain_gradients_on_one_thread(n: int) -> None:
    """On one thread the row-by-row backward sums the gain / bias gradients straight into the outputs (no per-chunk
    partial rows), bf16 kept in the lane order and put back at the end: still the float64 sums."""
    rows = (9 << 20) // (2 * n * 2) + 1
    gen = torch.Generator().manual_seed(19)
    x, gy = (torch.randn(rows, n, generator=gen).to(torch.bfloat16) for _ in range(2))
    w, b = (torch.rand(n, generator=gen) + 0.5).to(torch.bfloat16), torch.randn(n, generator=gen).to(torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for spec, bias in ((RMS, None), (LN, b)):
            leaves = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
            leaves += [bias.clone().requires_grad_(True)] if bias is not None else []
            got = torch.autograd.grad(fused_normalize(leaves[0], spec, *leaves[1:]), leaves, gy)
            ref_leaves = [t.double().requires_grad_(True) for t in (x, w, bias) if t is not None]
            want = torch.autograd.grad(normalize(ref_leaves[0], spec, *ref_leaves[1:]), ref_leaves, gy.double())
            for a, e, what in zip(got, want, ("dx", "dweight", "dbias"), strict=False):
                _close(a, e, torch.bfloat16, what)
    finally:
        torch.set_num_threads(threads)


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


_HUGE_PROBE = """
import torch
from pathlib import Path
from normatlas.kernels import cpu, fused_rms_norm


def vm_flags(address):
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return []


assert cpu.extension() is not None
x, w = torch.randn(4096, 4096), torch.rand(4096) + 0.5
y = fused_rms_norm(x, 4096, w, 1e-6)  # 64 MiB: in a new process, a new mapping
torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (4096,), w, 1e-6))
small = fused_rms_norm(x[:256], 4096, w, 1e-6)  # 4 MiB: under the 8 MiB threshold
interior = (y.data_ptr() + (2 << 20) - 1) & ~((2 << 20) - 1)
print("big", "hg" in vm_flags(interior), "small", "hg" in vm_flags(small.data_ptr()))
"""


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="needs transparent huge pages (madvise/always)")
@pytest.mark.parametrize("setting", [None, "0"], ids=["default", "NORMATLAS_HUGEPAGES=0"])
def test_fresh_large_outputs_get_huge_pages(setting: str | None) -> None:
    """A fresh output of >= 8 MiB asks for transparent huge pages before the first write; a small one does not.

    Run in a new process, where glibc gives a 64 MiB block a new mapping for certain (a long-lived process may hand
    back a free heap block, already mapped, which is rightly left alone). Checked by the advice on the mapping
    (VmFlags "hg"), not by the pages the kernel then found: a fragmented machine may fall back to 4 KiB pages.
    """
    if cpu.extension() is None:
        pytest.skip("no C++ toolchain")
    env = {k: v for k, v in os.environ.items() if k != "NORMATLAS_HUGEPAGES"}
    if setting is not None:
        env["NORMATLAS_HUGEPAGES"] = setting
    out = subprocess.run([sys.executable, "-c", _HUGE_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    want = "big True small False" if setting is None else "big False small False"
    assert out.stdout.split("\n")[-2] == want
