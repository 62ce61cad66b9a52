"""nGPT, AdaIN, adaLN-Zero and the VLM connector norm."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from normatlas.longtail import (
    AdaIN,
    AdaLNZero,
    ConnectorNorm,
    HypersphereConstraint,
    SphericalUpdate,
    adain,
    ngpt_constraint,
    sphere,
    text_embedding_norm,
)

# ----------------------------------------------------------------------------- nGPT


def test_ngpt_constraint_keeps_rows_on_the_sphere_after_every_optimizer_step():
    torch.manual_seed(0)
    d = 16
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(30, d), "up": torch.nn.Linear(d, 40, bias=False),
                                 "down": torch.nn.Linear(40, d, bias=False)})  # fmt: skip
    constraint = ngpt_constraint(model, d)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    constraint.attach(opt)
    for _ in range(3):
        h = sphere(model["emb"](torch.randint(0, 30, (4, 5))))
        loss = model["down"](torch.relu(model["up"](h))).pow(3).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert_close(model["emb"].weight.norm(dim=1), torch.ones(30))
        assert_close(model["up"].weight.norm(dim=1), torch.ones(40))  # reads the stream: rows
        assert_close(model["down"].weight.norm(dim=0), torch.ones(40))  # writes the stream: columns


def test_hypersphere_constraint_rejects_bad_dim():
    with pytest.raises(ValueError, match="dim=2 is out of range"):
        HypersphereConstraint([(torch.zeros(3, 4), 2)])


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), d=st.integers(2, 12))
def test_spherical_update_stays_on_the_sphere_and_interpolates(seed, d):
    torch.manual_seed(seed)
    h = sphere(torch.randn(3, d, dtype=torch.float64))
    hb = torch.randn(3, d, dtype=torch.float64) * 5
    upd = SphericalUpdate(d, alpha_init=0.3).double()
    out = upd(h, hb)
    assert_close(out.norm(dim=-1), torch.ones(3, dtype=torch.float64))
    assert_close(upd.rate(), torch.full((d,), 0.3, dtype=torch.float64))
    expected = sphere(h + 0.3 * (sphere(hb) - h))  # float64 reference of nGPT eq. (10)
    assert_close(out, expected)
    with torch.no_grad():
        upd.alpha.zero_()
    assert_close(upd(h, hb), h)  # rate 0: stay
    with torch.no_grad():
        upd.alpha.fill_(upd.alpha_scale / upd.alpha_init)
    assert_close(upd(h, hb), sphere(hb))  # rate 1: jump to the block's output


def test_spherical_update_default_parametrisation_is_ngpts():
    upd = SphericalUpdate(64)
    assert upd.alpha_scale == pytest.approx(1 / 8) and upd.alpha.detach().eq(1 / 8).all()


# ----------------------------------------------------------------------------- AdaIN


def test_adain_output_takes_the_style_statistics():
    torch.manual_seed(1)
    content = torch.randn(2, 3, 7, 9, dtype=torch.float64) * 4 + 2
    style = torch.randn(2, 3, 5, 5, dtype=torch.float64) * 0.5 - 1
    out = AdaIN(3, eps=1e-12)(content, style)
    assert_close(out.mean((2, 3)), style.mean((2, 3)))
    assert_close(out.std((2, 3), unbiased=False), style.std((2, 3), unbiased=False))
    # float64 reference of Huang & Belongie eq. (8)
    mu_c, sd_c = content.mean((2, 3), keepdim=True), content.std((2, 3), unbiased=False, keepdim=True)
    mu_s, sd_s = style.mean((2, 3), keepdim=True), style.std((2, 3), unbiased=False, keepdim=True)
    assert_close(out, sd_s * (content - mu_c) / sd_c + mu_s)


def test_adain_gradcheck_and_conditioning_vector_form():
    torch.manual_seed(2)
    c = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    m = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    s = torch.rand(2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda c, m, s: adain(c, m, s), (c, m, s))
    layer = AdaIN(3, cond_dim=5)
    x = torch.randn(2, 3, 6)
    out = layer(x, torch.randn(2, 5))  # zero-init projection: std 1, mean 0 -> plain InstanceNorm
    assert_close(out, torch.nn.functional.instance_norm(x))


def test_adain_rejects_wrong_channels():
    with pytest.raises(ValueError, match=r"needs \(N, 3, ...\)"):
        AdaIN(3)(torch.randn(2, 4, 5), torch.randn(2, 4, 5))


# ----------------------------------------------------------------------------- adaLN-Zero


@pytest.mark.parametrize("shape", [(2, 5, 8), (3, 8)])
def test_adaln_zero_is_exactly_identity_at_init_and_the_gate_learns(shape):
    torch.manual_seed(3)
    block = AdaLNZero(8, 6, torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)))
    x = torch.randn(shape, requires_grad=True)
    c = torch.randn(shape[0], 6)
    y = block(x, c)
    assert torch.equal(y, x)
    y.pow(2).sum().backward()
    assert_close(x.grad, 2 * x.detach())  # the branch contributes nothing to the gradient either
    gate_rows = block.ada.weight.grad[16:]
    assert gate_rows.abs().max() > 0  # ... but the gate receives gradient, so it opens
    assert block.ada.weight.grad[:16].abs().max() == 0  # shift/scale wait for the gate


def test_adaln_zero_matches_float64_reference_after_training_starts():
    torch.manual_seed(4)
    branch = torch.nn.Linear(8, 8).double()
    block = AdaLNZero(8, 4, branch).double()
    with torch.no_grad():
        block.ada.weight.normal_()
        block.ada.bias.normal_()
    x, c = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    mod = block.ada(torch.nn.functional.silu(c))
    shift, scale, gate = mod[:, :8, None].transpose(1, 2), mod[:, 8:16, None].transpose(1, 2), mod[:, 16:, None]
    ln = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-6)
    expected = x + gate.transpose(1, 2) * branch(ln * (1 + scale) + shift)
    assert_close(block(x, c), expected)


# ----------------------------------------------------------------------------- connector norm


def test_connector_norm_forward_scale_matches_text_embedding_norm():
    torch.manual_seed(5)
    emb = torch.nn.Embedding(200, 48)
    with torch.no_grad():
        emb.weight.mul_(0.02)  # LM-like small embeddings: T ~ 0.14, far from sqrt(48)
    t = text_embedding_norm(emb)
    assert t == pytest.approx(emb.weight.double().norm(dim=1).mean().item())
    norm = ConnectorNorm.from_embedding(emb)
    assert_close(norm.weight.detach(), torch.full((48,), t / math.sqrt(48)))
    x = torch.randn(4, 9, 48) * 30  # projector output at an arbitrary scale
    y = norm(x)
    var = x.double().var(-1, unbiased=False)
    assert_close(y.double().norm(dim=-1), t * torch.sqrt(var / (var + 1e-5)), atol=1e-6, rtol=1e-5)
    assert y.norm(dim=-1).mean().item() == pytest.approx(t, rel=1e-4)


def test_connector_norm_backward_is_rescaled_exactly_by_one_over_mean_gain():
    torch.manual_seed(6)
    norm = ConnectorNorm(16, text_norm=0.5).double()
    with torch.no_grad():
        norm.weight.mul_(torch.rand(16, dtype=torch.float64) + 0.5)  # a non-uniform gain
    plain = torch.nn.LayerNorm(16).double()
    plain.load_state_dict(norm.state_dict())
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    up = torch.randn(3, 5, 16, dtype=torch.float64)
    y_ours, y_plain = norm(x), plain(x)
    assert_close(y_ours, y_plain, atol=0, rtol=0)  # forward unchanged
    g_ours = torch.autograd.grad((y_ours * up).sum(), [x, norm.weight, norm.bias])
    g_plain = torch.autograd.grad((y_plain * up).sum(), [x, plain.weight, plain.bias])
    factor = 1.0 / norm.weight.detach().mean().item()
    assert_close(g_ours[0], g_plain[0] * factor, atol=1e-14, rtol=1e-13)
    assert_close(g_ours[1], g_plain[1], atol=0, rtol=0)
    assert_close(g_ours[2], g_plain[2], atol=0, rtol=0)
    norm.rescale_backward = False
    (g_off,) = torch.autograd.grad((norm(x) * up).sum(), x)
    assert_close(g_off, g_plain[0], atol=0, rtol=0)


@pytest.mark.parametrize(("kwargs", "needle"), [({"dim": 0, "text_norm": 1.0}, "dim=0"),
                                                ({"dim": 4, "text_norm": -1.0}, "text_norm=-1.0")])  # fmt: skip
def test_connector_norm_bad_arguments(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ConnectorNorm(**kwargs)
