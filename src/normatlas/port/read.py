"""Read a model's parts off its recorded dataflow: which module invocation plays which role in which layer.

Method (structural; module paths are labels and handles, never read to decide): the inspector's phases
(:mod:`normatlas.inspect`) give the norm sites, the residual stream and its sublayers with their pre / out / post
norms, and the attention cores with their q / k / v operands. A sublayer's *own* nodes are those its branch depends
on that the stream before it does not. Among the affine module invocations (:func:`~normatlas.analysis.linear_kind`)
inside them:

* attention: the projection feeding the core's q (k, v) operand is q (k, v); one feeding several is a fused
  projection, split by matching its output's values against each operand's (:func:`rows_of`); the one reading the
  core's output is the output projection;
* MLP: the projection(s) reading the branch input are the first layer, the one after them the down projection;
  which first projection is the gate is decided by behaviour in :mod:`.measure`.

A norm's gain and bias are the parameters its affine map multiplies and adds (:func:`norm_params`), found on the
recorded graph. Everything is returned as parameter *objects*; their registered names are looked up by identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..analysis.flow import linear_kind
from ..analysis.graph import Graph, Ref
from ..analysis.ops import SHAPE_ONLY, SPLITS
from ..analysis.walk import strip
from ..inspect.attention import Core
from ..inspect.norms import Site
from ..inspect.residual import Sublayer
from ..spec import CastOrder, Gain, GainConvention, NormSpec, Scale
from ..vocabulary import Operator
from .errors import PortError

__all__ = [
    "AttnParts",
    "MlpParts",
    "Proj",
    "Roles",
    "attention_parts",
    "attention_roles",
    "mlp_parts",
    "norm_params",
    "norm_spec",
    "own_bits",
    "projections",
]


@dataclass
class Proj:
    """One affine module invocation: the module, what it computes (``linear`` / ``conv1d_t``), its input and output
    nodes, and ``rows``: the output features a fused projection gives one role (None: all of them)."""

    label: str
    module: nn.Module
    kind: str
    input: int
    output: int
    rows: tuple[int, ...] | None = None

    def weight(self) -> nn.Parameter:
        w = self.module.weight  # the operator's typed API (nn.Linear / Conv1D), not a name guess
        assert isinstance(w, nn.Parameter)
        return w

    def bias(self) -> nn.Parameter | None:
        b = self.module.bias
        return b if isinstance(b, nn.Parameter) else None

    def with_rows(self, rows: tuple[int, ...] | None) -> Proj:
        return Proj(self.label, self.module, self.kind, self.input, self.output, rows)


@dataclass
class AttnParts:
    q: Proj
    k: Proj
    v: Proj
    o: Proj
    core: Core
    gate: Proj | None = None  # a projection gating the core's output before o (read by :mod:`.gates`)


@dataclass
class MlpParts:
    firsts: list[Proj]
    down: Proj
    extra: list[str] = field(default_factory=list)


def projections(g: Graph) -> list[Proj]:
    """Every invocation of a linear / Conv1D module with one tensor in and one out, in execution order."""
    out = []
    for s in g.spans:
        kind = linear_kind(s.module)
        if kind in ("linear", "conv1d_t") and s.inputs and len(s.outputs) == 1:
            out.append(Proj(s.name, s.module, kind, s.inputs[0], s.outputs[0]))
    return out


def own_bits(g: Graph, branch: int, source: int) -> int:
    """The nodes a branch depends on that the stream value it started from does not (a bitset)."""
    return (g.anc(branch) | 1 << branch) & ~(g.anc(source) | 1 << source)


def _feeds(g: Graph, a: int, b: int) -> bool:
    return a == b or g.feeds(a, b)


@dataclass
class Roles:
    """One attention branch's core, the projections inside the branch, those feeding each operand, and those
    reading the core's output."""

    core: Core
    inside: list[Proj]
    qkv: dict[str, list[Proj]]
    outs: list[Proj]


def attention_roles(g: Graph, sub: Sublayer, branch: int, cores: list[Core], projs: list[Proj]) -> Roles:
    """The one core of an attention branch and the projections around it (raises unless there is one core with a
    value operand)."""
    own = own_bits(g, branch, sub.source)
    mine = [c for c in cores if own >> c.node & 1]
    if len(mine) != 1:
        raise PortError([f"layer {sub.layer}: {len(mine)} attention cores in one branch"])
    core = mine[0]
    inside = [p for p in projs if own >> p.output & 1]
    if core.v < 0:
        core.v = _value_through(g, core.node)
    if core.v < 0:
        raise PortError([f"layer {sub.layer}: the attention's value operand was not found"])
    roles: dict[str, list[Proj]] = {r: [p for p in inside if _feeds(g, p.output, getattr(core, r))] for r in "qkv"}
    outs = [p for p in inside if _feeds(g, core.node, p.input)]
    _refuse_rounded_operands(g, sub.layer, core, roles, own)
    return Roles(core, inside, roles, outs)


ROUNDING = frozenset({"round", "floor", "ceil", "trunc"})
"""Ops that snap values to a grid: on the way from a projection to a core operand, a fake quantization."""


def _refuse_rounded_operands(g: Graph, layer: int, core: Core, roles: dict[str, list[Proj]], own: int) -> None:
    """Refuse q / k / v rounded between their projection and the core (Kolibri 1.1's NVFP4 keys and values, with
    a straight-through gradient): our attention reads its operands as computed."""
    rounded = sorted(
        r for r, ps in roles.items()
        for n in g.nodes
        if n.op in ROUNDING and own >> n.idx & 1 and _feeds(g, n.idx, getattr(core, r))
        and any(_feeds(g, p.output, n.idx) for p in ps)
    )  # fmt: skip
    if rounded:
        which = " / ".join(dict.fromkeys(rounded))
        raise PortError([f"layer {layer}: {which} rounded to a grid between the projection and the attention core "
                         "(fake quantization, e.g. NVFP4 keys and values)"])  # fmt: skip


def attention_parts(g: Graph, sub: Sublayer, branch: int, cores: list[Core], projs: list[Proj]) -> AttnParts:
    """q, k, v and output projections of one attention branch; raises :class:`PortError` when they are not four
    (or three fused and one) plain projections around one core."""
    found = attention_roles(g, sub, branch, cores, projs)
    core, inside, roles, outs = found.core, found.inside, found.qkv, found.outs
    used = {id(p) for ps in (*roles.values(), outs) for p in ps}
    gates = [
        p for p in inside
        if id(p) not in used and len(outs) == 1 and _feeds(g, p.output, outs[0].input)
        and not any(_feeds(g, p.output, getattr(core, r)) for r in "qkv")
    ]  # fmt: skip
    gate = gates[0] if len(gates) == 1 else None
    fused_gate = _fused_gate(g, core, roles["q"], outs) if gate is None else None
    used |= {id(gate)} if gate is not None else set()
    extra = [p.label for p in inside if id(p) not in used]
    problems = [
        f"layer {sub.layer}: {r} is computed by {len(ps)} projections" + (" (low-rank: MLA)" if len(ps) > 1 else "")
        for r, ps in roles.items()
        if len(ps) != 1
    ]
    if len(outs) != 1:
        problems.append(f"layer {sub.layer}: {len(outs)} projections read the attention output")
    if extra:
        problems.append(f"layer {sub.layer}: attention projections with no role in our Block: {', '.join(extra)}")
    if problems:
        raise PortError(problems)
    picked = {}
    for r, (p,) in roles.items():
        fused = sum(p is ps[0] for ps in roles.values()) > 1 or (r == "q" and fused_gate is not None)
        picked[r] = p.with_rows(rows_of(g, p, getattr(core, r)) if fused else None)
    if fused_gate is not None:  # q and the gate from one projection (MiniCPM 5: per head, q's rows then the gate's)
        q = roles["q"][0]
        gate = Proj(q.label, q.module, q.kind, q.input, fused_gate, rows_of(g, q, fused_gate))
    return AttnParts(picked["q"], picked["k"], picked["v"], outs[0], core, gate)


def _fused_gate(g: Graph, core: Core, qs: list[Proj], outs: list[Proj]) -> int | None:
    """The part of the q projection's output that gates the core's output (a fused ``q_gate_proj``): the first
    piece split off q's output that reaches the output projection without passing the core; None if none."""
    if len(qs) != 1 or len(outs) != 1:
        return None
    q, o = qs[0], outs[0]
    whole = g.tensors[q.output].numel()
    for u in g.nodes[q.output + 1 : o.input + 1]:
        t = g.tensors.get(u.idx)
        if (u.op not in SPLITS and u.op != "item_of") or t is None or t.numel() >= whole:
            continue
        if not g.feeds(q.output, u.idx) or g.feeds(core.node, u.idx):
            continue
        if any(_feeds(g, u.idx, x) for x in (core.q, core.k, core.v, core.node) if x >= 0):
            continue  # a piece the core reads (fused q / k / v), not a gate around it
        if _feeds(g, u.idx, o.input):
            return u.idx
    return None


def _value_through(g: Graph, softmax: int) -> int:
    """The value operand of a core whose probabilities pass a slice first (attention sinks drop the sink's
    column): the second operand of the matmul the softmax reaches through splits and value-preserving ops."""
    frontier, seen = [softmax], set()
    while frontier:
        here = frontier.pop()
        for u in g.users(here):
            if u.idx in seen:
                continue
            seen.add(u.idx)
            if u.op in ("matmul", "bmm") and len(u.inputs) == 2 and u.inputs[0] == here:
                return u.inputs[1]
            if u.op in SHAPE_ONLY or u.op in SPLITS:
                frontier.append(u.idx)
    return -1


def mlp_parts(g: Graph, sub: Sublayer, branch: int, projs: list[Proj]) -> MlpParts:
    """The first projection(s) and the down projection of one MLP branch; raises on anything else (a router, experts,
    more than two layers)."""
    own = own_bits(g, branch, sub.source)
    inside = [p for p in projs if own >> p.output & 1]
    firsts = [p for p in inside if not any(q is not p and _feeds(g, q.output, p.input) for q in inside)]
    downs = [p for p in inside if p not in firsts]
    routed = [n.op for n in g.nodes if own >> n.idx & 1 and n.op in ("topk", "sort", "argsort")]
    problems = []
    if routed:
        raise PortError([f"layer {sub.layer}: a routed mixture of experts ({routed[0]} over router scores)"])
    if len(downs) != 1 or not 1 <= len(firsts) <= 2:
        problems.append(
            f"layer {sub.layer}: the MLP has {len(firsts)} input and {len(downs)} later projections "
            f"({', '.join(p.label for p in inside) or 'none found'}); our MLP is up (and gate) then down"
        )
    if problems:
        raise PortError(problems)
    return MlpParts(firsts, downs[0])


def rows_of(g: Graph, p: Proj, target: int) -> tuple[int, ...]:
    """The output features of a fused projection ``p`` that become ``target``'s operand, by matching values: the
    first tensor on the way from ``p``'s output to ``target`` (through splits and views, in any layout: GPT-NeoX
    transposes to heads first) that holds fewer features per token is compared with ``p``'s output, token by token:
    the elements equal to one token's output features, in memory order, are that role's rows."""
    y = g.tensors[p.output]
    n = y.shape[-1]
    tokens = y.reshape(-1, n)
    stack, seen = [p.output], set()
    while stack:
        i = stack.pop(0)
        for u in g.users(i):
            if u.idx in seen or not (u.op in SPLITS or u.op in SHAPE_ONLY or u.op == "item_of"):
                continue
            seen.add(u.idx)
            t = g.tensors.get(u.idx)
            fewer = t is not None and t.numel() < y.numel() and t.numel() % tokens.shape[0] == 0
            if fewer and _feeds(g, u.idx, target):
                rows = _match(tokens, t)  # type: ignore[arg-type]
                if rows is not None:
                    return rows
            stack.append(u.idx)
    raise PortError([f"{p.label}: a fused projection whose split into q / k / v (or gate / up) was not read"])


def _match(tokens: Tensor, t: Tensor) -> tuple[int, ...] | None:
    """The rows of ``tokens`` (one row per token) whose values ``t`` holds, in ``t``'s memory order, the same for
    the first and the last token that occur once (a repeated token id gives a repeated row before RoPE); None when
    they are not found exactly once each."""
    per = t.numel() // tokens.shape[0]
    once = [i for i in range(tokens.shape[0]) if int((tokens == tokens[i]).all(1).sum()) == 1]
    if not once:
        return None
    found = []
    for row in (tokens[once[0]], tokens[once[-1]]):
        vals = t.reshape(-1)[torch.isin(t.reshape(-1), row)]
        if vals.numel() != per:
            return None
        eq = vals[:, None] == row[None, :]
        if not bool((eq.sum(1) == 1).all()):
            return None
        found.append(tuple(int(r) for r in eq.float().argmax(1)))
    return found[0] if found[0] == found[1] else None


def norm_params(g: Graph, site: Site) -> tuple[nn.Parameter | None, nn.Parameter | None]:
    """The gain and bias parameters of one norm site: the parameters its affine map reads (a fused kernel's
    ``weight`` / ``bias`` operands; else a parameter multiplied in, directly or as ``1 + w``, and one added)."""
    n = g.nodes[site.node]
    gain = bias = None
    if site.fused and n.op in ("layer_norm", "rms_norm"):
        w_i, b_i = (2, 3) if n.op == "layer_norm" else (2, None)
        gain = _param_arg(g, n.kwargs.get("weight", n.args[w_i] if len(n.args) > w_i else None))
        if b_i is not None:
            bias = _param_arg(g, n.kwargs.get("bias", n.args[b_i] if len(n.args) > b_i else None))
    region = (g.anc(site.output) | 1 << site.output) & ~(g.anc(site.node) | 1 << site.node)
    for node in g.nodes[site.node + 1 : site.output + 1]:
        if not region >> node.idx & 1:
            continue
        for i in node.inputs:
            leaf = g.nodes[strip(g, i, SHAPE_ONLY)]
            if leaf.op != "param":
                continue
            on_path = any(_feeds(g, site.node, j) for j in node.inputs if j != i)
            if node.op == "add" and on_path:
                bias = bias if bias is not None else g.tensors[leaf.idx]  # type: ignore[assignment]
            else:
                gain = gain if gain is not None else g.tensors[leaf.idx]  # type: ignore[assignment]
    return gain, bias  # type: ignore[return-value]


def _param_arg(g: Graph, arg: object) -> nn.Parameter | None:
    if not isinstance(arg, Ref):
        return None
    leaf = g.nodes[strip(g, arg.idx, SHAPE_ONLY)]
    if leaf.op == "add":  # a 1 + w gain handed to the fused kernel (Nemotron's LayerNorm1P)
        inner = [g.nodes[strip(g, i, SHAPE_ONLY)] for i in leaf.inputs]
        leaf = next((n for n in inner if n.op == "param"), leaf)
    t = g.tensors.get(leaf.idx)
    return t if leaf.op == "param" and isinstance(t, nn.Parameter) else None


def norm_spec(site: Site) -> NormSpec:
    """The :class:`NormSpec` of one site, from the arithmetic the inspector read (operator, eps, its placement,
    cast order, gain and its convention, bias)."""
    if site.operator not in (Operator.LAYERNORM, Operator.LAYERNORM_NONPARAM, Operator.RMSNORM, Operator.L2):
        raise PortError([f"a {site.operator.value} norm ({site.module}), which our Norm slots do not take"])
    return NormSpec(
        center=site.operator in (Operator.LAYERNORM, Operator.LAYERNORM_NONPARAM),
        scale=Scale.L2 if site.operator is Operator.L2 else Scale.RMS,
        eps=site.eps, eps_placement=site.eps_placement or NormSpec().eps_placement,
        cast_order=site.cast_order or CastOrder.AFTER_GAIN,
        gain=Gain.PER_FEATURE if site.gain else Gain.NONE,
        gain_convention=site.gain_convention or GainConvention.W, bias=site.bias,
    )  # fmt: skip
