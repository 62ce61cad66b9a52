"""DyT / Derf: float64 reference, diagonal Jacobian, drop-in and converter."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from normatlas import LayerNorm, LayerNorm2d, RMSNorm
from normatlas.longtail import Derf, DyT, Pointwise, convert_norms_to_pointwise, derf, dyt

TOL = {torch.float32: {"atol": 1e-6, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def _reference(x, alpha, shift, w, b, kind):
    x64 = x.double()
    z = alpha * x64 + shift
    f = torch.tanh(z) if kind == "dyt" else torch.tensor([math.erf(v) for v in z.flatten().tolist()]).view_as(z)
    return f.double() * w.double() + b.double()


@pytest.mark.parametrize("kind", ["dyt", "derf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 7, 33), (1, 1, 1023)])
def test_forward_backward_match_float64(kind, dtype, shape):
    torch.manual_seed(0)
    d = shape[-1]
    m = DyT(d, alpha_init=0.7, dtype=dtype) if kind == "dyt" else Derf(d, 0.7, shift_init=0.3, dtype=dtype)
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    shift = 0.3 if kind == "derf" else 0.0
    y = m(x)
    ref = _reference(x.detach(), 0.7, shift, m.weight.detach(), m.bias.detach(), kind)
    assert_close(y.double(), ref, **TOL[dtype])
    g = torch.randn(shape, dtype=dtype)
    (gx,) = torch.autograd.grad(y, x, g)
    # d/dx of w * f(a x + s): w * a * f'(a x + s)
    z = 0.7 * x.detach().double() + shift
    fprime = 1 - torch.tanh(z) ** 2 if kind == "dyt" else 2 / math.sqrt(math.pi) * torch.exp(-(z**2))
    assert_close(gx.double(), g.double() * m.weight.detach().double() * 0.7 * fprime, **TOL[dtype])


@pytest.mark.parametrize("fn", ["dyt", "derf"])
def test_gradcheck_all_inputs(fn):
    torch.manual_seed(1)
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    a = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)
    s = torch.tensor(-0.2, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    if fn == "dyt":
        assert torch.autograd.gradcheck(lambda *t: dyt(*t), (x, a, w, b))
    else:
        assert torch.autograd.gradcheck(lambda *t: derf(*t), (x, a, s, w, b))


@settings(max_examples=25, deadline=None)
@given(d=st.integers(2, 9), alpha=st.floats(0.05, 3.0), seed=st.integers(0, 2**16))
def test_jacobian_is_diagonal(d, alpha, seed):
    """No cross-element dependence: dy_i/dx_j = 0 for i != j (LayerNorm's is dense)."""
    torch.manual_seed(seed)
    x = torch.randn(d, dtype=torch.float64)
    for m in (DyT(d, alpha, dtype=torch.float64), Derf(d, alpha, shift_init=0.1, dtype=torch.float64)):
        jac = torch.autograd.functional.jacobian(m, x)
        off = jac - torch.diag(torch.diagonal(jac))
        assert off.abs().max().item() == 0.0
        assert torch.diagonal(jac).abs().min().item() > 0
    ln = torch.autograd.functional.jacobian(LayerNorm(d, dtype=torch.float64), x)
    assert (ln - torch.diag(torch.diagonal(ln))).abs().max().item() > 1e-6


def test_channels_first_matches_permuted_channels_last():
    torch.manual_seed(2)
    x = torch.randn(2, 6, 5, 3)
    cf, cl = Derf(6, channels_last=False), Derf(6)
    with torch.no_grad():
        for m in (cf, cl):
            m.weight.copy_(torch.arange(6.0))
            m.bias.fill_(0.5)
    assert_close(cf(x), cl(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))


def test_alpha_init_is_a_learnable_parameter():
    m = DyT(4, alpha_init=0.25)
    assert isinstance(m.alpha, torch.nn.Parameter) and m.alpha.item() == 0.25
    assert {n for n, _ in m.named_parameters()} == {"alpha", "weight", "bias"}
    m(torch.randn(3, 4)).sum().backward()
    assert m.alpha.grad is not None and m.alpha.grad.abs().item() > 0
    assert {n for n, _ in Derf(4).named_parameters()} == {"alpha", "shift", "weight", "bias"}


def test_loads_layernorm_state_dict_minus_alpha():
    ln = torch.nn.LayerNorm(8)
    m = DyT(8)
    missing, unexpected = m.load_state_dict(ln.state_dict(), strict=False)
    assert missing == ["alpha"] and unexpected == []


@pytest.mark.parametrize(
    ("kwargs", "exc", "needle"),
    [
        ({"normalized_shape": 0}, ValueError, "normalized_shape=0"),
        ({"normalized_shape": 4, "alpha_init": 0.0}, ValueError, "alpha_init=0.0"),
        ({"normalized_shape": 4, "alpha_init": "big"}, TypeError, "alpha_init='big'"),
        ({"normalized_shape": (2, 3), "channels_last": False}, ValueError, "single channel count"),
    ],
)
def test_bad_arguments(kwargs, exc, needle):
    with pytest.raises(exc, match=needle):
        DyT(**kwargs)


def test_wrong_input_shape_is_rejected():
    with pytest.raises(ValueError, match=r"trailing dims \(5,\)"):
        DyT(4)(torch.randn(2, 5))


def test_converter_swaps_every_per_token_norm_and_reports():
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.LayerNorm(8),
        torch.nn.Linear(8, 8),
        torch.nn.RMSNorm(8),
        RMSNorm(8),
        LayerNorm2d(3),
        torch.nn.BatchNorm1d(8),
    )
    with torch.no_grad():
        model[0].weight.normal_()
        model[3].weight.normal_()
    w0, w3 = model[0].weight.clone(), model[3].weight.clone()
    report = convert_norms_to_pointwise(model, Pointwise.DERF, alpha_init=0.3, copy_affine=True)
    assert [c.path for c in report] == ["0", "2", "3", "4"]
    assert all(isinstance(model[i], Derf) for i in (0, 2, 3, 4))
    assert isinstance(model[5], torch.nn.BatchNorm1d)  # batch statistics are not per-token norms
    assert_close(model[0].weight.detach(), w0)
    assert_close(model[3].weight.detach(), w3)
    assert model[4].channels_last is False and model[0].alpha.item() == pytest.approx(0.3)
    assert "LayerNorm -> Derf" in str(report)


def test_converter_one_plus_w_gain_is_carried_as_multiplier():
    g = RMSNorm(4, gain_convention=__import__("normatlas").GainConvention.ONE_PLUS_W)
    with torch.no_grad():
        g.weight.fill_(0.5)
    model = torch.nn.Sequential(g)
    convert_norms_to_pointwise(model, copy_affine=True)
    assert_close(model[0].weight.detach(), torch.full((4,), 1.5))


def test_converter_hf_protocol_never_copies_gain():
    class HFRMSNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.full((6,), 3.0))
            self.variance_epsilon = 1e-6

    model = torch.nn.Sequential(HFRMSNorm())
    report = convert_norms_to_pointwise(model, copy_affine=True)
    assert isinstance(model[0], DyT) and model[0].weight.detach().eq(1).all()
    assert report.changes[0].kept == () and "convention unknown" in report.changes[0].note


def test_converter_rejects_string_kind():
    with pytest.raises(TypeError, match="kind='dyt'"):
        convert_norms_to_pointwise(torch.nn.Sequential(), "dyt")  # type: ignore[arg-type]
