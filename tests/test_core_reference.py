"""The generic core against the independent float64 reference, across the spec space."""

from __future__ import annotations

import itertools

import pytest
import torch

from normatlas import Axis, CastOrder, EpsPlacement, Gain, GainConvention, Layout, Norm, NormSpec, Scale, normalize
from normatlas.functional import resolve

from .reference import TOL, reference

F, P, S = Axis.FEATURE, Axis.POSITION, Axis.SAMPLE

# (layout, reduce, groups, feature_ndim, input shape)
SLICES = [
    (Layout.BTD, {F}, 1, 1, (5, 7, 123)),
    (Layout.N_ANY_C, {F}, 1, 2, (3, 5, 4, 9)),
    (Layout.N_ANY_C, {F}, 1, 1, (1, 1, 1023)),
    (Layout.NCHW, {F, P}, 3, 1, (2, 12, 5, 7)),
    (Layout.NC_ANY, {F, P}, 1, 1, (3, 6, 11)),
    (Layout.NC_ANY, {P}, 1, 1, (4, 5, 3, 3)),
    (Layout.NC_ANY, {F}, 1, 1, (2, 8, 3, 5)),  # LayerNorm2d
    (Layout.NCHW, {S, P}, 1, 1, (6, 4, 3, 5)),  # BatchNorm
    (Layout.BTD, {S, P}, 1, 1, (4, 9, 6)),  # BatchNorm over tokens
    (Layout.BTD, {F}, 4, 1, (3, 5, 16)),  # grouped per-token norm
    (Layout.NC, {S}, 1, 1, (7, 5)),  # BatchNorm1d
]


def _params(spec: NormSpec, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor | None, ...]:
    fshape = tuple(shape[d] for d in resolve(spec, shape).feature_dims)
    w = b = None
    if spec.gain is Gain.SCALAR:
        w = torch.tensor(1.7, dtype=dtype)
    elif spec.gain is Gain.PER_FEATURE:
        w = (torch.randn(fshape) * 0.3 + (0.0 if spec.gain_convention is GainConvention.ONE_PLUS_W else 1.0)).to(dtype)
    if spec.bias:
        b = (torch.randn(fshape) * 0.3).to(dtype)
    return w, b


@pytest.mark.parametrize("layout,reduce,groups,fnd,shape", SLICES)
@pytest.mark.parametrize("center", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_slices_match_reference(layout, reduce, groups, fnd, shape, center, dtype):
    spec = NormSpec(layout=layout, reduce=frozenset(reduce), groups=groups, feature_ndim=fnd, center=center)
    x = (torch.randn(shape) * 3 + 2).to(dtype)
    w, b = _params(spec, shape, dtype)
    out = normalize(x, spec, w, b)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(x, spec, w, b), **TOL[dtype])


SPEC_KNOBS = list(
    itertools.product(
        [Scale.RMS, Scale.L2],
        list(EpsPlacement),
        [CastOrder.AFTER_GAIN, CastOrder.BEFORE_GAIN],
        [(Gain.PER_FEATURE, GainConvention.W), (Gain.PER_FEATURE, GainConvention.ONE_PLUS_W),
         (Gain.SCALAR, GainConvention.W), (Gain.NONE, GainConvention.W)],
        [True, False],
    )
)  # fmt: skip


@pytest.mark.parametrize("scale,placement,cast,gain,bias", SPEC_KNOBS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_knobs_match_reference(scale, placement, cast, gain, bias, dtype):
    spec = NormSpec(
        center=False, scale=scale, eps=1e-3, eps_placement=placement, cast_order=cast,
        gain=gain[0], gain_convention=gain[1], bias=bias,
    )  # fmt: skip
    x = (torch.randn(6, 5, 37) * 2).to(dtype)
    x[0, 0] = 0.0  # a zero row: eps alone keeps the division finite
    w, b = _params(spec, tuple(x.shape), dtype)
    out = normalize(x, spec, w, b)
    ref = reference(x, spec, w, b)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


@pytest.mark.parametrize("placement", list(EpsPlacement))
def test_eps_placements_are_different_functions(placement):
    """Essay: where eps sits changes the answer. Small-norm rows expose it."""
    x = torch.randn(4, 16, dtype=torch.float64) * 1e-3
    outs = {p: normalize(x, NormSpec(center=False, eps=1e-4, eps_placement=p, gain=Gain.NONE, bias=False))
            for p in EpsPlacement}  # fmt: skip
    others = [o for p, o in outs.items() if p is not placement]
    for other in others:
        assert (outs[placement] - other).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layout,reduce,groups,fnd,shape", SLICES[:8])
def test_backward_matches_reference(layout, reduce, groups, fnd, shape, dtype):
    spec = NormSpec(layout=layout, reduce=frozenset(reduce), groups=groups, feature_ndim=fnd)
    x = (torch.randn(shape) * 2 + 1).to(dtype).requires_grad_()
    w, b = (t.requires_grad_() for t in _params(spec, shape, dtype))  # type: ignore[union-attr]
    g = torch.randn(shape, dtype=dtype)
    grads = torch.autograd.grad(normalize(x, spec, w, b), (x, w, b), g)
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = torch.autograd.grad(reference(xr, spec, wr, br), (xr, wr, br), g.double())
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype is torch.float32 else TOL[dtype]
    for a, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(a.double(), r, **tol)


@pytest.mark.parametrize(
    "spec",
    [
        NormSpec(center=False),
        NormSpec(center=False, eps_placement=EpsPlacement.OUTSIDE_SQRT, gain_convention=GainConvention.ONE_PLUS_W),
        NormSpec(center=False, scale=Scale.L2, eps_placement=EpsPlacement.CLAMP, gain=Gain.SCALAR, bias=False),
        NormSpec(layout=Layout.NC_ANY, reduce=frozenset({F, P}), groups=2),
        NormSpec(layout=Layout.BTD, reduce=frozenset({S, P})),
    ],
    ids=["rms", "rms-outside-1+w", "scalenorm", "groupnorm", "batchnorm-tokens"],
)
def test_gradcheck_generic_path(spec):
    shape = (3, 4, 6)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    w, b = (t.requires_grad_() if t is not None else None for t in _params(spec, shape, torch.float64))
    inputs = tuple(t for t in (x, w, b) if t is not None)

    def fn(*args):
        it = iter(args)
        xx = next(it)
        ww = next(it) if w is not None else None
        bb = next(it) if b is not None else None
        return normalize(xx, spec, ww, bb)

    assert torch.autograd.gradcheck(fn, inputs)


def test_masked_statistics_ignore_padding():
    """BatchNorm over (B, T) with a padding mask: statistics equal those of the valid tokens alone."""
    spec = NormSpec(layout=Layout.BTD, reduce=frozenset({S, P}), gain=Gain.NONE, bias=False)
    x = torch.randn(3, 7, 5, dtype=torch.float64)
    lengths = torch.tensor([7, 4, 2])
    mask = (torch.arange(7)[None, :] < lengths[:, None])[..., None]
    poisoned = x.masked_fill(~mask, 1e6)
    out = normalize(poisoned, spec, mask=mask)
    valid = x[mask.expand_as(x)].reshape(-1, 5)
    expected = (valid - valid.mean(0)) / torch.sqrt(valid.var(0, unbiased=False) + spec.eps)
    torch.testing.assert_close(out[mask.expand_as(out)].reshape(-1, 5), expected)
    torch.testing.assert_close(out.double(), reference(poisoned, spec, mask=mask))


def test_running_statistics_match_torch_batchnorm():
    spec = NormSpec(layout=Layout.NC_ANY, reduce=frozenset({S, P}))
    ours = Norm(spec, 4, track_running_stats=True, momentum=0.2)
    peer = torch.nn.BatchNorm2d(4, momentum=0.2)
    for _ in range(3):
        x = torch.randn(5, 4, 3, 2) * 2 + 1
        torch.testing.assert_close(ours(x), peer(x))
    torch.testing.assert_close(ours.running_mean, peer.running_mean)
    torch.testing.assert_close(ours.running_var, peer.running_var)
    assert int(ours.num_batches_tracked) == int(peer.num_batches_tracked) == 3
    ours.eval(), peer.eval()
    x = torch.randn(2, 4, 3, 2)
    torch.testing.assert_close(ours(x), peer(x))


def test_running_statistics_generic_path_channels_last_and_masked():
    """The generic path (channels-last, masked) keeps fp32 running stats with torch's update rule."""
    spec = NormSpec(layout=Layout.BTD, reduce=frozenset({S, P}))
    ours = Norm(spec, 6, track_running_stats=True, momentum=None, dtype=torch.bfloat16)
    assert ours.running_var is not None and ours.running_var.dtype is torch.float32
    peer = torch.nn.BatchNorm1d(6, momentum=None)
    xs = [torch.randn(4, 5, 6) * 3 + 1 for _ in range(3)]
    for x in xs:
        mask = torch.ones(4, 5, 1, dtype=torch.bool)
        mask[0, 3:] = False
        ours(x.bfloat16(), mask=mask)
        valid = x[mask.expand_as(x)].reshape(-1, 6)
        peer(valid)  # BatchNorm1d over the valid tokens only
    torch.testing.assert_close(ours.running_mean, peer.running_mean, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ours.running_var, peer.running_var, atol=5e-2, rtol=2e-2)


def test_empty_batch_keeps_running_estimates():
    spec = NormSpec(layout=Layout.BTD, reduce=frozenset({S, P}))
    norm = Norm(spec, 3, track_running_stats=True)
    out = norm(torch.empty(0, 4, 3))
    assert out.shape == (0, 4, 3)
    torch.testing.assert_close(norm.running_var, torch.ones(3))
    torch.testing.assert_close(norm.running_mean, torch.zeros(3))


def test_fp32_statistics_beat_input_dtype_statistics():
    """Essay: compute norms in fp32, always. LayerNorm of bf16 values near 1e2 with unit spread: a bf16
    mean rounds 100.25 to a multiple of 0.5 and shifts every centred value by a quarter."""
    x = (torch.randn(8, 4096, dtype=torch.float64) + 100.25).bfloat16()
    ref = reference(x, NormSpec(gain=Gain.NONE, bias=False))
    errs = {}
    for cast in (CastOrder.AFTER_GAIN, CastOrder.INPUT_DTYPE):
        spec = NormSpec(gain=Gain.NONE, bias=False, cast_order=cast)
        errs[cast] = (normalize(x, spec).double() - ref).abs().max().item()
    assert errs[CastOrder.AFTER_GAIN] <= 2**-6  # one bf16 rounding of values up to ~4
    assert errs[CastOrder.INPUT_DTYPE] > 4 * errs[CastOrder.AFTER_GAIN]
