"""The one walker over a recorded :class:`~.graph.Graph`: value-preserving chains and constant scalings.

Every reader of the fine graph steps over the same things: casts and views (:func:`strip`), a
multiply by a Python number or a one-element tensor (:func:`scalar_mul`), a multiply by a learned
parameter (:func:`learned_mul`), a sum's additive parts (:func:`components`), and what lies upstream of a
node up to a boundary (:func:`upstream`). What counts as a
cast or a view is the op table's (:mod:`.ops`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from ..vocabulary import BranchScaling
from .graph import Graph, Node, Ref
from .ops import CASTS, SHAPE_ONLY, SPLITS

__all__ = ["components", "learned_mul", "scalar_mul", "scalar_of", "scale_back", "strip", "upstream"]


def strip(g: Graph, idx: int, ops: frozenset[str] = CASTS) -> int:
    """Follow ``idx`` back through value-preserving ops (casts; optionally shape ops)."""
    while True:
        n = g.nodes[idx]
        if n.op in ops and n.inputs:
            first = n.args[0] if n.args else None
            idx = first.idx if isinstance(first, Ref) else n.inputs[0]
        else:
            return idx


def scalar_of(g: Graph, arg: object) -> float | None:
    """The float value of a Python number or a one-element non-parameter tensor argument (a 0-d buffer too, an
    integer one cast to float included: MiniCPM3's ``embed_scale``)."""
    if isinstance(arg, bool):
        return None
    if isinstance(arg, (int, float)):
        return float(arg)
    if isinstance(arg, Ref):
        n = g.nodes[strip(g, arg.idx)]
        if n.op == "param":
            return None
        if n.scalar is not None:
            return n.scalar
        got = g.nodes[arg.idx].scalar  # the cast's float value of an integer constant
        if got is None and n.op == "buffer" and n.value is not None and n.value.numel() == 1:
            v = n.value.reshape(())
            got = float(v.item()) if v.dtype != torch.bool else None
        return got
    return None


def scalar_mul(g: Graph, n: Node) -> tuple[int, float] | None:
    """``x * c`` / ``x / c`` with c a constant: (x, c)."""
    if n.op not in ("mul", "div") or not n.args or not isinstance(n.args[0], Ref):
        if n.op == "mul" and len(n.args) == 2 and isinstance(n.args[1], Ref):
            c = scalar_of(g, n.args[0])
            return (n.args[1].idx, c) if c is not None else None
        return None
    c = scalar_of(g, n.args[1]) if len(n.args) > 1 else None
    if c is None and n.op == "mul" and len(n.args) > 1 and isinstance(n.args[1], Ref):
        c2 = scalar_of(g, n.args[0])
        return (n.args[1].idx, c2) if c2 is not None else None
    if c is None or c == 0:
        return None
    return n.args[0].idx, (c if n.op == "mul" else 1.0 / c)


def scale_back(g: Graph, start: int, reached: Callable[[int], bool]) -> tuple[float, bool]:
    """The product of the constant multipliers met walking back from ``start`` through views, casts and splits
    until ``reached(node)``: ``(scale, True)``, or ``(scale so far, False)`` where another op stops the walk."""
    cur, scale = start, 1.0
    while not reached(cur):
        n = g.nodes[cur]
        sm = scalar_mul(g, n)
        if sm is not None:
            scale, cur = scale * sm[1], sm[0]
        elif (n.op in SHAPE_ONLY or n.op in CASTS or n.op in SPLITS) and n.inputs:
            cur = n.inputs[0]
        else:
            return scale, False
    return scale, True


def components(g: Graph, idx: int, limit: int = 48) -> list[int]:
    out: list[int] = []
    queue = [idx]
    while queue and len(out) < limit:
        i = queue.pop(0)
        out.append(i)
        n = g.nodes[i]
        if n.op in SHAPE_ONLY and n.inputs:
            queue.append(strip(g, i, SHAPE_ONLY))
        elif n.op == "add" and len(n.inputs) == 2:
            queue.extend(n.inputs)
        elif (sm := scalar_mul(g, n)) is not None:
            queue.append(sm[0])
        elif (lp := learned_mul(g, n)) is not None:
            queue.append(lp[0])
    return out


def learned_mul(g: Graph, n: Node) -> tuple[int, BranchScaling] | None:
    """``x * p`` with p a parameter: (x, what p is: one number or one per channel)."""
    if n.op != "mul" or len(n.inputs) != 2:
        return None
    params = [i for i in n.inputs if g.nodes[strip(g, i, SHAPE_ONLY)].op == "param"]
    if len(params) != 1:
        return None
    p = g.nodes[strip(g, params[0], SHAPE_ONLY)]
    scalar = p.shape is not None and math.prod(p.shape) == 1
    kind = BranchScaling.LEARNED_SCALAR if scalar else BranchScaling.PER_CHANNEL
    return next(i for i in n.inputs if i != params[0]), kind


def upstream(g: Graph, start: int, expand: Callable[[Node], bool]) -> Iterator[Node]:
    """Every node from ``start`` backwards, each once, stepping into the inputs of the nodes ``expand`` accepts
    (a boundary node is yielded, not crossed)."""
    stack, seen = [start], set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        node = g.nodes[i]
        yield node
        if expand(node):
            stack.extend(node.inputs)
