"""BatchNorm converters: every flavour in, the target out, state kept where meaningful, a report of changes."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from normatlas import GroupNorm, Layout, Norm
from normatlas.longtail import (
    BatchNorm,
    BatchNormTarget,
    BatchRenorm,
    FrozenBatchNorm,
    GhostBatchNorm,
    SyncBatchNorm,
    convert_batchnorm,
)


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Sequential(torch.nn.Conv2d(8, 8, 1), BatchNorm(8)), BatchRenorm(8, r_max=1.0, d_max=0.0),
        torch.nn.LayerNorm(5),
    )  # fmt: skip
    for _ in range(3):
        m(torch.randn(4, 3, 7, 7))
    with torch.no_grad():
        for mod in m.modules():
            if getattr(mod, "running_var", None) is not None:
                mod.weight.normal_()
                mod.bias.normal_()
    return m.to(dtype).eval()


def test_frozen_conversion_keeps_the_eval_function_and_reports():
    m = _model(torch.float64)  # fp64 so that folding scale and shift is exact to assert_close's tolerance
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    before = m(x)
    report = convert_batchnorm(m, BatchNormTarget.FROZEN)
    assert [(c.path, c.old, c.new) for c in report] == [
        ("1", "BatchNorm2d", "FrozenBatchNorm"), ("3.1", "BatchNorm", "FrozenBatchNorm"),
        ("4", "BatchRenorm", "FrozenBatchNorm"),
    ]  # fmt: skip
    assert set(report.changes[0].kept) == {"running_mean", "running_var", "weight", "bias"}
    assert_close(m(x), before)
    assert_close(m.train()(x), before)  # frozen: train mode is the same function
    assert isinstance(m[5], torch.nn.LayerNorm)  # per-sample norms are left alone
    assert len(convert_batchnorm(m, BatchNormTarget.FROZEN)) == 0  # idempotent


@pytest.mark.parametrize("target", [BatchNormTarget.SYNC, BatchNormTarget.GHOST])
def test_sync_and_ghost_keep_statistics_affine_and_counters(target):
    m = _model()
    old = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(2, 3, 7, 7)
    before = m(x)
    report = convert_batchnorm(m, target, virtual_batch_size=2)
    cls = SyncBatchNorm if target is BatchNormTarget.SYNC else GhostBatchNorm
    assert all(isinstance(m.get_submodule(c.path), cls) for c in report) and len(report) == 3
    new = m.state_dict()
    for k, v in old.items():
        assert_close(new[k], v, msg=k)
    assert_close(m(x), before)  # eval mode: same running statistics, same function
    assert not m[1].training


def test_group_conversion_keeps_affine_drops_statistics_and_adjusts_groups():
    m = _model()
    w = m[1].weight.detach().clone()
    report = convert_batchnorm(m, BatchNormTarget.GROUP, num_groups=3)
    assert isinstance(m[1], GroupNorm) and m[1].num_groups == 2  # largest divisor of 8 <= 3
    assert_close(m[1].weight.detach(), w)
    assert "running statistics dropped" in report.changes[0].note and "used" in report.changes[0].note
    x = torch.randn(2, 3, 7, 7)
    y = m[1](m[0](x))
    assert_close(y, torch.nn.functional.group_norm(m[0](x), 2, m[1].weight, m[1].bias))


def test_group_conversion_of_channels_last_batchnorm():
    m = torch.nn.Sequential(BatchNorm(6, layout=Layout.N_ANY_C))
    convert_batchnorm(m, BatchNormTarget.GROUP, num_groups=3)
    assert isinstance(m[0], Norm) and m[0].spec.groups == 3 and m[0].spec.layout is Layout.N_ANY_C
    x = torch.randn(2, 5, 6)
    ref = torch.nn.functional.group_norm(x.transpose(1, 2), 3, m[0].weight, m[0].bias).transpose(1, 2)
    assert_close(m[0](x), ref)


def test_frozen_back_to_trainable_is_noted():
    m = torch.nn.Sequential(FrozenBatchNorm(4))
    report = convert_batchnorm(m, BatchNormTarget.GHOST)
    assert isinstance(m[0], GhostBatchNorm) and "was frozen" in report.changes[0].note


def test_freeze_without_running_statistics_names_the_module():
    m = torch.nn.Sequential(torch.nn.Sequential(torch.nn.BatchNorm1d(4, track_running_stats=False)))
    with pytest.raises(ValueError, match=r"0\.0: cannot freeze"):
        convert_batchnorm(m, BatchNormTarget.FROZEN)


def test_bad_arguments():
    with pytest.raises(TypeError, match="to='frozen'"):
        convert_batchnorm(torch.nn.Sequential(), "frozen")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_groups=0"):
        convert_batchnorm(torch.nn.Sequential(), BatchNormTarget.GROUP, num_groups=0)
