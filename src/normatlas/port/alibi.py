"""Read an additive bias on the attention scores by value, as ALiBi's per-head slopes (:mod:`..blocks.alibi`).

The bias is what the scores carry besides ``scale * q.k`` where a query may attend: in eager attention each tensor
added to the scores between their matmul and the softmax (``baddbmm``'s ``beta * input``, an added tensor, a float
mask's values where it allows), times the constants applied after it, so it is measured in the scores' units
wherever the model adds it; in a fused call, the float ``attn_mask``'s values at the allowed positions.

Head ``h`` must read ``slope[h] * (j - i)`` plus a constant per query row (which the softmax cancels: BLOOM's
``slope * j``, MPT's ``slope * (j - T + 1)``); anything else is refused by name (relative-position buckets, a
symmetric ``-|i - j|``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..analysis.graph import Graph
from .errors import PortError

__all__ = ["eager_bias", "fit_slopes"]

_NOT_ALIBI = (
    "an additive bias on the attention scores that is not ALiBi's slope * (j - i) per head (relative positions)"
)


def fit_slopes(bias: Tensor, allowed: Tensor, layer: int) -> tuple[float, ...] | None:
    """The slope of each head of a ``(H, T, S)`` bias at the ``(T, S)`` allowed positions (None: the bias is zero
    there). Least squares on each row's deviations from its mean; the fit must hold to 1e-4 of the bias's size.
    A bias recorded in fp32 or narrower has its slopes rounded to the nearest fp32 value (what the model computed;
    the float64 fit of an fp32 subtraction is off by a few 1e-9)."""
    b = bias.double()
    m = allowed.bool().expand(b.shape[-2:])
    if not bool(m.any()):
        return None
    size = float(b[:, m].abs().max())
    if size <= 1e-6:
        return None
    t, s = m.shape
    rel = torch.arange(s, dtype=torch.float64)[None, :] - torch.arange(s - t, s, dtype=torch.float64)[:, None]
    w = m.double()
    count = w.sum(-1, keepdim=True).clamp(min=1)
    rel_c = (rel - (rel * w).sum(-1, keepdim=True) / count) * w  # (T, S)
    b_c = (b - (b * w).sum(-1, keepdim=True) / count) * w  # (H, T, S)
    den = float((rel_c**2).sum())
    if den == 0:
        raise PortError([f"layer {layer}: an additive bias on the attention scores with one key per query"])
    slopes = (b_c * rel_c).sum((-2, -1)) / den
    err = float((b_c - slopes[:, None, None] * rel_c).abs().max())
    if err > 1e-4 * (1 + size):
        raise PortError([f"layer {layer}: {_NOT_ALIBI}"])
    if bias.dtype != torch.float64:
        slopes = slopes.float().double()
    return tuple(float(v) for v in slopes)


def eager_bias(g: Graph, terms: list[tuple[int, int, float]], softmax: int, scale: float) -> tuple[Tensor, Tensor]:
    """(bias, allowed) of an eager core: each recorded bias operand (``terms``: its node, the node it is added into,
    the scale on q.k there) times the scale applied after it (``scale``: the total), broadcast to the scores it
    joins and laid out as the softmax's input, summed, as ``(leading, T, S)``; and the ``(T, S)`` mask of the
    softmax input's entries above its dtype's minimum (the first leading entry's; every one must agree)."""
    x = g.tensors[g.nodes[softmax].inputs[0]]
    t, s = int(x.shape[-2]), int(x.shape[-1])
    bias = torch.zeros(x.shape, dtype=torch.float64)
    for operand, into, at in terms:
        b, shape = g.tensors[operand].double(), g.nodes[into].shape or ()
        if math.prod(shape) != x.numel():
            raise PortError([f"an additive bias on attention scores of shape {tuple(shape)} for a softmax over "
                             f"{tuple(x.shape)}"])  # fmt: skip
        bias += b.expand(torch.broadcast_shapes(b.shape, shape)).reshape(x.shape) * (scale / at)
    live = x > torch.finfo(x.dtype).min / 2
    bias = torch.where(live, bias, torch.zeros_like(bias)).reshape(-1, t, s).to(x.dtype)
    allowed = live.reshape(-1, t, s)
    if not bool((allowed == allowed[:1]).all()):
        raise PortError(["an attention mask that differs between heads, next to an additive bias"])
    return bias, allowed[0]
