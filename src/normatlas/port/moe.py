"""Read a routed mixture-of-experts MLP off the recorded dataflow, by behaviour (:class:`~normatlas.blocks.MoEConfig`).

Structure gives the parts: the one ``topk`` among the branch's own nodes is the choice of experts; the ``linear`` map
of the branch input that feeds it, giving one score per expert, is the router; a per-expert tensor added on the way
to the ``topk`` is a selection bias; the 3-D tensors of ``E`` slices the branch reads are the experts' weights;
the projections left over form the shared expert (one of output width 1 is its sigmoid gate). How the experts'
weights are stored (``(E, 2F, D)`` fused gate-and-up, transposed, separate) and used (an eager loop, ``grouped_mm``,
``bmm``) does not matter: every semantic is measured by comparing candidate computations with recorded values:

* the routing (score function, softmax before or after the top-k, renormalisation, selection bias): the candidate
  that chooses the recorded experts for every token and, with
* the experts' layout and activation (each candidate split of the stacked weights, each :class:`Activation`, gated
  or not) and a routed scale fitted by least squares, gives the recorded output of the MLP branch.

A variant none of them computes raises :class:`PortError` naming it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ..analysis.graph import Graph, Node
from ..analysis.ops import SHAPE_ONLY
from ..analysis.walk import strip
from ..blocks.mlp import Activation
from ..blocks.moe import MoEConfig, RouterScore, route
from ..inspect.residual import Sublayer
from .errors import PortError
from .read import MlpParts, Proj, own_bits

__all__ = ["MoeReading", "read_moe", "routed"]

_Route = tuple[MoEConfig, Tensor, Tensor]


@dataclass(frozen=True)
class Stacked:
    """One of our stacked expert tensors ``(E, out, in)``: ``param`` (the model's tensor), transposed in its last two
    dims first, then ``rows`` along dim 1 (a fused gate-and-up tensor; None: all)."""

    param: Tensor
    transpose: bool
    rows: tuple[int, ...] | None = None

    def value(self) -> Tensor:
        t = self.param.detach().double()
        t = t.transpose(-2, -1) if self.transpose else t
        return t[:, list(self.rows)] if self.rows is not None else t


@dataclass
class MoeReading:
    """One MoE layer: its config, the experts' activation and gating, and where each of our tensors comes from
    (``router``, ``gate`` / ``up`` / ``down`` as :class:`Stacked`, ``selection_bias``, the shared expert's parts)."""

    config: MoEConfig
    activation: Activation
    gated: bool
    router: Tensor
    experts: dict[str, Stacked]
    selection_bias: Tensor | None = None
    shared: tuple[Proj | None, Proj, Proj] | None = None  # (gate, up, down) of the shared expert
    shared_gate: Proj | None = None
    notes: list[str] = field(default_factory=list)


def routed(g: Graph, sub: Sublayer, branch: int) -> bool:
    """Whether the branch chooses among experts (a ``topk`` among its own nodes)."""
    own = own_bits(g, branch, sub.source)
    return any(own >> n.idx & 1 for n in g.nodes if n.op == "topk")


def _leaves(g: Graph, bits: int) -> list[Node]:
    return [n for n in g.nodes if bits >> n.idx & 1 and n.op in ("param", "buffer")]


def _close(a: Tensor, b: Tensor, tol: float = 1e-5) -> bool:
    """Equal to ``tol`` relative to ``b``'s size (not ``1 +`` it: a freshly initialised branch's output is ~1e-3,
    where an absolute floor would let a wrong routing with a fitted scale pass)."""
    return a.shape == b.shape and bool((a - b).abs().max() <= tol * float(b.abs().max()) + 1e-30)


def read_moe(g: Graph, sub: Sublayer, branch: int, out: int, projs: list[Proj], layer: int) -> MoeReading:
    """The MoE of one MLP branch whose output (before any post-norm or constant scale) is node ``out``."""
    own = own_bits(g, branch, sub.source)
    topks = [n for n in g.nodes if own >> n.idx & 1 and n.op == "topk"]
    t, groups = _stages(g, topks, layer)
    k = _k(t)
    if t.kwargs.get("largest", t.args[3] if len(t.args) > 3 else True) is False:
        raise PortError([f"layer {layer}: a router that picks the smallest scores"])
    picked = next((u for u in g.users(t.idx) if u.op == "item_of" and u.args[1] == 1), None)
    scores_in = t.inputs[0]
    n_exp = int(g.tensors[scores_in].shape[-1])
    lins = [
        n
        for n in g.nodes
        if own >> n.idx & 1 and n.op == "linear" and (n.idx == scores_in or g.feeds(n.idx, scores_in))
        and len(n.inputs) >= 2 and g.nodes[strip(g, n.inputs[1], SHAPE_ONLY)].op == "param"
        and tuple(g.tensors[n.inputs[1]].shape)[:1] == (n_exp,)
    ]  # fmt: skip
    if len(lins) != 1 or picked is None:
        raise PortError([f"layer {layer}: a router that is not one linear map to {n_exp} expert scores"])
    rl = lins[0]
    if len(rl.inputs) > 2:
        raise PortError([f"layer {layer}: a router with a bias"])
    router = g.tensors[strip(g, rl.inputs[1], SHAPE_ONLY)]
    d = int(router.shape[1])
    x_node = rl.inputs[0]
    x = g.tensors[x_node].detach().double().reshape(-1, d)
    logits = g.tensors[rl.idx].detach().double().reshape(-1, n_exp)
    chosen = g.tensors[picked.idx].reshape(-1, k)
    sel_bits = (g.anc(scores_in) | 1 << scores_in) & own
    biases = [n for n in _leaves(g, sel_bits) if g.tensors[n.idx].numel() == n_exp and g.tensors[n.idx] is not router]
    if len(biases) > 1:
        raise PortError([f"layer {layer}: {len(biases)} per-expert tensors on the way to the router's top-k"])
    sel_bias = g.tensors[biases[0].idx] if biases else None
    taken = {id(router)} | ({id(sel_bias)} if sel_bias is not None else set())
    inside = [p for p in projs if own >> p.output & 1 and id(p.weight()) not in taken]
    shared_gate = [p for p in inside if g.tensors[p.output].shape[-1] == 1]
    if len(shared_gate) > 1:
        raise PortError([f"layer {layer}: {len(shared_gate)} projections of width 1 beside the experts"])
    shared_projs = [p for p in inside if p not in shared_gate]
    taken |= {id(p.weight()) for p in inside} | {id(p.bias()) for p in inside if p.bias() is not None}
    stacked = list({id(g.tensors[n.idx]): g.tensors[n.idx] for n in _leaves(g, own)}.values())
    stacked = [s for s in stacked if id(s) not in taken and s.dim() == 3]  # other tensors: norms, left to the links
    if not stacked:
        raise PortError([f"layer {layer}: experts that are not stacked (E, out, in) tensors (one module per expert)"])
    if not all(s.shape[0] == n_exp for s in stacked) or len(stacked) not in (2, 3):
        shapes = ", ".join(str(tuple(s.shape)) for s in stacked)
        raise PortError([f"layer {layer}: experts' weights our stacked gate / up / down do not take ({shapes})"])
    y = g.tensors[out].detach().double().reshape(-1, d)
    shared = _shared(g, shared_projs, layer)
    s_val = torch.zeros_like(y)
    if shared is not None:
        dn = shared[2]  # recomputed from its input: an in-place add (Llama 4's out.add_) mutates the recorded output
        b_dn = dn.bias()
        if dn.kind == "linear":
            s_val = torch.nn.functional.linear(
                g.tensors[dn.input].detach().double(), dn.weight().detach().double(),
                None if b_dn is None else b_dn.detach().double(),
            ).reshape(-1, d)  # fmt: skip
        else:
            s_val = g.tensors[dn.output].detach().double().reshape(-1, d)
        if shared_gate:
            s_val = torch.sigmoid(g.tensors[shared_gate[0].output].detach().double().reshape(-1, 1)) * s_val
    bias_d = None if sel_bias is None else sel_bias.detach().double().reshape(-1)
    routes = [r for r in _routes(logits, bias_d, n_exp, k, groups, d) if _same_choice(r[1], chosen)]
    if not routes:
        raise PortError([f"layer {layer}: a router whose choice of experts is none of ours (softmax / sigmoid top-k)"])
    for experts, act, gated in _experts(stacked, d):
        o = _run(experts, act, x)  # (E, N, D)
        for base, idx, w in routes:
            r = (w[..., None] * o[idx, torch.arange(x.shape[0])[:, None]]).sum(1)
            scale = float((r * (y - s_val)).sum() / (r * r).sum().clamp_min(1e-300))
            scale = 1.0 if abs(scale - 1) < 1e-6 else float(f"{scale:.6g}")
            if scale > 0 and _close(scale * r + s_val, y):
                return _reading(g, replace(base, routed_scale=scale), act, gated, router, experts, sel_bias,
                                shared, shared_gate)  # fmt: skip
    if _scales_input(g, own, t, x_node):  # the weights on the experts' input: sum_j expert_j(w_j * x)
        for experts, act, gated in _experts(stacked, d):
            for base, idx, w in routes:
                rows = torch.arange(x.shape[0])
                parts = [_run(experts, act, x * w[:, j : j + 1])[idx[:, j], rows] for j in range(k)]
                if _close(torch.stack(parts).sum(0) + s_val, y):
                    return _reading(g, replace(base, weight_input=True), act, gated, router, experts, sel_bias,
                                    shared, shared_gate)  # fmt: skip
        raise PortError([f"layer {layer}: router weights that scale the experts' input, with experts or a "
                         "combination none of ours computes"])  # fmt: skip
    raise PortError(
        [f"layer {layer}: experts or a combination of their outputs that none of ours computes (the output differs)"]
    )


def _reading(
    g: Graph, base: MoEConfig, act: Activation, gated: bool, router: Tensor, experts: dict[str, Stacked],
    sel_bias: Tensor | None, shared: tuple[Proj | None, Proj, Proj] | None, shared_gate: list[Proj],
) -> MoeReading:  # fmt: skip
    """The reading once the experts and the way their weights enter are found: the widths read off the tensors."""
    cfg = replace(
        base, d_expert=int(experts["up"].value().shape[1]),
        shared_width=0 if shared is None else int(g.tensors[shared[2].input].shape[-1]), shared_gate=bool(shared_gate),
    )  # fmt: skip
    return MoeReading(cfg, act, gated, router, experts, sel_bias, shared, shared_gate[0] if shared_gate else None)


def _scales_input(g: Graph, own: int, t: Node, x: int) -> bool:
    """Whether a product of a routing weight (fed by the top-k) and the branch input itself (no projection between)
    happens among the branch's own nodes: the weights applied before the experts."""
    mats = [n.idx for n in g.nodes if own >> n.idx & 1 and n.op in ("linear", "matmul", "bmm", "grouped_mm", "mm")]
    for n in g.nodes:
        if not (own >> n.idx & 1 and n.op == "mul" and len(n.inputs) == 2):
            continue
        for w, v in (n.inputs, n.inputs[::-1]):
            direct = v == x or (g.feeds(x, v) and not any(g.feeds(x, m) and g.feeds(m, v) for m in mats))
            if g.feeds(t.idx, w) and not g.feeds(t.idx, v) and direct:
                return True
    return False


def _shared(g: Graph, projs: list[Proj], layer: int) -> tuple[Proj | None, Proj, Proj] | None:
    """The shared expert's (gate, up, down), from the projections beside the router and the experts."""
    if not projs:
        return None
    from .measure import mlp_design

    firsts = [p for p in projs if not any(q is not p and g.feeds(q.output, p.input) for q in projs)]
    downs = [p for p in projs if p not in firsts]
    if len(downs) != 1 or not 1 <= len(firsts) <= 2:
        raise PortError([f"layer {layer}: {len(projs)} projections beside the experts that are not one shared MLP"])
    if any(p.bias() is not None for p in projs):
        raise PortError([f"layer {layer}: a shared expert with biases"])
    m = mlp_design(g, MlpParts(firsts, downs[0]), layer)
    return m.gate, m.up, m.down


def _k(n: Node) -> int:
    return int(n.kwargs.get("k", n.args[1] if len(n.args) > 1 else 0))


def _stages(g: Graph, topks: list[Node], layer: int) -> tuple[Node, tuple[int, int]]:
    """The top-k that chooses the experts and the (n_groups, topk_groups) of a group-limited router before it: the
    top-2 within each of G groups (a ``(.., G, E / G)`` input), then the best groups (our ``MoEConfig`` groups)."""
    if len(topks) == 1:
        return topks[0], (1, 1)
    if len(topks) == 3 and all(g.feeds(a.idx, topks[-1].idx) for a in topks[:2]):
        within, best, last = topks
        shape = tuple(g.tensors[within.inputs[0]].shape)
        if _k(within) == 2 and len(shape) >= 2 and g.feeds(within.idx, best.idx):
            return last, (int(shape[-2]), _k(best))
    raise PortError(
        [f"layer {layer}: a router with {len(topks)} top-k steps that are not DeepSeek-V3's groups (top-2 sums)"]
    )


def _routes(logits: Tensor, bias: Tensor | None, e: int, k: int, groups: tuple[int, int], d: int) -> Iterator[_Route]:
    """Every routing our MoE computes (its config with ``d_expert=d`` a placeholder, chosen experts, weights)."""
    for score, after, renorm in (
        (RouterScore.SOFTMAX, False, False), (RouterScore.SOFTMAX, False, True), (RouterScore.SOFTMAX, True, False),
        (RouterScore.SIGMOID, False, False), (RouterScore.SIGMOID, False, True),
    ):  # fmt: skip
        cfg = MoEConfig(
            e, k, d, score=score, score_after_topk=after, renormalize=renorm, selection_bias=bias is not None,
            n_groups=groups[0], topk_groups=groups[1] if groups[0] > 1 else 1,
        )  # fmt: skip
        idx, w = route(logits, cfg, bias)
        yield cfg, idx, w


def _same_choice(idx: Tensor, chosen: Tensor) -> bool:
    return idx.shape == chosen.shape and torch.equal(idx.sort(-1).values, chosen.to(idx.dtype).sort(-1).values)


def _oriented(p: Tensor, d: int, reads: bool) -> list[bool]:
    """The transposes of ``p`` ``(E, a, b)`` that make it ``(E, out, in)`` with ``in == d`` (``reads``: a first layer)
    or ``out == d`` (the down projection)."""
    dim = 2 if reads else 1
    return [tr for tr in (False, True) if (p.transpose(-2, -1) if tr else p).shape[dim] == d]


def _experts(stacked: list[Tensor], d: int) -> Iterator[tuple[dict[str, Stacked], Activation, bool]]:
    """Candidate (gate, up, down) tensors of the experts, with each activation."""
    cands: list[dict[str, Stacked]] = []
    for order in itertools.permutations(stacked):
        *firsts, down = order
        for tr_d in _oriented(down, d, reads=False):
            f = int((down.transpose(-2, -1) if tr_d else down).shape[2])
            dn = Stacked(down, tr_d)
            if len(firsts) == 2:
                for tr_g, tr_u in itertools.product(_oriented(firsts[0], d, True), _oriented(firsts[1], d, True)):
                    gate, up = Stacked(firsts[0], tr_g), Stacked(firsts[1], tr_u)
                    if gate.value().shape[1] == up.value().shape[1] == f:
                        cands.append({"gate": gate, "up": up, "down": dn})
                continue
            for tr in _oriented(firsts[0], d, True):
                width = int((firsts[0].transpose(-2, -1) if tr else firsts[0]).shape[1])
                if width == f:
                    cands.append({"up": Stacked(firsts[0], tr), "down": dn})
                elif width == 2 * f:
                    halves = (tuple(range(f)), tuple(range(f, 2 * f)))
                    pairs = (tuple(range(0, 2 * f, 2)), tuple(range(1, 2 * f, 2)))
                    for a, b in (halves, halves[::-1], pairs, pairs[::-1]):
                        cands.append({"gate": Stacked(firsts[0], tr, a), "up": Stacked(firsts[0], tr, b), "down": dn})
    for c in cands:
        for act in (a for a in Activation if not a.learned):  # a learned activation is not an expert's
            yield c, act, "gate" in c


def _run(experts: dict[str, Stacked], act: Activation, x: Tensor) -> Tensor:
    """Every expert on every token: ``(E, N, D)``."""
    up = torch.einsum("efd,nd->enf", experts["up"].value(), x)
    h = act(torch.einsum("efd,nd->enf", experts["gate"].value(), x)) * up if "gate" in experts else act(up)
    return torch.einsum("edf,enf->end", experts["down"].value(), h)
