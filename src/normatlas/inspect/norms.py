"""Find normalization sites in a recorded graph by their arithmetic, never by names.

Method. A site is recognised either as a fused call (``layer_norm``, ``rms_norm``,
``group_norm``; ``normalize`` only with ``p=2`` over the last axis) or as the four-line
pattern every norm shares (essay §02): a reduction over the last axis of ``x`` or of ``x - mean(x)``
(``mean(x**2)``, ``var``, ``sum(x**2)``, ``norm``), a chain of scalar-shaped
ops on that statistic (``+ eps``, ``sqrt``/``rsqrt``/``pow(-0.5)``, ``clamp``),
and one full-shape ``mul``/``div`` that applies it to ``x``. From the pattern:

* operator: centred + RMS statistic = LayerNorm, uncentred = RMSNorm, sum of
  squares / ``norm`` = L2 normalization;
* eps and its placement: the constant added before the root (inside), after it
  (outside), or a clamp;
* the affine map, read forwards from the normalized tensor: a multiply by a
  parameter (gain ``w``) or by ``param + 1`` (gain ``1+w``), an added parameter
  (bias), casts before or after the gain (cast order), scalar multiplies
  (output scaling, e.g. LayerNorm Scaling's 1/sqrt(layer)). The walk never enters the cast another
  site's statistic reads: a cast to the dtype a tensor already has returns that tensor, so the next norm's
  ``x.to(float32)`` can be the previous norm's only reader in a float32 run (Pixtral's ``ln_pre`` right before
  its first pre-norm); that cast is the next norm's input, not the previous norm's output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..analysis.graph import Graph, Node, Ref
from ..analysis.ops import CASTS, SHAPE_ONLY
from ..analysis.walk import scalar_of, strip
from ..spec import CastOrder, EpsPlacement, GainConvention
from ..vocabulary import Operator

__all__ = ["Site", "find_sites"]

_VIEW = SHAPE_ONLY  # value-preserving up to a view: how parameters reach the affine map
_REDUCE = frozenset({"mean", "sum", "var", "std", "var_mean", "std_mean", "norm", "vector_norm"})
_SCALAR_CHAIN = frozenset(
    {
        "add",
        "sqrt",
        "rsqrt",
        "pow",
        "reciprocal",
        "div",
        "rdiv",
        "mul",
        "clamp",
        "clamp_min",
        "max",
        "maximum",
        "item_of",
    }
    | CASTS
)
_ROOTS = frozenset({"sqrt", "rsqrt", "reciprocal"})


@dataclass
class Site:
    """One normalization found in the graph."""

    node: int  # the node producing the normalized tensor (before the affine map)
    input: int  # the normalized tensor's source, casts stripped
    output: int  # the last node of the affine map
    operator: Operator
    size: int
    eps: float | None
    eps_placement: EpsPlacement | None
    gain: bool
    gain_convention: GainConvention | None
    bias: bool
    cast_order: CastOrder | None
    output_scale: float = 1.0
    gain_shape: tuple[int, ...] | None = None  # the stored gain's shape: (D,), or (heads, head_dim) per head
    read: int = -1  # the value the statistic reads, casts not stripped (``input`` is it with casts stripped)
    fused: bool = False
    module: str = ""
    probe: dict[str, object] = field(default_factory=dict)


def _tensor_args(n: Node) -> list[int]:
    return [a.idx for a in n.args if isinstance(a, Ref)]


def _reduces_last(n: Node, g: Graph) -> bool:
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
    if n.op in ("norm", "vector_norm"):
        dim = n.kwargs.get("dim", n.args[2] if len(n.args) > 2 else None)
    src = g.nodes[n.inputs[0]] if n.inputs else None
    if src is None or src.shape is None or not src.shape:
        return False
    nd = len(src.shape)
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return len(dims) == 1 and isinstance(dims[0], int) and dims[0] % nd == nd - 1 and src.shape[-1] > 1


def _is_square(g: Graph, n: Node) -> int | None:
    """If ``n`` is x**2 / x*x / square(x), the index of x."""
    if n.op == "pow" and len(n.args) > 1 and n.args[1] == 2:
        return n.inputs[0]
    if n.op == "square" and n.inputs:
        return n.inputs[0]
    if n.op == "mul" and len(n.inputs) == 2 and n.inputs[0] == n.inputs[1]:
        return n.inputs[0]
    return None


def _centred(g: Graph, z: int) -> int | None:
    """If ``z`` is ``x - mean(x, -1)``, the index of x."""
    n = g.nodes[strip(g, z)]
    if n.op != "sub" or len(n.inputs) != 2:
        return None
    x, m = (strip(g, i) for i in n.inputs)
    mn = g.nodes[m]
    if mn.op == "mean" and mn.inputs and strip(g, mn.inputs[0]) == x and _reduces_last(mn, g):
        return x
    return None


def _affine(g: Graph, site: Site, start: int, stop: frozenset[int] = frozenset()) -> None:
    """Read the affine map forwards from the normalized tensor ``start``, never into a node of ``stop``; fill the
    site's fields."""
    cur, casts_before_gain, casts_after_gain = start, 0, 0
    while True:
        users = g.users(cur)
        if len(users) != 1 or users[0].idx in stop:
            break
        u = users[0]
        others = [i for i in u.inputs if i != cur]
        if u.op in CASTS and u.inputs and u.inputs[0] == cur:
            if site.gain:
                casts_after_gain += 1
            else:
                casts_before_gain += 1
        elif u.op == "mul" and len(others) == 1 and not site.gain and not site.bias:
            o = g.nodes[strip(g, others[0], _VIEW)]
            conv = _gain_param(g, o)
            if conv is not None:
                site.gain_shape = _gain_shape(g, o)
            if conv is None:
                val = scalar_of(g, Ref(others[0]))
                if val is None:
                    break
                site.output_scale *= val
            else:
                site.gain, site.gain_convention = True, conv
        elif u.op == "mul" and not others and len(u.args) > 1 and scalar_of(g, u.args[1]) is not None:
            site.output_scale *= scalar_of(g, u.args[1]) or 1.0
        elif u.op == "add" and len(others) == 1 and g.nodes[strip(g, others[0], _VIEW)].op == "param" and not site.bias:
            site.bias = True
        else:
            break
        cur = u.idx
    site.output = cur
    if site.gain and (casts_before_gain or casts_after_gain):
        site.cast_order = CastOrder.AFTER_GAIN if casts_after_gain else CastOrder.BEFORE_GAIN


def _gain_shape(g: Graph, o: Node) -> tuple[int, ...] | None:
    """The stored shape of the gain parameter behind ``o`` (a parameter, or ``param + 1``)."""
    if o.op == "param":
        return o.shape
    return next((p.shape for i in o.inputs if (p := g.nodes[strip(g, i, _VIEW)]).op == "param"), None)


def _gain_param(g: Graph, o: Node) -> GainConvention | None:
    """``w`` for a parameter, ``1+w`` for ``param + 1`` (either order); None otherwise."""
    if o.op == "param" and o.shape and max(o.shape) > 1:
        return GainConvention.W
    if o.op == "add":
        ts = [strip(g, i, _VIEW) for i in o.inputs]
        consts = [a for a in o.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        consts += [v for i in o.inputs if (v := g.nodes[strip(g, i)].scalar) is not None]
        params = [i for i in ts if g.nodes[i].op == "param"]
        if params and consts and abs(consts[0] - 1.0) < 1e-12:
            return GainConvention.ONE_PLUS_W
    return None


def _fused(g: Graph, n: Node, stop: frozenset[int] = frozenset()) -> Site | None:
    a = n.args

    def arg(i: int, name: str) -> object:
        return n.kwargs.get(name, a[i] if len(a) > i else None)

    if n.op not in ("layer_norm", "rms_norm", "group_norm", "normalize") or not n.inputs or n.shape is None:
        return None
    x = strip(g, n.inputs[0])
    w_node: Node | None = None
    if n.op == "normalize":
        p, dim, nd = arg(1, "p"), arg(2, "dim"), len(n.shape)
        p, dim = 2.0 if p is None else p, 1 if dim is None else dim  # F.normalize's defaults: p=2, dim=1
        if isinstance(p, bool) or not isinstance(p, (int, float)) or p != 2:
            return None  # not an L2 norm (an Lp normalization): not one of the operators reported
        if isinstance(dim, bool) or not isinstance(dim, int) or nd == 0 or not -nd <= dim < nd or dim % nd != nd - 1:
            return None  # not over the last axis: as for an unfused reduction over another axis
        site = Site(
            n.idx,
            x,
            n.idx,
            Operator.L2,
            n.shape[dim],
            float(arg(3, "eps") or 1e-12),  # type: ignore[arg-type]
            EpsPlacement.CLAMP,
            False,
            None,
            False,
            None,
            fused=True,
        )
    else:
        op = {"layer_norm": Operator.LAYERNORM, "rms_norm": Operator.RMSNORM, "group_norm": Operator.GROUPNORM}[n.op]
        w_i, b_i, e_i = (2, 3, 4) if n.op == "layer_norm" else (2, None, 3) if n.op == "rms_norm" else (2, 3, 4)
        if n.op == "group_norm":
            w_i, b_i, e_i = 2, 3, 4
        w, b = arg(w_i, "weight"), (arg(b_i, "bias") if b_i is not None else None)
        eps = arg(e_i, "eps")
        if eps is None:
            eps = 1e-5 if n.op != "rms_norm" else None  # rms_norm's default: finfo(dtype).eps
        w_node = g.nodes[strip(g, w.idx, _VIEW)] if isinstance(w, Ref) else None
        conv = _gain_param(g, w_node) if w_node is not None else None
        if isinstance(w, Ref) and conv is None:
            conv = GainConvention.W
        site = Site(
            n.idx,
            x,
            n.idx,
            op,
            n.shape[-1] if n.op != "group_norm" else n.shape[1],
            float(eps) if isinstance(eps, (int, float)) else None,
            EpsPlacement.INSIDE_SQRT,  # type: ignore[arg-type]
            isinstance(w, Ref),
            conv,
            isinstance(b, Ref),
            None,
            fused=True,
        )
    site.module, site.read = n.module, n.inputs[0]
    if n.op != "normalize" and w_node is not None:
        site.gain_shape = _gain_shape(g, w_node)
    gain_before = site.gain
    _affine(g, site, n.idx, stop)  # an affine map applied after a parameter-free fused kernel
    if gain_before:
        site.cast_order = None  # gain applied inside the fused kernel
    if site.operator is Operator.LAYERNORM and not site.gain and not site.bias:
        site.operator = Operator.LAYERNORM_NONPARAM
    return site


def _pattern(g: Graph, s: Node, stop: frozenset[int] = frozenset()) -> Site | None:
    """A reduction node ``s`` that starts the unfused pattern, completed to a Site."""
    if s.op not in _REDUCE or not s.inputs or not _reduces_last(s, g):
        return None
    q = g.nodes[strip(g, s.inputs[0])]
    if s.op in ("var", "std", "var_mean", "std_mean"):
        z, centred, l2 = q.idx, True, False
    elif s.op in ("norm", "vector_norm"):
        z, centred, l2 = q.idx, False, True
    else:
        sq = _is_square(g, q)
        if sq is None:
            return None
        z, centred, l2 = sq, False, s.op == "sum"
    x = _centred(g, z)
    if x is not None:
        centred = True
    else:
        x = strip(g, z)
    # scalar chain forwards to the full-shape combine
    full = g.nodes[x].shape
    frontier, seen, chain = [s.idx], set(), []
    combine, read = None, -1
    while frontier and combine is None:
        cur = frontier.pop(0)
        for u in g.users(cur):
            if u.idx in seen:
                continue
            seen.add(u.idx)
            if u.shape == full and u.op in ("mul", "div"):
                raw = [i for i in u.inputs if i != cur]
                other = [strip(g, i) for i in raw]
                if other and (other[0] == x or other[0] == strip(g, z) or _centred(g, other[0]) == x):
                    combine, read = u, raw[0]
                    break
            elif u.op in _SCALAR_CHAIN and u.shape is not None and (not u.shape or u.shape[-1] == 1):
                chain.append(u)
                frontier.append(u.idx)
    if combine is None or full is None:
        return None
    eps, placement, rooted = None, None, s.op in ("std", "norm", "vector_norm", "std_mean")
    for c in sorted(chain, key=lambda n: n.idx):
        if c.op in _ROOTS or (c.op == "pow" and len(c.args) > 1 and c.args[1] in (0.5, -0.5)):
            rooted = True
        consts = [v for a in c.args[1:] if (v := scalar_of(g, a)) is not None] + [
            v for k, a in c.kwargs.items() if k in ("min", "other", "alpha") and (v := scalar_of(g, a)) is not None
        ]
        if c.op == "add" and consts and eps is None:
            eps, placement = consts[0], EpsPlacement.OUTSIDE_SQRT if rooted else EpsPlacement.INSIDE_SQRT
        elif c.op in ("clamp", "clamp_min", "max", "maximum") and consts and eps is None:
            eps, placement = consts[0], EpsPlacement.CLAMP
    op = {
        (True, True): Operator.OTHER,
        (True, False): Operator.L2,
        (False, True): Operator.LAYERNORM,
        (False, False): Operator.RMSNORM,
    }[(l2, centred)]
    site = Site(
        combine.idx, x, combine.idx, op, full[-1], eps, placement, False, None, False, None, module=combine.module
    )
    if _centred(g, read) is not None:  # LayerNorm's combine reads x - mean(x): the value read is the sub's x
        read = g.nodes[strip(g, read)].inputs[0]
    site.read = read
    _affine(g, site, combine.idx, stop)
    if op is Operator.LAYERNORM and not site.gain and not site.bias:
        site.operator = Operator.LAYERNORM_NONPARAM
    return site


def find_sites(g: Graph) -> list[Site]:
    """Every normalization site in ``g``, in execution order (one per normalized tensor)."""
    found: dict[int, tuple[Node, Site]] = {}
    for n in g.nodes:
        site = _fused(g, n) or _pattern(g, n)
        if site is not None and site.node not in found:
            found[site.node] = (n, site)
    casts = frozenset(s.read for _, s in found.values() if g.nodes[s.read].op in CASTS)  # a site's input cast
    sites = []
    for n, site in found.values():
        if site.output != site.node and site.output in casts:  # its walk ran into the next norm's input cast
            site = _fused(g, n, casts) or _pattern(g, n, casts) or site
        sites.append(site)
    return sorted(sites, key=lambda s: s.node)
