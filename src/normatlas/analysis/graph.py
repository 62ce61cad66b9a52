"""The recorder: a model's executed dataflow, one node per torch call (the fine view).

Method: run the model once under a :class:`torch.overrides.TorchFunctionMode` that sees
every torch call at the level the model's own code wrote it (``x.pow(2).mean(-1)``,
``F.layer_norm``, ``torch.rsqrt``, ``a + b``; nested calls inside a recorded call are not
seen, so ``F.layer_norm`` is one node). Forward pre/post hooks on every module record each
module invocation as a :class:`Span` (its path, the nodes it read and returned, the range
of nodes recorded inside it) and keep the module path of each node as a *label* only.

* :func:`record` returns the fine :class:`Graph`: one :class:`Node` per torch call, one
  node per tensor *value*. Tensors are identified by object identity (kept alive for the
  run, so identities are never reused) plus a version: an in-place write makes a new node
  whose ``prev`` is the node it overwrote. Parameters, buffers and model inputs are leaves.
The coarse view (one call per parameter-owning module) is :mod:`.flow`.

Guaranteed property: both views are the dataflow of the run that happened (like
``torch.jit.trace``; data-dependent control flow is recorded as taken), so every answer is
a fact about the executed computation, never a guess from parameter or class names. Unlike
``torch.fx`` / ``torch.export`` no symbolic tracing is needed: every model that runs eagerly
can be recorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..backend import reference_only
from .ops import op_name

__all__ = ["LEAVES", "Graph", "Node", "Ref", "Span", "record"]

LEAVES = frozenset({"input", "param", "buffer", "leaf"})
_NO_TENSOR = frozenset({"get_shape", "get_dtype", "get_device", "size", "dim", "get_is_cuda", "numel"})
_LIKE_OTHER = frozenset({"to", "type_as"})  # a tensor argument after the first is read for its dtype / device


# ----------------------------------------------------------------------------- fine graph
@dataclass(frozen=True)
class Ref:
    """A tensor argument: the index of the node that produced it."""

    idx: int


@dataclass
class Node:
    """One recorded call (or a leaf: ``input``, ``param``, ``buffer``, ``leaf``)."""

    idx: int
    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: tuple[int, ...]
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    module: str
    scope: tuple[str, ...] = ()
    value: torch.Tensor | None = field(default=None, repr=False)
    label: str = ""  # parameter/buffer path, for reports only
    prev: int | None = None  # the node this one overwrote in place (same tensor object)

    @property
    def scalar(self) -> float | None:
        """The value of a one-element tensor node, else None."""
        if self.value is not None and self.value.numel() == 1 and self.value.is_floating_point():
            return float(self.value.detach().reshape(()).item())
        return None

    @property
    def scalar_args(self) -> bool:
        """Every non-tensor operand is a Python number (so a mul/div is a scaling by a constant)."""
        flat, _ = tree_flatten((self.args, self.kwargs))
        return all(isinstance(a, (int, float)) for a in flat if not isinstance(a, Ref))


@dataclass
class Span:
    """One module invocation: nodes ``start <= idx < end`` were recorded inside it."""

    name: str
    module: nn.Module
    parent: int | None  # index of the enclosing span
    start: int
    inputs: tuple[int, ...]
    end: int = -1
    outputs: tuple[int, ...] = ()


@dataclass
class Graph:
    """The fine recorded graph: every torch call at the level the model wrote it."""

    nodes: list[Node]
    outputs: tuple[int, ...]
    list_children: frozenset[str]  # module paths that are elements of an nn.ModuleList
    spans: list[Span] = field(default_factory=list)
    tensors: dict[int, Tensor] = field(default_factory=dict, repr=False)
    model: nn.Module | None = field(default=None, repr=False)
    consumers: dict[int, list[int]] = field(default_factory=dict)
    _anc: dict[int, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for n in self.nodes:
            for i in n.inputs:
                self.consumers.setdefault(i, []).append(n.idx)

    def anc(self, idx: int) -> int:
        """Ancestor set of node ``idx`` as a bitset (bit j set: node j feeds it)."""
        if idx in self._anc:
            return self._anc[idx]
        for n in self.nodes[: idx + 1]:  # execution order: inputs always precede
            if n.idx not in self._anc:
                bits = 0
                for i in n.inputs:
                    bits |= self._anc[i] | (1 << i)
                self._anc[n.idx] = bits
        return self._anc[idx]

    def feeds(self, a: int, b: int) -> bool:
        """True when node ``a`` is an ancestor of node ``b``."""
        return bool(self.anc(b) >> a & 1)

    def users(self, idx: int) -> list[Node]:
        return [self.nodes[j] for j in self.consumers.get(idx, [])]


class _Recorder(TorchFunctionMode):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.nodes: list[Node] = []
        self.by_id: dict[int, int] = {}
        self.tensors: dict[int, Tensor] = {}
        self.scope: list[str] = [""]
        self.spans: list[Span] = []
        self.open: list[int] = []
        self.leaf_names: dict[int, tuple[str, str]] = {}
        for name, p in model.named_parameters():
            self.leaf_names[id(p)] = ("param", name)
        for name, b in model.named_buffers():
            self.leaf_names[id(b)] = ("buffer", name)

    def new(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: tuple[int, ...], out: Any) -> int:
        t = out if isinstance(out, Tensor) else None
        idx = len(self.nodes)
        small = t is not None and t.numel() <= 1
        node = Node(idx, op, args, kwargs, inputs, None, None, self.scope[-1], tuple(self.scope))
        if t is not None:
            node.shape, node.dtype = tuple(t.shape), t.dtype
            node.value = t.detach().clone() if small else None
            node.prev = self.by_id.get(id(t))
            self.by_id[id(t)] = idx
            self.tensors[idx] = t  # also keeps the object alive, so ids are never reused
        self.nodes.append(node)
        return idx

    def ref(self, t: Tensor) -> int:
        got = self.by_id.get(id(t))
        if got is not None:
            return got
        kind, name = self.leaf_names.get(id(t), ("leaf", ""))
        idx = self.new(kind, (), {}, (), t)
        self.nodes[idx].label = name
        return idx

    def convert(self, obj: Any, refs: list[int]) -> Any:
        if isinstance(obj, Tensor):
            r = self.ref(obj)
            refs.append(r)
            return Ref(r)
        if isinstance(obj, tuple):
            return type(obj)(self.convert(o, refs) for o in obj)
        if isinstance(obj, list):
            return [self.convert(o, refs) for o in obj]
        if isinstance(obj, dict):
            return {k: self.convert(v, refs) for k, v in obj.items()}
        return obj

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = op_name(func)
        if op in _NO_TENSOR:
            return out
        refs: list[int] = []
        a = self.convert(tuple(args), refs)
        k = {key: self.convert(v, refs) for key, v in kwargs.items()}
        if op in _LIKE_OTHER:  # x.to(other) / x.type_as(other): other gives a dtype and device, not a value
            refs = refs[:1]
        if isinstance(out, Tensor):
            self.new(op, a, k, tuple(refs), out)
        elif isinstance(out, (tuple, list)) and any(isinstance(o, Tensor) for o in out):
            parent = self.new(op, a, k, tuple(refs), None)
            for i, o in enumerate(out):
                if isinstance(o, Tensor):
                    self.new("item_of", (Ref(parent), i), {}, (parent,), o)
        return out

    def enter(self, name: str, mod: nn.Module, args: Any, kwargs: Any) -> None:
        ins = tuple(self.ref(t) for t in _tensors((args, kwargs)))
        self.spans.append(Span(name, mod, self.open[-1] if self.open else None, len(self.nodes), ins))
        self.open.append(len(self.spans) - 1)
        self.scope.append(name)

    def leave(self, out: Any) -> None:
        self.scope.pop()
        span = self.spans[self.open.pop()]
        span.outputs = tuple(self.ref(t) for t in _tensors(out))
        span.end = len(self.nodes)


def _tensors(obj: Any) -> list[Tensor]:
    if hasattr(obj, "to_tuple"):
        obj = obj.to_tuple()
    leaves, _ = tree_flatten(obj)
    return [t for t in leaves if isinstance(t, Tensor)]


def _eager_compiled() -> contextlib.AbstractContextManager[None]:
    stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


def record(model: nn.Module, example_inputs: Any, kwargs: dict[str, Any] | None = None) -> Graph:
    """Run ``model`` once on ``example_inputs`` (a tensor, a tuple/list of positional arguments or a
    kwargs dict; ``kwargs`` adds keyword arguments to positional ones) under ``torch.no_grad`` and
    return the fine :class:`Graph` of what ran."""
    rec = _Recorder(model)
    list_children = frozenset(
        f"{parent}.{child}" if parent else child
        for parent, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList)
        for child, _ in mod.named_children()
    )

    def pre(name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any, kwargs: Any) -> None:
            rec.enter(name, mod, args, kwargs)

        return hook

    def post(mod: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        rec.leave(out)

    handles = []
    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True, always_call=True))
    inputs, extra = example_inputs, kwargs or {}
    for t in _tensors((inputs, extra)):
        rec.nodes[rec.ref(t)].op = "input"
    try:  # our own norms run their torch ops, for the recorder to see; compiled code (transformers' flex
        # attention) runs its Python eagerly, the same computation, so that every call is recorded
        with torch.no_grad(), reference_only(), _eager_compiled(), rec:
            if isinstance(inputs, dict):
                out = model(**inputs, **extra)
            elif isinstance(inputs, (tuple, list)):
                out = model(*inputs, **extra)
            else:
                out = model(inputs, **extra)
    finally:
        for h in handles:
            h.remove()
    outs = tuple(rec.by_id[id(t)] for t in _tensors(out) if id(t) in rec.by_id)
    return Graph(rec.nodes, outs, list_children, rec.spans, rec.tensors, model)
