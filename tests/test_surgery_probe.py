"""The norm probe measures what a layer computes (centring, gain convention, eps and its placement,
cast order), never reading names: property tests over normatlas layers with known specs, and the
dataflow facts surgery relies on."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from normatlas.analysis import record_flow as record
from normatlas.modules import Norm
from normatlas.spec import CastOrder, EpsPlacement, Gain, GainConvention, NormSpec
from normatlas.surgery import fold_batchnorm, probe_norm, run_checks


@settings(max_examples=25, deadline=None)
@given(
    center=st.booleans(),
    log_eps=st.floats(-12, -2),
    placement=st.sampled_from([EpsPlacement.INSIDE_SQRT, EpsPlacement.OUTSIDE_SQRT]),
    convention=st.sampled_from(list(GainConvention)),
    bias=st.booleans(),
    dim=st.integers(3, 67),
    cast=st.sampled_from([CastOrder.AFTER_GAIN, CastOrder.BEFORE_GAIN]),
)
def test_probe_recovers_the_spec(center, log_eps, placement, convention, bias, dim, cast) -> None:
    eps = 10.0**log_eps
    spec = NormSpec(
        center=center,
        eps=eps,
        eps_placement=placement,
        gain=Gain.PER_FEATURE,
        gain_convention=convention,
        bias=bias and center,
        cast_order=cast,
    )
    layer = Norm(spec, dim)
    gen = torch.Generator().manual_seed(dim)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    facts = probe_norm(layer, "n", dim)
    assert facts is not None
    assert facts.measured.center is center
    assert facts.measured.gain_convention is convention
    assert (facts.bias_param is not None) is spec.bias
    assert facts.measured.eps_placement is placement
    assert math.isclose(facts.eps, eps, rel_tol=2e-2)
    for k, v in layer.state_dict().items():  # the probe restores the layer
        assert torch.equal(v, before[k])


def test_probe_rejects_non_norms() -> None:
    torch.manual_seed(0)
    assert probe_norm(torch.nn.Linear(8, 8), "lin", 8) is None

    class Scale(torch.nn.Module):  # an elementwise gain: not scale invariant
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    assert probe_norm(Scale(), "scale", 8) is None


def test_probe_reads_cast_order_of_torch_rmsnorm() -> None:
    facts = probe_norm(torch.nn.RMSNorm(16, eps=1e-6), "rms", 16)
    assert facts is not None and facts.measured.cast_order is CastOrder.AFTER_GAIN and not facts.measured.center
    assert facts.eps == 1e-6 and facts.eps_attr == 1e-6


def test_dataflow_sees_through_dropout_and_views() -> None:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.drop = torch.nn.LayerNorm(8), torch.nn.Dropout(0.5)
            self.a, self.b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.drop(self.norm(x)).reshape(-1, 8)
            return self.a(h) + self.b(h) + x[..., :4].reshape(-1, 4)

    from normatlas.surgery import linear_consumers

    flow = record(Block(), (torch.randn(2, 3, 8),))
    assert linear_consumers(flow, "norm") == (["a", "b"], None)


class CNN(torch.nn.Module):
    """conv(+bias) -> BN -> ReLU -> conv -> BN, and a BN fed by a ReLU (not foldable)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.n1 = torch.nn.Conv2d(3, 6, 3, bias=True), torch.nn.BatchNorm2d(6)
        self.c2, self.n2 = torch.nn.Conv2d(6, 5, 3, bias=False), torch.nn.BatchNorm2d(5)
        self.n3 = torch.nn.BatchNorm2d(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.n3(torch.relu(self.n2(self.c2(torch.relu(self.n1(self.c1(x)))))))


def test_batchnorm_fold_on_a_plain_cnn() -> None:
    torch.manual_seed(0)
    model = CNN()
    model.train()
    for _ in range(3):  # real running statistics
        model(torch.randn(4, 3, 12, 12) * 2 + 1)
    model.eval()
    x = (torch.randn(2, 3, 12, 12),)
    s = fold_batchnorm(model, x)
    assert [c.target for c in s.changes] == ["n1", "n2"]
    assert [r.target for r in s.refusals] == ["n3"] and "not a convolution" in s.refusals[0].reason
    run_checks(model, s, x)
    assert s.passed, s.check_rows()
    runtime = s.runtime()
    assert isinstance(runtime.n1, torch.nn.Identity) and isinstance(runtime.n2, torch.nn.Identity)
    assert runtime.c2.bias is not None
    with torch.no_grad():
        torch.testing.assert_close(runtime(*x), model(*x), rtol=1e-5, atol=1e-5)


def test_bad_tolerance_names_the_value() -> None:
    from normatlas.surgery import Tolerance

    with pytest.raises(ValueError, match="float64=-1"):
        Tolerance(-1, 1e-4)
