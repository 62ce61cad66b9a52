"""The fused normalization as two ``torch.library`` custom ops with a fake and an autograd formula.

``normatlas::fused_norm_fwd(x, residual, weight, bias, eps, center, eps_mode, before_gain,
one_plus_w, l2) -> (y, h, stats)`` normalizes the last dim of ``x`` (or of ``h = x + residual``,
also returned): centring for LayerNorm, the root mean square (or L2 norm) as the scale, eps
inside / outside the sqrt or as a clamp, the gain ``w`` or ``1 + w`` applied after or before the
cast back, and an optional bias. ``stats`` holds per-row ``(mean, rstd, d rstd / d ms)`` in the
accumulation dtype. ``normatlas::fused_norm_bwd`` computes dx (plus the gradient flowing into
``h``), dgain and dbias in one pass over x and dy.

On CPU in eager mode the public functions skip these ops altogether: they call the C++
extension's ``norm`` entry, whose forward and backward (a ``torch::autograd::Function``) run
without a Python frame; the custom ops are what ``torch.compile`` traces.

Guaranteed: the same function as :func:`normatlas.functional.normalize` for the specs that
:mod:`normatlas.kernels.dispatch` accepts, within the dtype's rounding. Both ops carry fake
(meta) implementations with symbolic shapes, so they trace under ``torch.compile(fullgraph=True,
dynamic=True)`` without graph breaks or per-shape recompilation. Implementations: the C++
extension on CPU, Triton on CUDA, and an eager torch fallback everywhere else.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .dispatch import Impl, implementation

__all__ = ["bwd_impl", "eager_bwd", "eager_fwd", "fused_norm", "fused_norm_bwd", "fused_norm_fwd", "fwd_impl"]

INSIDE, OUTSIDE, CLAMP = 0, 1, 2
DOUBLE_BACKWARD = "normatlas fused norm: double backward (create_graph=True) is not supported on the eager path"
_HALF = (torch.float16, torch.bfloat16)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _gain(weight: Tensor | None, n: int, dtype: torch.dtype, before_gain: bool, one_plus_w: bool, device) -> Tensor:
    """The multiplier in the accumulation dtype (for ``before_gain``: rounded in the weight dtype first)."""
    acc = _acc(dtype)
    if weight is None:
        return torch.ones(n, dtype=acc, device=device)
    w = weight.reshape(-1)
    if before_gain:
        return ((1 + w) if one_plus_w else w).to(acc).contiguous()
    w = w.to(acc)
    return (1.0 + w if one_plus_w else w).contiguous()


def _scale(ms: Tensor, eps: float, eps_mode: int) -> tuple[Tensor, Tensor]:
    if eps_mode == INSIDE:
        r = torch.rsqrt(ms + eps)
        return r, -0.5 * r.pow(3)
    s = ms.sqrt()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    if eps_mode == OUTSIDE:
        r = 1.0 / (s + eps)
        return r, torch.where(s > 0, -0.5 * r * r / safe, torch.zeros_like(s))
    r = 1.0 / s.clamp_min(eps)
    return r, torch.where((s >= eps) & (s > 0), -0.5 / safe.pow(3), torch.zeros_like(s))


def eager_fwd(
    x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None, eps: float,
    center: bool, eps_mode: int, before_gain: bool, one_plus_w: bool, l2: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The reference arithmetic of the fused op in plain torch (the fallback without a compiler).

    Every output is contiguous, whatever the strides of ``x`` (as from the C++ and Triton kernels and the fake).
    """
    n = x.shape[-1]
    h = (x + residual).contiguous() if residual is not None else x.new_empty(0)
    src = (h if residual is not None else x).reshape(-1, n).contiguous()
    acc = _acc(x.dtype)
    xf = src.to(acc)
    mean = xf.mean(-1, keepdim=True) if center else torch.zeros_like(xf[:, :1])
    xc = xf - mean
    ms = xc.pow(2).sum(-1, keepdim=True) / (1 if l2 else n)
    r, drdms = _scale(ms, eps, eps_mode)
    g = _gain(weight, n, x.dtype, before_gain, one_plus_w, x.device)
    if before_gain:
        y = (xc * r).to(x.dtype).to(acc) * g
        y = y.to(x.dtype)
        if bias is not None:
            y = (y.to(acc) + bias.reshape(-1).to(acc)).to(x.dtype)
    else:
        y = xc * r * g
        if bias is not None:
            y = y + bias.reshape(-1).to(acc)
        y = y.to(x.dtype)
    stats = torch.cat([mean, r, drdms], dim=1)
    return y.reshape(x.shape), h, stats


def eager_bwd(
    dy: Tensor, x: Tensor, weight: Tensor | None, stats: Tensor, dres: Tensor | None,
    center: bool, before_gain: bool, one_plus_w: bool, l2: bool, need_dg: bool, need_db: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Hand-written backward in plain torch: the same formula as the C++ and Triton kernels (dx contiguous)."""
    n = x.shape[-1]
    acc = _acc(x.dtype)
    xf = x.reshape(-1, n).contiguous().to(acc)
    dyf = dy.reshape(-1, n).contiguous().to(acc)
    mean, r, drdms = stats[:, :1], stats[:, 1:2], stats[:, 2:3]
    g = _gain(weight, n, x.dtype, before_gain, one_plus_w, x.device)
    xc = xf - mean
    dxh = dyf * g
    k = drdms * 2.0 / (1 if l2 else n) * (dxh * xc).sum(-1, keepdim=True)
    dx = r * dxh + k * xc
    if center:
        dx = dx - dx.mean(-1, keepdim=True)
    if dres is not None:
        dx = dx + dres.reshape(-1, n).to(acc)
    xhat = xc * r
    if before_gain:
        xhat = xhat.to(x.dtype).to(acc)
    dg = (dyf * xhat).sum(0) if need_dg else dyf.new_empty(0)
    db = dyf.sum(0) if need_db else dyf.new_empty(0)
    return dx.to(x.dtype).reshape(x.shape).contiguous(), dg, db


def fwd_impl(
    x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None, eps: float,
    center: bool, eps_mode: int, before_gain: bool, one_plus_w: bool, l2: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The forward on this device's implementation (:func:`~.dispatch.implementation`: C++, Triton or eager)."""
    impl, handle = implementation(x.device)
    if impl is Impl.CPP:
        y, h, stats = handle.norm_fwd(x, residual, weight, bias, float(eps), center, eps_mode, before_gain,
                                      one_plus_w, l2, x.shape[-1])  # fmt: skip
        return y, h, stats
    if impl is Impl.TRITON:
        return handle.norm_fwd(x, residual, weight, bias, eps, center, eps_mode, before_gain, one_plus_w, l2)
    return eager_fwd(x, residual, weight, bias, eps, center, eps_mode, before_gain, one_plus_w, l2)


@torch.library.custom_op("normatlas::fused_norm_fwd", mutates_args=())
def fused_norm_fwd(
    x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None, eps: float,
    center: bool, eps_mode: int, before_gain: bool, one_plus_w: bool, l2: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return fwd_impl(x, residual, weight, bias, eps, center, eps_mode, before_gain, one_plus_w, l2)


# The fakes allocate contiguous outputs (not ``empty_like``, which keeps a transposed input's strides): every real
# implementation (C++, Triton, eager) returns y, h and dx contiguous, and inductor asserts the fake's strides.
@fused_norm_fwd.register_fake
def _(x, residual, weight, bias, eps, center, eps_mode, before_gain, one_plus_w, l2):
    rows = math.prod(x.shape[:-1])
    h = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    return x.new_empty(x.shape), h, x.new_empty((rows, 3), dtype=_acc(x.dtype))


def bwd_impl(
    dy: Tensor, x: Tensor, weight: Tensor | None, stats: Tensor, dres: Tensor | None,
    center: bool, before_gain: bool, one_plus_w: bool, l2: bool, need_dg: bool, need_db: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The backward on this device's implementation (:func:`~.dispatch.implementation`: C++, Triton or eager)."""
    impl, handle = implementation(x.device)
    if impl is Impl.CPP:
        dx, dg, db = handle.norm_bwd(dy, x, weight, stats, dres, center, before_gain, one_plus_w, l2, need_dg,
                                     need_db, x.shape[-1])  # fmt: skip
        return dx, dg, db
    args = (dy, x, weight, stats, dres, center, before_gain, one_plus_w, l2, need_dg, need_db)
    return handle.norm_bwd(*args) if impl is Impl.TRITON else eager_bwd(*args)


@torch.library.custom_op("normatlas::fused_norm_bwd", mutates_args=())
def fused_norm_bwd(
    dy: Tensor, x: Tensor, weight: Tensor | None, stats: Tensor, dres: Tensor | None,
    center: bool, before_gain: bool, one_plus_w: bool, l2: bool, need_dg: bool, need_db: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return bwd_impl(dy, x, weight, stats, dres, center, before_gain, one_plus_w, l2, need_dg, need_db)


@fused_norm_bwd.register_fake
def _(dy, x, weight, stats, dres, center, before_gain, one_plus_w, l2, need_dg, need_db):
    acc = _acc(x.dtype)
    n = x.shape[-1]
    dg = x.new_empty((n,) if need_dg else (0,), dtype=acc)
    db = x.new_empty((n,) if need_db else (0,), dtype=acc)
    return x.new_empty(x.shape), dg, db


def _setup_context(ctx, inputs, output) -> None:
    x, residual, weight, bias, _eps, center, _eps_mode, before_gain, one_plus_w, l2 = inputs
    _, h, stats = output
    ctx.save_for_backward(h if residual is not None else x, weight, stats)
    ctx.flags = (center, before_gain, one_plus_w, l2)
    ctx.has_residual = residual is not None
    ctx.has_bias = bias is not None
    ctx.bias_meta = (bias.dtype, bias.shape) if bias is not None else None


def _backward(ctx, dy, dh, dstats, bwd=fused_norm_bwd):
    src, weight, stats = ctx.saved_tensors
    center, before_gain, one_plus_w, l2 = ctx.flags
    need_dg = weight is not None and ctx.needs_input_grad[2]
    need_db = ctx.has_bias and ctx.needs_input_grad[3]
    dres = dh if ctx.has_residual and dh is not None else None
    dx, dg, db = bwd(
        dy.contiguous(), src, weight, stats, dres, center, before_gain, one_plus_w, l2, need_dg, need_db
    )  # fmt: skip
    dweight = dg.to(weight.dtype).reshape(weight.shape) if need_dg else None
    dbias = db.to(ctx.bias_meta[0]).reshape(ctx.bias_meta[1]) if need_db else None
    dresidual = dx if ctx.has_residual else None
    return dx, dresidual, dweight, dbias, None, None, None, None, None, None


fused_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerFn(torch.autograd.Function):
    """The same forward / backward without the dispatcher round trip (eager mode only)."""

    @staticmethod
    def forward(ctx, *inputs):  # type: ignore[override]
        out = fwd_impl(*inputs)
        _setup_context(ctx, inputs, out)
        ctx.mark_non_differentiable(out[2])
        return out

    @staticmethod
    def backward(ctx, dy, dh, dstats):  # type: ignore[override]
        # The backward is hand-written with the saved statistics as constants: differentiated again it would give
        # wrong second derivatives, so refuse create_graph=True as the C++ Function does (NormFn, csrc/norm_ops.cpp).
        if torch.is_grad_enabled():
            raise RuntimeError(DOUBLE_BACKWARD)
        return _backward(ctx, dy, dh, dstats, bwd=bwd_impl)


def fused_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None, eps: float,
    center: bool, eps_mode: int, before_gain: bool, one_plus_w: bool, l2: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The fused norm: the custom op under torch.compile, a direct call (or autograd.Function) in eager.

    Eager calls skip the dispatcher's Python round trip (about 20 us a call on a small CPU),
    which matters for cache-resident and short-row (QK-norm) inputs.
    """
    args = (x, residual, weight, bias, eps, center, eps_mode, before_gain, one_plus_w, l2)
    if torch.compiler.is_compiling():
        return fused_norm_fwd(*args)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, residual, weight, bias))
    if not grad:
        return fwd_impl(*args)
    return _EagerFn.apply(*args)
