"""The attention phase of the inspector: attention cores, the norms on q / k / v, RoPE order, soft-capping.

Method (all structural, no names):

* **Cores** are fused attention calls (``scaled_dot_product_attention``, flex attention:
  :mod:`normatlas.analysis.attention_calls`), or a ``softmax`` fed by a matmul of two
  activations (not by a parameter: that is a router or a projection); the value operand is the
  matmul that reads the softmax.
* **QK / V norms** are found walking back from a core's q / k / v operands to the projections;
  a norm on the stream itself (a pre-norm) is not one. Their kind comes from the statistic's size
  and the stored gain's shape (:class:`~normatlas.vocabulary.QKNormKind`).
* **RoPE order**: a RoPE add (``q*cos + rot(q)*sin``, or a complex ``view_as_real``) between the
  norm and the core means the norm runs before RoPE; one between the projection and the norm means
  after. RoPE is looked for only on that path, so a rotation computed in an earlier layer that
  reaches this one through the residual stream is not mistaken for this layer's.
* A ``tanh`` between the scores and the softmax is logit soft-capping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..analysis.attention_calls import fused_call
from ..analysis.graph import Graph, Node
from ..analysis.ops import PROJECTIONS, SHAPE_ONLY
from ..analysis.walk import scalar_mul, strip, upstream
from ..vocabulary import QKNormKind, RopeOrder
from .norms import Site

__all__ = ["Core", "find_cores", "qk_kind", "rope_order"]

_TRIG = frozenset({"cos", "sin", "polar", "view_as_complex"})
_MATMUL = frozenset({"matmul", "bmm"})
_LEAVES = frozenset({"param", "input", "leaf", "buffer", "embedding"})


@dataclass
class Core:
    """One attention core: its node, its q / k / v operands (v = -1 when not found), soft-cap and the norms
    on each operand (with, per norm, whether RoPE is applied between the norm and the core)."""

    node: int
    q: int
    k: int
    v: int
    softcap: float | None
    head_dim: int | None = None
    norms: dict[str, list[tuple[Site, bool]]] = field(default_factory=dict)


def trig_bits(g: Graph) -> int:
    """Every node computing a rotation's trigonometry, as a bitset."""
    bits = 0
    for n in g.nodes:
        if n.op in _TRIG:
            bits |= 1 << n.idx
    return bits


def _is_rope_add(g: Graph, n: Node, trig: int) -> bool:
    if n.op == "view_as_real":
        return True
    if n.op not in ("add", "sub") or len(n.inputs) != 2:
        return False
    return all(g.nodes[i].op == "mul" for i in n.inputs) and bool(g.anc(n.idx) & trig)


def _by_param(g: Graph, n: Node) -> bool:
    return any(g.nodes[strip(g, i, SHAPE_ONLY)].op == "param" for i in n.inputs)


def _fused(g: Graph, n: Node) -> Core | None:
    call = fused_call(g, n)
    return None if call is None else Core(n.idx, call.q, call.k, call.v, call.softcap)


def _scores(g: Graph, n: Node, stream_bit: int) -> tuple[int, float | None]:
    """Walk back from a softmax to the matmul that computed its scores, reading a tanh soft-cap on the way."""
    cur, cap = n.inputs[0], None
    for _ in range(12):
        c = g.nodes[cur]
        if (c.op in ("matmul", "bmm", "einsum") and len(c.inputs) == 2) or c.op in PROJECTIONS:
            break
        if c.op == "tanh":
            sm = scalar_mul(g, g.nodes[c.inputs[0]])
            cap = 1.0 / sm[1] if sm else cap
        tensor_inputs = [i for i in c.inputs if g.anc(i) & stream_bit or g.nodes[i].op == "input"]
        if not tensor_inputs:
            break
        cur = max(tensor_inputs, key=lambda i: g.nodes[i].shape or ())
    return cur, cap


def _value_operand(g: Graph, softmax: int) -> int:
    frontier = [softmax]
    while frontier:
        here = frontier.pop()
        for u in g.users(here):
            if u.op in _MATMUL and len(u.inputs) == 2 and u.inputs[0] == here:
                return u.inputs[1]
            if u.op in SHAPE_ONLY:
                frontier.append(u.idx)
    return -1


def _softmax_core(g: Graph, n: Node, stream_bit: int) -> Core | None:
    if n.op != "softmax" or not n.inputs:
        return None
    cur, cap = _scores(g, n, stream_bit)
    c = g.nodes[cur]
    if c.op == "baddbmm" and len(c.inputs) == 3:  # beta * input + alpha * q @ k (GPT-2's reordered attention)
        if any(g.nodes[strip(g, i, SHAPE_ONLY)].op in ("param", "buffer") for i in c.inputs[1:]):
            return None
        return Core(n.idx, c.inputs[1], c.inputs[2], _value_operand(g, n.idx), cap)
    if c.op not in _MATMUL or len(c.inputs) != 2:
        return None
    if any(g.nodes[strip(g, i, SHAPE_ONLY)].op in ("param", "buffer") for i in c.inputs):
        return None  # a router or a projection, not q @ k^T
    return Core(n.idx, c.inputs[0], c.inputs[1], _value_operand(g, n.idx), cap)


def _operand_norms(
    g: Graph, start: int, by_output: dict[int, Site], stream_bit: int, stream_inputs: set[int], trig: int
) -> list[tuple[Site, bool]]:
    """The norms on one operand, walking back to the projections; True where RoPE sits between norm and core."""
    found: list[tuple[Site, bool]] = []
    stack, seen = [(start, False)], set()
    while stack and start >= 0:
        i, rope = stack.pop()
        if (i, rope) in seen:
            continue
        seen.add((i, rope))
        node = g.nodes[i]
        if i in by_output:
            if strip(g, by_output[i].input, SHAPE_ONLY) not in stream_inputs:  # a pre-norm is not a QK/V norm
                found.append((by_output[i], rope))
            continue
        if node.op in PROJECTIONS or node.op in ("param", "input", "leaf") or not g.anc(i) & stream_bit:
            continue
        if node.op == "matmul" and _by_param(g, node):
            continue
        here = rope or _is_rope_add(g, node, trig)
        stack.extend((j, here) for j in node.inputs)
    return found


def find_cores(g: Graph, sites: list[Site], stream_bit: int, stream_inputs: set[int], trig: int) -> list[Core]:
    """Phase 2: every attention core, with the norms on its q / k / v operands."""
    by_output = {s.output: s for s in sites}
    cores = [c for n in g.nodes if (c := _fused(g, n) or _softmax_core(g, n, stream_bit)) is not None]
    for core in cores:
        qshape = g.nodes[core.q].shape
        core.head_dim = qshape[-1] if qshape else None
        for role, start in (("q", core.q), ("k", core.k), ("v", core.v)):
            core.norms[role] = _operand_norms(g, start, by_output, stream_bit, stream_inputs, trig)
    return cores


def qk_kind(sites: list[Site], head_dim: int | None) -> QKNormKind:
    """The kind of one layer's QK-norm: over each head (one shared gain, or one per head) or over all heads."""
    if not sites:
        return QKNormKind.NONE
    kinds = set()
    for s in sites:
        if s.size != head_dim:
            kinds.add(QKNormKind.FLATTENED)
        elif s.gain_shape is not None and math.prod(s.gain_shape) > s.size:
            kinds.add(QKNormKind.PER_HEAD_GAINS)
        else:
            kinds.add(QKNormKind.PER_HEAD)
    return kinds.pop() if len(kinds) == 1 else QKNormKind.MIXED


def _rope_before(g: Graph, idx: int, trig: int) -> bool:
    """A RoPE add between the projection that produced ``idx``'s operand and ``idx`` itself."""

    def inside(node: Node) -> bool:  # still between the projection and the norm
        if _is_rope_add(g, node, trig) or node.op in PROJECTIONS or node.op in _LEAVES:
            return False
        if node.op == "matmul" and _by_param(g, node):
            return False
        residual = node.op == "add" and len(node.inputs) == 2 and not any(g.nodes[j].op == "mul" for j in node.inputs)
        return not residual  # a residual add: the stream, not this layer's rotation

    return any(_is_rope_add(g, n, trig) for n in upstream(g, idx, inside))


def rope_order(g: Graph, norms: list[tuple[Site, bool]], trig: int) -> RopeOrder:
    """Where one layer's QK-norm runs relative to RoPE, read on the path from its projection to its core."""
    if not norms:
        return RopeOrder.NOT_APPLICABLE
    if any(rope for _, rope in norms):
        return RopeOrder.BEFORE_ROPE
    if any(_rope_before(g, s.input, trig) for s, _ in norms):
        return RopeOrder.AFTER_ROPE
    return RopeOrder.NO_ROPE
