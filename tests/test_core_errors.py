"""Bad input raises ValueError/TypeError naming the parameter, the value and what is allowed."""

from __future__ import annotations

import pytest
import torch

import normatlas as na
from normatlas import Axis, GainConvention, Layout, NormSpec


def test_shape_mismatch_names_the_shapes():
    with pytest.raises(ValueError, match=r"input of shape \(2, 7\).*\(8,\)"):
        na.LayerNorm(8)(torch.randn(2, 7))
    with pytest.raises(ValueError, match=r"channel dim"):
        na.GroupNorm(2, 4)(torch.randn(2, 6, 3))


@pytest.mark.parametrize("eps", [0.0, -1e-5, float("nan"), float("inf")])
def test_eps_must_be_positive(eps):
    with pytest.raises(ValueError, match=r"eps=.*must be a finite float > 0"):
        na.LayerNorm(8, eps=eps)


def test_eps_type():
    with pytest.raises(TypeError, match=r"eps='1e-5'"):
        NormSpec(eps="1e-5")  # type: ignore[arg-type]


def test_groups_must_divide_channels():
    with pytest.raises(ValueError, match=r"num_groups=5 must divide num_channels=12"):
        na.GroupNorm(5, 12)
    spec = NormSpec(layout=Layout.NC_ANY, reduce=frozenset({Axis.FEATURE, Axis.POSITION}), groups=5, gain=na.Gain.NONE,
                    bias=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"groups=5 must divide the number of channels, 12"):
        na.normalize(torch.randn(2, 12, 3), spec)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_tensors_are_rejected(dtype):
    with pytest.raises(TypeError, match=r"floating-point"):
        na.LayerNorm(4)(torch.ones(2, 4, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
@pytest.mark.parametrize("name", ["weight", "bias"])
def test_non_float_parameters_are_rejected(name, dtype):
    x = torch.randn(2, 4)
    params = {"weight": torch.ones(4), "bias": torch.zeros(4)}
    params[name] = torch.ones(4, dtype=dtype)
    with pytest.raises(TypeError, match=rf"{name} has dtype {dtype}; it must be a floating-point tensor"):
        na.normalize(x, NormSpec(), params["weight"], params["bias"])


def test_unknown_layout_and_axis():
    with pytest.raises(ValueError, match=r"layout='NCWH' is not a valid Layout; allowed: 'NC\.\.\.'"):
        na.spec.parse_enum(Layout, "NCWH", name="layout")
    assert na.spec.parse_enum(Layout, "nchw", name="layout") is Layout.NCHW
    with pytest.raises(TypeError, match=r"layout='NCHW' must be a Layout"):
        NormSpec(layout="NCHW")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"reduce='feature' must be a Axis"):
        NormSpec(reduce=frozenset({"feature"}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"reduce=.*non-empty"):
        NormSpec(reduce=frozenset())


def test_layout_rank_is_checked():
    m = na.Norm(NormSpec(layout=Layout.NCHW, reduce=frozenset({Axis.POSITION}), gain=na.Gain.NONE, bias=False))
    with pytest.raises(ValueError, match=r"has 5 dims; layout='NCHW' needs 4"):
        m(torch.randn(1, 2, 3, 4, 5))


def test_inconsistent_specs_fail_at_construction():
    with pytest.raises(ValueError, match=r"groups=2 needs Axis.FEATURE"):
        NormSpec(reduce=frozenset({Axis.POSITION}), groups=2)
    with pytest.raises(ValueError, match=r"ONE_PLUS_W needs a gain"):
        NormSpec(gain=na.Gain.NONE, gain_convention=GainConvention.ONE_PLUS_W)
    with pytest.raises(ValueError, match=r"feature_ndim=2 needs a channels-last layout"):
        NormSpec(layout=Layout.NCHW, feature_ndim=2)
    with pytest.raises(ValueError, match=r"track_running_stats=True needs per-feature statistics"):
        na.Norm(NormSpec(), 4, track_running_stats=True)
    with pytest.raises(ValueError, match=r"momentum=2"):
        na.InstanceNorm1d(4, momentum=2, track_running_stats=True)
    with pytest.raises(TypeError, match=r"cast_order='before_gain' must be a CastOrder"):
        na.RMSNorm(4, cast_order="before_gain")  # type: ignore[arg-type]


def test_param_shape_mismatch_in_functional():
    with pytest.raises(ValueError, match=r"weight has shape \(3,\).*needs \(4,\)"):
        na.normalize(torch.randn(2, 4), NormSpec(), torch.ones(3), torch.zeros(4))


def test_mask_must_be_bool():
    with pytest.raises(TypeError, match=r"mask must be a bool tensor"):
        na.LayerNorm(4)(torch.randn(2, 4), mask=torch.ones(2, 1))


@pytest.mark.parametrize(
    "layer,shape",
    [(na.LayerNorm(8), (0, 8)), (na.RMSNorm(8), (0, 3, 8)), (na.GroupNorm(2, 4), (0, 4, 5)),
     (na.InstanceNorm1d(4), (0, 4, 5)), (na.LayerNorm2d(4), (0, 4, 2, 2)), (na.ScaleNorm(8), (0, 8))],
)  # fmt: skip
def test_zero_rows_work(layer, shape):
    x = torch.randn(shape, requires_grad=True)
    y = layer(x)
    assert y.shape == shape
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == shape
