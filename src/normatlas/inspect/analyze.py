"""Read a model's normalization design off its recorded dataflow graph, in named phases.

1. **sites** (:func:`.norms.find_sites`): every normalization, by its arithmetic;
2. **stream** (:func:`.residual.find_stream`): the residual stream and its sublayers;
3. **attention** (:func:`.attention.find_cores`): attention cores and the norms on q / k / v;
4. **placement** (:func:`.residual.place_norms`): each sublayer's kind and its pre / out / post norms;
5. **ends** (:func:`.residual.final_norm`, :func:`.residual.embedding`): the final norm, the
   embedding norm and scaling, a final logit soft-cap;
6. **report** (this module): per-site, per-sublayer and per-attention records, then the summary
   fields, each a value of the design vocabulary (:mod:`normatlas.vocabulary`).

Everything is structural: module paths are labels in the report, never read to decide.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from typing import Any, TypeVar

from ..analysis.graph import Graph
from ..analysis.ops import SHAPE_ONLY
from ..analysis.walk import scalar_mul, strip
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
)
from .attention import Core, find_cores, qk_kind, rope_order, trig_bits
from .norms import Site, find_sites
from .report import AttentionInfo, InspectionReport, NormInfo, SublayerInfo
from .residual import (
    Stream,
    Sublayer,
    embedding,
    final_norm,
    find_stream,
    layer_of,
    place_norms,
    scale_after,
    split_stacks,
    stream_root,
)

__all__ = ["analyze"]

T = TypeVar("T")


def analyze(
    g: Graph, name: str = "model", tracer: str = "torch_function", *, stream: Stream | None = None
) -> InspectionReport:
    """Derive the :class:`InspectionReport` of a recorded graph (``stream``: the residual stream when the caller
    has found it, e.g. a staged vision tower's stages merged; default :func:`.residual.find_stream`). A stream of
    two stacks (:func:`.residual.split_stacks`: an encoder and the decoder that cross-attends to it) is read stack
    by stack: the report is the last stack's (the decoder's) and its ``encoder`` the stack it reads."""
    sites = find_sites(g)
    stream = find_stream(g, sites) if stream is None else stream
    trig = trig_bits(g)
    subs = stream.sublayers
    stream_inputs = {strip(g, s.source, SHAPE_ONLY) for s in subs} | {strip(g, s.adds[-1], SHAPE_ONLY) for s in subs}

    def cores_of(stacks: list[Stream]) -> list[Core]:
        starts = [st.sublayers[0].source for st in stacks if st.sublayers]
        return find_cores(g, sites, sum(1 << s for s in set(starts)), stream_inputs, trig) if subs else []

    stacks = split_stacks(g, stream)
    cores = cores_of(stacks)
    owner = _core_stacks(g, cores, stacks)
    if len(stacks) > 1 and not _cross_attends(g, cores, owner, stacks):
        # a later branch reads an earlier stream value without attending to it (Zamba's shared blocks read the
        # first embeddings beside the stream): one stack, not an encoder and a decoder
        stacks = [stream]
        cores = cores_of(stacks)
        owner = _core_stacks(g, cores, stacks)
    reads = [
        _read_stack(g, sites, st, [c for c, k in zip(cores, owner, strict=True) if k == i], trig, f"{name}", tracer)
        for i, st in enumerate(stacks)
    ]
    report, roles = reads[-1]
    if len(reads) > 1:
        enc, enc_roles = reads[-2]
        enc.model = f"{name} / encoder"
        enc.norms = [n for n in enc.norms if n.index in enc_roles]
        report.norms = [_norm_info(s, {**enc_roles, **roles}) for s in sites if s.node not in enc_roles]
        report.encoder = enc
        report.stack = "decoder"
        enc.stack = "encoder"
        if len(reads) > 2:
            report.notes.append(f"{len(reads)} stacks: the last two are reported (decoder and encoder)")
    return report


def _cross_attends(g: Graph, cores: list[Core], owner: list[int], stacks: list[Stream]) -> bool:
    """Whether every stack after the first holds an attention whose keys come from the stack before it and not
    from its own first stream value (a decoder's cross-attention to its encoder's output)."""
    for i in range(1, len(stacks)):
        if not stacks[i].sublayers or not stacks[i - 1].sublayers:
            return False
        start, before = stacks[i].sublayers[0].source, stacks[i - 1].sublayers[-1].adds[-1]
        mine = [c for c, k in zip(cores, owner, strict=True) if k == i and c.k >= 0]
        if not any((c.k == before or g.feeds(before, c.k)) and not (c.k == start or g.feeds(start, c.k)) for c in mine):
            return False
    return True


def _core_stacks(g: Graph, cores: list[Core], stacks: list[Stream]) -> list[int]:
    """The stack each attention core belongs to: the first whose sublayer branches it feeds (-1: none)."""
    owner = []
    for core in cores:
        here = -1
        for i, st in enumerate(stacks):
            if any(g.feeds(core.node, b) or core.node == b for sub in st.sublayers for b in sub.branches):
                here = i
                break
        owner.append(here)
    return owner


def _read_stack(
    g: Graph, sites: list[Site], stream: Stream, cores: list[Core], trig: int, name: str, tracer: str
) -> tuple[InspectionReport, _Roles]:
    """One stack's report and the roles it gives its norm sites."""
    subs = stream.sublayers
    attn_bits = sum(1 << c.node for c in cores)
    layers: dict[str, int] = {}  # layer container path -> layer index, shared by sublayers and attention
    place_norms(g, stream, attn_bits, layers, {c.node: c.k for c in cores})
    final = final_norm(g, stream)
    emb_scale, emb_norm = embedding(g, stream, through_joins=True)
    if emb_scale is None and subs:  # a scale the walk back cannot reach: read forwards from the lookups (the first
        lookups = (n.idx for n in g.nodes if n.op == "embedding" and g.feeds(n.idx, subs[0].source))  # scaled one:
        emb_scale = next(
            (x for i in lookups if (x := scale_after(g, i)) is not None), None
        )  # FSMT looks up positions first
    roles = _roles(subs, final, emb_norm)
    cross = {c.node for c in cores if subs and not (c.k == subs[0].source or g.feeds(subs[0].source, c.k))}
    attention = _attention_infos(g, cores, roles, trig, layers, cross)
    sub_infos = [_sublayer_info(s) for s in subs]
    notes: list[str] = []
    as_pre = _embedding_norm_as_pre(g, subs, sub_infos, emb_norm)
    if as_pre:
        notes.append(
            f"layer {subs[0].layer}'s {subs[0].kind.value} sublayer has no pre-norm of its own: the embedding norm "
            f"feeds it, so it reads as {sub_infos[0].placement.value} and the summary keeps the other layers' scheme"
        )
    report = InspectionReport(
        model=name,
        tracer=tracer,
        layers=len({s.layer for s in subs}),
        hidden_size=stream.shape[-1],
        **_norm_summary(sites, roles, notes),
        **_placement_summary(stream, _as_pre(sub_infos) if as_pre else sub_infos),
        embedding_norm_as_pre=as_pre,
        **_attention_summary(attention),
        final_norm=final.operator if final else Operator.NONE,
        final_logit_softcap=_logit_cap(g, final),
        embedding_scale=emb_scale,
        embedding_norm=emb_norm.operator if emb_norm else Operator.NONE,
        norms=[_norm_info(s, roles) for s in sites],
        sublayers=sub_infos,
        attention=attention,
        notes=notes,
    )
    return report, roles


# ----------------------------------------------------------------------------- per-site records
_Roles = dict[int, tuple[SiteRole, int | None]]  # site node -> (role, layer)


def _roles(subs: list[Sublayer], final: Site | None, emb_norm: Site | None) -> _Roles:
    roles: _Roles = {}
    for sub in subs:
        for role, ss in ((SiteRole.PRE, sub.pre), (SiteRole.OUT, sub.out), (SiteRole.POST, sub.post)):
            for s in ss:
                roles[s.node] = (role, sub.layer)
    if final is not None:
        roles[final.node] = (SiteRole.FINAL, None)
    if emb_norm is not None:
        roles[emb_norm.node] = (SiteRole.EMBEDDING, None)
    return roles


def _attention_infos(
    g: Graph, cores: list[Core], roles: _Roles, trig: int, keys: dict[str, int], cross: set[int]
) -> list[AttentionInfo]:
    out: list[AttentionInfo] = []
    for core in cores:
        layer = layer_of(g, core.node, keys)
        qk = [*core.norms["q"], *core.norms["k"]]
        for s, _ in qk:
            roles[s.node] = (SiteRole.QK, layer)
        for s, _ in core.norms["v"]:
            roles[s.node] = (SiteRole.V, layer)
        out.append(
            AttentionInfo(
                layer if layer is not None else len(out),
                qk_kind([s for s, _ in qk], core.head_dim),
                rope_order(g, qk, trig),
                bool(core.norms["v"]),
                core.softcap,
                core.node in cross,
            )
        )
    return out


def _norm_info(s: Site, roles: _Roles) -> NormInfo:
    role, layer = roles.get(s.node, (SiteRole.OTHER, None))
    return NormInfo(
        s.node, role, layer, s.module, s.operator, s.size, s.eps, s.eps_placement,
        s.gain_convention if s.gain else None, s.bias, s.cast_order, s.output_scale, s.fused, s.probe,
    )  # fmt: skip


def _sublayer_info(sub: Sublayer) -> SublayerInfo:
    parallel = len(sub.branches) > 1 and not sub.parallel_same
    kind = PlacementKind.PARALLEL if parallel else PlacementKind.of_slots(bool(sub.pre), bool(sub.out), bool(sub.post))
    return SublayerInfo(
        sub.layer, sub.kind, kind,
        tuple(s.node for s in sub.pre), tuple(s.node for s in sub.out), tuple(s.node for s in sub.post),
        sub.skip_scale if sub.skip_scale != 1.0 else None, BranchScale.of(sub.branch_scales),
    )  # fmt: skip


def _embedding_norm_as_pre(g: Graph, subs: list[Sublayer], infos: list[SublayerInfo], emb: Site | None) -> bool:
    """Whether the first sublayer has no pre-norm where the embedding norm's output is its stream value, and reading
    that norm as its pre-norm gives the scheme every other sublayer of its kind has (the embedding norm doubles
    as layer 0's pre-norm: the placement is that scheme, not ``mix``)."""
    if emb is None or not subs or subs[0].pre or stream_root(g, subs[0].source) != stream_root(g, emb.output):
        return False
    first = infos[0]
    alt = PlacementKind.of_slots(True, bool(first.out), bool(first.post))
    same = [i.placement for i in infos[1:] if i.kind is first.kind]
    return alt is not first.placement and bool(same) and all(p is alt for p in same)


def _as_pre(infos: list[SublayerInfo]) -> list[SublayerInfo]:
    first = infos[0]
    alt = PlacementKind.of_slots(True, bool(first.out), bool(first.post))
    return [dataclasses.replace(first, placement=alt), *infos[1:]]


def _logit_cap(g: Graph, final: Site | None) -> float | None:
    """A tanh soft-cap downstream of the final norm: ``c * tanh(x / c)``."""
    cap = None
    if final is not None:
        for n in g.nodes[final.output :]:
            if n.op == "tanh" and g.feeds(final.output, n.idx) and n.inputs:
                sm = scalar_mul(g, g.nodes[n.inputs[0]])
                cap = 1.0 / sm[1] if sm else None
    return cap


# ----------------------------------------------------------------------------- summaries
def _one(values: Iterable[T | None], notes: list[str]) -> T | None:
    """The most common value (a note when they differ), or None when there is none."""
    common = Counter(v for v in values if v is not None).most_common()
    if len(common) > 1:
        notes.append(f"mixed values { {getattr(k, 'value', k): n for k, n in common} }")
    return common[0][0] if common else None


def _summary_of(values: set[T], none: T, mixed: T) -> T:
    return values.pop() if len(values) == 1 else mixed if values else none


def _norm_summary(sites: list[Site], roles: _Roles, notes: list[str]) -> dict[str, Any]:
    """Operator, eps, gain convention, bias and cast order over the block norms and the final norm."""
    block_roles = (SiteRole.PRE, SiteRole.OUT, SiteRole.POST, SiteRole.FINAL)
    main = [s for s in sites if roles.get(s.node, (None,))[0] in block_roles]
    return {
        "operator": _summary_of({s.operator for s in main}, Operator.NONE, Operator.MIXED),
        "eps": _one((s.eps for s in main), notes),
        "eps_placement": _one((s.eps_placement for s in main), notes),
        "gain_convention": _one((s.gain_convention if s.gain else None for s in main), notes),
        "bias": any(s.bias for s in main),
        "cast_order": _one((s.cast_order for s in main), notes),
    }


def _placement_summary(stream: Stream, subs: list[SublayerInfo]) -> dict[str, Any]:
    per_kind: dict[SublayerKind, list[PlacementKind]] = {}
    by_layer: dict[int, list[PlacementKind]] = {}
    for sub in subs:
        per_kind.setdefault(sub.kind, []).append(sub.placement)
        by_layer.setdefault(sub.layer, []).append(sub.placement)
    kinds = {sub.placement for sub in subs}
    skip = BranchScale.of([
        *(s.skip_scale for s in subs if s.skip_scale), *(s.skip_learned for s in stream.sublayers if s.skip_learned)
    ])  # fmt: skip
    return {
        "placement": _summary_of(kinds, PlacementKind.UNKNOWN, PlacementKind.MIX),
        "placement_attention": PlacementMix(tuple(per_kind.get(SublayerKind.ATTENTION, ()))),
        "placement_mlp": PlacementMix(tuple(per_kind.get(SublayerKind.MLP, ()))),
        "placement_cross_attention": PlacementMix(tuple(per_kind.get(SublayerKind.CROSS_ATTENTION, ()))),
        "placement_mixer": PlacementMix(tuple(per_kind.get(SublayerKind.MIXER, ()))),
        "placement_by_layer": tuple(tuple(v) for _, v in sorted(by_layer.items())),
        "residual_scale": skip,
        "branch_scale": frozenset(s.branch_scale for s in subs if s.branch_scale),
        "depth_scaling": _depth_scaling(stream.sublayers),
    }


def _depth_scaling(subs: list[Sublayer]) -> DepthScaling | None:
    """A constant on the sublayers' norm outputs that changes with depth (LayerNorm Scaling: 1/sqrt(layer))."""
    scales = [s.output_scale for sub in subs for s in sub.pre + sub.out]
    if len({round(x, 9) for x in scales}) <= 1:
        return None
    by_layer = {sub.layer: float((sub.pre + sub.out)[0].output_scale) for sub in subs if sub.pre + sub.out}
    return DepthScaling(tuple(by_layer.items())) if len(by_layer) > 1 else None


def _attention_summary(attention: list[AttentionInfo]) -> dict[str, Any]:
    normed = [a for a in attention if a.qk_norm is not QKNormKind.NONE]
    caps = [a.softcap for a in attention if a.softcap]
    return {
        "qk_norm": _summary_of({a.qk_norm for a in attention}, QKNormKind.NONE, QKNormKind.MIXED),
        "qk_norm_rope": _summary_of({a.qk_norm_rope for a in normed}, RopeOrder.NOT_APPLICABLE, RopeOrder.MIXED),
        "v_norm": any(a.v_norm for a in attention),
        "attn_softcap": caps[0] if caps else None,
    }
