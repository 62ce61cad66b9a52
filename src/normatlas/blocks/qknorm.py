"""QK-norm and QKV-norm: normalize queries and keys (and values) inside attention.

QK-norm (Henry et al., 2020; Dehghani et al., ViT-22B 2023; OLMo 2, Qwen 3, Gemma 3)
bounds the attention logits ``q.k / sqrt(d)`` by normalizing ``q`` and ``k`` over
the head dim. The variants real models ship differ in four orthogonal choices,
each a field of :class:`QKNormConfig`:

* operator, in the design vocabulary's :class:`~normatlas.vocabulary.Operator`: ``Operator.RMSNORM``
  (Qwen 3, Gemma 3, OLMo 2), ``Operator.L2`` (unit vectors, cosine attention) or ``Operator.LAYERNORM``
  (Cohere, ViT-22B) (:data:`QK_OPERATORS`);
* scope: per head over ``head_dim`` (Qwen 3, Gemma 3, Cohere) or over the flattened
  heads ``n_heads * head_dim`` before the split (OLMo 2);
* gain: none, one shared across heads (Qwen 3), or one per head (Cohere); stored as
  ``w`` or zero-centred ``1 + w`` (Gemma 3);
* order: before RoPE (all of the above) or after it (:class:`normatlas.vocabulary.RopeOrder`).

:attr:`QKNormConfig.kind` names the result in the design vocabulary (:class:`~normatlas.vocabulary.QKNormKind`).

Guaranteed property: a gain-free RMS / L2 QK-norm over the head dim commutes with
RoPE, since a rotation preserves the norm; a per-dim gain does not commute.
HybridNorm's QKV-norm adds the same norm on V (:attr:`Placement.qkv_norm`).
"""

from __future__ import annotations

import enum
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..backend import Backend, as_backend
from ..functional import normalize
from ..spec import CastOrder, EpsPlacement, Gain, NormSpec, Scale
from ..vocabulary import Operator, QKNormKind, RopeOrder

__all__ = ["QK_OPERATORS", "QKGain", "QKNorm", "QKNormConfig", "QKScope"]

QK_OPERATORS = (Operator.RMSNORM, Operator.L2, Operator.LAYERNORM)
"""The operators a QK-norm computes (:attr:`QKNormConfig.operator`)."""


class _QKOperator:
    """Deprecated: the operators are :class:`~normatlas.vocabulary.Operator`'s (``QKOperator.RMS`` is
    ``Operator.RMSNORM``); kept so that old code importing it keeps working."""

    RMS = Operator.RMSNORM
    L2 = Operator.L2
    LAYERNORM = Operator.LAYERNORM


def __getattr__(name: str) -> Any:
    if name == "QKOperator":
        warnings.warn(
            "normatlas.blocks.QKOperator is deprecated: QKNormConfig.operator takes normatlas.Operator "
            "(RMSNORM, L2, LAYERNORM); QKOperator.RMS is Operator.RMSNORM",
            DeprecationWarning,
            stacklevel=2,
        )
        return _QKOperator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class QKScope(enum.Enum):
    HEAD = "head"  # statistics over head_dim, per head
    FLAT = "flat"  # statistics over n_heads * head_dim (OLMo 2)


class QKGain(enum.Enum):
    NONE = "none"
    SHARED = "shared"  # one (head_dim,) gain for all heads
    PER_HEAD = "per_head"  # one (n_heads, head_dim) gain; the only option for FLAT scope


@dataclass(frozen=True)
class QKNormConfig:
    """QK-norm as a value; see the module docstring. Validated at construction."""

    operator: Operator = Operator.RMSNORM
    scope: QKScope = QKScope.HEAD
    gain: QKGain = QKGain.SHARED
    zero_centred: bool = False
    order: RopeOrder = RopeOrder.BEFORE_ROPE
    eps: float = 1e-6
    bias: bool = False

    def __post_init__(self) -> None:
        allowed_by_field = (("operator", Operator, QK_OPERATORS), ("scope", QKScope, tuple(QKScope)),
                            ("gain", QKGain, tuple(QKGain)), ("order", RopeOrder, tuple(RopeOrder)))  # fmt: skip
        for name, t, members in allowed_by_field:
            if not isinstance(getattr(self, name), t):
                allowed = ", ".join(f"{t.__name__}.{m.name}" for m in members)
                raise TypeError(f"{name}={getattr(self, name)!r} must be one of {allowed}")
        if self.operator not in QK_OPERATORS:
            allowed = ", ".join(f"Operator.{m.name}" for m in QK_OPERATORS)
            raise ValueError(f"operator={self.operator!r} is not a QK-norm operator; allowed: {allowed}")
        if not isinstance(self.zero_centred, bool) or not isinstance(self.bias, bool):
            raise TypeError(f"zero_centred={self.zero_centred!r} and bias={self.bias!r} must be bool")
        if (
            isinstance(self.eps, bool)
            or not isinstance(self.eps, (int, float))
            or not (math.isfinite(self.eps) and self.eps > 0)
        ):
            raise ValueError(f"eps={self.eps!r} must be a finite float > 0")
        if self.scope is QKScope.FLAT and self.gain is QKGain.SHARED:
            raise ValueError(
                "gain=QKGain.SHARED with scope=QKScope.FLAT: a norm over the flattened heads has one gain per "
                "head and dim; use QKGain.PER_HEAD or QKGain.NONE"
            )
        if self.order not in (RopeOrder.BEFORE_ROPE, RopeOrder.AFTER_ROPE):
            raise ValueError(f"order={self.order!r} must be RopeOrder.BEFORE_ROPE or RopeOrder.AFTER_ROPE")
        if self.scope is QKScope.FLAT and self.order is RopeOrder.AFTER_ROPE:
            raise ValueError("scope=QKScope.FLAT normalizes the projection before the head split, so before RoPE")
        if self.zero_centred and self.gain is QKGain.NONE:
            raise ValueError("zero_centred=True needs a gain (gain is QKGain.NONE)")
        if self.bias and self.operator is not Operator.LAYERNORM:
            raise ValueError(f"bias=True is a LayerNorm option; operator={self.operator.value!r}")

    @property
    def kind(self) -> QKNormKind:
        """This QK-norm in the design vocabulary (what the inspector reads back)."""
        if self.scope is QKScope.FLAT:
            return QKNormKind.FLATTENED
        return QKNormKind.PER_HEAD_GAINS if self.gain is QKGain.PER_HEAD else QKNormKind.PER_HEAD

    def spec(self) -> NormSpec:
        """The gain-free core spec of the statistics."""
        center = self.operator is Operator.LAYERNORM
        scale = Scale.L2 if self.operator is Operator.L2 else Scale.RMS
        eps_placement = EpsPlacement.CLAMP if self.operator is Operator.L2 else EpsPlacement.INSIDE_SQRT
        return NormSpec(
            center=center, scale=scale, eps=self.eps, eps_placement=eps_placement,
            cast_order=CastOrder.AFTER_GAIN, gain=Gain.NONE, bias=False,
        )  # fmt: skip


class QKNorm(nn.Module):
    """Normalize a query or key tensor of shape ``(B, T, H, Dh)`` (or ``(B, T, H*Dh)`` for FLAT scope).

    Statistics and gain in at least fp32, result cast back (HF's Qwen3 / Gemma3 /
    Cohere / OLMo2 order). Parameter ``weight`` has shape ``(Dh,)`` for a shared gain,
    ``(H, Dh)`` per head, ``(H*Dh,)`` for FLAT scope.
    """

    def __init__(
        self, config: QKNormConfig, n_heads: int, head_dim: int, device=None, dtype=None,
        backend: Backend | str = Backend.AUTO,
    ) -> None:  # fmt: skip
        super().__init__()
        self.backend = as_backend(backend)  # of the statistics (see normatlas.backend)
        if not isinstance(config, QKNormConfig):
            raise TypeError(f"config={config!r} must be a QKNormConfig")
        self.config, self.n_heads, self.head_dim = config, n_heads, head_dim
        self._spec = config.spec()
        shape: tuple[int, ...] = ()
        if config.scope is QKScope.FLAT:
            shape = (n_heads * head_dim,)
        elif config.gain is QKGain.PER_HEAD:
            shape = (n_heads, head_dim)
        else:
            shape = (head_dim,)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(shape, **factory)) if config.gain is not QKGain.NONE else None
        self.bias = nn.Parameter(torch.empty(shape, **factory)) if config.bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.weight is not None:
                self.weight.fill_(0.0 if self.config.zero_centred else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, input: Tensor) -> Tensor:
        dt = torch.promote_types(input.dtype, torch.float32)
        y = normalize(input.to(dt), self._spec, None, None, backend=self.backend)
        if self.weight is not None:
            w = self.weight.to(dt)
            y = y * (1.0 + w if self.config.zero_centred else w)
        if self.bias is not None:
            y = y + self.bias.to(dt)
        return y.to(input.dtype)

    def extra_repr(self) -> str:
        c = self.config
        zc = ", gain=1+w" if c.zero_centred else ""
        return f"{c.operator.value}, scope={c.scope.value}, gain={c.gain.value}{zc}, {c.order.value}, eps={c.eps}"
