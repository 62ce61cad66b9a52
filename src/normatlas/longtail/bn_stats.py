"""BatchNorm's remaining pitfalls, measured: how many samples a statistic really rests on; MoCo's shuffled BN.

Essay section "BatchNorm and its five failure modes".

* :func:`effective_sample_count`: BatchNorm over (batch x positions) of a sequence model averages each
  channel over ``n = B * T`` values, but the positions of one sequence are correlated, so the statistic
  rests on fewer independent samples. Per channel: the one-way ANOVA intraclass correlation ``rho``
  between sequences (groups = sequences, ``T`` members each) and the design-effect count
  ``n_eff = n / (1 + (T - 1) * rho)``, clipped to ``[B, n]`` (iid positions: ``n``; every sequence
  constant: ``B``).
* :func:`shuffled_bn_forward`: MoCo's shuffling BN (He et al., 2020) on one process: the batch is
  permuted, split into ``groups`` simulated devices, each sub-batch runs through ``model`` on its own
  (per-sub-batch BatchNorm statistics in train mode) and the outputs are un-permuted. A key encoder run
  this way does not compute its statistics over the same sub-batch as the query encoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["SampleCount", "effective_sample_count", "shuffled_bn_forward"]


@dataclass(frozen=True)
class SampleCount:
    """Per-channel sample counts of a BatchNorm statistic over (batch x positions).

    ``n``: values averaged per channel (``B * T``; the real tokens under a mask); ``batch``: ``B`` (the sequences
    holding a real token); ``rho`` (C,): the intraclass correlation between sequences; ``n_eff`` (C,): the
    design-effect count, in ``[batch, n]`` (in ``[n^2 / sum n_b^2, n]`` under a mask of unequal lengths).
    """

    n: int
    batch: int
    rho: Tensor
    n_eff: Tensor

    @property
    def ratio(self) -> Tensor:
        """``n_eff / n`` per channel, in ``[batch / n, 1]`` (the lower end smaller under a mask of unequal lengths)."""
        return self.n_eff / self.n


def _dim(value: object, name: str, rank: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -rank <= value < rank:
        raise ValueError(f"{name}={value!r} must be an integer dim of a {rank}-D input, in [{-rank}, {rank - 1}]")
    return value % rank


def effective_sample_count(
    x: Tensor, batch_dim: int = 0, seq_dim: int = 1, channel_dim: int = -1, *, mask: Tensor | None = None
) -> SampleCount:
    """Per channel: ``n`` values, the intraclass correlation ``rho`` and ``n_eff = n / (1 + (m - 1) rho)``.

    ``x``: a 3-D floating tensor holding a batch of ``B >= 2`` sequences of ``T >= 2`` positions with
    ``C`` channels, the three dims named by ``batch_dim``, ``seq_dim``, ``channel_dim``. ``rho`` is the
    one-way ANOVA estimator ``(MSB - MSW) / (MSB + (T - 1) MSW)`` with ``MSB = T * sum_b (mean_b -
    mean)^2 / (B - 1)`` and ``MSW = sum_{b,t} (x - mean_b)^2 / (B (T - 1))``; a channel with no variance
    at all gets ``rho = 0``. Computed in float64.

    ``mask``: a boolean ``(B, T)`` tensor (in the order of ``batch_dim``, ``seq_dim``), True at the real tokens;
    padding is left out of every statistic, as a masked BatchNorm leaves it out. Sequences of ``n_b`` real tokens
    make groups of unequal size: ``n = sum n_b`` over the ``B'`` sequences with a token, ``MSB = sum_b n_b (mean_b -
    mean)^2 / (B' - 1)``, ``MSW = sum (x - mean_b)^2 / (n - B')``, ``rho = (MSB - MSW) / (MSB + (n0 - 1) MSW)``
    with ``n0 = (n - sum n_b^2 / n) / (B' - 1)``, and Kish's design effect ``1 + (m - 1) rho`` with the
    size-weighted mean length ``m = sum n_b^2 / n``; ``n_eff`` is clipped to ``[n / m, n]``: ``n / m = n^2 / sum
    n_b^2`` is the count of a pooled mean whose sequences are each constant (the pooled mean weights a sequence by
    its length, so unequal lengths count for fewer than ``B'``). With every token real this is the formula above
    (``n0 = m = T``, ``n / m = B``). Needs ``B' >= 2`` and ``n > B'``.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x has shape {tuple(x.shape)} and dtype {x.dtype}; expected a 3-D floating tensor")
    dims = (_dim(batch_dim, "batch_dim", 3), _dim(seq_dim, "seq_dim", 3), _dim(channel_dim, "channel_dim", 3))
    if len(set(dims)) != 3:
        raise ValueError(f"batch_dim, seq_dim, channel_dim = {batch_dim}, {seq_dim}, {channel_dim} must be distinct")
    v = x.detach().permute(*dims).to(torch.float64)  # (B, T, C)
    b, t, _ = v.shape
    if mask is None:
        if b < 2 or t < 2:
            raise ValueError(
                f"x has B={b} sequences of T={t} positions; the intraclass correlation needs B >= 2, T >= 2"
            )
        keep = torch.ones(b, t, dtype=torch.float64, device=v.device)
    else:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
            raise TypeError(f"mask must be a boolean torch.Tensor (True at real tokens), got {got}")
        if tuple(mask.shape) != (b, t):
            raise ValueError(f"mask has shape {tuple(mask.shape)}; expected (B, T) = {(b, t)} of x")
        keep = mask.to(v.device, torch.float64)
    sizes = keep.sum(1)  # n_b
    rows = sizes > 0
    v, keep, sizes = v[rows], keep[rows], sizes[rows]
    groups = int(rows.sum())
    n = int(sizes.sum())
    if groups < 2 or n <= groups:
        raise ValueError(
            f"mask leaves {groups} sequences with {n} real tokens; the intraclass correlation needs >= 2 sequences "
            "and more tokens than sequences"
        )
    w = keep[..., None]
    group = (v * w).sum(1) / sizes[:, None]  # (B', C)
    grand = (v * w).sum((0, 1)) / n  # (C,)
    msb = (sizes[:, None] * (group - grand).pow(2)).sum(0) / (groups - 1)
    msw = ((v - group[:, None]).pow(2) * w).sum((0, 1)) / (n - groups)
    sq = float(sizes.pow(2).sum())
    n0 = (n - sq / n) / (groups - 1)
    m = sq / n
    denom = msb + (n0 - 1) * msw
    rho = torch.where(denom > 0, (msb - msw) / denom.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    n_eff = (n / (1 + (m - 1) * rho)).clamp(n / m, n)
    return SampleCount(n, groups, rho, n_eff)


def shuffled_bn_forward(
    model: nn.Module, x: Tensor, groups: int, *, generator: torch.Generator | None = None
) -> Tensor:
    """``model`` run on ``groups`` simulated devices of a shuffled batch, outputs in the input's order.

    The batch (dim 0) is permuted (``torch.randperm`` with ``generator``), split into ``groups`` equal
    sub-batches, each run through ``model`` alone (so a train-mode BatchNorm uses that sub-batch's
    statistics) and the concatenated outputs are un-permuted. ``groups`` must divide the batch.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={model!r} must be an nn.Module")
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise TypeError(f"x must be a batch-first torch.Tensor, got {type(x).__name__}")
    n = x.shape[0]
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or n % groups:
        raise ValueError(f"groups={groups!r} must be a positive integer dividing the batch of {n}")
    perm = torch.randperm(n, generator=generator).to(x.device)
    out = torch.cat([model(chunk) for chunk in x[perm].chunk(groups)])
    return out[torch.argsort(perm)]
