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

from .spec import CastOrder, EpsPlacement, GainConvention

__all__ = [
    "CastOrder",
    "ConnectorKind",
    "EmbeddingScale",
    "EpsPlacement",
    "GainConvention",
    "Injection",
    "Operator",
    "PlacementKind",
    "QKNormKind",
    "RopeOrder",
    "SiteRole",
    "SublayerKind",
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
