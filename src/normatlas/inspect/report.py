"""The typed inspection report (enums inside; strings only in :meth:`InspectionReport.to_dict`)."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "AttentionInfo",
    "InspectionReport",
    "NormInfo",
    "Operator",
    "Placement",
    "QKNorm",
    "RopeOrder",
    "SublayerInfo",
]


class Operator(enum.Enum):
    """The normalization operator, as read from its arithmetic."""

    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"
    LAYERNORM_NONPARAM = "layernorm-nonparam"  # centred, no gain, no bias
    L2 = "l2"
    GROUPNORM = "groupnorm"
    OTHER = "other"
    MIXED = "mixed"
    NONE = "none"


class Placement(enum.Enum):
    """Where a sublayer's norms sit relative to its residual add (essay §06)."""

    PRE = "pre"  # x + F(N(x))
    POST = "post"  # N(x + F(x))
    PERI = "peri"  # x + N(F(N(x)))  (= Sandwich-LN)
    RES_POST = "res-post"  # x + N(F(x))  (Swin-V2, Chameleon, OLMo 2 "reordered")
    PARALLEL = "parallel"  # x + F1(N(x)) + F2(N(x))
    NONE = "none"  # x + F(x)
    PRE_POST = "pre+post"  # N(x + F(N(x)))
    MIX = "mix"  # differs across layers or sublayers
    UNKNOWN = "unknown"


class QKNorm(enum.Enum):
    NONE = "none"
    PER_HEAD = "per-head"  # normalizes each head's d_head vector
    FLATTENED = "flattened"  # normalizes the concatenated heads (d_model)
    MIXED = "mixed"


class RopeOrder(enum.Enum):
    BEFORE_ROPE = "before-rope"  # the norm runs first, then RoPE
    AFTER_ROPE = "after-rope"
    NO_ROPE = "no-rope"
    NOT_APPLICABLE = "n/a"


@dataclass(frozen=True)
class NormInfo:
    """One normalization site."""

    index: int
    role: str  # pre / out / post / qk / q / k / v / final / embedding / other
    layer: int | None
    module: str  # label only (the module that ran it); never used to classify
    operator: Operator
    size: int
    eps: float | None
    eps_placement: str | None
    gain_convention: str  # w / 1+w / none
    bias: bool
    cast_order: str | None
    output_scale: float
    fused: bool
    probe: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SublayerInfo:
    """One residual add and the norms around it."""

    layer: int
    kind: str  # attention / mlp / attention+mlp
    placement: Placement
    pre: tuple[int, ...]
    out: tuple[int, ...]
    post: tuple[int, ...]
    skip_scale: float | None  # constant multiplying the residual (DeepNorm alpha)
    branch_scale: str | None  # constant, learned scalar or per-channel (LayerScale) on the branch


@dataclass(frozen=True)
class AttentionInfo:
    layer: int
    qk_norm: QKNorm
    qk_norm_rope: RopeOrder
    v_norm: bool
    softcap: float | None


@dataclass
class InspectionReport:
    """The normalization design of one model, derived from its executed dataflow."""

    model: str
    tracer: str
    layers: int
    hidden_size: int | None
    operator: Operator
    eps: float | None
    eps_placement: str | None
    gain_convention: str
    bias: bool
    cast_order: str | None
    placement: Placement
    placement_attention: str
    placement_mlp: str
    placement_by_layer: list[str]
    residual_scale: str | None
    branch_scale: str | None
    depth_scaling: str | None
    qk_norm: QKNorm
    qk_norm_rope: RopeOrder
    v_norm: bool
    attn_softcap: float | None
    final_norm: Operator
    final_logit_softcap: float | None
    embedding_scale: float | None
    embedding_norm: Operator
    norms: list[NormInfo] = field(default_factory=list)
    sublayers: list[SublayerInfo] = field(default_factory=list)
    attention: list[AttentionInfo] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self, detail: bool = True) -> dict[str, Any]:
        """JSON-ready dict; enums become their string values."""
        d = asdict(self)
        if not detail:
            for k in ("norms", "sublayers", "attention"):
                d.pop(k)
        return _plain(d)

    def summary_row(self) -> dict[str, Any]:
        """One flat row (for tables, CSV and the sweep)."""
        d = self.to_dict(detail=False)
        d["placement_by_layer"] = " ".join(self.placement_by_layer)
        d["notes"] = "; ".join(self.notes)
        return d


def _plain(obj: Any) -> Any:
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj
