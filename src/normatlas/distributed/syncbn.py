"""``convert_sync_batchnorm`` for normatlas BatchNorm modules (torch's converter knows torch's classes only).

Every :class:`~normatlas.longtail.BatchNorm` (1d / 2d / 3d, any layout) in a model is replaced by a
:class:`~normatlas.longtail.SyncBatchNorm` with the same spec, parameters and running statistics, whose batch
statistics span the process group (one all-gather per layer in the forward, one all-reduce in the backward; ranks
may hold different batch sizes). Ghost and frozen BatchNorm keep their own semantics and are left alone. Wrap the
converted model in ``DistributedDataParallel`` as usual: DDP averages the parameter gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..longtail import BatchNorm, BatchNorm1d, BatchNorm2d, BatchNorm3d, SyncBatchNorm

__all__ = ["convert_sync_batchnorm"]

_CONVERTIBLE = (BatchNorm, BatchNorm1d, BatchNorm2d, BatchNorm3d)


def _sync(bn: BatchNorm, process_group: Any) -> SyncBatchNorm:
    w = bn.weight if bn.weight is not None else bn.bias
    assert bn.shape is not None  # a BatchNorm always has its channel count
    sync = SyncBatchNorm(
        int(bn.shape[0]), eps=float(bn.spec.eps or 1e-5),
        momentum=bn.momentum, affine=bn.weight is not None, track_running_stats=bn.track_running_stats,
        process_group=process_group, device=None if w is None else w.device, dtype=None if w is None else w.dtype,
        layout=bn.spec.layout,
    )  # fmt: skip
    with torch.no_grad():
        for name in ("weight", "bias"):
            src, dst = getattr(bn, name), getattr(sync, name)
            if src is not None and dst is not None:
                dst.copy_(src)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        src = getattr(bn, name)
        if src is not None:
            setattr(sync, name, src.detach().clone())
    sync.train(bn.training)
    return sync


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Replace each plain normatlas BatchNorm in ``module`` (itself included) by a SyncBatchNorm; return the result.

    ``process_group``: the group the statistics span (None: the default group). Subclasses with other semantics
    (GhostBatchNorm, FrozenBatchNorm, SyncBatchNorm itself) are kept. Like ``torch.nn.SyncBatchNorm.
    convert_sync_batchnorm``, it returns the converted top module (a new object when ``module`` itself converts).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module={module!r} must be an nn.Module")
    if type(module) in _CONVERTIBLE:
        assert isinstance(module, BatchNorm)
        return _sync(module, process_group)
    for name, child in module.named_children():
        new = convert_sync_batchnorm(child, process_group)
        if new is not child:
            setattr(module, name, new)
    return module
