"""Two of BatchNorm's remaining pitfalls (essay §04): how few samples feed a statistic, and the per-device split.

* :func:`bn_sample_counts`: BatchNorm over ``(batch x positions)`` of a padded sequence batch. With the pads
  masked out, each channel's statistic is fed by the real tokens only (``pooled``), not ``B * T``; a BatchNorm
  that keeps one statistic per position (BN over the batch axis alone, a sequence flattened into features) sees
  at position ``t`` only the sequences longer than ``t`` (``per_position``): few at the tail, none past the
  longest. The counts come from the input's own mask.
* :func:`split_outputs`: the same global batch of 8 through a BatchNorm model in 1, 2 or 4 gloo processes
  (:func:`~normatlas.distributed.launch.spawn`), each holding ``8 / world`` examples. Without SyncBN every process
  normalises with its own shard's statistics, so the output changes with the split; with
  :func:`~normatlas.distributed.syncbn.convert_sync_batchnorm` the statistics span the group and the output is
  the one-process output (to float rounding).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import Tensor, nn

__all__ = ["BNSampleCounts", "bn_sample_counts", "split_model", "split_outputs", "split_worker"]


@dataclasses.dataclass(frozen=True)
class BNSampleCounts:
    """How many real tokens feed BatchNorm's statistics on one padded batch.

    ``total``: ``B * T`` (what an unmasked BN averages over, pads included); ``pooled``: real tokens feeding each
    channel's statistic over (batch x positions) with the pads masked; ``per_position[t]``: real tokens feeding a
    per-position statistic (over the batch axis) at position ``t``."""

    total: int
    pooled: int
    per_position: tuple[int, ...]

    @property
    def pad_share(self) -> float:
        """The share of an unmasked BN's samples that are pads."""
        return 1.0 - self.pooled / self.total if self.total else 0.0

    @property
    def min_per_position(self) -> int:
        return min(self.per_position) if self.per_position else 0


def bn_sample_counts(mask: Tensor) -> BNSampleCounts:
    """The sample counts of :class:`BNSampleCounts` for ``mask`` ``(B, T)`` (bool, True = real token)."""
    if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.dtype is not torch.bool:
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a (B, T) bool tensor (True = real token), got {got}")
    per_pos = mask.sum(0)
    return BNSampleCounts(mask.numel(), int(mask.sum()), tuple(int(c) for c in per_pos))


# ------------------------------------------------------------------------ the per-device split

GLOBAL_BATCH = 8


def split_model(seed: int = 0) -> nn.Module:
    """The measured model: Linear(6, 16) -> BatchNorm1d(16) -> Tanh -> Linear(16, 4) -> BatchNorm1d(4), seeded,
    in train mode (batch statistics)."""
    from ..longtail import BatchNorm1d

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4), BatchNorm1d(4)).train()


def _batch(seed: int = 1) -> Tensor:
    return torch.randn(GLOBAL_BATCH, 6, generator=torch.Generator().manual_seed(seed)) * 2 + 0.5


def split_worker(rank: int, world_size: int, sync: bool) -> list[list[float]]:
    """One process's output on its ``8 / world_size`` examples of the global batch (a :func:`spawn` target; a
    list, as a tensor's shared memory does not outlive the process that sends it)."""
    from .syncbn import convert_sync_batchnorm

    model = split_model().double()
    if sync:
        model = convert_sync_batchnorm(model)
    n = GLOBAL_BATCH // world_size
    with torch.no_grad():
        out: list[list[float]] = model(_batch()[rank * n : (rank + 1) * n].double()).tolist()
    return out


def split_outputs(world_size: int, *, sync: bool = False) -> float:
    """Max |output difference| between ``world_size`` gloo processes (global batch 8, split evenly) and one
    process on the whole batch, in float64; ``sync``: the model's BatchNorms converted to SyncBatchNorm."""
    from .launch import spawn

    if world_size not in (1, 2, 4, 8):
        raise ValueError(f"world_size={world_size!r} must divide the global batch of {GLOBAL_BATCH}: 1, 2, 4 or 8")
    with torch.no_grad():
        one = copy.deepcopy(split_model()).double()(_batch().double())
    if world_size == 1:
        return 0.0
    parts = spawn(split_worker, world_size, sync)
    return float((torch.tensor([r for p in parts for r in p], dtype=torch.float64) - one).abs().max())
