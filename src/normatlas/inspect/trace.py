"""Record a model's executed dataflow as a small graph, with no symbolic tracing.

Method: run the model once under a :class:`torch.overrides.TorchFunctionMode`
that sees every torch call at the level the model's own code wrote it
(``x.pow(2).mean(-1)``, ``F.layer_norm``, ``torch.rsqrt``, ``a + b``). Each call
becomes a :class:`Node` whose inputs are the nodes that produced its tensor
arguments; parameters, buffers and model inputs become leaf nodes. Forward
pre/post hooks on every module keep the module path of each call, used only as a
*label* in reports, never to decide what a node is.

Guaranteed property: the graph is the dataflow of the run that happened (like
``torch.jit.trace``): data-dependent control flow is recorded as taken. Nested
calls inside a recorded call are not recorded (``F.layer_norm`` is one node).
Unlike ``torch.fx`` / ``torch.export`` it needs no symbolic tracing, so it works
on every model that runs eagerly (HF models with data-dependent Python control
flow included); when even this fails, :mod:`.probe` falls back to module hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["Graph", "Node", "Ref", "record"]

_RENAME = {
    "radd": "add",
    "iadd": "add",
    "rmul": "mul",
    "imul": "mul",
    "multiply": "mul",
    "truediv": "div",
    "true_divide": "div",
    "itruediv": "div",
    "divide": "div",
    "rtruediv": "rdiv",
    "subtract": "sub",
    "isub": "sub",
    "matmul": "matmul",
    "rmatmul": "matmul",
    "getitem": "getitem",
}


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

    @property
    def scalar(self) -> float | None:
        """The value of a one-element tensor node, else None."""
        if self.value is not None and self.value.numel() == 1 and self.value.is_floating_point():
            return float(self.value.detach().reshape(()).item())
        return None


@dataclass
class Graph:
    nodes: list[Node]
    outputs: tuple[int, ...]
    list_children: frozenset[str]  # module paths that are elements of an nn.ModuleList
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
        # iterative, nodes are in execution order so inputs always precede
        for n in self.nodes[: idx + 1]:
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


def _op_name(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", None) or str(func)
    if name == "__get__":  # attribute access: Tensor.T, .mT, .data, .real
        owner = getattr(func, "__self__", None)
        name = "get_" + str(getattr(owner, "__name__", "attr"))
    name = name.strip("_")
    if name.endswith("_") and name not in ("", "_"):
        name = name.rstrip("_")
    return _RENAME.get(name, name)


class _Recorder(TorchFunctionMode):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.nodes: list[Node] = []
        self.by_id: dict[int, int] = {}
        self.keep: list[Any] = []
        self.scope: list[str] = [""]
        self.leaf_names: dict[int, tuple[str, str]] = {}
        for name, p in model.named_parameters():
            self.leaf_names[id(p)] = ("param", name)
        for name, b in model.named_buffers():
            self.leaf_names[id(b)] = ("buffer", name)

    def _new(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: tuple[int, ...], out: Any) -> int:
        t = out if isinstance(out, torch.Tensor) else None
        idx = len(self.nodes)
        small = t is not None and t.numel() <= 1
        self.nodes.append(
            Node(
                idx,
                op,
                args,
                kwargs,
                inputs,
                tuple(t.shape) if t is not None else None,
                t.dtype if t is not None else None,
                self.scope[-1],
                tuple(self.scope),
                value=t.detach().clone() if small and t is not None else None,
            )
        )
        if t is not None:
            self.by_id[id(t)] = idx
            self.keep.append(t)
        return idx

    def ref(self, t: torch.Tensor) -> int:
        got = self.by_id.get(id(t))
        if got is not None:
            return got
        kind, name = self.leaf_names.get(id(t), ("leaf", ""))
        idx = self._new(kind, (), {}, (), t)
        self.nodes[idx].label = name
        if kind == "leaf" and t.numel() <= 1:
            self.nodes[idx].value = t.detach().clone()
        return idx

    def _convert(self, obj: Any, refs: list[int]) -> Any:
        if isinstance(obj, torch.Tensor):
            r = self.ref(obj)
            refs.append(r)
            return Ref(r)
        if isinstance(obj, (list, tuple)):
            return (
                type(obj)(self._convert(o, refs) for o in obj)
                if isinstance(obj, tuple)
                else [self._convert(o, refs) for o in obj]
            )
        return obj

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = _op_name(func)
        if op in ("get_shape", "get_dtype", "get_device", "size", "dim", "get_is_cuda", "numel", "get_requires_grad"):
            return out
        refs: list[int] = []
        a = self._convert(tuple(args), refs)
        k = {key: self._convert(v, refs) for key, v in kwargs.items()}
        if isinstance(out, torch.Tensor):
            self._new(op, a, k, tuple(refs), out)
        elif isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
            parent = self._new(op, a, k, tuple(refs), None)
            for i, o in enumerate(out):
                if isinstance(o, torch.Tensor):
                    self._new("item_of", (Ref(parent), i), {}, (parent,), o)
        return out


def _flat_tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _flat_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _flat_tensors(v)
    elif hasattr(obj, "to_tuple"):
        yield from _flat_tensors(obj.to_tuple())


def record(model: nn.Module, example_inputs: Any) -> Graph:
    """Run ``model`` once on ``example_inputs`` (a tensor, tuple or kwargs dict) and record its dataflow."""
    rec = _Recorder(model)
    list_children = frozenset(
        f"{parent}.{child}" if parent else child
        for parent, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList)
        for child, _ in mod.named_children()
    )

    def enter(name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any) -> None:
            rec.scope.append(name)

        return hook

    def leave(mod: nn.Module, args: Any, out: Any) -> None:
        rec.scope.pop()

    handles = []
    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(enter(name)))
        handles.append(mod.register_forward_hook(leave, always_call=True))
    inputs = example_inputs
    for t in _flat_tensors(inputs):
        rec.ref(t)
        rec.nodes[rec.by_id[id(t)]].op = "input"
    try:
        with torch.no_grad(), rec:
            if isinstance(inputs, dict):
                out = model(**inputs)
            elif isinstance(inputs, (tuple, list)):
                out = model(*inputs)
            else:
                out = model(inputs)
    finally:
        for h in handles:
            h.remove()
    outs = tuple(rec.by_id[id(t)] for t in _flat_tensors(out) if id(t) in rec.by_id)
    return Graph(rec.nodes, outs, list_children)
