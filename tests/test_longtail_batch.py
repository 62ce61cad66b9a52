"""BatchNorm preset and its variants: the essay's defining properties, against torch and float64 references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from normatlas import Layout
from normatlas.longtail import (
    PAPER_D_MAX,
    PAPER_R_MAX,
    BatchNorm,
    BatchNorm1d,
    BatchNorm2d,
    BatchRenorm,
    FrozenBatchNorm,
    GhostBatchNorm,
    PowerNorm,
    Ramp,
    power_norm,
)

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}


def _copy_state(src, dst):
    dst.load_state_dict(src.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("ours", "theirs", "shape"), [
    (BatchNorm1d, torch.nn.BatchNorm1d, (5, 7)), (BatchNorm1d, torch.nn.BatchNorm1d, (5, 7, 33)),
    (BatchNorm2d, torch.nn.BatchNorm2d, (3, 7, 9, 11)),
])  # fmt: skip
def test_batchnorm_matches_torch_train_and_eval(ours, theirs, shape, dtype):
    torch.manual_seed(0)
    c = shape[1]
    a, b = ours(c, momentum=0.2, dtype=dtype), theirs(c, momentum=0.2, dtype=torch.float32)
    with torch.no_grad():
        a.weight.normal_()
        a.bias.normal_()
        b.weight.copy_(a.weight.float())
        b.bias.copy_(a.bias.float())
    assert a.running_var.dtype == torch.float32  # running statistics stay fp32 with bf16 parameters
    for _ in range(3):
        x = (torch.randn(shape) * 2 + 0.5).requires_grad_(True)
        xa = x.detach().to(dtype).requires_grad_(True)
        up = torch.randn(shape)
        ya, yb = a(xa), b(x)
        assert_close(ya.float(), yb, **TOL[dtype])
        (ya.float() * up).sum().backward()
        (yb * up).sum().backward()
        assert_close(xa.grad.float(), x.grad, **TOL[dtype])
    assert_close(a.running_mean, b.running_mean, **TOL[dtype])
    assert_close(a.running_var, b.running_var, **TOL[dtype])
    a.eval(), b.eval()
    x = torch.randn(shape)
    assert_close(a(x.to(dtype)).float(), b(x), **TOL[dtype])


def test_padding_mask_keeps_padding_out_of_statistics():
    """Failure mode 2: a padded (B, T, D) batch with its mask equals BN over the real tokens only."""
    torch.manual_seed(1)
    lengths = [5, 2, 3]
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    mask = torch.arange(5)[None, :] < torch.tensor(lengths)[:, None]
    x[~mask] = 1e3  # garbage in the padding
    bn = BatchNorm(4, layout=Layout.N_ANY_C, dtype=torch.float64)
    y = bn(x, mask=mask[..., None])
    real = x[mask]  # (10, 4)
    ref = torch.nn.BatchNorm1d(4, dtype=torch.float64)
    assert_close(y[mask], ref(real))
    assert_close(bn.running_mean, ref.running_mean.float())
    assert_close(bn.running_var, ref.running_var.float())
    unmasked = BatchNorm(4, layout=Layout.N_ANY_C, dtype=torch.float64)(x)
    assert (unmasked[mask] - ref(real)).abs().max() > 0.1  # without the mask the padding contaminates


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 6), i=st.integers(0, 5), j=st.integers(0, 5), seed=st.integers(0, 1000))
def test_cross_example_leakage_in_train_not_in_eval(n, i, j, seed):
    """Failure mode 4: in train mode example i's output moves when example j changes; in eval it does not."""
    i, j = i % n, j % n
    if i == j:
        j = (i + 1) % n
    torch.manual_seed(seed)
    x = torch.randn(n, 3, 4, dtype=torch.float64)
    x2 = x.clone()
    x2[j] += 5.0
    for cls in (BatchNorm, GhostBatchNorm, BatchRenorm):
        m = cls(3, dtype=torch.float64)
        assert (m(x)[i] - m(x2)[i]).abs().max() > 1e-3
        m.eval()
        assert_close(m(x)[i], m(x2)[i], atol=0, rtol=0)
    pn = PowerNorm(3, layout=Layout.NC_ANY, dtype=torch.float64).eval()
    assert_close(pn(x)[i], pn(x2)[i], atol=0, rtol=0)


def test_ghost_with_virtual_batch_equal_to_batch_is_batchnorm():
    torch.manual_seed(2)
    x = torch.randn(8, 3, 5)
    g, b = GhostBatchNorm(3, virtual_batch_size=8), BatchNorm(3)
    for _ in range(2):
        assert_close(g(x), b(x))
    assert_close(g.running_mean, b.running_mean)
    assert_close(g.running_var, b.running_var)


def test_ghost_normalizes_each_virtual_batch_by_its_own_statistics():
    torch.manual_seed(3)
    x = torch.randn(10, 3, 5)
    g = GhostBatchNorm(3, virtual_batch_size=4, momentum=1.0)
    y = g(x)
    parts = [x[:4], x[4:8], x[8:]]
    assert_close(y, torch.cat([torch.nn.functional.batch_norm(p, None, None, training=True) for p in parts]))
    counts = torch.tensor([[20.0], [20.0], [10.0]])  # values per channel in each virtual batch
    unbiased = (counts * torch.stack([p.transpose(0, 1).reshape(3, -1).var(1) for p in parts])).sum(0) / 50
    # momentum 1: the virtual batches' statistics averaged by their counts (the short last one weighs half)
    assert_close(g.running_var, unbiased)


def test_ghost_backward_is_per_virtual_batch_batchnorm_backward():
    torch.manual_seed(3)
    x = torch.randn(10, 3, 5, dtype=torch.float64, requires_grad=True)
    up = torch.randn(10, 3, 5, dtype=torch.float64)
    g = GhostBatchNorm(3, virtual_batch_size=4, dtype=torch.float64)
    (gx,) = torch.autograd.grad((g(x) * up).sum(), x)
    xr = x.detach().clone().requires_grad_(True)
    parts = [torch.nn.functional.batch_norm(p, None, None, training=True) for p in xr.split(4)]
    (ref,) = torch.autograd.grad((torch.cat(parts) * up).sum(), xr)
    assert_close(gx, ref)


def test_renorm_with_closed_clips_is_batchnorm_forward_and_backward():
    torch.manual_seed(4)
    r, b = BatchRenorm(3, momentum=0.1, r_max=1.0, d_max=0.0, dtype=torch.float64), BatchNorm(3, dtype=torch.float64)
    with torch.no_grad():  # make the running statistics differ from the batch ones
        r.running_mean.fill_(3.0)
        r.running_var.fill_(9.0)
        b.running_mean.fill_(3.0)
        b.running_var.fill_(9.0)
    x = torch.randn(6, 3, 7, dtype=torch.float64, requires_grad=True)
    up = torch.randn(6, 3, 7, dtype=torch.float64)
    (gr,) = torch.autograd.grad((r(x) * up).sum(), x)
    (gb,) = torch.autograd.grad((b(x) * up).sum(), x)
    assert_close(gr, gb)
    assert_close(r.running_mean, b.running_mean)
    assert_close(r.running_var, b.running_var)


def test_renorm_with_open_clips_is_the_eval_function():
    """Unclipped r and d make the training output equal (x - mu) / sigma with the running statistics."""
    torch.manual_seed(5)
    r = BatchRenorm(3, r_max=1e6, d_max=1e6, dtype=torch.float64)
    with torch.no_grad():
        r.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
        r.running_var.copy_(torch.tensor([4.0, 0.25, 1.0]))
        r.weight.normal_()
    expected = r.eval()(x := torch.randn(6, 3, 7, dtype=torch.float64))
    assert_close(r.train()(x), expected)


def test_renorm_backward_is_r_times_the_batchnorm_backward():
    """r and d are constants in the backward: dL/dx = r * (BatchNorm's dL/dx) per channel (float64)."""
    torch.manual_seed(5)
    r = BatchRenorm(3, momentum=0.0, r_max=1.5, d_max=1e6, affine=False, dtype=torch.float64)
    with torch.no_grad():
        r.running_var.copy_(torch.tensor([4.0, 0.25, 1.0]))
    x = torch.randn(6, 3, 7, dtype=torch.float64, requires_grad=True)
    up = torch.randn(6, 3, 7, dtype=torch.float64)
    (gx,) = torch.autograd.grad((r(x) * up).sum(), x)
    std_b = (x.detach().var((0, 2), unbiased=False) + 1e-5).sqrt()
    ratio = (std_b / (r.running_var.double() + 1e-5).sqrt()).clamp(1 / 1.5, 1.5)
    xr = x.detach().clone().requires_grad_(True)
    (gbn,) = torch.autograd.grad((torch.nn.functional.batch_norm(xr, None, None, training=True) * up).sum(), xr)
    assert_close(gx, gbn * ratio[None, :, None])
    assert (ratio != 1).all() and ((ratio == 1.5) | (ratio == 1 / 1.5)).any()  # clipping was exercised


def test_renorm_schedules():
    assert PAPER_R_MAX(0) == 1.0 and PAPER_R_MAX(40_000) == 3.0 and PAPER_R_MAX(22_500) == pytest.approx(2.0)
    assert PAPER_D_MAX(5_000) == 0.0 and PAPER_D_MAX(15_000) == pytest.approx(2.5) and PAPER_D_MAX(10**6) == 5.0
    r = BatchRenorm(2, r_max=Ramp(1.0, 2.0, 0, 2), d_max=Ramp(0.0, 1.0, 0, 4))
    seen = []
    for _ in range(3):
        seen.append(r.limits())
        r(torch.randn(4, 2))
    assert seen == [(1.0, 0.0), (1.5, 0.25), (2.0, 0.5)]


def test_frozen_equals_eval_batchnorm_and_has_no_parameters():
    torch.manual_seed(6)
    bn = torch.nn.BatchNorm2d(4)
    for _ in range(3):
        bn(torch.randn(5, 4, 3, 3) * 2 + 1)
    with torch.no_grad():
        bn.weight.normal_()
        bn.bias.normal_()
    bn.eval()
    f1 = FrozenBatchNorm.from_batchnorm(bn)
    f2 = FrozenBatchNorm(4)
    f2.load_state_dict(bn.state_dict())  # torch's state dict loads, num_batches_tracked ignored
    x = torch.randn(2, 4, 6, 5)
    for f in (f1, f2, f1.train()):
        assert_close(f(x), bn(x))
    assert list(f1.parameters()) == []


def _pn_reference(x, phi, nu, w, b, g, alpha_bkw, eps):
    """Float64 transcription of Shen et al. Algorithm 1 for (B, T, D)."""
    inv = (phi + eps).rsqrt()
    x_hat = x * inv
    y = x_hat * w + b
    gh = g * w
    dx = (gh - nu * x_hat) * inv
    n = x.shape[0] * x.shape[1]
    gamma_t = (x_hat * x_hat).sum((0, 1)) / n
    lambda_t = (gh * x_hat).sum((0, 1)) / n
    nu_new = nu * (1 - (1 - alpha_bkw) * gamma_t) + (1 - alpha_bkw) * lambda_t
    return y, dx, nu_new, (x * x).mean((0, 1))


def test_powernorm_forward_backward_and_running_updates_match_algorithm_1():
    torch.manual_seed(7)
    d = 5
    pn = PowerNorm(d, alpha_fwd=0.8, alpha_bkw=0.7, dtype=torch.float64)
    with torch.no_grad():
        pn.weight.normal_()
        pn.bias.normal_()
        pn.running_phi.copy_(torch.rand(d) + 0.5)
        pn.nu.copy_(torch.randn(d) * 0.1)
    for _ in range(2):
        phi, nu = pn.running_phi.double().clone(), pn.nu.double().clone()
        x = torch.randn(3, 4, d, dtype=torch.float64, requires_grad=True)
        g = torch.randn(3, 4, d, dtype=torch.float64)
        y = pn(x)
        (y * g).sum().backward()
        ry, rdx, rnu, psi_b = _pn_reference(x.detach(), phi, nu, pn.weight.detach(), pn.bias.detach(), g, 0.7, 1e-5)
        assert_close(y, ry)
        assert_close(x.grad, rdx)
        assert_close(pn.nu.double(), rnu, atol=1e-6, rtol=1e-6)
        assert_close(pn.running_phi.double(), 0.8 * phi + 0.2 * psi_b, atol=1e-6, rtol=1e-6)
        assert_close(pn.weight.grad, (g * x.detach() * (phi + 1e-5).rsqrt()).sum((0, 1)))
        pn.weight.grad = None
        pn.bias.grad = None


def test_powernorm_gradcheck_when_correction_is_frozen_at_zero():
    """alpha_bkw = 1 keeps nu at 0: the hand-written backward is then the exact gradient."""
    torch.manual_seed(8)
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    phi, nu = torch.rand(4, dtype=torch.float64) + 0.5, torch.zeros(4, dtype=torch.float64)
    mask = torch.rand(2, 3, 1) > 0.3
    assert torch.autograd.gradcheck(lambda x, w, b: power_norm(x, phi, nu, w, b, alpha_bkw=1.0), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w, b: power_norm(x, phi, nu, w, b, mask=mask, alpha_bkw=1.0), (x, w, b))
    assert nu.abs().max() == 0


def test_estimator_variance_of_the_batch_mean_falls_as_one_over_n():
    """Failure mode 1: Var[batch mean] = sigma^2 / N, measured from BN's own batch statistics."""
    torch.manual_seed(9)
    trials, c = 2000, 4
    for n in (2, 8, 32):
        x = torch.randn(trials, n, c, dtype=torch.float64) * 3.0  # sigma^2 = 9
        bn = BatchNorm(c, momentum=1.0, layout=Layout.N_ANY_C, dtype=torch.float64)
        means = []
        for t in range(trials):
            bn(x[t])
            means.append(bn.running_mean.clone())
        var = torch.stack(means).var(0).mean().item()
        assert var * n / 9.0 == pytest.approx(1.0, abs=0.1)


@pytest.mark.parametrize(("build", "needle"), [
    (lambda: GhostBatchNorm(3, virtual_batch_size=0), "virtual_batch_size=0"),
    (lambda: BatchRenorm(3, r_max=0.5), "r_max=0.5"),
    (lambda: BatchRenorm(3, d_max=-1.0), "d_max=-1.0"),
    (lambda: Ramp(1.0, 2.0, 10, 5), "finish=5 must be >= begin=10"),
    (lambda: PowerNorm(3, alpha_fwd=1.5), "alpha_fwd=1.5"),
    (lambda: BatchNorm(3, momentum=2.0), "momentum=2.0"),
    (lambda: FrozenBatchNorm.from_batchnorm(torch.nn.BatchNorm1d(3, track_running_stats=False)), "no running"),
    (lambda: FrozenBatchNorm.from_batchnorm(torch.nn.BatchNorm1d(3, eps=0.0)), r"eps=0.0; FrozenBatchNorm needs"),
])  # fmt: skip
def test_bad_arguments(build, needle):
    with pytest.raises(ValueError, match=needle):
        build()


def test_bad_layout_type():
    with pytest.raises(TypeError, match="layout='NCHW'"):
        BatchNorm(3, layout="NCHW")  # type: ignore[arg-type]


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.floats(0.01, 100.0), shift=st.floats(-50.0, 50.0))
def test_train_mode_batchnorm_is_invariant_to_per_channel_affine_input_changes(seed, scale, shift):
    """BN(a_c x + b_c) == BN(x) for a_c > 0 (statistics over samples and positions absorb both)."""
    torch.manual_seed(seed)
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    a = torch.tensor([scale, 1.0, 2.0], dtype=torch.float64)[None, :, None]
    b = torch.tensor([shift, -shift, 0.0], dtype=torch.float64)[None, :, None]
    bn = BatchNorm(3, eps=1e-12, track_running_stats=False, dtype=torch.float64)
    assert_close(bn(a * x + b), bn(x), atol=1e-8, rtol=1e-6)


def test_renorm_and_ghost_respect_the_padding_mask():
    torch.manual_seed(11)
    x = torch.randn(4, 6, 3, dtype=torch.float64)
    mask = (torch.arange(6)[None, :] < torch.tensor([6, 2, 4, 1])[:, None])[..., None]
    ref = BatchNorm(3, layout=Layout.N_ANY_C, dtype=torch.float64)
    y_ref = ref(x, mask=mask)
    ren = BatchRenorm(3, momentum=0.1, r_max=1.0, d_max=0.0, layout=Layout.N_ANY_C, dtype=torch.float64)
    ghost = GhostBatchNorm(3, virtual_batch_size=4, layout=Layout.N_ANY_C, dtype=torch.float64)
    for m in (ren, ghost):
        assert_close(m(x, mask=mask)[mask.expand_as(x)], y_ref[mask.expand_as(x)])
        assert_close(m.running_mean, ref.running_mean)
        assert_close(m.running_var, ref.running_var)
