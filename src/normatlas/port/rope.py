"""Read a layer's rotary position embedding from the recorded tensors: the cos / sin tables that multiply its
queries, their layout, the rotated width, the inverse frequency of every rotated pair, the constant on the tables
(YaRN's / LongRoPE's attention factor) and a second frequency profile chosen by the sequence length (LongRoPE).

Where the tables come from: ``cos`` / ``sin`` ops (most models compute them each forward), or, where no such op
runs, a buffer precomputed at init and indexed by the positions (GPT-J, CodeGen): there the table whose row at
position 0 is zero is the sine. The frequencies are exact when the angle tensor the ``cos`` op read is recorded
(its row at position 1 *is* the frequency vector, ``1 * f = f`` in any float type), else fitted from
``atan2(sin, cos)`` at position 1. A profile ``theta ** (-2i/d)`` is kept as its ``theta`` (snapped to a value the
config states, as ``_theta`` does); any other profile is kept as the measured ``inv_freq`` themselves.

Refused by name: complex-number RoPE, a frequency profile the model recomputes from the sequence length with state
(dynamic NTK scaling: a branch on ``max(position) + 1`` that no tensor records), tables that are not a rotation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..analysis.graph import Graph, Node
from ..blocks.attention import Rope, RopeStyle
from ..inspect.attention import Core
from .errors import PortError

__all__ = ["RopeReading", "rope_of"]

_COMPARE = frozenset({"gt", "lt", "ge", "le"})


@dataclass(frozen=True)
class RopeReading:
    """One layer's rotation: ``inv_freq`` None when the profile is ``theta ** (-2i/d)``."""

    theta: float
    style: RopeStyle
    rotary_dim: int
    inv_freq: tuple[float, ...] | None = None
    attention_factor: float = 1.0
    long_inv_freq: tuple[float, ...] | None = None
    long_after: int | None = None
    clockwise: bool = False

    def rope(self, head_dim: int) -> Rope:
        return Rope(self.theta, self.style, self.rotary_dim / head_dim, self.inv_freq, self.attention_factor,
                    self.long_inv_freq, self.long_after, self.clockwise)  # fmt: skip


def _reaches(g: Graph, a: int, b: int) -> bool:
    return a == b or g.feeds(a, b)


def _tables(g: Graph, core: Core, own: int, source: int) -> tuple[int, int, int | None, dict[int, int]] | None:
    """(cos table, sin table, the ``cos`` op node or None, each table's partner in its mul) multiplying this layer's
    queries; None: no RoPE."""
    found: dict[str, set[int]] = {"cos": set(), "sin": set()}
    trig = {n.idx: n.op for n in g.nodes if n.op in found}
    muls = [
        n for n in g.nodes
        if n.op == "mul" and len(n.inputs) == 2 and own >> n.idx & 1 and _reaches(g, n.idx, core.q)
    ]  # fmt: skip
    operands = [t for n in muls for t in n.inputs if t != source and not g.feeds(source, t)]
    partner = {t: next(i for i in n.inputs if i != t) for n in muls for t in n.inputs if len(set(n.inputs)) == 2}
    for t in operands:
        kinds = {op for i, op in trig.items() if _reaches(g, i, t)}
        if len(kinds) == 1:
            found[kinds.pop()].add(t)
    if not found["cos"] and not found["sin"]:  # no trig op: a precomputed table (a buffer indexed by position)
        for t in dict.fromkeys(operands):
            if _buffer_table(g, t):
                v = g.tensors[t]
                first = v.reshape(-1, *v.shape[-2:])[0][0]
                found["sin" if bool((first.abs() < 1e-12).all()) else "cos"].add(t)
    if not found["cos"] and not found["sin"]:
        return None
    if len(found["cos"]) != 1 or len(found["sin"]) != 1:
        raise PortError([f"{len(found['cos'])} cos and {len(found['sin'])} sin tables rotate the queries"])
    c, s = next(iter(found["cos"])), next(iter(found["sin"]))
    op = [i for i, kind in trig.items() if kind == "cos" and _reaches(g, i, c)]
    return c, s, (max(op) if op else None), partner


def _buffer_table(g: Graph, t: int) -> bool:
    """A float tensor of two or more dims computed from a buffer and from no parameter (a position table)."""
    v = g.tensors.get(t)
    if v is None or not v.is_floating_point() or v.dim() < 2 or v.numel() < 2:
        return False
    leaves = [g.nodes[i].op for i in range(t + 1) if _reaches(g, i, t) and g.nodes[i].op in ("buffer", "param")]
    return "buffer" in leaves and "param" not in leaves


def _first(v: Tensor) -> Tensor:
    """The (T, d) table of the first batch row / head (the one non-singleton axis before the last is T)."""
    wide = [n for n in v.shape[:-1] if n != 1]
    if len(wide) == 1:
        return v.double().reshape(wide[0], v.shape[-1])
    return v.double().reshape(-1, *v.shape[-2:])[0]


def _angles(g: Graph, cos_op: int | None, d: int, inv: Tensor, t: int) -> Tensor | None:
    """The exact inverse frequencies (d/2,) from the angle tensor the ``cos`` op read, if its rows are
    ``position * f`` for positions ``0..T-1`` and ``f`` (its halves, its even entries, or all of it) is what the
    tables show (``inv``, from atan2); else None. (GLM takes an angle tensor laid out in halves and interleaves the
    table it makes of it.)"""
    if cos_op is None:
        return None
    a = g.tensors.get(g.nodes[cos_op].inputs[0]) if g.nodes[cos_op].inputs else None
    if a is None or a.dim() < 2 or a.shape[-1] not in (d, d // 2) or t < 2 or not a.is_floating_point():
        return None
    rows = _first(a).to(a.dtype)
    if rows.shape[0] != t:
        return None
    f = rows[1]
    if not torch.equal(rows, torch.arange(t, dtype=rows.dtype, device=rows.device)[:, None] * f[None]):
        return None
    cands = [f] if f.shape[-1] == d // 2 else [f[: d // 2], f[0::2]]
    return next((c for c in cands if torch.allclose(c.double(), inv, rtol=1e-5, atol=1e-6)), None)


def _long_profile(g: Graph, freq_of: int) -> tuple[tuple[float, ...], tuple[float, ...], int] | None:
    """LongRoPE: a ``where(max(position) + 1 > n, long, short)`` feeding the frequencies: (short, long, n)."""
    for n in g.nodes[: freq_of + 1]:
        if n.op != "where" or len(n.inputs) != 3 or not _reaches(g, n.idx, freq_of):
            continue
        cond, long, short = n.inputs
        after = _length_threshold(g, g.nodes[cond])
        if after is None:
            raise PortError(["RoPE frequencies chosen by a condition that is not the sequence length"])
        lv, sv = g.tensors[long].double().flatten(), g.tensors[short].double().flatten()
        return tuple(sv.tolist()), tuple(lv.tolist()), after
    return None


def _length_threshold(g: Graph, cmp: Node) -> int | None:
    """``n`` of a recorded ``max(position) + k > c`` (true when the sequence, ``max + 1``, is longer than n)."""
    if cmp.op != "gt" or len(cmp.inputs) != 1:
        return None
    c = next((a for a in cmp.args[1:] if isinstance(a, (int, float)) and not isinstance(a, bool)), None)
    x = g.nodes[cmp.inputs[0]]
    k = 0.0
    if x.op == "add" and len(x.inputs) == 1:
        k = next((float(a) for a in x.args[1:] if isinstance(a, (int, float))), 0.0)
        x = g.nodes[x.inputs[0]]
    if c is None or x.op != "max":
        return None
    n = c + 1 - k
    return int(n) if float(n).is_integer() and n >= 1 else None


def _dynamic(g: Graph, angles: int) -> int | None:
    """A branch on the sequence length that feeds no tensor (dynamic NTK: the frequencies are recomputed, with a
    cache, once the sequence passes n positions): n, else None."""
    for n in g.nodes[:angles]:
        if n.op in _COMPARE and not g.consumers.get(n.idx) and n.inputs:
            m = g.nodes[n.inputs[0]]
            m = g.nodes[m.inputs[0]] if m.op == "add" and m.inputs else m
            if m.op == "max" and m.inputs and _reaches(g, m.inputs[0], angles):
                c = next((a for a in n.args[1:] if isinstance(a, (int, float))), None)
                return int(c) if c is not None else -1
    return None


def rope_of(g: Graph, core: Core, layer: int, known: tuple[float, ...], own: int, source: int) -> RopeReading | None:
    """The rotation applied to this layer's queries, read off the cos / sin tables its own nodes multiply the
    queries by (``own``: the layer's nodes; a table reaching the queries only through the stream is an earlier
    layer's). ``known``: RoPE bases the config states, for a fitted ``theta`` to snap to. None: no RoPE."""
    if any(n.op in ("view_as_complex", "polar") and own >> n.idx & 1 for n in g.nodes):
        raise PortError([f"layer {layer}: RoPE written with complex numbers"])
    try:
        found = _tables(g, core, own, source)
    except PortError as e:
        raise PortError([f"layer {layer}: {m}" for m in e.missing]) from None
    if found is None:
        return None
    ci, si, cos_op, partner = found
    c, s = _first(g.tensors[ci]), _first(g.tensors[si])
    t, d = c.shape
    factor = float(c[0, 0])
    if t < 2 or not (factor > 0 and torch.allclose(c[0], c[0, :1].expand_as(c[0]), rtol=0, atol=1e-7)):
        raise PortError([f"layer {layer}: RoPE tables whose row at position 0 is not a constant cos (not a rotation)"])
    if not bool((s[0].abs() <= 1e-7).all()):
        raise PortError([f"layer {layer}: RoPE sine table that is not 0 at position 0 (positions not from 0)"])
    if not math.isclose(factor, 1.0, rel_tol=0, abs_tol=1e-7):
        c, s = c / factor, s / factor
    ang = torch.atan2(s[1], c[1])
    if torch.allclose(ang[: d // 2], ang[d // 2 :], atol=1e-6):
        style, inv = RopeStyle.HALF, ang[: d // 2]
    elif torch.allclose(ang[0::2], ang[1::2], atol=1e-6):
        style, inv = RopeStyle.INTERLEAVED, ang[0::2]
    else:
        raise PortError([f"layer {layer}: a RoPE layout that is neither halves nor interleaved pairs"])
    clockwise = _clockwise(g, partner.get(ci), partner.get(si), style, layer)
    if cos_op is not None and (n := _dynamic(g, g.nodes[cos_op].inputs[0])) is not None:
        raise PortError([f"layer {layer}: RoPE frequencies recomputed once the sequence passes {n} positions "
                         "(dynamic NTK scaling: a cached branch on the sequence length)"])  # fmt: skip
    exact = _angles(g, cos_op, d, inv, t)
    if exact is not None:
        inv = exact.double()
    long = _long_profile(g, g.nodes[cos_op].inputs[0]) if cos_op is not None else None
    theta = _theta(inv, d, known)
    factor_out = 1.0 if math.isclose(factor, 1.0, rel_tol=0, abs_tol=1e-7) else factor
    if long is not None:
        short, lng, after = long
        return RopeReading(theta or 10000.0, style, d, short, factor_out, lng, after, clockwise)
    if theta is not None:
        return RopeReading(theta, style, d, None, factor_out, clockwise=clockwise)
    if bool((inv < 0).any()):
        raise PortError([f"layer {layer}: RoPE frequencies that are not all >= 0"])
    return RopeReading(10000.0, style, d, tuple(float(v) for v in inv), factor_out, clockwise=clockwise)


def _clockwise(g: Graph, q: int | None, rotated: int | None, style: RopeStyle, layer: int) -> bool:
    """Whether the operand the sine multiplies is ``-rotate(q)`` (NanoChat's ``(x2, -x1)``: each pair turned by
    ``-angle``) rather than our ``rotate(q)`` of the operand the cosine multiplies."""
    from ..blocks.attention import _rotate

    qv, rv = g.tensors.get(q) if q is not None else None, g.tensors.get(rotated) if rotated is not None else None
    if qv is None or rv is None or qv.shape != rv.shape:
        return False  # not comparable (broadcast operands): the tables' own check decides
    ours = _rotate(qv.double(), style)
    if torch.allclose(rv.double(), ours, rtol=1e-5, atol=1e-6):
        return False
    if torch.allclose(rv.double(), -ours, rtol=1e-5, atol=1e-6):
        return True
    raise PortError([f"layer {layer}: a RoPE rotation of the query pairs that is neither (-x2, x1) nor (x2, -x1)"])


def _theta(inv: Tensor, d: int, known: tuple[float, ...]) -> float | None:
    """``theta`` of ``inv_i = theta ** (-2i/d)`` fitted in log space (a ``known`` value within 1e-3 of the fit is
    taken exactly), or None when the frequencies are not of that form (a scaled profile)."""
    k = torch.arange(len(inv), dtype=torch.float64)
    if len(inv) < 2 or abs(float(inv[0]) - 1) > 1e-6 or bool((inv <= 0).any()):
        return None
    log_theta = float(-(torch.log(inv[1:]) * d / (2 * k[1:])).mean())
    fit = torch.exp(-2 * k / d * log_theta)
    if float(((fit - inv) / inv).abs().max()) > 1e-4:
        return None
    theta = math.exp(log_theta)
    exact = [t for t in known if t > 0 and abs(t / theta - 1) < 1e-3]
    return float(exact[0]) if exact else float(f"{theta:.5g}")
