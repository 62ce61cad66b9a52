"""Fused attention calls in a recorded run: what ``F.scaled_dot_product_attention`` and flex attention were asked
to compute, read from the call's own arguments, so every reader of attention (the inspector, the port, the
tensor-parallel plan) sees a fused core exactly as it sees eager ``softmax(q k^T * s + mask) v``.

* **sdpa** ``(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)``: the scale (None: the
  kernel's ``1 / sqrt(head_dim)``), the mask (a boolean "may attend" mask, or a float one added to the scores),
  ``is_causal`` (the kernel's top-left causal band), the dropout probability.
* **flex attention** (the higher-order op ``flex_attention(q, k, v, score_mod, block_mask, scale, ...)``): the
  scale; the dense mask, by evaluating the block mask's ``mask_mod`` on every (query, key) position; what
  ``score_mod`` does to a score, by evaluating it on seeded scores: nothing, a ``c * tanh(x / c)`` soft-cap, or
  something else (:attr:`FusedCall.score_mod_other`, which a reader refuses by name).

Nothing here reruns the model or switches its attention implementation; the values are the call's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .graph import Graph, Node, Ref

__all__ = ["ATTENTION_CALLS", "FusedCall", "evaluate_mask_mod", "fused_call"]

SDPA = "scaled_dot_product_attention"
FLEX = "flex_attention"
ATTENTION_CALLS = frozenset({SDPA, FLEX, "multi_head_attention_forward"})
"""Recorded ops that are a whole attention core (q, k, v in; the attended values out)."""

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@dataclass(frozen=True)
class FusedCall:
    """One fused attention call: the operands' nodes and what the kernel computes with them.

    ``allowed``: the (..., T, S) boolean mask of keys each query may attend to (None: every key); ``bias``: a float
    mask added to the scores at the allowed positions (None or all zeros: no bias); ``causal``: the kernel's own
    causal flag (sdpa's ``is_causal``), applied on top of ``allowed``; ``softcap``: a ``c * tanh(x / c)``
    ``score_mod``; ``score_mod_other``: a ``score_mod`` that is neither identity nor a soft-cap."""

    op: str
    q: int
    k: int
    v: int
    scale: float
    allowed: Tensor | None
    bias: Tensor | None
    causal: bool
    dropout: float
    softcap: float | None = None
    score_mod_other: bool = False

    def mask(self, t: int, s: int) -> Tensor | None:
        """The (T, S) "may attend" mask of the first batch element and head, the causal flag folded in (None: all)."""
        m = None if self.allowed is None else self.allowed.reshape(-1, *self.allowed.shape[-2:])[0].bool()
        if self.causal:
            band = torch.ones(t, s, dtype=torch.bool).tril()
            m = band if m is None else m & band
        return m


def _tensor(g: Graph, a: Any) -> Tensor | None:
    return g.tensors.get(a.idx) if isinstance(a, Ref) else None


def _sdpa(g: Graph, n: Node) -> FusedCall:
    got = dict(zip(_SDPA_ARGS, n.args, strict=False)) | dict(n.kwargs)
    q, k, v = (got[r].idx for r in ("query", "key", "value"))
    mask = _tensor(g, got.get("attn_mask"))
    scale = got.get("scale")
    hd = g.nodes[q].shape[-1] if g.nodes[q].shape else 1
    allowed = bias = None
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed = mask
        else:  # a float mask is added to the scores: -inf (or the dtype's min) masks, anything else is a bias
            allowed = mask > torch.finfo(mask.dtype).min / 2
            bias = torch.where(allowed, mask, torch.zeros_like(mask))
    return FusedCall(
        SDPA, q, k, v, float(scale) if scale is not None else 1.0 / math.sqrt(hd), allowed, bias,
        bool(got.get("is_causal", False)), float(got.get("dropout_p", 0.0) or 0.0),
    )  # fmt: skip


def evaluate_mask_mod(mask_mod: Callable[..., Tensor], t: int, s: int) -> Tensor:
    """A flex ``mask_mod(b, h, q_idx, kv_idx)`` as a dense (T, S) boolean mask (batch element and head 0)."""
    zero = torch.zeros((), dtype=torch.long)
    qi, ki = torch.arange(t)[:, None], torch.arange(s)[None, :]
    try:
        out = mask_mod(zero, zero, qi, ki)
        if isinstance(out, Tensor) and out.shape[-2:] == (t, s):
            return out.bool()
    except (RuntimeError, IndexError, TypeError):
        pass
    return torch.tensor([[bool(mask_mod(zero, zero, torch.tensor(i), torch.tensor(j))) for j in range(s)]
                         for i in range(t)])  # fmt: skip


def _score_mod_kind(score_mod: Any, t: int, s: int) -> tuple[float | None, bool]:
    """(soft-cap, other) of a flex ``score_mod``, evaluated on seeded scores at every position."""
    if not callable(score_mod):
        return None, False
    x = torch.randn(t, s, generator=torch.Generator().manual_seed(0), dtype=torch.float32) * 8
    zero = torch.zeros((), dtype=torch.long)
    try:
        y = score_mod(x, zero, zero, torch.arange(t)[:, None], torch.arange(s)[None, :])
    except (RuntimeError, IndexError, TypeError):
        return None, True
    y = torch.as_tensor(y, dtype=torch.float32).expand_as(x)
    if torch.equal(y, x):
        return None, False
    big = int(x.abs().argmax())  # fit c on the largest score: c * tanh(x / c) grows with c, so bisect
    xb, yb = float(x.reshape(-1)[big].abs()), float(y.reshape(-1)[big].abs())
    if not 0 < yb < xb:
        return None, True
    lo, hi = yb, 1e9
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if mid * math.tanh(xb / mid) < yb else (lo, mid)
    cap = lo
    if torch.allclose(cap * torch.tanh(x / cap), y, rtol=1e-4, atol=1e-5):
        return float(f"{cap:.6g}"), False
    return None, True


def _flex(g: Graph, n: Node) -> FusedCall:
    q, k, v = (a.idx for a in n.args[:3])
    score_mod, block, scale = n.args[3], n.args[4], n.args[5]
    qs, ks = g.nodes[q].shape or (1, 1), g.nodes[k].shape or (1, 1)
    t, s = int(qs[-2]), int(ks[-2])
    mask_mod = block[-1] if isinstance(block, tuple) and block and callable(block[-1]) else None
    allowed = evaluate_mask_mod(mask_mod, t, s) if mask_mod is not None else None
    cap, other = _score_mod_kind(score_mod, t, s)
    hd = int(qs[-1])
    sc = float(scale) if isinstance(scale, (int, float)) else 1.0 / math.sqrt(hd)
    return FusedCall(FLEX, q, k, v, sc, allowed, None, False, 0.0, cap, other)


def fused_call(g: Graph, n: Node) -> FusedCall | None:
    """The fused attention call recorded at ``n`` (None: ``n`` is none, or its operands are not recorded)."""
    if n.op == SDPA and len(n.inputs) >= 3:
        return _sdpa(g, n)
    if n.op == FLEX and len(n.args) >= 6 and all(isinstance(a, Ref) for a in n.args[:3]):
        return _flex(g, n)
    return None
