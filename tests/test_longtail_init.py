"""Fixup and Admin: identity at initialisation and the papers' constants."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from normatlas.longtail import (
    AdminOutputChange,
    AdminResidual,
    FixupBasicBlock,
    admin_init_,
    admin_omega,
    fixup_init_,
    fixup_scale,
)


@settings(max_examples=30, deadline=None)
@given(num_branches=st.integers(1, 200), m=st.integers(2, 6))
def test_fixup_scale_is_the_papers_formula(num_branches, m):
    assert fixup_scale(num_branches, m) == pytest.approx(num_branches ** (-1 / (2 * m - 2)), rel=1e-12)


def test_fixup_blocks_are_identity_at_init_and_branch_weights_are_rescaled_he():
    torch.manual_seed(0)
    blocks = [FixupBasicBlock(16) for _ in range(9)]
    head = torch.nn.Linear(16, 10)
    scale = fixup_init_([b.branch_layers() for b in blocks], output_layer=head)
    assert scale == pytest.approx(9**-0.5)
    x = torch.randn(2, 16, 6, 6)
    for b in blocks:
        assert b.branch(x).abs().max().item() == 0.0
        assert_close(b(x.relu()), x.relu(), atol=0, rtol=0)
        assert b.conv2.weight.abs().max().item() == 0.0
    assert head.weight.abs().max().item() == 0.0 and head.bias.abs().max().item() == 0.0
    # the non-final layers: He std sqrt(2 / fan_in) times the Fixup scale, measured over all blocks
    w = torch.cat([b.conv1.weight.flatten() for b in blocks])
    expected = math.sqrt(2 / (16 * 9)) * scale
    assert w.std().item() == pytest.approx(expected, rel=0.03)


def test_fixup_branch_still_learns_from_zero():
    torch.manual_seed(1)
    block = FixupBasicBlock(4)
    fixup_init_([block.branch_layers()])
    block(torch.randn(2, 4, 5, 5)).sum().backward()
    assert block.conv2.weight.grad.abs().max() > 0  # the zero layer gets gradient


def test_fixup_bad_arguments():
    with pytest.raises(ValueError, match="layers_per_branch=1"):
        fixup_scale(4, 1)
    with pytest.raises(ValueError, match="num_branches=0"):
        fixup_scale(0, 2)
    with pytest.raises(ValueError, match="same number of layers"):
        fixup_init_([[torch.nn.Linear(2, 2)] * 2, [torch.nn.Linear(2, 2)] * 3])


class _PostLN(torch.nn.Module):
    def __init__(self, dim, depth):
        super().__init__()
        self.branches = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(depth))
        self.res = torch.nn.ModuleList(AdminResidual(dim) for _ in range(depth))

    def forward(self, x):
        for f, r in zip(self.branches, self.res, strict=True):
            x = r(x, f(x))
        return x


def test_admin_omegas_equal_the_cumulative_branch_variance():
    torch.manual_seed(2)
    model = _PostLN(16, 6)
    x = torch.randn(8, 5, 16)
    # independent measurement: run with omega = 1 and record Var[f_i(x_{i-1})] by hand
    variances, h = [], x
    with torch.no_grad():
        for f, r in zip(model.branches, model.res, strict=True):
            out = f(h)
            variances.append(out.double().var(unbiased=False).item())
            h = r.norm(h + out)
    omegas = admin_init_(list(model.res), lambda: model(x), input_variance=1.0)
    expected = [math.sqrt(1.0 + sum(variances[:i])) for i in range(6)]
    assert omegas == pytest.approx(expected, rel=1e-6)
    for r, w in zip(model.res, expected, strict=True):
        assert_close(r.omega.detach(), torch.full((16,), w, dtype=torch.float32))
    assert omegas == sorted(omegas)  # deeper layers lean more on the residual


def test_admin_rejects_uncalled_residual():
    model = _PostLN(4, 2)
    extra = AdminResidual(4)
    with pytest.raises(ValueError, match="residual 2 was not called"):
        admin_init_([*model.res, extra], lambda: model(torch.randn(2, 4)))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 1000))
def test_admin_closed_forms(n):
    assert admin_omega(n) ** 2 == pytest.approx((n + 1) / math.log(n + 1) - 1, rel=1e-12)
    assert admin_omega(n, AdminOutputChange.LINEAR) == 1.0
    assert admin_omega(n, AdminOutputChange.CONSTANT) ** 2 == pytest.approx(n, rel=1e-12)


def test_admin_closed_form_bad_arguments():
    with pytest.raises(ValueError, match="num_res_layers=0"):
        admin_omega(0)
    with pytest.raises(TypeError, match="output_change='O\\(1\\)'"):
        admin_omega(4, "O(1)")  # type: ignore[arg-type]
