"""Input-rank rules, single-value batch statistics and argument checks of the core, against torch.nn's behaviour."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import normatlas as na
from normatlas import Axis, Layout, Norm, NormSpec
from normatlas.longtail import BatchNorm, BatchNorm1d, BatchNorm2d, BatchNorm3d

_BATCH = frozenset({Axis.SAMPLE, Axis.POSITION})


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def _assert_state_unchanged(m: nn.Module, before: dict[str, torch.Tensor]) -> None:
    for k, v in m.state_dict().items():
        assert_close(v, before[k], atol=0, rtol=0, msg=f"{k} changed")


# --------------------------------------------------------------------------- input rank (torch's _check_input_dim)
@pytest.mark.parametrize(("ours", "theirs", "shape", "message"), [
    (BatchNorm2d, nn.BatchNorm2d, (4, 5, 5), r"expected 4D input \(got 3D input\)"),  # missing batch axis
    (BatchNorm2d, nn.BatchNorm2d, (2, 4, 5, 5, 1), r"expected 4D input \(got 5D input\)"),
    (BatchNorm3d, nn.BatchNorm3d, (4, 3, 5, 5), r"expected 5D input \(got 4D input\)"),  # missing batch axis
    (BatchNorm1d, nn.BatchNorm1d, (2, 4, 5, 5), r"expected 2D or 3D input \(got 4D input\)"),
    (BatchNorm1d, nn.BatchNorm1d, (4,), r"expected 2D or 3D input \(got 1D input\)"),
])  # fmt: skip
@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_rejects_the_ranks_torch_rejects(ours, theirs, shape, message, training):
    torch.manual_seed(0)
    x = torch.randn(shape) * 3 + 2
    peer = theirs(4).train(training)
    with pytest.raises(ValueError, match=message):
        peer(x)
    m = ours(4).train(training)
    before = _state(m)
    with pytest.raises(ValueError, match=message) as info:
        m(x)
    assert f"shape {tuple(shape)}" in str(info.value)  # the shape the user passed, not a reshaped one
    _assert_state_unchanged(m, before)  # no running statistics from a lone sample


def test_batch_statistics_spec_has_no_unbatched_form():
    m = Norm(NormSpec(layout=Layout.NCHW, reduce=_BATCH), 4, track_running_stats=True)
    with pytest.raises(ValueError, match=r"expected 4D input \(got 3D input\).*shape \(4, 5, 5\).*sample axis"):
        m(torch.randn(4, 5, 5))
    assert int(m.num_batches_tracked) == 0


@pytest.mark.parametrize(("ours", "theirs", "shape"), [
    (na.InstanceNorm1d, nn.InstanceNorm1d, (4, 17)),
    (na.InstanceNorm2d, nn.InstanceNorm2d, (4, 5, 7)),
    (na.InstanceNorm3d, nn.InstanceNorm3d, (4, 3, 5, 2)),
])  # fmt: skip
def test_instancenorm_accepts_unbatched_input_like_torch(ours, theirs, shape):
    torch.manual_seed(1)
    x = torch.randn(shape, dtype=torch.float64) * 2 + 1
    m = ours(4, affine=True, track_running_stats=True, dtype=torch.float64)
    peer = theirs(4, affine=True, track_running_stats=True, dtype=torch.float64)
    assert_close(m(x), peer(x))
    assert_close(m.running_mean, peer.running_mean.float())
    assert_close(m.running_var, peer.running_var.float())
    m.eval(), peer.eval()
    assert_close(m(x), peer(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("ours", "theirs", "shape", "message"), [
    (na.InstanceNorm1d, nn.InstanceNorm1d, (2, 4, 5, 5), r"expected 2D or 3D input \(got 4D input\)"),
    (na.InstanceNorm2d, nn.InstanceNorm2d, (4, 5), r"expected 3D or 4D input \(got 2D input\)"),
    (na.InstanceNorm3d, nn.InstanceNorm3d, (4, 5, 5), r"expected 4D or 5D input \(got 3D input\)"),
])  # fmt: skip
def test_instancenorm_rejects_the_ranks_torch_rejects(ours, theirs, shape, message):
    x = torch.randn(shape)
    with pytest.raises(ValueError, match=message):
        theirs(4)(x)
    with pytest.raises(ValueError, match=message):
        ours(4)(x)


def test_unbatched_channel_mismatch_reports_the_input_as_given():
    with pytest.raises(ValueError, match=r"input of shape \(2, 4, 5\) has channel dim \(dim 0.*\(2,\).*\(4,\)") as info:
        na.InstanceNorm2d(4)(torch.randn(2, 4, 5))
    assert "(1, 2, 4, 5)" not in str(info.value)


# --------------------------------------------------------------------------- one value per channel (torch raises)
@pytest.mark.parametrize(("ours", "theirs", "shape"), [
    (BatchNorm1d, nn.BatchNorm1d, (1, 4)),
    (BatchNorm1d, nn.BatchNorm1d, (1, 4, 1)),
    (BatchNorm2d, nn.BatchNorm2d, (1, 4, 1, 1)),
])  # fmt: skip
@pytest.mark.parametrize("track_running_stats", [True, False])
def test_training_batchnorm_on_one_value_per_channel_raises_like_torch(ours, theirs, shape, track_running_stats):
    x = torch.randn(shape)
    message = re.escape(f"Expected more than 1 value per channel when training, got input size {torch.Size(shape)}")
    with pytest.raises(ValueError, match=message):
        theirs(4, track_running_stats=track_running_stats)(x)
    m = ours(4, track_running_stats=track_running_stats)
    before = _state(m)
    with pytest.raises(ValueError, match=message):
        m(x)
    _assert_state_unchanged(m, before)  # running_var is not dragged toward 0
    if track_running_stats:  # eval uses the running estimates: one sample is fine there, as in torch
        peer = theirs(4).eval()
        assert_close(m.eval()(x), peer(x))
    else:  # no running estimates: eval normalises by the batch too, and torch raises again
        with pytest.raises(ValueError, match=r"Expected more than 1 value per channel"):
            theirs(4, track_running_stats=False).eval()(x)
        with pytest.raises(ValueError, match=r"Expected more than 1 value per channel"):
            m.eval()(x)


def test_channels_last_batchnorm_and_functional_raise_on_one_value_per_feature():
    m = BatchNorm(4, layout=Layout.N_ANY_C)  # the generic path, not torch's kernel
    with pytest.raises(ValueError, match=r"Expected more than 1 value per channel when training"):
        m(torch.randn(1, 1, 4))
    assert_close(m.running_var, torch.ones(4), atol=0, rtol=0)
    spec = NormSpec(layout=Layout.NC_ANY, reduce=_BATCH)
    with pytest.raises(ValueError, match=r"Expected more than 1 value per channel when training"):
        na.normalize(torch.randn(1, 4), spec, torch.ones(4), torch.zeros(4), training=True)
    rv, rm = torch.ones(4), torch.zeros(4)
    out = na.normalize(torch.randn(1, 4), spec, running_mean=rm, running_var=rv, training=False)
    assert out.shape == (1, 4)  # eval with running statistics needs no batch
    assert na.normalize(torch.randn(0, 4), spec, training=True).shape == (0, 4)  # empty is not "one value"


# --------------------------------------------------------------------------- momentum
@pytest.mark.parametrize("momentum", ["a", True, False, [0.1], torch.tensor(0.1)])
def test_momentum_must_be_a_real_number(momentum):
    with pytest.raises(TypeError, match=re.escape(f"momentum={momentum!r}")):
        BatchNorm2d(4, momentum=momentum)
    with pytest.raises(TypeError, match=r"momentum=.*must be a float in \[0, 1\] or None"):
        na.InstanceNorm1d(4, momentum=momentum, track_running_stats=True)


@pytest.mark.parametrize("momentum", [-0.1, 1.5, float("nan")])
def test_momentum_out_of_range(momentum):
    with pytest.raises(ValueError, match=r"momentum=.*must lie in \[0, 1\] or be None"):
        BatchNorm2d(4, momentum=momentum)


@pytest.mark.parametrize("momentum", [0, 1, 0.3, None])
def test_momentum_numbers_and_none_are_accepted(momentum):
    torch.manual_seed(2)
    x = torch.randn(3, 4, 5, 5)
    m, peer = BatchNorm2d(4, momentum=momentum), nn.BatchNorm2d(4, momentum=momentum)
    for _ in range(2):
        m(x), peer(x)
    assert_close(m.running_var, peer.running_var)
    assert m.momentum is None or isinstance(m.momentum, float)


# --------------------------------------------------------------------------- GroupNorm's own argument names
@pytest.mark.parametrize(("args", "message"), [
    ((0, 8), r"num_groups=0 must be an integer >= 1"),
    ((-2, 8), r"num_groups=-2 must be an integer >= 1"),
    ((2.0, 8), r"num_groups=2\.0 must be an integer >= 1"),
    ((True, 8), r"num_groups=True must be an integer >= 1"),
    ((2, 0), r"num_channels=0 must be an integer >= 1"),
    ((2, 8.0), r"num_channels=8\.0 must be an integer >= 1"),
])  # fmt: skip
def test_groupnorm_names_the_argument_passed(args, message):
    with pytest.raises(ValueError, match=message) as info:
        na.GroupNorm(*args)
    assert "groups=" not in str(info.value).replace("num_groups=", "")  # not the spec's field name
