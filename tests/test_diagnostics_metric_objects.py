"""The Monitor's metric protocol: a user metric end to end, structure instead of names, the real BatchNorm eps."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

from normatlas.diagnostics import CSVSink, JSONLSink, Metric, Monitor, repeated_ngrams, residual_stats
from normatlas.diagnostics.metric_base import Column, Hook, MonitorMetric, Row, Scope, tensors
from normatlas.diagnostics.monitor_metrics import REGISTRY, batch_norm_eps, make_metric
from normatlas.diagnostics.tinylm import TinyLM
from normatlas.modules import Norm
from normatlas.spec import Axis, Layout, NormSpec


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


class NormSaturation(MonitorMetric):
    """Share of each block's norm outputs above ``threshold`` in magnitude (all norms of the block pooled)."""

    key = "norm_saturation"
    hooks = frozenset({Hook.MODULE_OUTPUT, Hook.STEP})  # MODULE_*: the model's norms by default
    columns = (
        Column(
            "norm_saturation",
            "norm>thr",
            "share of norm outputs above the threshold",
            "share",
            scope=Scope.LAYER,
            table=True,
            summary="max saturation",
            worst="max",
        ),
    )

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.counts: dict[int, tuple[int, int]] = {}

    def on_module_output(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Row | None:
        layer = self.monitor.layer_of(module)
        if layer is None or not isinstance(output, Tensor):
            return None
        above, total = self.counts.get(layer, (0, 0))
        above += int((output.detach().abs() > self.threshold).sum())
        total += output.numel()
        self.counts[layer] = (above, total)
        return {self.columns[0].at(layer): above / total}

    def on_step(self, record: Mapping[str, object]) -> Row | None:
        self.counts = {}
        return None


def test_a_user_metric_appears_in_rows_sinks_and_the_printed_table(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyLM(qk_norm=True)
    j, c = tmp_path / "m.jsonl", tmp_path / "m.csv"
    metric = NormSaturation(threshold=1.5)
    mon = Monitor(model, every=1, metrics=["residual", metric], sinks=[JSONLSink(j), CSVSink(c)], print_alarms=False)
    assert mon.metric("norm_saturation") is metric and mon.metric(Metric.RESIDUAL) is not None
    # the reference: every norm inside block i, by our own hooks (the q/k norms and the two block norms)
    seen: dict[int, list[Tensor]] = {0: [], 1: []}
    hooks = [
        m.register_forward_hook(lambda mod, a, out, i=i: seen[i].append(out.detach()))
        for i, blk in enumerate(model.blocks)
        for m in blk.modules()
        if isinstance(m, Norm)
    ]
    ids = torch.randint(64, (4, 16))
    model(ids)
    mon.step()
    for h in hooks:
        h.remove()
    rec = mon.last
    for i, outs in seen.items():
        assert len(outs) == 4  # norm1, norm2, q_norm, k_norm: found by behaviour, not by name
        ref = sum(int((o.abs() > 1.5).sum()) for o in outs) / sum(o.numel() for o in outs)
        assert rec[f"norm_saturation/L{i}"] == pytest.approx(ref, rel=1e-12)
    assert "residual/rms/L1" in rec
    rows = mon.layer_table()
    assert [r["norm>thr"] for r in rows] == [format(rec[f"norm_saturation/L{i}"], ".4g") for i in range(2)]
    text = mon.table(width=200)
    assert "norm>thr" in text.splitlines()[1] and format(rec["norm_saturation/L1"], ".4g") in text
    worst = max(range(2), key=lambda i: rec[f"norm_saturation/L{i}"])
    assert f"max saturation {rec[f'norm_saturation/L{worst}']:.4g} (L{worst})" in mon.summary()
    mon.close()
    line = json.loads(j.read_text().splitlines()[0])
    assert line["norm_saturation/L0"] == pytest.approx(rec["norm_saturation/L0"])
    assert any(r.startswith("0,norm_saturation/L1,") for r in c.read_text().splitlines())
    described = {r["key"]: r for r in mon.describe_columns()}
    assert described["norm_saturation/L<i>"]["metric"] == "norm_saturation"
    assert described["residual/rms/L<i>"]["metric"] == "residual"


def test_the_column_table_is_the_metrics_columns() -> None:
    mon = Monitor(TinyLM(), every=1, print_alarms=False)
    keys = [c.key for c in mon.columns]
    assert keys[0] == "loss" and len(keys) == 1 + sum(len(m.columns) for m in mon.metrics)
    assert [m.key for m in mon.metrics] == [m.value for m in Metric if m is not Metric.MODALITY]
    assert set(REGISTRY) == set(Metric)
    for metric in mon.metrics:
        for col in metric.columns:
            assert col.key.split("/")[0] in (metric.key, "residual_add", "weight_norm", "weight_growth"), col


class TokensByKeyword(nn.Module):
    """A language model whose token ids come as ``tokens=`` beside an all-ones integer mask given first."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.seg = nn.Embedding(2, 8)  # a token-type table: a small embedding fed another integer input
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, mask: Tensor, segments: Tensor, tokens: Tensor) -> Tensor:
        x = self.emb(tokens) + self.seg(segments)
        for blk in self.blocks:
            x = x + blk(x)
        return x * mask.unsqueeze(-1)


def test_token_ids_are_what_enters_the_largest_embedding_not_a_named_argument() -> None:
    torch.manual_seed(1)
    model = TokensByKeyword()
    mon = Monitor(model, every=1, metrics=["ngrams"], print_alarms=False)
    tokens = torch.randint(50, (2, 40))
    tokens[1] = torch.tensor([7, 8, 9, 10]).repeat(10)
    ones = torch.ones(2, 40, dtype=torch.long)
    model(mask=ones, segments=torch.zeros(2, 40, dtype=torch.long), tokens=tokens)  # mask first, by keyword
    mon.step()
    ref = repeated_ngrams(tokens)
    assert mon.last["ngrams/max_repeats"] == ref["max_repeats"] == 10.0  # the all-ones mask would give 40


def test_token_ids_without_an_embedding_are_the_first_integer_argument() -> None:
    class Hashing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, ids: Tensor) -> Tensor:
            x = torch.nn.functional.one_hot(ids % 4, 4).float()
            for blk in self.blocks:
                x = blk(x)
            return x

    model = Hashing()
    mon = Monitor(model, every=1, metrics=["ngrams"], print_alarms=False)
    ids = torch.tensor([[1, 2] * 20])
    model(ids)
    mon.step()
    assert mon.last["ngrams/max_repeats"] == repeated_ngrams(ids)["max_repeats"] == 20.0


class _KeywordBlock(nn.Module):
    """A block called as ``blk(rope, stream=h, bias=...)``: its stream is neither first nor positional."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, rope: Tensor, *, stream: Tensor, bias: Tensor) -> Tensor:
        return stream + self.lin(stream) * rope.mean() + bias.mean()


class _KeywordModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_KeywordBlock() for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        rope = torch.ones(x.shape[1], 3)
        for blk in self.layers:
            x = blk(rope, stream=x, bias=torch.zeros(1, 6))
        return x


def test_the_block_input_stream_is_the_input_with_the_output_shape() -> None:
    torch.manual_seed(2)
    model = _KeywordModel()
    mon = Monitor(model, every=1, metrics=["residual"], print_alarms=False)
    x = torch.randn(3, 5, 6)
    with torch.no_grad():
        h1 = model.layers[0](torch.ones(5, 3), stream=x, bias=torch.zeros(1, 6))
        h2 = model.layers[1](torch.ones(5, 3), stream=h1, bias=torch.zeros(1, 6))
        model(x)
    mon.step()
    for i, (a, b) in enumerate(((x, h1), (h1, h2))):
        for k, v in residual_stats(a, b).items():
            assert_close(mon.last[f"residual/{k}/L{i}"], v, rtol=1e-6, atol=1e-7)


def test_batchnorm_health_uses_the_eps_the_module_computes_with() -> None:
    """A normatlas BatchNorm with ``eps=None`` computes with the machine eps; the old ``eps or 1e-5`` did not."""
    torch.manual_seed(3)
    spec = NormSpec(layout=Layout.NC, reduce=frozenset({Axis.SAMPLE}), eps=None)
    fc, bn = nn.Linear(6, 8), Norm(spec, 8, track_running_stats=True)
    model = nn.Sequential(fc, bn)
    mon = Monitor(model, every=1, metrics=["batchnorm"], print_alarms=False)
    assert bn.running_var is not None and bn.running_mean is not None
    with torch.no_grad():
        bn.running_var.fill_(1e-6)  # where eps = 1e-5 would dominate the denominator
    x = torch.randn(32, 6)
    h = fc(x).detach().double()
    rm, rv = bn.running_mean.clone().double(), bn.running_var.clone().double()
    model.train()(x)
    mon.step()
    eps = torch.finfo(torch.float32).eps
    ref = ((h.mean(0) - rm).abs() / (rv + eps).sqrt()).mean()
    assert_close(mon.last["batchnorm/mean_gap/1"], float(ref), rtol=1e-4, atol=0)
    ratio = ((h.var(0, unbiased=False) + eps) / (rv + eps)).log().abs().mean()
    assert_close(mon.last["batchnorm/var_logratio/1"], float(ratio), rtol=1e-4, atol=0)


def test_batch_norm_eps_is_read_from_the_module_or_unknown() -> None:
    assert batch_norm_eps(nn.BatchNorm2d(3, eps=0.0), torch.float32) == 0.0  # torch allows it in eval mode
    assert batch_norm_eps(nn.BatchNorm2d(3, eps=1e-3), torch.float32) == 1e-3
    machine = Norm(NormSpec(layout=Layout.NC, reduce=frozenset({Axis.SAMPLE}), eps=None), 4, track_running_stats=True)
    assert batch_norm_eps(machine, torch.float32) == torch.finfo(torch.float32).eps
    own = Norm(NormSpec(layout=Layout.NC, reduce=frozenset({Axis.SAMPLE}), eps=1e-3), 4, track_running_stats=True)
    assert batch_norm_eps(own, torch.float64) == 1e-3
    broken = nn.BatchNorm1d(3)
    broken.eps = None  # type: ignore[assignment]
    assert batch_norm_eps(broken, torch.float32) is None
    assert batch_norm_eps(nn.LayerNorm(3), torch.float32) is None  # not a BatchNorm: nothing to read


@dataclasses.dataclass
class _Out:
    logits: Tensor
    aux: tuple[Tensor, Tensor]


def test_tensors_walks_structure_in_order() -> None:
    a, b, c = torch.zeros(2), torch.ones(3), torch.ones(1)
    ids, flags = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.bool)
    found = list(tensors(({"x": a, "ids": ids}, [_Out(b, (c, flags))])))
    assert [t is s for t, s in zip(found, (a, b, c), strict=True)] == [True] * 3
    assert list(tensors([a, ids, flags], floating=False)) == [ids]  # no bool masks among integer inputs
    assert len(list(tensors([a, ids, flags], floating=None))) == 3


def test_bad_metrics_and_columns_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match="metrics holds 3"):
        make_metric(3)
    with pytest.raises(ValueError, match="metrics='nonsense'"):
        make_metric("nonsense")
    with pytest.raises(ValueError, match="two metrics with key 'norm_saturation'"):
        Monitor(TinyLM(), metrics=[NormSaturation(1.0), NormSaturation(2.0)], print_alarms=False)
    metric = NormSaturation(1.0)
    Monitor(TinyLM(), metrics=[metric], print_alarms=False)
    with pytest.raises(ValueError, match="already bound to another Monitor"):
        Monitor(TinyLM(), metrics=[metric], print_alarms=False)

    class NoKey(MonitorMetric):
        pass

    with pytest.raises(TypeError, match=r"NoKey\.key=None"):
        make_metric(NoKey)

    class Undeclared(NormSaturation):
        hooks = frozenset({Hook.MODULE_OUTPUT})  # but on_step is overridden

    with pytest.raises(ValueError, match=r"overrides on_step but its hooks lack Hook\.STEP"):
        make_metric(Undeclared(1.0))

    class Unimplemented(NormSaturation):
        hooks = frozenset({Hook.MODULE_OUTPUT, Hook.STEP, Hook.GRADIENTS})

    with pytest.raises(ValueError, match=r"holds Hook\.GRADIENTS but it overrides none of on_gradients"):
        make_metric(Unimplemented(1.0))
    with pytest.raises(ValueError, match=r"table=True needs scope=Scope\.LAYER"):
        Column("x", "x", "an x", table=True)
    with pytest.raises(ValueError, match="worst='median'"):
        Column("x", "x", "an x", worst="median")
    # the same built-in named twice is one metric
    mon = Monitor(TinyLM(), metrics=["grad_norm", Metric.GRAD_NORM], print_alarms=False)
    assert [m.key for m in mon.metrics] == ["grad_norm"]


def test_gradients_are_read_once_per_step() -> None:
    torch.manual_seed(4)
    model = TinyLM()
    mon = Monitor(model, every=1, metrics=["grad_norm"], print_alarms=False)
    model(torch.randint(64, (2, 8))).sum().backward()
    ref = torch.stack([p.grad.double().norm() for p in model.parameters() if p.grad is not None]).norm()
    mon.read_gradients()
    for p in model.parameters():  # what a trainer does before the step closes
        p.grad = torch.full_like(p, math.nan)
    mon.read_gradients()  # a second read in the same step reads nothing
    mon.step()
    assert_close(mon.last["grad_norm/total"], float(ref), rtol=1e-5, atol=0)


def test_cross_example_check_reads_the_output_by_structure() -> None:
    """A scalar first and the per-example tensor under any field name: the batch-leading tensor is compared."""
    from normatlas.diagnostics.health import cross_example_dependence

    class Wrapped(nn.Module):
        def __init__(self, norm: nn.Module) -> None:
            super().__init__()
            self.lin, self.norm = nn.Linear(6, 8), norm

        def forward(self, x: Tensor) -> dict[str, object]:
            h = self.norm(self.lin(x))
            return {"aux": h.mean(), "stuff": [_Out(h, (h.sum(-1), h.sum(-1)))]}

    torch.manual_seed(5)
    x = torch.randn(8, 6)
    assert not cross_example_dependence(Wrapped(nn.BatchNorm1d(8)).train(), x).passed
    assert cross_example_dependence(Wrapped(nn.LayerNorm(8)).train(), x).passed

    class Pooled(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x.sum()  # nothing per example to compare

    with pytest.raises(TypeError, match="no tensor with the batch of 8"):
        cross_example_dependence(Pooled(), x)
