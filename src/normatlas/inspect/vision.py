"""Inspect a vision encoder's (or a VLM vision tower's) normalization design from its dataflow.

Method: one eager forward of the tower on an image tensor is recorded with the shared
recorder (:func:`normatlas.analysis.record`). The tower's **stages** are found first
(:mod:`.stages`): one residual stream shape per stage, the stages chained by dataflow across
the downsampling layers between them (a ViT has one stage; ConvNeXt, Swin, ResNet have four).
The token-model analysis (:func:`.analyze.analyze`) then reads the blocks of every stage at once,
exactly as for a language model, so the operator, eps, block placement, branch scales, the norm
on the patch embeddings before the first block (``embedding`` role, e.g. CLIP's
``pre_layrnorm``) and the norm on the whole last stream value (``final``) come out unchanged.
Per stage (:class:`StageInfo`): its stream shape and width, layers, operator and placement, the
LayerScale on its branches and its init value, the norms in the downsampling layer that leads
into it (the stem, for the first stage), the norms inside its branches (ConvNeXt's LayerNorm
after the depthwise convolution), its batch-statistics norms, its weight-standardized
convolutions and its response norms (ConvNeXt V2's GRN). What a tower adds after its last
stage is then read off the same graph:

* ``pooled``: a norm whose input is a token subset of the last stream value (CLIP normalizes
  the CLS row: ``post_layernorm``) or an average over its tokens (ConvNeXt's final LayerNorm
  reads the global average), reached from it only through selections, pooling and reshapes;
* ``merger``: a norm on the last stream whose output rows are regrouped into wider rows
  (``view(-1, k*D)``) before anything else reads them (Qwen2-VL's PatchMerger ``ln_q``);
* ``head``: any other norm downstream of the last block (SigLIP's attention-pooling head).

Outside the operator vocabulary: a ``batch_norm`` call whose input is a parameter standardizes
a convolution's weight (BiT's Weight Standardization), counted apart from the batch-statistics
norms on activations; GRN (an L2 norm over the spatial axes divided by its mean over the
channels, multiplied back onto the input) is listed as an ``other`` norm with a note.

Guaranteed property: every field is a fact about the executed computation (which ops ran,
on which tensors), never read from parameter or class names; module paths appear in the
report as labels only.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..analysis.graph import Graph, Ref, record
from ..analysis.ops import CASTS, SHAPE_ONLY
from ..analysis.walk import scalar_of, strip
from ..factory import tower_inputs
from ..spec import EpsPlacement
from ..vocabulary import (
    BranchScale,
    BranchScaling,
    Operator,
    PlacementKind,
    SiteRole,
    branch_scale_word,
    layer_placement_words,
)
from .norms import Site, find_sites
from .report import InspectionReport, NormInfo, SublayerInfo, UntraceableModel
from .stages import (
    Stage,
    attention_bits,
    branch_bits,
    branch_gains,
    find_stages,
    init_value,
    layer_paths,
    merged_stream,
)

__all__ = ["StageInfo", "VisionReport", "default_pixel_values", "inspect_vision", "vision_report"]

_SELECT = frozenset({"getitem", "select", "narrow", "index_select", "squeeze", "unsqueeze"})
_POOL = frozenset({"mean", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "avg_pool1d", "avg_pool2d"})
_BLOCK_ROLES = frozenset({SiteRole.PRE, SiteRole.OUT, SiteRole.POST})
_BATCH_STAT = frozenset({"batch_norm", "instance_norm"})  # fused calls whose statistics span the batch / a sample
_L2 = frozenset({"linalg_vector_norm", "vector_norm", "norm"})


@dataclass(frozen=True)
class StageInfo:
    """One stage of a tower: a run of residual blocks on one stream shape.

    ``operator`` summarises the norms of its blocks (on a branch's input or output, on the stream after
    an add, or inside a branch); ``downsample_norms`` are the norms between the previous stage's last
    stream value and this stage's first (the stem's, for the first stage).
    """

    index: int
    shape: tuple[int, ...]  # the stream value's shape, batch first
    width: int  # channels
    positions: int  # tokens (or spatial positions) per image
    layers: int
    operator: Operator
    placement: PlacementKind
    placement_by_layer: tuple[tuple[PlacementKind, ...], ...]  # each block's sublayers' placements
    branch_scale: frozenset[
        BranchScale
    ]  # its sublayers' distinct scales: LayerScale (per-channel), a learned scalar, constants
    layer_scale_init: float | None  # the value every LayerScale entry holds (a fresh init), else None
    downsample_norms: tuple[Operator, ...]
    inner_norms: int  # norms inside a branch, neither on its input nor on its output
    batch_stat_norms: int  # batch_norm / instance_norm on activations, in its downsampling layer and blocks
    weight_standardization: int  # batch_norm calls on a convolution's weight
    response_norms: int  # GRN


@dataclass
class VisionReport(InspectionReport):
    """:class:`InspectionReport` of a vision tower plus its stages and what follows its blocks.

    ``embedding_norm`` is the norm on the patch(+position) embeddings before the first
    block; ``final_norm`` the norm on every token of the last stream value; ``layers`` counts
    the blocks of every stage and ``hidden_size`` is the last stage's width.
    """

    tokens: int | None = None  # tokens in the (last stage's) residual stream (patches, plus CLS/registers)
    pooled_norm: Operator = Operator.NONE  # norm on a token subset (CLS) or the token average of the last stream
    merger_norm: Operator = Operator.NONE  # norm whose output rows are merged (k tokens -> one row)
    head_norm: Operator = Operator.NONE  # norm inside a pooling head / connector after the blocks
    batch_stat_norms: int = 0  # BatchNorm / InstanceNorm calls on activations: statistics over the batch
    stages: list[StageInfo] = field(default_factory=list)
    layer_scale_init: float | None = None  # the LayerScale init every stage shares, else None
    downsample_norm: Operator = Operator.NONE  # the norms of the downsampling layers between stages
    weight_standardization: int = 0  # convolutions whose weight a batch_norm call standardizes (BiT)
    response_norms: int = 0  # GRN (ConvNeXt V2), listed among the norms as ``other``

    def to_dict(self, detail: bool = True) -> dict[str, Any]:
        """As :meth:`InspectionReport.to_dict`; without ``detail`` the stages become one list per field."""
        d = super().to_dict(detail)
        for sd, stage in zip(d["stages"], self.stages, strict=True):
            sd["branch_scale"] = branch_scale_word(stage.branch_scale)
            sd["placement_by_layer"] = layer_placement_words(stage.placement_by_layer)
        if not detail:
            stages = d.pop("stages")
            d["stages"] = len(stages)
            for key in ("layers", "width", "operator", "placement", "branch_scale", "batch_stat_norms"):
                d[f"stage_{key}"] = [s[key] for s in stages]
            d["stage_downsample_norms"] = ["+".join(s["downsample_norms"]) or "none" for s in stages]
        return d


def default_pixel_values(model: nn.Module, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """A seeded ``(batch, num_channels, image_size, image_size)`` image for a transformers vision config."""
    cfg = getattr(model, "config", None)
    size = getattr(cfg, "image_size", None)
    if isinstance(size, (list, tuple)):
        size = size[0]
    if size is None and isinstance(getattr(cfg, "num_channels", None), int):
        size = 64  # a convolutional net without a fixed input size (ResNet, RegNet) reads any image
    if not isinstance(size, int):
        raise ValueError(
            f"pixel_values is required: {type(model).__name__} has no config.image_size (got {size!r}); "
            "pass an image tensor"
        )
    channels = int(getattr(cfg, "num_channels", 3))
    param = next(model.parameters(), None)
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, channels, size, size, generator=gen).to(dtype)


# ----------------------------------------------------------------------------- after the last stage
def _merges_rows(g: Graph, site: Site) -> bool:
    """The normalized rows (size D) are regrouped into rows of k*D, k > 1, before anything else reads them."""
    stack, seen = [site.output], set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        for u in g.users(i):
            if u.op in ("view", "reshape", "flatten") and u.shape and u.shape[-1] > site.size:
                if u.shape[-1] % site.size == 0:
                    return True
            elif u.op in CASTS:
                stack.append(u.idx)
    return False


def _selects_tokens(g: Graph, site: Site, stream: tuple[int, ...], last: int) -> bool:
    """The site reads fewer rows than the stream, taken from (or averaged over) the stream value ``last``
    through selections, token pooling, reshapes and casts only."""
    shape = g.nodes[site.input].shape
    if shape is None or math.prod(shape) > math.prod(stream):
        return False
    cur, picked, pooled = site.input, False, False
    while True:
        n = g.nodes[cur]
        if n.op in _SELECT | SHAPE_ONLY and n.inputs:
            picked |= n.op in _SELECT
            cur = strip(g, cur, SHAPE_ONLY | _SELECT)
            continue
        if n.op in _POOL and n.inputs:  # an average over the tokens (one position left: as many elements)
            pooled, cur = True, n.inputs[0]
            continue
        fewer = math.prod(shape) < math.prod(stream)
        return ((picked and fewer) or pooled) and n.shape == stream and cur == last


def _vision_roles(g: Graph, report: InspectionReport, last: Stage) -> dict[int, SiteRole]:
    """New roles for the norms after the last stage's last stream value."""
    sites = {s.node: s for s in find_sites(g)}
    roles: dict[int, SiteRole] = {}
    for info in report.norms:
        site = sites.get(info.index)
        if site is None or info.index <= last.last or not _from(g, last.last, site.input):
            continue
        if info.role not in (SiteRole.FINAL, SiteRole.OTHER):
            continue
        if _merges_rows(g, site):
            roles[info.index] = SiteRole.MERGER
        elif info.role is SiteRole.OTHER and _extends_tokens(g, site, last.last):
            roles[info.index] = SiteRole.FINAL
        elif info.role is SiteRole.OTHER:
            roles[info.index] = SiteRole.POOLED if _selects_tokens(g, site, last.shape, last.last) else SiteRole.HEAD
    return roles


def _extends_tokens(g: Graph, site: Site, last: int) -> bool:
    """The site reads the last stream value's tokens concatenated with more rows (DINOv3 ConvNeXt prepends its
    pooled row, then normalises every row): a norm on every token of the last stream value."""
    n = g.nodes[strip(g, site.input, SHAPE_ONLY)]
    return n.op == "cat" and any(strip(g, i, SHAPE_ONLY) == last for i in n.inputs)


def _from(g: Graph, a: int, b: int) -> bool:
    return a == b or g.feeds(a, b)


def _first(norms: list[NormInfo], role: SiteRole) -> Operator:
    return next((n.operator for n in norms if n.role is role), Operator.NONE)


# ----------------------------------------------------------------------------- outside the vocabulary
def _weight_standardization(g: Graph, idx: int) -> bool:
    """A batch_norm / instance_norm call whose input is a parameter: it standardizes a weight."""
    n = g.nodes[idx]
    return bool(n.inputs) and g.nodes[strip(g, n.inputs[0], SHAPE_ONLY)].op == "param"


def _response_norms(g: Graph) -> list[tuple[int, int, float | None]]:
    """GRN: ``x * (r / (mean_c(r) + eps))`` with ``r`` an L2 norm of ``x`` over other axes, kept: (the multiply,
    x, eps)."""
    found = []
    for r in g.nodes:
        if r.op not in _L2 or not r.inputs or r.shape is None:
            continue
        x = strip(g, r.inputs[0])
        for d in g.users(r.idx):
            if d.op != "div" or not d.inputs or d.inputs[0] != r.idx or len(d.inputs) < 2:
                continue
            den, eps = g.nodes[d.inputs[1]], None
            if den.op == "add":
                eps = next((v for a in den.args if not isinstance(a, Ref) and (v := scalar_of(g, a)) is not None), None)
                den = g.nodes[next((i for i in den.inputs if g.nodes[i].op == "mean"), den.idx)]
            if den.op != "mean" or not den.inputs or den.inputs[0] != r.idx:
                continue
            for m in g.users(d.idx):
                if m.op == "mul" and any(strip(g, i) == x for i in m.inputs if i != d.idx):
                    found.append((m.idx, x, eps))
    return found


def _grn_info(g: Graph, node: int, x: int, eps: float | None) -> NormInfo:
    shape = g.nodes[x].shape or (0,)
    return NormInfo(
        node, SiteRole.OTHER, None, g.nodes[node].module, Operator.OTHER, shape[-1], eps,
        EpsPlacement.OUTSIDE_SQRT if eps is not None else None, None, False, None, 1.0, False,
    )  # fmt: skip


# ----------------------------------------------------------------------------- per stage
def _summary(values: Iterable[Operator]) -> Operator:
    kinds = set(values)
    return kinds.pop() if len(kinds) == 1 else Operator.MIXED if kinds else Operator.NONE


def _placement(infos: list[SublayerInfo]) -> PlacementKind:
    kinds = {s.placement for s in infos}
    return kinds.pop() if len(kinds) == 1 else PlacementKind.MIX if kinds else PlacementKind.UNKNOWN


def _width(shape: tuple[int, ...], sizes: list[int]) -> int:
    """The channel count: the size of the norms on the stream itself (``sizes``: a branch's input or output, the
    stream after an add) where it is an axis of the stream, else axis 1 of a 4-d (N, C, H, W) feature map
    (torch's convolution layout), else the last axis."""
    common = Counter(sizes).most_common(1)
    if common and common[0][0] in (shape[1:2] if len(shape) == 4 else ()) + shape[-1:]:
        return common[0][0]
    return shape[1] if len(shape) == 4 else shape[-1]


def _scales(
    g: Graph, stage: Stage, infos: list[SublayerInfo], norm_nodes: frozenset[int]
) -> tuple[list[BranchScale], list[float | None]]:
    """Each sublayer's branch scale (the reader's constants and learned scalings, plus LayerScale found behind a
    view or permute; a norm's own gain is not one) and the init values of the per-channel gains."""
    scales, inits = [], []
    for sub, info in zip(stage.sublayers, infos, strict=True):
        gains = branch_gains(g, sub, norm_nodes)
        scales.append(info.branch_scale | BranchScale.of(kind for kind, _ in gains))
        inits += [init_value(g, p) for kind, p in gains if kind is BranchScaling.PER_CHANNEL]
    return scales, inits


def _stage_info(
    g: Graph, i: int, stage: Stage, infos: list[SublayerInfo], norms: dict[int, NormInfo], grn: list[int]
) -> tuple[StageInfo, list[BranchScale]]:
    own = branch_bits(g, stage.sublayers)
    block = [norms[j] for s in infos for j in (*s.pre, *s.out, *s.post) if j in norms]
    inner = [  # norm layers (a learned gain or bias) inside a branch: not an attention's unit-length q / k
        n
        for n in norms.values()
        if n.role is SiteRole.OTHER and own >> n.index & 1 and n.index not in grn and (n.gain_convention or n.bias)
    ]
    scales, inits = _scales(g, stage, infos, frozenset(norms))
    by_layer: dict[int, list[PlacementKind]] = {}
    for s in infos:
        by_layer.setdefault(s.layer, []).append(s.placement)
    calls = [n.idx for n in g.nodes if n.op in _BATCH_STAT and stage.region >> n.idx & 1]
    ws = sum(1 for c in calls if _weight_standardization(g, c))
    init_set = set(inits)
    width = _width(stage.shape, [n.size for n in block])
    batch = stage.shape[0] if len(stage.shape) >= 3 else 1
    info = StageInfo(
        index=i,
        shape=stage.shape,
        width=width,
        positions=math.prod(stage.shape) // max(1, width * batch),
        layers=len(by_layer),
        operator=_summary([n.operator for n in block + inner]),
        placement=_placement(infos),
        placement_by_layer=tuple(tuple(v) for _, v in sorted(by_layer.items())),
        branch_scale=frozenset(s for s in scales if s),
        layer_scale_init=init_set.pop() if len(init_set) == 1 else None,
        downsample_norms=tuple(n.operator for j, n in sorted(norms.items()) if stage.boundary >> j & 1),
        inner_norms=len(inner),
        batch_stat_norms=len(calls) - ws,
        weight_standardization=ws,
        response_norms=sum(1 for j in grn if stage.region >> j & 1),
    )
    return info, scales


def _stage_infos(
    g: Graph, stages: list[Stage], base: InspectionReport, grn: list[int]
) -> tuple[list[StageInfo], list[SublayerInfo]]:
    """Every stage's :class:`StageInfo`, and the sublayers with the LayerScale the branch walk adds."""
    norms = {n.index: n for n in base.norms}
    out, subs, k = [], [], 0
    for i, stage in enumerate(stages):
        infos = base.sublayers[k : k + len(stage.sublayers)]
        k += len(stage.sublayers)
        info, scales = _stage_info(g, i, stage, infos, norms, grn)
        out.append(info)
        subs += [dataclasses.replace(s, branch_scale=sc) for s, sc in zip(infos, scales, strict=True)]
    return out, subs


# ----------------------------------------------------------------------------- entry points
def inspect_vision(
    model: nn.Module,
    pixel_values: torch.Tensor | None = None,
    *,
    name: str | None = None,
    probe: bool = True,
    **inputs: Any,
) -> VisionReport:
    """Report a vision tower's normalization design from one recorded forward on an image.

    ``pixel_values`` is passed as the first positional argument; ``inputs`` go in as keyword
    arguments (e.g. ``grid_thw`` for Qwen2-VL's tower, whose first argument is the flattened
    patch tensor). With neither, a transformers vision model gets the seeded input layout its
    config and signature ask for (:func:`normatlas.factory.tower_inputs.tower_inputs`), any other model a
    seeded image of ``config.image_size``. Raises :class:`~normatlas.inspect.UntraceableModel` when the
    model does not run on these inputs.
    """
    t0 = time.perf_counter()
    label = name or type(model).__name__
    if pixel_values is None and not inputs and callable(getattr(getattr(model, "config", None), "to_dict", None)):
        try:
            inputs = tower_inputs(model)
        except ValueError as exc:
            raise UntraceableModel(f"cannot run {label}: {exc}") from exc
        pixel_values = inputs.pop("pixel_values")
    if pixel_values is None:
        pixel_values = default_pixel_values(model)
    if not isinstance(pixel_values, torch.Tensor):
        raise TypeError(f"pixel_values must be a torch.Tensor, got {type(pixel_values).__name__}")
    if not pixel_values.is_floating_point():
        raise ValueError(f"pixel_values must be a floating-point tensor, got dtype {pixel_values.dtype}")
    model = model.eval()
    try:
        graph = record(model, (pixel_values,), inputs)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise UntraceableModel(f"cannot run {label} on pixel_values: {type(exc).__name__}: {first}") from exc
    report = vision_report(model, graph, label, probe=probe)
    report.seconds = time.perf_counter() - t0
    return report


def _read(graph: Graph, label: str) -> tuple[InspectionReport, list[Stage], Graph]:
    """The shared reader over every stage at once (the plain reader when no residual add is found), and the
    graph it read (its layer grouping, :func:`.stages.layer_paths`, carried as the list-element paths)."""
    from .analyze import analyze

    sites = find_sites(graph)
    stages = find_stages(graph, sites)
    if not stages:
        return analyze(graph, label), [], graph
    paths = layer_paths(graph, stages, attention_bits(graph))
    g = Graph(graph.nodes, graph.outputs, paths or frozenset(), graph.spans, graph.tensors, graph.model)
    return analyze(g, label, stream=merged_stream(g, stages, sites)), stages, g


def vision_report(model: nn.Module, graph: Graph, label: str, *, probe: bool = True) -> VisionReport:
    """The :class:`VisionReport` of a recorded tower run (the whole graph, or a VLM's tower part of one)."""
    from .probe import check_sites

    base, stages, g = _read(graph, label)
    if probe:
        check_sites(model, g, base)
    grn = _response_norms(g)
    base.norms = sorted([*base.norms, *(_grn_info(g, *r) for r in grn)], key=lambda n: n.index)
    notes: list[str] = []
    if grn:
        notes.append(
            f"{len(grn)} GRN (global response normalization: an L2 norm over the spatial axes divided by its mean "
            "over the channels, multiplied back onto the input) listed as 'other' norms"
        )
    infos, subs = _stage_infos(g, stages, base, [m for m, _, _ in grn]) if stages else ([], base.sublayers)
    roles = _vision_roles(g, base, stages[-1]) if stages else {}
    if not stages:
        notes.append("no residual blocks found: nothing after the blocks classified")
    norms = [dataclasses.replace(n, role=roles[n.index]) if n.index in roles else n for n in base.norms]
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(InspectionReport)}
    fields.update(norms=norms, sublayers=subs, notes=[*base.notes, *notes])
    fields["final_norm"] = _first(norms, SiteRole.FINAL)  # a norm on the last stream that merges rows is none
    if infos:
        _summarise_stages(fields, base, infos, subs)
    calls = [n.idx for n in g.nodes if n.op in _BATCH_STAT]
    ws = sum(1 for c in calls if _weight_standardization(g, c))
    downsample = [op for st in infos[1:] for op in st.downsample_norms]
    inits = {
        st.layer_scale_init for st in infos if any(BranchScaling.PER_CHANNEL in s.learned for s in st.branch_scale)
    }
    return VisionReport(
        **fields,
        tokens=infos[-1].positions if infos else None,
        pooled_norm=_first(norms, SiteRole.POOLED),
        merger_norm=_first(norms, SiteRole.MERGER),
        head_norm=_first(norms, SiteRole.HEAD),
        batch_stat_norms=len(calls) - ws,
        stages=infos,
        layer_scale_init=inits.pop() if len(inits) == 1 else None,
        downsample_norm=_summary(downsample),
        weight_standardization=ws,
        response_norms=len(grn),
    )


def _summarise_stages(
    fields: dict[str, Any], base: InspectionReport, infos: list[StageInfo], subs: list[SublayerInfo]
) -> None:
    """The report-wide fields the stages change: the width handed on, the branch scales the branch walk adds,
    and the operator over the norms inside the branches too (ConvNeXt's only block norm is one)."""
    fields["hidden_size"] = infos[-1].width
    union = BranchScale()
    for s in subs:
        union |= s.branch_scale
    fields["branch_scale"] = frozenset({union}) if union else frozenset()  # the parts of every sublayer's, as one
    ops = [st.operator for st in infos if st.operator is not Operator.NONE]
    if fields["final_norm"] is not Operator.NONE:
        ops.append(fields["final_norm"])
    fields["operator"] = _summary(ops)
    inner = [n for n in base.norms if n.role is SiteRole.OTHER and n.operator is not Operator.OTHER]
    if base.operator is Operator.NONE and inner and sum(st.inner_norms for st in infos):
        fields["eps"] = Counter(n.eps for n in inner).most_common(1)[0][0]
        fields["eps_placement"] = inner[0].eps_placement
        fields["gain_convention"] = inner[0].gain_convention
        fields["bias"] = any(n.bias for n in inner)
