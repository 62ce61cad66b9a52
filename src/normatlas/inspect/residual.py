"""The residual phases of the inspector: the stream, its sublayers and the norms around them.

Method (all structural, no names):

* **Residual adds** are ``add`` nodes on the residual-stream shape where one operand's additive
  components (through casts, scalar multiplies and earlier adds) contain a value ``s`` that also
  feeds the other operand: ``s`` is the stream, the other operand the branch. Consecutive adds
  that share ``s`` (or one branch that is itself a sum of two branches of ``s``) are *parallel*.
  A branch that is only linear maps of ``s`` (no activation, no attention; its norms aside) is an
  augmented residual beside a sublayer (Gemma 3n's LAuReL low-rank path), not a sublayer.
* **Norms around a sublayer**: a norm whose input is ``s`` and whose output feeds the branch is
  *pre*; a norm that ends the branch is *out*; a norm whose input is the add and whose output is
  the next sublayer's stream is *post* (:meth:`PlacementKind.of_slots`).
* **Stacks**: where a sublayer's stream value is not computed from the previous sublayer's add and its branches
  read the earlier run's last value (an encoder-decoder: the decoder's stream starts at its own embedding and its
  cross-attention reads the encoder's output), the sublayers are two stacks (:func:`split_stacks`), each read on
  its own. A stack on a stream of another length (a decoder batch shorter than the encoder's) joins the stream
  the same way (:func:`find_stream`). An attention whose keys are not computed from its stack's first stream
  value reads another stream: ``cross-attention``.
* The **final norm** is the norm on the last stream value (after the last sublayer's post-norm,
  when two norms follow each other there or the sublayer repeats a post-norm scheme), looking
  through constant scalings of the stream; the **embedding** norm or scaling is read walking back
  from the first stream value (the norm on the patch or token embeddings, whether a position embedding or a
  CLS token joins them before it or after it).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field

from ..analysis.graph import Graph, Node, Ref
from ..analysis.ops import CASTS, PROJECTIONS, SHAPE_ONLY, TOKEN_MIXING
from ..analysis.walk import components, learned_mul, scalar_mul, strip, upstream
from ..vocabulary import BranchScaling, SublayerKind
from .norms import Site

__all__ = [
    "Stream",
    "Sublayer",
    "embedding",
    "final_norm",
    "find_stream",
    "group_sublayers",
    "layer_of",
    "norm_bits_of",
    "place_norms",
    "residual_adds",
    "scale_after",
    "split_stacks",
    "stream_root",
]


@dataclass
class Sublayer:
    """One residual add (or a run of parallel adds on one stream value) and the norms around it."""

    source: int
    adds: list[int]
    branches: list[int]
    skip_scale: float = 1.0
    branch_scales: list[float | BranchScaling] = field(default_factory=list)  # constants and learned multipliers
    pre: list[Site] = field(default_factory=list)
    out: list[Site] = field(default_factory=list)
    post: list[Site] = field(default_factory=list)
    kind: SublayerKind = SublayerKind.MLP
    layer: int = 0
    parallel_same: bool = False
    whole: int | None = None  # the branch operand before splitting a sum of branches
    skip_learned: BranchScaling | None = None  # a learned multiplier on the residual itself


def _has_compute(g: Graph, branch: int, source: int) -> bool:
    own = g.anc(branch) & ~(g.anc(source) | 1 << source)  # the source's own op is not the branch's (gelu_new's cube)
    return any(own >> n.idx & 1 for n in g.nodes if n.op in PROJECTIONS or n.op == "matmul")


def norm_bits_of(g: Graph, sites: list[Site]) -> int:
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
        if not own >> n.idx & 1 or n.op in SHAPE_ONLY or n.op in ("param", "buffer", "leaf", "add", "sub"):
            continue
        by_param = any(g.nodes[strip(g, i, SHAPE_ONLY)].op == "param" for i in n.inputs)
        if (n.op in PROJECTIONS or n.op == "matmul") and by_param:
            continue
        if scalar_mul(g, n) is None and learned_mul(g, n) is None:
            return False
    return True


def _alias_root(g: Graph, idx: int) -> int:
    """The first node of the same value: a cast that returned its own input tensor (``x.to(x.dtype)``) re-binds
    the stream to a new node, so uses after it and uses before it would look like different values."""
    while (n := g.nodes[idx]).op in CASTS and n.prev is not None and n.prev in n.inputs:
        idx = n.prev
    return idx


def residual_adds(g: Graph, shape: tuple[int, ...], norms: int = 0) -> list[tuple[int, int, int, int]]:
    """(add, skip operand, branch operand, stream source) for every residual add (``norms``: the nodes inside
    norms, as :func:`norm_bits_of` gives them, set aside when telling a linear side path from a sublayer)."""

    def stream_like(s: tuple[int, ...] | None) -> bool:  # the stream, possibly flattened to (B*T, D)
        return s is not None and len(s) >= 2 and s[-1] == shape[-1] and math.prod(s) == math.prod(shape)

    found = []
    for n in g.nodes:
        if n.op != "add" or not stream_like(n.shape) or len(n.inputs) != 2 or n.inputs[0] == n.inputs[1]:
            continue
        for a, b in (n.inputs, n.inputs[::-1]):
            src = next((c for c in components(g, a) if stream_like(g.nodes[c].shape) and g.feeds(c, b)), None)
            if src is not None:
                src = _alias_root(g, src)
            if src is not None and _has_compute(g, b, src):
                if not _linear_only(g, b, src, norms):
                    found.append((n.idx, a, b, src))
                break
    return found


def _walk_branch(g: Graph, b: int, ends: dict[int, Site]) -> tuple[int, list[float | BranchScaling]]:
    scales: list[float | BranchScaling] = []
    while True:
        n = g.nodes[b]
        if b in ends:
            return b, scales
        if n.op in CASTS | {"dropout", "identity"} and n.inputs:  # one step: a norm may end in a cast (type_as)
            first = n.args[0] if n.args else None
            b = first.idx if isinstance(first, Ref) else n.inputs[0]
            continue
        sm = scalar_mul(g, n)
        if sm is not None:
            if sm[1] != 1.0:
                scales.append(float(sm[1]))
            b = sm[0]
            continue
        lm = learned_mul(g, n)
        if lm is not None:
            scales.append(lm[1])
            b = lm[0]
            continue
        return b, scales


def layer_of(g: Graph, idx: int, keys: dict[str, int]) -> int | None:
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


def _channels_first(g: Graph) -> list[tuple[int, ...]]:
    """Shapes of repeated 4-d adds: a channels-first stream (ConvNeXt: ``(B, C, H, W)``, its norms on NHWC
    views), tried only when no other candidate has a residual add."""
    adds = Counter(n.shape for n in g.nodes if n.op == "add" and n.shape and len(n.shape) == 4)
    return [sh for sh, k in adds.most_common(2) if k > 1]


@dataclass
class Stream:
    """The residual stream: its shape, its sublayers in order, and the norms indexed by where they read and write."""

    shape: tuple[int, ...]
    sublayers: list[Sublayer]
    by_input: dict[int, list[Site]]
    by_output: dict[int, Site]

    def reading(self, g: Graph, idx: int) -> list[Site]:
        """The norms whose input is the stream value ``idx`` (through views, casts and constant scalings)."""
        return self.by_input.get(stream_root(g, idx), [])


def stream_root(g: Graph, idx: int) -> int:
    """``idx`` followed back through views, casts and multiplies by a constant (a scalar buffer included)."""
    while True:
        idx = strip(g, idx, SHAPE_ONLY)
        sm = scalar_mul(g, g.nodes[idx])
        if sm is None:
            return idx
        idx = sm[0]


def find_stream(g: Graph, sites: list[Site]) -> Stream:
    """Phase 1: the residual stream shape with the most residual adds, and its sublayers (norms not yet placed)."""
    shapes = _stream_shapes(g, sites)
    if not shapes:
        raise ValueError("cannot find the residual stream: the model has no embedding and no floating input")
    norm_bits = norm_bits_of(g, sites)
    found = [(residual_adds(g, c, norm_bits), c) for c in shapes[:6]]
    adds, shape = max(found, key=lambda f: len(f[0]))
    if not adds:
        found = [(residual_adds(g, c, norm_bits), c) for c in _channels_first(g)]
        adds, shape = max(found, key=lambda f: len(f[0])) if found else ([], shapes[0])
    if not adds:
        shape = shapes[0]
    for more, other in found:  # another stack's stream of another length (a decoder batch of its own length)
        same_width = bool(other) and bool(shape) and other[-1] == shape[-1] and math.prod(other) != math.prod(shape)
        if adds and more and same_width and not {a[0] for a in more} & {a[0] for a in adds} and _apart(g, adds, more):
            adds = sorted(adds + more)
    subs = group_sublayers(g, adds)
    by_input: dict[int, list[Site]] = {}
    for s in sites:
        by_input.setdefault(stream_root(g, s.input), []).append(s)
    return Stream(shape, subs, by_input, {s.output: s for s in sites})


def _apart(g: Graph, a: list[tuple[int, int, int, int]], b: list[tuple[int, int, int, int]]) -> bool:
    """Two runs of residual adds are two stacks: one runs wholly before the other, the later one's stream does not
    start from the earlier one's last add, and a branch of the later one reads it."""
    first, later = (a, b) if a[-1][0] < b[0][0] else (b, a) if b[-1][0] < a[0][0] else (None, None)
    if first is None or later is None:
        return False
    end = first[-1][0]
    return not g.feeds(end, later[0][3]) and any(g.feeds(end, br) for _, _, br, _ in later)


def split_stacks(g: Graph, stream: Stream) -> list[Stream]:
    """The stream cut into stacks where a sublayer's stream value is not computed from the previous sublayer's
    add and a branch after the cut reads the value before it (an encoder's output, read by the decoder's
    cross-attention); one stack otherwise. Each stack keeps the stream's norm indices."""
    subs = stream.sublayers
    cuts = [0]
    for i in range(1, len(subs)):
        end = subs[i - 1].adds[-1]
        if g.feeds(end, subs[i].source) or stream_root(g, subs[i].source) == stream_root(g, end):
            continue
        if any(g.feeds(end, b) for s in subs[i:] for b in s.branches):
            cuts.append(i)
    bounds = [*cuts, len(subs)]
    return [Stream(stream.shape, subs[a:b], stream.by_input, stream.by_output) for a, b in itertools.pairwise(bounds)]


def _sublayer(g: Graph, add: int, skip: int, branch: int, src: int) -> Sublayer:
    """One residual add: the residual's own scaling (walking the skip operand back to the stream) and a
    branch that is a sum of two branches of the stream (GPT-J style parallel) split in two."""
    sub = Sublayer(src, [add], [branch])
    cur = skip
    while cur != src:
        n = g.nodes[cur]
        if (sm := scalar_mul(g, n)) is not None:
            sub.skip_scale *= sm[1]
            cur = sm[0]
        elif (lm := learned_mul(g, n)) is not None:
            sub.skip_learned = lm[1]
            cur = lm[0]
        elif n.op in SHAPE_ONLY and n.inputs:  # one step: a chain of casts and views may pass the source itself
            first = n.args[0] if n.args else None
            cur = first.idx if isinstance(first, Ref) else n.inputs[0]
        else:
            break
    bnode = g.nodes[strip(g, branch, SHAPE_ONLY)]
    if bnode.op == "add":
        parts = [i for i in bnode.inputs if g.feeds(src, i) and _has_compute(g, i, src)]
        if len(parts) == 2:
            sub.whole, sub.branches = sub.branches[0], parts
    return sub


def group_sublayers(g: Graph, adds: list[tuple[int, int, int, int]]) -> list[Sublayer]:
    """Residual adds (as :func:`residual_adds` gives them, in order) grouped into sublayers: consecutive adds on one
    stream value are one (parallel) sublayer."""
    subs: list[Sublayer] = []
    for add, skip, branch, src in adds:
        last = subs[-1] if subs else None
        if last is not None and src == last.source and last.adds[-1] in components(g, skip):
            last.adds.append(add)
            last.branches.append(branch)
            continue
        subs.append(_sublayer(g, add, skip, branch, src))
    return subs


def place_norms(
    g: Graph, stream: Stream, attn_bits: int, keys: dict[str, int], key_operands: dict[int, int] | None = None
) -> None:
    """Phase 3: each sublayer's kind (attention / MLP / both), its pre, out and post norms, and its layer
    (``keys``: layer container path -> index, filled in order of first use; ``key_operands``: attention core ->
    its key operand, to tell a cross-attention, whose keys are not computed from the stack's stream)."""
    subs = stream.sublayers
    for i, sub in enumerate(subs):
        _branch_norms(g, sub, stream.by_output)
        _classify(g, sub, attn_bits)
        if sub.kind is SublayerKind.ATTENTION and key_operands:
            own = g.anc(sub.adds[-1]) & ~g.anc(sub.source)
            ks = [k for core, k in key_operands.items() if own >> core & 1]
            start = subs[0].source
            if ks and not any(k == start or g.feeds(start, k) for k in ks):
                sub.kind = SublayerKind.CROSS_ATTENTION
        outs = {s.node for s in sub.out}
        sub.pre = [
            s
            for s in stream.reading(g, sub.source)
            if s.node not in outs and any(g.feeds(s.output, b) for b in sub.branches)
        ]
        nxt = subs[i + 1].source if i + 1 < len(subs) else None
        for s in stream.reading(g, sub.adds[-1]):
            if nxt is not None and strip(g, nxt, SHAPE_ONLY) == strip(g, s.output, SHAPE_ONLY):  # may end in a cast
                sub.post.append(s)
        layer = layer_of(g, sub.adds[-1], keys)
        sub.layer = layer if layer is not None else -1
    if subs and any(sub.layer < 0 for sub in subs):  # no ModuleList: count layers by the first sublayer kind
        layer, first_kind = -1, subs[0].kind
        for sub in subs:
            layer += sub.kind == first_kind
            sub.layer = layer


def _branch_norms(g: Graph, sub: Sublayer, by_output: dict[int, Site]) -> None:
    """The norm that ends each branch (out) and the constant or learned scalings after it."""
    for b in sub.branches:
        node, scales = _walk_branch(g, b, by_output)
        sub.branch_scales += scales
        if node in by_output:
            sub.out.append(by_output[node])
            if by_output[node].output_scale != 1.0:  # a constant after the branch's last norm scales the branch
                sub.branch_scales.append(by_output[node].output_scale)


def _mixes_tokens(g: Graph, source: int, own: int) -> bool:
    """A branch's own compute holds, on the path from its stream value, a floating op that mixes positions without
    an attention core (:data:`TOKEN_MIXING`: an SSM's convolution and scan, linear attention's running sum)."""
    return any(
        own >> n.idx & 1 and n.op in TOKEN_MIXING and n.dtype is not None and n.dtype.is_floating_point
        and g.feeds(source, n.idx)
        for n in g.nodes
    )  # fmt: skip


def _classify(g: Graph, sub: Sublayer, attn_bits: int) -> None:
    """Each branch is attention (an attention core in its own compute), a mixer (positions mixed otherwise:
    :func:`_mixes_tokens`) or an MLP (neither); the sublayer is the branches' kind, or two of them beside each
    other at one add (attention + MLP, attention + mixer)."""
    own = [g.anc(b) & ~g.anc(sub.source) for b in sub.branches]
    attends = [bool(o & attn_bits) for o in own]
    mixes = [not a and _mixes_tokens(g, sub.source, o) for a, o in zip(attends, own, strict=True)]
    sub.kind = SublayerKind.ATTENTION if any(attends) else SublayerKind.MIXER if any(mixes) else SublayerKind.MLP
    if len(sub.branches) > 1:
        if any(attends) and any(mixes):
            sub.kind = SublayerKind.ATTENTION_MIXER
        elif set(attends) == {True, False}:
            sub.kind = SublayerKind.PARALLEL
        else:  # two branches of one kind (routed + shared experts): one sublayer, not parallel
            sub.parallel_same = True
            if sub.whole is not None:
                sub.branches = [sub.whole]


def final_norm(g: Graph, stream: Stream) -> Site | None:
    """Phase 4: the norm on the last stream value. A norm there is the last sublayer's post-norm when another
    norm follows it (the final norm), or when the nearest sublayer of its kind has a post-norm and otherwise
    the same norms (Mix-LN switches scheme with depth, so a Pre-LN last layer after a Post-LN one ends in a
    final norm); the post-norm is then appended to the last sublayer. A post-norm run outside the layer list
    after a last layer that runs inside it (nGPT's Dory: each layer's post-norm is the next layer's first norm, the
    last one the model's) is both the last sublayer's post-norm and the final norm."""
    if not stream.sublayers:
        return None
    last = stream.sublayers[-1]
    cands = [s for s in stream.reading(g, last.adds[-1]) if s not in last.pre]
    same_kind = [sub for sub in stream.sublayers[:-1] if sub.kind == last.kind]
    near = same_kind[-1] if same_kind else None
    chained = bool(cands) and bool(stream.reading(g, cands[0].output))
    same_scheme = near is not None and (bool(near.pre), bool(near.out)) == (bool(last.pre), bool(last.out))
    like_near = near is not None and bool(near.post) and same_scheme
    if cands and (chained or like_near):
        last.post.append(cands[0])
        if not chained and _in_layer(g, last.adds[-1]) and not _in_layer(g, cands[0].node):
            return cands[0]  # the stack's own norm, run after its last layer: that layer's post-norm and the final norm
        cands = list(stream.reading(g, cands[0].output))
    return cands[0] if cands else None


def _in_layer(g: Graph, idx: int) -> bool:
    """Whether node ``idx`` runs inside an element of a layer list (an ``nn.ModuleList`` child)."""
    return any(path in g.list_children for path in g.nodes[idx].scope)


def embedding(g: Graph, stream: Stream, *, through_joins: bool = False) -> tuple[float | None, Site | None]:
    """Phase 5: the constant scaling and the norm between the embedding and the first stream value (with
    ``through_joins``, a norm before a position add or a CLS concatenation too: :func:`_norm_before_adds`)."""
    if not stream.sublayers:
        return None, None
    scale, norm = None, None
    cur = stream.sublayers[0].source
    while True:
        n = g.nodes[cur]
        sm = scalar_mul(g, n)
        if cur in stream.by_output and norm is None:
            norm = stream.by_output[cur]
            cur = norm.input
        elif sm is not None:
            scale = (scale or 1.0) * sm[1]
            cur = sm[0]
        elif n.op in SHAPE_ONLY and n.inputs:
            cur = strip(g, cur, SHAPE_ONLY)
        else:
            break
    if norm is None and through_joins:
        norm = _norm_before_adds(g, stream, cur)
    return (scale if scale != 1.0 else None), norm


_TOKEN_JOINS = frozenset({"add", "cat", "concat", "dropout", "identity"})


def _norm_before_adds(g: Graph, stream: Stream, start: int) -> Site | None:
    """The one norm of the stream's width (at ``start``) upstream of ``start`` through what joins the embedding's
    terms: adds (a position embedding added after the norm), concatenations (a CLS token prepended), views, casts,
    dropout and constant scalings (PVT's patch LayerNorm, then its position table); None unless exactly one."""

    def expand(node: Node) -> bool:
        if node.idx in stream.by_output:
            return False
        return node.op in _TOKEN_JOINS or node.op in SHAPE_ONLY or node.op in CASTS or scalar_mul(g, node) is not None

    found = [stream.by_output[n.idx] for n in upstream(g, start, expand) if n.idx in stream.by_output]
    width = (g.nodes[start].shape or stream.shape)[-1]  # the first stage's width, in a staged tower
    found = [s for s in found if s.size == width]
    return found[0] if len(found) == 1 else None


def scale_after(g: Graph, idx: int) -> float | None:
    """The constant multiplying node ``idx``'s value right after it (through casts): Gemma's sqrt(hidden_size) on
    the token embeddings, read forwards where the walk back from the first stream value cannot reach them (Gemma
    3n's AltUp widens the embeddings into several streams; a VLM places image rows among them first)."""
    scale, cur = 1.0, idx
    while True:
        step = None
        for u in g.users(cur):
            sm = scalar_mul(g, u)
            if sm is not None and sm[0] == cur:
                scale, step = scale * sm[1], u.idx
            elif u.op in CASTS and u.inputs and u.inputs[0] == cur:
                step = u.idx
            if step is not None:
                break
        if step is None:
            return scale if scale != 1.0 else None
        cur = step
