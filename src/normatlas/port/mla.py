"""Read Multi-head Latent Attention off the recorded dataflow (:class:`~normatlas.blocks.mla.MLAConfig`).

Structure (no names): an attention branch is MLA when its key and value operands are computed by the same two
projections, one feeding the other (``kv_a`` then ``kv_b``); the query's are one projection (``q``) or two
(``q_a`` then ``q_b``). The latent norms are the norm sites between ``kv_a`` and ``kv_b`` (``q_a`` and ``q_b``).

Values (by behaviour): the widths follow from the core's operands (heads and q / k head dim from q, the value head
from v, the part without RoPE from ``kv_b``'s width); then each part of each operand is matched, value for value,
with the rows of the projection output it comes from: the value heads and the unrotated parts of q and k at every
token (:func:`~normatlas.port.read._match`); the rotated parts at position 0, where RoPE is the identity, which also
gives them in the core's layout (DeepSeek-V3's ``rope_interleave`` takes interleaved pairs in and writes halves
out: a permutation of the rows). The rotation from those rows to the operand is then fitted as halves or
interleaved pairs with ``theta ** (-2i/d)`` and checked at every position; the latents are matched with the norms'
inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..analysis.graph import Graph
from ..blocks.attention import Rope, RopeStyle, apply_rope, rope_tables
from ..blocks.mla import MLAConfig
from ..inspect.attention import Core
from ..inspect.norms import Site
from .errors import PortError
from .read import Proj, _match, norm_spec
from .rope import RopeReading, _theta

__all__ = ["MlaParts", "MlaReading", "mla_parts", "read_mla"]


@dataclass
class MlaParts:
    q: Proj  # q_b, or the one full-rank q projection
    q_a: Proj | None
    kv_a: Proj
    kv_b: Proj
    o: Proj
    core: Core


@dataclass
class MlaReading:
    config: MLAConfig
    heads: int
    rows: dict[str, tuple[int, ...]]  # our projection (q_proj / q_b_proj, kv_a_proj, kv_b_proj) -> their rows
    norms: dict[str, Site]  # our latent norm slot (q_norm, kv_norm) -> site
    rope: RopeReading | None


def mla_parts(g: Graph, roles: dict[str, list[Proj]], outs: list[Proj], core: Core) -> MlaParts | None:
    """The MLA projections of one attention branch, or None when its k and v are not one two-projection chain."""
    k, v, q = roles["k"], roles["v"], roles["q"]
    if len(k) != 2 or {id(p) for p in k} != {id(p) for p in v} or len(outs) != 1 or len(q) not in (1, 2):
        return None
    kv_a, kv_b = (k[0], k[1]) if g.feeds(k[0].output, k[1].input) else (k[1], k[0])
    if not g.feeds(kv_a.output, kv_b.input) or any(id(p) in {id(kv_a), id(kv_b)} for p in q):
        return None
    q_a = None
    if len(q) == 2:
        q_a, qb = (q[0], q[1]) if g.feeds(q[0].output, q[1].input) else (q[1], q[0])
        if not g.feeds(q_a.output, qb.input):
            return None
    else:
        qb = q[0]
    return MlaParts(qb, q_a, kv_a, kv_b, outs[0], core)


def _latent_site(g: Graph, sites: list[Site], a: Proj, b: Proj, what: str, layer: int) -> Site:
    found = [s for s in sites if _on(g, a.output, s.input) and _on(g, s.output, b.input)]
    if len(found) != 1:
        raise PortError([f"layer {layer}: MLA with {len(found)} norms on the {what} latent (ours: one)"])
    return found[0]


def _on(g: Graph, a: int, b: int) -> bool:
    return a == b or g.feeds(a, b)


def _rows(tokens: Tensor, target: Tensor, what: str, layer: int) -> tuple[int, ...]:
    rows = _match(tokens, target.contiguous())
    if rows is None:
        raise PortError([f"layer {layer}: MLA's {what} was not found in its projection's output"])
    return rows


def _per_head(parts: list[tuple[int, ...]], widths: list[int], heads: int) -> tuple[int, ...]:
    """Interleave per-head row lists: for each head, ``widths[j]`` rows of ``parts[j]``."""
    out: list[int] = []
    for h in range(heads):
        for rows, w in zip(parts, widths, strict=True):
            out += rows[h * w : (h + 1) * w]
    return tuple(out)


def read_mla(g: Graph, parts: MlaParts, sites: list[Site], layer: int, known: tuple[float, ...]) -> MlaReading:
    """Widths, rows, latent norms and the decoupled RoPE of one MLA branch (see the module docstring)."""
    q_t, k_t, v_t = (g.tensors[getattr(parts.core, r)] for r in "qkv")
    if g.nodes[parts.core.node].op != "scaled_dot_product_attention":
        k_t = k_t.transpose(-1, -2)  # a score matmul's key operand is k transposed
    if q_t.dim() != 4 or k_t.dim() != 4 or v_t.dim() != 4:
        raise PortError([f"layer {layer}: MLA operands that are not (batch, heads, tokens, dim)"])
    heads, seq, qk = (int(d) for d in q_t.shape[1:])
    dv = int(v_t.shape[-1])
    if int(k_t.shape[1]) != heads or int(v_t.shape[1]) != heads:
        raise PortError([f"layer {layer}: MLA with {int(k_t.shape[1])} key heads for {heads} query heads"])
    y_q, y_kva, y_kvb = (g.tensors[p.output] for p in (parts.q, parts.kv_a, parts.kv_b))
    tok = {n: t.reshape(-1, t.shape[-1]) for n, t in (("q", y_q), ("kva", y_kva), ("kvb", y_kvb))}
    nope = int(y_kvb.shape[-1]) // heads - dv
    rope = qk - nope
    if nope < 0 or rope <= 0 or rope % 2:
        raise PortError([f"layer {layer}: MLA widths that do not split (q/k head {qk}, value head {dv})"])
    v_rows = _rows(tok["kvb"], v_t, "value", layer)
    k_nope = _rows(tok["kvb"], k_t[..., :nope], "key without RoPE", layer) if nope else ()
    q_nope = _rows(tok["q"], q_t[..., :nope], "query without RoPE", layer) if nope else ()
    q_rope = _rows(tok["q"][:1], q_t[0, :, 0, nope:], "rotated query", layer)  # position 0: RoPE is the identity
    k_first = k_t[0, :, :, nope:]
    if not torch.equal(k_first, k_first[:1].expand_as(k_first)):
        raise PortError([f"layer {layer}: MLA whose rotated key differs between heads (ours: one shared head)"])
    k_rope = _rows(tok["kva"][:1], k_t[0, 0, 0, nope:], "rotated key", layer)
    kv_site = _latent_site(g, sites, parts.kv_a, parts.kv_b, "kv", layer)
    latent = _rows(tok["kva"], g.tensors[kv_site.input], "kv latent", layer)
    norms = {"kv_norm": kv_site}
    q_rank = None
    if parts.q_a is not None:
        q_site = _latent_site(g, sites, parts.q_a, parts.q, "q", layer)
        q_rank = int(g.tensors[parts.q_a.output].shape[-1])
        if int(g.tensors[q_site.input].shape[-1]) != q_rank:
            raise PortError([f"layer {layer}: a norm on part of MLA's q latent"])
        norms["q_norm"] = q_site
    specs = {norm_spec(s) for s in norms.values()}
    if len(specs) != 1:
        raise PortError([f"layer {layer}: MLA's q and kv latent norms differ"])
    cfg = MLAConfig(
        kv_lora_rank=len(latent), qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=dv, q_lora_rank=q_rank,
        latent_norm=specs.pop(),
    )  # fmt: skip
    q_pre = y_q.reshape(-1, y_q.shape[-1])[:seq, list(q_rope)].reshape(seq, heads, rope)
    k_pre = y_kva.reshape(-1, y_kva.shape[-1])[:seq, list(k_rope)].reshape(seq, 1, rope)
    reading = _fit_rope(
        (q_pre, q_t[0, :, :, nope:].transpose(0, 1)), (k_pre, k_t[0, :1, :, nope:].transpose(0, 1)), layer, known
    )
    rows = {
        "q": _per_head([q_nope, q_rope], [nope, rope], heads),
        "kv_a_proj": latent + k_rope,
        "kv_b_proj": _per_head([k_nope, v_rows], [nope, dv], heads),
    }
    return MlaReading(cfg, heads, rows, norms, reading)


def _fit_rope(
    q: tuple[Tensor, Tensor], k: tuple[Tensor, Tensor], layer: int, known: tuple[float, ...]
) -> RopeReading | None:
    """The rotation taking the rows ``(T, H, r)`` to the operand's rotated part, the same for q and k: halves or
    interleaved pairs, ``inv_freq`` read at position 1, ``theta`` fitted, then checked at every position."""
    (xq, yq), (xk, yk) = q, k
    if torch.equal(xq, yq) and torch.equal(xk, yk):
        return None  # no rotation: the decoupled part is a NoPE part
    r = xq.shape[-1]
    pos = torch.arange(xq.shape[0])
    for style in (RopeStyle.HALF, RopeStyle.INTERLEAVED):
        a, b = (torch.arange(r // 2), torch.arange(r // 2, r)) if style is RopeStyle.HALF else (
            torch.arange(0, r, 2), torch.arange(1, r, 2))  # fmt: skip
        x, y = xq.double(), yq.double()  # (T, H, r)
        ang = torch.atan2(x[..., a] * y[..., b] - x[..., b] * y[..., a], x[..., a] * y[..., a] + x[..., b] * y[..., b])
        ang = ang.median(1).values  # (T, r/2): each pair's angle at each position
        inv = ang[1]
        for p in range(2, ang.shape[0]):  # unwrap: p * inv_i grows past pi; the last position reads it most finely
            turns = torch.round((p * inv - ang[p]) / (2 * math.pi))
            inv = (ang[p] + 2 * math.pi * turns) / p
        theta = _theta(inv, r, known)
        if theta is None:  # not theta ** (-2i/d) in this layout
            continue
        rope = Rope(theta, style)
        cos, sin = rope_tables(rope, r, pos)
        c2, s2 = cos.double(), sin.double()
        ok = all(
            _near(apply_rope(xx.double().transpose(0, 1), c2, s2, style), yy.double().transpose(0, 1))
            for xx, yy in ((xq, yq), (xk, yk))
        )
        if ok:
            return RopeReading(theta, style, r)
    raise PortError([f"layer {layer}: MLA's rotated part is not a RoPE of theta ** (-2i/d) (scaled RoPE)"])


def _near(a: Tensor, b: Tensor) -> bool:
    return bool((a - b).abs().max() <= 1e-5 * (1 + float(b.abs().max()))) and not math.isnan(float(a.sum()))
