"""Splitting one recorded image + text run into the image part, the tower, the connector and the language model.

The dataflow facts :mod:`.vlm` reports, each a function of the recorded graph (module calls are read for their
extent only, never their names):

* the **image part**: values computed from ``pixel_values`` and not from the text embedding; its **entries** are
  the image values the rest of the run reads;
* the **tower region**: the outermost module calls that take the image itself (``pixel_values``, re-laid out by
  reshapes, selections and casts only), run at least one norm and compute nothing from the text. A norm outside
  them belongs to the connector even where it normalises every token of the tower's last stream value (Mistral 3's
  projector RMSNorm): the tower is what its own module computes. Without such a call the whole image part is read
  as the tower;
* the **tap** (the tower's last stream value that reaches an entry) and the **taps** (every tower stream value the
  connector reads directly: VipLLaVA concatenates several layers);
* the **connector**: what lies between the tap and the entries, its kind read off its ops, less the tower's
  **neck**: where the tower region hands the rest only norm outputs (a convolution neck ending in a norm inside
  the tower's own call, GOT-OCR 2.0's), what the region computes after the tap is the tower's, not the connector's;
* **discrete tokens**: the entries reach ``pixel_values`` only through integer values (a VQ tokenizer's code ids,
  looked up in an embedding table): the image enters as tokens.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from ..analysis.attention_calls import ATTENTION_CALLS
from ..analysis.graph import Graph, Node
from ..analysis.ops import PROJECTIONS, SHAPE_ONLY, SHAPES, SPLITS
from ..vocabulary import ConnectorKind, Injection, Operator
from .norms import Site, find_sites
from .vision import _BATCH_STAT, VisionReport

__all__ = ["ConnectorInfo", "ConnectorKind", "Injection"]

_ACTIVATIONS = frozenset({"gelu", "silu", "relu", "tanh", "sigmoid", "mish", "relu6", "leaky_relu", "hardswish"})
_POOLS = frozenset(
    {"avg_pool1d", "avg_pool2d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "max_pool2d", "interpolate"}
)
_SCORE_STEPS = frozenset({"mul", "div", "truediv", "add", "sub"})  # a scale or a mask between q k^T and softmax


@dataclass
class ConnectorInfo:
    """The connector: its kind, its norms (in order), projections, activation, and the token counts around it."""

    kind: ConnectorKind
    norms: list[Operator] = field(default_factory=list)
    norm_widths: list[int] = field(default_factory=list)  # the size each of them normalises (taps x width: VipLLaVA)
    projections: int = 0
    activation: bool = False
    tokens_in: int | None = None  # rows at the tap
    tokens_out: int | None = None  # rows at the entries
    taps: int = 0  # tower stream values it reads directly (VipLLaVA / Mllama concatenate several layers)
    row_merge: int | None = None  # k when k rows become one row (k times the width, or a strided projection)
    scale: float | None = None  # a constant multiplying the connector's output (PaliGemma: 1/sqrt(width))
    modules: list[str] = field(default_factory=list)  # labels only

    @property
    def norm(self) -> Operator:
        """The connector's norm (the first; ``none`` without one)."""
        return self.norms[0] if self.norms else Operator.NONE


# ----------------------------------------------------------------------------- splitting the graph
def desc(g: Graph, root: int) -> int:
    """Bitset of the nodes computed from ``root`` (``root`` included)."""
    return sum(1 << n.idx for n in g.nodes if n.idx == root or g.feeds(root, n.idx))


def restricted(g: Graph, keep: int) -> Graph:
    """The graph with every node outside ``keep`` a bare leaf (same indices): what it computed is cut off."""
    nodes = [
        n if keep >> n.idx & 1 else Node(n.idx, "leaf", (), {}, (), n.shape, n.dtype, n.module, n.scope)
        for n in g.nodes
    ]
    outs = tuple(i for i in g.outputs if keep >> i & 1)
    return Graph(nodes, outs, g.list_children, g.spans, g.tensors, g.model)


def closure(g: Graph, bits: int) -> int:
    """``bits`` and every ancestor of them."""
    out = bits
    for n in g.nodes:
        if bits >> n.idx & 1:
            out |= g.anc(n.idx)
    return out


def input_node(g: Graph, tensor: torch.Tensor) -> int:
    for n in g.nodes:
        if n.op == "input" and g.tensors.get(n.idx) is tensor:
            return n.idx
    raise ValueError("the input tensor was not read by the recorded run")


def side_inputs(g: Graph, inputs: dict[str, object]) -> int:
    """Bitset of the model inputs that are neither ``input_ids`` nor a floating-point image (``pixel_values``, a
    second image): integer ids, grids, masks the connector may read (InstructBLIP's ``qformer_input_ids``)."""
    out = 0
    for key, t in inputs.items():
        if key == "input_ids" or not isinstance(t, torch.Tensor) or t.is_floating_point():
            continue
        with contextlib.suppress(ValueError):  # an input the run did not read
            out |= 1 << input_node(g, t)
    return out


def second_images(g: Graph, inputs: dict[str, object], pixel: int, text: int) -> int:
    """Bitset of what a second floating-point image input computes before it meets ``pixel_values`` (DeepSeek-VL
    hybrid's ``high_res_pixel_values`` runs a SAM encoder of its own), with the parameters and learned values only
    that computation reads: the values computed from another floating-point model input (the text ids are
    integer) and from neither ``pixel_values`` nor the text (``text``: its bitset), and their ancestors that no
    other value reads."""
    own = 0
    for key, t in inputs.items():
        if key == "pixel_values" or not isinstance(t, torch.Tensor) or not t.is_floating_point():
            continue
        with contextlib.suppress(ValueError):  # an input the run did not read
            own |= desc(g, input_node(g, t))
    own &= ~desc(g, pixel) & ~text
    if not own:
        return 0
    out = own
    for n in reversed(g.nodes):  # an ancestor read only by the second encoder's values is its own too
        if not out >> n.idx & 1 and g.users(n.idx) and all(out >> u.idx & 1 for u in g.users(n.idx)):
            out |= 1 << n.idx
    return out


def text_embedding(g: Graph, ids: int) -> int:
    for n in g.nodes:
        if n.op == "embedding" and (ids in n.inputs or g.feeds(ids, n.idx)):
            return n.idx
    raise ValueError("no embedding lookup reads input_ids: the language model's stream cannot be found")


def entries_of(g: Graph, image: int) -> list[int]:
    """Image-part values read outside the image part."""
    return [n.idx for n in g.nodes if image >> n.idx & 1 and any(not image >> u.idx & 1 for u in g.users(n.idx))]


def _floating(g: Graph, idx: int) -> bool:
    dtype = g.nodes[idx].dtype
    return dtype is not None and dtype.is_floating_point


def joined(g: Graph, image: int, entries: list[int]) -> int:
    """The last image value every entry is computed from: the connector's output. Cross-attention layers project
    one image feature tensor into keys and values of their own (each an entry): those projections belong to the
    language model's layers, and the features they share are what the connector hands over."""
    for n in reversed(g.nodes):
        if image >> n.idx & 1 and all(e == n.idx or g.feeds(n.idx, e) for e in entries):
            return n.idx
    return max(entries)


def learned(g: Graph, side: int = 0) -> int:
    """Bitset of the values computed from parameters / buffers (and the side inputs ``side``: model inputs that
    are neither the text nor an image, such as InstructBLIP's instruction ids for its Q-Former) and from no other
    model input: a resampler's learned queries and what it computes from them before they meet the image (BLIP-2's
    query LayerNorm; InstructBLIP's, on the queries and the instruction's embeddings together)."""
    from_input, from_param = 0, 0
    for n in g.nodes:
        if n.op == "input" and not side >> n.idx & 1:
            from_input |= 1 << n.idx
        elif n.op in ("param", "buffer", "input"):
            from_param |= 1 << n.idx
        elif n.inputs:
            if any(from_input >> i & 1 for i in n.inputs):
                from_input |= 1 << n.idx
            elif any(from_param >> i & 1 for i in n.inputs):
                from_param |= 1 << n.idx
    return from_param & ~from_input


def bits_of(idx: list[int]) -> int:
    return sum(1 << i for i in idx)


def _rows(shape: tuple[int, ...] | None) -> int | None:
    if not shape or len(shape) < 2:
        return None
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows


def _row_value(g: Graph, idx: int) -> int:
    """``idx``, or where it is flattened to one axis (Molmo2 adds its features to the placeholders' embeddings as
    one flat vector) the last value of two or more axes it re-lays out: back through reshapes, casts and a
    concatenation of one tensor, each keeping the element count."""
    cur = idx
    while (shape := g.nodes[cur].shape) is not None and len(shape) < 2:
        n = g.nodes[cur]
        src = n.inputs[0] if n.inputs and (n.op in SHAPE_ONLY or n.op == "cat") else None
        before = g.nodes[src].shape if src is not None else None
        if src is None or before is None or math.prod(before) != math.prod(shape):
            return idx
        cur = src
    return cur


# ----------------------------------------------------------------------------- the tower, its region and its taps
_RELAYOUT = SHAPE_ONLY | SPLITS | {"select", "index_select", "masked_select", "item_of"}


def raw_image(g: Graph, pixel: int) -> int:
    """Bitset of ``pixel_values`` and its re-layouts: values reached from it through reshapes, selections and casts
    alone (Idefics2 drops padding images by a boolean index; Qwen2-VL's patches arrive flattened)."""
    bits = 1 << pixel
    for n in g.nodes:
        if n.inputs and bits >> n.inputs[0] & 1 and n.op in _RELAYOUT:
            bits |= 1 << n.idx
    return bits


def tower_region(g: Graph, pixel: int, text: int) -> int | None:
    """Bitset of the nodes recorded inside the tower's module calls: the outermost calls that take the raw image
    (:func:`raw_image`), run at least one norm and record nothing computed from the text (``text``: its bitset).
    ``None`` where no module call qualifies (the image part is then read whole as the tower)."""
    raw = raw_image(g, pixel)
    sites = sorted(s.node for s in find_sites(g))
    chosen: list[int] = []
    for i, sp in enumerate(g.spans):
        if sp.end <= sp.start or not any(raw >> j & 1 for j in sp.inputs):
            continue
        inside = ((1 << sp.end) - 1) ^ ((1 << sp.start) - 1)
        if inside & text or not any(sp.start <= s < sp.end for s in sites):
            continue
        chosen.append(i)
    keep = set(chosen)
    region = 0
    for i in chosen:
        parent = g.spans[i].parent
        while parent is not None and parent not in keep:
            parent = g.spans[parent].parent
        if parent is None:  # outermost
            sp = g.spans[i]
            region |= ((1 << sp.end) - 1) ^ ((1 << sp.start) - 1)
    return region or None


def discrete(g: Graph, pixel: int, entries: list[int]) -> bool:
    """The entries depend on ``pixel_values`` only through integer values: no chain of floating-point values links
    them (a VQ tokenizer's argmin over its codebook, the ids then looked up in an embedding table)."""
    reach = 1 << pixel
    for n in g.nodes:  # a call returning several tensors (split, chunk) has no dtype: its parts carry on
        if any(reach >> i & 1 and (_floating(g, i) or g.nodes[i].dtype is None) for i in n.inputs):
            reach |= 1 << n.idx
    return not any(reach >> e & 1 for e in entries)


def tap(g: Graph, gv: Graph, vision: VisionReport, entries: list[int]) -> tuple[int | None, int, list[int]]:
    """The last stream value of the tower that feeds an entry, how many tower layers it depends on, and every
    stream value of the tower that feeds an entry (the candidates :func:`taps` counts). The stream is every stage's
    sublayers in order (:func:`.stages.find_stages`): a tower that merges tokens between its layers (MiniCPM-V's
    window merger) runs layers on both stream shapes."""
    from .residual import find_stream, layer_of
    from .stages import find_stages, merged_stream

    sites = find_sites(gv)
    stages = find_stages(gv, sites)
    stream = merged_stream(gv, stages, sites) if stages else find_stream(gv, sites)
    by_node = {s.node: s for s in sites}
    shape = stream.shape or ()
    # the stream's channel width: its last axis, or axis 1 of a (B, C, H, W) feature map (a conv tower: VQ-VAE);
    # a norm over wider rows (merged tokens) is the connector's
    widths = {shape[-1]} | ({shape[1]} if len(shape) == 4 else set()) if shape else set()
    ends = {
        n.index for n in vision.norms if n.role.value in ("final", "post") and n.index in by_node and n.size in widths
    }
    cands = [sub.adds[-1] for sub in stream.sublayers] + [by_node[i].output for i in ends]
    feeding = [c for c in cands if any(c == e or g.feeds(c, e) for e in entries)]
    if not feeding:
        return None, 0, []
    last = max(feeding)
    keys: dict[str, int] = {}
    layers = {
        layer_of(gv, sub.adds[-1], keys)
        for sub in stream.sublayers
        if sub.adds[-1] == last or g.feeds(sub.adds[-1], last)
    }
    return last, len(layers), feeding


def taps(g: Graph, feeding: list[int], last: int | None, bits: int) -> int:
    """Tower stream values the connector (``bits``) reads directly: 1 for one tapped layer, k for k concatenated."""
    read = {c for c in feeding if any(bits >> u.idx & 1 for u in g.users(c))}
    return len(read | ({last} if last is not None else set()))


def batch_stat_norms(gv: Graph, image: int) -> int:
    """BatchNorm / InstanceNorm calls among the image part's nodes of ``gv``."""
    return sum(1 for n in gv.nodes if image >> n.idx & 1 and n.op in _BATCH_STAT)


def neck(g: Graph, gi: Graph, region: int | None, bits: int) -> int:
    """The nodes of ``bits`` (the connector) that belong to the tower: where every value the tower region hands to the
    rest of ``bits`` is a norm's output (shape ops aside), the region's part of ``bits``; else 0. A tower whose call
    ends in a norm has normalised its own output (GOT-OCR 2.0's conv neck); a region that ends in a projection
    (Qwen2-VL's merger inside the visual call) hands on a connector's value and keeps it."""
    from ..analysis.walk import strip

    inner = bits & (region or 0)
    if not inner:
        return 0
    outputs = {s.output for s in find_sites(gi)}
    exits = [
        n.idx
        for n in g.nodes
        if inner >> n.idx & 1 and any(bits >> u.idx & 1 and not inner >> u.idx & 1 for u in g.users(n.idx))
    ]
    return inner if exits and all(strip(g, e, SHAPE_ONLY) in outputs for e in exits) else 0


# ----------------------------------------------------------------------------- the connector
def _by_param(g: Graph, n: Node) -> bool:
    from ..analysis.walk import strip

    return any(g.nodes[strip(g, i, SHAPE_ONLY)].op == "param" for i in n.inputs)


def _widens_rows(nodes: list[Node], width: int) -> bool:
    """Rows of ``width`` regrouped into rows of k * width (same elements, wider rows: a patch merger, a pixel
    shuffle, an unfold)."""
    widest = max(
        (n.shape[-1] for n in nodes if (n.op in SHAPES or n.op in ("unfold", "t")) and n.shape and n.inputs),
        default=0,
    )
    return widest > width and widest % width == 0


def _attends(g: Graph, nodes: list[Node]) -> bool:
    """An attention: a fused attention call, or a softmax over a product of two activations (q k^T), reached back
    from the softmax through reshapes, scalings and mask additions (a few ops at most)."""
    from ..analysis.walk import strip

    for n in nodes:
        if n.op in ATTENTION_CALLS:
            return True
        if n.op != "softmax" or not n.inputs:
            continue
        frontier = [n.inputs[0]]
        for _ in range(4):
            srcs = [g.nodes[strip(g, i, SHAPE_ONLY)] for i in frontier]
            for src in srcs:
                acts = [i for i in src.inputs if g.nodes[strip(g, i, SHAPE_ONLY)].op != "param"]
                if src.op in ("matmul", "bmm", "einsum", "baddbmm") and acts:
                    return True
            frontier = [i for src in srcs if src.op in _SCORE_STEPS for i in src.inputs]
    return False


def _soft_tokens(g: Graph, nodes: list[Node]) -> bool:
    """A softmax over a projection by a parameter whose output is multiplied by a parameter table."""
    from ..analysis.walk import strip

    for n in nodes:
        if n.op == "softmax" and n.inputs and _by_param(g, g.nodes[strip(g, n.inputs[0], SHAPE_ONLY)]):
            later = [m for m in nodes if m.idx > n.idx and g.feeds(n.idx, m.idx)]
            if any(m.op in ("matmul", "mm", "einsum") and _by_param(g, m) for m in later):
                return True
    return False


def _output_scale(g: Graph, entry: int, bits: int) -> float | None:
    """A constant multiplying the connector's output, walking back from the entry through views and casts."""
    from ..analysis.walk import scalar_mul, strip

    scale, cur = 1.0, strip(g, entry, SHAPE_ONLY)
    while bits >> cur & 1 and (sm := scalar_mul(g, g.nodes[cur])) is not None:
        scale *= sm[1]
        cur = strip(g, sm[0], SHAPE_ONLY)
    return scale if scale != 1.0 else None


def connector_info(g: Graph, gi: Graph, bits: int, tap: int | None, entries: list[int], tokens: bool) -> ConnectorInfo:
    """The connector between ``tap`` and ``entries`` (``bits``: its nodes; ``gi``: the image part's graph, whose
    norms inside ``bits`` are its norms); ``tokens``: the image reaches the entries as discrete ids."""
    nodes = [n for n in g.nodes if bits >> n.idx & 1]
    inside = [s for s in find_sites(gi) if bits >> s.node & 1]
    ops = {n.op for n in nodes}
    shape = g.nodes[tap].shape if tap is not None else None
    width = shape[-1] if shape else 0
    main = max(entries, key=lambda e: (_floating(g, e), e))
    rows = (_rows(g.nodes[tap].shape) if tap is not None else None, _rows(g.nodes[_row_value(g, main)].shape))
    info = ConnectorInfo(
        ConnectorKind.NONE,
        norms=[s.operator for s in inside],
        norm_widths=[s.size for s in inside],
        projections=sum(1 for n in nodes if (n.op in PROJECTIONS or n.op == "matmul") and _by_param(g, n)),
        activation=bool(ops & _ACTIVATIONS),
        tokens_in=rows[0],
        tokens_out=rows[1],
        scale=_output_scale(g, main, bits),
        modules=sorted({n.module for n in nodes if n.module}),
    )
    if tokens:
        info.kind = ConnectorKind.VQ_TOKENS
    elif _attends(g, nodes):
        info.kind = ConnectorKind.RESAMPLER
    elif _soft_tokens(g, nodes):
        info.kind = ConnectorKind.SOFT_TOKENS
    elif ops & _POOLS:
        info.kind = ConnectorKind.POOLING
    elif width and (_widens_rows(nodes, width) or (rows[0] and rows[1] and rows[0] >= 2 * rows[1])):
        info.kind = ConnectorKind.PATCH_MERGER  # regrouped rows, or k rows into one by a strided projection
    elif info.projections >= 2 and info.activation:
        info.kind = ConnectorKind.MLP
    elif info.projections >= 1:
        info.kind = ConnectorKind.LINEAR
    if info.kind in (ConnectorKind.PATCH_MERGER, ConnectorKind.POOLING) and rows[0] and rows[1]:
        info.row_merge = rows[0] // rows[1]
    return info


# ----------------------------------------------------------------------------- the language model
def image_key_norms(g: Graph, text: int, image: int, stream_bit: int) -> list[tuple[int, int | None, list[Site]]]:
    """The language model's attention cores whose keys are computed from the image alone (cross-attention), each
    as (its position among the language model's cores in execution order, its head width, the norms on its keys
    that run in the image part: Mllama's ``k_norm``). ``text``: the bitset of the text embedding's descendants
    (every core of the language model reads one); ``image``: the image part's bitset."""
    from .attention import find_cores, trig_bits

    cores = [c for c in find_cores(g, find_sites(g), stream_bit, set(), trig_bits(g)) if text >> c.node & 1]
    out = []
    for i, core in enumerate(cores):
        if core.k >= 0 and image >> core.k & 1 and not image >> core.q & 1:
            keys = [s for s, _ in core.norms["k"] if image >> s.node & 1]
            if keys:
                out.append((i, core.head_dim, keys))
    return out


def injection_of(g: Graph, gl: Graph, text: int, entries: list[int], tokens: bool) -> Injection:
    """How the image reaches the language model (``gl``; ``text``: the text embedding's node)."""
    from .residual import find_stream

    if tokens:
        return Injection.TOKENS
    stream = find_stream(gl, find_sites(gl))
    first = stream.sublayers[0].source if stream.sublayers else None
    if first is not None and any(g.feeds(e, first) for e in entries):
        return Injection.EMBEDDING_STREAM
    lm = desc(g, text)
    gated = any(
        n.op == "tanh"
        and n.inputs
        and g.nodes[n.inputs[0]].op == "param"
        and any(lm >> u.idx & 1 for u in g.users(n.idx))
        for n in g.nodes
    )  # a tanh of a parameter scaling a language-model value: Flamingo's gate
    return Injection.GATED_CROSS_ATTENTION if gated else Injection.CROSS_ATTENTION
