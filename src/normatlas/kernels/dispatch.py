"""The one dispatch point of the fused kernels: which kernel runs a norm, if any, and the handles to run it.

Every way into the kernels (:func:`normatlas.normalize` and the core modules through
:func:`normatlas.kernels.api.drop_in`, the kernels' own functions and modules, QK-norm) asks :func:`route` (or
:func:`qk_route`) and gets a typed :class:`Route`: the :class:`Kernel` that runs, why, and the handle it runs with.
The decision reads the :class:`Mode` (``Backend.AUTO``, ``Backend.FUSED``, or the kernels' own functions), the
device, the dtype, the shape, whether autograd is needed and whether the kernels are built. No other module imports
the compiled entry points (:mod:`.cpu`'s extension, :mod:`.triton_kernels`); the fused op (:mod:`.ops`) asks
:func:`implementation` which of them runs on a device (tests/test_architecture.py holds both rules).

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

import enum
import functools
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..backend import _REFERENCE_ONLY
from ..reference import check_float_params, check_spec_params
from ..spec import Axis, CastOrder, EpsPlacement, Gain, GainConvention, NormSpec, Scale
from . import cpu

__all__ = [
    "Impl",
    "Kernel",
    "KernelArgs",
    "Mode",
    "Route",
    "backend",
    "build_info",
    "describe",
    "ensure_built",
    "implementation",
    "kernel_args",
    "plan",
    "qk_route",
    "ready",
    "route",
    "spec_unsupported",
    "subclass_refusal",
    "unsupported",
]


class Kernel(enum.Enum):
    """What runs a norm."""

    REFERENCE = "reference"  # no kernel: the core's reference arithmetic (normatlas.reference)
    PLAN = "plan"  # the cached C++ plan: one pybind11 call, which declines (None) an input its checks find unusual
    PAIR = "pair"  # the C++ plan's QK pair: the rows of q and k in one launch (inference on CPU)
    SPLIT = "split"  # QK-norm as two fused calls, q and k each routed on its own
    CPP = "cpp"  # the C++ extension's checked entry (``norm``), with its own autograd Function
    OP = "op"  # the fused op (normatlas::fused_norm_fwd): torch.compile's trace, Triton, or the eager transcription
    LOCAL_SHARDS = "local-shards"  # a DTensor sharded on its leading dims: the kernels on its local shard


class Mode(enum.Enum):
    """Who asks: the backend of a core norm, or the kernels' own functions."""

    AUTO = "auto"  # Backend.AUTO: the kernels that are ready, never compiling; the reference where they do not serve
    FUSED = "fused"  # Backend.FUSED: the kernels, built if needed; what they cannot serve raises a ValueError
    DIRECT = "direct"  # fused_normalize, fused_rms_norm, ...: built if needed; what they cannot serve: the reference


class Route(NamedTuple):
    """The decision: the kernel, why (for the reference: why not a kernel), and its handle (the plan for PLAN and
    PAIR, the extension for CPP; None otherwise)."""

    kernel: Kernel
    reason: str = ""
    handle: Any = None


class Impl(enum.Enum):
    """The implementation behind the fused op on one device."""

    CPP = "cpp"
    TRITON = "triton"
    EAGER = "eager"


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


def build_info() -> dict[str, Any]:
    """How the C++ CPU kernels were obtained, never compiling (see :func:`normatlas.kernels.cpu.build_info`)."""
    return cpu.build_info()


def ensure_built() -> dict[str, Any]:
    """Build (or load) the C++ CPU kernels now and return :func:`build_info`; RuntimeError when they cannot be."""
    return cpu.ensure_built()


def ready(device: torch.device) -> bool:
    """Whether the fused kernels run natively on ``device`` without compiling anything: the built C++ extension
    on CPU, Triton on CUDA. (Otherwise the fused ops run their eager transcription.)"""
    if device.type == "cpu":
        return cpu.loaded() is not None
    if device.type == "cuda":
        from . import triton_kernels

        return triton_kernels.available()
    return False


def implementation(device: torch.device) -> tuple[Impl, Any]:
    """What runs the fused op's forward and backward on ``device``, with its module: the C++ extension on CPU (built
    if needed), Triton on CUDA where it is installed, the eager transcription (no module) otherwise."""
    if device.type == "cpu":
        ext = cpu.extension()
        if ext is not None:
            return Impl.CPP, ext
    elif device.type == "cuda":
        from . import triton_kernels

        if triton_kernels.available():
            return Impl.TRITON, triton_kernels
    return Impl.EAGER, None


# One C++ plan (csrc/norm_ops.h) per (spec, input dtype): the kernel's scalar arguments bound once, so an eager call
# costs a dict lookup and one pybind11 call, whose checks (device, shapes, dtypes) return None for anything unusual; the
# caller then routes again with ``declined=True``, to the checked path that raises the informative error or falls back.
_PLANS: dict[Any, Any] = {}


def plan(spec: NormSpec, dtype: torch.dtype, build: bool = True) -> Any:
    """The cached plan, or None. With ``build=False`` (``Backend.AUTO``) nothing is compiled: without a built
    extension the answer is None and not cached, so a later build is picked up."""
    key = (spec, dtype)
    try:
        return _PLANS[key]
    except KeyError:
        pass
    ext = cpu.extension() if build else cpu.loaded()
    if ext is None and not build:
        return None
    made = None
    if ext is not None and spec_unsupported(spec, dtype) is None:
        a = kernel_args(spec, dtype)
        made = ext.Plan(
            spec.feature_ndim, spec.gain is not Gain.NONE, spec.gain_convention is GainConvention.ONE_PLUS_W,
            spec.cast_order is CastOrder.BEFORE_GAIN, a.eps, a.center, a.eps_mode, a.before_gain, a.one_plus_w, a.l2,
        )  # fmt: skip
    if len(_PLANS) > 1024:
        _PLANS.clear()
    _PLANS[key] = made
    return made


_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def _refuse_absent_params(spec: NormSpec, weight: Tensor | None, bias: Tensor | None) -> None:
    """A weight for a spec without a gain, or a bias for one without a bias, raises (the C++ plan would drop it)."""
    if (weight is not None and spec.gain is Gain.NONE) or (bias is not None and not spec.bias):
        check_float_params(("weight", weight), ("bias", bias))
        check_spec_params(spec, weight, bias)


def subclass_refusal(input: Tensor) -> str:
    """The ValueError message of ``backend='fused'`` on a tensor subclass the kernels cannot run."""
    return (
        f"backend='fused' cannot run on this {type(input).__name__} (the kernels take a DTensor sharded only "
        "on its leading dims, with replicated weight and bias); use backend='auto' or 'reference'"
    )


def _shards_unserved(input: Tensor, spec: NormSpec, weight: Tensor | None, bias: Tensor | None) -> str | None:
    """Why the kernels cannot run this tensor subclass on its local shard, or None (a DTensor sharded only on its
    leading dims, with weight and bias replicated DTensors on the same mesh)."""
    if not torch.distributed.is_available():
        return "torch.distributed is not available"
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(input, DTensor):
        return f"a {type(input).__name__} has no storage for the kernels"
    lead = input.dim() - spec.feature_ndim
    for p in input.placements:
        if not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim % input.dim() < lead)):
            return "a Partial input, or one sharded on the normalized dims: the statistics need the engine"
    for t in (weight, bias):
        if t is None:
            continue
        if not isinstance(t, DTensor) or t.device_mesh != input.device_mesh:
            return "weight and bias must be DTensors on the input's mesh"
        if not all(isinstance(p, Replicate) for p in t.placements):
            return "weight and bias must be replicated"
    return None


def route(
    spec: NormSpec, input: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, *, mode: Mode,
    fshape: tuple[int, ...] | None = None, declined: bool = False,
) -> Route:  # fmt: skip
    """Which kernel runs ``spec`` on ``input`` (with ``weight`` and ``bias``) for ``mode``.

    ``fshape`` is a core module's normalized shape (a mismatch routes to the reference, whose check raises in the
    module's words). ``declined=True`` asks again after the plan declined the input: the checked path decides.
    ``Mode.FUSED`` raises a ValueError naming why where the kernels cannot serve the norm; a weight or bias the spec
    has no place for raises in every mode.
    """
    fused = mode is not Mode.AUTO
    if (
        mode is not Mode.DIRECT
        and type(input) is not Tensor
        and torch._C._dispatch_keys(input).has(torch._C.DispatchKey.Python)
    ):
        # a subclass with its own dispatch (DTensor, FakeTensor) has no storage for the C++ plan: a DTensor sharded
        # only on the leading dims runs the kernels on its local shard, anything else the reference path
        reason = _shards_unserved(input, spec, weight, bias)
        if reason is None:
            return Route(Kernel.LOCAL_SHARDS)
        if mode is Mode.FUSED:
            raise ValueError(subclass_refusal(input))
        return Route(Kernel.REFERENCE, reason)
    compiling = torch.compiler.is_compiling()
    if mode is Mode.AUTO and (compiling or _REFERENCE_ONLY[0] or _functorch_active()):
        # AUTO traces the reference path (the compiler fuses it), shows its ops to the recorder, and under
        # torch.func transforms (vmap, grad, jacrev) runs the ops they have rules for (a C++ autograd Function has none)
        return Route(Kernel.REFERENCE, "torch.compile, a torch.func transform or reference_only()")
    if not declined:
        _refuse_absent_params(spec, weight, bias)
        found = None if compiling else plan(spec, input.dtype, fused)
        if found is not None:
            return Route(Kernel.PLAN, "the cached C++ plan", found)
    if (
        mode is not Mode.DIRECT
        and fshape is not None
        and tuple(input.shape[max(0, input.dim() - len(fshape)) :]) != fshape
    ):
        return Route(Kernel.REFERENCE, "the input does not match the module's shape (its own check raises)")
    reason = unsupported(spec, input, weight, bias)
    if reason is not None:
        if mode is Mode.FUSED:
            raise ValueError(f"backend='fused' cannot run this norm: {reason}; use backend='auto' or 'reference'")
        return Route(Kernel.REFERENCE, reason)
    if mode is Mode.AUTO and not ready(input.device):
        return Route(Kernel.REFERENCE, f"the kernels are not ready on {input.device} (never compiled under auto)")
    ext = cpu.extension() if input.is_cpu and not compiling else None
    if ext is not None:
        return Route(Kernel.CPP, "the C++ extension's checked entry", ext)
    return Route(Kernel.OP, "the fused op")


# Above this the launch overhead saved (~3 us) is noise and two calls stream each tensor on its own.
_PAIR_MAX_ELEMENTS = 1 << 21


@functools.lru_cache(maxsize=64)
def _qk_spec(eps: float | None, cast_order: CastOrder, affine: bool) -> NormSpec:
    return NormSpec(
        feature_ndim=1, center=False, scale=Scale.RMS, eps=eps, eps_placement=EpsPlacement.INSIDE_SQRT,
        cast_order=cast_order, gain=Gain.PER_FEATURE if affine else Gain.NONE, bias=False,
    )  # fmt: skip


def qk_route(
    q: Tensor, k: Tensor, q_weight: Tensor | None, k_weight: Tensor | None, eps: float | None, cast_order: CastOrder
) -> Route:
    """QK-norm's route: ``Kernel.PAIR`` (q and k in one launch: CPU, no autograd, one head dim and dtype, at most
    2M elements) with the plan, else ``Kernel.SPLIT`` (two calls, each routed by :func:`route`)."""
    d = q.shape[-1]
    tensors = [t for t in (q, k, q_weight, k_weight) if t is not None]
    if torch.compiler.is_compiling():
        return Route(Kernel.SPLIT, "torch.compile")
    if k.shape[-1] != d or d == 0 or k.dtype != q.dtype or (q_weight is None) != (k_weight is None):
        return Route(Kernel.SPLIT, "q and k differ in head dim, dtype or gains (or the head dim is empty)")
    if not all(t.is_cpu for t in tensors):
        return Route(Kernel.SPLIT, "the pair runs on CPU only")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return Route(Kernel.SPLIT, "autograd is needed (the pair is inference only)")
    if q.numel() + k.numel() > _PAIR_MAX_ELEMENTS:
        return Route(Kernel.SPLIT, f"more than {_PAIR_MAX_ELEMENTS} elements in all")
    for w in (q_weight, k_weight):
        if w is not None and (w.shape != (d,) or (cast_order is CastOrder.BEFORE_GAIN and w.dtype != q.dtype)):
            return Route(Kernel.SPLIT, "a gain of another shape, or of another dtype under BEFORE_GAIN")
    found = plan(_qk_spec(eps, cast_order, q_weight is not None), q.dtype)
    if found is None:
        return Route(Kernel.SPLIT, "no C++ plan for this spec and dtype")
    return Route(Kernel.PAIR, "q and k in one launch", found)


def describe(spec: NormSpec, device: torch.device, dtype: torch.dtype, fused: bool) -> str:
    """What a core module's forward runs for inputs of ``dtype`` on ``device`` and why, after the backend's name:
    ``fused (cpp, from cache)``, ``reference (the C++ kernels are not built; ...)``, ``fused (triton)`` ..."""
    reason = spec_unsupported(spec, dtype)
    if reason is not None:
        return f"reference ({reason})"
    if device.type == "cpu":
        ext = cpu.extension(build=False)
        info = cpu.build_info()
        if ext is not None:
            return f"fused (cpp, {'from cache' if info.get('source') == 'cache' else 'built now'})"
        if fused and info.get("reason", "").startswith("the C++ kernels are not built"):
            return "fused (cpp, compiled on the first call)"
        return (
            "fused (eager transcription: " if fused else "reference ("
        ) + f"{info.get('reason', 'kernels unavailable')})"
    return "fused (triton)" if ready(device) else "reference (no kernels for this device)"
