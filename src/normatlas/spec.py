"""The normalization spec: every named layer is one of these values.

The essay's thesis is that every normalization layer is the same arithmetic

    y = gain * (x - mean) / scale + bias

pointed at different slices of the tensor. A :class:`NormSpec` names the slice
(which axes of a named :class:`Layout` are reduced, and channel groups) and each
step of the arithmetic as an explicit, typed, orthogonal field: centring,
the scale statistic, eps and where it sits, the precision and cast order, and
the affine map back with its gain convention.

Enums are used inside the library; strings appear only at the CLI and in data
files (see :func:`parse_enum`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

__all__ = [
    "Axis",
    "CastOrder",
    "EpsPlacement",
    "Gain",
    "GainConvention",
    "Layout",
    "NormSpec",
    "Scale",
    "parse_enum",
]


class _SpecEnum(enum.Enum):
    """The spec's enums: members hash by identity (their equality already is identity), not by ``Enum.__hash__``'s
    Python-level ``hash(self._name_)``, which cost ~0.15 us a member in the keys the fused functions look up on every
    call (``fused_rms_norm``'s has three)."""

    __hash__ = object.__hash__


class Axis(_SpecEnum):
    """A role an axis plays in the essay's ``x[n, c, s]`` block."""

    SAMPLE = "sample"  # n: the batch axis (N in NCHW, B in BTD)
    FEATURE = "feature"  # c: channels (C) or features (D)
    POSITION = "position"  # s: spatial axes (H, W, ...) or tokens (T)


class Layout(_SpecEnum):
    """A named tensor layout: where the sample, feature and position axes are.

    Channels-first layouts (vision) put the feature axis at dim 1 and positions
    after it; channels-last layouts (sequences, NHWC) put the feature axes last.
    ``NC...`` and ``N...C`` accept any number of position axes.
    """

    NC_ANY = "NC..."
    NC = "NC"
    NCL = "NCL"
    NCHW = "NCHW"
    NCDHW = "NCDHW"
    N_ANY_C = "N...C"
    BD = "BD"
    BTD = "BTD"
    NLC = "NLC"
    NHWC = "NHWC"
    NDHWC = "NDHWC"

    @property
    def channels_last(self) -> bool:
        return self in _CHANNELS_LAST

    @property
    def ndim(self) -> int | None:
        """The rank this layout requires, or None for the open-ended ones."""
        return None if "..." in self.value else len(self.value)


_CHANNELS_LAST = frozenset({Layout.N_ANY_C, Layout.BD, Layout.BTD, Layout.NLC, Layout.NHWC, Layout.NDHWC})


class Scale(_SpecEnum):
    """The statistic the (centred) values are divided by."""

    RMS = "rms"  # sqrt(mean(x^2)): the standard deviation when centred
    L2 = "l2"  # sqrt(sum(x^2)): the Euclidean norm (F.normalize, ScaleNorm)
    NONE = "none"  # no division (mean-only normalization)


class EpsPlacement(_SpecEnum):
    """Where eps enters the denominator (essay: "Where eps sits")."""

    INSIDE_SQRT = "inside_sqrt"  # x / sqrt(ms + eps)          LayerNorm, RMSNorm
    OUTSIDE_SQRT = "outside_sqrt"  # x / (sqrt(ms) + eps)      some older code, timm variants
    CLAMP = "clamp"  # x / max(sqrt(ms), eps)                  F.normalize, ScaleNorm


class CastOrder(_SpecEnum):
    """Precision of the statistics and where the result returns to the input dtype.

    Statistics are computed in at least float32 except under ``INPUT_DTYPE``.
    """

    AFTER_GAIN = "after_gain"  # (x_hat * g + b).to(dtype): torch.nn, Gemma
    BEFORE_GAIN = "before_gain"  # g * x_hat.to(dtype) + b: Llama / HF LlamaRMSNorm
    INPUT_DTYPE = "input_dtype"  # everything in the input dtype (explicit opt-in)


class Gain(_SpecEnum):
    """Shape of the learned gain."""

    NONE = "none"
    PER_FEATURE = "per_feature"  # one per channel, or elementwise over normalized_shape
    SCALAR = "scalar"  # a single learned scalar (ScaleNorm)


class GainConvention(_SpecEnum):
    """How the stored gain parameter maps to the multiplier."""

    W = "w"  # multiplier = w, w initialised at 1
    ONE_PLUS_W = "1+w"  # multiplier = 1 + w, w initialised at 0 (Gemma, zero-centred gamma)


E = TypeVar("E", bound=enum.Enum)


def parse_enum(enum_type: type[E], value: str | E, *, name: str) -> E:
    """Turn a string from the CLI or a data file into an enum member, or raise ValueError."""
    if isinstance(value, enum_type):
        return value
    for member in enum_type:
        if isinstance(value, str) and value.lower() in (member.value.lower(), member.name.lower()):
            return member
    allowed = ", ".join(repr(m.value) for m in enum_type)
    raise ValueError(f"{name}={value!r} is not a valid {enum_type.__name__}; allowed: {allowed}")


def _require_enum(value: object, enum_type: type[enum.Enum], name: str) -> None:
    if not isinstance(value, enum_type):
        members = ", ".join(f"{enum_type.__name__}.{m.name}" for m in enum_type)
        raise TypeError(f"{name}={value!r} must be a {enum_type.__name__} ({members})")


@dataclass(frozen=True)
class NormSpec:
    """A normalization layer as a value. Validated at construction.

    Attributes:
        layout: the named layout the reduction axes refer to.
        reduce: the axis roles the statistics are computed over.
        feature_ndim: how many trailing dims form the feature axis in a channels-last
            layout (``len(normalized_shape)`` for torch's LayerNorm); 1 for channels-first.
        groups: channel groups; the feature axis is split into ``groups`` and statistics
            are per group (GroupNorm). Requires ``Axis.FEATURE`` in ``reduce``.
        center: subtract the mean first (LayerNorm) or not (RMSNorm).
        scale: the statistic divided by.
        eps: the epsilon; ``None`` means the machine epsilon of the compute dtype
            (torch.nn.RMSNorm's default).
        eps_placement: where eps enters the denominator.
        cast_order: compute precision and where the output is cast back.
        gain: shape of the learned gain.
        gain_convention: ``w`` or ``1 + w``.
        bias: whether a learned bias is added after the gain.
    """

    layout: Layout = Layout.N_ANY_C
    reduce: frozenset[Axis] = field(default_factory=lambda: frozenset({Axis.FEATURE}))
    feature_ndim: int = 1
    groups: int = 1
    center: bool = True
    scale: Scale = Scale.RMS
    eps: float | None = 1e-5
    eps_placement: EpsPlacement = EpsPlacement.INSIDE_SQRT
    cast_order: CastOrder = CastOrder.AFTER_GAIN
    gain: Gain = Gain.PER_FEATURE
    gain_convention: GainConvention = GainConvention.W
    bias: bool = True
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __hash__(self) -> int:  # cached: specs key the plan caches on every call
        return self._hash

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # pickled (and copied) as its constructor's arguments, so that __post_init__ validates and hashes it again in
        # the process that loads it: the cached hash of another process (its str and enum hashes) would make an equal
        # spec miss every dict and set lookup there
        return (type(self), tuple(getattr(self, f.name) for f in fields(self) if f.init))

    def __post_init__(self) -> None:
        _require_enum(self.layout, Layout, "layout")
        if isinstance(self.reduce, (set, list, tuple)):
            object.__setattr__(self, "reduce", frozenset(self.reduce))
        if not isinstance(self.reduce, frozenset) or not self.reduce:
            raise ValueError(f"reduce={self.reduce!r} must be a non-empty set of Axis members")
        for axis in self.reduce:
            _require_enum(axis, Axis, "reduce")
        for name in ("feature_ndim", "groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.feature_ndim != 1 and not self.layout.channels_last:
            raise ValueError(
                f"feature_ndim={self.feature_ndim} needs a channels-last layout; "
                f"layout={self.layout.value!r} has a single channel axis at dim 1"
            )
        if self.layout.ndim is not None and self.feature_ndim >= self.layout.ndim:
            raise ValueError(f"feature_ndim={self.feature_ndim} leaves no sample axis in layout={self.layout.value!r}")
        if self.groups > 1 and Axis.FEATURE not in self.reduce:
            raise ValueError(f"groups={self.groups} needs Axis.FEATURE in reduce={_axes(self.reduce)}")
        if self.groups > 1 and self.feature_ndim != 1:
            raise ValueError(f"groups={self.groups} needs feature_ndim=1, got {self.feature_ndim}")
        if not isinstance(self.center, bool) or not isinstance(self.bias, bool):
            raise TypeError(f"center={self.center!r} and bias={self.bias!r} must be bool")
        _require_enum(self.scale, Scale, "scale")
        _require_enum(self.eps_placement, EpsPlacement, "eps_placement")
        _require_enum(self.cast_order, CastOrder, "cast_order")
        _require_enum(self.gain, Gain, "gain")
        _require_enum(self.gain_convention, GainConvention, "gain_convention")
        if self.eps is not None:
            if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)):
                raise TypeError(f"eps={self.eps!r} must be a float > 0 or None")
            if not (math.isfinite(self.eps) and self.eps > 0):
                raise ValueError(f"eps={self.eps!r} must be a finite float > 0 (or None for machine eps)")
        if self.gain_convention is GainConvention.ONE_PLUS_W and self.gain is Gain.NONE:
            raise ValueError("gain_convention=GainConvention.ONE_PLUS_W needs a gain (gain is Gain.NONE)")
        if self.scale is Scale.NONE and not self.center:
            raise ValueError("scale=Scale.NONE with center=False normalizes nothing")
        knobs = (self.eps_placement, self.cast_order, self.gain, self.gain_convention, self.bias)
        axes = (self.layout, self.reduce, self.feature_ndim, self.groups, self.center, self.scale, self.eps)
        object.__setattr__(self, "_hash", hash((axes, knobs)))

    @property
    def batch_dependent(self) -> bool:
        """True when the forward pass of one example depends on the others (the essay's right-hand column)."""
        return Axis.SAMPLE in self.reduce

    @property
    def statistic(self) -> str:
        """The name of the divisor: std, rms, l2 norm of the centred values, or none."""
        if self.scale is Scale.RMS:
            return "std" if self.center else "rms"
        if self.scale is Scale.L2:
            return "centred l2 norm" if self.center else "l2 norm"
        return "none"

    def with_(self, **changes: object) -> NormSpec:
        """A copy with some fields changed (and validated again)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON-ready values (enums as their ``value``, ``reduce`` sorted); :meth:`from_dict` inverts it."""
        return {
            "layout": self.layout.value,
            "reduce": sorted(a.value for a in self.reduce),
            "feature_ndim": self.feature_ndim,
            "groups": self.groups,
            "center": self.center,
            "scale": self.scale.value,
            "eps": self.eps,
            "eps_placement": self.eps_placement.value,
            "cast_order": self.cast_order.value,
            "gain": self.gain.value,
            "gain_convention": self.gain_convention.value,
            "bias": self.bias,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NormSpec:
        """A spec from :meth:`to_dict`'s form (a data file, a surgery manifest); missing keys take the defaults.

        Raises ``ValueError`` naming an unknown key or a value that is not one of its enum's, and
        validates the result like the constructor.
        """
        if not isinstance(d, Mapping):
            raise TypeError(f"d={d!r} must be a mapping of NormSpec fields")
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown NormSpec field(s) {unknown}; allowed: {sorted(known)}")
        kw: dict[str, Any] = dict(d)
        for name, enum_type in _SPEC_ENUMS.items():
            if name in kw:
                kw[name] = parse_enum(enum_type, kw[name], name=name)
        if "reduce" in kw:
            kw["reduce"] = frozenset(parse_enum(Axis, a, name="reduce") for a in kw["reduce"])
        return cls(**kw)


_SPEC_ENUMS: dict[str, type[enum.Enum]] = {
    "layout": Layout,
    "scale": Scale,
    "eps_placement": EpsPlacement,
    "cast_order": CastOrder,
    "gain": Gain,
    "gain_convention": GainConvention,
}


def _axes(axes: frozenset[Axis]) -> str:
    return "{" + ", ".join(sorted(a.value for a in axes)) + "}"
