"""Weight Standardization, scaled WS, AGC, and the torch parametrization wrappers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from normatlas import longtail as lt  # the public namespace the tests exercise


def _ws_reference(w, eps, scaled, gamma=1.0):
    w64 = w.double().reshape(w.shape[0], -1)
    mean = w64.mean(1, keepdim=True)
    var = ((w64 - mean) ** 2).mean(1, keepdim=True)
    if scaled:
        out = (w64 - mean) / torch.sqrt(torch.clamp(var * w64.shape[1], min=eps)) * gamma
    else:
        out = (w64 - mean) / torch.sqrt(var + eps)
    return out.reshape(w.shape)


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("shape", [(5, 3, 3, 3), (7, 123), (1, 1, 1023)])
def test_standardize_weight_matches_float64(scaled, shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * 3 + 1
    assert_close(lt.standardize_weight(w, 1e-5, scaled=scaled, gamma=1.7).double(), _ws_reference(w, 1e-5, scaled, 1.7)
                 if scaled else _ws_reference(w, 1e-5, False), atol=1e-5, rtol=1e-5)  # fmt: skip
    w64 = torch.randn(shape[0], 6, dtype=torch.float64, requires_grad=True)
    gain = torch.rand(shape[0], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w, g: lt.standardize_weight(w, 1e-5, scaled=scaled, gain=g), (w64, gain))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), a=st.floats(0.1, 10.0), b=st.floats(-5.0, 5.0))
def test_ws_conv_is_invariant_to_per_filter_affine_weight_changes(seed, a, b):
    torch.manual_seed(seed)
    conv = lt.WSConv2d(3, 4, 3, eps=1e-12, dtype=torch.float64)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    y = conv(x)
    with torch.no_grad():
        conv.weight.mul_(a).add_(b)
    assert_close(conv(x), y, atol=1e-9, rtol=1e-7)


def test_scaled_ws_preserves_unit_variance():
    """A unit-variance iid input through scaled WS (gamma=1) gives output variance ~1 (no padding)."""
    torch.manual_seed(1)
    conv = lt.ScaledWSConv2d(64, 64, 3, bias=False)
    y = conv(torch.randn(32, 64, 10, 10))
    assert y.var().item() == pytest.approx(1.0, abs=0.05)
    w = lt.standardize_weight(conv.weight, conv.eps, scaled=True)
    assert_close(w.reshape(64, -1).var(1, unbiased=False) * w[0].numel(), torch.ones(64), atol=1e-4, rtol=0)


def test_agc_clips_unitwise_relative_to_weight_norm_and_keeps_direction():
    torch.manual_seed(2)
    lin = torch.nn.Linear(8, 6)
    with torch.no_grad():
        lin.weight[0].mul_(1e-6)  # tiny row: eps floor applies
    lin.weight.grad = torch.randn(6, 8)
    lin.weight.grad[3] *= 1e-5  # one row already small: left alone
    lin.bias.grad = torch.randn(6)
    before_w, before_b = lin.weight.grad.clone(), lin.bias.grad.clone()
    lt.adaptive_clip_grad_(lin.parameters(), clipping=0.05, eps=1e-3)
    w_norm = lin.weight.detach().norm(dim=1).clamp_min(1e-3)
    g_norm = lin.weight.grad.norm(dim=1)
    assert torch.all(g_norm <= 0.05 * w_norm * (1 + 1e-5))
    assert_close(lin.weight.grad[3], before_w[3], atol=0, rtol=0)
    cos = F.cosine_similarity(lin.weight.grad, before_w, dim=1)
    assert_close(cos, torch.ones(6))
    # float64 reference for the bias (a 1-D tensor: one unit)
    bmax = 0.05 * max(lin.bias.detach().double().norm().item(), 1e-3)
    ref = before_b.double() * min(1.0, bmax / before_b.double().norm().item())
    assert_close(lin.bias.grad.double(), ref, atol=1e-6, rtol=1e-5)


def test_agc_bad_arguments():
    with pytest.raises(ValueError, match="clipping=0"):
        lt.adaptive_clip_grad_([], clipping=0)


def test_spectral_norm_wraps_torch_and_gives_unit_spectral_norm():
    torch.manual_seed(3)
    lin = lt.spectral_norm(torch.nn.Linear(12, 9), n_power_iterations=50)
    lin.train()
    for _ in range(3):
        lin(torch.randn(2, 12))
    lin.eval()
    assert torch.linalg.matrix_norm(lin.weight.detach(), ord=2).item() == pytest.approx(1.0, rel=1e-4)
    lt.remove_parametrization(lin)
    assert not torch.nn.utils.parametrize.is_parametrized(lin)


def test_weight_norm_wraps_torch_and_keeps_the_initial_weight():
    torch.manual_seed(4)
    lin = torch.nn.Linear(5, 4)
    w0 = lin.weight.detach().clone()
    lt.weight_norm(lin)
    assert_close(lin.weight.detach(), w0)
    g = lin.parametrizations.weight.original0
    assert_close(g.detach().flatten(), w0.norm(dim=1))


def test_apply_parametrization_walks_the_model_and_reports():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(4, 2)))
    report = lt.apply_parametrization(model, lt.spectral_norm)
    assert [(c.path, c.old, c.new) for c in report] == [
        ("0", "Conv2d", "Conv2d+spectral_norm"), ("2.0", "Linear", "Linear+spectral_norm"),
    ]  # fmt: skip
    assert len(lt.apply_parametrization(model, lt.spectral_norm)) == 0  # already wrapped: skipped
