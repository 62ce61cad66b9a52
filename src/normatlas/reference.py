"""The reference arithmetic of any :class:`~normatlas.spec.NormSpec`: what :func:`normatlas.functional.normalize`
computes where the fused kernels do not serve the spec, and what the kernels fall back to (:mod:`normatlas.kernels`).

The arithmetic is the essay's four lines: statistics over the reduced axes,
optional centring, division by the scale statistic (with eps where the spec puts
it), and the affine map back. Where a native torch kernel computes exactly the
same function (``F.layer_norm``, ``F.group_norm``, ``F.batch_norm``) it is used;
the generic path serves every other spec, including masked statistics and
running estimates, so BatchNorm-style layers are presets rather than a second
implementation.

The generic path keeps the op order of the HF reference RMSNorms
(``x * rsqrt(mean(x^2) + eps)``), so it is bit-for-bit equal to them when the
cast order matches.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .spec import Axis, CastOrder, EpsPlacement, Gain, GainConvention, NormSpec, Scale

__all__ = [
    "Plan",
    "check_batch_values",
    "check_float_params",
    "check_spec_params",
    "compute_dtype",
    "feature_shape",
    "moments",
    "reference_normalize",
    "resolve",
]

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Plan:
    """A spec resolved against a concrete input shape.

    ``view`` is the grouped shape the statistics are computed in (or None when no
    channel groups), ``reduce_dims`` index that view, ``feature_dims`` index the
    input, and ``param_view`` is the shape per-feature parameters and running
    statistics take to broadcast against the input.
    """

    view: tuple[int, ...] | None
    reduce_dims: tuple[int, ...]
    feature_dims: tuple[int, ...]
    param_view: tuple[int, ...]


@functools.lru_cache(maxsize=1024)
def resolve(spec: NormSpec, shape: tuple[int, ...]) -> Plan:
    """Map the spec's axis roles onto the dims of an input of ``shape``."""
    ndim = len(shape)
    layout = spec.layout
    if layout.ndim is not None and ndim != layout.ndim:
        raise ValueError(f"input of shape {tuple(shape)} has {ndim} dims; layout={layout.value!r} needs {layout.ndim}")
    if layout.channels_last:
        if ndim < spec.feature_ndim:
            raise ValueError(f"input of shape {tuple(shape)} has fewer dims than feature_ndim={spec.feature_ndim}")
        feature = tuple(range(ndim - spec.feature_ndim, ndim))
        sample: tuple[int, ...] = (0,) if ndim > spec.feature_ndim else ()
        position = tuple(range(len(sample), feature[0]))
    else:
        if ndim < 2:
            raise ValueError(
                f"input of shape {tuple(shape)} needs at least 2 dims (N, C, ...) for layout={layout.value!r}"
            )
        feature, sample, position = (1,), (0,), tuple(range(2, ndim))
    roles = {Axis.SAMPLE: sample, Axis.FEATURE: feature, Axis.POSITION: position}
    param_view = tuple(shape[d] for d in feature) if layout.channels_last else (shape[1],) + (1,) * (ndim - 2)

    view: tuple[int, ...] | None = None
    if spec.groups > 1:
        c = shape[feature[0]]
        if c % spec.groups:
            raise ValueError(f"groups={spec.groups} must divide the number of channels, {c}")
        f = feature[0]
        view = (*tuple(shape[:f]), spec.groups, c // spec.groups, *tuple(shape[f + 1 :]))
        # the channel axis splits into (group, channel-in-group); dims after it shift by one
        shift = {d: (d + 1 if d > f else d) for d in range(ndim)}
        roles = {
            Axis.SAMPLE: tuple(shift[d] for d in sample),
            Axis.FEATURE: (f + 1,),
            Axis.POSITION: tuple(shift[d] for d in position),
        }
    reduce_dims = tuple(sorted(d for axis in spec.reduce for d in roles[axis]))
    return Plan(view=view, reduce_dims=reduce_dims, feature_dims=feature, param_view=param_view)


def feature_shape(spec: NormSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of per-feature parameters and running statistics for an input of ``shape``."""
    return tuple(shape[d] for d in resolve(spec, shape).feature_dims)


def compute_dtype(dtype: torch.dtype, cast_order: CastOrder) -> torch.dtype:
    """The dtype statistics are computed in: at least float32 unless ``INPUT_DTYPE``."""
    if cast_order is CastOrder.INPUT_DTYPE or dtype not in _HALF:
        return dtype
    return torch.float32


def reference_normalize(
    input: Tensor,
    spec: NormSpec,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    mask: Tensor | None = None,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
) -> Tensor:
    """:func:`normatlas.functional.normalize` on the reference path (its arguments but ``backend``)."""
    _check(input, spec, weight, bias, mask, running_mean, running_var)
    # under torch.compile trace resolve's body, not its cache (dynamo warns on every cached call it traces)
    plan = (resolve.__wrapped__ if torch.compiler.is_compiling() else resolve)(spec, tuple(input.shape))
    _check_params(input, spec, plan, weight, bias, running_mean, running_var)
    if training or running_var is None:
        check_batch_values(input, spec, plan)
    return _compute(input, spec, plan, weight, bias, mask, running_mean, running_var, training, momentum)


def check_float_params(*named: tuple[str, Tensor | None]) -> None:
    """Raise a TypeError naming the first given (name, tensor) that is not a floating-point tensor (None passes)."""
    for name, t in named:
        if t is not None and not (isinstance(t, Tensor) and t.is_floating_point()):
            got = f"dtype {t.dtype}" if isinstance(t, Tensor) else f"type {type(t).__name__}"
            raise TypeError(f"{name} has {got}; it must be a floating-point tensor")


def check_spec_params(spec: NormSpec, weight: Tensor | None, bias: Tensor | None) -> None:
    """Raise a ValueError for a weight given to a spec without a gain, or a bias to a spec without one.

    (Dropping it would silently compute another function than the caller meant; applying it another than the spec.)
    """
    if weight is not None and spec.gain is Gain.NONE:
        raise ValueError(
            f"weight was given (shape {tuple(weight.shape)}) but the spec has gain=Gain.NONE; pass weight=None, "
            "or use a spec with gain=Gain.PER_FEATURE or Gain.SCALAR"
        )
    if bias is not None and not spec.bias:
        raise ValueError(
            f"bias was given (shape {tuple(bias.shape)}) but the spec has bias=False; pass bias=None, "
            "or use a spec with bias=True"
        )


def _check(
    input: Tensor,
    spec: NormSpec,
    weight: Tensor | None,
    bias: Tensor | None,
    mask: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
) -> None:
    if not isinstance(input, Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if not input.is_floating_point():
        raise TypeError(f"input has dtype {input.dtype}; normalization needs a floating-point tensor")
    if not isinstance(spec, NormSpec):
        raise TypeError(f"spec must be a NormSpec, got {type(spec).__name__}")
    check_float_params(("weight", weight), ("bias", bias), ("running_mean", running_mean), ("running_var", running_var))
    check_spec_params(spec, weight, bias)
    if weight is None and spec.gain_convention is GainConvention.ONE_PLUS_W and spec.gain is not Gain.NONE:
        raise ValueError("gain_convention=ONE_PLUS_W needs the weight tensor; got weight=None")
    if mask is not None and mask.dtype is not torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = use in statistics), got dtype {mask.dtype}")
    if (running_mean is None) != (running_var is None) and spec.center:
        raise ValueError("running_mean and running_var must be given together for a centred spec")
    if running_var is not None and Axis.FEATURE in spec.reduce:
        raise ValueError("running statistics are per feature; they need a spec that does not reduce over Axis.FEATURE")
    if running_var is not None and spec.scale is not Scale.RMS:
        raise ValueError(f"running statistics need scale=Scale.RMS, got {spec.scale}")


def _check_params(
    input: Tensor,
    spec: NormSpec,
    plan: Plan,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
) -> None:
    fshape = tuple(input.shape[d] for d in plan.feature_dims)
    expected = {"weight": () if spec.gain is Gain.SCALAR else fshape, "bias": fshape}
    expected["running_mean"] = expected["running_var"] = fshape
    for name, t in (("weight", weight), ("bias", bias), ("running_mean", running_mean), ("running_var", running_var)):
        if t is not None and tuple(t.shape) != expected[name]:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}; an input of shape {tuple(input.shape)} in layout "
                f"{spec.layout.value!r} needs {expected[name]}"
            )


def check_batch_values(input: Tensor, spec: NormSpec, plan: Plan) -> None:
    """Centred batch statistics of a single value per feature are 0 / 0: raise as ``F.batch_norm`` does.

    (Its output would be all zeros and its variance, 0, would drag the running estimate toward 0.)
    """
    if Axis.SAMPLE not in spec.reduce or not spec.center:
        return
    view = plan.view if plan.view is not None else tuple(input.shape)
    if math.prod(view[d] for d in plan.reduce_dims) == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {input.size()}: batch "
            f"statistics over dims {plan.reduce_dims} (reduce={{{', '.join(sorted(a.value for a in spec.reduce))}}}) "
            "need at least 2 values per feature"
        )


def _resolved_eps(spec: NormSpec, dtype: torch.dtype) -> float:
    return spec.eps if spec.eps is not None else float(torch.finfo(dtype).eps)


def _compute(
    x: Tensor,
    spec: NormSpec,
    plan: Plan,
    weight: Tensor | None,
    bias: Tensor | None,
    mask: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool,
    momentum: float,
) -> Tensor:
    """Dispatch to a torch kernel that computes exactly the same function where there is one, else the generic path."""
    use_batch = training or running_var is None
    # a torch kernel computes exactly this where the spec has its eps placement, gain and casts (it computes
    # half-precision inputs in fp32 and casts after the affine map) and every parameter has the input's dtype
    native = (
        mask is None and spec.center and spec.scale is Scale.RMS and spec.eps_placement is EpsPlacement.INSIDE_SQRT
        and spec.gain_convention is GainConvention.W and spec.gain is not Gain.SCALAR
        and (spec.cast_order is CastOrder.AFTER_GAIN or x.dtype not in _HALF)
    )  # fmt: skip
    for t in (weight, bias, running_mean, running_var) if native else ():
        if t is not None and t.dtype != x.dtype:
            native = False
    if native:
        eps = _resolved_eps(spec, compute_dtype(x.dtype, spec.cast_order))
        reduce = spec.reduce
        if spec.layout.channels_last and reduce == {Axis.FEATURE} and spec.groups == 1:
            return F.layer_norm(x, x.shape[x.ndim - spec.feature_ndim :], weight, bias, eps)
        if not spec.layout.channels_last and x.numel() != 0:
            if running_var is None and reduce == {Axis.FEATURE, Axis.POSITION}:
                return F.group_norm(x, spec.groups, weight, bias, eps)
            if reduce == {Axis.POSITION} and x.ndim > 2:
                return F.instance_norm(x, running_mean, running_var, weight, bias, use_batch, momentum, eps)
            if reduce == {Axis.SAMPLE, Axis.POSITION} or (reduce == {Axis.SAMPLE} and x.ndim == 2):
                return F.batch_norm(x, running_mean, running_var, weight, bias, use_batch, momentum, eps)
    in_dtype = x.dtype
    cdtype = compute_dtype(in_dtype, spec.cast_order)
    eps = _resolved_eps(spec, cdtype)
    xf = x.to(cdtype)
    if plan.view is not None:
        xf = xf.reshape(plan.view)
    if mask is not None:
        mask = mask.expand(x.shape)
        if plan.view is not None:
            mask = mask.reshape(plan.view)

    # the generic path: the core's statistics, eps where the spec puts it, the affine map back
    if running_var is not None and not training:
        ms = running_var.to(cdtype).reshape(plan.param_view)
        xc = xf - running_mean.to(cdtype).reshape(plan.param_view) if spec.center and running_mean is not None else xf
    else:
        mean, xc, ms, count = moments(xf, spec, plan.reduce_dims, mask)
        if running_var is not None:
            _update_running(spec, plan, mean, ms, count, running_mean, running_var, momentum)

    if spec.scale is Scale.NONE:
        y = xc
    elif spec.eps_placement is EpsPlacement.INSIDE_SQRT:
        y = xc * torch.rsqrt(ms + eps)
    elif spec.eps_placement is EpsPlacement.OUTSIDE_SQRT:
        y = xc / (ms.sqrt() + eps)
    else:
        y = xc / ms.sqrt().clamp_min(eps)
    if plan.view is not None:
        y = y.reshape(x.shape)
    return _affine(y, spec, plan, weight, bias, in_dtype, cdtype)


def moments(
    xf: Tensor, spec: NormSpec, dims: tuple[int, ...], mask: Tensor | None
) -> tuple[Tensor | None, Tensor, Tensor, Tensor | int]:
    """The core's statistics of ``xf`` over ``dims``: ``(mean, centred values, mean square, count)``.

    Only ``spec.center`` and ``spec.scale`` are read: the mean is None without centring, and the
    mean square becomes the sum of squares for ``Scale.L2``. With ``mask`` (of ``xf``'s full shape:
    expand a broadcastable mask first, or the count is wrong) only the True positions count, and
    ``count`` is a tensor (clamped to 1 as a divisor); without it, an int. Computed in ``xf``'s
    dtype (callers pass fp32 or fp64).
    """
    if mask is None:
        count: Tensor | int = 1
        for d in dims:
            count *= xf.shape[d]
        mean = xf.mean(dims, keepdim=True) if spec.center else None
        xc = xf - mean if mean is not None else xf
        sq = xc.pow(2)
        ms = sq.sum(dims, keepdim=True) if spec.scale is Scale.L2 else sq.mean(dims, keepdim=True)
        return mean, xc, ms, count
    m = mask.to(xf.dtype)
    count = m.sum(dims, keepdim=True)
    denom = count.clamp_min(1)
    mean = (xf * m).sum(dims, keepdim=True) / denom if spec.center else None
    xc = xf - mean if mean is not None else xf
    sq = (xc.pow(2) * m).sum(dims, keepdim=True)
    return mean, xc, (sq if spec.scale is Scale.L2 else sq / denom), count


@torch.no_grad()
def _update_running(
    spec: NormSpec,
    plan: Plan,
    mean: Tensor | None,
    ms: Tensor,
    count: Tensor | int,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    momentum: float,
) -> None:
    """Blend the batch statistics into the running estimates (torch's momentum convention)."""
    assert running_var is not None
    total = count.sum() if isinstance(count, Tensor) else count * ms.numel()
    if float(total) == 0:
        return  # nothing observed (an empty batch, or everything masked): keep the estimates
    other = tuple(d for d in range(ms.ndim) if d not in plan.feature_dims)
    var = ms
    if spec.center:
        n = count if isinstance(count, Tensor) else torch.tensor(float(count), dtype=ms.dtype)
        var = ms * n / (n - 1).clamp_min(1)  # unbiased, as torch stores it
    fshape = running_var.shape
    running_var.mul_(1 - momentum).add_(var.mean(other).reshape(fshape).to(running_var.dtype), alpha=momentum)
    if spec.center and running_mean is not None and mean is not None:
        running_mean.mul_(1 - momentum).add_(mean.mean(other).reshape(fshape).to(running_mean.dtype), alpha=momentum)


def _multiplier(weight: Tensor, spec: NormSpec, dtype: torch.dtype) -> Tensor:
    w = weight.to(dtype)
    return 1.0 + w if spec.gain_convention is GainConvention.ONE_PLUS_W else w


def _affine(
    y: Tensor,
    spec: NormSpec,
    plan: Plan,
    weight: Tensor | None,
    bias: Tensor | None,
    in_dtype: torch.dtype,
    cdtype: torch.dtype,
) -> Tensor:
    """The affine map back, in the cast order the spec asks for."""
    pview = () if spec.gain is Gain.SCALAR else plan.param_view
    if spec.cast_order is CastOrder.BEFORE_GAIN:
        # Llama: weight * x_hat.to(input_dtype), with torch's type promotion
        y = y.to(in_dtype)
        if weight is not None and spec.gain is not Gain.NONE:
            y = _multiplier(weight, spec, weight.dtype).reshape(pview) * y
        if bias is not None:
            y = y + bias.reshape(plan.param_view)
        return y
    if weight is not None and spec.gain is not Gain.NONE:
        y = y * _multiplier(weight, spec, cdtype).reshape(pview)
    if bias is not None:
        y = y + bias.to(cdtype).reshape(plan.param_view)
    return y.to(in_dtype)
