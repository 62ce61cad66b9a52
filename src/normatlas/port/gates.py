"""Read a gate on the attention output (:class:`~normatlas.blocks.attn_gate.OutputGate`) by behaviour.

The gate is the one projection inside an attention branch that feeds the output projection but none of the core's
operands (:func:`~normatlas.port.read.attention_parts`). Which activation and scope it has is the one candidate
``attn * act(gate)`` (act: sigmoid or softplus; one gate per head and dim, or one per head) equal to what the output
projection read, ``attn`` being the core's recorded output with its heads merged.
"""

from __future__ import annotations

import torch

from ..analysis.graph import Graph
from ..analysis.ops import SHAPE_ONLY
from ..analysis.walk import strip
from ..blocks.attn_gate import GateActivation, GateScope, OutputGate
from ..inspect.attention import Core
from .errors import PortError
from .measure import Scores, _close
from .read import AttnParts

__all__ = ["core_output", "gate_design", "lse_sink"]


def core_output(g: Graph, core: Core) -> int:
    """The node holding the core's output, heads first ``(B, H, T, Dv)``: the SDPA call, or the matmul of the
    probabilities with the values; -1 when not found."""
    if g.nodes[core.node].op == "scaled_dot_product_attention":
        return core.node
    for u in g.users(core.v):
        matmul = u.op in ("matmul", "bmm") and len(u.inputs) == 2 and u.inputs[1] == core.v
        if matmul and (u.inputs[0] == core.node or g.feeds(core.node, u.inputs[0])):
            return u.idx
    return -1


def gate_design(g: Graph, parts: AttnParts, layer: int) -> OutputGate:
    """The activation and scope of ``parts.gate`` (see the module docstring); raises :class:`PortError` naming the
    gate when no candidate fits."""
    gate = parts.gate
    assert gate is not None
    if strip(g, gate.input, SHAPE_ONLY) != strip(g, parts.q.input, SHAPE_ONLY):
        raise PortError([f"layer {layer}: an attention output gate ({gate.label}) reading another input than q"])
    node = core_output(g, parts.core)
    if node < 0:
        raise PortError([f"layer {layer}: a gated attention whose core output was not found"])
    a = g.tensors[node]
    heads = int(a.shape[1])
    merged = a.transpose(1, 2).reshape(*a.shape[:1], a.shape[2], -1)
    target, gv = g.tensors[parts.o.input], g.tensors[gate.output]
    if target.numel() != merged.numel():
        raise PortError([f"layer {layer}: a gated attention output of another size than the core's"])
    target = target.reshape(merged.shape)
    if gv.numel() % (merged.shape[0] * merged.shape[1]) == 0:  # a piece of a fused projection: heads not merged
        gv = gv.reshape(merged.shape[0], merged.shape[1], -1)
    for act in GateActivation:
        for scope in GateScope:
            cand = OutputGate(act, scope, bias=gate.bias() is not None)
            if gv.shape[-1] == cand.width(heads, int(a.shape[-1])) and _close(cand.apply(merged, gv, heads), target):
                return cand
    names = " / ".join(a.value for a in GateActivation)
    raise PortError(
        [f"layer {layer}: an attention output gate ({gate.label}) that is none of {names}, per element or per head"]
    )


def lse_sink(g: Graph, parts: AttnParts, scores: Scores, own: int, linked: set[int], layer: int) -> int | None:
    """The parameter node of attention sinks applied after the core (Granite-SWA: ``attn * sigmoid(lse - sink)``,
    equal to a sink logit in the softmax), found by behaviour: the one per-head parameter of the branch no other
    role takes for which the core's recorded output times ``sigmoid(logsumexp(scores) - sink)`` is what the output
    projection read (scores recomputed from the recorded q and k with the read scale, cap and mask). None: none."""
    q = g.tensors[parts.core.q]
    heads = int(q.shape[1])
    cands = [
        n.idx for n in g.nodes
        if n.op == "param" and own >> n.idx & 1 and id(g.tensors[n.idx]) not in linked
        and g.tensors[n.idx].numel() == heads
    ]  # fmt: skip
    node = core_output(g, parts.core)
    if not cands or node < 0 or parts.gate is not None:
        return None
    k = g.tensors[parts.core.k]
    sdpa = g.nodes[parts.core.node].op == "scaled_dot_product_attention"
    s = (q.double() @ (k.double().transpose(-1, -2) if sdpa else k.double())) * scores.scale
    if scores.softcap is not None:
        s = torch.tanh(s / scores.softcap) * scores.softcap
    t = s.shape[-1]
    i = torch.arange(t)
    allowed = torch.ones(t, t, dtype=torch.bool)
    if scores.causal:
        allowed &= i[:, None] >= i[None, :]
    if scores.window is not None:
        allowed &= (i[:, None] - i[None, :]) < scores.window
    lse = torch.logsumexp(s.masked_fill(~allowed, float("-inf")), dim=-1)
    a = g.tensors[node].double()
    target = g.tensors[parts.o.input]
    for c in cands:
        sink = g.tensors[c].double().reshape(1, -1, 1)
        got = a * torch.sigmoid(lse - sink)[..., None]
        merged = got.transpose(1, 2).reshape(target.shape) if got.numel() == target.numel() else None
        if merged is not None and _close(merged, target):
            return c
    return None
