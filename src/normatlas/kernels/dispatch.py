"""Which specs the fused kernels serve, and the op arguments a spec maps to.

A spec is served when it normalizes each row of a channels-last tensor over its trailing
feature dims (``reduce == {Axis.FEATURE}``, no channel groups), with the RMS or L2 scale
(centred or not), a per-feature gain or none, an optional bias, any eps placement, and a cast
order the kernels reproduce exactly (``INPUT_DTYPE`` is served only where it equals float
compute, i.e. for float32 / float64 inputs; ``BEFORE_GAIN`` on half inputs needs the weight
and bias in the input dtype, as in HF's Llama). Masks and running statistics are not served.
:func:`unsupported` returns the reason, or None; :func:`backend` names the implementation
that will run on a device (``NORMATLAS_KERNELS=eager`` forces the eager fallback).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from ..spec import Axis, CastOrder, EpsPlacement, Gain, GainConvention, NormSpec, Scale

__all__ = ["KernelArgs", "backend", "kernel_args", "spec_unsupported", "unsupported"]

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_HALF = (torch.float16, torch.bfloat16)
_EPS_MODE = {EpsPlacement.INSIDE_SQRT: 0, EpsPlacement.OUTSIDE_SQRT: 1, EpsPlacement.CLAMP: 2}


@dataclass(frozen=True)
class KernelArgs:
    """The scalar arguments of ``normatlas::fused_norm_fwd`` for one spec and input dtype."""

    eps: float
    center: bool
    eps_mode: int
    before_gain: bool
    one_plus_w: bool
    l2: bool
    feature_ndim: int


def spec_unsupported(spec: NormSpec, dtype: torch.dtype) -> str | None:
    """Why the kernels cannot serve ``spec`` for inputs of ``dtype`` whatever their shape, or None."""
    if not spec.layout.channels_last or spec.reduce != frozenset({Axis.FEATURE}) or spec.groups != 1:
        return "the kernels normalize over the trailing feature dims only (reduce={FEATURE}, channels-last, groups=1)"
    if spec.scale is Scale.NONE:
        return "scale=Scale.NONE is not served"
    if spec.gain is Gain.SCALAR:
        return "gain=Gain.SCALAR is not served"
    if dtype not in _DTYPES:
        return f"input dtype {dtype} is not one of {_DTYPES}"
    if spec.cast_order is CastOrder.INPUT_DTYPE and dtype in _HALF:
        return "cast_order=INPUT_DTYPE on half inputs computes statistics in half precision; not served"
    return None


def unsupported(spec: NormSpec, input: Tensor, weight: Tensor | None = None, bias: Tensor | None = None) -> str | None:
    """Why the fused kernels cannot run ``spec`` on these tensors, or None when they can."""
    reason = spec_unsupported(spec, input.dtype)
    if reason is not None:
        return reason
    if input.dim() < spec.feature_ndim or any(s == 0 for s in input.shape[input.dim() - spec.feature_ndim :]):
        return "the feature dims must be present and non-empty"
    if spec.cast_order is CastOrder.BEFORE_GAIN:
        for name, t in (("weight", weight), ("bias", bias)):
            if t is not None and t.dtype != input.dtype:
                return f"cast_order=BEFORE_GAIN needs {name} in the input dtype (torch type promotion otherwise)"
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != input.device:
            return f"{name} is on {t.device}, input on {input.device}"
    return None


@functools.lru_cache(maxsize=512)
def kernel_args(spec: NormSpec, dtype: torch.dtype) -> KernelArgs:
    """Map a served spec to the op's scalar arguments (eps=None resolves to the compute dtype's eps)."""
    half = dtype in _HALF
    compute = torch.float32 if half and spec.cast_order is not CastOrder.INPUT_DTYPE else dtype
    eps = spec.eps if spec.eps is not None else float(torch.finfo(compute).eps)
    return KernelArgs(
        eps=float(eps),
        center=spec.center,
        eps_mode=_EPS_MODE[spec.eps_placement],
        before_gain=spec.cast_order is CastOrder.BEFORE_GAIN and half,
        one_plus_w=spec.gain_convention is GainConvention.ONE_PLUS_W,
        l2=spec.scale is Scale.L2,
        feature_ndim=spec.feature_ndim,
    )


def backend(device: torch.device | str = "cpu") -> str:
    """The implementation the ops use on ``device``: ``cpp``, ``triton`` or ``eager``."""
    dev = torch.device(device)
    if os.environ.get("NORMATLAS_KERNELS", "auto").lower() == "eager":
        return "eager"
    if dev.type == "cpu":
        from . import cpu

        return "cpp" if cpu.extension() is not None else "eager"
    if dev.type == "cuda":
        from . import triton_kernels

        return "triton" if triton_kernels.available() else "eager"
    return "eager"
