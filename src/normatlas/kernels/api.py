"""Fused normalization entry points: spec-driven, torch.nn-named, and residual-add variants.

``fused_normalize(input, spec, weight, bias, residual=None)`` runs any spec through the fused kernels when
:func:`~normatlas.kernels.dispatch.route` (the one dispatch point) finds a kernel for it, and through the core's
reference arithmetic (:mod:`normatlas.reference`, what :func:`normatlas.functional.normalize` computes there)
otherwise, so it always computes the spec's function. The engine sits below :mod:`normatlas.functional`, which
dispatches to it. With ``residual`` it returns ``(normalize(input + residual), input + residual)``: the pre-norm
transformer's add & norm in one pass (Xiong et al., 2020 place the norm on the residual branch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..reference import check_float_params, reference_normalize
from ..spec import CastOrder, EpsPlacement, Gain, GainConvention, NormSpec, Scale
from .dispatch import Kernel, Mode, Route, kernel_args, qk_route, route, subclass_refusal
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


def _waited(t: Tensor) -> Tensor:
    """A plain tensor for the C++ kernels: an ``AsyncCollectiveTensor`` (DTensor's pending collective) waited on."""
    wait = getattr(t, "wait", None) if type(t) is not Tensor else None
    return wait() if callable(wait) else t


class _Plain(torch.autograd.Function):
    """Identity whose forward and backward hand the C++ kernels plain tensors: a DTensor's local shard, or the
    gradient flowing back into it, can be a pending collective's wrapper with no storage of its own."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        plain = _waited(x)
        return plain.view_as(plain)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return _waited(grad)


def _on_local_shards(
    input: Tensor, spec: NormSpec, weight: Tensor | None, bias: Tensor | None, fshape: tuple[int, ...] | None,
    fused: bool,
) -> Tensor | None:  # fmt: skip
    """The kernels on a DTensor's local shard (:data:`Kernel.LOCAL_SHARDS <.dispatch.Kernel>`), or None where the
    local shard is not a plain tensor or the kernels decline it there.

    A norm reduces over its trailing (feature) dims only, so on a DTensor sharded on leading dims (batch,
    sequence: the sequence-parallel regions of :mod:`normatlas.distributed`) with replicated weight and bias the
    global result's local shard is the kernel's result on the local shard. The weight and bias enter as local
    views whose gradients are ``Partial`` over the mesh dims the input is sharded on (each rank saw its own rows)
    and ``Replicate`` elsewhere: the gradients DTensor's reference path would give. Nothing communicates here.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    assert isinstance(input, DTensor)
    grad_placements = [Partial() if isinstance(p, Shard) else Replicate() for p in input.placements]
    local = [t.to_local(grad_placements=grad_placements) if isinstance(t, DTensor) else None for t in (weight, bias)]
    x = input.to_local()
    if type(x) is not Tensor:
        x = _Plain.apply(x)
    if type(x) is not Tensor:
        return None
    out = drop_in(x, spec, local[0], local[1], fshape, fused)
    if out is None:
        return None
    return DTensor.from_local(
        _Plain.apply(out), input.device_mesh, input.placements, run_check=False, shape=input.shape,
        stride=input.stride(),
    )  # fmt: skip


def drop_in(
    input: Tensor, spec: NormSpec, weight: Tensor | None, bias: Tensor | None, fshape: tuple[int, ...] | None,
    fused: bool,
) -> Tensor | None:  # fmt: skip
    """The forward of a core module or :func:`normalize` on the fused kernels, or None where the reference path
    runs, as :func:`~.dispatch.route` decides: ``fused=False`` is ``Backend.AUTO`` (kernels that are ready, outside
    ``torch.compile``, torch.func transforms and :func:`normatlas.backend.reference_only`),
    ``fused=True`` ``Backend.FUSED`` (compile the kernels if needed; a spec or input they cannot serve raises)."""
    r = route(spec, input, weight, bias, mode=Mode.FUSED if fused else Mode.AUTO, fshape=fshape)
    if r.kernel is Kernel.LOCAL_SHARDS:
        local = _on_local_shards(input, spec, weight, bias, fshape, fused)
        if local is None and fused:
            raise ValueError(subclass_refusal(input))
        return local
    if r.kernel is Kernel.PLAN:
        out = r.handle(input, None, weight, bias, fshape)  # the C++ plan checks shapes, dtypes, devices
        if out is not None:
            return out[0]
        r = route(spec, input, weight, bias, mode=Mode.FUSED if fused else Mode.AUTO, fshape=fshape, declined=True)
    if r.kernel is Kernel.REFERENCE:
        return None
    if fshape is not None:
        _check_shape(input, fshape)
    _check_params(input, spec, weight, bias)
    return _run(r, input, spec, weight, bias, None)[0]


def _run(
    r: Route, input: Tensor, spec: NormSpec, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Run a ``Kernel.CPP`` or ``Kernel.OP`` route."""
    compiling = torch.compiler.is_compiling()
    a = (kernel_args.__wrapped__ if compiling else kernel_args)(spec, input.dtype)  # dynamo: no lru_cache to trace
    k = a.feature_ndim
    lead = input.shape[: input.dim() - k]
    n = 1
    for d in input.shape[input.dim() - k :]:
        n *= d
    w = weight.reshape(-1) if weight is not None else None
    b = bias.reshape(-1) if bias is not None else None
    if r.kernel is Kernel.CPP:
        y, h = r.handle.norm(input, residual, w, b, a.eps, a.center, a.eps_mode, a.before_gain, a.one_plus_w, a.l2, n)
        return y, h
    flat = (*lead, n)
    x = input.reshape(flat)
    res = residual.reshape(flat) if residual is not None else None
    y, h, _ = fused_norm(x, res, w, b, a.eps, a.center, a.eps_mode, a.before_gain, a.one_plus_w, a.l2)
    return y.reshape(input.shape), (h.reshape(input.shape) if residual is not None else h)


def fused_normalize(
    input: Tensor,
    spec: NormSpec,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """``normalize(input, spec, weight, bias)`` on the fused path; with ``residual``, ``(y, input + residual)``."""
    y, h = direct(spec, input, residual, weight, bias, None, None)
    return (y, h) if residual is not None else y


def direct(
    spec: NormSpec, input: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None,
    fshape: tuple[int, ...] | None, check_shape: Callable[[Tensor], None] | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The kernels' own functions and modules (``Mode.DIRECT``): ``(y, h)``, ``h = input + residual`` (an empty
    tensor without a residual). ``fshape`` goes to the plan's checks; ``check_shape`` (the caller's, in its words)
    runs where the plan declines."""
    r = route(spec, input, weight, bias, mode=Mode.DIRECT)
    if r.kernel is Kernel.PLAN:
        out = r.handle(input, residual, weight, bias, fshape)
        if out is not None:
            return out[0], out[1]
    if check_shape is not None:
        check_shape(input)
    if residual is not None and residual.shape != input.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}; input has {tuple(input.shape)}")
    if residual is not None and residual.dtype != input.dtype:
        raise TypeError(f"residual has dtype {residual.dtype}; input has {input.dtype}")
    if r.kernel is Kernel.PLAN:
        r = route(spec, input, weight, bias, mode=Mode.DIRECT, declined=True)
    if r.kernel is not Kernel.REFERENCE:
        _check_params(input, spec, weight, bias)
        return _run(r, input, spec, weight, bias, residual)
    if residual is None:
        return reference_normalize(input, spec, weight, bias), input.new_empty(0)
    h = input + residual
    return reference_normalize(h, spec, weight, bias), h


def _check_params(input: Tensor, spec: NormSpec, weight: Tensor | None, bias: Tensor | None) -> None:
    fshape = tuple(input.shape[input.dim() - spec.feature_ndim :])
    check_float_params(("weight", weight), ("bias", bias))
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != fshape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}; an input of shape {tuple(input.shape)} needs {fshape}"
            )
    if weight is None and spec.gain_convention is GainConvention.ONE_PLUS_W:
        raise ValueError("gain_convention=ONE_PLUS_W needs the weight tensor; got weight=None")


def _shape(normalized_shape: Shape) -> tuple[int, ...]:
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


def _check_shape(input: Tensor, fshape: tuple[int, ...]) -> None:
    got = tuple(input.shape[max(0, input.dim() - len(fshape)) :])
    if got != fshape:
        raise ValueError(f"normalized_shape={list(fshape)} does not match the input's trailing dims {list(got)} "
                         f"(input shape {tuple(input.shape)})")  # fmt: skip


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


def _call(
    make: Any, key: tuple[Any, ...], fshape: tuple[int, ...], input: Tensor, residual: Tensor | None,
    weight: Tensor | None, bias: Tensor | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Run the spec ``make(*key)`` (an lru_cache'd builder) through :func:`direct`.

    Under torch.compile the builder's body is traced instead of its cache (dynamo warns on each cached call it
    traces, and a compiled graph builds the spec once anyway), so eager calls keep the cache and one compile check.
    """
    spec = make.__wrapped__(*key) if torch.compiler.is_compiling() else make(*key)
    return direct(spec, input, residual, weight, bias, fshape, lambda x: _check_shape(x, fshape))


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
    fshape = _shape(normalized_shape)
    key = (len(fshape), eps, cast_order, gain_convention, eps_placement, weight is not None)
    return _call(_rms_spec, key, fshape, input, None, weight, None)[0]


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
    fshape = _shape(normalized_shape)
    key = (len(fshape), eps, cast_order, eps_placement, weight is not None, bias is not None)
    return _call(_ln_spec, key, fshape, input, None, weight, bias)[0]


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
    fshape = _shape(normalized_shape)
    key = (len(fshape), eps, cast_order, gain_convention, eps_placement, weight is not None)
    y, h = _call(_rms_spec, key, fshape, input, residual, weight, None)
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
    fshape = _shape(normalized_shape)
    key = (len(fshape), eps, cast_order, eps_placement, weight is not None, bias is not None)
    y, h = _call(_ln_spec, key, fshape, input, residual, weight, bias)
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
    """QK-norm (OLMo 2, Qwen3, Gemma 3): RMSNorm over the head dim of q and k, many short rows each.

    Without autograd (inference, decoding) on CPU, for up to 2M elements in all, the rows of q and k are
    normalised in one launch (``norm_pair``: one parallel region split over both tensors' rows; what it saves
    over two calls is measured by ``python benchmarks/bench_qk.py``, in docs/kernels.md); otherwise, or when q
    and k differ in head dim or dtype, two fused calls. Both paths compute the same values, bit for bit.
    ``q_weight`` has shape ``(q.shape[-1],)`` and ``k_weight`` ``(k.shape[-1],)``.
    """
    d = q.shape[-1]
    r = qk_route(q, k, q_weight, k_weight, eps, cast_order)
    if r.kernel is Kernel.PAIR:
        yq, yk = r.handle.pair(q, k, q_weight, k_weight, d)
        return yq, yk
    check_float_params(("q_weight", q_weight), ("k_weight", k_weight))  # the C++ pair names them; so do two calls
    for name, w, t, what in (("q_weight", q_weight, q, "q"), ("k_weight", k_weight, k, "k")):
        if w is not None and tuple(w.shape) != (t.shape[-1],):
            raise ValueError(f"{name} has shape {tuple(w.shape)}; {what} of shape {tuple(t.shape)} needs "
                             f"({t.shape[-1]},) (one gain per element of the head dim)")  # fmt: skip
    return (
        fused_rms_norm(q, d, q_weight, eps, cast_order=cast_order),
        fused_rms_norm(k, k.shape[-1], k_weight, eps, cast_order=cast_order),
    )
