"""The essay's algebra as property tests (hypothesis), in float64."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import normatlas as na

SEEDS = st.integers(0, 2**31 - 1)
DIMS = st.integers(2, 64)
SCALES = st.floats(1e-2, 1e2)


def _x(seed: int, d: int, rows: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, d, generator=g, dtype=torch.float64) * 2 + 0.5


def _layers(d: int) -> dict[str, torch.nn.Module]:
    return {
        "layernorm": na.LayerNorm(d, eps=1e-300).double(),
        "rmsnorm": na.RMSNorm(d, eps=1e-300).double(),
        "gemma": na.GemmaRMSNorm(d, eps=1e-300).double(),
        "l2norm": na.L2Norm(eps=1e-300).double(),
    }


@given(seed=SEEDS, d=DIMS, a=SCALES)
def test_rescaling_invariance(seed, d, a):
    """Norm(a x) = Norm(x) for LayerNorm, RMSNorm (both gain conventions) and L2Norm."""
    x = _x(seed, d)
    for layer in _layers(d).values():
        torch.testing.assert_close(layer(a * x), layer(x), atol=1e-9, rtol=1e-9)


@given(seed=SEEDS, d=DIMS, a=SCALES)
def test_rescaling_invariance_channels_first(seed, d, a):
    x = _x(seed, 4 * d, rows=1).reshape(1, 4, d)
    for layer in (na.GroupNorm(2, 4, eps=1e-300), na.InstanceNorm1d(4, eps=1e-300), na.LayerNorm2d(4, eps=1e-300)):
        layer = layer.double()
        torch.testing.assert_close(layer(a * x), layer(x), atol=1e-9, rtol=1e-9)


@given(seed=SEEDS, d=DIMS, c=st.floats(-50, 50).filter(lambda c: abs(c) > 0.5))
def test_recentring_invariance_layernorm_only(seed, d, c):
    """LN(x + c1) = LN(x); RMSNorm has no such invariance."""
    x = _x(seed, d)
    ln, rms = na.LayerNorm(d, eps=1e-300).double(), na.RMSNorm(d, eps=1e-300).double()
    torch.testing.assert_close(ln(x + c), ln(x), atol=1e-8, rtol=1e-8)
    assert (rms(x + c) - rms(x)).abs().max() > 1e-3


def _input_grad(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(layer(x), x, g)
    return grad


@given(seed=SEEDS, d=st.integers(3, 64))
def test_layernorm_gradient_projects_out_ones_and_xhat(seed, d):
    """The LN input gradient is orthogonal to 1 and to x_hat, whatever the gain; RMSNorm's only to x_hat."""
    x = _x(seed, d)
    g = _x(seed + 1, d)
    ln, rms = na.LayerNorm(d, eps=1e-300).double(), na.RMSNorm(d, eps=1e-300).double()
    with torch.no_grad():
        ln.weight.copy_(_x(seed + 2, d)[0])
        rms.weight.copy_(_x(seed + 3, d)[0])
    xhat_ln = (x - x.mean(-1, keepdim=True)) / x.std(-1, unbiased=False, keepdim=True)
    gl = _input_grad(ln, x, g)
    scale = gl.abs().max().item() + 1.0
    torch.testing.assert_close((gl * 1).sum(-1), torch.zeros(3, dtype=torch.float64), atol=1e-9 * scale, rtol=0)
    torch.testing.assert_close((gl * xhat_ln).sum(-1), torch.zeros(3, dtype=torch.float64), atol=1e-9 * scale, rtol=0)
    gr = _input_grad(rms, x, g)
    torch.testing.assert_close((gr * x).sum(-1), torch.zeros(3, dtype=torch.float64), atol=1e-9 * scale, rtol=0)
    assert gr.sum(-1).abs().max() > 1e-6  # RMSNorm keeps the component along 1


@given(seed=SEEDS, d=DIMS, a=SCALES)
def test_gradient_scales_inversely_with_input(seed, d, a):
    """Scaling the input by a scales the input gradient by 1/a (the 1/sigma prefactor)."""
    x, g = _x(seed, d), _x(seed + 1, d)
    for layer in _layers(d).values():
        torch.testing.assert_close(_input_grad(layer, a * x, g), _input_grad(layer, x, g) / a, atol=1e-8, rtol=1e-7)


@given(seed=SEEDS, d=DIMS)
def test_layernorm_image_is_a_sphere_in_the_zero_sum_hyperplane(seed, d):
    """Geometry: LN maps onto radius sqrt(D) in 1^T x = 0; RMSNorm onto radius sqrt(D), mean unconstrained."""
    x = _x(seed, d)
    ln, rms = na.LayerNorm(d, eps=1e-300, elementwise_affine=False), na.RMSNorm(d, eps=1e-300, elementwise_affine=False)
    y, z = ln(x), rms(x)
    torch.testing.assert_close(y.sum(-1), torch.zeros(3, dtype=torch.float64), atol=1e-9, rtol=0)
    torch.testing.assert_close(y.norm(dim=-1), torch.full((3,), d**0.5, dtype=torch.float64))
    torch.testing.assert_close(z.norm(dim=-1), torch.full((3,), d**0.5, dtype=torch.float64))


def test_batch_independence_follows_the_taxonomy():
    """Per-sample norms: output i ignores example j. A sample-reducing spec does not."""
    x = torch.randn(4, 6, 5, dtype=torch.float64)
    y = x.clone()
    y[1] += torch.randn(6, 5, dtype=torch.float64)
    per_sample = [na.LayerNorm(5), na.GroupNorm(2, 6), na.InstanceNorm1d(6)]
    for layer in per_sample:
        layer = layer.double()
        assert not layer.spec.batch_dependent
        torch.testing.assert_close(layer(x)[0], layer(y)[0])
    bn = na.Norm(na.NormSpec(layout=na.Layout.NC_ANY, reduce=frozenset({na.Axis.SAMPLE, na.Axis.POSITION})), 6)
    bn = bn.double()
    assert bn.spec.batch_dependent
    assert (bn(x)[0] - bn(y)[0]).abs().max() > 1e-3


@pytest.mark.parametrize("d", [8, 64])
def test_one_plus_w_starts_at_identity_scale(d):
    gemma, plain = na.GemmaRMSNorm(d), na.RMSNorm(d, eps=1e-6)
    assert torch.equal(gemma.weight, torch.zeros(d)) and torch.equal(plain.weight, torch.ones(d))
    x = torch.randn(3, d)
    torch.testing.assert_close(gemma(x), plain(x))


def test_spec_survives_pickling_into_another_process() -> None:
    """A NormSpec pickled in one process (another hash seed) is equal to, and hashes like, the same spec built in
    this one, so it finds the plan caches' and any dict's entries; a copy validates again (a frozen dataclass
    pickled with its cached hash had kept the other process's)."""
    import copy
    import os
    import pickle
    import subprocess
    import sys

    from normatlas import CastOrder, EpsPlacement, GainConvention, NormSpec

    spec = NormSpec(center=False, bias=False, eps=1e-6, cast_order=CastOrder.BEFORE_GAIN,
                    gain_convention=GainConvention.ONE_PLUS_W, eps_placement=EpsPlacement.OUTSIDE_SQRT)  # fmt: skip
    code = ("import pickle, sys; from normatlas import CastOrder, EpsPlacement, GainConvention, NormSpec; "
            "sys.stdout.buffer.write(pickle.dumps(NormSpec(center=False, bias=False, eps=1e-6, "
            "cast_order=CastOrder.BEFORE_GAIN, gain_convention=GainConvention.ONE_PLUS_W, "
            "eps_placement=EpsPlacement.OUTSIDE_SQRT)))")  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    blob = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, env=env).stdout
    other = pickle.loads(blob)
    assert other == spec and hash(other) == hash(spec) and {spec: 1}.get(other) == 1
    assert copy.deepcopy(spec) == spec and hash(copy.copy(spec)) == hash(spec)
