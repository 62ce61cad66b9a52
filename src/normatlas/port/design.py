"""Derive a :class:`~normatlas.blocks.ModelConfig` and the parameter links of a transformers decoder from one
recorded forward pass (no per-family key map).

Method: :func:`read_layers` walks the inspector's sublayers (:mod:`normatlas.inspect`) layer by layer and reads
each one's norms, projections and measured constants (:mod:`.read`, :mod:`.measure`); :func:`derive` checks that
every layer is one our :class:`~normatlas.blocks.Block` expresses (attention then MLP, or both in parallel; one norm
operator; one RoPE layout), assembles the config, and links each of our parameters to the model's parameter
*object* it comes from (with the transpose and the rows a fused projection needs). Every problem found is
collected, so a refusal names all of them at once (:class:`PortError`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..analysis.graph import Graph
from ..blocks.attn_gate import OutputGate
from ..blocks.mla import MLAConfig
from ..blocks.model import ModelConfig
from ..blocks.placement import Gate, Placement, Schedule, Sublayer
from ..blocks.qknorm import QK_OPERATORS, QKGain, QKNormConfig, QKScope
from ..inspect.attention import Core
from ..inspect.norms import Site
from ..inspect.residual import Sublayer as InspSub
from ..spec import GainConvention, NormSpec
from ..vocabulary import RopeOrder, SublayerKind
from .errors import PortError
from .measure import Mlp, RopeReading, Scores, branch_scale, mlp_design, rope_of, scores_of
from .mla import mla_parts, read_mla
from .moe import MoeReading, read_moe, routed
from .read import Proj, attention_parts, attention_roles, mlp_parts, norm_params, norm_spec, own_bits

__all__ = ["LayerReading", "Source", "norm_spec", "qk_config", "read_layers", "v_config"]


@dataclass(frozen=True)
class Source:
    """Where one of our parameters comes from: a parameter object of the model (or a buffer: a MoE's selection
    bias), its last two dims transposed first (Conv1D; stacked experts stored ``(E, in, out)``), then ``rows`` of it
    taken along dim ``axis`` (a fused projection: 0; a fused gate-and-up stack of experts: 1; None: all)."""

    param: nn.Parameter
    transpose: bool = False
    rows: tuple[int, ...] | None = None
    axis: int = 0


@dataclass
class LayerReading:
    """One layer as our Block sees it: placement slots, norm sites per slot, projections, measured constants."""

    index: int
    placement: Placement
    norms: dict[str, Site] = field(default_factory=dict)  # our slot (attn_pre_norm, ...) -> site
    sources: dict[str, Source] = field(default_factory=dict)  # our parameter name inside the block -> source
    heads: tuple[int, int, int] = (0, 0, 0)  # n_heads, n_kv_heads, head_dim
    d_ff: int = 0
    mlp: Mlp | None = None
    moe: MoeReading | None = None
    scores: Scores | None = None
    rope: RopeReading | None = None
    core: Core | None = None
    qk: tuple[Site, ...] = ()
    v_norm: Site | None = None  # a norm on the core's value operand (V-norm)
    qk_order: RopeOrder = RopeOrder.NOT_APPLICABLE
    biases: dict[str, bool] = field(default_factory=dict)
    sinks: bool = False  # a learned logit per head in the softmax (``attn.sinks``)
    gate: OutputGate | None = None  # a gate on the attention output (``attn.gate_proj``)
    mla: MLAConfig | None = None  # a multi-head latent attention (heads: n_heads, n_heads, its q / k head dim)
    mla_rope: RopeReading | None = None  # MLA's decoupled RoPE, read by :mod:`.mla`
    rope_head: int = 0  # the width the RoPE tables span when it is not the head dim (MLA's rotated part)


@dataclass(frozen=True)
class _Ctx:
    """What every layer's reading shares: the norm sites and the RoPE bases the config states."""

    sites: list[Site]
    known: tuple[float, ...]


def _proj_sources(prefix: str, p: Proj, biases: dict[str, bool], key: str) -> dict[str, Source]:
    t = p.kind == "conv1d_t"
    out = {f"{prefix}.weight": Source(p.weight(), t, p.rows)}
    b = p.bias()
    biases[f"{key}:{prefix}"] = b is not None
    if b is not None:
        out[f"{prefix}.bias"] = Source(b, False, p.rows)
    return out


def _norm_sources(g: Graph, slot: str, site: Site) -> dict[str, Source]:
    gain, bias = norm_params(g, site)
    out = {}
    if site.gain:
        if gain is None:
            raise PortError([f"{slot}: the gain of the norm in {site.module} is not a parameter"])
        out[f"{slot}.weight"] = Source(gain)
    if site.bias:
        if bias is None:
            raise PortError([f"{slot}: the bias of the norm in {site.module} is not a parameter"])
        out[f"{slot}.bias"] = Source(bias)
    return out


def _slots(sub: InspSub) -> Sublayer:
    return Sublayer(pre=bool(sub.pre), post=bool(sub.out), after_add=bool(sub.post))


def _one(sites: list[Site], what: str, layer: int) -> Site | None:
    if len(sites) > 1:
        raise PortError([f"layer {layer}: {len(sites)} norms in the {what} slot"])
    return sites[0] if sites else None


def _attention(
    g: Graph, r: LayerReading, sub: InspSub, branch: int, cores: list[Core], projs: list[Proj], ctx: _Ctx
) -> None:
    roles = attention_roles(g, sub, branch, cores, projs)
    own = own_bits(g, branch, sub.source)
    picks = [n.idx for n in g.nodes if n.op == "topk" and own >> n.idx & 1 and g.feeds(n.idx, roles.core.node)]
    if picks:
        core = roles.core
        if any(g.feeds(t, op) for t in picks for op in (core.q, core.k, core.v) if op >= 0):  # JetMoE's MoA
            raise PortError([f"layer {r.index}: a routed mixture of attention experts (top-k over router scores picks "
                             "the projections that compute q / k / v)"])  # fmt: skip
        raise PortError([f"layer {r.index}: a sparse-attention indexer (top-k over its own key scores picks the keys)"])
    mla = mla_parts(g, roles.qkv, roles.outs, roles.core)
    if mla is not None:
        _mla(g, r, mla, roles, ctx)
        return
    parts = attention_parts(g, sub, branch, cores, projs)
    for name in ("q", "k", "v", "o"):
        r.sources.update(_proj_sources(f"attn.{name}_proj", getattr(parts, name), r.biases, "attn"))
    qshape = g.tensors[parts.core.q].shape
    hd = int(qshape[-1])
    k_out = len(parts.k.rows) if parts.k.rows else int(g.tensors[parts.k.output].shape[-1])
    q_out = len(parts.q.rows) if parts.q.rows else int(g.tensors[parts.q.output].shape[-1])
    r.heads = (q_out // hd, k_out // hd, hd)
    r.core = parts.core
    r.scores = scores_of(g, parts.core, r.index)
    r.scores.scale *= _q_scale(g, parts.core.q)  # OPT scales q before the score matmul
    if r.scores.alibi is not None and len(r.scores.alibi) != r.heads[0]:
        raise PortError([f"layer {r.index}: an additive bias with {len(r.scores.alibi)} slopes for {r.heads[0]} heads"])
    if r.scores.sink is None:
        from .gates import lse_sink

        linked = {id(s.param) for s in r.sources.values()}
        r.scores.sink = lse_sink(g, parts, r.scores, own_bits(g, branch, sub.source), linked, r.index)
    if r.scores.sink is not None:
        r.sinks = True
        r.sources["attn.sinks"] = Source(g.tensors[r.scores.sink])  # type: ignore[arg-type]
    if parts.gate is not None:
        from .gates import gate_design

        r.gate = gate_design(g, parts, r.index)
        r.sources.update(_proj_sources("attn.gate_proj", parts.gate, {}, "attn"))
    for role in ("q", "k"):  # one norm reached on the rotated and the passed-through part (partial RoPE) is one
        parts.core.norms[role] = list({s.node: (s, rope) for s, rope in parts.core.norms[role]}.values())
    r.qk = tuple(s for s, _ in [*parts.core.norms["q"], *parts.core.norms["k"]])
    v_sites = list({s.node: s for s, _ in parts.core.norms["v"]}.values())
    if len(v_sites) > 1:
        raise PortError([f"layer {r.index}: {len(v_sites)} norms on the attention values"])
    if v_sites:
        r.v_norm = v_sites[0]
        r.sources.update(_norm_sources(g, "attn.v_norm", v_sites[0]))
    if r.qk:
        from ..inspect.attention import rope_order, trig_bits

        r.qk_order = rope_order(g, [*parts.core.norms["q"], *parts.core.norms["k"]], trig_bits(g))
        q_sites, k_sites = parts.core.norms["q"], parts.core.norms["k"]
        if len(q_sites) != 1 or len(k_sites) != 1:
            raise PortError([f"layer {r.index}: QK-norm on {len(q_sites)} query and {len(k_sites)} key norms"])
        for slot, (site, _) in (("attn.q_norm", q_sites[0]), ("attn.k_norm", k_sites[0])):
            r.sources.update(_norm_sources(g, slot, site))


def _q_scale(g: Graph, q: int) -> float:
    """Constant multipliers on the query between its last non-constant op and the score matmul (OPT's
    ``q_proj(x) * head_dim ** -0.5``), walking back through views and casts."""
    from ..analysis.ops import CASTS, SHAPE_ONLY
    from ..analysis.walk import scalar_mul

    scale, cur = 1.0, q
    while True:
        n = g.nodes[cur]
        sm = scalar_mul(g, n)
        if sm is not None:
            scale, cur = scale * sm[1], sm[0]
        elif (n.op in SHAPE_ONLY or n.op in CASTS) and n.inputs:
            cur = n.inputs[0]
        else:
            return scale


def _mla(g: Graph, r: LayerReading, parts: Any, roles: Any, ctx: _Ctx) -> None:
    """An MLA branch (:mod:`.mla`): its config, the rows each of our projections takes, its latent norms."""
    used = {id(p) for p in (parts.q, parts.q_a, parts.kv_a, parts.kv_b, parts.o) if p is not None}
    extra = [p.label for p in roles.inside if id(p) not in used]
    if extra:
        raise PortError([f"layer {r.index}: attention projections with no role in our Block: {', '.join(extra)}"])
    m = read_mla(g, parts, ctx.sites, r.index, ctx.known)
    named: list[tuple[str, Proj, tuple[int, ...] | None]] = [
        ("attn.q_proj" if parts.q_a is None else "attn.q_b_proj", parts.q, m.rows["q"]),
        ("attn.kv_a_proj", parts.kv_a, m.rows["kv_a_proj"]),
        ("attn.kv_b_proj", parts.kv_b, m.rows["kv_b_proj"]),
    ]
    if parts.q_a is not None:
        named.append(("attn.q_a_proj", parts.q_a, None))
    for prefix, p, rows in named:
        biased = prefix in ("attn.q_a_proj", "attn.kv_a_proj")
        if p.bias() is not None and not biased:
            raise PortError([f"layer {r.index}: a bias on MLA's {prefix.split('.')[1]} (ours: on q_a / kv_a only)"])
        r.sources.update(_proj_sources(prefix, p.with_rows(rows), r.biases if biased else {}, "attn"))
    r.sources.update(_proj_sources("attn.o_proj", parts.o, r.biases, "attn"))
    for slot, site in m.norms.items():
        r.sources.update(_norm_sources(g, f"attn.{slot}", site))
    r.mla = m.config
    r.heads = (m.heads, m.heads, m.config.qk_head_dim)
    r.rope_head = m.config.qk_rope_head_dim
    r.core = parts.core
    r.scores = scores_of(g, parts.core, r.index)
    r.mla_rope = m.rope
    if r.scores.alibi is not None:
        raise PortError([f"layer {r.index}: MLA with an additive bias on its scores (ALiBi)"])
    if any(parts.core.norms[k] for k in "qkv"):
        raise PortError([f"layer {r.index}: MLA with a norm on its q / k / v operands"])


def _mlp(g: Graph, r: LayerReading, sub: InspSub, branch: int, projs: list[Proj]) -> None:
    if routed(g, sub, branch):
        _moe(g, r, sub, branch, projs)
        return
    m = mlp_design(g, mlp_parts(g, sub, branch, projs), r.index)
    r.mlp = m
    if m.gate is not None:
        r.sources.update(_proj_sources("mlp.gate_proj", m.gate, r.biases, "mlp"))
    r.sources.update(_proj_sources("mlp.up_proj", m.up, r.biases, "mlp"))
    r.sources.update(_proj_sources("mlp.down_proj", m.down, r.biases, "mlp"))
    for name, t in zip(("alpha_p", "alpha_n"), m.learned, strict=False):  # a learned activation's own parameters
        r.sources[f"mlp.act.{name}"] = Source(t)  # type: ignore[arg-type]
    r.d_ff = int(g.tensors[m.down.input].shape[-1])


def _moe(g: Graph, r: LayerReading, sub: InspSub, branch: int, projs: list[Proj]) -> None:
    """A routed MoE MLP: read by behaviour (:mod:`.moe`) against the branch's value before its post-norm (or, with
    none, before its constant scale)."""
    from ..analysis.ops import SHAPE_ONLY
    from ..analysis.walk import strip

    stops = {site.output for site in sub.out}
    _, cur, _ = branch_scale(g, branch, stops)
    site = next((s for s in sub.out if s.output == cur), None)
    out = strip(g, site.input, SHAPE_ONLY) if site is not None else cur
    m = read_moe(g, sub, branch, out, projs, r.index)
    r.moe = m
    r.sources["mlp.router.weight"] = Source(m.router)  # type: ignore[arg-type]
    for name, st in m.experts.items():
        r.sources[f"mlp.{name}"] = Source(st.param, st.transpose, st.rows, axis=1)  # type: ignore[arg-type]
    if m.selection_bias is not None:
        r.sources["mlp.selection_bias"] = Source(m.selection_bias)  # type: ignore[arg-type]
    if m.shared is not None:
        unused: dict[str, bool] = {}
        for name, p in zip(("gate_proj", "up_proj", "down_proj"), m.shared, strict=True):
            if p is not None:
                r.sources.update(_proj_sources(f"mlp.shared.{name}", p, unused, "mlp"))
    if m.shared_gate is not None:
        r.sources.update(_proj_sources("mlp.shared_gate", m.shared_gate, {}, "mlp"))


def _branch_kind(g: Graph, sub: InspSub, branch: int, cores: list[Core]) -> SublayerKind:
    from .read import own_bits

    own = own_bits(g, branch, sub.source)
    return SublayerKind.ATTENTION if any(own >> c.node & 1 for c in cores) else SublayerKind.MLP


def _skip(g: Graph, sub: InspSub, layer: int) -> int | None:
    """The parameter node of a learned multiplier on the stream itself before the add (Doge's ``input_residual *
    x``), walking the add's skip operand back to the stream value; anything else on the way is refused by name."""
    from ..analysis.ops import SHAPE_ONLY
    from ..analysis.walk import learned_mul, scalar_mul, strip

    add = g.nodes[sub.adds[0]]
    skip = next((i for i in add.inputs if i != sub.branches[0] and not g.feeds(sub.branches[0], i)), None)
    cur, learned = skip, None
    while cur is not None and cur != sub.source:
        n = g.nodes[cur]
        if (sm := scalar_mul(g, n)) is not None:
            cur = sm[0]
        elif learned is None and learned_mul(g, n) is not None:
            learned = next(strip(g, i, SHAPE_ONLY) for i in n.inputs if g.nodes[strip(g, i, SHAPE_ONLY)].op == "param")
            cur = next(i for i in n.inputs if g.nodes[strip(g, i, SHAPE_ONLY)].op != "param")
        elif n.op in SHAPE_ONLY and n.inputs:
            cur = strip(g, cur, SHAPE_ONLY)
        else:
            what = "a learned bias" if n.op == "add" else f"an op ({n.op})"
            raise PortError([f"layer {layer}: {what} on the residual stream itself before its add"])
    return learned


def _scalings(g: Graph, subs: list[InspSub], layer: int) -> dict[str, Any]:
    """Per sublayer: residual alpha, constant branch scale, learned per-channel branch gate (LayerScale) and learned
    multiplier on the stream itself (Doge); the gates must be on every sublayer or none."""
    per: list[tuple[float, float]] = []
    gates: list[int | None] = []
    skips: list[int | None] = []
    for s in subs:
        stops = {site.output for site in s.out}
        scales = set()
        for b in s.branches:
            scale, _, learned = branch_scale(g, b, stops)
            scales.add(round(scale, 12))
            gates.append(learned)
        if len(scales) > 1:
            raise PortError([f"layer {layer}: parallel branches with different constant scales"])
        per.append((round(s.skip_scale, 12), scales.pop()))
        skips.append(_skip(g, s, layer))
    if len({p is None for p in gates}) > 1 or len({p is None for p in skips}) > 1:
        raise PortError([f"layer {layer}: a learned residual multiplier on some of its sublayers only"])
    out: dict[str, Any] = {"residual_alpha": per[0][0], "branch_scale": per[0][1], "gate": gates, "skip": skips}
    if len(per) > 1 and per[1] != per[0]:
        out.update(ffn_residual_alpha=per[1][0], ffn_branch_scale=per[1][1])
    return out


def read_layer(
    g: Graph,
    index: int,
    subs: list[InspSub],
    cores: list[Core],
    projs: list[Proj],
    known: tuple[float, ...],
    sites: list[Site] | None = None,
) -> LayerReading:
    """One layer: its sublayers must be attention then MLP, or one parallel sublayer of both."""
    kinds = [s.kind for s in subs]
    ctx = _Ctx(sites or [], known)
    r = LayerReading(index, Placement())
    sc = _scalings(g, subs, index)
    keys = ("residual_alpha", "branch_scale", "ffn_residual_alpha", "ffn_branch_scale")
    common: dict[str, Any] = {k: sc[k] for k in keys if k in sc}
    if any(p is not None for p in sc["skip"]):
        shapes = {tuple(g.tensors[p].shape) for p in sc["skip"]}
        scalar = all(math.prod(sh) == 1 for sh in shapes)
        common["skip_gate"] = Gate.SCALAR if scalar else Gate.VECTOR
        tags = ("attn", "ffn") if len(sc["skip"]) == 2 else ("attn",)
        for tag, node in zip(tags, sc["skip"], strict=True):
            name = "alpha" if scalar else "gamma"
            r.sources[f"{tag}_residual.skip_gate.{name}"] = Source(g.tensors[node])  # type: ignore[arg-type]
    if any(p is not None for p in sc["gate"]):
        if len(sc["gate"]) != 2:
            raise PortError([f"layer {index}: a learned branch multiplier on a parallel block"])
        common.update(gate=Gate.VECTOR, gate_init=1e-5)
        for tag, node in zip(("attn", "ffn"), sc["gate"], strict=True):
            r.sources[f"{tag}_residual.gate.gamma"] = Source(g.tensors[node])  # type: ignore[arg-type]
    if kinds == [SublayerKind.ATTENTION, SublayerKind.MLP]:
        a, m = subs
        _attention(g, r, a, a.branches[0], cores, projs, ctx)
        _mlp(g, r, m, m.branches[0], projs)
        r.placement = Placement(f"layer{index}", _slots(a), _slots(m), **common)
        for sub, tag in ((a, "attn"), (m, "ffn")):
            for slot, sites in (("pre", sub.pre), ("post", sub.out), ("after", sub.post)):
                site = _one(sites, f"{tag} {slot}", index)
                if site is not None:
                    r.norms[f"{tag}_{slot}_norm"] = site
    elif kinds == [SublayerKind.PARALLEL]:
        _parallel(g, r, subs[0], cores, projs, common, ctx)
    elif SublayerKind.ATTENTION not in kinds and SublayerKind.PARALLEL not in kinds:
        raise PortError([f"layer {index}: a layer with no attention (an SSM, recurrent or convolution mixer)"])
    else:
        names = ", ".join(k.value for k in kinds)
        raise PortError([f"layer {index}: sublayers ({names}); our Block is attention then MLP, or both in parallel"])
    return r


def _parallel(
    g: Graph, r: LayerReading, sub: InspSub, cores: list[Core], projs: list[Proj], common: dict[str, Any], ctx: _Ctx
) -> None:
    by_kind = {_branch_kind(g, sub, b, cores): b for b in sub.branches}
    if set(by_kind) != {SublayerKind.ATTENTION, SublayerKind.MLP}:
        raise PortError([f"layer {r.index}: a parallel sublayer that is not one attention and one MLP branch"])
    ab, mb = by_kind[SublayerKind.ATTENTION], by_kind[SublayerKind.MLP]
    _attention(g, r, sub, ab, cores, projs, ctx)
    _mlp(g, r, sub, mb, projs)
    pre = {tag: [s for s in sub.pre if g.feeds(s.output, b)] for tag, b in (("attn", ab), ("ffn", mb))}
    shared = len(sub.pre) == 1
    outs = {
        tag: [s for s in sub.out if g.feeds(s.output, b) or s.output == b] for tag, b in (("attn", ab), ("ffn", mb))
    }
    slots = {tag: Sublayer(pre=bool(pre[tag]), post=bool(outs[tag]), after_add=bool(sub.post)) for tag in pre}
    r.placement = Placement(f"layer{r.index}", slots["attn"], slots["ffn"], parallel=True, shared_pre_norm=shared,
                            **common)  # fmt: skip
    for tag in ("attn", "ffn"):
        if pre[tag] and not (shared and tag == "ffn"):
            r.norms[f"{tag}_pre_norm"] = _one(pre[tag], f"{tag} pre", r.index)  # type: ignore[assignment]
        if outs[tag]:
            r.norms[f"{tag}_post_norm"] = _one(outs[tag], f"{tag} post", r.index)  # type: ignore[assignment]
    if sub.post:
        r.norms["attn_after_norm"] = _one(sub.post, "after", r.index)  # type: ignore[assignment]


def qk_config(layers: list[LayerReading]) -> QKNormConfig | None:
    """One QK-norm for every layer (or none anywhere), from its sites: operator, scope, gain shape, order, eps."""
    kinds = {bool(r.qk) for r in layers}
    if kinds == {False}:
        return None
    if len(kinds) > 1:
        raise PortError(["QK-norm in some layers only"])
    configs = {_qk_one(r) for r in layers}
    if len(configs) > 1:
        raise PortError(["QK-norms that differ between layers"])
    return configs.pop()


def v_config(layers: list[LayerReading]) -> QKNormConfig | None:
    """One V-norm for every layer (or none anywhere), read from its site as a QK-norm's fields."""
    configs = {None if r.v_norm is None else _qk_one(r, (r.v_norm,), "V-norm") for r in layers}
    if len(configs) > 1:
        raise PortError(["V-norms that differ between layers (or in some layers only)"])
    return configs.pop()


def _qk_one(r: LayerReading, sites: tuple[Site, ...] | None = None, what: str = "QK-norm") -> QKNormConfig:
    sites = r.qk if sites is None else sites
    q = sites[0]
    hd = r.heads[2]
    if any(s.operator not in QK_OPERATORS or s.operator is not q.operator for s in sites):
        raise PortError([f"layer {r.index}: a {what} operator ({q.operator.value}) our QKNorm does not compute"])
    scope = QKScope.HEAD if q.size == hd else QKScope.FLAT
    if not q.gain:
        gain = QKGain.NONE
    elif scope is QKScope.FLAT or (q.gain_shape is not None and len(q.gain_shape) == 2):
        gain = QKGain.PER_HEAD
    else:
        gain = QKGain.SHARED
    after = r.qk_order is RopeOrder.AFTER_ROPE and what == "QK-norm"
    order = RopeOrder.AFTER_ROPE if after else RopeOrder.BEFORE_ROPE
    return QKNormConfig(
        q.operator, scope, gain, zero_centred=q.gain_convention is GainConvention.ONE_PLUS_W, order=order,
        eps=q.eps or 1e-6, bias=q.bias,
    )  # fmt: skip


def read_layers(
    g: Graph,
    subs: list[InspSub],
    cores: list[Core],
    projs: list[Proj],
    known: tuple[float, ...],
    sites: list[Site] | None = None,
) -> list[LayerReading]:
    """Every layer, in order; problems in any layer are collected into one :class:`PortError`."""
    by_layer: dict[int, list[InspSub]] = {}
    for s in subs:
        by_layer.setdefault(s.layer, []).append(s)
    out, problems = [], []
    for i, layer in enumerate(sorted(by_layer)):
        try:
            r = read_layer(g, i, by_layer[layer], cores, projs, known, sites)
            r.rope = _rope(g, r, by_layer[layer], known)
            out.append(r)
        except PortError as e:
            problems += [m.replace(f"layer {layer}:", f"layer {i}:") for m in e.missing]
    if problems:
        raise PortError(problems)
    return out


def _rope(g: Graph, r: LayerReading, subs: list[InspSub], known: tuple[float, ...]) -> RopeReading | None:
    from .read import own_bits

    if r.core is None:
        return None
    if r.mla is not None:
        return r.mla_rope
    sub = subs[0]
    own = 0
    for b in sub.branches:
        own |= own_bits(g, b, sub.source)
    return rope_of(g, r.core, r.index, known, own, sub.source)


def make_config(
    base: dict[str, Any], layers: list[LayerReading], spec: NormSpec | None, kind: type[ModelConfig] = ModelConfig
) -> ModelConfig:
    """The config (``kind``: a :class:`ModelConfig` or :class:`ViTConfig`) of the read layers (``base``: the
    model-level fields)."""
    placements = [r.placement for r in layers]
    one = all(p.with_(name="x") == placements[0].with_(name="x") for p in placements)
    placement: Placement | Schedule = (
        placements[0].with_(name=f"read {placements[0].kind.value}") if one else Schedule.of(placements, "read")
    )
    return kind(placement=placement, norm=spec, **base)
