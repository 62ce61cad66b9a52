"""effective_sample_count(mask=...): padding tokens left out of the per-channel count (issue 36).

Against an element-wise float64 reference of the unbalanced one-way ANOVA and Kish's design effect; an all-True mask
is the unmasked count; what padding holds does not matter; sequences of one length after masking are the unmasked
count of the cut batch.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from normatlas.longtail.bn_stats import effective_sample_count


def ref_count(x: Tensor, mask: Tensor) -> tuple[int, int, list[float], list[float]]:
    """(n, groups, rho per channel, n_eff per channel) with Python loops, x (B, T, C), mask (B, T)."""
    b, t, c = x.shape
    rhos, effs = [], []
    for ch in range(c):
        groups = [[float(x[i, j, ch]) for j in range(t) if mask[i, j]] for i in range(b)]
        groups = [g for g in groups if g]
        k, n = len(groups), sum(len(g) for g in groups)
        grand = sum(sum(g) for g in groups) / n
        means = [sum(g) / len(g) for g in groups]
        msb = sum(len(g) * (m - grand) ** 2 for g, m in zip(groups, means, strict=True)) / (k - 1)
        msw = sum((v - m) ** 2 for g, m in zip(groups, means, strict=True) for v in g) / (n - k)
        sq = sum(len(g) ** 2 for g in groups)
        n0 = (n - sq / n) / (k - 1)
        denom = msb + (n0 - 1) * msw
        rho = (msb - msw) / denom if denom > 0 else 0.0
        rhos.append(rho)
        effs.append(min(max(n / (1 + (sq / n - 1) * rho), n * n / sq), n))
    return n, k, rhos, effs


def _batch(b: int = 5, t: int = 9, c: int = 4) -> tuple[Tensor, Tensor]:
    x = torch.randn(b, t, c, dtype=torch.float64) + torch.randn(b, 1, c, dtype=torch.float64)  # correlated in-sequence
    lengths = torch.tensor([9, 3, 6, 1, 7])[:b]
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return x, mask


def test_masked_count_matches_the_loop_reference() -> None:
    x, mask = _batch()
    got = effective_sample_count(x, mask=mask)
    n, k, rho, eff = ref_count(x, mask)
    assert (got.n, got.batch) == (n, k) == (26, 5)
    torch.testing.assert_close(got.rho, torch.tensor(rho, dtype=torch.float64), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(got.n_eff, torch.tensor(eff, dtype=torch.float64), atol=1e-10, rtol=1e-10)


def test_padding_content_does_not_matter_and_all_true_is_unmasked() -> None:
    x, mask = _batch()
    filled = x.masked_fill(~mask[..., None], 1e6)
    a, b = effective_sample_count(x, mask=mask), effective_sample_count(filled, mask=mask)
    torch.testing.assert_close(a.n_eff, b.n_eff, atol=1e-9, rtol=1e-9)
    unmasked = effective_sample_count(filled)  # the padding now counts: another answer
    assert unmasked.n == 45 and not torch.allclose(unmasked.n_eff, a.n_eff)
    full = effective_sample_count(x, mask=torch.ones(5, 9, dtype=torch.bool))
    plain = effective_sample_count(x)
    torch.testing.assert_close(full.rho, plain.rho, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(full.n_eff, plain.n_eff, atol=1e-10, rtol=1e-12)


def test_one_length_after_masking_is_the_cut_batch_and_other_dims() -> None:
    x = torch.randn(4, 10, 3, dtype=torch.float64) + torch.randn(4, 1, 3, dtype=torch.float64)
    mask = torch.zeros(4, 10, dtype=torch.bool)
    mask[:, :6] = True
    mask[2] = False  # an empty sequence is left out
    got = effective_sample_count(x, mask=mask)
    want = effective_sample_count(x[[0, 1, 3], :6])
    assert (got.n, got.batch) == (18, 3)
    torch.testing.assert_close(got.n_eff, want.n_eff, atol=1e-10, rtol=1e-12)
    moved = effective_sample_count(x.permute(2, 1, 0), batch_dim=2, seq_dim=1, channel_dim=0, mask=mask)
    torch.testing.assert_close(moved.n_eff, got.n_eff, atol=1e-12, rtol=1e-12)


def test_constant_sequences_count_as_a_length_weighted_batch() -> None:
    x = torch.randn(6, 1, 5, dtype=torch.float64).expand(6, 8, 5).clone()
    lengths = torch.tensor([8, 2, 5, 3, 8, 4])
    mask = torch.arange(8)[None, :] < lengths[:, None]
    got = effective_sample_count(x, mask=mask)
    # the pooled mean weights sequence b by n_b / n: its variance is sum n_b^2 / n^2 of one sequence's
    want = float(lengths.sum() ** 2 / lengths.pow(2).sum())  # 900 / 182 = 4.95 of 6 sequences
    torch.testing.assert_close(got.n_eff, torch.full((5,), want, dtype=torch.float64), atol=0, rtol=1e-6)
    same = effective_sample_count(x, mask=torch.ones(6, 8, dtype=torch.bool))
    torch.testing.assert_close(same.n_eff, torch.full((5,), 6.0, dtype=torch.float64), atol=0, rtol=1e-6)


def test_bad_masks_are_named() -> None:
    x = torch.randn(3, 4, 2)
    with pytest.raises(
        TypeError, match=r"mask must be a boolean torch.Tensor \(True at real tokens\), got torch.int64"
    ):
        effective_sample_count(x, mask=torch.ones(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"mask has shape \(4, 3\); expected \(B, T\) = \(3, 4\)"):
        effective_sample_count(x, mask=torch.ones(4, 3, dtype=torch.bool))
    one = torch.zeros(3, 4, dtype=torch.bool)
    one[:, 0] = True  # one token per sequence: no within-sequence spread
    with pytest.raises(ValueError, match="mask leaves 3 sequences with 3 real tokens"):
        effective_sample_count(x, mask=one)
