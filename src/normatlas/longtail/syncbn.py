"""SyncBatchNorm on ``torch.distributed``: BatchNorm whose statistics span every rank.

Essay failure mode 5: per-device statistics make the local batch the effective batch, so
changing the parallelism changes the model's function. :class:`SyncBatchNorm` computes the
statistics of the concatenated global batch:

* forward: ONE collective per layer per step, an ``all_gather`` of each rank's
  ``(count, mean, M2)`` packed into one fp32 (fp64 for fp64 input) vector of ``2C + 1``
  numbers, merged with Chan et al.'s numerically stable parallel-variance formula (no
  ``E[x^2] - E[x]^2`` cancellation). Ranks may hold different batch sizes, including zero; an
  empty global batch gives an empty output and keeps the running estimates, and a global batch
  of one value per feature raises, both as :class:`BatchNorm` (and ``torch.nn.BatchNorm*d``) do.
* backward: one ``all_reduce`` of ``(sum g, sum g * x_hat)`` per layer, the two sums the
  BatchNorm input gradient needs over the global batch.

Works with any backend that implements ``all_gather`` / ``all_reduce`` (gloo, nccl). Without an
initialised process group (or with world size 1) it is plain :class:`BatchNorm`. Eval mode uses
the running statistics. Parameter gradients are the local contributions; DDP's gradient
all-reduce sums / averages them as for any parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..functional import compute_dtype, resolve
from ..spec import CastOrder, Layout
from .batchnorm import BatchNorm, Device, _blend, batch_moments

__all__ = ["SyncBatchNorm", "merge_moments"]


def merge_moments(counts: Tensor, means: Tensor, m2s: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Merge per-part ``(count, mean, M2 = sum of squared deviations)`` along dim 0 (Chan et al., 1979).

    ``counts`` has shape (P,), ``means`` / ``m2s`` (P, C). Returns (total count, mean, M2);
    parts with count 0 contribute nothing.
    """
    total = counts.sum()
    w = counts / total.clamp_min(1)
    mean = (w[:, None] * means).sum(0)
    m2 = m2s.sum(0) + (counts[:, None] * (means - mean).pow(2)).sum(0)
    return total, mean, m2


class _SyncBNFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, group: Any,
        reduce_dims: tuple[int, ...], pview: tuple[int, ...], world: int, out_stats: list[Tensor],
    ) -> Tensor:  # fmt: skip
        cdtype = torch.float64 if x.dtype == torch.float64 else compute_dtype(x.dtype, CastOrder.AFTER_GAIN)
        xf = x.to(cdtype)
        count, mean, var = batch_moments(xf, reduce_dims, None)
        c = mean.numel()
        local = torch.cat([count.reshape(1), mean.reshape(c), (var * count).reshape(c)])
        if world > 1:
            gathered = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(gathered, local.contiguous(), group=group)  # the one forward collective
            parts = torch.stack(gathered)
        else:
            parts = local[None]
        total, gmean, m2 = merge_moments(parts[:, 0], parts[:, 1 : 1 + c], parts[:, 1 + c :])
        if float(total) == 1:  # every rank sees the same total, so every rank raises (no collective is left hanging)
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size {x.size()} on this rank "
                f"and 1 value per channel over all {world} rank(s): batch statistics need at least 2 values per feature"
            )
        gvar = m2 / total.clamp_min(1)  # an empty global batch: mean 0, var 0, an empty output, estimates kept
        invstd = torch.rsqrt(gvar + eps)
        x_hat = (xf - gmean.reshape(pview)) * invstd.reshape(pview)
        y = x_hat
        if weight is not None:
            y = y * weight.to(cdtype).reshape(pview)
        if bias is not None:
            y = y + bias.to(cdtype).reshape(pview)
        ctx.save_for_backward(x_hat, invstd, weight, total)
        ctx.meta = (group, reduce_dims, pview, world, x.dtype, bias is not None)
        out_stats.extend([total, gmean, gvar])
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x_hat, invstd, weight, total = ctx.saved_tensors
        group, dims, pview, world, in_dtype, has_bias = ctx.meta
        go = grad_out.to(x_hat.dtype)
        g = go * weight.to(x_hat.dtype).reshape(pview) if weight is not None else go
        c = invstd.numel()
        sums = torch.cat([g.sum(dims).reshape(c), (g * x_hat).sum(dims).reshape(c)])
        if world > 1:
            dist.all_reduce(sums, group=group)  # the one backward collective
        mean_g = (sums[:c] / total).reshape(pview)
        mean_gx = (sums[c:] / total).reshape(pview)
        grad_x = ((g - mean_g - x_hat * mean_gx) * invstd.reshape(pview)).to(in_dtype)
        grad_w = (go * x_hat).sum(dims).reshape(weight.shape).to(weight.dtype) if weight is not None else None
        grad_b = go.sum(dims).reshape(-1).to(grad_out.dtype) if has_bias else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


class SyncBatchNorm(BatchNorm):
    """BatchNorm over the global batch of a ``torch.distributed`` process group (see module docstring).

    Same arguments as :class:`BatchNorm` plus ``process_group`` (None = the default group).
    Statistics, outputs, input gradients and running statistics equal single-process BatchNorm
    on the concatenation of every rank's batch; summed over ranks, the parameter gradients do too.
    """

    def __init__(
        self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
        track_running_stats: bool = True, process_group: Any = None, device: Device = None,
        dtype: torch.dtype | None = None, *, layout: Layout = Layout.NC_ANY,
    ) -> None:  # fmt: skip
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, layout=layout)
        self.process_group = process_group

    def _world(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return int(dist.get_world_size(self.process_group))

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        if not self._use_batch_stats():
            return super().forward(input, mask)
        if mask is not None:
            raise ValueError("mask is not supported by SyncBatchNorm; use BatchNorm or GhostBatchNorm for padding")
        self._check_shape(input)
        plan = resolve(self.spec, tuple(input.shape))
        stats: list[Tensor] = []
        out: Tensor = _SyncBNFunction.apply(
            input, self.weight, self.bias, self._eps(), self.process_group, plan.reduce_dims, plan.param_view,
            self._world(), stats,
        )  # fmt: skip
        if self.running_var is not None and self.running_mean is not None:
            total, gmean, gvar = stats
            momentum = self._momentum()  # counts the step even for an empty batch, as torch.nn.BatchNorm does
            if float(total) > 0:  # nothing observed on any rank: keep the estimates (as BatchNorm does)
                n = total.clamp_min(2)
                _blend(self.running_mean, gmean, momentum)
                _blend(self.running_var, gvar * n / (n - 1), momentum)
        return out
