"""Where the norms sit in a transformer block, as a value.

The essay calls placement "one of the largest architectural decisions in a
transformer". A :class:`Placement` says, for each sublayer (attention, FFN),
whether a norm sits on the branch input (``pre``), on the branch output before
the residual add (``post``) and on the stream after the add (``after_add``), plus
the residual and branch scalings that DeepNorm, LayerNorm Scaling, Granite, ReZero,
SkipInit and LayerScale add. One :class:`~normatlas.blocks.block.Block` reads it;
there is no class per scheme. A :class:`Schedule` maps layer index to placement
(and optionally operator), which is how Mix-LN and HybridNorm* are written. :attr:`Placement.kind`
names a placement in the design vocabulary (:class:`~normatlas.vocabulary.PlacementKind`), the
words the inspector reads a model's placement back in.

Every preset's docstring draws its dataflow for one sublayer ``F`` (attention or
FFN); ``N`` is the block's norm operator.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from torch import nn

from ..vocabulary import PlacementKind
from .residual import DeepNormArch, deepnorm_constants

__all__ = [
    "DepthScale",
    "Gate",
    "LayerPlan",
    "NormFactory",
    "Placement",
    "Schedule",
    "Sublayer",
    "deepnorm",
    "depth_scaled_sandwich",
    "hybridnorm",
    "hybridnorm_star",
    "layernorm_scaling",
    "layerscale",
    "mix_ln",
    "norm_free",
    "parallel",
    "peri_ln",
    "post_ln",
    "pre_ln",
    "reordered_norm",
    "res_post_norm",
    "rezero",
    "sandwich_ln",
    "scaled_residual",
    "skipinit",
]

NormFactory = Callable[[int], nn.Module]
"""Anything that builds a norm for a feature size: ``RMSNorm``, ``DyT``, ``lambda d: Norm(spec, d)``."""


class Gate(enum.Enum):
    """A learned multiplier on each residual branch (norm-free and near-identity init)."""

    NONE = "none"
    SCALAR = "scalar"  # ReZero, SkipInit: one alpha per branch
    VECTOR = "vector"  # LayerScale: one per channel


class DepthScale(enum.Enum):
    """A depth-dependent constant factor."""

    NONE = "none"
    INV_SQRT_LAYER = "1/sqrt(l)"  # l = 1-based layer index (LayerNorm Scaling)
    INV_SQRT_DEPTH = "1/sqrt(L)"  # L = number of layers (Pangu's depth-scaled sandwich)

    def factor(self, layer: int, depth: int) -> float:
        """The factor for 0-based ``layer`` in a model of ``depth`` layers."""
        if self is DepthScale.INV_SQRT_LAYER:
            return 1.0 / math.sqrt(layer + 1)
        if self is DepthScale.INV_SQRT_DEPTH:
            return 1.0 / math.sqrt(depth)
        return 1.0


@dataclass(frozen=True)
class Sublayer:
    """Norm slots around one residual branch ``x <- x + F(x)``.

    ``pre``: ``F(N(x))``. ``post``: ``N(F(.))`` before the add. ``after_add``:
    ``N(x + F)`` (the stream itself is normalized: Post-LN).
    """

    pre: bool = True
    post: bool = False
    after_add: bool = False

    def __post_init__(self) -> None:
        for name in ("pre", "post", "after_add"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Sublayer.{name}={getattr(self, name)!r} must be bool")

    @property
    def slots(self) -> tuple[str, ...]:
        return tuple(n for n in ("pre", "post", "after_add") if getattr(self, n))

    @property
    def kind(self) -> PlacementKind:
        """This sublayer's placement in the design vocabulary (what the inspector reads back)."""
        return PlacementKind.of_slots(self.pre, self.post, self.after_add)


def _finite(value: object, name: str, *, positive: bool = False, nonzero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name}={value!r} must be a finite float")
    if positive and value <= 0:
        raise ValueError(f"{name}={value!r} must be > 0")
    if nonzero and value == 0:
        raise ValueError(f"{name}={value!r} must be nonzero (a zero branch scale removes the branch)")
    return float(value)


@dataclass(frozen=True)
class Placement:
    """The placement of norms and residual scalings in one block. Validated at construction.

    Attributes:
        name: a label for printing (semantics come only from the fields below).
        attn, ffn: the norm slots of each sublayer.
        parallel: attention and FFN read the same input and share one add
            (GPT-J, GPT-NeoX, Cohere): ``x <- x + F_attn(N(x)) + F_ffn(N'(x))``.
        shared_pre_norm: with ``parallel``, one pre-norm feeds both branches (GPT-J,
            Cohere); otherwise each has its own (GPT-NeoX).
        qkv_norm: norm Q, K and V over the head dim inside attention (HybridNorm).
        residual_alpha: the stream is multiplied by alpha before the add (DeepNorm).
        branch_scale: constant multiplier on each branch output (Granite's residual multiplier).
        ffn_residual_alpha, ffn_branch_scale: the FFN sublayer's own alpha and branch scale where they differ
            from the attention's (None: the same); Beam's depth-scaled adds ``sqrt((k-1)/k) x + F / sqrt(k)`` count
            k over every add, so the two sublayers of a layer differ. Not with ``parallel`` (one add).
        skip_gate: a learned multiplier on the stream itself before the add, initialised at 1 (Doge's
            ``input_residual * x + F``): ``Gate.SCALAR`` one value, ``Gate.VECTOR`` one per channel.
        branch_init_beta: DeepNorm's beta: v/o/FFN weights initialised Xavier-normal with gain beta.
        gate, gate_init: learned branch multiplier (ReZero/SkipInit scalar at 0, LayerScale vector at 1e-5).
        pre_norm_scale: factor on the pre-norm output (LayerNorm Scaling: 1/sqrt(l)).
        post_gain_init: the post-branch norms' gains start at ``post_gain_c`` times this (Pangu DSSN).
    """

    name: str = "custom"
    attn: Sublayer = field(default_factory=Sublayer)
    ffn: Sublayer = field(default_factory=Sublayer)
    parallel: bool = False
    shared_pre_norm: bool = True
    qkv_norm: bool = False
    residual_alpha: float = 1.0
    branch_scale: float = 1.0
    ffn_residual_alpha: float | None = None
    ffn_branch_scale: float | None = None
    skip_gate: Gate = Gate.NONE
    branch_init_beta: float | None = None
    gate: Gate = Gate.NONE
    gate_init: float = 0.0
    pre_norm_scale: DepthScale = DepthScale.NONE
    post_gain_init: DepthScale = DepthScale.NONE
    post_gain_c: float = 1.0

    def __post_init__(self) -> None:
        for name in ("attn", "ffn"):
            if not isinstance(getattr(self, name), Sublayer):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a Sublayer")
        for name in ("parallel", "shared_pre_norm", "qkv_norm"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be bool")
        for name, enum_type in (
            ("gate", Gate), ("skip_gate", Gate), ("pre_norm_scale", DepthScale), ("post_gain_init", DepthScale)
        ):  # fmt: skip
            if not isinstance(getattr(self, name), enum_type):
                allowed = ", ".join(f"{enum_type.__name__}.{m.name}" for m in enum_type)
                raise TypeError(f"{name}={getattr(self, name)!r} must be one of {allowed}")
        _finite(self.residual_alpha, "residual_alpha", positive=True)
        _finite(self.branch_scale, "branch_scale", nonzero=True)
        _finite(self.gate_init, "gate_init")
        if self.ffn_residual_alpha is not None:
            _finite(self.ffn_residual_alpha, "ffn_residual_alpha", positive=True)
        if self.ffn_branch_scale is not None:
            _finite(self.ffn_branch_scale, "ffn_branch_scale", nonzero=True)
        if self.parallel and (self.ffn_residual_alpha is not None or self.ffn_branch_scale is not None):
            raise ValueError(
                f"parallel=True has one residual add, so ffn_residual_alpha={self.ffn_residual_alpha} and "
                f"ffn_branch_scale={self.ffn_branch_scale} must be None (set residual_alpha / branch_scale)"
            )
        _finite(self.post_gain_c, "post_gain_c", positive=True)
        if self.branch_init_beta is not None:
            _finite(self.branch_init_beta, "branch_init_beta", positive=True)
        if self.parallel and self.attn.after_add != self.ffn.after_add:
            raise ValueError(
                f"parallel=True has one residual add, so attn.after_add={self.attn.after_add} and "
                f"ffn.after_add={self.ffn.after_add} must agree"
            )
        if self.parallel and self.shared_pre_norm and self.attn.pre != self.ffn.pre:
            raise ValueError("shared_pre_norm=True needs attn.pre == ffn.pre (one norm feeds both branches)")
        if self.pre_norm_scale is not DepthScale.NONE and not (self.attn.pre or self.ffn.pre):
            raise ValueError(f"pre_norm_scale={self.pre_norm_scale.value!r} needs a pre-norm slot; none is set")
        if self.post_gain_init is not DepthScale.NONE and not (self.attn.post or self.ffn.post):
            raise ValueError(f"post_gain_init={self.post_gain_init.value!r} needs a post-branch norm slot")
        if self.gate is Gate.NONE and self.gate_init != 0.0:
            raise ValueError(f"gate_init={self.gate_init} is set but gate=Gate.NONE; choose Gate.SCALAR or VECTOR")

    def scalings(self, sublayer: str) -> tuple[float, float]:
        """(residual alpha, branch scale) of ``sublayer`` (``"attn"`` or ``"ffn"``)."""
        if sublayer not in ("attn", "ffn"):
            raise ValueError(f"sublayer={sublayer!r} must be 'attn' or 'ffn'")
        if sublayer == "attn":
            return self.residual_alpha, self.branch_scale
        alpha, scale = self.ffn_residual_alpha, self.ffn_branch_scale
        return (self.residual_alpha if alpha is None else alpha), (self.branch_scale if scale is None else scale)

    @property
    def kinds(self) -> tuple[PlacementKind, ...]:
        """Per residual add, in the design vocabulary: ``(attention, FFN)``, or ``(PARALLEL,)`` for one shared add."""
        return (PlacementKind.PARALLEL,) if self.parallel else (self.attn.kind, self.ffn.kind)

    @property
    def kind(self) -> PlacementKind:
        """The block's placement in the design vocabulary: the sublayers' one kind, or ``MIX`` where they differ."""
        kinds = set(self.kinds)
        return kinds.pop() if len(kinds) == 1 else PlacementKind.MIX

    @property
    def has_norm(self) -> bool:
        """True when any slot needs a norm operator."""
        return bool(self.attn.slots or self.ffn.slots or self.qkv_norm)

    def with_(self, **changes: object) -> Placement:
        """A validated copy with some fields changed."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def describe(self) -> str:
        """One line: the formula of each sublayer."""
        return f"{self.name}: attn {_formula(self.attn, self, 'A')} ; ffn {_formula(self.ffn, self, 'F')}" + (
            " (parallel)" if self.parallel else ""
        )


def _formula(s: Sublayer, p: Placement, f: str) -> str:
    inner = "N(x)" if s.pre else "x"
    if s.pre and p.pre_norm_scale is not DepthScale.NONE:
        inner = f"{inner}*{p.pre_norm_scale.value}"
    if f == "A" and p.qkv_norm:
        f = "A_qkvnorm"
    branch = f"{f}({inner})"
    if s.post:
        branch = f"N({branch})"
    if p.gate is not Gate.NONE:
        branch = f"g*{branch}"
    alpha, scale = p.scalings("attn" if f.startswith("A") else "ffn")
    if scale != 1.0:
        branch = f"{scale:g}*{branch}"
    stream = "x" if alpha == 1.0 else f"{alpha:.4g}*x"
    if p.skip_gate is not Gate.NONE:
        stream = f"s*{stream}"
    out = f"{stream} + {branch}"
    return f"x <- N({out})" if s.after_add else f"x <- {out}"


# --------------------------------------------------------------------------- presets
PRE, POST_ADD, PERI = Sublayer(pre=True), Sublayer(pre=False, after_add=True), Sublayer(pre=True, post=True)
RES_POST, NONE = Sublayer(pre=False, post=True), Sublayer(pre=False)


def post_ln() -> Placement:
    """Post-LN (Vaswani et al., 2017); BERT, the original Transformer.

    ::

        x ──► (+) ──► N ──► x'
        │      ▲
        └─► F ─┘
    """
    return Placement("post_ln", POST_ADD, POST_ADD)


def pre_ln() -> Placement:
    """Pre-LN (Baevski & Auli 2019; Xiong et al., 2020); GPT-2, Llama, Qwen, Mistral.

    ::

        x ───────────────► (+) ──► x'      identity path from output to input
        └─► N ──► F ───────┘
    """
    return Placement("pre_ln", PRE, PRE)


def sandwich_ln() -> Placement:
    """Sandwich-LN (Ding et al., CogView 2021); GLM-4-0414 (GLM-4 itself is Pre-LN): norm both branch input and output.

    ::

        x ─────────────────────► (+) ──► x'
        └─► N ──► F ──► N ───────┘
    """
    return Placement("sandwich_ln", PERI, PERI)


def peri_ln() -> Placement:
    """Peri-LN (Kim et al., 2025); Gemma 2/3: the Sandwich-LN shape, named and analysed.

    ::

        x ─────────────────────► (+) ──► x'     each branch adds a unit-RMS (times gain) update
        └─► N ──► F ──► N ───────┘
    """
    return Placement("peri_ln", PERI, PERI)


def res_post_norm() -> Placement:
    """Swin-V2 res-post-norm (Liu et al., 2022): the norm moves to the branch output, inside the residual.

    ::

        x ───────────────► (+) ──► x'
        └─► F ──► N ───────┘
    """
    return Placement("res_post_norm", RES_POST, RES_POST)


def reordered_norm() -> Placement:
    """Chameleon / OLMo 2 "reordered norm" (2024): the Swin-V2 scheme, usually with QK-norm.

    ::

        x ───────────────► (+) ──► x'
        └─► F ──► N ───────┘
    """
    return res_post_norm().with_(name="reordered_norm")


def deepnorm(
    n_layers: int, arch: DeepNormArch = DeepNormArch.DECODER, *, n_decoder_layers: int = 0, part: str = "encoder"
) -> Placement:
    """DeepNorm (Wang et al., DeepNet 2022): Post-LN with the stream up-weighted by alpha, branches init by beta.

    ``n_layers`` is N (the encoder depth, or the decoder depth for decoder-only);
    for encoder-decoder pass ``n_decoder_layers`` = M and ``part`` ``"encoder"`` or ``"decoder"``.

    ::

        x ──► ×alpha ──► (+) ──► N ──► x'      v, o, FFN weights ~ Xavier(gain=beta)
        │                 ▲
        └─► F ────────────┘
    """
    if part not in ("encoder", "decoder"):
        raise ValueError(f"part={part!r} must be 'encoder' or 'decoder'")
    c = deepnorm_constants(arch, n_layers, n_decoder_layers)
    alpha, beta = c.alpha, c.beta
    if part == "decoder" and c.decoder is not None:
        alpha, beta = c.decoder
    return Placement("deepnorm", POST_ADD, POST_ADD, residual_alpha=alpha, branch_init_beta=beta)


def hybridnorm() -> Placement:
    """HybridNorm (Zhuo et al., 2025): QKV-norm inside attention, Post-Norm on the FFN.

    ::

        attn:  x ───────────────────────► (+) ──► x'
               └─► A(N(xWq), N(xWk), N(xWv)) ┘
        ffn:   x ──► (+) ──► N ──► x'
               └─► F ─┘
    """
    return Placement("hybridnorm", NONE, POST_ADD, qkv_norm=True)


def layernorm_scaling() -> Placement:
    """LayerNorm Scaling (Sun et al., 2025): Pre-LN with the norm output of layer l times 1/sqrt(l).

    ::

        x ─────────────────────────────► (+) ──► x'
        └─► N ──► ×1/sqrt(l) ──► F ──────┘
    """
    return Placement("layernorm_scaling", PRE, PRE, pre_norm_scale=DepthScale.INV_SQRT_LAYER)


def depth_scaled_sandwich(c_attn: float = 1.0) -> Placement:
    """Depth-scaled sandwich norm (Pangu Ultra, 2025): sandwich with post-norm gains initialised at c/sqrt(L).

    ::

        x ──────────────────────────────────► (+) ──► x'
        └─► N ──► F ──► N (gain0 = c/sqrt(L)) ┘
    """
    return Placement("depth_scaled_sandwich", PERI, PERI, post_gain_init=DepthScale.INV_SQRT_DEPTH, post_gain_c=c_attn)


def parallel(shared_pre_norm: bool = True) -> Placement:
    """Parallel attention + FFN (GPT-J, GPT-NeoX, PaLM, Cohere): one add per block.

    ::

        x ────────────────────► (+) ──► x'
        ├─► N ──► A ───────────► ▲
        └─► N'──► F ───────────► ┘      (N' is N when shared_pre_norm)
    """
    return Placement("parallel", PRE, PRE, parallel=True, shared_pre_norm=shared_pre_norm)


def scaled_residual(multiplier: float) -> Placement:
    """Scaled residual branches (Granite's ``residual_multiplier``): Pre-LN with each branch times m.

    ::

        x ────────────────────► (+) ──► x'
        └─► N ──► F ──► ×m ─────┘
    """
    return Placement("scaled_residual", PRE, PRE, branch_scale=multiplier)


def rezero() -> Placement:
    """ReZero (Bachlechner et al., 2020): no norm; each branch times a scalar alpha initialised at 0.

    ::

        x ────────────────► (+) ──► x'     identity at initialisation
        └─► F ──► ×alpha ───┘
    """
    return Placement("rezero", NONE, NONE, gate=Gate.SCALAR, gate_init=0.0)


def skipinit() -> Placement:
    """SkipInit (De & Smith, 2020): the residual branch times a learned scalar at 0; no norm.

    ::

        x ────────────────► (+) ──► x'     identity at initialisation
        └─► F ──► ×alpha ───┘
    """
    return rezero().with_(name="skipinit")


def layerscale(init_values: float = 1e-5) -> Placement:
    """LayerScale (Touvron et al., CaiT 2021): Pre-LN with a per-channel gain at 1e-5 / 1e-4 on each branch.

    ::

        x ──────────────────────────► (+) ──► x'
        └─► N ──► F ──► ×diag(g) ─────┘
    """
    return Placement("layerscale", PRE, PRE, gate=Gate.VECTOR, gate_init=init_values)


def norm_free() -> Placement:
    """Plain residual with no norm and no gate (use Pre-LN with a DyT/Derf operator for "norm-free" DyT).

    ::

        x ───────────► (+) ──► x'
        └─► F ─────────┘
    """
    return Placement("norm_free", NONE, NONE)


# --------------------------------------------------------------------------- schedules
@dataclass(frozen=True)
class LayerPlan:
    """One layer of a schedule: its placement and, optionally, its own norm operator."""

    placement: Placement
    norm: NormFactory | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.placement, Placement):
            raise TypeError(f"placement={self.placement!r} must be a Placement")
        if self.norm is not None and not callable(self.norm):
            raise TypeError(f"norm={self.norm!r} must be a callable dim -> nn.Module or None")


@dataclass(frozen=True)
class Schedule:
    """Layer index -> placement (and operator). Its length must equal the model depth."""

    layers: tuple[LayerPlan, ...]
    name: str = "schedule"

    def __post_init__(self) -> None:
        items = tuple(p if isinstance(p, LayerPlan) else LayerPlan(p) for p in self.layers)
        if not items:
            raise ValueError("Schedule.layers is empty; give one Placement or LayerPlan per layer")
        object.__setattr__(self, "layers", items)

    @classmethod
    def of(cls, placements: Sequence[Placement | LayerPlan], name: str = "schedule") -> Schedule:
        return cls(tuple(LayerPlan(p) if isinstance(p, Placement) else p for p in placements), name)

    def __len__(self) -> int:
        return len(self.layers)

    def check_depth(self, n_layers: int) -> None:
        if len(self.layers) != n_layers:
            raise ValueError(
                f"schedule {self.name!r} has {len(self.layers)} layers but the model has n_layers={n_layers}; "
                "a schedule needs exactly one entry per layer"
            )


def mix_ln(n_layers: int, post_ln_layers: int | None = None, ratio: float = 0.25) -> Schedule:
    """Mix-LN (Li et al., 2025): Post-LN for the first k layers, Pre-LN after.

    ``k = post_ln_layers`` when given, else ``floor(ratio * n_layers)``: the paper applies Post-LN to the
    first ``floor(alpha * L)`` layers (its code: ``int(L * ratio)``). A shallow model can get ``k = 0``
    for ``ratio > 0`` (``mix_ln(3)`` is all Pre-LN); pass ``post_ln_layers`` to choose k yourself.

    ::

        layers 0 .. k-1 (Post-LN)            layers k .. L-1 (Pre-LN)
        x ──► (+) ──► N ──► x'               x ───────────────► (+) ──► x'
        │      ▲                             └─► N ──► F ───────┘
        └─► F ─┘
    """
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers={n_layers!r} must be an integer >= 1")
    if post_ln_layers is None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
            raise TypeError(f"ratio={ratio!r} must be a float in [0, 1] (the fraction of Post-LN layers)")
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio={ratio!r} must lie in [0, 1] (the fraction of Post-LN layers)")
        k = math.floor(ratio * n_layers)
    else:
        bad = isinstance(post_ln_layers, bool) or not isinstance(post_ln_layers, int)
        if bad or not 0 <= post_ln_layers <= n_layers:
            raise ValueError(f"post_ln_layers={post_ln_layers!r} must lie in [0, n_layers={n_layers}] (an integer)")
        k = post_ln_layers
    return Schedule.of([post_ln() if i < k else pre_ln() for i in range(n_layers)], name=f"mix_ln(k={k})")


def hybridnorm_star(n_layers: int) -> Schedule:
    """HybridNorm* (Zhuo et al., 2025): block 0 is plain Pre-Norm, every later block is HybridNorm."""
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers={n_layers!r} must be an integer >= 1")
    return Schedule.of([pre_ln() if i == 0 else hybridnorm() for i in range(n_layers)], name="hybridnorm_star")
