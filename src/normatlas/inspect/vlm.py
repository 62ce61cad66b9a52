"""Inspect an image-text model whole: its vision tower, its connector and its language model, from one run.

Method: one eager forward of the whole model on a synthetic image + text batch (:mod:`.vlm_build`) is recorded
with the shared recorder. The graph is then split by dataflow alone:

* the **image part** is every value computed from the pixel input and not from the text embedding (the
  ``embedding`` lookup fed by ``input_ids``); its **entries** are the image values the rest of the run reads;
* the **tower** is the image part read as a vision encoder (:func:`.vision.vision_report` on the graph restricted
  to the image part): operator, placement, LayerScale, the final norm, plus the batch-statistics norms it runs;
* the **tap** is the last stream value of the tower (a residual add, or the final / post norm on one) that feeds
  an entry: LLaVA reads its tower's second-to-last layer, so the tap is that layer's output;
* the **connector** is what lies between the tap and the entries. Its kind is read off its ops: an attention
  inside it (learned queries attending to the image: a resampler or Q-Former), a pooling op, rows regrouped into
  wider rows (a patch merger or pixel shuffle: the row width grows, the element count does not), two projections
  with an activation between (an MLP), one projection (linear); its norms are the norms found inside it;
* the **language model** is the graph restricted to the text embedding's descendants and what feeds them, image
  part cut (:func:`.analyze.analyze`); how the image reaches it (**injection**) is read off the entries' readers:
  into the embedding stream (its first stream value descends from an entry), as keys / values of cross-attention
  layers (gated when a ``tanh`` of a parameter scales the branch), or as discrete token ids (an integer entry).

Guaranteed property: every field is a fact of the executed computation; module paths are labels only.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..analysis.graph import Graph, Node, record
from ..analysis.ops import PROJECTIONS, SHAPE_ONLY, SHAPES
from ..vocabulary import Operator
from .norms import find_sites
from .report import InspectionReport, _plain
from .vision import _BATCH_STAT, VisionReport, vision_report

__all__ = [
    "ConnectorInfo",
    "ConnectorKind",
    "Injection",
    "VLMReport",
    "inspect_vlm",
    "inspect_vlm_target",
    "is_vision_type",
    "is_vlm_type",
]

_ACTIVATIONS = frozenset({"gelu", "silu", "relu", "tanh", "sigmoid", "mish", "relu6", "leaky_relu", "hardswish"})
_POOLS = frozenset(
    {"avg_pool1d", "avg_pool2d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "max_pool2d", "interpolate"}
)
_ATTENTION = frozenset({"softmax", "scaled_dot_product_attention"})


class ConnectorKind(enum.Enum):
    """What maps the tower's features into the language model (read off the connector's ops)."""

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


@dataclass
class ConnectorInfo:
    """The connector: its kind, its norms (in order), projections, activation, and the token counts around it."""

    kind: ConnectorKind
    norms: list[Operator] = field(default_factory=list)
    projections: int = 0
    activation: bool = False
    tokens_in: int | None = None  # rows at the tap
    tokens_out: int | None = None  # rows at the entries
    row_merge: int | None = None  # k when k rows become one row (k times the width, or a strided projection)
    scale: float | None = None  # a constant multiplying the connector's output (PaliGemma: 1/sqrt(width))
    modules: list[str] = field(default_factory=list)  # labels only

    @property
    def norm(self) -> Operator:
        """The connector's norm (the first; ``none`` without one)."""
        return self.norms[0] if self.norms else Operator.NONE


@dataclass
class VLMReport:
    """The three parts of an image-text model, each from the one recorded run."""

    model: str
    vision: VisionReport
    connector: ConnectorInfo
    language: InspectionReport
    injection: Injection
    image_tokens: int  # rows of image features the language model reads
    tower_layers_run: int = 0  # tower layers the language model's input depends on (LLaVA: all but the last)
    batch_stat_norms: int = 0  # batch-statistics norms in the tower (BatchNorm / InstanceNorm calls)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def part_rows(self) -> dict[str, list[dict[str, Any]]]:
        """Three field / value tables: the vision tower, the connector, the language model."""
        v, c, lm = self.vision, self.connector, self.language
        tower = {
            "operator": v.operator.value,
            "placement": v.placement.value,
            "layers (run / built)": f"{self.tower_layers_run} / {v.layers}",
            "layer scale": v.branch_scale,
            "batch-statistics norms": self.batch_stat_norms,
            "embedding norm": v.embedding_norm.value,
            "final norm": v.final_norm.value,
            "pooled norm": v.pooled_norm.value,
            "tokens": v.tokens,
        }
        conn = {
            "kind": c.kind.value,
            "norms": ", ".join(o.value for o in c.norms) or "none",
            "projections": c.projections,
            "activation": c.activation,
            "tokens in -> out": f"{c.tokens_in} -> {c.tokens_out}",
            "rows merged": c.row_merge,
            "output scale": c.scale,
            "injection": self.injection.value,
            "modules (labels)": ", ".join(c.modules[:4]) + (" ..." if len(c.modules) > 4 else ""),
        }
        lang = {
            "operator": lm.operator.value,
            "placement": lm.placement.value,
            "layers": lm.layers,
            "qk_norm": lm.qk_norm.value,
            "final norm": lm.final_norm.value,
            "embedding scale": lm.embedding_scale,
            "gain convention": lm.gain_convention.value if lm.gain_convention else None,
        }
        return {
            key: [{"field": k, "value": val} for k, val in part.items()]
            for key, part in (("vision tower", tower), ("connector", conn), ("language model", lang))
        }

    def summary_row(self) -> dict[str, Any]:
        """One flat row of the three parts (for comparing several models)."""
        v, c, lm = self.vision, self.connector, self.language
        return {
            "model": self.model,
            "tower": f"{v.operator.value} {v.placement.value}",
            "tower final": v.final_norm.value,
            "layer scale": v.branch_scale,
            "batch-stat": self.batch_stat_norms,
            "connector": c.kind.value,
            "connector norm": ", ".join(o.value for o in c.norms) or "none",
            "injection": self.injection.value,
            "lm": f"{lm.operator.value} {lm.placement.value}",
            "lm qk_norm": lm.qk_norm.value,
            "image tokens": self.image_tokens,
        }

    def check_row(self) -> dict[str, Any]:
        """The language model's summary row plus the atlas's part fields (``matrix --check`` compares them):
        the tower's operator, the connector's kind (a gated cross-attention injection names the connector)
        and its first norm."""
        gated = self.injection is Injection.GATED_CROSS_ATTENTION
        return {
            **self.language.summary_row(),
            "model": self.model,
            "vision_tower_norm": self.vision.operator.value,
            "connector": "gated-cross-attention" if gated else self.connector.kind.value,
            "connector_norm": self.connector.norm.value,
        }

    def to_dict(self, detail: bool = False) -> dict[str, Any]:
        """JSON-ready: the three parts (the tower and language model as their report dicts)."""
        return {
            "model": self.model,
            "vision": self.vision.to_dict(detail=detail),
            "connector": _plain({**self.connector.__dict__, "norm": self.connector.norm}),
            "language": self.language.to_dict(detail=detail),
            "injection": self.injection.value,
            "image_tokens": self.image_tokens,
            "tower_layers_run": self.tower_layers_run,
            "batch_stat_norms": self.batch_stat_norms,
            "notes": list(self.notes),
            "seconds": self.seconds,
        }


# ----------------------------------------------------------------------------- splitting the graph
def _desc(g: Graph, root: int) -> int:
    """Bitset of the nodes computed from ``root`` (``root`` included)."""
    return sum(1 << n.idx for n in g.nodes if n.idx == root or g.feeds(root, n.idx))


def _restricted(g: Graph, keep: int) -> Graph:
    """The graph with every node outside ``keep`` a bare leaf (same indices): what it computed is cut off."""
    nodes = [
        n if keep >> n.idx & 1 else Node(n.idx, "leaf", (), {}, (), n.shape, n.dtype, n.module, n.scope)
        for n in g.nodes
    ]
    outs = tuple(i for i in g.outputs if keep >> i & 1)
    return Graph(nodes, outs, g.list_children, g.spans, g.tensors, g.model)


def _closure(g: Graph, bits: int) -> int:
    """``bits`` and every ancestor of them."""
    out = bits
    for n in g.nodes:
        if bits >> n.idx & 1:
            out |= g.anc(n.idx)
    return out


def _input_node(g: Graph, tensor: torch.Tensor) -> int:
    for n in g.nodes:
        if n.op == "input" and g.tensors.get(n.idx) is tensor:
            return n.idx
    raise ValueError("the input tensor was not read by the recorded run")


def _text_embedding(g: Graph, ids: int) -> int:
    for n in g.nodes:
        if n.op == "embedding" and (ids in n.inputs or g.feeds(ids, n.idx)):
            return n.idx
    raise ValueError("no embedding lookup reads input_ids: the language model's stream cannot be found")


def _entries(g: Graph, image: int) -> list[int]:
    """Image-part values read outside the image part."""
    return [n.idx for n in g.nodes if image >> n.idx & 1 and any(not image >> u.idx & 1 for u in g.users(n.idx))]


def _floating(g: Graph, idx: int) -> bool:
    dtype = g.nodes[idx].dtype
    return dtype is not None and dtype.is_floating_point


def _joined(g: Graph, image: int, entries: list[int]) -> int:
    """The last image value every entry is computed from: the connector's output. Cross-attention layers project
    one image feature tensor into keys and values of their own (each an entry): those projections belong to the
    language model's layers, and the features they share are what the connector hands over."""
    for n in reversed(g.nodes):
        if image >> n.idx & 1 and all(e == n.idx or g.feeds(n.idx, e) for e in entries):
            return n.idx
    return max(entries)


def _bits(idx: list[int]) -> int:
    return sum(1 << i for i in idx)


def _rows(shape: tuple[int, ...] | None) -> int | None:
    if not shape or len(shape) < 2:
        return None
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows


# ----------------------------------------------------------------------------- the tower and its tap
def _tap(g: Graph, gv: Graph, vision: VisionReport, entries: list[int]) -> tuple[int | None, int]:
    """The last stream value of the tower that feeds an entry, and how many tower layers it depends on."""
    from .residual import find_stream, layer_of

    sites = find_sites(gv)
    stream = find_stream(gv, sites)
    by_node = {s.node: s for s in sites}
    width = stream.shape[-1]  # a norm over wider rows (merged tokens) is the connector's, not the tower's
    ends = {
        n.index for n in vision.norms if n.role.value in ("final", "post") and n.index in by_node and n.size == width
    }
    cands = [sub.adds[-1] for sub in stream.sublayers] + [by_node[i].output for i in ends]
    feeding = [c for c in cands if any(c == e or g.feeds(c, e) for e in entries)]
    if not feeding:
        return None, 0
    tap = max(feeding)
    keys: dict[str, int] = {}
    layers = {
        layer_of(gv, sub.adds[-1], keys)
        for sub in stream.sublayers
        if sub.adds[-1] == tap or g.feeds(sub.adds[-1], tap)
    }
    return tap, len(layers)


def _batch_stat_norms(gv: Graph, image: int) -> int:
    return sum(1 for n in gv.nodes if image >> n.idx & 1 and n.op in _BATCH_STAT)


# ----------------------------------------------------------------------------- the connector
def _by_param(g: Graph, n: Node) -> bool:
    from ..analysis.walk import strip

    return any(g.nodes[strip(g, i, SHAPE_ONLY)].op == "param" for i in n.inputs)


def _widens_rows(nodes: list[Node], width: int) -> bool:
    """Rows of ``width`` regrouped into rows of k * width (same elements, wider rows: a patch merger, a pixel
    shuffle, an unfold)."""
    widest = max(
        (n.shape[-1] for n in nodes if (n.op in SHAPES or n.op in ("unfold", "t")) and n.shape and n.inputs),
        default=0,
    )
    return widest > width and widest % width == 0


def _attends(g: Graph, nodes: list[Node]) -> bool:
    """An attention: a fused attention call, or a softmax over a product of two activations (q k^T)."""
    from ..analysis.walk import strip

    for n in nodes:
        if n.op == "scaled_dot_product_attention":
            return True
        if n.op == "softmax" and n.inputs:
            src = g.nodes[strip(g, n.inputs[0], SHAPE_ONLY)]
            activations = [i for i in src.inputs if g.nodes[strip(g, i, SHAPE_ONLY)].op != "param"]
            if src.op in ("matmul", "bmm", "einsum", "baddbmm") and activations:
                return True
    return False


def _soft_tokens(g: Graph, nodes: list[Node]) -> bool:
    """A softmax over a projection by a parameter whose output is multiplied by a parameter table."""
    from ..analysis.walk import strip

    for n in nodes:
        if n.op == "softmax" and n.inputs and _by_param(g, g.nodes[strip(g, n.inputs[0], SHAPE_ONLY)]):
            later = [m for m in nodes if m.idx > n.idx and g.feeds(n.idx, m.idx)]
            if any(m.op in ("matmul", "mm", "einsum") and _by_param(g, m) for m in later):
                return True
    return False


def _output_scale(g: Graph, entry: int, bits: int) -> float | None:
    """A constant multiplying the connector's output, walking back from the entry through views and casts."""
    from ..analysis.walk import scalar_mul, strip

    scale, cur = 1.0, strip(g, entry, SHAPE_ONLY)
    while bits >> cur & 1 and (sm := scalar_mul(g, g.nodes[cur])) is not None:
        scale *= sm[1]
        cur = strip(g, sm[0], SHAPE_ONLY)
    return scale if scale != 1.0 else None


def _connector(g: Graph, gv: Graph, bits: int, tap: int | None, entries: list[int]) -> ConnectorInfo:
    nodes = [n for n in g.nodes if bits >> n.idx & 1]
    ops = {n.op for n in nodes}
    shape = g.nodes[tap].shape if tap is not None else None
    width = shape[-1] if shape else 0
    main = max(entries, key=lambda e: (_floating(g, e), e))
    rows = (_rows(g.nodes[tap].shape) if tap is not None else None, _rows(g.nodes[main].shape))
    info = ConnectorInfo(
        ConnectorKind.NONE,
        norms=[s.operator for s in find_sites(gv) if bits >> s.node & 1],
        projections=sum(1 for n in nodes if (n.op in PROJECTIONS or n.op == "matmul") and _by_param(g, n)),
        activation=bool(ops & _ACTIVATIONS),
        tokens_in=rows[0],
        tokens_out=rows[1],
        scale=_output_scale(g, main, bits),
        modules=sorted({n.module for n in nodes if n.module}),
    )
    if not all(_floating(g, e) for e in entries):
        info.kind = ConnectorKind.VQ_TOKENS
    elif _attends(g, nodes):
        info.kind = ConnectorKind.RESAMPLER
    elif _soft_tokens(g, nodes):
        info.kind = ConnectorKind.SOFT_TOKENS
    elif ops & _POOLS:
        info.kind = ConnectorKind.POOLING
    elif width and (_widens_rows(nodes, width) or (rows[0] and rows[1] and rows[0] >= 2 * rows[1])):
        info.kind = ConnectorKind.PATCH_MERGER  # regrouped rows, or k rows into one by a strided projection
    elif info.projections >= 2 and info.activation:
        info.kind = ConnectorKind.MLP
    elif info.projections >= 1:
        info.kind = ConnectorKind.LINEAR
    if info.kind in (ConnectorKind.PATCH_MERGER, ConnectorKind.POOLING) and rows[0] and rows[1]:
        info.row_merge = rows[0] // rows[1]
    return info


# ----------------------------------------------------------------------------- the language model
def _injection(g: Graph, gl: Graph, text: int, entries: list[int]) -> Injection:
    from .residual import find_stream

    if not all(_floating(g, e) for e in entries):
        return Injection.TOKENS
    stream = find_stream(gl, find_sites(gl))
    first = stream.sublayers[0].source if stream.sublayers else None
    if first is not None and any(g.feeds(e, first) for e in entries):
        return Injection.EMBEDDING_STREAM
    lm = _desc(g, text)
    gated = any(
        n.op == "tanh"
        and n.inputs
        and g.nodes[n.inputs[0]].op == "param"
        and any(lm >> u.idx & 1 for u in g.users(n.idx))
        for n in g.nodes
    )  # a tanh of a parameter scaling a language-model value: Flamingo's gate
    return Injection.GATED_CROSS_ATTENTION if gated else Injection.CROSS_ATTENTION


# ----------------------------------------------------------------------------- entry points
def inspect_vlm(
    model: nn.Module, inputs: dict[str, Any] | None = None, *, name: str | None = None, probe: bool = True
) -> VLMReport:
    """Report an image-text model's tower, connector and language model from one recorded forward.

    ``inputs`` are keyword inputs of ``model.forward`` holding ``input_ids`` and ``pixel_values`` (default: the
    synthetic batch of :func:`.vlm_build.vlm_inputs`). Raises :class:`~normatlas.inspect.UntraceableModel` when
    the model does not run on them, ``ValueError`` when the run has no image part or no text embedding.
    """
    from . import UntraceableModel
    from .analyze import analyze
    from .probe import check_sites
    from .residual import scale_after
    from .vlm_build import vlm_inputs

    t0 = time.perf_counter()
    inputs = vlm_inputs(model) if inputs is None else inputs
    for key in ("input_ids", "pixel_values"):
        if not isinstance(inputs.get(key) if isinstance(inputs, dict) else None, torch.Tensor):
            raise ValueError(f"inputs must be a dict holding a tensor {key!r}, got keys {sorted(inputs or {})}")
    label = name or type(model).__name__
    try:
        g = record(model.eval(), inputs)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise UntraceableModel(f"cannot run {label} on an image + text: {type(exc).__name__}: {first}") from exc
    text = _text_embedding(g, _input_node(g, inputs["input_ids"]))
    image = _desc(g, _input_node(g, inputs["pixel_values"])) & ~_desc(g, text)
    entries = _entries(g, image)
    if not entries:
        raise ValueError(f"{label}: nothing computed from pixel_values reaches the language model")
    injection_entries, entries = entries, [_joined(g, image, entries)]
    gv = _restricted(g, _closure(g, image))
    vision = vision_report(model, gv, f"{label} / vision tower", probe=probe)
    tap, layers_run = _tap(g, gv, vision, entries)
    cut = _restricted(g, ~image)
    gl = _restricted(cut, _closure(cut, _desc(cut, text)))
    language = analyze(gl, f"{label} / language model")
    if language.embedding_scale is None:  # the walk back from the first stream value stops at the merge
        language.embedding_scale = scale_after(g, text)
    if probe:
        check_sites(model, gl, language)
    conn_bits = _closure(g, _bits(entries)) & image & ~(_closure(g, 1 << tap) if tap is not None else 0)
    connector = _connector(g, gv, conn_bits, tap, entries)
    report = VLMReport(
        label,
        vision,
        connector,
        language,
        _injection(g, gl, text, injection_entries),
        connector.tokens_out or 0,
        tower_layers_run=layers_run,
        batch_stat_norms=_batch_stat_norms(gv, image),
    )
    if tap is None:
        report.notes.append("no tower stream value feeds the language model: the connector is the whole image part")
    report.seconds = time.perf_counter() - t0
    return report


def inspect_vlm_target(model_type: str, *, seed: int = 0, probe: bool = True) -> VLMReport:
    """Build a tiny image-text model of a transformers ``model_type`` and inspect it whole."""
    from .vlm_build import build_vlm, vlm_inputs

    model = build_vlm(model_type, seed=seed)
    return inspect_vlm(model, vlm_inputs(model, seed=seed), name=model_type, probe=probe)


def is_vision_type(model_type: str) -> bool:
    """Whether ``model_type``'s config describes an image encoder alone: image channels, no vocabulary, no
    text config (a transformers config fact, not a name)."""
    from transformers import AutoConfig

    try:
        d = AutoConfig.for_model(model_type).to_dict()
    except Exception:
        return False
    return "num_channels" in d and "vocab_size" not in d and "text_config" not in d


def is_vlm_type(model_type: str) -> bool:
    """Whether transformers registers ``model_type`` as an image-text-to-text model with a vision tower config."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return False
    try:
        return getattr(AutoConfig.for_model(model_type), "vision_config", None) is not None
    except Exception:
        return False
