"""Model surgery for batch statistics: swap every BatchNorm flavour for Frozen, Group, Sync or Ghost.

Essay failure modes 3 (train/eval mismatch: freeze) and 5 (per-device statistics: sync), and
the advice for hybrid VLM towers ("freeze them, or convert to GroupNorm before you fine-tune").

Recognised sources: whatever :func:`~normatlas.longtail.read_batchnorm` reads as a BatchNorm (torch's
family, every normatlas :class:`~normatlas.Norm` with per-channel batch statistics, and
:class:`FrozenBatchNorm`). What is kept:

=========  ==========================================================================
target     kept
=========  ==========================================================================
FROZEN     running_mean, running_var, weight, bias (output = eval-mode BatchNorm)
GROUP      weight, bias (per-channel affine has the same meaning); running stats dropped
SYNC       running_mean, running_var, num_batches_tracked, weight, bias, momentum
GHOST      as SYNC
=========  ==========================================================================
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..modules import Norm
from ..presets import GroupNorm
from ..spec import Axis, Gain, NormSpec
from ._report import ConversionReport, replace_modules
from .batchnorm import BatchNorm, BatchNormState, FrozenBatchNorm, GhostBatchNorm, read_batchnorm
from .syncbn import SyncBatchNorm

__all__ = ["BatchNormTarget", "convert_batchnorm"]

_BATCH_AXES = frozenset({Axis.SAMPLE, Axis.POSITION})


class BatchNormTarget(enum.Enum):
    """What :func:`convert_batchnorm` turns every BatchNorm into."""

    FROZEN = "frozen"
    GROUP = "group"
    SYNC = "sync"
    GHOST = "ghost"


def _copy(dst: Tensor | None, src: Tensor | None, name: str, kept: list[str]) -> None:
    if dst is not None and src is not None:
        with torch.no_grad():
            dst.copy_(src)
        kept.append(name)


def _group_count(channels: int, wanted: int) -> int:
    """The largest divisor of ``channels`` that is <= ``wanted``."""
    return max(d for d in range(1, min(channels, wanted) + 1) if channels % d == 0)


def _build(
    bn: BatchNormState, to: BatchNormTarget, num_groups: int, vbs: int, group: Any
) -> tuple[nn.Module, list[str], str]:
    kept: list[str] = []
    note = ""
    affine = bn.weight is not None
    if to is BatchNormTarget.FROZEN:
        if bn.running_var is None:
            raise ValueError("cannot freeze a BatchNorm without running statistics (track_running_stats=False)")
        frozen = FrozenBatchNorm.from_state(bn)
        kept = [n for n in ("running_mean", "running_var", "weight", "bias") if getattr(bn, n) is not None]
        return frozen, kept, note
    if to is BatchNormTarget.GROUP:
        g = _group_count(bn.num_features, num_groups)
        if g != num_groups:
            note = f"num_groups={num_groups} does not divide {bn.num_features} channels; used {g}. "
        new: nn.Module
        if bn.layout.channels_last:
            spec = NormSpec(layout=bn.layout, reduce=frozenset({Axis.FEATURE, Axis.POSITION}), groups=g, eps=bn.eps,
                            bias=affine, gain=Gain.PER_FEATURE if affine else Gain.NONE)  # fmt: skip
            new = Norm(spec, bn.num_features, **bn.factory)
        else:
            new = GroupNorm(g, bn.num_features, bn.eps, affine, **bn.factory)
        _copy(getattr(new, "weight", None), bn.weight, "weight", kept)
        _copy(getattr(new, "bias", None), bn.bias, "bias", kept)
        note += "running statistics dropped (GroupNorm is per sample)"
        return new, kept, note
    track = bn.running_var is not None
    common: dict[str, Any] = {"eps": bn.eps, "momentum": bn.momentum, "affine": affine,
                              "track_running_stats": track, "layout": bn.layout, **bn.factory}  # fmt: skip
    new_bn: BatchNorm
    if to is BatchNormTarget.SYNC:
        new_bn = SyncBatchNorm(bn.num_features, process_group=group, **common)
    else:
        new_bn = GhostBatchNorm(bn.num_features, vbs, **common)
    for name in ("running_mean", "running_var", "num_batches_tracked", "weight", "bias"):
        _copy(getattr(new_bn, name), getattr(bn, name), name, kept)
    if bn.frozen:
        note = "was frozen: statistics update and the affine trains again"
    return new_bn, kept, note


_TARGET_TYPES: dict[BatchNormTarget, type[nn.Module]] = {
    BatchNormTarget.FROZEN: FrozenBatchNorm,
    BatchNormTarget.SYNC: SyncBatchNorm,
    BatchNormTarget.GHOST: GhostBatchNorm,
}


def convert_batchnorm(
    model: nn.Module,
    to: BatchNormTarget,
    *,
    num_groups: int = 32,
    virtual_batch_size: int = 32,
    process_group: Any = None,
    include: Callable[[str, nn.Module], bool] | None = None,
) -> ConversionReport:
    """Replace, in place, every BatchNorm flavour in ``model`` by ``to``; return what changed.

    Args:
        model: any ``nn.Module`` (the root itself is not replaced).
        to: the target flavour.
        num_groups: for ``GROUP``; when it does not divide the channel count, the largest
            divisor of the channel count below it is used and the report says so.
        virtual_batch_size: for ``GHOST``.
        process_group: for ``SYNC`` (None = the default group).
        include: optional filter ``(path, module) -> bool``.

    Modules already of the target type (or a subclass of it) are left alone. Train/eval mode is preserved.
    """
    if not isinstance(to, BatchNormTarget):
        members = ", ".join(f"BatchNormTarget.{m.name}" for m in BatchNormTarget)
        raise TypeError(f"to={to!r} must be a BatchNormTarget ({members})")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"num_groups={num_groups!r} must be an integer >= 1")
    if isinstance(virtual_batch_size, bool) or not isinstance(virtual_batch_size, int) or virtual_batch_size < 1:
        raise ValueError(f"virtual_batch_size={virtual_batch_size!r} must be an integer >= 1")
    skip = _TARGET_TYPES.get(to)

    def build(path: str, module: nn.Module) -> tuple[nn.Module, list[str], str] | None:
        bn = read_batchnorm(module) if skip is None or not isinstance(module, skip) else None
        if bn is None:
            return None
        try:
            return _build(bn, to, num_groups, virtual_batch_size, process_group)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None

    return replace_modules(model, build, include)
