"""Who reads and who writes what: the dataflow facts surgery needs, from one recorded run.

Method: run the model once under a :class:`torch.overrides.TorchFunctionMode` and
forward hooks. Every module that owns parameters directly (a linear layer, an
embedding, a norm, a convolution) is recorded as one opaque *call*; every torch
call outside such modules (``a + b``, ``x.view(...)``, dropout, RoPE arithmetic) is
recorded as an *op*. Tensors are identified by object identity plus a version that
advances on in-place writes, and are kept alive for the run so identities are
never reused. Edges are "call B read a tensor call A produced".

Guaranteed property: the graph is the dataflow of the run that happened (like
``torch.jit.trace``), so every question answered from it (the consumers of a norm,
the writers of a residual stream, the path from a projection to a norm) is a fact
about the executed computation, never a guess from parameter or class names. The
only type checks are on the *operator* a module computes (``nn.Linear``,
``Conv1D``, ``nn.Embedding``, ``nn.Conv*d``), never on its role.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["PASS_THROUGH", "SHAPE_ONLY", "Call", "Dataflow", "linear_kind", "record"]

# ops that hand their input on unchanged in value (eval mode), per element
PASS_THROUGH = frozenset(
    {"dropout", "contiguous", "clone", "detach", "to", "float", "type_as", "alias", "identity", "__get__"}
)
# ops that only rearrange elements within a token (no arithmetic)
SHAPE_ONLY = PASS_THROUGH | {"view", "reshape", "transpose", "permute", "unflatten", "flatten", "unsqueeze"}
# ops that may keep every row (last-dim vector) intact: pass-through when the last dim is unchanged
ROW_PRESERVING = frozenset({"view", "reshape", "__getitem__", "flatten", "unflatten", "squeeze", "unsqueeze"})
_ADD = frozenset({"add", "__add__", "__radd__", "__iadd__", "add_"})
_SCALAR_SCALE = frozenset({"mul", "__mul__", "__rmul__", "__imul__", "mul_", "div", "__truediv__", "__itruediv__"})


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", str(func))
    return {"__add__": "add", "__radd__": "add", "__iadd__": "add", "add_": "add"}.get(name, name)


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


@dataclass
class Call:
    """One recorded step: a parameter-owning module call (``module`` set) or a torch op."""

    idx: int
    op: str
    module: str | None
    inputs: list[tuple[int, int]]
    outputs: list[tuple[int, int]]
    scalar_args: bool = False  # for mul/div: every non-tensor operand is a Python number

    @property
    def label(self) -> str:
        return self.module if self.module is not None else f"op#{self.idx}:{self.op}"


@dataclass
class Dataflow:
    """The recorded graph with the queries surgery asks."""

    model: nn.Module
    calls: list[Call] = field(default_factory=list)
    producer: dict[tuple[int, int], int] = field(default_factory=dict)
    readers: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    keep: list[Any] = field(default_factory=list)
    inputs: set[tuple[int, int]] = field(default_factory=set)
    outputs: set[tuple[int, int]] = field(default_factory=set)
    _by_id: dict[int, Any] = field(default_factory=dict, repr=False)

    # -- basic lookups -------------------------------------------------------------------
    def module_calls(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.module == name]

    def modules(self) -> list[str]:
        seen: dict[str, None] = {}
        for c in self.calls:
            if c.module is not None:
                seen.setdefault(c.module, None)
        return list(seen)

    def tensor(self, key: tuple[int, int]) -> Tensor:
        """The recorded tensor for ``key`` (its latest version's value)."""
        if len(self._by_id) != len(self.keep):
            self._by_id = {id(t): t for t in self.keep if isinstance(t, Tensor)}
            self._by_id.update({-i - 1: None for i in range(len(self.keep) - len(self._by_id))})  # keep sizes equal
        t = self._by_id.get(key[0])
        if t is None:
            raise KeyError(key)
        return t

    def submodule(self, name: str) -> nn.Module:
        return self.model.get_submodule(name)

    def row_preserving(self, call: Call) -> bool:
        """True for a value-preserving op, or a reshape/slice that keeps the last dim (rows intact)."""
        if call.module is not None:
            return False
        if call.op in PASS_THROUGH:
            return True
        if call.op in ROW_PRESERVING and call.inputs and call.outputs:
            a, b = self.tensor(call.inputs[0]), self.tensor(call.outputs[0])
            return a.dim() > 0 and b.dim() > 0 and a.shape[-1] == b.shape[-1]
        return False

    def consumers(self, key: tuple[int, int], through: frozenset[str] = PASS_THROUGH) -> list[Call]:
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
                if (call.module is None and call.op in through) or self.row_preserving(call):
                    stack.extend(call.outputs)
                else:
                    out.append(call)
        return out

    def producer_of(self, key: tuple[int, int], through: frozenset[str] = PASS_THROUGH) -> Call | None:
        """The call that produced ``key``, looking back through value-preserving ops."""
        while key in self.producer:
            call = self.calls[self.producer[key]]
            if ((call.module is None and call.op in through) or self.row_preserving(call)) and call.inputs:
                key = call.inputs[0]
                continue
            return call
        return None

    def escapes(self, key: tuple[int, int]) -> bool:
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

    def reaches_norm(self, key: tuple[int, int], norms: Iterable[str]) -> str | None:
        """The norm module ``key`` flows into through shape-only ops (view/transpose/...), if every
        path ends there; None when any path reaches anything else first."""
        targets = set(norms)
        found: set[str] = set()
        stack, seen = [key], set()
        while stack:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            if k in self.outputs:
                return None
            for r in self.readers.get(k, []):
                call = self.calls[r]
                if call.module is not None and call.module in targets:
                    found.add(call.module)
                elif call.module is None and call.op in SHAPE_ONLY:
                    stack.extend(call.outputs)
                else:
                    return None
        return next(iter(found)) if len(found) == 1 else None

    def first_non_shape_reader(self, key: tuple[int, int]) -> str:
        """A readable name for what first reads ``key`` past shape-only ops (for refusal reasons)."""
        stack, seen = [key], set()
        while stack:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            for r in self.readers.get(k, []):
                call = self.calls[r]
                if call.module is None and call.op in SHAPE_ONLY:
                    stack.extend(call.outputs)
                else:
                    return call.label
        return "the model output"

    def stream(self, key: tuple[int, int]) -> tuple[set[tuple[int, int]], list[tuple[int, int]]]:
        """Expand ``key`` backwards through residual adds, value-preserving ops and scalings by a
        Python number. Returns (stream tensors, leaf tensors: the writers' outputs)."""
        tensors: set[tuple[int, int]] = set()
        leaves: list[tuple[int, int]] = []
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


def _tensors(obj: Any) -> list[Tensor]:
    leaves, _ = tree_flatten(obj)
    return [t for t in leaves if isinstance(t, Tensor)]


class _Recorder(TorchFunctionMode):
    def __init__(self, flow: Dataflow, tracked: dict[nn.Module, str]) -> None:
        super().__init__()
        self.flow, self.tracked = flow, tracked
        self.depth = 0
        self.version: dict[int, int] = {}
        self.pending: list[tuple[str, list[tuple[int, int]]]] = []

    def key(self, t: Tensor) -> tuple[int, int]:
        return (id(t), self.version.get(id(t), 0))

    def add_call(self, op: str, module: str | None, ins: list[Tensor], outs: list[Tensor], scalar: bool) -> None:
        flow = self.flow
        in_keys = [self.key(t) for t in ins]
        out_keys = []
        for t in outs:
            if id(t) in {id(i) for i in ins}:  # in-place: a new version of the same object
                self.version[id(t)] = self.version.get(id(t), 0) + 1
            out_keys.append(self.key(t))
        call = Call(len(flow.calls), op, module, in_keys, out_keys, scalar)
        flow.calls.append(call)
        flow.keep.extend(ins + outs)
        for k in in_keys:
            flow.readers.setdefault(k, []).append(call.idx)
        for k in out_keys:
            flow.producer[k] = call.idx

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.depth == 0:
            outs = _tensors(result)
            if outs:
                flat, _ = tree_flatten((args, kwargs))
                ins = [a for a in flat if isinstance(a, Tensor)]
                scalar = all(isinstance(a, (int, float)) for a in flat if not isinstance(a, Tensor))
                self.add_call(_op_name(func), None, ins, outs, scalar)
        return result


def record(model: nn.Module, example_inputs: Any) -> Dataflow:
    """Run ``model`` once on ``example_inputs`` (tensor, tuple or dict) in eval mode and record it."""
    flow = Dataflow(model)
    tracked = {m: n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}
    rec = _Recorder(flow, tracked)
    handles = []

    def pre(mod: nn.Module, args: Any, kwargs: Any) -> None:
        if rec.depth == 0:
            rec.pending.append((tracked[mod], [rec.key(t) for t in _tensors((args, kwargs))]))
            flow.keep.extend(_tensors((args, kwargs)))
        else:
            rec.pending.append(("", []))
        rec.depth += 1

    def post(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        rec.depth -= 1
        name, in_keys = rec.pending.pop()
        if rec.depth == 0 and name:
            call = Call(len(flow.calls), "module", name, in_keys, [], False)
            flow.calls.append(call)
            for k in in_keys:
                flow.readers.setdefault(k, []).append(call.idx)
            outs = _tensors(output)
            flow.keep.extend(outs)
            for t in outs:
                if any(k[0] == id(t) for k in in_keys):
                    rec.version[id(t)] = rec.version.get(id(t), 0) + 1
                call.outputs.append(rec.key(t))
                flow.producer[rec.key(t)] = call.idx

    for mod in tracked:
        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))
    was_training = model.training
    model.eval()
    try:
        ins = example_inputs if isinstance(example_inputs, (tuple, dict)) else (example_inputs,)
        flow.inputs = {rec.key(t) for t in _tensors(ins)}
        flow.keep.extend(_tensors(ins))
        with torch.no_grad(), rec:
            out = model(**ins) if isinstance(ins, dict) else model(*ins)
        flow.outputs = {rec.key(t) for t in _tensors(out if not hasattr(out, "to_tuple") else out.to_tuple())}
        flow.keep.append(out)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return flow
