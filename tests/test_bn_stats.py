"""Effective sample count per BatchNorm statistic; MoCo's shuffled BN (essay §04, issue 36)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from normatlas.longtail.bn_stats import effective_sample_count, shuffled_bn_forward


def _reference(x: Tensor) -> tuple[list[float], list[float]]:
    """(rho, n_eff) per channel of a (B, T, C) tensor, element by element in Python floats."""
    b, t, c = x.shape
    rhos, neffs = [], []
    for k in range(c):
        vals = [[float(x[i, j, k]) for j in range(t)] for i in range(b)]
        means = [sum(row) / t for row in vals]
        grand = sum(means) / b
        msb = t * sum((m - grand) ** 2 for m in means) / (b - 1)
        msw = sum((vals[i][j] - means[i]) ** 2 for i in range(b) for j in range(t)) / (b * (t - 1))
        rho = (msb - msw) / (msb + (t - 1) * msw) if msb + (t - 1) * msw > 0 else 0.0
        rhos.append(rho)
        neffs.append(min(max(b * t / (1 + (t - 1) * rho), b), b * t))
    return rhos, neffs


@pytest.mark.parametrize("shape", [(2, 2, 1), (5, 7, 3), (3, 11, 4)])
def test_matches_elementwise_reference(shape: tuple[int, int, int]) -> None:
    gen = torch.Generator().manual_seed(0)
    b, t, c = shape
    # correlated: a per-sequence offset of random size per channel plus noise
    x = torch.randn(b, 1, c, generator=gen) * torch.rand(c, generator=gen) * 2 + torch.randn(shape, generator=gen)
    got = effective_sample_count(x.float())
    rho, n_eff = _reference(x.double())
    assert got.n == b * t and got.batch == b
    torch.testing.assert_close(got.rho, torch.tensor(rho, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.n_eff, torch.tensor(n_eff, dtype=torch.float64), rtol=1e-5, atol=1e-5)


def test_dims_are_honoured() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, 3, generator=gen, dtype=torch.float64) + torch.randn(4, 1, 3, generator=gen)
    ref = effective_sample_count(x)
    moved = effective_sample_count(x.permute(2, 0, 1), batch_dim=1, seq_dim=2, channel_dim=0)
    torch.testing.assert_close(moved.n_eff, ref.n_eff, rtol=0, atol=0)


def test_iid_positions_count_fully() -> None:
    x = torch.randn(64, 64, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = effective_sample_count(x)
    assert got.rho.abs().max() < 0.01
    assert got.ratio.min() > 0.6  # 1 / (1 + 63 * 0.01) at the worst channel
    assert float(got.ratio.median()) > 0.9


def test_constant_sequences_count_once() -> None:
    x = torch.randn(8, 1, 5, generator=torch.Generator().manual_seed(3)).expand(8, 32, 5)
    got = effective_sample_count(x)
    torch.testing.assert_close(got.rho, torch.ones(5, dtype=torch.float64))
    torch.testing.assert_close(got.n_eff, torch.full((5,), 8.0, dtype=torch.float64))


def test_known_intraclass_correlation() -> None:
    """Sequence offset variance 1, noise variance 3: rho = 1 / 4, n_eff = n / (1 + (T - 1) / 4)."""
    gen = torch.Generator().manual_seed(4)
    b, t = 400, 9
    x = torch.randn(b, 1, 2, generator=gen, dtype=torch.float64) + 3**0.5 * torch.randn(
        b, t, 2, generator=gen, dtype=torch.float64
    )
    got = effective_sample_count(x)
    torch.testing.assert_close(got.rho, torch.full((2,), 0.25, dtype=torch.float64), atol=0.05, rtol=0)
    assert ((got.n_eff - b * t / 3).abs() < 0.2 * b * t / 3).all()


@pytest.mark.parametrize(("scale", "shift"), [(3.0, 0.0), (-0.01, 5.0), (1e3, -2.0)])
def test_affine_invariant(scale: float, shift: float) -> None:
    """n_eff counts samples: a per-channel affine map of the values (what BN undoes) does not change it."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, 9, 3, generator=gen, dtype=torch.float64) + torch.randn(5, 1, 3, generator=gen)
    ref, got = effective_sample_count(x), effective_sample_count(x * scale + shift)
    torch.testing.assert_close(got.rho, ref.rho, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got.n_eff, ref.n_eff, rtol=1e-9, atol=1e-9)


def test_no_variance_is_rho_zero() -> None:
    got = effective_sample_count(torch.ones(3, 4, 2))
    assert got.rho.tolist() == [0.0, 0.0] and got.n_eff.tolist() == [12.0, 12.0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"x": [1.0]}, "x must be a torch.Tensor"),
        ({"x": torch.zeros(2, 3)}, "3-D floating"),
        ({"x": torch.zeros(2, 3, 4, dtype=torch.long)}, "3-D floating"),
        ({"x": torch.zeros(2, 3, 4), "seq_dim": 0}, "distinct"),
        ({"x": torch.zeros(2, 3, 4), "channel_dim": 3}, "channel_dim=3"),
        ({"x": torch.zeros(1, 3, 4)}, "B=1"),
        ({"x": torch.zeros(2, 1, 4)}, "T=1"),
    ],
)
def test_refusals(kwargs: dict, match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        effective_sample_count(**kwargs)


# ---------------------------------------------------------------- MoCo shuffled BN

from tests.scripts import load_benchmark  # noqa: E402

_leak = load_benchmark("shuffled_bn_leak")
BATCH, GROUPS = _leak.BATCH, _leak.GROUPS
_key_encoder, query_mate_leak, _separates_mates = _leak._key_encoder, _leak.query_mate_leak, _leak._separates_mates


def test_plain_per_device_bn_leaks_to_the_mates_keys() -> None:
    assert query_mate_leak(None) > 0.05


def test_shuffle_that_separates_mates_does_not_leak() -> None:
    seed = next(s for s in range(100) if _separates_mates(s))
    assert query_mate_leak(seed) < 1e-12


def test_shuffle_that_keeps_mates_together_leaks_so_the_check_can_fail() -> None:
    seed = next(s for s in range(100) if not _separates_mates(s))
    assert query_mate_leak(seed) > 0.05


def test_shuffled_forward_is_per_sub_batch_and_unpermuted() -> None:
    enc = _key_encoder()
    x = torch.randn(BATCH, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    perm = torch.randperm(BATCH, generator=torch.Generator().manual_seed(7))
    want = torch.empty(BATCH, 4, dtype=torch.float64)
    for idx in perm.chunk(GROUPS):
        want[idx] = enc(x[idx])
    got = shuffled_bn_forward(enc, x, GROUPS, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    enc.eval()  # eval-mode BN: no batch statistics, the shuffle changes nothing
    torch.testing.assert_close(shuffled_bn_forward(enc, x, GROUPS), enc(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("groups", [0, 3, True, 2.0])
def test_shuffle_refuses_bad_groups(groups: object) -> None:
    with pytest.raises(ValueError, match="groups="):
        shuffled_bn_forward(nn.Identity(), torch.zeros(8, 2), groups)  # type: ignore[arg-type]
