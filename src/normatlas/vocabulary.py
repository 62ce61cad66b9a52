"""The design vocabulary: one set of words for what writes a design and what reads one.

:mod:`normatlas.spec` names one normalization *layer* (its axes, centring, statistic, eps and
where it sits, cast order, gain convention). This module names where layers sit in a *model*:
the operator a site computes, the placement kind of a residual sublayer, the kind of norm inside
attention (and whether its gains are shared across heads or one per head) and its order relative
to RoPE. The blocks (:class:`normatlas.blocks.Placement.kind`, :attr:`QKNormConfig.kind
<normatlas.blocks.QKNormConfig.kind>`) write these values; the inspector, surgery, diagnostics
and the atlas records read and store them. Enums inside; their ``value`` strings are the only
spelling at the CLI, the JSON reports and the data files (parse with :func:`normatlas.spec.parse_enum`).
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from .spec import CastOrder, EpsPlacement, GainConvention

__all__ = [
    "BranchScale",
    "BranchScaling",
    "CastOrder",
    "ConnectorKind",
    "DepthScaling",
    "EmbeddingScale",
    "EpsPlacement",
    "GainConvention",
    "Injection",
    "Operator",
    "PlacementKind",
    "PlacementMix",
    "QKNormKind",
    "RopeOrder",
    "SiteRole",
    "SublayerKind",
    "branch_scale_word",
    "layer_placement_words",
    "residual_scale_word",
]


class Operator(enum.Enum):
    """The normalization operator a site computes, read from its arithmetic."""

    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"
    LAYERNORM_NONPARAM = "layernorm-nonparam"  # centred, no gain, no bias (OLMo's non-parametric LN)
    L2 = "l2"
    GROUPNORM = "groupnorm"
    OTHER = "other"
    MIXED = "mixed"  # a summary over sites that differ
    NONE = "none"


class PlacementKind(enum.Enum):
    """Where a residual sublayer's norms sit relative to its add (essay §06)."""

    PRE = "pre"  # x + F(N(x))
    POST = "post"  # N(x + F(x))
    PERI = "peri"  # x + N(F(N(x)))  (= Sandwich-LN)
    RES_POST = "res-post"  # x + N(F(x))  (Swin-V2, Chameleon, OLMo 2 "reordered")
    PARALLEL = "parallel"  # x + F1(N(x)) + F2(N(x))
    NONE = "none"  # x + F(x)
    PRE_POST = "pre+post"  # N(x + F(N(x)))
    MIX = "mix"  # a summary: differs across layers or sublayers
    UNKNOWN = "unknown"  # no residual add was found

    @classmethod
    def of_slots(cls, pre: bool, post: bool, after_add: bool) -> PlacementKind:
        """The kind of one sublayer from its norm slots: on the branch input (``pre``), on the branch
        output before the add (``post``), on the stream after the add (``after_add``)."""
        return _SLOTS.get((pre, post, after_add), cls.MIX)


_SLOTS = {
    (True, False, False): PlacementKind.PRE,
    (True, True, False): PlacementKind.PERI,
    (False, True, False): PlacementKind.RES_POST,
    (False, False, True): PlacementKind.POST,
    (False, False, False): PlacementKind.NONE,
    (True, False, True): PlacementKind.PRE_POST,
}


class QKNormKind(enum.Enum):
    """The norm on queries and keys inside attention: its statistic's scope and its gains."""

    NONE = "none"
    PER_HEAD = "per-head"  # statistic over each head's vector; one gain shared by every head (Qwen 3), or none
    PER_HEAD_GAINS = "per-head-gains"  # statistic over each head's vector; a gain of its own per head (Chameleon)
    FLATTENED = "flattened"  # statistic over the concatenated heads (OLMo 2)
    MIXED = "mixed"  # a summary: differs across layers


class RopeOrder(enum.Enum):
    """Where a QK-norm runs relative to the rotary embedding."""

    BEFORE_ROPE = "before-rope"  # the norm runs first, then RoPE
    AFTER_ROPE = "after-rope"
    NO_ROPE = "no-rope"  # the layer applies no RoPE
    MIXED = "mixed"  # a summary: differs across layers
    NOT_APPLICABLE = "n/a"  # no QK-norm


class SiteRole(enum.Enum):
    """What a normalization site does in a model, by where it sits in the dataflow."""

    PRE = "pre"  # on a sublayer's branch input
    OUT = "out"  # on a sublayer's branch output, before the add
    POST = "post"  # on the stream after the add
    QK = "qk"  # on queries or keys inside attention
    V = "v"  # on values inside attention
    FINAL = "final"  # on the last stream value, before the head
    EMBEDDING = "embedding"  # between the embedding and the first sublayer
    POOLED = "pooled"  # vision: on a token subset (CLS) of the last stream value
    MERGER = "merger"  # vision: on rows that are then merged (k tokens -> one row), e.g. a patch merger
    HEAD = "head"  # vision: inside a pooling head or connector after the blocks
    OTHER = "other"


class SublayerKind(enum.Enum):
    """What a residual branch computes."""

    ATTENTION = "attention"
    CROSS_ATTENTION = "cross-attention"  # attention whose keys and values come from another stream (an encoder's)
    MLP = "mlp"
    PARALLEL = "attention+mlp"  # attention and MLP branches added at one add
    MIXER = "mixer"  # a token mixer without an attention core: an SSM (Mamba), a convolution, linear attention
    ATTENTION_MIXER = "attention+mixer"  # attention beside a mixer at one add (Falcon-H1, Hymba)


class EmbeddingScale(enum.Enum):
    """A constant multiplying the token embeddings before the first sublayer."""

    NONE = "none"
    SQRT_D_MODEL = "sqrt-d-model"  # sqrt(hidden_size) (the original Transformer, Gemma)
    CONSTANT = "constant"  # a constant of its own (MiniCPM's scale_emb)

    @classmethod
    def of(cls, scale: float | None, hidden_size: int | None) -> EmbeddingScale:
        """The kind of an inspected scale: none for no scale (or 1), sqrt-d-model where it is sqrt(hidden_size)."""
        if scale is None or abs(scale - 1.0) < 1e-6:
            return cls.NONE
        if hidden_size and abs(scale - hidden_size**0.5) < 1e-3 * hidden_size**0.5:
            return cls.SQRT_D_MODEL
        return cls.CONSTANT


class ConnectorKind(enum.Enum):
    """What maps a vision tower's features into the language model (read off the connector's ops)."""

    LINEAR = "linear"
    MLP = "mlp"
    PATCH_MERGER = "patch-merger"  # k rows regrouped into one wider row, then projected (pixel shuffle too)
    POOLING = "pooling"
    RESAMPLER = "resampler"  # an attention inside the connector (learned queries: Perceiver resampler, Q-Former)
    SOFT_TOKENS = "soft-tokens"  # a softmax over a projection, times a parameter table (Ovis' visual vocabulary)
    VQ_TOKENS = "vq-tokens"  # the image becomes discrete token ids
    NONE = "none"


class Injection(enum.Enum):
    """Where the image enters the language model."""

    EMBEDDING_STREAM = "embedding-stream"  # image rows placed among the token embeddings
    CROSS_ATTENTION = "cross-attention"
    GATED_CROSS_ATTENTION = "gated-cross-attention"  # a tanh(parameter) gate on the cross-attention branch
    TOKENS = "tokens"  # discrete ids, embedded by the language model's own table


@dataclass(frozen=True)
class PlacementMix:
    """The placements of one kind of sublayer (attention, MLP, ...) over a stack, in layer order.

    :attr:`value` is its spelling in the reports: ``n/a`` where the stack has no such sublayer, the one kind where
    they all agree (``pre``), else ``mix(...)`` naming the sequence (``mix(post,pre,pre)``; counts past 8 sublayers:
    ``mix(post x2, pre x10)``).
    """

    kinds: tuple[PlacementKind, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.kinds, tuple) or not all(isinstance(k, PlacementKind) for k in self.kinds):
            allowed = ", ".join(f"PlacementKind.{m.name}" for m in PlacementKind)
            raise TypeError(f"kinds={self.kinds!r} must be a tuple of {allowed}")

    @property
    def value(self) -> str:
        uniq = list(dict.fromkeys(p.value for p in self.kinds))
        if not uniq:
            return "n/a"
        if len(uniq) == 1:
            return uniq[0]
        if len(self.kinds) > 8:
            return "mix(" + ", ".join(f"{k} x{v}" for k, v in Counter(p.value for p in self.kinds).items()) + ")"
        return "mix(" + ",".join(p.value for p in self.kinds) + ")"

    def __str__(self) -> str:
        return self.value


class BranchScaling(enum.Enum):
    """A learned multiplier on a residual branch on its way to the add (a constant one is a number)."""

    LEARNED_SCALAR = "learned scalar"  # one learned number (ReZero's alpha, SkipInit)
    PER_CHANNEL = "per-channel"  # one learned number per channel (LayerScale)


@dataclass(frozen=True)
class BranchScale:
    """What multiplies one residual branch on its way to the add: constants and learned multipliers.

    Constants are kept to the 6 significant digits the reports print. :attr:`value` is the report's spelling: the
    parts' spellings sorted and joined by ``", "`` (``"0.5, learned scalar"``); a branch without a scale is
    ``BranchScale()``, which is falsy (``None`` in the JSON).
    """

    constants: frozenset[float] = frozenset()
    learned: frozenset[BranchScaling] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.constants, frozenset) or not all(isinstance(c, float) for c in self.constants):
            raise TypeError(f"constants={self.constants!r} must be a frozenset of floats")
        if not isinstance(self.learned, frozenset) or not all(isinstance(k, BranchScaling) for k in self.learned):
            allowed = ", ".join(f"BranchScaling.{m.name}" for m in BranchScaling)
            raise TypeError(f"learned={self.learned!r} must be a frozenset of {allowed}")

    @classmethod
    def of(cls, parts: Iterable[float | BranchScaling]) -> BranchScale:
        """The scale made of ``parts``: numbers (rounded to 6 significant digits) and learned multipliers."""
        items = list(parts)
        learned = frozenset(p for p in items if isinstance(p, BranchScaling))
        constants = frozenset(float(f"{p:.6g}") for p in items if not isinstance(p, BranchScaling))
        return cls(constants, learned)

    @classmethod
    def parse(cls, text: str, name: str = "branch_scale") -> BranchScale:
        """A report's spelling back as a value (the JSON / CLI edge): each comma-separated part a number or one of
        :class:`BranchScaling`'s values; anything else is a ValueError naming ``name``, the part and what is allowed."""
        if not isinstance(text, str):
            raise TypeError(f"{name}={text!r} must be a str")
        parts: list[float | BranchScaling] = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            try:
                parts.append(BranchScaling(part))
                continue
            except ValueError:
                pass
            try:
                number = float(part)
            except ValueError:
                number = math.nan
            if not math.isfinite(number):
                allowed = ", ".join(repr(m.value) for m in BranchScaling)
                raise ValueError(f"{name}={text!r}: part {part!r} is neither a finite number nor one of {allowed}")
            parts.append(number)
        return cls.of(parts)

    @property
    def value(self) -> str:
        return ", ".join(sorted({f"{c:.6g}" for c in self.constants} | {k.value for k in self.learned}))

    def __bool__(self) -> bool:
        return bool(self.constants or self.learned)

    def __or__(self, other: BranchScale) -> BranchScale:
        return BranchScale(self.constants | other.constants, self.learned | other.learned)

    def __str__(self) -> str:
        return self.value


def branch_scale_word(scale: BranchScale | frozenset[BranchScale]) -> str | None:
    """A branch scale, or the distinct ones of several sublayers, as the reports spell it: the spellings sorted and
    joined by ``", "``; None where there is none."""
    if isinstance(scale, BranchScale):
        return scale.value or None
    return ", ".join(sorted({s.value for s in scale if s})) or None


def residual_scale_word(scale: BranchScale) -> str | None:
    """The multipliers on the residual (skip) path as the reports spell them: constants to 6 significant digits
    (DeepNorm's alpha: ``"2"``), learned ones as ``"<kind> (learned)"``, sorted and joined by ``", "``; None where
    there is none."""
    parts = {f"{c:.6g}" for c in scale.constants} | {f"{k.value} (learned)" for k in scale.learned}
    return ", ".join(sorted(parts)) or None


def layer_placement_words(layers: Iterable[Iterable[PlacementKind]]) -> list[str]:
    """Each layer's sublayer placements as the reports spell them: ``"pre/pre"`` (attention, then the MLP)."""
    return ["/".join(p.value for p in layer) for layer in layers]


@dataclass(frozen=True)
class DepthScaling:
    """Constants on the sublayers' norm outputs that change with depth: ``(layer, scale)`` per layer (layers
    counted from 0). LayerNorm Scaling's is ``1/sqrt(layer + 1)``; :attr:`value` is the reports' spelling."""

    per_layer: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        ok = isinstance(self.per_layer, tuple) and all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], int) and isinstance(p[1], float)
            for p in self.per_layer
        )
        if not ok or len(self.per_layer) < 2:
            raise TypeError(f"per_layer={self.per_layer!r} must be two or more (layer: int, scale: float) pairs")

    @property
    def inverse_sqrt(self) -> bool:
        """Whether every layer's constant is LayerNorm Scaling's ``1/sqrt(layer + 1)`` (to 1e-6)."""
        return all(abs(v - 1 / math.sqrt(k + 1)) < 1e-6 for k, v in self.per_layer)

    @property
    def value(self) -> str:
        if self.inverse_sqrt:
            return "1/sqrt(layer)"
        return "varies: " + ", ".join(f"{v:.4g}" for _, v in self.per_layer)

    def __str__(self) -> str:
        return self.value
