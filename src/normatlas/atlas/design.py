"""A model record's typed design fields: each one a value of the design vocabulary (:mod:`normatlas.vocabulary`).

The data file spells every value by its enum's ``value`` (strings only at the edge); :func:`typed_design` parses a
record into enum members (a soft-cap into a float) and raises ``ValueError`` naming the record, the field, the value
and the allowed values. ``unclear`` (:data:`UNCLEAR`) is the one addition every field allows: neither the code nor
the paper within reach says. ``None`` in a typed design means "no such thing" where a field's allowed words include
``none`` for it (no gain, no soft-cap) and "not a VLM" for the VLM fields (``null`` in the data file).

The fields are the ones the inspector reports as typed values (:class:`normatlas.inspect.InspectionReport` and a
VLM's :meth:`~normatlas.inspect.vlm.VLMReport.check_row`), so ``matrix --check`` compares members, not spellings.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Any

from ..spec import GainConvention
from ..vocabulary import (
    ConnectorKind,
    EmbeddingScale,
    Injection,
    Operator,
    PlacementKind,
    QKNormKind,
    RopeOrder,
)

__all__ = [
    "DESIGN_FIELDS",
    "NONE",
    "SOFTCAP_FIELDS",
    "UNCLEAR",
    "VLM_TYPED",
    "RecordOperator",
    "Unclear",
    "allowed",
    "parse_field",
    "typed_design",
]

NONE = "none"  # no gain / no soft-cap: the inspector's word (normatlas.inspect.report.NO_GAIN)


class Unclear(enum.Enum):
    """Neither the code nor the paper within reach says."""

    UNCLEAR = "unclear"


UNCLEAR = Unclear.UNCLEAR.value


class RecordOperator(enum.Enum):
    """Model-level operators the site vocabulary has no member for."""

    BATCHNORM = "batchnorm"  # statistics over the batch (a tower whose only norms are BatchNorm reads so)
    ADALN_ZERO = "adaLN-Zero"  # DiT's conditioning-regressed, zero-initialised LayerNorm modulation


_OPERATOR: tuple[type[enum.Enum], ...] = (Operator, RecordOperator)
# field -> the enums its values come from (plus ``unclear``); the gain and the soft-caps also take ``none``
_ENUMS: dict[str, tuple[type[enum.Enum], ...]] = {
    "operator": _OPERATOR,
    "placement": (PlacementKind,),
    "qk_norm": (QKNormKind,),
    "qk_norm_rope": (RopeOrder,),
    "gain_convention": (GainConvention,),
    "final_norm": _OPERATOR,
    "embedding_scale": (EmbeddingScale,),
    "vision_tower_norm": _OPERATOR,
    "connector": (ConnectorKind,),
    "connector_norm": _OPERATOR,
}
# the connector of a Flamingo-style model: the image enters through gated cross-attention layers
_EXTRA_MEMBERS: dict[str, tuple[enum.Enum, ...]] = {"connector": (Injection.GATED_CROSS_ATTENTION,)}
SOFTCAP_FIELDS = ("attn_softcap", "final_logit_softcap")
VLM_TYPED = ("vision_tower_norm", "connector", "connector_norm")
DESIGN_FIELDS = (
    "operator",
    "placement",
    "qk_norm",
    "qk_norm_rope",
    "gain_convention",
    "final_norm",
    *SOFTCAP_FIELDS,
    "embedding_scale",
    *VLM_TYPED,
)


def allowed(field: str) -> tuple[str, ...]:
    """The words a data file may write in ``field`` (``null`` aside)."""
    if field in SOFTCAP_FIELDS:
        return ("<a positive number>", NONE, UNCLEAR)
    words = [m.value for e in _ENUMS[field] for m in e] + [m.value for m in _EXTRA_MEMBERS.get(field, ())]
    if field == "gain_convention":
        words.append(NONE)
    return (*words, UNCLEAR)


def parse_field(name: object, field: str, value: Any) -> Any:
    """One field's value as its enum member (a soft-cap: a float, or None for ``none``); ValueError otherwise."""
    if value == UNCLEAR:
        return Unclear.UNCLEAR
    if field in SOFTCAP_FIELDS:
        if value == NONE:
            return None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
            return float(value)
    elif field == "gain_convention" and value == NONE:
        return None
    elif field in _ENUMS and isinstance(value, str):
        for member in (*(m for e in _ENUMS[field] for m in e), *_EXTRA_MEMBERS.get(field, ())):
            if member.value == value:
                return member
    raise ValueError(f"model {name!r}: {field}={value!r} is not one of {', '.join(allowed(field))}")


def typed_design(rec: Mapping[str, Any]) -> dict[str, Any]:
    """Every design field of a record as an enum member (soft-caps as floats); ValueError naming what breaks.

    The VLM fields are ``None`` (``null``) exactly where the record is not an image-text model."""
    name = rec.get("name")
    out: dict[str, Any] = {}
    for field in DESIGN_FIELDS:
        value = rec.get(field)
        if field in VLM_TYPED and value is None:
            out[field] = None
            continue
        out[field] = parse_field(name, field, value)
    return out
