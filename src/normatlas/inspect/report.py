"""The typed inspection report, in the design vocabulary (:mod:`normatlas.vocabulary`, :mod:`normatlas.spec`).

Enums inside; strings only in :meth:`InspectionReport.to_dict` (each enum's ``value``). A field that
is ``None`` was not found or not measurable (a fused kernel hides its cast order; no norm has no eps), except the
gain convention: a norm without a gain has none, and every view of the report (JSON, tables, CSV, the sweep) says
:data:`NO_GAIN` there, one word for one fact.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from ..spec import CastOrder, EpsPlacement, GainConvention
from ..vocabulary import (
    BranchScale,
    DepthScaling,
    Operator,
    PlacementKind,
    PlacementMix,
    QKNormKind,
    RopeOrder,
    SiteRole,
    SublayerKind,
    branch_scale_word,
    layer_placement_words,
    residual_scale_word,
)

__all__ = [
    "ENCODER_COLUMNS",
    "NO_GAIN",
    "AttentionInfo",
    "InspectionReport",
    "NormInfo",
    "SublayerInfo",
    "UntraceableModel",
    "gain_word",
]

NO_SUBLAYERS = PlacementMix()  # the placement of a kind of sublayer the stack does not have ("n/a")
NO_GAIN = "none"  # the gain convention of a norm without a gain (GainConvention names the conventions of a gain)


def gain_word(conv: GainConvention | None) -> str:
    """A gain convention as the report spells it: its value, or :data:`NO_GAIN` for a norm without a gain."""
    return conv.value if conv is not None else NO_GAIN


class UntraceableModel(ValueError):
    """The model could not be run on the example inputs, so no dataflow could be recorded."""


@dataclass(frozen=True)
class NormInfo:
    """One normalization site."""

    index: int
    role: SiteRole
    layer: int | None
    module: str  # label only (the module that ran it); never used to classify
    operator: Operator
    size: int
    eps: float | None
    eps_placement: EpsPlacement | None
    gain_convention: GainConvention | None  # None: no gain
    bias: bool
    cast_order: CastOrder | None
    output_scale: float
    fused: bool
    probe: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SublayerInfo:
    """One residual add and the norms around it."""

    layer: int
    kind: SublayerKind
    placement: PlacementKind
    pre: tuple[int, ...]
    out: tuple[int, ...]
    post: tuple[int, ...]
    skip_scale: float | None  # constant multiplying the residual (DeepNorm alpha)
    branch_scale: BranchScale  # constants, a learned scalar or per-channel (LayerScale) on the branch; falsy: none


@dataclass(frozen=True)
class AttentionInfo:
    layer: int
    qk_norm: QKNormKind
    qk_norm_rope: RopeOrder
    v_norm: bool
    softcap: float | None
    cross: bool = False  # its keys and values come from another stack's stream (an encoder's output)


@dataclass
class InspectionReport:
    """The normalization design of one model, derived from its executed dataflow."""

    model: str
    tracer: str
    layers: int
    hidden_size: int | None
    operator: Operator
    eps: float | None
    eps_placement: EpsPlacement | None
    gain_convention: GainConvention | None
    bias: bool
    cast_order: CastOrder | None
    placement: PlacementKind
    placement_attention: PlacementMix
    placement_mlp: PlacementMix
    placement_by_layer: tuple[tuple[PlacementKind, ...], ...]  # each layer's sublayers' placements, in order
    residual_scale: BranchScale  # what multiplies the residual (skip) path: DeepNorm's alpha, a learned scalar
    branch_scale: frozenset[BranchScale]  # the sublayers' distinct branch scales (empty: none)
    depth_scaling: DepthScaling | None  # norm outputs scaled by depth (LayerNorm Scaling), else None
    qk_norm: QKNormKind
    qk_norm_rope: RopeOrder
    v_norm: bool
    attn_softcap: float | None
    final_norm: Operator
    final_logit_softcap: float | None
    embedding_scale: float | None
    embedding_norm: Operator
    placement_mixer: PlacementMix = NO_SUBLAYERS  # the placement of the mixer sublayers (an SSM, a convolution, ...)
    embedding_norm_as_pre: bool = False  # layer 0 has no pre-norm of its own: the embedding norm is it (a note)
    placement_cross_attention: PlacementMix = NO_SUBLAYERS  # the placement of the cross-attention sublayers
    stack: str | None = None  # "decoder" / "encoder" for a stack of an encoder-decoder; None: one stack
    encoder: InspectionReport | None = None  # the encoder stack's own report (the decoder is the headline)
    norms: list[NormInfo] = field(default_factory=list)
    sublayers: list[SublayerInfo] = field(default_factory=list)
    attention: list[AttentionInfo] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self, detail: bool = True) -> dict[str, Any]:
        """JSON-ready dict; enums become their string values."""
        d = asdict(self)
        d["encoder"] = self.encoder.to_dict(detail) if self.encoder is not None else None
        d["gain_convention"] = gain_word(self.gain_convention)
        for n, info in zip(d["norms"], self.norms, strict=True):
            n["gain_convention"] = gain_word(info.gain_convention)
        for key in PLACEMENT_MIXES:
            d[key] = getattr(self, key).value
        d["branch_scale"] = branch_scale_word(self.branch_scale)
        d["placement_by_layer"] = layer_placement_words(self.placement_by_layer)
        d["residual_scale"] = residual_scale_word(self.residual_scale)
        d["depth_scaling"] = self.depth_scaling.value if self.depth_scaling is not None else None
        for sd, sub in zip(d["sublayers"], self.sublayers, strict=True):
            sd["branch_scale"] = branch_scale_word(sub.branch_scale)
        if not detail:
            for k in ("norms", "sublayers", "attention"):
                d.pop(k)
        return _plain(d)

    def summary_row(self) -> dict[str, Any]:
        """One flat row (for tables, CSV and the sweep)."""
        d = self.to_dict(detail=False)
        d["placement_by_layer"] = " ".join(layer_placement_words(self.placement_by_layer))
        d["notes"] = "; ".join(self.notes)
        d.pop("encoder")
        if self.encoder is not None:  # the encoder's fields beside the decoder's, each under encoder_
            row = self.encoder.summary_row()
            d |= {f"encoder_{k}": row[k] for k in ENCODER_COLUMNS}
        else:  # one stack (or the encoder's own row): no stack column
            d.pop("stack")
        return d


PLACEMENT_MIXES = ("placement_attention", "placement_mlp", "placement_mixer", "placement_cross_attention")
"""The report's :class:`~normatlas.vocabulary.PlacementMix` fields (each its ``value`` in the JSON)."""

ENCODER_COLUMNS = (
    "layers",
    "operator",
    "eps",
    "gain_convention",
    "bias",
    "placement",
    "placement_attention",
    "placement_mlp",
    "placement_by_layer",
    "qk_norm",
    "final_norm",
    "embedding_scale",
    "embedding_norm",
)
"""The encoder stack's fields an encoder-decoder's summary row repeats as ``encoder_<field>``."""


def _plain(obj: Any) -> Any:
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj
