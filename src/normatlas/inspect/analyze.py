"""Read a model's normalization design off its recorded dataflow graph.

Method (all structural, no names):

* **Residual adds** are ``add`` nodes on the residual-stream shape where one
  operand's additive components (through casts, scalar multiplies and earlier
  adds) contain a value ``s`` that also feeds the other operand: ``s`` is the
  stream, the other operand the branch. Consecutive adds that share ``s`` (or
  one branch that is itself a sum of two branches of ``s``) are *parallel*. A
  branch that is only linear maps of ``s`` (no activation, no attention; its
  norms aside) is an augmented residual beside a sublayer (Gemma 3n's LAuReL
  low-rank path), not a sublayer, and its add is no residual add.
* **Placement** of each sublayer: a norm whose input is ``s`` and whose output
  feeds the branch is *pre*; a norm that ends the branch is *out*; a norm whose
  input is the add and whose output is the next sublayer's stream is *post*.
  (pre)=pre, (pre,out)=peri, (out)=res-post, (post)=post, ()=none.
* **Attention** cores are ``scaled_dot_product_attention`` or a ``softmax``
  fed by a matmul of two activations; norms found walking back from its q / k /
  v operands (stopping at projections) are QK / V norms, per-head when they
  normalize d_head, flattened otherwise; a RoPE add (``q*cos + rot(q)*sin``)
  between the norm and the core means the norm runs before RoPE; a ``tanh``
  between scores and softmax is logit soft-capping.
* The **final norm** is the norm on the last stream value (after the last sublayer's post-norm, when
  two norms follow each other there or the sublayer repeats a post-norm scheme); **embedding** norm or
  scaling is read walking back from the first stream value.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .norms import CASTS, SHAPES, Site, find_sites, scalar_of, strip
from .report import (
    AttentionInfo,
    InspectionReport,
    NormInfo,
    Operator,
    Placement,
    QKNorm,
    RopeOrder,
    SublayerInfo,
)
from .trace import Graph, Node, Ref

__all__ = ["analyze"]

_PROJ = frozenset({"linear", "addmm", "mm", "conv1d", "conv2d", "embedding", "einsum", "baddbmm", "bmm"})
_THRU = CASTS | SHAPES
_SCHEME = {
    (True, False, False): Placement.PRE,
    (True, True, False): Placement.PERI,
    (False, True, False): Placement.RES_POST,
    (False, False, True): Placement.POST,
    (False, False, False): Placement.NONE,
    (True, False, True): Placement.PRE_POST,
}


@dataclass
class _Group:
    source: int
    adds: list[int]
    branches: list[int]
    skip_scale: float = 1.0
    branch_scales: list[str] = field(default_factory=list)
    pre: list[Site] = field(default_factory=list)
    out: list[Site] = field(default_factory=list)
    post: list[Site] = field(default_factory=list)
    kind: str = "mlp"
    layer: int = 0
    parallel_same: bool = False
    whole: int | None = None  # the branch operand before splitting a sum of branches
    skip_learned: str | None = None  # a learned multiplier on the residual itself


def _scalar_mul(g: Graph, n: Node) -> tuple[int, float] | None:
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


def _components(g: Graph, idx: int, limit: int = 48) -> list[int]:
    out: list[int] = []
    queue = [idx]
    while queue and len(out) < limit:
        i = queue.pop(0)
        out.append(i)
        n = g.nodes[i]
        if n.op in _THRU and n.inputs:
            queue.append(strip(g, i, _THRU))
        elif n.op == "add" and len(n.inputs) == 2:
            queue.extend(n.inputs)
        elif (sm := _scalar_mul(g, n)) is not None:
            queue.append(sm[0])
        elif (lp := _learned_mul(g, n)) is not None:
            queue.append(lp[0])
    return out


def _learned_mul(g: Graph, n: Node) -> tuple[int, str] | None:
    """``x * p`` with p a parameter: (x, "learned scalar" | "per-channel")."""
    if n.op != "mul" or len(n.inputs) != 2:
        return None
    params = [i for i in n.inputs if g.nodes[strip(g, i, _THRU)].op == "param"]
    if len(params) != 1:
        return None
    p = g.nodes[strip(g, params[0], _THRU)]
    kind = "learned scalar" if p.shape is not None and math.prod(p.shape) == 1 else "per-channel"
    return next(i for i in n.inputs if i != params[0]), kind


def _has_compute(g: Graph, branch: int, source: int) -> bool:
    own = g.anc(branch) & ~g.anc(source)
    return any(own >> n.idx & 1 for n in g.nodes if n.op in _PROJ or n.op == "matmul")


def _norm_bits(g: Graph, sites: list[Site]) -> int:
    """Every node inside a norm (from its input, exclusive, to the end of its affine map) as a bitset."""
    bits = 0
    for s in sites:
        bits |= (g.anc(s.output) | 1 << s.output) & ~(g.anc(s.input) | 1 << s.input)
    return bits


def _linear_only(g: Graph, branch: int, source: int, norms: int) -> bool:
    """True when the branch's own compute, its norms aside, is linear maps of the source: projections (a matmul
    by a parameter), adds, casts, views and constant or learned scalings; no activation, gate or attention."""
    own = (g.anc(branch) | 1 << branch) & ~(g.anc(source) | 1 << source) & ~norms
    for n in g.nodes[: branch + 1]:
        if not own >> n.idx & 1 or n.op in _THRU or n.op in ("param", "buffer", "leaf", "add", "sub"):
            continue
        by_param = any(g.nodes[strip(g, i, _THRU)].op == "param" for i in n.inputs)
        if (n.op in _PROJ or n.op == "matmul") and by_param:
            continue
        if _scalar_mul(g, n) is None and _learned_mul(g, n) is None:
            return False
    return True


def _alias_root(g: Graph, idx: int) -> int:
    """The first node of the same value: a cast that returned its own input tensor (``x.to(x.dtype)``) re-binds
    the stream to a new node, so uses after it and uses before it would look like different values."""
    while (n := g.nodes[idx]).op in CASTS and n.prev is not None and n.prev in n.inputs:
        idx = n.prev
    return idx


def _residual_adds(g: Graph, shape: tuple[int, ...], norms: int = 0) -> list[tuple[int, int, int, int]]:
    """(add, skip operand, branch operand, stream source) for every residual add (``norms``: the nodes inside
    norms, as :func:`_norm_bits` gives them, set aside when telling a linear side path from a sublayer)."""

    def stream_like(s: tuple[int, ...] | None) -> bool:  # the stream, possibly flattened to (B*T, D)
        return s is not None and len(s) >= 2 and s[-1] == shape[-1] and math.prod(s) == math.prod(shape)

    found = []
    for n in g.nodes:
        if n.op != "add" or not stream_like(n.shape) or len(n.inputs) != 2 or n.inputs[0] == n.inputs[1]:
            continue
        for a, b in (n.inputs, n.inputs[::-1]):
            src = next((c for c in _components(g, a) if stream_like(g.nodes[c].shape) and g.feeds(c, b)), None)
            if src is not None:
                src = _alias_root(g, src)
            if src is not None and _has_compute(g, b, src):
                if not _linear_only(g, b, src, norms):
                    found.append((n.idx, a, b, src))
                break
    return found


def _walk_branch(g: Graph, b: int, ends: dict[int, Site]) -> tuple[int, list[str]]:
    scales: list[str] = []
    while True:
        n = g.nodes[b]
        if b in ends:
            return b, scales
        if n.op in CASTS | {"dropout", "identity"} and n.inputs:
            b = strip(g, b, CASTS | {"dropout", "identity"})
            continue
        sm = _scalar_mul(g, n)
        if sm is not None:
            if sm[1] != 1.0:
                scales.append(f"{sm[1]:.6g}")
            b = sm[0]
            continue
        lm = _learned_mul(g, n)
        if lm is not None:
            scales.append(lm[1])
            b = lm[0]
            continue
        return b, scales


def _layer_of(g: Graph, idx: int, keys: dict[str, int]) -> int | None:
    for path in g.nodes[idx].scope:
        if path in g.list_children:
            return keys.setdefault(path, len(keys))
    return None


def _stream_shapes(g: Graph, sites: list[Site]) -> list[tuple[int, ...]]:
    """Candidate residual-stream shapes: embedding outputs, float inputs, then normalized inputs by frequency."""
    cands = [n.shape for n in g.nodes if n.op == "embedding" and n.shape is not None]
    cands += [
        n.shape for n in g.nodes if n.op == "input" and n.dtype is not None and n.dtype.is_floating_point and n.shape
    ]
    counts = Counter(g.nodes[s.input].shape for s in sites if g.nodes[s.input].shape)
    cands += [sh for sh, _ in counts.most_common() if sh is not None and len(sh) >= 2]
    return list(dict.fromkeys(c for c in cands if c))


def _is_rope_add(g: Graph, n: Node, trig: int) -> bool:
    if n.op == "view_as_real":
        return True
    if n.op not in ("add", "sub") or len(n.inputs) != 2:
        return False
    return all(g.nodes[i].op == "mul" for i in n.inputs) and bool(g.anc(n.idx) & trig)


def _attention(
    g: Graph, sites: list[Site], stream_bit: int, trig: int, stream_inputs: set[int]
) -> list[tuple[int, dict[str, Any]]]:
    by_output = {s.output: s for s in sites}
    cores: list[tuple[int, int, int, int, float | None]] = []  # node, q, k, v, softcap
    for n in g.nodes:
        if n.op == "scaled_dot_product_attention" and len(n.inputs) >= 3:
            q, k, v = (a.idx for a in n.args[:3])  # type: ignore[union-attr]
            cap = n.kwargs.get("softcap") if isinstance(n.kwargs.get("softcap"), float) else None
            cores.append((n.idx, q, k, v, cap))
        elif n.op == "softmax" and n.inputs:
            cur, cap = n.inputs[0], None
            for _ in range(12):
                c = g.nodes[cur]
                if (c.op in ("matmul", "bmm", "einsum") and len(c.inputs) == 2) or c.op in _PROJ:
                    break
                if c.op == "tanh":
                    pre = g.nodes[c.inputs[0]]
                    sm = _scalar_mul(g, pre)
                    cap = 1.0 / sm[1] if sm else cap
                tensor_inputs = [i for i in c.inputs if g.anc(i) & stream_bit or g.nodes[i].op == "input"]
                if not tensor_inputs:
                    break
                cur = max(tensor_inputs, key=lambda i: g.nodes[i].shape or ())
            c = g.nodes[cur]
            if c.op not in ("matmul", "bmm") or len(c.inputs) != 2:
                continue
            if any(g.nodes[strip(g, i, _THRU)].op in ("param", "buffer") for i in c.inputs):
                continue  # a router or a projection, not q @ k^T
            v = None
            frontier = [n.idx]
            while frontier and v is None:
                here = frontier.pop()
                for u in g.users(here):
                    if u.op in ("matmul", "bmm") and len(u.inputs) == 2 and u.inputs[0] == here:
                        v = u.inputs[1]
                        break
                    if u.op in _THRU:
                        frontier.append(u.idx)
            cores.append((n.idx, c.inputs[0], c.inputs[1], v if v is not None else -1, cap))
    result = []
    for core, q, k, v, cap in cores:
        qshape = g.nodes[q].shape
        info: dict[str, Any] = {"softcap": cap, "head_dim": qshape[-1] if qshape else None}
        for role, start in (("q", q), ("k", k), ("v", v)):
            found: list[tuple[Site, bool]] = []
            stack, seen = [(start, False)], set()
            while stack and start >= 0:
                i, rope = stack.pop()
                if (i, rope) in seen:
                    continue
                seen.add((i, rope))
                node = g.nodes[i]
                if i in by_output:
                    if strip(g, by_output[i].input, _THRU) not in stream_inputs:  # a pre-norm is not a QK/V norm
                        found.append((by_output[i], rope))
                    continue
                if node.op in _PROJ or node.op in ("param", "input", "leaf") or not g.anc(i) & stream_bit:
                    continue
                if node.op == "matmul" and any(g.nodes[strip(g, j, _THRU)].op == "param" for j in node.inputs):
                    continue
                here = rope or _is_rope_add(g, node, trig)
                stack.extend((j, here) for j in node.inputs)
            info[role] = found
        result.append((core, info))
    return result


def analyze(g: Graph, name: str = "model", tracer: str = "torch_function") -> InspectionReport:
    """Derive the :class:`InspectionReport` of a recorded graph."""
    sites = find_sites(g)
    notes: list[str] = []
    shapes = _stream_shapes(g, sites)
    if not shapes:
        raise ValueError("cannot find the residual stream: the model has no embedding and no floating input")
    norm_bits = _norm_bits(g, sites)
    found = [(_residual_adds(g, c, norm_bits), c) for c in shapes[:6]]
    adds, shape = max(found, key=lambda f: len(f[0]))
    if not adds:
        shape = shapes[0]
    groups: list[_Group] = []
    for add, skip, branch, src in adds:
        last = groups[-1] if groups else None
        if last is not None and src == last.source and last.adds[-1] in _components(g, skip):
            last.adds.append(add)
            last.branches.append(branch)
            continue
        grp = _Group(src, [add], [branch])
        cur = skip
        while cur != src:
            n = g.nodes[cur]
            sm = _scalar_mul(g, n)
            lm = _learned_mul(g, n)
            if sm is not None:
                grp.skip_scale *= sm[1]
                cur = sm[0]
            elif lm is not None:
                grp.skip_learned = lm[1]
                cur = lm[0]
            elif n.op in _THRU and n.inputs:
                cur = strip(g, cur, _THRU)
            else:
                break
        bnode = g.nodes[strip(g, branch, _THRU)]
        if bnode.op == "add":  # one branch that is a sum of branches of s (GPT-J style parallel)
            parts = [i for i in bnode.inputs if g.feeds(src, i) and _has_compute(g, i, src)]
            if len(parts) == 2:
                grp.whole, grp.branches = grp.branches[0], parts
        groups.append(grp)
    trig = 0
    for n in g.nodes:
        if n.op in ("cos", "sin", "polar", "view_as_complex"):
            trig |= 1 << n.idx
    start_bit = 1 << groups[0].source if groups else 0
    stream_inputs = {strip(g, grp.source, _THRU) for grp in groups} | {strip(g, grp.adds[-1], _THRU) for grp in groups}
    cores = _attention(g, sites, start_bit, trig, stream_inputs) if groups else []
    attn_bits = 0
    for core, _ in cores:
        attn_bits |= 1 << core
    by_input: dict[int, list[Site]] = {}
    for s in sites:
        by_input.setdefault(strip(g, s.input, _THRU), []).append(s)
    by_output = {s.output: s for s in sites}
    keys: dict[str, int] = {}
    for i, grp in enumerate(groups):
        end = grp.adds[-1]
        own = 0
        for b in grp.branches:
            own |= g.anc(b) & ~g.anc(grp.source)
            node, scales = _walk_branch(g, b, by_output)
            grp.branch_scales += scales
            if node in by_output:
                grp.out.append(by_output[node])
                if by_output[node].output_scale != 1.0:  # a constant after the branch's last norm scales the branch
                    grp.branch_scales.append(f"{by_output[node].output_scale:.6g}")
        grp.kind = "attention" if own & attn_bits else "mlp"
        if len(grp.branches) > 1:
            kinds = {bool((g.anc(b) & ~g.anc(grp.source)) & attn_bits) for b in grp.branches}
            if kinds == {True, False}:
                grp.kind = "attention+mlp"
            else:  # two branches of one kind (routed + shared experts): one sublayer, not parallel
                grp.parallel_same = True
                if grp.whole is not None:
                    grp.branches = [grp.whole]
        outs = {s.node for s in grp.out}
        grp.pre = [
            s
            for s in by_input.get(strip(g, grp.source, _THRU), [])
            if s.node not in outs and any(g.feeds(s.output, b) for b in grp.branches)
        ]
        nxt = groups[i + 1].source if i + 1 < len(groups) else None
        for s in by_input.get(strip(g, end, _THRU), []):
            if nxt is not None and strip(g, nxt, _THRU) == strip(g, s.output, _THRU):  # the norm may end in a cast
                grp.post.append(s)
        layer = _layer_of(g, end, keys)
        grp.layer = layer if layer is not None else -1
    if groups and any(grp.layer < 0 for grp in groups):
        layer, first_kind = -1, groups[0].kind
        for grp in groups:
            layer += grp.kind == first_kind
            grp.layer = layer
    # the last stream value: post-norm of the last sublayer, or final norm
    final: Site | None = None
    if groups:
        last = groups[-1]
        cands = [s for s in by_input.get(strip(g, last.adds[-1], _THRU), []) if s not in last.pre]
        same_kind = [grp for grp in groups[:-1] if grp.kind == last.kind]
        near = same_kind[-1] if same_kind else None
        # A norm on the last stream value is the last sublayer's post-norm when another norm follows it (the final
        # norm), or when the nearest sublayer of its kind has a post-norm and otherwise the same norms (Mix-LN
        # switches scheme with depth, so a Pre-LN last layer after a Post-LN one ends in a final norm).
        chained = bool(cands) and bool(by_input.get(strip(g, cands[0].output, _THRU)))
        same_scheme = near is not None and (bool(near.pre), bool(near.out)) == (bool(last.pre), bool(last.out))
        like_near = near is not None and bool(near.post) and same_scheme
        if cands and (chained or like_near):
            last.post.append(cands[0])
            end_idx = cands[0].output
            cands = list(by_input.get(strip(g, end_idx, _THRU), []))
        final = cands[0] if cands else None
    # embedding
    emb_scale, emb_norm, start_bit = None, None, 0
    if groups:
        cur = groups[0].source
        while True:
            n = g.nodes[cur]
            sm = _scalar_mul(g, n)
            if cur in by_output and emb_norm is None:
                emb_norm = by_output[cur]
                cur = emb_norm.input
            elif sm is not None:
                emb_scale = (emb_scale or 1.0) * sm[1]
                cur = sm[0]
            elif n.op in _THRU | {"dropout"} and n.inputs:
                cur = strip(g, cur, _THRU | {"dropout"})
            else:
                break
        start_bit = 1 << groups[0].source
    # roles
    role: dict[int, str] = {}
    layer_of_site: dict[int, int | None] = {}
    for grp in groups:
        for r, ss in (("pre", grp.pre), ("out", grp.out), ("post", grp.post)):
            for s in ss:
                role[s.node], layer_of_site[s.node] = r, grp.layer
    if final is not None:
        role[final.node] = "final"
    if emb_norm is not None:
        role[emb_norm.node] = "embedding"
    # attention
    stream_bit = start_bit
    attention: list[AttentionInfo] = []
    for core, info in cores:
        lay = _layer_of(g, core, keys)
        hd = info["head_dim"]
        qk: list[tuple[Site, bool]] = [*info["q"], *info["k"]]
        for s, _ in qk:
            role[s.node], layer_of_site[s.node] = "qk", lay
        for s, _ in info["v"]:
            role[s.node], layer_of_site[s.node] = "v", lay
        if qk:
            qk_kinds = {QKNorm.PER_HEAD if s.size == hd else QKNorm.FLATTENED for s, _ in qk}
            qkn = qk_kinds.pop() if len(qk_kinds) == 1 else QKNorm.MIXED
            if any(r for _, r in qk):
                order = RopeOrder.BEFORE_ROPE
            elif any(g.anc(s.input) & trig and g.anc(s.input) & stream_bit for s, _ in qk):
                order = RopeOrder.AFTER_ROPE
            else:
                order = RopeOrder.NO_ROPE
        else:
            qkn, order = QKNorm.NONE, RopeOrder.NOT_APPLICABLE
        cap = info["softcap"]
        attention.append(
            AttentionInfo(
                lay if lay is not None else len(attention),
                qkn,
                order,
                bool(info["v"]),
                cap if isinstance(cap, float) else None,
            )
        )
    # final logit soft-cap: a tanh downstream of the final norm
    logit_cap = None
    if final is not None:
        for n in g.nodes[final.output :]:
            if n.op == "tanh" and g.feeds(final.output, n.idx) and n.inputs:
                sm = _scalar_mul(g, g.nodes[n.inputs[0]])
                logit_cap = 1.0 / sm[1] if sm else None
    # summaries
    main = [s for s in sites if role.get(s.node) in ("pre", "out", "post", "final")]
    norms = [
        NormInfo(
            s.node,
            role.get(s.node, "other"),
            layer_of_site.get(s.node),
            s.module,
            s.operator,
            s.size,
            s.eps,
            s.eps_placement.value if s.eps_placement else None,
            s.gain_convention.value if s.gain_convention else "none",
            s.bias,
            s.cast_order.value if s.cast_order else None,
            s.output_scale,
            s.fused,
            s.probe,
        )
        for s in sites
    ]
    subs = [
        SublayerInfo(
            grp.layer,
            grp.kind,
            Placement.PARALLEL
            if len(grp.branches) > 1 and not grp.parallel_same
            else _SCHEME.get((bool(grp.pre), bool(grp.out), bool(grp.post)), Placement.MIX),
            tuple(s.node for s in grp.pre),
            tuple(s.node for s in grp.out),
            tuple(s.node for s in grp.post),
            grp.skip_scale if grp.skip_scale != 1.0 else None,
            ", ".join(sorted(set(grp.branch_scales))) or None,
        )
        for grp in groups
    ]

    def one(values: list, default: object = None) -> object:  # type: ignore[type-arg]
        vals = [v for v in values if v is not None]
        if not vals:
            return default
        common = Counter(vals).most_common()
        if len(common) > 1:
            notes.append(f"mixed values {dict(common)}")
        return common[0][0]

    ops = {s.operator for s in main}
    operator = ops.pop() if len(ops) == 1 else Operator.MIXED if ops else Operator.NONE
    per_kind: dict[str, list[Placement]] = {}
    for sub in subs:
        per_kind.setdefault(sub.kind, []).append(sub.placement)

    def summarise(pl: list[Placement]) -> str:
        uniq = list(dict.fromkeys(p.value for p in pl))
        if len(uniq) == 1:
            return uniq[0]
        if len(pl) > 8:  # long stacks: counts, not the sequence
            return "mix(" + ", ".join(f"{k} x{v}" for k, v in Counter(p.value for p in pl).items()) + ")"
        return "mix(" + ",".join(p.value for p in pl) + ")"

    pa = summarise(per_kind.get("attention", [])) if "attention" in per_kind else "n/a"
    pm = summarise(per_kind.get("mlp", [])) if "mlp" in per_kind else "n/a"
    all_pl = {p for sub in subs for p in [sub.placement]}
    if not subs:
        placement = Placement.UNKNOWN
    elif len(all_pl) == 1:
        placement = all_pl.pop()
    else:
        placement = Placement.MIX
    by_layer: dict[int, list[str]] = {}
    for sub in subs:
        by_layer.setdefault(sub.layer, []).append(sub.placement.value)
    out_scales = [s.output_scale for grp in groups for s in grp.pre + grp.out]
    depth = None
    if len({round(x, 9) for x in out_scales}) > 1:
        lay_scale = {grp.layer: (grp.pre + grp.out)[0].output_scale for grp in groups if grp.pre + grp.out}
        if all(abs(v - 1 / math.sqrt(k + 1)) < 1e-6 for k, v in lay_scale.items()):
            depth = "1/sqrt(layer)"
        else:
            depth = "varies: " + ", ".join(f"{v:.4g}" for v in lay_scale.values())
    qks = {a.qk_norm for a in attention}
    ropes = {a.qk_norm_rope for a in attention if a.qk_norm is not QKNorm.NONE}
    caps = [a.softcap for a in attention if a.softcap]
    return InspectionReport(
        model=name,
        tracer=tracer,
        layers=len(by_layer),
        hidden_size=shape[-1],
        operator=operator,
        eps=one([s.eps for s in main]),  # type: ignore[arg-type]
        eps_placement=one([s.eps_placement.value if s.eps_placement else None for s in main]),  # type: ignore[arg-type]
        gain_convention=str(one([s.gain_convention.value if s.gain_convention else "none" for s in main], "none")),
        bias=any(s.bias for s in main),
        cast_order=one([s.cast_order.value if s.cast_order else None for s in main]),  # type: ignore[arg-type]
        placement=placement,
        placement_attention=pa,
        placement_mlp=pm,
        placement_by_layer=["/".join(v) for _, v in sorted(by_layer.items())],
        residual_scale=", ".join(
            sorted(
                {f"{sub.skip_scale:.6g}" for sub in subs if sub.skip_scale}
                | {f"{grp.skip_learned} (learned)" for grp in groups if grp.skip_learned}
            )
        )
        or None,
        branch_scale=", ".join(sorted({sub.branch_scale for sub in subs if sub.branch_scale})) or None,
        depth_scaling=depth,
        qk_norm=qks.pop() if len(qks) == 1 else QKNorm.MIXED if qks else QKNorm.NONE,
        qk_norm_rope=ropes.pop() if len(ropes) == 1 else RopeOrder.NOT_APPLICABLE,
        v_norm=any(a.v_norm for a in attention),
        attn_softcap=caps[0] if caps else None,
        final_norm=final.operator if final else Operator.NONE,
        final_logit_softcap=logit_cap,
        embedding_scale=emb_scale if emb_scale != 1.0 else None,
        embedding_norm=emb_norm.operator if emb_norm else Operator.NONE,
        norms=norms,
        sublayers=subs,
        attention=attention,
        notes=notes,
    )
