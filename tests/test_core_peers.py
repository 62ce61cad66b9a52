"""Presets against their peers: torch.nn and HF transformers, forward and backward, every dtype.

These test the reference path (``backend="reference"``), whose claims are bit for bit where the cast order matches;
the fused path of the same modules is held to float64 against the peers in tests/test_kernels_default.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normatlas as na
from normatlas import Backend, CastOrder

REF = Backend.REFERENCE

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
# forward: ours vs the peer in the same dtype; the peer's own rounding differs by about one ulp
FWD_TOL = {
    torch.float64: {"atol": 1e-12, "rtol": 1e-12},
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 4e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
}
# backward: input and parameter gradients reduce over rows, so allow a few ulps of the gradient scale
BWD_TOL = {
    torch.float64: {"atol": 1e-10, "rtol": 1e-10},
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 5e-2, "rtol": 1e-2},
    torch.bfloat16: {"atol": 2e-1, "rtol": 5e-2},
}


def _randomize(module: nn.Module, gen: torch.Generator, center: float = 1.0) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5 + center)


def _compare(ours: nn.Module, peer: nn.Module, shape, dtype, *, exact: bool = False, center: float = 1.0):
    gen = torch.Generator().manual_seed(1)
    ours, peer = ours.to(dtype), peer.to(dtype)
    _randomize(peer, gen, center)
    missing = ours.load_state_dict(peer.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 1).to(dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = ours(xa), peer(xb)
    assert a.dtype == b.dtype and a.shape == b.shape
    if exact:
        assert torch.equal(a, b), f"max diff {(a.double() - b.double()).abs().max().item()}"
    else:
        torch.testing.assert_close(a, b, **FWD_TOL[dtype])
    g = torch.randn(shape, generator=gen, dtype=torch.float64).to(a.dtype)
    ga = torch.autograd.grad(a, [xa, *ours.parameters()], g)
    gb = torch.autograd.grad(b, [xb, *peer.parameters()], g)
    for u, v in zip(ga, gb, strict=True):
        if exact:
            assert torch.equal(u, v)
        else:
            torch.testing.assert_close(u, v, **BWD_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,normalized_shape",
    [((5, 123, 123), 123), ((1, 1, 1023), 1023), ((7, 3, 5), (3, 5)), ((0, 16), 16), ((16,), 16)],
)
@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)])
def test_layernorm_vs_torch(dtype, shape, normalized_shape, affine, bias):
    _compare(
        na.LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=affine, bias=bias, backend=REF),
        nn.LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=affine, bias=bias),
        shape, dtype,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,normalized_shape", [((5, 123, 123), 123), ((1, 1, 1023), 1023), ((4, 3, 6), (3, 6))])
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_rmsnorm_vs_torch(dtype, shape, normalized_shape, eps):
    """Bit-for-bit: torch.nn.RMSNorm also casts after the gain, and eps=None is the opmath machine eps."""
    exact = dtype is not torch.float64  # fp64 rsqrt in torch's composite vs ours: same ops
    _compare(
        na.RMSNorm(normalized_shape, eps=eps, backend=REF),
        nn.RMSNorm(normalized_shape, eps=eps),
        shape,
        dtype,
        exact=exact,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups,shape", [(3, (4, 12, 7, 9)), (1, (2, 6, 5)), (6, (3, 6, 4, 2, 3)), (2, (0, 4, 3))])
@pytest.mark.parametrize("affine", [True, False])
def test_groupnorm_vs_torch(dtype, groups, shape, affine):
    c = shape[1]
    _compare(na.GroupNorm(groups, c, affine=affine), nn.GroupNorm(groups, c, affine=affine), shape, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "ours_cls,peer_cls,shape",
    [
        (na.InstanceNorm1d, nn.InstanceNorm1d, (3, 5, 17)),
        (na.InstanceNorm1d, nn.InstanceNorm1d, (5, 17)),  # unbatched
        (na.InstanceNorm2d, nn.InstanceNorm2d, (2, 4, 7, 9)),
        (na.InstanceNorm3d, nn.InstanceNorm3d, (2, 3, 4, 5, 3)),
    ],
)
@pytest.mark.parametrize("affine,track", [(False, False), (True, False), (True, True)])
def test_instancenorm_vs_torch(dtype, ours_cls, peer_cls, shape, affine, track):
    c = shape[-3] if ours_cls is na.InstanceNorm2d else shape[1] if len(shape) > 2 else shape[0]
    if ours_cls is na.InstanceNorm3d:
        c = shape[1]
    ours = ours_cls(c, affine=affine, track_running_stats=track)
    peer = peer_cls(c, affine=affine, track_running_stats=track)
    _compare(ours, peer, shape, dtype)
    if track:
        torch.testing.assert_close(ours.running_mean, peer.running_mean)
        torch.testing.assert_close(ours.running_var, peer.running_var)
        ours.eval(), peer.eval()
        _compare(ours, peer, shape, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_instancenorm_half_vs_torch(dtype):
    _compare(na.InstanceNorm2d(4, affine=True), nn.InstanceNorm2d(4, affine=True), (2, 4, 7, 9), dtype)


def test_running_statistics_stay_fp32_under_half():
    m = na.InstanceNorm2d(4, affine=True, track_running_stats=True).to(torch.bfloat16)
    assert m.weight.dtype is torch.bfloat16
    assert m.running_mean.dtype is torch.float32 and m.running_var.dtype is torch.float32
    m(torch.randn(2, 4, 5, 5, dtype=torch.bfloat16))  # the generic path updates fp32 estimates
    assert m.running_var.dtype is torch.float32 and not torch.equal(m.running_var, torch.ones(4))


transformers = pytest.importorskip("transformers")
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemmaRMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm as HFLlamaRMSNorm  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 123, 123), (1, 1, 1023), (0, 64)])
def test_rmsnorm_cast_before_gain_is_llama_bit_for_bit(dtype, shape):
    d = shape[-1]
    ours = na.RMSNorm(d, eps=1e-6, cast_order=CastOrder.BEFORE_GAIN, backend=REF)
    _compare(ours, HFLlamaRMSNorm(d, eps=1e-6), shape, dtype, exact=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 123, 123), (1, 1, 1023), (0, 64)])
def test_gemma_rmsnorm_is_hf_bit_for_bit(dtype, shape):
    d = shape[-1]
    _compare(
        na.GemmaRMSNorm(d, eps=1e-6, backend=REF), HFGemmaRMSNorm(d, eps=1e-6), shape, dtype, exact=True, center=0.0
    )


def test_llama_and_gemma_cast_orders_differ_in_bf16():
    """The two conventions are different functions in half precision (same in fp32)."""
    x = torch.randn(64, 257, dtype=torch.bfloat16) * 3
    w = torch.randn(257, dtype=torch.bfloat16)
    llama = na.RMSNorm(257, 1e-6, cast_order=CastOrder.BEFORE_GAIN).bfloat16()
    torchs = na.RMSNorm(257, 1e-6, cast_order=CastOrder.AFTER_GAIN).bfloat16()
    for m in (llama, torchs):
        m.weight.data.copy_(w)
    assert not torch.equal(llama(x), torchs(x))
    assert torch.equal(llama.float()(x.float()), torchs.float()(x.float()))


def test_gemma_weights_in_a_llama_layer_are_the_porting_bug():
    """Loading (1+w) weights into a w-convention layer without adding 1 gives garbage; adding 1 fixes it."""
    d = 32
    gemma = HFGemmaRMSNorm(d)
    nn.init.normal_(gemma.weight, std=0.1)
    x = torch.randn(4, d)
    naive = na.RMSNorm(d, eps=1e-6)
    naive.load_state_dict(gemma.state_dict())
    assert (naive(x) - gemma(x)).abs().max() > 0.5
    naive.weight.data.add_(1.0)
    torch.testing.assert_close(naive(x), gemma(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_layernorm2d_matches_permuted_layer_norm(dtype):
    x = (torch.randn(2, 7, 5, 9) * 2 + 1).to(dtype)
    m = na.LayerNorm2d(7).to(dtype)
    with torch.no_grad():
        m.weight.normal_(), m.bias.normal_()
    ref = F.layer_norm(x.permute(0, 2, 3, 1), (7,), m.weight, m.bias, 1e-6).permute(0, 3, 1, 2)
    torch.testing.assert_close(m(x), ref, **FWD_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm_matches_f_normalize(dtype):
    x = (torch.randn(3, 5, 37) * 2).to(dtype)
    x[0, 0] = 0
    ours = na.L2Norm()(x)
    if dtype is torch.float16:
        # torch computes in fp16, where eps=1e-12 underflows to 0 and a zero row becomes 0/0; ours stays fp32
        assert torch.isnan(F.normalize(x, dim=-1)[0, 0]).all() and torch.isfinite(ours).all()
    peer = F.normalize(x.float() if dtype in (torch.float16, torch.bfloat16) else x, dim=-1).to(dtype)
    torch.testing.assert_close(ours, peer, **FWD_TOL[dtype])


def test_scalenorm_formula_and_init():
    m = na.ScaleNorm(64).double()
    assert m.weight.shape == () and m.weight.item() == pytest.approx(8.0)
    x = torch.randn(3, 64, dtype=torch.float64)
    torch.testing.assert_close(m(x), 8.0 * x / x.norm(dim=-1, keepdim=True))
    tiny = torch.full((1, 64), 1e-9, dtype=torch.float64)
    torch.testing.assert_close(m(tiny), 8.0 * tiny / 1e-5)  # the norm is clamped at eps


def test_native_dispatch_is_used_for_layer_norm(monkeypatch):
    """Where torch has a kernel for exactly the same function the module uses it."""
    calls = []
    real = F.layer_norm
    monkeypatch.setattr(F, "layer_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    na.LayerNorm(8, backend=REF)(torch.randn(2, 8))
    assert calls
    calls.clear()
    na.LayerNorm(8, cast_order=CastOrder.BEFORE_GAIN, backend=REF)(
        torch.randn(2, 8).bfloat16()
    )  # not the same function
    assert not calls
