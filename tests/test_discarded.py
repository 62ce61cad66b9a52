"""The directions a norm discards (essay §03): closed-form Jacobians against autograd in float64, their exact
rank, the removed gradient share against a direct projection, measurement by behaviour, the Monitor metric."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.functional import jacobian

from normatlas.diagnostics import Monitor
from normatlas.diagnostics.discarded import (
    DiscardedDirections,
    discarded_basis,
    effective_rank,
    measure_site,
    normaliser_jacobian,
    removed_share,
)

F64 = {"rtol": 1e-10, "atol": 1e-12}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _ref(x: torch.Tensor, center: bool, eps: float) -> torch.Tensor:
    """Independent float64 reference of the pre-gain normaliser on one row."""
    xc = x - x.mean() if center else x
    return xc / torch.sqrt(xc.pow(2).mean() + eps)


@pytest.mark.parametrize("d", [5, 123])
@pytest.mark.parametrize("center", [True, False])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_closed_form_jacobian_matches_autograd(d: int, center: bool, eps: float) -> None:
    g = torch.Generator().manual_seed(d)
    x = torch.randn(3, d, generator=g, dtype=torch.float64) * 2 + 0.7
    jac = normaliser_jacobian(x, center=center, eps=eps)
    for i in range(3):
        torch.testing.assert_close(jac[i], jacobian(lambda v: _ref(v, center, eps), x[i]), **F64)
    if center:  # and the peer: torch's layer_norm without affine
        peer = jacobian(lambda v: F.layer_norm(v, (d,), eps=eps), x[0])
        torch.testing.assert_close(jac[0], peer, **F64)


@pytest.mark.parametrize("d", [5, 123])
@pytest.mark.parametrize("center", [True, False])
def test_rank_is_d_minus_2_for_layernorm_and_d_minus_1_for_rmsnorm(d: int, center: bool) -> None:
    x = torch.randn(4, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    jac = normaliser_jacobian(x, center=center)
    k = 2 if center else 1
    s = torch.linalg.svdvals(jac)
    xc = x - x.mean(-1, keepdim=True) if center else x
    sigma = xc.pow(2).mean(-1).sqrt()
    # (I - P) / sigma with P the projector on span{1, x_hat}: D - k singular values 1 / sigma, k zeros
    torch.testing.assert_close(s[:, : d - k], (1 / sigma).unsqueeze(-1).expand(4, d - k), **F64)
    assert float(s[:, d - k :].max()) < 1e-12 * float(s[:, 0].min())
    assert effective_rank(jac).tolist() == [d - k] * 4
    # the discarded directions are the null space: J 1 = 0 (LayerNorm) and J x_hat = 0
    basis = discarded_basis(x, center=center)
    assert basis.shape == (4, d, k)
    torch.testing.assert_close(jac @ basis, torch.zeros(4, d, k, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("d", [5, 123])
@pytest.mark.parametrize("center", [True, False])
def test_removed_share_is_the_projection_on_span_1_xhat(d: int, center: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, d, generator=gen, dtype=torch.float64) + 0.3
    g = torch.randn(6, d, generator=gen, dtype=torch.float64)
    share = removed_share(x, g, center=center)
    for i in range(6):
        xc = x[i] - x[i].mean() if center else x[i]
        cols = [torch.ones(d, dtype=torch.float64), xc] if center else [xc]
        a = torch.stack(cols, dim=1)
        coef = torch.linalg.lstsq(a, g[i].unsqueeze(-1)).solution
        direct = (a @ coef).norm() / g[i].norm()
        torch.testing.assert_close(share[i], direct.squeeze(), **F64)
    # and it is what the backward pass drops: sigma J g = g - P g
    xc = x - x.mean(-1, keepdim=True) if center else x
    sigma = xc.pow(2).mean(-1, keepdim=True).sqrt()
    kept = sigma * (normaliser_jacobian(x, center=center) @ g.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close((g - kept).norm(dim=-1) / g.norm(dim=-1), share, **F64)


class HandRMS(nn.Module):
    """An RMSNorm no type list knows, with a Gemma-style (1 + w) gain: found and read by behaviour only."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.scale)


@pytest.mark.parametrize("d", [5, 123])
@pytest.mark.parametrize("kind", ["layernorm", "hand_rms"])
def test_measure_site_divides_out_the_probed_gain(d: int, kind: str) -> None:
    torch.manual_seed(3)
    module: nn.Module = nn.LayerNorm(d, eps=1e-6) if kind == "layernorm" else HandRMS(d)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.rand(p.shape) + 0.5)
    x, g = torch.randn(7, d) * 3, torch.randn(7, d)
    site = measure_site(module, x, g)
    center = kind == "layernorm"
    assert site.dim == d and site.deficit == (2 if center else 1)
    assert site.rank_min == site.rank_max == d - site.deficit
    gain = module.weight if center else 1 + module.scale  # type: ignore[operator]
    expect = removed_share(x, g * gain.detach(), center=center)
    torch.testing.assert_close(site.share_mean, float(expect.mean()), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(site.share_max, float(expect.max()), rtol=1e-6, atol=1e-9)


class _Block(nn.Module):
    def __init__(self, d: int, norm: nn.Module) -> None:
        super().__init__()
        self.norm, self.fc = norm, nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(torch.tanh(self.norm(x)))


class _Tiny(nn.Module):
    """Two Pre-norm blocks, one LayerNorm and one hand-written RMSNorm, width 12 (a shrunk residual stack)."""

    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, d)
        self.blocks = nn.ModuleList([_Block(d, nn.LayerNorm(d)), _Block(d, HandRMS(d))])
        self.head = nn.Linear(d, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_monitor_metric_on_a_tiny_model() -> None:
    torch.manual_seed(4)
    model = _Tiny()
    with torch.no_grad():
        model.blocks[1].norm.scale.normal_(0, 0.3)
    mon = Monitor(model, every=1, metrics=[DiscardedDirections(tokens=1000)], print_alarms=False)
    seen: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(m: nn.Module, args: tuple[torch.Tensor, ...], y: torch.Tensor) -> None:
        y.retain_grad()  # raises on a tensor without grad: the metric's probes must not fire user hooks
        seen[m] = (args[0].detach(), y)

    for b in model.blocks:
        b.norm.register_forward_hook(hook)
    ids = torch.randint(32, (2, 5))
    F.cross_entropy(model(ids).reshape(-1, 32), ids.roll(-1, 1).reshape(-1)).backward()
    mon.step()
    rec = mon.last
    assert rec["discarded_rank/blocks.0.norm"] == 2.0
    assert rec["discarded_rank/blocks.1.norm"] == 1.0
    shares = []
    for i, (center, gain) in enumerate([(True, model.blocks[0].norm.weight), (False, 1 + model.blocks[1].norm.scale)]):
        x, y = seen[model.blocks[i].norm]
        assert y.grad is not None
        share = removed_share(x.reshape(-1, 12), (y.grad * gain.detach()).reshape(-1, 12), center=center)
        torch.testing.assert_close(rec[f"discarded_grad/blocks.{i}.norm"], float(share.mean()), rtol=1e-6, atol=1e-9)
        shares.append(float(share.mean()))
    torch.testing.assert_close(rec["discarded_grad_max"], max(shares), rtol=1e-6, atol=1e-9)
    assert min(shares) > 0 and max(shares) < 1
    # a later step measures afresh
    model.zero_grad()
    F.cross_entropy(model(ids).reshape(-1, 32), ids.roll(-1, 1).reshape(-1)).backward()
    mon.step()
    assert mon.last["discarded_rank/blocks.0.norm"] == 2.0


def test_monitor_metric_leaves_out_a_channels_first_batchnorm() -> None:
    torch.manual_seed(5)
    model = nn.Sequential(
        nn.Conv1d(3, 6, 1), nn.BatchNorm1d(6), nn.Flatten(), nn.Linear(24, 6), nn.LayerNorm(6, eps=1e-9)
    )
    mon = Monitor(model, every=1, metrics=[DiscardedDirections()], print_alarms=False)
    model(torch.randn(5, 3, 4)).pow(2).sum().backward()
    mon.step()
    assert mon.last["discarded_rank/4"] == 2.0
    assert not any(k.startswith("discarded_rank/1") for k in mon.last)


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="tokens"):
        DiscardedDirections(tokens=0)
    with pytest.raises(ValueError, match="eps"):
        normaliser_jacobian(torch.randn(2, 5), eps=-1.0)
    with pytest.raises(ValueError, match="shape"):
        removed_share(torch.randn(2, 5), torch.randn(2, 4))
