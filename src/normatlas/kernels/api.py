"""Fused normalization entry points: spec-driven, torch.nn-named, and residual-add variants.

``fused_normalize(input, spec, weight, bias, residual=None)`` runs any spec through the fused
kernels when :func:`~normatlas.kernels.dispatch.unsupported` allows it and through the core's
:func:`normatlas.functional.normalize` otherwise, so it always computes the spec's function.
With ``residual`` it returns ``(normalize(input + residual), input + residual)``: the pre-norm
transformer's add & norm in one pass (Xiong et al., 2020 place the norm on the residual branch).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from torch import Tensor

from ..functional import normalize
from ..spec import CastOrder, EpsPlacement, Gain, GainConvention, NormSpec, Scale
from .dispatch import kernel_args, unsupported
from .ops import fused_norm

__all__ = [
    "fused_add_layer_norm",
    "fused_add_rms_norm",
    "fused_layer_norm",
    "fused_normalize",
    "fused_rms_norm",
    "qk_rms_norm",
]

Shape = int | Sequence[int]


def _run(
    input: Tensor, spec: NormSpec, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None
) -> tuple[Tensor, Tensor]:
    a = kernel_args(spec, input.dtype)
    k = a.feature_ndim
    lead = input.shape[: input.dim() - k]
    n = 1
    for d in input.shape[input.dim() - k :]:
        n *= d
    flat = (*lead, n)
    x = input.reshape(flat)
    r = residual.reshape(flat) if residual is not None else None
    w = weight.reshape(-1) if weight is not None and spec.gain is not Gain.NONE else None
    b = bias.reshape(-1) if bias is not None else None
    y, h, _ = fused_norm(x, r, w, b, a.eps, a.center, a.eps_mode, a.before_gain, a.one_plus_w, a.l2)
    return y.reshape(input.shape), (h.reshape(input.shape) if residual is not None else h)


def fused_normalize(
    input: Tensor,
    spec: NormSpec,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """``normalize(input, spec, weight, bias)`` on the fused path; with ``residual``, ``(y, input + residual)``."""
    if residual is not None and residual.shape != input.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}; input has {tuple(input.shape)}")
    if residual is not None and residual.dtype != input.dtype:
        raise TypeError(f"residual has dtype {residual.dtype}; input has {input.dtype}")
    if unsupported(spec, input, weight, bias) is None:
        _check_params(input, spec, weight, bias)
        y, h = _run(input, spec, weight, bias, residual)
        return (y, h) if residual is not None else y
    if residual is None:
        return normalize(input, spec, weight, bias)
    h = input + residual
    return normalize(h, spec, weight, bias), h


def _check_params(input: Tensor, spec: NormSpec, weight: Tensor | None, bias: Tensor | None) -> None:
    fshape = tuple(input.shape[input.dim() - spec.feature_ndim :])
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != fshape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}; an input of shape {tuple(input.shape)} needs {fshape}"
            )
    if weight is None and spec.gain_convention is GainConvention.ONE_PLUS_W:
        raise ValueError("gain_convention=ONE_PLUS_W needs the weight tensor; got weight=None")


def _shape(normalized_shape: Shape) -> tuple[int, ...]:
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


@functools.lru_cache(maxsize=256)
def _rms_spec(
    k: int, eps: float | None, cast_order: CastOrder, gain_convention: GainConvention, eps_placement: EpsPlacement,
    affine: bool,
) -> NormSpec:  # fmt: skip
    return NormSpec(
        feature_ndim=k, center=False, scale=Scale.RMS, eps=eps, eps_placement=eps_placement, cast_order=cast_order,
        gain=Gain.PER_FEATURE if affine else Gain.NONE, gain_convention=gain_convention, bias=False,
    )  # fmt: skip


@functools.lru_cache(maxsize=256)
def _ln_spec(k: int, eps: float, cast_order: CastOrder, eps_placement: EpsPlacement, affine: bool, bias: bool):
    return NormSpec(
        feature_ndim=k, eps=eps, eps_placement=eps_placement, cast_order=cast_order,
        gain=Gain.PER_FEATURE if affine else Gain.NONE, bias=bias,
    )  # fmt: skip


def fused_rms_norm(
    input: Tensor,
    normalized_shape: Shape,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    cast_order: CastOrder = CastOrder.AFTER_GAIN,
    gain_convention: GainConvention = GainConvention.W,
    eps_placement: EpsPlacement = EpsPlacement.INSIDE_SQRT,
) -> Tensor:
    """``F.rms_norm`` (same arguments and defaults) on the fused path, plus the spec's knobs."""
    spec = _rms_spec(len(_shape(normalized_shape)), eps, cast_order, gain_convention, eps_placement, weight is not None)
    out = fused_normalize(input, spec, weight)
    assert isinstance(out, Tensor)
    return out


def fused_layer_norm(
    input: Tensor,
    normalized_shape: Shape,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    cast_order: CastOrder = CastOrder.AFTER_GAIN,
    eps_placement: EpsPlacement = EpsPlacement.INSIDE_SQRT,
) -> Tensor:
    """``F.layer_norm`` (same arguments and defaults) on the fused path."""
    spec = _ln_spec(len(_shape(normalized_shape)), eps, cast_order, eps_placement, weight is not None, bias is not None)
    out = fused_normalize(input, spec, weight, bias)
    assert isinstance(out, Tensor)
    return out


def fused_add_rms_norm(
    input: Tensor,
    residual: Tensor,
    normalized_shape: Shape,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    cast_order: CastOrder = CastOrder.AFTER_GAIN,
    gain_convention: GainConvention = GainConvention.W,
    eps_placement: EpsPlacement = EpsPlacement.INSIDE_SQRT,
) -> tuple[Tensor, Tensor]:
    """``(rms_norm(input + residual), input + residual)`` in one pass over memory."""
    spec = _rms_spec(len(_shape(normalized_shape)), eps, cast_order, gain_convention, eps_placement, weight is not None)
    y, h = fused_normalize(input, spec, weight, residual=residual)
    return y, h


def fused_add_layer_norm(
    input: Tensor,
    residual: Tensor,
    normalized_shape: Shape,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    cast_order: CastOrder = CastOrder.AFTER_GAIN,
    eps_placement: EpsPlacement = EpsPlacement.INSIDE_SQRT,
) -> tuple[Tensor, Tensor]:
    """``(layer_norm(input + residual), input + residual)`` in one pass over memory."""
    spec = _ln_spec(len(_shape(normalized_shape)), eps, cast_order, eps_placement, weight is not None, bias is not None)
    y, h = fused_normalize(input, spec, weight, bias, residual=residual)
    return y, h


def qk_rms_norm(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor | None,
    k_weight: Tensor | None,
    eps: float | None = 1e-6,
    *,
    cast_order: CastOrder = CastOrder.AFTER_GAIN,
) -> tuple[Tensor, Tensor]:
    """QK-norm (OLMo 2, Qwen3, Gemma 3): RMSNorm over the head dim of q and k, many short rows each."""
    d = q.shape[-1]
    return (
        fused_rms_norm(q, d, q_weight, eps, cast_order=cast_order),
        fused_rms_norm(k, k.shape[-1], k_weight, eps, cast_order=cast_order),
    )
