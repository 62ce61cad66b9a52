"""What the tools need to know about a model, read off one recorded forward pass (structure only, never names).

The inspector's phases (:mod:`normatlas.inspect`) give the residual stream, its sublayers grouped into layers,
the norms around them and the final norm. From them, :func:`read_model` derives:

* **the layers**: for each layer, the module invocation that runs it (the innermost ``nn.ModuleList`` element
  holding all of its residual adds), the stream value entering it and the one leaving it (its last add, or its
  post-norm's output in a Post-LN layer), and where each sits among that module's tensor inputs and outputs, so
  hooks can read and replace them on later runs;
* **the tail**: the modules run after the last layer on the way to the first output (the final norm, a head
  transform, the head), each a call on one tensor, with the constant scalings between them and the
  ``c * tanh(x / c)`` soft-cap after them. :func:`read_model` calls the tail on the recorded last stream value
  and requires the recorded output back exactly; a model whose tail is anything else is refused by what it is.

Module paths are used as handles (to hook a module the dataflow pointed at), never to decide what anything is.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from ..analysis.graph import Graph, Span, record
from ..analysis.ops import CASTS, SHAPE_ONLY, SPLITS
from ..analysis.walk import scalar_mul, scale_back, strip
from ..inspect.attention import find_cores, trig_bits
from ..inspect.norms import Site, find_sites
from ..inspect.residual import final_norm, find_stream, place_norms
from ..surgery.verify import model_inputs

__all__ = [
    "Layer",
    "NoHead",
    "Reading",
    "ToolError",
    "capture_stream",
    "finish_figure",
    "model_inputs",
    "read_model",
    "skipping",
    "tensors_of",
]


class ToolError(ValueError):
    """The model has no structure the tool needs (said in words: what was found instead)."""


class NoHead(ToolError):
    """The model's first output is its residual stream itself (an encoder without an LM / MLM head)."""


def tensors_of(obj: Any) -> list[Tensor]:
    """The tensors of a module's arguments or output, in the order the recorder saw them."""
    if hasattr(obj, "to_tuple"):
        obj = obj.to_tuple()
    leaves, _ = tree_flatten(obj)
    return [t for t in leaves if isinstance(t, Tensor)]


@dataclass(frozen=True)
class Layer:
    """One layer: the module that runs it, the stream values around it and their places in its call."""

    index: int
    module: str  # the module's path (a handle for hooks)
    source: int  # the stream value entering the layer (a graph node)
    output: int  # the stream value leaving it
    arg: int  # the stream's position among the module's tensor inputs
    out: int  # and among its tensor outputs


@dataclass
class Reading:
    """The layers and the tail of one model, with the graph they were read from."""

    graph: Graph
    layers: list[Layer]
    final: Site | None  # the final norm (None: a Post-LN model ends in its last layer's post-norm)
    tail: list[str] = field(default_factory=list)  # module paths, in call order
    tail_scales: list[float] = field(default_factory=list)  # the constant multiplying each tail module's input
    norm_at: int | None = None  # the tail module that is the final norm (its output is the norm's output)
    logit_scale: float = 1.0
    softcap: float | None = None

    @property
    def last(self) -> int:
        return self.layers[-1].output

    def decode(self, model: nn.Module, h: Tensor, gain: Tensor | None = None) -> Tensor:
        """The logits the model's own tail makes of stream value ``h``; ``gain`` multiplies the final norm's
        output (the tuned lens's refit gain: the norm's gain becomes ``gain * w``)."""
        x = h
        for i, (path, s) in enumerate(zip(self.tail, self.tail_scales, strict=True)):
            x = tensors_of(model.get_submodule(path)(x * s if s != 1.0 else x))[0]
            if gain is not None and i == self.norm_at:
                x = x * gain.to(x.dtype)
        if self.logit_scale != 1.0:
            x = x * self.logit_scale
        if self.softcap is not None:
            x = torch.tanh(x / self.softcap) * self.softcap
        return x


def _same(g: Graph, a: int, b: int) -> bool:
    return a == b or strip(g, a, SHAPE_ONLY) == strip(g, b, SHAPE_ONLY)


def _layer_module(g: Graph, adds: list[int]) -> str | None:
    """The innermost ``nn.ModuleList`` element every add of a layer runs in."""
    scopes = [g.nodes[a].scope for a in adds]
    common = [p for p in scopes[0] if p in g.list_children and all(p in s for s in scopes[1:])]
    return common[-1] if common else None


def _layers(g: Graph, subs: Sequence[Any]) -> list[Layer]:
    by_layer: dict[int, list[Any]] = {}
    for sub in subs:
        by_layer.setdefault(sub.layer, []).append(sub)
    spans = {s.name: s for s in reversed(g.spans)}  # a module's first invocation
    layers: list[Layer] = []
    for i, (_, group) in enumerate(sorted(by_layer.items())):
        source = group[0].source
        end = group[-1]
        output = end.post[-1].output if end.post else end.adds[-1]
        path = _layer_module(g, [a for sub in group for a in sub.adds])
        span = spans.get(path) if path is not None else None
        if path is None or span is None:
            raise ToolError(f"layer {i} does not run inside one element of a layer list (nn.ModuleList)")
        arg = next((k for k, n in enumerate(span.inputs) if _same(g, n, source)), None)
        out = next((k for k, n in enumerate(span.outputs) if _same(g, n, output)), None)
        if arg is None or out is None:
            raise ToolError(f"layer {i} ({path}) does not take the stream as an input and return it as an output")
        layers.append(Layer(i, path, source, output, arg, out))
    if len({layer.module for layer in layers}) != len(layers):
        raise ToolError("several layers run one module (weights shared across depth): a layer cannot be hooked alone")
    return layers


def finish_figure(
    fig: Any,
    path: str | os.PathLike[str],
    caption: str,
    *,
    title: str | None = None,
    wrap: int = 160,
    bottom: float = 0.04,
    top: float = 0.95,
) -> None:
    """The tools' figures' one ending: ``title`` (wrapped at 90 characters) on top, ``caption`` (wrapped at
    ``wrap``) at the foot with ``bottom`` of the height kept for it, laid out below ``top``; saved at 110 dpi and
    closed."""
    import matplotlib.pyplot as plt

    if title is not None:
        fig.suptitle("\n".join(textwrap.wrap(title, 90)), fontsize=9)
    if caption:
        fig.text(0.01, 0.005, "\n".join(textwrap.wrap(caption, wrap)), fontsize=6.5, va="bottom")
    fig.tight_layout(rect=(0, bottom if caption else 0, 1, top))
    fig.savefig(os.fspath(path), dpi=110)
    plt.close(fig)


def _walk_back(g: Graph, start: int, stop: int) -> float | None:
    """The constant multiplying ``stop`` on its way to ``start`` (through views and casts); None: other ops."""
    scale, reached = scale_back(g, start, lambda cur: _same(g, cur, stop))
    return scale if reached else None


def _logit_ends(g: Graph, cur: int, out: int) -> tuple[float, float | None]:
    """(constant scale, tanh soft-cap) between the tail's last module and the first output."""
    scale, cap = 1.0, None
    while not _same(g, cur, out):
        nxt = [u for u in g.users(cur) if u.idx == out or g.feeds(u.idx, out)]
        if len(nxt) != 1:
            raise ToolError("the logits branch after the head")
        u = nxt[0]
        sm = scalar_mul(g, u)
        if sm is not None and sm[0] == cur:
            if cap is None:
                scale *= sm[1]
        elif u.op == "tanh" and u.inputs:
            pre = scalar_mul(g, g.nodes[u.inputs[0]])
            if pre is None:
                raise ToolError("a tanh on the logits that is not a c * tanh(x / c) soft-cap")
            cap = 1.0 / pre[1]
            scale /= pre[1]
        elif not (u.op in SHAPE_ONLY or u.op in SPLITS or u.op in CASTS):
            raise ToolError(f"an op ({u.op}) between the head and the logits that is not a module")
        cur = u.idx
    return scale, cap


def _tail(g: Graph, last: int) -> tuple[list[Span], list[float], float, float | None]:
    out = g.outputs[0] if g.outputs else None
    if out is None:
        raise ToolError("the model returned no tensor")
    if _same(g, out, last):
        raise NoHead(
            "the model's first output is its residual stream itself (an encoder without an LM or MLM head): there "
            "is no head to decode a layer's stream through"
        )
    cands = [
        i
        for i, s in enumerate(g.spans)
        if s.start > last
        and s.outputs
        and (_same(g, s.outputs[0], out) or g.feeds(s.outputs[0], out))
        and any(i == last or g.feeds(last, i) for i in s.inputs)
    ]
    keep = set(cands)

    def nested(i: int) -> bool:
        p = g.spans[i].parent
        while p is not None:
            if p in keep:
                return True
            p = g.spans[p].parent
        return False

    chain = [g.spans[i] for i in sorted(cands, key=lambda i: g.spans[i].start) if not nested(i)]
    if not chain:
        raise ToolError("no module runs between the last layer and the logits (the head is not a module)")
    scales, cur = [], last
    for s in chain:
        x = next((i for i in s.inputs if i == cur or g.feeds(cur, i)), None)
        scale = _walk_back(g, x, cur) if x is not None else None
        if scale is None:
            raise ToolError(f"{s.name or 'a module'} on the way to the logits reads more than the stream")
        scales.append(scale)
        cur = s.outputs[0]
    return chain, scales, *_logit_ends(g, cur, out)


def read_model(model: nn.Module, ids: Tensor, *, head: bool = True) -> Reading:
    """Read the layers and the tail of ``model`` (a transformers LM or encoder) on token ids ``ids`` (B, T).
    ``head=False`` accepts a model without a head (:class:`NoHead`): its tail is then empty."""
    model = model.eval()
    g = record(model, model_inputs(model, ids))
    sites = find_sites(g)
    stream = find_stream(g, sites)
    subs = stream.sublayers
    if not subs:
        raise ToolError("no residual stream with sublayers was found")
    stream_inputs = {strip(g, s.source, SHAPE_ONLY) for s in subs} | {strip(g, s.adds[-1], SHAPE_ONLY) for s in subs}
    cores = find_cores(g, sites, 1 << subs[0].source, stream_inputs, trig_bits(g))
    place_norms(g, stream, sum(1 << c.node for c in cores), {})
    final = final_norm(g, stream)
    layers = _layers(g, subs)
    if final is not None and subs[-1].post and final in subs[-1].post:
        final = None  # the last layer's post-norm (Post-LN): part of the layer, not a final norm
    reading = Reading(g, layers, final)
    try:
        chain, scales, reading.logit_scale, reading.softcap = _tail(g, reading.last)
    except NoHead:
        if head:
            raise
        return reading
    reading.tail, reading.tail_scales = [s.name for s in chain], scales
    if final is not None:
        reading.norm_at = next(
            (k for k, s in enumerate(chain) if s.start <= final.node < s.end and _same(g, s.outputs[0], final.output)),
            None,
        )
    with torch.no_grad():
        got = reading.decode(model, g.tensors[reading.last])
    want = g.tensors[g.outputs[0]]
    if got.shape != want.shape or not torch.equal(got, want):
        diff = float((got.double() - want.double()).abs().max()) if got.shape == want.shape else math.inf
        raise ToolError(
            f"calling the tail ({', '.join(reading.tail)}) on the last stream value does not reproduce the logits "
            f"(max abs diff {diff:.3g}); the lens would not decode what the model decodes"
        )
    return reading


@contextmanager
def capture_stream(model: nn.Module, reading: Reading) -> Iterator[list[Tensor]]:
    """Inside the block, every forward of ``model`` fills the yielded list with the stream entering layer 0 and
    leaving each layer (``len(layers) + 1`` tensors; emptied at the start of each forward)."""
    found: list[Tensor] = []
    handles = []
    first = model.get_submodule(reading.layers[0].module)

    def pre(mod: nn.Module, args: Any, kwargs: Any) -> None:
        found.clear()
        found.append(tensors_of((args, kwargs))[reading.layers[0].arg])

    handles.append(first.register_forward_pre_hook(pre, with_kwargs=True))
    for layer in reading.layers:

        def post(mod: nn.Module, args: Any, output: Any, k: int = layer.out) -> None:
            found.append(tensors_of(output)[k])

        handles.append(model.get_submodule(layer.module).register_forward_hook(post))
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


def _replace(output: Any, k: int, value: Tensor) -> Any:
    """``output`` with its ``k``-th tensor replaced (a tensor, a tuple or list of tensors and other values)."""
    if isinstance(output, Tensor):
        return value
    if isinstance(output, (tuple, list)):
        seen, items = 0, []
        for o in output:
            if isinstance(o, Tensor):
                items.append(value if seen == k else o)
                seen += 1
            else:
                items.append(o)
        return type(output)(items)
    raise ToolError(f"a layer returns {type(output).__name__}, which a skip cannot rewrite")


def skipping(model: nn.Module, reading: Reading, drop: Sequence[int]) -> Callable[[], None]:
    """Make each layer in ``drop`` pass its stream input through unchanged (forward hooks on ``model``); returns
    the function that removes the hooks. The reference a pruned model is proven against."""
    handles = []
    for i in drop:
        layer = reading.layers[i]

        def hook(mod: nn.Module, args: Any, kwargs: Any, output: Any, layer: Layer = layer) -> Any:
            return _replace(output, layer.out, tensors_of((args, kwargs))[layer.arg])

        handles.append(model.get_submodule(layer.module).register_forward_hook(hook, with_kwargs=True))

    def remove() -> None:
        for h in handles:
            h.remove()

    return remove
