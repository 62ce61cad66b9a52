"""The shared dataflow recorder (normatlas.analysis), read at both granularities on hand-written
modules whose graph is known: a norm, a linear reading it, a residual add, an in-place op, a view."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from normatlas.analysis import Graph, Node, collapse, op_name, record
from normatlas.analysis import record_flow as record_surgery


class Net(nn.Module):
    """x -> norm -> proj -> (+ x) -> *= 0.5 (in place) -> view -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj, self.head = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.norm(x))
        y = x + h
        y.mul_(0.5)
        return self.head(y.view(6, 8))


def _calls(g: Graph) -> list[Node]:
    return [n for n in g.nodes if n.op not in ("input", "param", "buffer", "leaf")]


@pytest.fixture
def run() -> tuple[Net, torch.Tensor, Graph]:
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 3, 8)
    return net, x, record(net, x)


def test_fine_graph_has_every_torch_call_with_labels(run) -> None:
    net, x, g = run
    norm, proj, add, mul, view, head = _calls(g)
    assert [n.op for n in (norm, proj, add, mul, view, head)] == [
        "layer_norm",
        "linear",
        "add",
        "mul",
        "view",
        "linear",
    ]
    assert [n.module for n in (norm, proj, add, mul, view, head)] == ["norm", "proj", "", "", "", "head"]
    (xin,) = [n for n in g.nodes if n.op == "input"]
    assert g.tensors[xin.idx] is x and proj.inputs[0] == norm.idx and set(add.inputs) == {xin.idx, proj.idx}
    params = {g.nodes[i].label for i in norm.inputs + proj.inputs if g.nodes[i].op == "param"}
    assert params == {"norm.weight", "norm.bias", "proj.weight", "proj.bias"}
    assert g.outputs == (head.idx,) and g.feeds(norm.idx, head.idx) and not g.feeds(head.idx, norm.idx)
    torch.testing.assert_close(g.tensors[head.idx], net(x), rtol=0, atol=0)


def test_in_place_write_is_a_new_version_of_the_same_tensor(run) -> None:
    _, _, g = run
    _, _, add, mul, view, _ = _calls(g)
    assert mul.prev == add.idx and g.tensors[mul.idx] is g.tensors[add.idx]
    assert mul.inputs[0] == add.idx and view.inputs == (mul.idx,)  # readers after the write see it
    assert mul.scalar_args  # a scaling by a Python number


def test_spans_record_each_module_invocation(run) -> None:
    _, _, g = run
    norm, *_, head = _calls(g)
    assert [s.name for s in g.spans] == ["", "norm", "proj", "head"]
    assert [s.parent for s in g.spans] == [None, 0, 0, 0]
    sp = g.spans[1]
    assert sp.outputs == (norm.idx,) and sp.start <= norm.idx < sp.end and g.nodes[sp.inputs[0]].op == "input"
    assert g.spans[0].outputs == (head.idx,)


def test_coarse_view_makes_parameter_owners_opaque(run) -> None:
    _, _, g = run
    flow = collapse(g)
    assert [(c.module, c.op) for c in flow.calls] == [
        ("norm", "module"),
        ("proj", "module"),
        (None, "add"),
        (None, "mul"),
        (None, "view"),
        ("head", "module"),
    ]
    norm, proj, _, mul, view, head = flow.calls
    assert [c.label for c in flow.consumers(norm.outputs[0])] == ["proj"]
    assert flow.producer_of(head.inputs[0]) is mul  # the view keeps rows, the scaling does not pass
    tensors, leaves = flow.stream(head.inputs[0])  # residual add + scaling by a number: one stream
    assert set(leaves) == set(flow.inputs) | {proj.outputs[0]} and mul.outputs[0] in tensors
    assert flow.outputs == set(head.outputs) and flow.escapes(view.outputs[0]) is False
    assert flow.reaches_norm(proj.outputs[0], ["norm"]) is None
    assert flow.first_non_shape_reader(norm.outputs[0]) == "proj"


def test_both_granularities_from_one_recording(run) -> None:
    _, _, g = run
    fine = collapse(g, lambda name, m: False)  # nothing opaque: every torch call is an op
    assert [c.op for c in fine.calls] == [n.op for n in _calls(g)] and fine.modules() == []
    only_norm = collapse(g, lambda name, m: name == "norm")
    assert only_norm.modules() == ["norm"] and [c.op for c in only_norm.calls][1] == "linear"


class Wrap(nn.Module):
    """A parameter owner that writes its input in place and returns it, and one that hands it back unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((4,), 2.0))
        self.ident = nn.Linear(4, 4)
        self.ident.forward = lambda t: t  # type: ignore[method-assign]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        z = self.ident(y)
        return (z * self.scale).reshape(2, 2, 4)


def test_module_returning_its_input_makes_a_new_value() -> None:
    flow = collapse(record(Wrap(), torch.randn(4, 4)))
    clone, ident, mul, reshape = flow.calls
    assert (clone.op, ident.module, mul.op, reshape.op) == ("clone", "ident", "mul", "reshape")
    assert ident.inputs == clone.outputs and ident.outputs != clone.outputs  # a fresh key, like an in-place write
    assert mul.inputs[0] == ident.outputs[0] and flow.producer[mul.inputs[0]] == ident.idx
    assert flow.tensor(ident.outputs[0]) is flow.tensor(clone.outputs[0])
    assert flow.modules() == ["ident"]  # the root owns `scale` but is never collapsed


def test_surgery_view_restores_training_mode_and_accepts_kwargs() -> None:
    net = Net().train()
    flow = record_surgery(net, {"x": torch.randn(2, 3, 8)})
    assert net.training and flow.modules() == ["norm", "proj", "head"]


def test_op_names_are_canonical() -> None:
    x = torch.randn(3)
    g = record(nn.Identity(), x)
    assert g.nodes == [g.nodes[0]]  # nothing ran but the input
    ops = (torch.Tensor.__radd__, torch.Tensor.add_, torch.true_divide, torch.Tensor.__rmul__, torch.Tensor.view)
    assert [op_name(f) for f in ops] == ["add", "add", "div", "mul", "view"]
    assert op_name(torch.Tensor.T.__get__) == "get_T"


def test_collapse_needs_a_recorded_graph() -> None:
    with pytest.raises(ValueError, match=r"graph\.model"):
        collapse(Graph([], (), frozenset()))


class _CastLike(nn.Module):
    """``pos.to(x)`` / ``pos.type_as(x)`` then ``x + pos``: the reference tensor gives a dtype and a device."""

    def __init__(self, method: str) -> None:
        super().__init__()
        self.pos, self.method = nn.Parameter(torch.randn(3, 8)), method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + getattr(self.pos, self.method)(x)


@pytest.mark.parametrize("method", ["to", "type_as"])
def test_a_cast_to_another_tensors_dtype_reads_only_its_own_input(method: str) -> None:
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    g = record(_CastLike(method), x)
    cast = next(n for n in g.nodes if n.op == method)
    (src,) = cast.inputs
    assert g.nodes[src].op == "param"
    add = next(n for n in g.nodes if n.op == "add")
    inp = next(n.idx for n in g.nodes if n.op == "input")
    assert not g.feeds(inp, cast.idx) and g.feeds(inp, add.idx)  # the add is not x + f(x)
