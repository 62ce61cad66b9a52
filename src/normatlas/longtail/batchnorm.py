"""Batch-statistics normalization: BatchNorm as a preset of the core, and its variants.

Essay section "BatchNorm and its five failure modes" and "The BatchNorm variants worth knowing".

* :class:`BatchNorm` (Ioffe & Szegedy, 2015): statistics over (samples, positions) per
  feature; training uses the batch, eval the fp32 running estimates (torch's momentum
  convention). An optional boolean ``mask`` keeps padding out of the statistics (failure
  mode 2). A preset of :class:`normatlas.Norm`: no second implementation.
* :class:`GhostBatchNorm` (Hoffer, Hubara & Soudry, 2017): statistics per virtual
  sub-batch of ``virtual_batch_size`` examples; the running estimates blend the mean of the
  sub-batch statistics once per step.
* :class:`BatchRenorm` (Ioffe, 2017): ``((x - mu_B) / sigma_B * r + d)`` with
  ``r = clip(sigma_B / sigma, 1/r_max, r_max)`` and ``d = clip((mu_B - mu) / sigma, -d_max, d_max)``
  held constant in the backward; ``r_max`` / ``d_max`` are floats or :class:`Ramp` schedules.
* :class:`FrozenBatchNorm`: statistics and affine are buffers; equal to eval-mode BatchNorm.

All share torch's parameter and buffer names (``weight``, ``bias``, ``running_mean``,
``running_var``, ``num_batches_tracked``), so state dicts move between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..functional import check_batch_values, compute_dtype, moments, normalize, resolve
from ..modules import Norm, _count
from ..spec import Axis, CastOrder, Gain, Layout, NormSpec

__all__ = [
    "PAPER_D_MAX",
    "PAPER_R_MAX",
    "BatchNorm",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "BatchNormState",
    "BatchRenorm",
    "FrozenBatchNorm",
    "GhostBatchNorm",
    "Ramp",
    "batch_moments",
    "batch_norm_spec",
    "read_batchnorm",
]

Device = torch.device | str | None
_BATCH_AXES = frozenset({Axis.SAMPLE, Axis.POSITION})


def batch_norm_spec(layout: Layout = Layout.NC_ANY, eps: float = 1e-5, affine: bool = True) -> NormSpec:
    """The BatchNorm spec: centre and divide by the std over every axis but the feature axis."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout={layout!r} must be a Layout (e.g. Layout.NC_ANY, Layout.N_ANY_C)")
    return NormSpec(
        layout=layout, reduce=_BATCH_AXES, eps=eps, gain=Gain.PER_FEATURE if affine else Gain.NONE, bias=affine
    )


_MOMENTS_SPEC = batch_norm_spec()  # centred, mean of squares: what batch_moments asks the core for


def batch_moments(x: Tensor, dims: tuple[int, ...], mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(count, mean, biased variance) over ``dims`` (kept), counting only ``mask``'s True positions.

    A thin adapter over the core's statistics (``normatlas.functional.moments``, which the
    core's generic path uses) for the BatchNorm spec, with the count as a tensor. ``x`` should
    already be in the compute dtype. An empty or all-masked slice has count 0, mean 0, var 0.
    """
    if mask is not None:
        mask = mask.expand(x.shape)  # as the core does: a broadcast mask counts every position it covers
    elif math.prod(x.shape[d] for d in dims) == 0:  # the core's mean of nothing is NaN; ours is 0
        zero = torch.zeros_like(x.sum(dims, keepdim=True))
        return torch.zeros([1] * x.dim(), dtype=x.dtype, device=x.device), zero, torch.zeros_like(zero)
    mean, _, var, count = moments(x, _MOMENTS_SPEC, dims, mask)
    assert mean is not None  # the BatchNorm spec centres
    if not isinstance(count, Tensor):
        count = torch.full([1] * x.dim(), float(count), dtype=x.dtype, device=x.device)
    return count, mean, var


@torch.no_grad()
def _blend(running: Tensor, batch: Tensor, momentum: float) -> None:
    running.mul_(1 - momentum).add_(batch.reshape(running.shape).to(running.dtype), alpha=momentum)


def _check_positive(value: object, name: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name}={value!r} must be a finite number")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}={value!r} must be {'>= 0' if allow_zero else '> 0'}")
    return float(value)


class BatchNorm(Norm):
    """BatchNorm (Ioffe & Szegedy, 2015) as a preset of the core; drop-in for ``torch.nn.BatchNorm*d``.

    ``layout`` selects where the feature axis is: ``Layout.NC_ANY`` (default; ``(N, C, ...)``,
    torch's convention) or ``Layout.N_ANY_C`` for ``(B, T, D)`` sequences. ``forward(input,
    mask=None)``: ``mask`` (bool, broadcastable to the input, True = real token) removes padding
    from the statistics and from the running estimates. Running statistics are kept in fp32
    whatever the parameter dtype. In train mode example i's output depends on example j (the
    essay's failure mode 4); in eval mode it does not.
    """

    def __init__(
        self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
        track_running_stats: bool = True, device: Device = None, dtype: torch.dtype | None = None,
        *, layout: Layout = Layout.NC_ANY,
    ) -> None:  # fmt: skip
        super().__init__(
            batch_norm_spec(layout, eps, affine), _count(num_features, "num_features"),
            track_running_stats=track_running_stats, momentum=momentum, device=device, dtype=dtype,
        )  # fmt: skip
        self.num_features, self.affine = num_features, affine

    def _use_batch_stats(self) -> bool:
        return self.training or self.running_var is None

    def _eps(self) -> float:
        assert self.spec.eps is not None
        return self.spec.eps


class BatchNorm1d(BatchNorm):
    """``torch.nn.BatchNorm1d``: input (N, C) or (N, C, L); any other rank raises, as in torch."""

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        if isinstance(input, Tensor) and input.dim() not in (2, 3):
            raise ValueError(
                f"expected 2D or 3D input (got {input.dim()}D input): input of shape {tuple(input.shape)}; "
                "BatchNorm1d takes (N, C) or (N, C, L) (BatchNorm with layout=Layout.NC_ANY takes any rank >= 2)"
            )
        return super().forward(input, mask)


class BatchNorm2d(BatchNorm):
    """``torch.nn.BatchNorm2d``: input (N, C, H, W)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device: Device = None,
                 dtype: torch.dtype | None = None):  # fmt: skip
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, layout=Layout.NCHW)


class BatchNorm3d(BatchNorm):
    """``torch.nn.BatchNorm3d``: input (N, C, D, H, W)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device: Device = None,
                 dtype: torch.dtype | None = None):  # fmt: skip
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, layout=Layout.NCDHW)


class GhostBatchNorm(BatchNorm):
    """Ghost BatchNorm (Hoffer et al., 2017): batch statistics per virtual batch of ``virtual_batch_size``.

    The batch is split along dim 0 into consecutive chunks (the last may be smaller); each chunk
    is normalized by its own statistics, keeping the regularising noise of small batches inside
    a large one. A last chunk that would hold a single value per feature (one sample and no
    positions, e.g. batch 5 of ``(N, C)`` in virtual batches of 4) has no variance: it joins the
    chunk before it (batch 5 is then one chunk of 5). Running estimates are updated once per step
    with the chunks' statistics averaged with weights equal to their value counts (real positions
    only under a ``mask``), so equal chunks weigh equally and ``virtual_batch_size >= batch`` is
    exactly :class:`BatchNorm`.
    """

    def __init__(
        self, num_features: int, virtual_batch_size: int = 32, eps: float = 1e-5, momentum: float | None = 0.1,
        affine: bool = True, track_running_stats: bool = True, device: Device = None,
        dtype: torch.dtype | None = None, *, layout: Layout = Layout.NC_ANY,
    ) -> None:  # fmt: skip
        if isinstance(virtual_batch_size, bool) or not isinstance(virtual_batch_size, int) or virtual_batch_size < 1:
            raise ValueError(f"virtual_batch_size={virtual_batch_size!r} must be an integer >= 1")
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, layout=layout)
        self.virtual_batch_size = virtual_batch_size

    def _chunk_sizes(self, input: Tensor) -> list[int]:
        n, vbs = input.shape[0], self.virtual_batch_size
        sizes = [vbs] * (n // vbs) + ([n % vbs] if n % vbs else [])
        reduce_dims = resolve(self.spec, tuple(input.shape)).reduce_dims
        if sizes[-1] == 1 and math.prod(input.shape[d] for d in reduce_dims if d != 0) == 1:
            if vbs == 1:
                raise ValueError(
                    f"virtual_batch_size=1 splits an input of shape {tuple(input.shape)} into virtual batches of "
                    "one value per feature, which have no batch statistics; use virtual_batch_size >= 2"
                )
            sizes[-2:] = [sizes[-2] + 1]  # one value per feature: merge into the previous chunk
        return sizes

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        if not self._use_batch_stats() or input.shape[0] <= self.virtual_batch_size:
            return super().forward(input, mask)
        self._check_shape(input)
        sizes = self._chunk_sizes(input)
        chunks = input.split(sizes, 0)
        if mask is not None:
            mask = mask.expand(input.shape)
            mask_chunks: tuple[Tensor | None, ...] = tuple(mask.split(sizes, 0))
        else:
            mask_chunks = (None,) * len(chunks)
        outs, means, vars_, counts = [], [], [], []
        tracking = self.running_var is not None
        sdtype = self.running_var.dtype if self.running_var is not None else torch.float32
        for chunk, m in zip(chunks, mask_chunks, strict=True):
            # momentum 1 turns scratch buffers into this chunk's (unbiased) statistics
            rm = torch.zeros(self.shape or (), dtype=sdtype, device=input.device) if tracking else None
            rv = torch.ones(self.shape or (), dtype=sdtype, device=input.device) if tracking else None
            outs.append(normalize(chunk, self.spec, self.weight, self.bias, mask=m, running_mean=rm,
                                  running_var=rv, training=True, momentum=1.0))  # fmt: skip
            if tracking:
                means.append(rm)
                vars_.append(rv)
                counts.append(self._counts(chunk, m).to(sdtype))
        if tracking:
            assert self.running_var is not None and self.running_mean is not None
            momentum, w = self._momentum(), torch.stack(counts)
            total = w.sum(0)
            seen = total > 0  # a feature with no real value in any chunk keeps its estimates
            with torch.no_grad():
                for running, stats in ((self.running_mean, means), (self.running_var, vars_)):
                    batch = (w * torch.stack(stats)).sum(0) / total.clamp_min(1)  # type: ignore[arg-type]
                    running.copy_(torch.where(seen, running * (1 - momentum) + batch * momentum, running))
        return torch.cat(outs, 0)

    def _counts(self, chunk: Tensor, mask: Tensor | None) -> Tensor:
        """Per feature, the number of values in ``chunk`` its statistics were computed from (float32)."""
        plan = resolve(self.spec, tuple(chunk.shape))
        fshape = self.shape or ()
        if mask is None:
            n = math.prod(chunk.shape[d] for d in plan.reduce_dims)
            return torch.full(fshape, float(n), dtype=torch.float32, device=chunk.device)
        return mask.to(torch.float32).sum(plan.reduce_dims).reshape(fshape)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", virtual_batch_size={self.virtual_batch_size}"


@dataclass(frozen=True)
class Ramp:
    """A value that is ``start`` until step ``begin``, then linear to ``end`` at step ``finish``, then flat.

    The Batch Renormalization paper relaxes ``r_max`` from 1 to 3 and ``d_max`` from 0 to 5
    (:data:`PAPER_R_MAX`, :data:`PAPER_D_MAX`).
    """

    start: float
    end: float
    begin: int
    finish: int

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            _check_positive(getattr(self, name), name, allow_zero=True)
        for name in ("begin", "finish"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}={v!r} must be an integer step >= 0")
        if self.finish < self.begin:
            raise ValueError(f"finish={self.finish} must be >= begin={self.begin}")

    def __call__(self, step: int) -> float:
        if step <= self.begin:
            return self.start
        if step >= self.finish:
            return self.end
        return self.start + (self.end - self.start) * (step - self.begin) / (self.finish - self.begin)


PAPER_R_MAX = Ramp(1.0, 3.0, 5_000, 40_000)
PAPER_D_MAX = Ramp(0.0, 5.0, 5_000, 25_000)


class BatchRenorm(BatchNorm):
    """Batch Renormalization (Ioffe, NeurIPS 2017): batch statistics corrected toward the running ones.

    Training computes ``x_hat = (x - mu_B) / sigma_B * r + d`` with ``sigma = sqrt(running_var + eps)``,
    ``r = clip(sigma_B / sigma, 1 / r_max, r_max)`` and ``d = clip((mu_B - mu) / sigma, -d_max, d_max)``,
    both treated as constants in the backward (stop-gradient). ``r_max = 1, d_max = 0`` is exactly
    BatchNorm; with the clips open it equals the eval-mode function, closing the train/eval gap.
    ``r_max`` / ``d_max`` are floats or :class:`Ramp` schedules over ``num_batches_tracked``.
    """

    def __init__(
        self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.01, affine: bool = True,
        device: Device = None, dtype: torch.dtype | None = None, *, r_max: float | Ramp = PAPER_R_MAX,
        d_max: float | Ramp = PAPER_D_MAX, layout: Layout = Layout.NC_ANY,
    ) -> None:  # fmt: skip
        super().__init__(num_features, eps, momentum, affine, True, device, dtype, layout=layout)
        if not isinstance(r_max, Ramp) and _check_positive(r_max, "r_max") < 1:
            raise ValueError(f"r_max={r_max!r} must be >= 1")
        if not isinstance(d_max, Ramp):
            _check_positive(d_max, "d_max", allow_zero=True)
        self.r_max, self.d_max = r_max, d_max

    def limits(self) -> tuple[float, float]:
        """The current ``(r_max, d_max)`` at step ``num_batches_tracked``."""
        step = int(self.num_batches_tracked) if self.num_batches_tracked is not None else 0
        r = self.r_max(step) if isinstance(self.r_max, Ramp) else self.r_max
        d = self.d_max(step) if isinstance(self.d_max, Ramp) else self.d_max
        return max(float(r), 1.0), float(d)

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        if not self.training:
            return super().forward(input, mask)
        self._check_shape(input)
        assert self.running_mean is not None and self.running_var is not None
        r_max, d_max = self.limits()
        plan = resolve(self.spec, tuple(input.shape))
        check_batch_values(input, self.spec, plan)  # one value per feature: raise as BatchNorm (and torch) do
        cdtype = compute_dtype(input.dtype, CastOrder.AFTER_GAIN)
        xf = input.to(cdtype)
        count, mean, var = batch_moments(xf, plan.reduce_dims, mask)
        eps = self._eps()
        std_b = (var + eps).sqrt()
        pv = plan.param_view
        std = (self.running_var.to(cdtype) + eps).sqrt().reshape(pv)
        with torch.no_grad():
            r = (std_b / std).clamp(1.0 / r_max, r_max)
            d = ((mean - self.running_mean.to(cdtype).reshape(pv)) / std).clamp(-d_max, d_max)
        y = (xf - mean) / std_b * r + d
        if self.weight is not None:
            y = y * self.weight.to(cdtype).reshape(pv)
        if self.bias is not None:
            y = y + self.bias.to(cdtype).reshape(pv)
        n = float(count.sum()) if mask is not None else float(count.flatten()[0])
        momentum = self._momentum()
        if n > 0:
            cnt = count.reshape(self.running_var.shape) if mask is not None else n
            unbiased = var.reshape(self.running_var.shape) * (cnt / torch.as_tensor(cnt - 1).clamp_min(1))
            _blend(self.running_mean, mean.detach(), momentum)
            _blend(self.running_var, unbiased.detach(), momentum)
        return y.to(input.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", r_max={self.r_max}, d_max={self.d_max}"


class FrozenBatchNorm(nn.Module):
    """Frozen BatchNorm: statistics and affine are fixed buffers, ``y = x * scale + shift``.

    ``scale = weight / sqrt(running_var + eps)``, ``shift = bias - running_mean * scale``. Equal to
    eval-mode BatchNorm with the same state, in train mode too (the default for fine-tuning a CNN
    backbone at small batch; essay failure mode 3). No parameters, so nothing trains; load torch's
    BatchNorm state dicts directly (``num_batches_tracked`` is ignored) or use :meth:`from_batchnorm`.
    """

    weight: Tensor
    bias: Tensor
    running_mean: Tensor
    running_var: Tensor

    def __init__(
        self, num_features: int, eps: float = 1e-5, device: Device = None, *, layout: Layout = Layout.NC_ANY
    ) -> None:
        super().__init__()
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features={num_features!r} must be an integer >= 1")
        self.spec = batch_norm_spec(layout, eps)
        self.num_features, self.eps = num_features, _check_positive(eps, "eps")
        f32: dict[str, Any] = {"device": device, "dtype": torch.float32}
        self.register_buffer("weight", torch.ones(num_features, **f32))
        self.register_buffer("bias", torch.zeros(num_features, **f32))
        self.register_buffer("running_mean", torch.zeros(num_features, **f32))
        self.register_buffer("running_var", torch.ones(num_features, **f32))

    @classmethod
    def from_batchnorm(cls, bn: nn.Module) -> FrozenBatchNorm:
        """Freeze any BatchNorm flavour that has running statistics (torch's or ours; see :func:`read_batchnorm`)."""
        state = read_batchnorm(bn)
        if state is None:
            raise ValueError(f"{type(bn).__name__} computes no per-channel batch statistics: not a BatchNorm")
        return cls.from_state(state)

    @classmethod
    def from_state(cls, state: BatchNormState) -> FrozenBatchNorm:
        """The frozen copy of a :class:`BatchNormState`: its statistics, affine and eps as buffers."""
        rm, rv = state.running_mean, state.running_var
        name = type(state.module).__name__
        if rm is None or rv is None:
            raise ValueError(f"{name} has no running statistics to freeze (track_running_stats=False?)")
        if not state.eps > 0:  # an eps of 0 used to become 1e-5: a different function
            raise ValueError(f"{name} has eps={state.eps!r}; FrozenBatchNorm needs eps > 0 (var + eps)")
        frozen = cls(state.num_features, state.eps, device=rv.device, layout=state.layout)
        with torch.no_grad():
            frozen.running_mean.copy_(rm)
            frozen.running_var.copy_(rv)
            if state.weight is not None:
                frozen.weight.copy_(state.weight)
            if state.bias is not None:
                frozen.bias.copy_(state.bias)
        return frozen

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        state_dict.pop(prefix + "num_batches_tracked", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, input: Tensor) -> Tensor:
        plan = resolve(self.spec, tuple(input.shape))
        if tuple(input.shape[d] for d in plan.feature_dims) != (self.num_features,):
            raise ValueError(f"input of shape {tuple(input.shape)} does not have {self.num_features} features")
        cdtype = compute_dtype(input.dtype, CastOrder.AFTER_GAIN)
        scale = self.weight.to(cdtype) * torch.rsqrt(self.running_var.to(cdtype) + self.eps)
        shift = self.bias.to(cdtype) - self.running_mean.to(cdtype) * scale
        pv = plan.param_view
        return (input.to(cdtype) * scale.reshape(pv) + shift.reshape(pv)).to(input.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, layout={self.spec.layout.value!r}"


@dataclass
class BatchNormState:
    """A BatchNorm of any flavour, read by what it computes (per-channel batch statistics), not by its class.

    ``eps`` is the eps it computes with: torch's ``eps`` attribute, a normatlas spec's eps, or the machine
    eps of float32 where the spec says None (statistics are computed in at least float32).
    """

    module: nn.Module
    num_features: int
    eps: float
    momentum: float | None
    layout: Layout
    weight: Tensor | None
    bias: Tensor | None
    running_mean: Tensor | None
    running_var: Tensor | None
    num_batches_tracked: Tensor | None
    frozen: bool

    @property
    def factory(self) -> dict[str, Any]:
        """``device`` and ``dtype`` of its state, for building a replacement."""
        ref = self.weight if self.weight is not None else self.running_var
        if self.frozen:
            return {"device": self.running_var.device if self.running_var is not None else None, "dtype": torch.float32}
        return {"device": ref.device, "dtype": ref.dtype} if ref is not None else {}

    def channel_axis(self, ndim: int) -> int:
        """The axis of an ``ndim`` input it normalises per channel."""
        return ndim - 1 if self.layout.channels_last else 1 % ndim


def read_batchnorm(module: nn.Module) -> BatchNormState | None:
    """The :class:`BatchNormState` of ``module``, or None when it computes no per-channel batch statistics.

    Recognised: torch's ``_BatchNorm`` family (BatchNorm1d/2d/3d, SyncBatchNorm, lazy ones), every
    normatlas :class:`~normatlas.Norm` whose spec reduces over the samples and not the features (our
    BatchNorm and its subclasses), and :class:`FrozenBatchNorm`. The one BatchNorm detector of the
    library: the converters, surgery and the diagnostics all call it.
    """
    if isinstance(module, FrozenBatchNorm):
        return BatchNormState(module, module.num_features, module.eps, None, module.spec.layout, module.weight,
                              module.bias, module.running_mean, module.running_var, None, True)  # fmt: skip
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        eps = float(module.eps)
        return BatchNormState(module, module.num_features, eps, module.momentum, Layout.NC_ANY, module.weight,
                              module.bias, module.running_mean, module.running_var, module.num_batches_tracked,
                              False)  # fmt: skip
    if isinstance(module, Norm) and module.shape is not None:
        spec = module.spec
        if Axis.SAMPLE not in spec.reduce or Axis.FEATURE in spec.reduce:
            return None
        eps = spec.eps if spec.eps is not None else torch.finfo(torch.float32).eps
        buffers = {n: getattr(module, n, None) for n in ("running_mean", "running_var", "num_batches_tracked")}
        return BatchNormState(module, module.shape[0], float(eps), getattr(module, "momentum", None), spec.layout,
                              module.weight, module.bias, buffers["running_mean"], buffers["running_var"],
                              buffers["num_batches_tracked"], False)  # fmt: skip
    return None
