"""The stages of a vision tower: one residual stream shape per stage, read from the dataflow.

A hierarchical tower (ConvNeXt, Swin, ResNet, BiT, PVT, ...) runs its residual blocks on one stream shape per
stage and changes the shape between stages (a strided convolution, a patch merging, a projection block). The
token-model reader follows one stream shape; this module finds all of them. Method (structural, no names):

* **residual adds** are found for every shape an ``add`` node has (:func:`.residual.residual_adds`), each add
  kept under its own shape; a **run** is a sequence of residual adds on one shape, consecutive in execution order;
* the **chain**: from the run with the most adds, a neighbouring run is a stage of the same tower when the later
  run's first stream value is computed from the earlier run's last one and no attention with queries that are not
  computed from the earlier stream lies between them (learned queries: a pooling head, a resampler, a detection
  decoder read a tower; they are not one of its stages);
* the **boundary** into a stage is what lies between the previous stage's last stream value (the pixel input for
  the first stage) and the stage's first: the downsampling layer (the stem, for the first stage);
* a stage's **layers** are the sublayers grouped by the innermost ``nn.ModuleList`` element they run in, or
  counted by the stage's first sublayer kind where no list element separates them (blocks in an
  ``nn.Sequential``); the grouping is handed to the shared reader as the scope path each layer runs in;
* **LayerScale** is a multiply of the branch by a per-channel parameter on its way to the add, looking through
  views and permutes (ConvNeXt scales its NHWC branch, then permutes it back to NCHW); its init value is read off
  the parameter when every entry holds the same number (a model built from its config, not a trained checkpoint).

Guaranteed property: stages, boundaries and layers are facts of the executed computation; module paths are used
only as labels and as the carrier of a grouping found from the dataflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..analysis.attention_calls import ATTENTION_CALLS
from ..analysis.graph import LEAVES, Graph, Node
from ..analysis.ops import PROJECTIONS, SHAPE_ONLY
from ..analysis.walk import learned_mul, scalar_mul, strip
from ..vocabulary import BranchScaling, SublayerKind
from .norms import Site
from .residual import Stream, Sublayer, group_sublayers, norm_bits_of, residual_adds, stream_root

__all__ = [
    "Stage",
    "attention_bits",
    "branch_bits",
    "branch_gains",
    "find_stages",
    "init_value",
    "layer_paths",
    "merged_stream",
]

_SCORE_PRODUCTS = frozenset({"matmul", "bmm", "einsum", "baddbmm"})
_ACTIVATIONS = frozenset({"relu", "gelu", "silu", "hardswish", "leaky_relu", "relu6", "mish"})


@dataclass
class Stage:
    """One stage: its stream shape, its sublayers in order, and the values that bound it."""

    shape: tuple[int, ...]
    sublayers: list[Sublayer]
    entry: int | None  # the previous stage's last stream value (None for the first stage: the tower's input)
    boundary: int = 0  # bitset: the nodes between ``entry`` and the first stream value (the downsampling layer)
    region: int = 0  # bitset: every node computed for this stage (its boundary and its blocks)

    @property
    def first(self) -> int:
        """The stage's first stream value (the source of its first sublayer)."""
        return self.sublayers[0].source

    @property
    def last(self) -> int:
        """The stage's last stream value (its last residual add)."""
        return self.sublayers[-1].adds[-1]


def _projections(g: Graph, a: int, x: int) -> int:
    """How many projections (by a parameter or not) ``a`` computes since ``x``."""
    own = g.anc(a) | 1 << a
    own &= ~(g.anc(x) | 1 << x)
    return sum(1 for n in g.nodes[x : a + 1] if own >> n.idx & 1 and (n.op in PROJECTIONS or n.op == "matmul"))


def _projection_add(g: Graph, n: Node, by_output: dict[int, Site]) -> tuple[int, int, int, int] | None:
    """A block whose shortcut projects a stream of another shape: ``F(x) + P(x)`` (ResNet's first block of a
    stage, BiT's), as (add, shortcut, branch, x). ``x`` is the latest value both operands are computed from,
    before a norm they share (BiT normalises once, then feeds both); the branch is the operand with more
    projections."""
    if len(n.inputs) != 2 or n.inputs[0] == n.inputs[1]:
        return None
    a, b = n.inputs
    common = (g.anc(a) | 1 << a) & (g.anc(b) | 1 << b)
    xs = [m.idx for m in g.nodes[: n.idx] if common >> m.idx & 1 and m.op not in LEAVES and m.shape]
    if not xs:
        return None
    x = strip(g, max(xs), SHAPE_ONLY)
    if g.nodes[x].op in _ACTIVATIONS and g.nodes[x].inputs and strip(g, g.nodes[x].inputs[0]) in by_output:
        x = strip(g, g.nodes[x].inputs[0])  # a norm's activation (BiT's GroupNorm + ReLU)
    if x in by_output:
        x = strip(g, by_output[x].input, SHAPE_ONLY)
    shape = g.nodes[x].shape
    if shape is None or shape == n.shape or len(shape) != len(n.shape or ()):
        return None
    pa, pb = _projections(g, a, x), _projections(g, b, x)
    if not pa or not pb or pa == pb:
        return None
    skip, branch = (a, b) if pa < pb else (b, a)
    return n.idx, skip, branch, x


def _runs(g: Graph, sites: list[Site]) -> list[list[tuple[int, int, int, int]]]:
    """Residual adds (add, skip, branch, source) grouped into runs of one shape, in execution order."""
    norm_bits = norm_bits_of(g, sites)
    shapes = list(dict.fromkeys(n.shape for n in g.nodes if n.op == "add" and n.shape and len(n.shape) >= 2))
    found: dict[int, tuple[int, int, int, int]] = {}
    for shape in shapes:
        for add in residual_adds(g, shape, norm_bits):  # type: ignore[arg-type]
            if g.nodes[add[0]].shape == shape:  # a flattened view of another shape is found under its own
                found.setdefault(add[0], add)
    by_output = {s.output: s for s in sites}
    for n in g.nodes:
        ok = n.op == "add" and n.idx not in found and n.shape is not None and len(n.shape) >= 3
        if ok and (proj := _projection_add(g, n, by_output)) is not None:
            found[n.idx] = proj
    runs: list[list[tuple[int, int, int, int]]] = []
    for add in sorted(found.values()):
        if runs and g.nodes[runs[-1][-1][0]].shape == g.nodes[add[0]].shape:
            runs[-1].append(add)
        else:
            runs.append([add])
    return runs


def _from(g: Graph, a: int, b: int) -> bool:
    return a == b or g.feeds(a, b)


def _between(g: Graph, entry: int, end: int) -> int:
    """Bitset of the nodes computed from ``entry`` that ``end`` is computed from (both ends included)."""
    anc = g.anc(end) | 1 << end
    return sum(1 << n.idx for n in g.nodes[entry : end + 1] if anc >> n.idx & 1 and _from(g, entry, n.idx))


def _score_operands(g: Graph, softmax: int) -> list[int]:
    """The two activations whose product a softmax normalises (empty when there is no such product)."""
    cur = g.nodes[softmax].inputs[0] if g.nodes[softmax].inputs else None
    for _ in range(12):
        if cur is None:
            return []
        n = g.nodes[cur]
        if n.op in _SCORE_PRODUCTS:
            ins = [i for i in n.inputs if g.nodes[strip(g, i, SHAPE_ONLY)].op not in ("param", "buffer")]
            return ins if len(ins) == 2 else []
        ins = [i for i in n.inputs if g.nodes[i].shape == n.shape]
        cur = ins[0] if ins else None
    return []


def _learned_queries(g: Graph, boundary: int, entry: int) -> bool:
    """An attention on the boundary whose queries are not computed from the earlier stream (a probe, latents)."""
    for n in g.nodes:
        if not boundary >> n.idx & 1:
            continue
        if n.op in ATTENTION_CALLS and n.inputs and not _from(g, entry, n.inputs[0]):
            return True
        if n.op == "softmax" and any(not _from(g, entry, i) for i in _score_operands(g, n.idx)):
            return True
    return False


def _joins(g: Graph, earlier: list[Sublayer], later: list[Sublayer]) -> int | None:
    """The boundary bitset when ``later`` continues the tower from ``earlier``; None when it does not."""
    entry, first = earlier[-1].adds[-1], later[0].source
    if not _from(g, entry, first):  # a projection block reads the earlier stream value itself
        return None
    boundary = _between(g, entry, first)
    return None if _learned_queries(g, boundary, entry) else boundary


def branch_bits(g: Graph, subs: list[Sublayer]) -> int:
    """Bitset of every node the sublayers' branches compute themselves (the stream they read excluded)."""
    bits = 0
    for sub in subs:
        for b in sub.branches:
            bits |= (g.anc(b) | 1 << b) & ~(g.anc(sub.source) | 1 << sub.source)
    return bits


def _nested(run: list[Sublayer], bits: int) -> bool:
    """Every add of ``run`` is computed inside the branches ``bits`` of another run. Of two runs nested so, the
    one with fewer blocks is not a stage: a residual within a block (SAM's attention scores plus a relative-position
    term read as one), or one residual around a whole body of blocks (Swin2SR's)."""
    return all(bits >> a & 1 for sub in run for a in sub.adds)


def _interleaved(g: Graph, runs: list[list[Sublayer]]) -> list[list[Sublayer]]:
    """Runs whose shapes recur (A B A B ...) are one run: a stage never returns to an earlier stage's shape, so
    a shape that comes back is a side stream each block runs beside its main one (X-CLIP's cross-frame message
    tokens, ``(B, T, D)`` beside ``(B T, N, D)``), its sublayers part of the same blocks."""
    shapes = [g.nodes[r[-1].adds[-1]].shape for r in runs]
    last = {shape: m for m, shape in enumerate(shapes)}  # each shape's last run
    out: list[list[Sublayer]] = []
    i = 0
    while i < len(runs):
        j = k = i
        while k <= j:  # widen the span to the last recurrence of every shape inside it
            j = max(j, last[shapes[k]])
            k += 1
        out.append([sub for r in runs[i : j + 1] for sub in r])
        i = j + 1
    return out


def find_stages(g: Graph, sites: list[Site]) -> list[Stage]:
    """The tower's stages in execution order (empty when the run has no residual add)."""
    runs = [r for r in (group_sublayers(g, run) for run in _runs(g, sites)) if r]
    own = [branch_bits(g, r) for r in runs]
    keep: list[int] = []
    for i in sorted(range(len(runs)), key=lambda i: -len(runs[i])):  # the run with more blocks wins
        if not any(_nested(runs[i], own[j]) or _nested(runs[j], own[i]) for j in keep):
            keep.append(i)
    kept = [runs[i] for i in sorted(keep)]
    runs = []
    for r in kept:  # two runs of one shape that a nested add separated are one
        if runs and g.nodes[runs[-1][-1].adds[-1]].shape == g.nodes[r[-1].adds[-1]].shape:
            runs[-1] += r
        else:
            runs.append(r)
    runs = _interleaved(g, runs)
    if not runs:
        return []
    anchor = max(range(len(runs)), key=lambda i: (sum(len(s.adds) for s in runs[i]), -i))
    lo = hi = anchor
    while lo > 0 and _joins(g, runs[lo - 1], runs[lo]) is not None:
        lo -= 1
    while hi + 1 < len(runs) and _joins(g, runs[hi], runs[hi + 1]) is not None:
        hi += 1
    stages: list[Stage] = []
    for subs in runs[lo : hi + 1]:
        prev = stages[-1] if stages else None
        entry = prev.last if prev is not None else None
        st = Stage(g.nodes[subs[-1].adds[-1]].shape or (), subs, entry)
        last_anc = g.anc(st.last) | 1 << st.last
        if entry is None:
            st.boundary = g.anc(st.first) | 1 << st.first
            st.region = last_anc
        else:
            st.boundary = _between(g, entry, st.first) & ~(1 << entry)
            st.region = last_anc & ~(g.anc(entry) | 1 << entry)
        stages.append(st)
    return stages


def merged_stream(g: Graph, stages: list[Stage], sites: list[Site]) -> Stream:
    """One :class:`~.residual.Stream` holding every stage's sublayers in order (its shape: the last stage's)."""
    by_input: dict[int, list[Site]] = {}
    for s in sites:
        by_input.setdefault(stream_root(g, s.input), []).append(s)
    subs = [sub for st in stages for sub in st.sublayers]
    return Stream(stages[-1].shape, subs, by_input, {s.output: s for s in sites})


# ----------------------------------------------------------------------------- layers
def _innermost_list_child(g: Graph, idx: int) -> str:
    """The innermost ``nn.ModuleList`` element node ``idx`` runs in ("" for the root when there is none)."""
    return next((p for p in reversed(g.nodes[idx].scope) if p in g.list_children), "")


def _below(g: Graph, sub: Sublayer, path: str) -> tuple[str, ...]:
    """The module paths below ``path`` that the sublayer's last add runs in, outermost first."""
    scope = g.nodes[sub.adds[-1]].scope
    if path not in scope:
        return ()
    return scope[len(scope) - scope[::-1].index(path) :]  # after its last entry: the root is entered twice


def _kind(g: Graph, sub: Sublayer, attn_bits: int) -> SublayerKind:
    """Attention when a branch computes a softmax over a product of two activations, else MLP."""
    own = [g.anc(b) & ~g.anc(sub.source) for b in sub.branches]
    return SublayerKind.ATTENTION if any(o & attn_bits for o in own) else SublayerKind.MLP


def _split(g: Graph, group: list[Sublayer], path: str, attn_bits: int) -> list[list[Sublayer]]:
    """``group`` (the sublayers running in module ``path``) cut into layers: one per child module of ``path``
    holding its adds, when each child holds whole sublayers and all of them the same sequence of sublayer
    kinds (ResNet's blocks in an ``nn.Sequential``); else one layer (a ViT block: its attention add runs in the
    block module itself)."""
    below = [_below(g, sub, path) for sub in group]
    if not all(below):
        return [group]
    children = list(dict.fromkeys(b[0] for b in below))
    if len(children) == 1 and children[0] != path:
        return _split(g, group, children[0], attn_bits)
    parts = [[sub for sub, b in zip(group, below, strict=True) if b[0] == c] for c in children]
    kinds = {tuple(_kind(g, sub, attn_bits) for sub in part) for part in parts}
    if len(kinds) != 1 or sum(len(p) for p in parts) != len(group):
        return [group]
    return [layer for part, c in zip(parts, children, strict=True) for layer in _split(g, part, c, attn_bits)]


def _groups(g: Graph, subs: list[Sublayer], attn_bits: int) -> list[list[Sublayer]]:
    """A stage's sublayers grouped into layers (the module docstring's rule); with no module to tell them
    apart, a layer starts at each sublayer of the stage's first kind."""
    runs: list[tuple[str, list[Sublayer]]] = []
    for sub in subs:
        key = _innermost_list_child(g, sub.adds[-1])
        if runs and runs[-1][0] == key:
            runs[-1][1].append(sub)
        else:
            runs.append((key, [sub]))
    groups = [layer for key, run in runs for layer in _split(g, run, key, attn_bits)]
    if len(groups) > 1 or len(subs) == 1:
        return groups
    first, counted = _kind(g, subs[0], attn_bits), list[list[Sublayer]]()
    for sub in subs:
        if not counted or _kind(g, sub, attn_bits) == first:
            counted.append([sub])
        else:
            counted[-1].append(sub)
    return counted


def attention_bits(g: Graph) -> int:
    """Every attention as a bitset: a fused attention call, or a softmax over a product of two activations."""
    bits = 0
    for n in g.nodes:
        if n.op in ATTENTION_CALLS or (n.op == "softmax" and _score_operands(g, n.idx)):
            bits |= 1 << n.idx
    return bits


def layer_paths(g: Graph, stages: list[Stage], attn_bits: int) -> frozenset[str] | None:
    """One scope path per layer: the deepest module every add of the layer runs in and no add of another layer
    does (None when some layer has none: the shared reader then counts layers itself)."""
    groups = [grp for st in stages for grp in _groups(g, st.sublayers, attn_bits)]
    scopes = [[g.nodes[a].scope for sub in grp for a in sub.adds] for grp in groups]
    paths: list[str] = []
    for i, own in enumerate(scopes):
        common = [p for p in own[0] if all(p in sc for sc in own[1:])]
        others = {p for j, sc in enumerate(scopes) if j != i for s in sc for p in s}
        path = next((p for p in reversed(common) if p not in others), None)
        if path is None:
            return None
        paths.append(path)
    return frozenset(paths)


# ----------------------------------------------------------------------------- LayerScale
def branch_gains(g: Graph, sub: Sublayer, norm_nodes: frozenset[int] = frozenset()) -> list[tuple[BranchScaling, int]]:
    """The learned multipliers on each branch's way to the add, through views, permutes and constant scalings:
    (:class:`~normatlas.vocabulary.BranchScaling`, the parameter's node). ``norm_nodes``: the sites' normalized values
    (:attr:`Site.node`); a multiplier applied to one of them is that norm's gain (a branch ending in an RMSNorm,
    Peri-LN / res-post), not a LayerScale, and the walk stops there."""
    found: list[tuple[BranchScaling, int]] = []
    for b in sub.branches:
        cur = b
        while True:
            n = g.nodes[cur]
            if n.op in SHAPE_ONLY and n.inputs:
                cur = strip(g, cur, SHAPE_ONLY)
            elif (sm := scalar_mul(g, n)) is not None:
                cur = sm[0]
            elif (lm := learned_mul(g, n)) is not None:
                if strip(g, lm[0], SHAPE_ONLY) in norm_nodes:
                    break
                param = next(strip(g, i, SHAPE_ONLY) for i in n.inputs if i != lm[0])
                found.append((lm[1], param))
                cur = lm[0]
            else:
                break
    return found


def init_value(g: Graph, param: int) -> float | None:
    """The one number every entry of a parameter holds (its init, in a model built from its config), else None."""
    t = g.tensors.get(param)
    if t is None or t.numel() == 0 or not t.is_floating_point():
        return None
    flat = t.detach().reshape(-1)
    first = float(flat[0])
    return float(f"{first:.6g}") if bool((flat == flat[0]).all()) and math.isfinite(first) else None
