"""The coarse dataflow view: who reads and who writes what, one call per parameter-owning module.

Method: :func:`collapse` turns the recorder's fine :class:`~.graph.Graph` into a :class:`Dataflow`:
every outermost invocation of a module that owns parameters directly (a linear layer, an embedding,
a norm, a convolution; or any chosen set) is one opaque :class:`Call`, every visible torch call
outside them is an op call. Its queries (the consumers of a norm, the writers of a residual stream,
the path from a projection to a norm) look through the op table's value-preserving sets
(:mod:`.ops`). :func:`record_flow` records a model in eval mode and collapses it in one step.

Guaranteed property: every answer is a fact about the executed computation, never a guess from
parameter or class names. The only type checks are on the *operator* a module computes
(:func:`linear_kind`: ``nn.Linear``, transformers' ``Conv1D``, ``nn.Embedding``, ``nn.Conv*d``),
never on its role.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from .graph import LEAVES, Graph, Span, record
from .ops import ROW_PRESERVING, SHAPE_ONLY, VALUE_PRESERVING

__all__ = ["Call", "Dataflow", "Key", "collapse", "linear_kind", "owns_parameters", "record_flow"]

_ADD = frozenset({"add"})
_SCALAR_SCALE = frozenset({"mul", "div"})

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
        return call.module is None and (call.op in ops or (call.op.startswith("get_") and ops >= VALUE_PRESERVING))

    def row_preserving(self, call: Call) -> bool:
        """True for a value-preserving op, or a reshape/slice that keeps the last dim (rows intact)."""
        if call.module is not None:
            return False
        if self._through(call, VALUE_PRESERVING):
            return True
        if call.op in ROW_PRESERVING and call.inputs and call.outputs:
            a, b = self.tensor(call.inputs[0]), self.tensor(call.outputs[0])
            return a.dim() > 0 and b.dim() > 0 and a.shape[-1] == b.shape[-1]
        return False

    def reach(self, key: Key, passes: Callable[[Call], bool]) -> Iterator[tuple[Call | None, bool]]:
        """The one forward walker: every first reader of ``key`` past the calls for which ``passes(call)`` holds,
        with whether it reads ``key`` itself (not a passed alias); ``(None, direct)`` where a value on the way is a
        model output. Readers, aliases and outputs are each visited once per value."""
        stack, seen = [(key, True)], set()
        while stack:
            k, direct = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            if k in self.outputs:
                yield None, direct
            for r in self.readers.get(k, []):
                call = self.calls[r]
                if passes(call):
                    stack.extend((o, False) for o in call.outputs)
                else:
                    yield call, direct

    def consumers(self, key: Key, through: frozenset[str] = VALUE_PRESERVING) -> list[Call]:
        """Every call reading ``key``, looking through value-preserving, row-preserving ops."""
        found = (c for c, _ in self.reach(key, lambda c: self._through(c, through) or self.row_preserving(c)))
        return list({c.idx: c for c in found if c is not None}.values())

    def producer_of(self, key: Key, through: frozenset[str] = VALUE_PRESERVING) -> Call | None:
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
        return any(c is None for c, _ in self.reach(key, self.row_preserving))

    def _shape_only_readers(self, key: Key) -> Iterator[Call | None]:
        """Every reader past shape-only ops (None for reaching a model output)."""
        return (c for c, _ in self.reach(key, lambda c: self._through(c, SHAPE_ONLY)))

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
        if n.op in LEAVES or n.op == "item_of" or hidden_at[n.idx]:
            continue
        outs = [n.idx] if n.shape is not None else items.get(n.idx, [])
        flow.add(n.op, None, [key(j) for j in n.inputs], outs, n.scalar_args)
    flow.inputs = {key(n.idx) for n in nodes if n.op == "input"}
    flow.outputs = {key(j) for j in graph.outputs}
    return flow


def linear_kind(module: nn.Module) -> str | None:
    """The affine operator a leaf module computes: 'linear' (y = x W^T + b), 'conv1d_t' (y = x W + b,
    transformers' Conv1D), 'embedding', 'conv' or None."""
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return "conv"
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is optional
        return None
    return "conv1d_t" if isinstance(module, Conv1D) else None


def record_flow(
    model: nn.Module, example_inputs: Any, *, opaque: Callable[[str, nn.Module], bool] | None = None
) -> Dataflow:
    """Run ``model`` once on ``example_inputs`` (a tensor, a tuple of positional arguments or a kwargs
    dict) in eval mode and return its coarse dataflow: parameter-owning modules opaque, and also every
    module for which ``opaque(name, module)`` holds (a BatchNorm without affine owns only buffers)."""
    was_training = model.training
    model.eval()

    def hidden(name: str, module: nn.Module) -> bool:
        return owns_parameters(name, module) or (opaque is not None and bool(name) and opaque(name, module))

    try:
        ins = example_inputs if isinstance(example_inputs, (tuple, dict)) else (example_inputs,)
        return collapse(record(model, ins), hidden)
    finally:
        model.train(was_training)
