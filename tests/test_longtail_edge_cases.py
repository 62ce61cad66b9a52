"""Edge cases of the long-tail layers: Ghost BN's last virtual batch, Renorm on one value, PowerNorm's dtype, AdaIN."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from normatlas import Layout
from normatlas.longtail import (
    AdaIN,
    AdaLNZero,
    BatchRenorm,
    ConnectorNorm,
    GhostBatchNorm,
    HypersphereConstraint,
    PowerNorm,
    ngpt_constraint,
)

F64 = torch.float64


def _bn(x: torch.Tensor) -> torch.Tensor:
    return F.batch_norm(x, None, None, training=True)


def _unbiased_var(x: torch.Tensor) -> torch.Tensor:
    """Per-channel unbiased variance of an (N, C, ...) tensor."""
    return x.transpose(0, 1).reshape(x.shape[1], -1).var(1)


# --------------------------------------------------------------------------- Ghost BatchNorm
@pytest.mark.parametrize("n", [5, 9])
def test_ghost_merges_a_last_virtual_batch_of_one_value_per_feature(n):
    """Batch 5 (or 9) in virtual batches of 4 leaves one sample of one value per feature: it joins the chunk before."""
    torch.manual_seed(0)
    x = torch.randn(n, 4, dtype=F64) * 3 + 1
    g = GhostBatchNorm(4, virtual_batch_size=4, momentum=1.0, dtype=F64)
    y = g(x)
    parts = [x[: n - 5], x[n - 5 :]] if n > 5 else [x]
    assert_close(y, torch.cat([_bn(p) for p in parts if len(p)]))
    assert y[-1].abs().min() > 0  # no row of zeros from a one-sample batch
    counts = torch.tensor([float(len(p)) for p in parts if len(p)], dtype=F64)
    var = torch.stack([_unbiased_var(p) for p in parts if len(p)])
    assert_close(g.running_var, ((counts[:, None] * var).sum(0) / counts.sum()).float())
    assert_close(g.running_mean, x.mean(0).float())  # the count-weighted mean of the chunk means


def test_ghost_keeps_a_one_sample_last_chunk_that_has_positions():
    torch.manual_seed(1)
    x = torch.randn(5, 3, 7, dtype=F64)
    y = GhostBatchNorm(3, virtual_batch_size=4, dtype=F64)(x)
    assert_close(y, torch.cat([_bn(x[:4]), _bn(x[4:])]))  # 7 values per channel: its own statistics


def test_ghost_running_statistics_weight_chunks_by_their_counts():
    torch.manual_seed(2)
    x = torch.randn(10, 3, 5, dtype=F64) * 2 - 1
    g = GhostBatchNorm(3, virtual_batch_size=4, momentum=1.0, dtype=F64)
    g(x)
    parts = [x[:4], x[4:8], x[8:]]  # 20, 20 and 10 values per channel
    w = torch.tensor([20.0, 20.0, 10.0], dtype=F64)[:, None]
    var = torch.stack([_unbiased_var(p) for p in parts])
    assert_close(g.running_var, ((w * var).sum(0) / w.sum()).float())
    assert_close(g.running_mean, x.mean((0, 2)).float())  # the count-weighted mean of means is the batch mean


def test_ghost_running_statistics_weight_masked_chunks_by_their_real_counts():
    torch.manual_seed(3)
    x = torch.randn(6, 5, 3, dtype=F64)
    lengths = torch.tensor([5, 1, 3, 2, 4, 5])
    mask = (torch.arange(5)[None, :] < lengths[:, None])[..., None]
    g = GhostBatchNorm(3, virtual_batch_size=4, momentum=1.0, layout=Layout.N_ANY_C, dtype=F64)
    g(x, mask=mask)
    chunks = [(x[:4], mask[:4]), (x[4:], mask[4:])]
    counts, means, vars_ = [], [], []
    for xc, mc in chunks:
        valid = xc[mc.expand_as(xc)].reshape(-1, 3)
        counts.append(float(valid.shape[0]))
        means.append(valid.mean(0))
        vars_.append(valid.var(0))
    w = torch.tensor(counts, dtype=F64)[:, None]
    assert_close(g.running_mean, ((w * torch.stack(means)).sum(0) / w.sum()).float())
    assert_close(g.running_var, ((w * torch.stack(vars_)).sum(0) / w.sum()).float())


# --------------------------------------------------------------------------- PowerNorm
def test_powernorm_running_phi_is_computed_in_the_input_dtype():
    torch.manual_seed(4)
    pn = PowerNorm(4, alpha_fwd=0.9).double()  # float64 buffers: the update must not round through float32
    x = torch.randn(3, 5, 4, dtype=F64) * 1.7
    pn(x)
    assert pn.running_phi.dtype == F64
    expected = 0.9 * torch.ones(4, dtype=F64) + 0.1 * x.pow(2).mean((0, 1))
    assert_close(pn.running_phi, expected, atol=1e-15, rtol=1e-15)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_powernorm_buffers_stay_fp32_when_the_module_is_cast_to_half(half):
    torch.manual_seed(5)
    pn = PowerNorm(4, alpha_fwd=0.9, alpha_bkw=0.5).to(half)  # as model.half() / model.to(bf16) do
    assert pn.weight is not None and pn.weight.dtype == half
    assert pn.running_phi.dtype == torch.float32 and pn.nu.dtype == torch.float32
    x = (torch.randn(3, 5, 4) * 1.7).to(half).requires_grad_(True)
    up = torch.randn(3, 5, 4).to(half)
    (pn(x) * up).sum().backward()
    xf = x.detach().float()
    assert_close(pn.running_phi, 0.9 + 0.1 * xf.pow(2).mean((0, 1)), atol=1e-6, rtol=1e-6)  # not rounded to half
    x_hat = xf / torch.sqrt(torch.tensor(1.0 + 1e-5))  # psi_{t-1}^2 = 1, gamma = 1
    assert_close(pn.nu, 0.5 * (up.float() * x_hat).mean((0, 1)), atol=1e-6, rtol=1e-6)  # nu_0 = 0
    assert pn.double().running_phi.dtype == F64  # float64 is kept, not lowered


# --------------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("eps", [-1.0, 0.0, float("nan")])
@pytest.mark.parametrize(
    "build",
    [lambda eps: AdaIN(4, eps=eps), lambda eps: AdaLNZero(4, 3, torch.nn.Identity(), eps=eps),
     lambda eps: ConnectorNorm(4, 1.0, eps=eps)],
    ids=["AdaIN", "AdaLNZero", "ConnectorNorm"],
)  # fmt: skip
def test_conditioning_norms_reject_a_bad_eps(build, eps):
    with pytest.raises(ValueError, match=rf"eps={eps!r} must be a finite float > 0"):
        build(eps)


def test_hypersphere_constraint_rejects_a_non_int_dim_by_name():
    with pytest.raises(TypeError, match=r"dim='1' must be an int"):
        HypersphereConstraint([(torch.zeros(3, 4), "1")])  # type: ignore[list-item]


# --------------------------------------------------------------------------- nGPT
def test_ngpt_constraint_normalises_a_square_output_projection_per_column():
    # nGPT (NVIDIA/ngpt normalize_matrices): q / k / v are per row (dim 1), the square attention output
    # projection, which writes into the stream, per column (dim 0); shapes alone cannot tell them apart
    torch.manual_seed(6)
    d = 8
    model = torch.nn.ModuleDict({"q": torch.nn.Linear(d, d, bias=False), "o": torch.nn.Linear(d, d, bias=False)})
    ngpt_constraint(model, d, writes=[model["o"]])
    assert_close(model["q"].weight.norm(dim=1), torch.ones(d))
    assert_close(model["o"].weight.norm(dim=0), torch.ones(d))
    assert (model["o"].weight.norm(dim=1) - 1).abs().max() > 1e-3  # not per row
    bad = torch.nn.Sequential(torch.nn.Linear(d, 5))
    with pytest.raises(ValueError, match="out_features=5"):
        ngpt_constraint(bad, d, writes=[bad[0]])
    with pytest.raises(TypeError, match=r"writes must hold nn\.Linear"):
        ngpt_constraint(model, d, writes=[torch.nn.Embedding(3, d)])  # type: ignore[list-item]


# --------------------------------------------------------------------------- AdaIN
@pytest.mark.parametrize(("cond_dim", "message"), [
    (0, r"cond_dim=0 must be an integer >= 1 or None"),
    (-3, r"cond_dim=-3 must be an integer >= 1 or None"),
    (2.5, r"cond_dim=2\.5 must be an integer >= 1 or None"),
    (True, r"cond_dim=True must be an integer >= 1 or None"),
])  # fmt: skip
def test_adain_rejects_a_bad_cond_dim(cond_dim, message):
    with pytest.raises(ValueError, match=message):
        AdaIN(4, cond_dim=cond_dim)


def test_adain_accepts_cond_dim_none_or_positive():
    assert AdaIN(4).proj is None
    proj = AdaIN(4, cond_dim=3).proj
    assert proj is not None and (proj.in_features, proj.out_features) == (3, 8)


# --------------------------------------------------------------------------- Batch Renormalization
def test_renorm_on_one_value_per_channel_raises_and_keeps_its_estimates():
    r = BatchRenorm(4)
    before = {k: v.clone() for k, v in r.state_dict().items()}
    with pytest.raises(ValueError, match=r"Expected more than 1 value per channel when training"):
        r(torch.randn(1, 4))
    for k, v in r.state_dict().items():
        assert_close(v, before[k], atol=0, rtol=0, msg=f"{k} changed")
    assert r.eval()(torch.randn(1, 4)).shape == (1, 4)  # eval uses the running estimates


def test_ghost_virtual_batches_of_one_value_name_virtual_batch_size():
    with pytest.raises(ValueError, match=r"virtual_batch_size=1 splits an input of shape \(6, 4\)"):
        GhostBatchNorm(4, virtual_batch_size=1)(torch.randn(6, 4))
    y = GhostBatchNorm(4, virtual_batch_size=1)(x := torch.randn(6, 4, 3))  # 3 values per feature: fine
    assert_close(y, torch.cat([_bn(p) for p in x.split(1)]))
