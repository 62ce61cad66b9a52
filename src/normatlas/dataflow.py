"""Record a model's executed dataflow once, and read it at two granularities.

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
* :func:`collapse` returns the coarse :class:`Dataflow`: every invocation of a module that
  owns parameters directly (a linear layer, an embedding, a norm; or any chosen set) is one
  opaque :class:`Call`, every visible torch call outside them is an op call. Its queries
  (the consumers of a norm, the writers of a residual stream, projection -> norm paths)
  look through the value-preserving op sets :data:`PASS_THROUGH`, :data:`SHAPE_ONLY` and
  :data:`ROW_PRESERVING`.

Guaranteed property: both views are the dataflow of the run that happened (like
``torch.jit.trace``; data-dependent control flow is recorded as taken), so every answer is
a fact about the executed computation, never a guess from parameter or class names. Unlike
``torch.fx`` / ``torch.export`` no symbolic tracing is needed: every model that runs eagerly
can be recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .backend import reference_only

__all__ = [
    "PASS_THROUGH",
    "ROW_PRESERVING",
    "SHAPE_ONLY",
    "Call",
    "Dataflow",
    "Graph",
    "Node",
    "Ref",
    "Span",
    "collapse",
    "op_name",
    "record",
]

_RENAME = {
    "radd": "add",
    "iadd": "add",
    "rmul": "mul",
    "imul": "mul",
    "multiply": "mul",
    "truediv": "div",
    "true_divide": "div",
    "itruediv": "div",
    "idiv": "div",  # Tensor.__itruediv__.__name__ is "__idiv__"
    "divide": "div",
    "rtruediv": "rdiv",
    "subtract": "sub",
    "isub": "sub",
    "rmatmul": "matmul",
}
_LEAVES = frozenset({"input", "param", "buffer", "leaf"})
_NO_TENSOR = frozenset({"get_shape", "get_dtype", "get_device", "size", "dim", "get_is_cuda", "numel"})

# ops (canonical names, see :func:`op_name`) that hand their input on unchanged in value (eval mode)
PASS_THROUGH = frozenset({"dropout", "contiguous", "clone", "detach", "to", "float", "type_as", "alias", "identity"})
# ops that only rearrange elements within a token (no arithmetic)
SHAPE_ONLY = PASS_THROUGH | {"view", "reshape", "transpose", "permute", "unflatten", "flatten", "unsqueeze"}
# ops that may keep every row (last-dim vector) intact: pass-through when the last dim is unchanged
ROW_PRESERVING = frozenset({"view", "reshape", "getitem", "flatten", "unflatten", "squeeze", "unsqueeze"})
_ADD = frozenset({"add"})
_SCALAR_SCALE = frozenset({"mul", "div"})


def op_name(func: Callable[..., Any]) -> str:
    """Canonical name of a torch call: dunders and the in-place ``_`` stripped, aliases merged
    (``__radd__``/``add_`` -> ``add``, ``true_divide`` -> ``div``), attribute reads as ``get_<attr>``."""
    name = getattr(func, "__name__", None) or str(func)
    if name == "__get__":  # attribute access: Tensor.T, .mT, .data, .real
        owner = getattr(func, "__self__", None)
        name = "get_" + str(getattr(owner, "__name__", "attr"))
    name = name.strip("_")
    if name.endswith("_") and name not in ("", "_"):
        name = name.rstrip("_")
    return _RENAME.get(name, name)


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
    try:
        with torch.no_grad(), reference_only(), rec:  # our own norms run their torch ops, for the recorder to see
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


# ----------------------------------------------------------------------------- coarse view
Key = int  # a tensor value: the node that produced it (or a fresh key for a module's pass-through output)


@dataclass
class Call:
    """One step of the coarse view: an opaque module invocation (``module`` set) or a torch op."""

    idx: int
    op: str
    module: str | None
    inputs: list[Key]
    outputs: list[Key]
    scalar_args: bool = False  # for mul/div: every non-tensor operand is a Python number

    @property
    def label(self) -> str:
        return self.module if self.module is not None else f"op#{self.idx}:{self.op}"


@dataclass
class Dataflow:
    """The coarse recorded graph with the questions asked of it (who reads and who writes what)."""

    model: nn.Module
    calls: list[Call] = field(default_factory=list)
    producer: dict[Key, int] = field(default_factory=dict)
    readers: dict[Key, list[int]] = field(default_factory=dict)
    tensors: dict[Key, Tensor] = field(default_factory=dict, repr=False)
    inputs: set[Key] = field(default_factory=set)
    outputs: set[Key] = field(default_factory=set)

    def add(self, op: str, module: str | None, inputs: list[Key], outputs: list[Key], scalar: bool) -> Call:
        call = Call(len(self.calls), op, module, inputs, outputs, scalar)
        self.calls.append(call)
        for k in inputs:
            self.readers.setdefault(k, []).append(call.idx)
        for k in outputs:
            self.producer[k] = call.idx
        return call

    # -- basic lookups -------------------------------------------------------------------
    def module_calls(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.module == name]

    def modules(self) -> list[str]:
        return list(dict.fromkeys(c.module for c in self.calls if c.module is not None))

    def tensor(self, key: Key) -> Tensor:
        """The recorded tensor for ``key`` (the object's latest value)."""
        return self.tensors[key]

    def submodule(self, name: str) -> nn.Module:
        return self.model.get_submodule(name)

    def _through(self, call: Call, ops: frozenset[str]) -> bool:
        return call.module is None and (call.op in ops or (call.op.startswith("get_") and ops >= PASS_THROUGH))

    def row_preserving(self, call: Call) -> bool:
        """True for a value-preserving op, or a reshape/slice that keeps the last dim (rows intact)."""
        if call.module is not None:
            return False
        if self._through(call, PASS_THROUGH):
            return True
        if call.op in ROW_PRESERVING and call.inputs and call.outputs:
            a, b = self.tensor(call.inputs[0]), self.tensor(call.outputs[0])
            return a.dim() > 0 and b.dim() > 0 and a.shape[-1] == b.shape[-1]
        return False

    def consumers(self, key: Key, through: frozenset[str] = PASS_THROUGH) -> list[Call]:
        """Every call reading ``key``, looking through value-preserving, row-preserving ops."""
        out: list[Call] = []
        stack, seen = [key], set()
        while stack:
            k = stack.pop()
            for r in self.readers.get(k, []):
                if r in seen:
                    continue
                seen.add(r)
                call = self.calls[r]
                if self._through(call, through) or self.row_preserving(call):
                    stack.extend(call.outputs)
                else:
                    out.append(call)
        return out

    def producer_of(self, key: Key, through: frozenset[str] = PASS_THROUGH) -> Call | None:
        """The call that produced ``key``, looking back through value-preserving ops."""
        while key in self.producer:
            call = self.calls[self.producer[key]]
            if (self._through(call, through) or self.row_preserving(call)) and call.inputs:
                key = call.inputs[0]
                continue
            return call
        return None

    def escapes(self, key: Key) -> bool:
        """True when ``key`` (or a pass-through alias of it) is a model output."""
        stack, seen = [key], set()
        while stack:
            k = stack.pop()
            if k in self.outputs:
                return True
            if k in seen:
                continue
            seen.add(k)
            for r in self.readers.get(k, []):
                call = self.calls[r]
                if self.row_preserving(call):
                    stack.extend(call.outputs)
        return False

    def _shape_only_readers(self, key: Key) -> Iterable[Call | None]:
        """Every reader past shape-only ops (None for reaching a model output)."""
        stack, seen = [key], set()
        while stack:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            if k in self.outputs:
                yield None
            for r in self.readers.get(k, []):
                call = self.calls[r]
                if self._through(call, SHAPE_ONLY):
                    stack.extend(call.outputs)
                else:
                    yield call

    def reaches_norm(self, key: Key, norms: Iterable[str]) -> str | None:
        """The norm module ``key`` flows into through shape-only ops (view/transpose/...), if every
        path ends there; None when any path reaches anything else first."""
        targets, found = set(norms), set()
        for call in self._shape_only_readers(key):
            if call is None or call.module not in targets:
                return None
            found.add(call.module)
        return next(iter(found)) if len(found) == 1 else None

    def first_non_shape_reader(self, key: Key) -> str:
        """A readable name for what first reads ``key`` past shape-only ops (for refusal reasons)."""
        return next((c.label for c in self._shape_only_readers(key) if c is not None), "the model output")

    def stream(self, key: Key) -> tuple[set[Key], list[Key]]:
        """Expand ``key`` backwards through residual adds, value-preserving ops and scalings by a
        Python number. Returns (stream tensors, leaf tensors: the writers' outputs)."""
        tensors: set[Key] = set()
        leaves: list[Key] = []
        stack = [key]
        while stack:
            k = stack.pop()
            if k in tensors:
                continue
            tensors.add(k)
            idx = self.producer.get(k)
            call = self.calls[idx] if idx is not None else None
            if (
                call is not None
                and call.module is None
                and (
                    call.op in _ADD
                    or self.row_preserving(call)
                    or (call.op in _SCALAR_SCALE and call.scalar_args and len(call.inputs) == 1)
                )
            ):
                stack.extend(call.inputs)
            else:
                leaves.append(k)
        return tensors, leaves


def owns_parameters(name: str, module: nn.Module) -> bool:
    """The default opaque set: every module but the root that holds parameters of its own."""
    return bool(name) and next(module.parameters(recurse=False), None) is not None


def collapse(graph: Graph, opaque: Callable[[str, nn.Module], bool] = owns_parameters) -> Dataflow:
    """The coarse view of ``graph``: each outermost invocation of a module for which
    ``opaque(name, module)`` holds is one :class:`Call` (what ran inside is hidden); every other
    torch call is an op call. A module that hands back a tensor it did not produce (its input,
    unchanged) gets a fresh key for it, as an in-place write would."""
    if graph.model is None:
        raise ValueError("graph must come from record() (graph.model is None)")
    flow = Dataflow(graph.model, tensors=dict(graph.tensors))
    chosen: dict[int, bool] = {}
    outer: list[Span] = []
    for i, s in enumerate(graph.spans):
        hidden = s.parent is not None and chosen[s.parent]
        chosen[i] = hidden or opaque(s.name, s.module)
        if chosen[i] and not hidden:
            outer.append(s)
    nodes = graph.nodes
    hidden_at = [False] * len(nodes)
    for s in outer:
        for j in range(s.start, s.end):
            hidden_at[j] = True
        for j in s.outputs:
            if s.start <= j < s.end:
                hidden_at[j] = False
    alias: dict[int, Key] = {}

    def key(n: int) -> Key:
        while hidden_at[n] and nodes[n].prev is not None:  # a write hidden in a module, not returned
            n = nodes[n].prev  # type: ignore[assignment]
        return alias.get(n, n)

    items: dict[int, list[int]] = {}
    for n in nodes:
        if n.op == "item_of":
            items.setdefault(n.inputs[0], []).append(n.idx)
    fresh = len(nodes)
    i = si = 0
    while i < len(nodes) or si < len(outer):
        if si < len(outer) and (i >= len(nodes) or outer[si].start <= i):
            s = outer[si]
            ins = [key(j) for j in s.inputs]
            outs: list[Key] = []
            for j in s.outputs:
                if s.start <= j < s.end:
                    outs.append(j)
                else:  # returned a tensor that existed before the call: a new value of it
                    alias[key(j)] = fresh
                    flow.tensors[fresh] = graph.tensors[j]
                    outs.append(fresh)
                    fresh += 1
            flow.add("module", s.name, ins, outs, False)
            i, si = max(i, s.end), si + 1
            continue
        n = nodes[i]
        i += 1
        if n.op in _LEAVES or n.op == "item_of" or hidden_at[n.idx]:
            continue
        outs = [n.idx] if n.shape is not None else items.get(n.idx, [])
        flow.add(n.op, None, [key(j) for j in n.inputs], outs, n.scalar_args)
    flow.inputs = {key(n.idx) for n in nodes if n.op == "input"}
    flow.outputs = {key(j) for j in graph.outputs}
    return flow
