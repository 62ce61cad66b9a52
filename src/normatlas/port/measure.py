"""Measure what the structure leaves open, from the recorded values: the MLP's activation and gate, the attention's
score scale, soft-cap, mask (causal, sliding window), RoPE (style, rotated fraction, base), and the constant
scalings of the branches, the embedding and the logits.

Each measurement compares recorded tensors with the candidates our blocks can compute (``silu(gate) * up`` against
the down projection's input, the cos/sin tables against ``theta ** (-2i/d)``), so a value is what the model did,
not what its config or names say. A value that fits no candidate raises :class:`PortError` naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..analysis.attention_calls import FusedCall, fused_call
from ..analysis.graph import Graph
from ..analysis.ops import CASTS, SHAPE_ONLY, SPLITS
from ..analysis.walk import learned_mul, scalar_mul, scale_back, strip
from ..blocks.mlp import Activation
from ..inspect.attention import Core
from .errors import PortError
from .read import MlpParts, Proj
from .rope import RopeReading, rope_of

__all__ = ["Mlp", "RopeReading", "Scores", "branch_scale", "logit_ends", "mlp_design", "rope_of", "scores_of"]


def _close(a: Tensor, b: Tensor) -> bool:
    a, b = a.double(), b.double()
    return a.shape == b.shape and bool((a - b).abs().max() <= 1e-5 * (1 + float(b.abs().max())))


@dataclass
class Mlp:
    activation: Activation
    gated: bool
    gate: Proj | None
    up: Proj
    down: Proj
    learned: tuple[Tensor, ...] = ()  # a learned activation's parameters, in its module's order (xIELU: a_p, a_n)


def mlp_design(g: Graph, parts: MlpParts, layer: int) -> Mlp:
    """Which first projection is the gate and which activation it goes through: the one candidate among
    ``act(gate) * up`` (gated) or ``act(up)`` (plain) that equals what the down projection read."""
    d = g.tensors[parts.down.input]
    outs = [(p, g.tensors[p.output]) for p in parts.firsts]
    cands: list[tuple[Proj | None, Proj, Tensor | None, Tensor]] = []
    if len(outs) == 2:
        (pa, a), (pb, b) = outs
        cands = [(pa, pb, a, b), (pb, pa, b, a)]
    else:
        p, y = outs[0]
        n = d.shape[-1]
        if y.shape[-1] == n:
            cands = [(None, p, None, y)]
        elif y.shape[-1] == 2 * n:  # one fused gate-and-up projection, split in halves
            lo, hi = tuple(range(n)), tuple(range(n, 2 * n))
            cands = [(p.with_rows(lo), p.with_rows(hi), y[..., :n], y[..., n:])]
            cands.append((p.with_rows(hi), p.with_rows(lo), y[..., n:], y[..., :n]))
    for act in Activation:
        for gate, up, gv, uv in cands:
            if act.learned:
                found = _xielu(g, parts, uv if gv is None else gv, None if gv is None else uv)
                if found is not None:
                    return Mlp(act, gate is not None, gate, up, parts.down, found)
                continue
            got = act(uv) if gv is None else act(gv) * uv
            if _close(got, d):
                return Mlp(act, gate is not None, gate, up, parts.down)
    names = ", ".join(a.value for a in Activation)
    starts = [p.output for p in parts.firsts]
    clamps = [n for n in g.nodes if n.op in ("clamp", "clamp_max", "clamp_min") and g.feeds(n.idx, parts.down.input)
              and any(g.feeds(s, n.idx) for s in starts)]  # fmt: skip
    why = ": it clamps its inputs (a gpt-oss style clamped SwiGLU)" if clamps else ""  # MiniMax-M3: (up + 1) g s(a g)
    raise PortError([f"layer {layer}: an MLP activation or gating that is none of {names} (gated or not){why}"])


def _xielu(g: Graph, parts: MlpParts, x: Tensor, up: Tensor | None) -> tuple[Tensor, ...] | None:
    """xIELU's two learned scalars (a_p, a_n before their softplus), when the down projection's input equals
    :class:`~normatlas.blocks.XIELU` of ``x`` (times ``up``, gated) with them in one order or the other: the
    parameters of one element the branch reads after its first projections."""
    from ..blocks.mlp import XIELU

    d = g.tensors[parts.down.input]
    starts = [p.output for p in parts.firsts]
    params = [n.idx for n in g.nodes if n.op == "param" and math.prod(n.shape or ()) == 1
              and g.feeds(n.idx, parts.down.input) and not any(g.feeds(n.idx, s) for s in starts)]  # fmt: skip
    if len(params) != 2:
        return None
    act = XIELU().double()
    for a_p, a_n in (params, params[::-1]):
        with torch.no_grad():
            act.alpha_p.copy_(g.tensors[a_p].detach().reshape(1))
            act.alpha_n.copy_(g.tensors[a_n].detach().reshape(1))
            got = act(x.double()) if up is None else act(x.double()) * up.double()
        if _close(got, d):
            return g.tensors[a_p], g.tensors[a_n]
    return None


@dataclass
class Scores:
    scale: float
    softcap: float | None
    causal: bool
    window: int | None
    sink: int | None = None  # the parameter node of a learned per-head logit joining the softmax (attention sinks)
    alibi: tuple[float, ...] | None = None  # ALiBi's slope per head, read from an additive bias (:mod:`.alibi`)


def scores_of(g: Graph, core: Core, layer: int) -> Scores:
    """The constant on q.k, the tanh soft-cap and the mask between the score matmul and the softmax, or the
    arguments of a fused attention call (sdpa, flex attention) that computes them."""
    call = fused_call(g, g.nodes[core.node])
    if call is not None:
        return _fused_scores(call, g, layer)
    start = next((n.idx for n in g.nodes if n.op in ("matmul", "bmm") and n.inputs[:1] == (core.q,)), None)
    scale = 1.0
    terms: list[tuple[int, int, float]] = []  # (a bias operand, the node it is added into, the scale on q.k there)
    if start is None:  # baddbmm(input, q, k, beta, alpha=scale): beta * input is a bias
        fused = [n for n in g.nodes if n.op == "baddbmm" and n.inputs[1:2] == (core.q,)]
        start = fused[0].idx if fused else None
        scale = float(fused[0].kwargs.get("alpha", 1.0)) if fused else 1.0
        beta = float(fused[0].kwargs.get("beta", 1.0)) if fused else 0.0
        if beta != 0 and bool((g.tensors[fused[0].inputs[0]] != 0).any()):
            terms.append((fused[0].inputs[0], fused[0].idx, scale / beta))
    if start is None or g.nodes[core.node].op != "softmax":
        raise PortError([f"layer {layer}: the attention scores are not a matmul of q and k before a softmax"])
    cur, capped, mask, sink, mult = start, False, None, None, None
    while cur != core.node:
        nxt = [u for u in g.users(cur) if u.idx == core.node or g.feeds(u.idx, core.node)]
        nxt = _past_max_shift(g, nxt, cur)
        if len(nxt) != 1:
            raise PortError([f"layer {layer}: the attention scores branch before the softmax"])
        u = nxt[0]
        sm = scalar_mul(g, u)
        if u.idx == core.node:
            break
        if sm is not None and sm[0] == cur:
            scale *= 1.0 if capped else sm[1]
        elif u.op == "tanh":
            if terms:
                raise PortError([f"layer {layer}: an additive bias on the attention scores before a soft-cap"])
            capped = True
        elif u.op == "mul" and (m := _mul_mask(g, u, cur)) is not None:
            mult = mask = m if mask is None else mask & m  # GPT-1: scores * b + -1e4 * (1 - b)
        elif u.op in ("add", "where", "masked_fill"):
            got, operand = _mask_operand(g, u, cur, mult)
            if operand is not None:
                terms.append((operand, u.idx, scale))
            mask = got if mask is None else (mask if got is None else mask & got)
        elif u.op in ("max", "maximum", "clamp_min") and _floor_noop(g, u, cur):
            pass  # XGLM's max(scores, finfo.min): equal on every finite score
        elif u.op == "cat" and sink is None and (s := _sink_of(g, u, cur, core)) is not None:
            sink = s
        elif u.op == "sub" and _is_max_shift(g, u, cur):
            pass  # x - max(x): the softmax is the same
        elif not (u.op in SHAPE_ONLY or u.op in SPLITS):
            raise PortError([f"layer {layer}: an op ({u.op}) on the attention scores our attention does not have"])
        cur = u.idx
    cap = core.softcap if capped else None
    if capped and cap is None:
        raise PortError([f"layer {layer}: a tanh on the attention scores that is not a c * tanh(x / c) soft-cap"])
    causal, window = _mask_shape(mask, layer)
    slopes = None
    if terms:
        if sink is not None:
            raise PortError([f"layer {layer}: an additive bias on the attention scores with attention sinks"])
        from .alibi import eager_bias, fit_slopes

        bias, allowed = eager_bias(g, terms, core.node, scale)
        slopes = fit_slopes(bias, allowed, layer)
    return Scores(scale * (cap or 1.0), cap, causal, window, sink, slopes)


def _is_max(g: Graph, i: int, of: int) -> bool:
    n = g.nodes[strip(g, i, SHAPE_ONLY | SPLITS | frozenset({"item_of"}))]
    return n.op in ("max", "amax") and n.inputs[:1] == (of,)


def _is_max_shift(g: Graph, u: object, cur: int) -> bool:
    """``u`` is ``cur - max(cur)`` (a softmax's overflow guard, gpt-oss)."""
    n = g.nodes[u.idx]  # type: ignore[attr-defined]
    return len(n.inputs) == 2 and n.inputs[0] == cur and _is_max(g, n.inputs[1], cur)


def _past_max_shift(g: Graph, nxt: list, cur: int) -> list:
    """The users of ``cur`` on the way to the softmax, with the max a ``cur - max(cur)`` guard reads left out."""
    if len(nxt) < 2:
        return nxt
    shifts = [u for u in nxt if u.op == "sub" and _is_max_shift(g, u, cur)]
    if len(shifts) != 1:
        return nxt
    return [u for u in nxt if u is shifts[0] or not _is_max(g, u.idx, cur)]


def _sink_of(g: Graph, u: object, cur: int, core: Core) -> int | None:
    """The parameter node of a learned logit per head concatenated after the keys (attention sinks), if ``u`` is
    that concatenation along the last dim."""
    n = g.nodes[u.idx]  # type: ignore[attr-defined]
    dim, nd = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else 0), len(n.shape or ())
    if len(n.inputs) != 2 or n.inputs[0] != cur or not isinstance(dim, int) or not nd or dim % nd != nd - 1:
        return None
    leaf = g.nodes[strip(g, n.inputs[1], SHAPE_ONLY)]
    heads = g.nodes[core.q].shape
    t = g.tensors.get(leaf.idx)
    if leaf.op != "param" or t is None or heads is None or t.numel() != heads[1]:
        return None
    return leaf.idx


def _fused_scores(call: FusedCall, g: Graph, layer: int) -> Scores:
    """A fused call's scores: its scale, its soft-cap (flex ``score_mod``) and its mask (``attn_mask``, the
    causal flag, or flex's ``mask_mod``)."""
    what = "flex attention" if call.op == "flex_attention" else "scaled_dot_product_attention"
    if call.dropout:
        raise PortError([f"layer {layer}: {what} with dropout_p={call.dropout} (put the model in eval mode)"])
    if call.score_mod_other:
        raise PortError([f"layer {layer}: a flex attention score_mod that is neither identity nor a soft-cap"])
    qs, ks = g.nodes[call.q].shape, g.nodes[call.k].shape
    t, s = (int(qs[-2]), int(ks[-2])) if qs and ks else (0, 0)
    if call.causal and t != s:
        raise PortError([f"layer {layer}: {what} with is_causal over {t} queries and {s} keys"])
    allowed = call.mask(t, s)
    causal, window = _mask_shape(allowed, layer)
    slopes = None
    if call.bias is not None and bool((call.bias != 0).any()):  # a float attn_mask: ALiBi's slopes, or refused
        from .alibi import fit_slopes

        h = int(qs[-3]) if qs and len(qs) >= 3 else 1
        bias = call.bias.expand(torch.broadcast_shapes(call.bias.shape, (h, t, s))).reshape(-1, h, t, s)[0]
        slopes = fit_slopes(bias, allowed if allowed is not None else torch.ones(t, s, dtype=torch.bool), layer)
    return Scores(call.scale, call.softcap, causal, window, alibi=slopes)


def _mul_mask(g: Graph, u: object, scores: int) -> Tensor | None:
    """The keys a multiplication of the scores by a 0 / 1 tensor keeps (GPT-1's ``scores * b``), or None when the
    other factor is not such a mask."""
    node = g.nodes[u.idx]  # type: ignore[attr-defined]
    others = [i for i in node.inputs if i != scores and not g.feeds(scores, i)]
    t = g.tensors.get(others[0]) if len(others) == 1 else None
    if t is None or t.numel() < 2 or not bool(((t == 0) | (t == 1)).all()):
        return None
    return t.bool()


def _floor_noop(g: Graph, u: object, scores: int) -> bool:
    """Whether ``max(scores, c)`` has a floor ``c`` at or below the dtype's lowest finite value (a no-op on every
    finite score: XGLM's clamp against an overflowing mask)."""
    from ..analysis.walk import scalar_of

    node = g.nodes[u.idx]  # type: ignore[attr-defined]
    others = [a for a in (*node.args, *node.kwargs.values()) if not (hasattr(a, "idx") and a.idx == scores)]
    st = g.tensors.get(scores)
    floors = [scalar_of(g, a) for a in others]
    lowest = torch.finfo(st.dtype).min if st is not None and st.is_floating_point() else None
    return lowest is not None and len(floors) == 1 and floors[0] is not None and floors[0] <= lowest


def _mask_operand(g: Graph, u: object, scores: int, mult: Tensor | None = None) -> tuple[Tensor | None, int | None]:
    """(the "may attend" mask, None where it allows every key; the operand's node when it also adds a nonzero
    bias where it allows); ``mult``: the keys a multiplicative mask before it keeps (GPT-1)."""
    node = g.nodes[u.idx]  # type: ignore[attr-defined]
    others = [i for i in node.inputs if i != scores and not g.feeds(scores, i)]
    t = g.tensors[others[0]] if others else None
    if t is None:
        raise PortError(["an attention mask that was not recorded"])
    if node.op == "add":
        if not t.is_floating_point():
            return t.bool(), None
        if mult is not None:  # the fill of a multiplicative mask: 0 where it keeps, <= -1e4 (exp gives 0) elsewhere
            tb, mb = torch.broadcast_tensors(t, mult)
            if bool((tb[mb] == 0).all()) and bool((tb[~mb] <= -1e4).all()):
                return mult, None
        allowed = t > torch.finfo(t.dtype).min / 2
        biased = others[0] if bool((t[allowed] != 0).any()) else None
        return (None if bool(allowed.all()) else allowed), biased
    return (t.bool() if node.op == "where" else ~t.bool()), None


def _mask_shape(mask: Tensor | None, layer: int) -> tuple[bool, int | None]:
    """(causal, window) of a recorded (..., T, T) mask: allowed keys ``i - w < j <= i`` (causal, window w)."""
    if mask is None:
        return False, None
    m = mask.reshape(-1, *mask.shape[-2:])[0]
    t = m.shape[-1]
    if bool(m.all()):
        return False, None
    i = torch.arange(t)
    if bool(m.triu(1).any()):
        raise PortError([f"layer {layer}: an attention mask that is neither causal nor full"])
    w = int(m.sum(-1).max())
    band = (i[:, None] - i[None, :] < w) & (i[:, None] >= i[None, :])
    if not torch.equal(m, band):
        raise PortError([f"layer {layer}: a causal mask that is not a sliding window"])
    return True, (w if w < t else None)


def branch_scale(g: Graph, branch: int, stops: set[int]) -> tuple[float, int, int | None]:
    """Constant multipliers on a branch before its residual add, the node they scale, and the parameter node of a
    learned per-channel multiplier (LayerScale) there, if any (walking back until a norm's output, ``stops``)."""
    cur, scale, learned = branch, 1.0, None
    while cur not in stops:
        n = g.nodes[cur]
        if n.op in CASTS and n.inputs:
            cur = strip(g, cur)
        elif (sm := scalar_mul(g, n)) is not None:
            scale, cur = scale * sm[1], sm[0]
        elif (lm := learned_mul(g, n)) is not None and learned is None:
            learned = next(strip(g, i, SHAPE_ONLY) for i in n.inputs if i != lm[0])
            cur = lm[0]
        else:
            break
    return scale, cur, learned


def head_input_scale(g: Graph, head: Proj, stop: int | None = None) -> float:
    """The constant multipliers on the head's input after the last stream value (``stop``: MiniCPM3's
    ``hidden / logits_scaling``), walking back through views and casts. Through a linear head without bias it is
    a scale on the logits; with a bias it is refused by name."""
    scale, _ = scale_back(g, head.input, lambda cur: cur == stop)
    if scale != 1.0 and head.bias() is not None:
        raise PortError([f"a constant scale ({scale:g}) on the input of a head projection with a bias"])
    return scale


def logit_ends(g: Graph, head: Proj, stop: int | None = None) -> tuple[float, float | None]:
    """(constant scale, tanh soft-cap) between the head projection and the logits, with the constant on the head's
    input after ``stop`` (the last stream value) folded in (:func:`head_input_scale`)."""
    out = g.outputs[0] if g.outputs else head.output
    cur, scale, cap = head.output, head_input_scale(g, head, stop), None
    while cur != out:
        nxt = [u for u in g.users(cur) if u.idx == out or g.feeds(u.idx, out)]
        if len(nxt) != 1:
            raise PortError(["the logits branch after the head projection"])
        u = nxt[0]
        sm = scalar_mul(g, u)
        if sm is not None and sm[0] == cur:
            if cap is None:
                scale *= sm[1]
        elif u.op == "tanh":
            pre = scalar_mul(g, g.nodes[u.inputs[0]])
            cap = 1.0 / pre[1] if pre is not None else None
            if cap is None:
                raise PortError(["a tanh on the logits that is not a c * tanh(x / c) soft-cap"])
            scale /= pre[1] if pre is not None else 1.0  # the 1/c before the tanh is the cap's, not a logit scale
        elif not (u.op in SHAPE_ONLY or u.op in SPLITS):
            raise PortError([f"an op ({u.op}) between the head projection and the logits"])
        cur = u.idx
    return scale, cap
