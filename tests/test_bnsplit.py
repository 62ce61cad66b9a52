"""BatchNorm's remaining pitfalls (essay §04): the sample count behind each statistic of a padded sequence batch,
and outputs that change with the per-device split of a batch unless BatchNorm is synchronised."""

from __future__ import annotations

import pytest
import torch

from normatlas.distributed.bnsplit import bn_sample_counts, split_outputs
from normatlas.longtail import BatchNorm
from normatlas.longtail.batchnorm import batch_moments
from normatlas.spec import Layout


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _mask(lengths: list[int], t: int) -> torch.Tensor:
    return torch.arange(t).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)


def test_sample_counts_of_a_padded_batch() -> None:
    mask = _mask([7, 3, 1, 5], 7)
    c = bn_sample_counts(mask)
    assert (c.total, c.pooled) == (28, 16)
    assert c.per_position == (4, 3, 3, 2, 2, 1, 1)
    assert c.min_per_position == 1
    assert c.pad_share == pytest.approx(12 / 28)
    # the library's masked BatchNorm statistics count exactly ``pooled`` (B x T pooled) and ``per_position``
    x = torch.randn(4, 7, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    pooled, _, _ = batch_moments(x, (0, 1), mask.unsqueeze(-1))
    per_pos, _, _ = batch_moments(x, (0,), mask.unsqueeze(-1))
    assert float(pooled.flatten()[0]) == c.pooled
    assert tuple(int(v) for v in per_pos[0, :, 0]) == c.per_position


def test_masked_batchnorm_over_positions_matches_torch_on_the_real_tokens_only() -> None:
    mask = _mask([6, 2, 4], 6)
    x = torch.randn(3, 6, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ours = BatchNorm(5, layout=Layout.N_ANY_C, dtype=torch.float64).train()
    peer = torch.nn.BatchNorm1d(5, dtype=torch.float64).train()
    y = ours(x, mask=mask.unsqueeze(-1))
    torch.testing.assert_close(y[mask], peer(x[mask]), rtol=1e-12, atol=1e-12)
    # unmasked, the pads (here zeros) drag the statistics: 12 of 18 samples real
    xz = x * mask.unsqueeze(-1)
    assert float((ours(xz)[mask] - peer(x[mask])).detach().abs().max()) > 0.1


def test_bad_mask_is_refused() -> None:
    with pytest.raises(ValueError, match="mask"):
        bn_sample_counts(torch.ones(2, 3))
    with pytest.raises(ValueError, match="world_size"):
        split_outputs(3)


def test_output_changes_with_the_split_unless_syncbn() -> None:
    """2 gloo processes, 4 examples each, vs 1 process on all 8 (float64)."""
    assert split_outputs(1) == 0.0
    assert split_outputs(2) > 0.1  # measured 0.98
    assert split_outputs(2, sync=True) < 1e-12  # measured 4.4e-16
