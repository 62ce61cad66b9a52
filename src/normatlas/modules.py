"""The one normalization module: parameters and running statistics around :func:`normalize`."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .backend import Backend, as_backend
from .functional import fused_kernels, normalize
from .spec import Axis, Gain, GainConvention, NormSpec, Scale

__all__ = ["Norm"]


def _as_shape(shape: int | Sequence[int] | None, name: str) -> tuple[int, ...] | None:
    if shape is None:
        return None
    if isinstance(shape, bool) or not isinstance(shape, (numbers.Integral, Sequence)):
        raise TypeError(f"{name}={shape!r} must be an int or a sequence of ints")
    dims = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1:
            raise ValueError(f"{name}={shape!r} must hold positive integers")
    return tuple(int(d) for d in dims)


def _count(value: object, name: str) -> int:
    """``value`` as an int >= 1 (a channel, feature or group count), or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")
    return int(value)


class Norm(nn.Module):
    """Run any :class:`NormSpec`, holding its gain, bias and (optionally) running statistics.

    Args:
        spec: the normalization to compute.
        shape: the feature shape: ``normalized_shape`` for a channels-last layout,
            ``num_channels`` for a channels-first one. May be None only when the
            layer holds no per-feature state (no affine and no running statistics).
        track_running_stats: keep running estimates of the statistics (per feature)
            and use them in eval mode, as torch's BatchNorm / InstanceNorm do.
        momentum: update factor for the running estimates; None means a cumulative
            average over all batches seen, as in torch.

        backend: ``"auto"`` (default: the fused kernels wherever they serve the spec and are built, never
            compiling), ``"reference"`` (the core's arithmetic in torch ops) or ``"fused"`` (the kernels,
            compiled now if needed; what they cannot serve raises). See :mod:`normatlas.backend`.

    ``forward(input, mask=None)``: ``mask`` is an optional boolean tensor broadcastable
    to ``input``; statistics are computed over its True positions only (on the reference path).
    """

    def __init__(
        self,
        spec: NormSpec,
        shape: int | Sequence[int] | None = None,
        *,
        track_running_stats: bool = False,
        momentum: float | None = 0.1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        backend: Backend | str = Backend.AUTO,
    ) -> None:
        super().__init__()
        if not isinstance(spec, NormSpec):
            raise TypeError(f"spec must be a NormSpec, got {type(spec).__name__}")
        self.spec = spec
        self.shape = _as_shape(shape, "shape")
        if self.shape is not None:
            expected = spec.feature_ndim if spec.layout.channels_last else 1
            if len(self.shape) != expected:
                raise ValueError(
                    f"shape={self.shape} has {len(self.shape)} dims; layout={spec.layout.value!r} "
                    f"with feature_ndim={spec.feature_ndim} needs {expected}"
                )
            if spec.groups > 1 and self.shape[0] % spec.groups:
                raise ValueError(f"num_groups={spec.groups} must divide num_channels={self.shape[0]}")
        needs_shape = spec.gain is Gain.PER_FEATURE or spec.bias or track_running_stats
        if needs_shape and self.shape is None:
            raise ValueError("shape is required when the layer has per-feature parameters or running stats")
        if momentum is not None:
            if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real):
                raise TypeError(f"momentum={momentum!r} must be a float in [0, 1] or None")
            if not (0.0 <= momentum <= 1.0):
                raise ValueError(f"momentum={momentum!r} must lie in [0, 1] or be None")
            momentum = float(momentum)
        if track_running_stats and (Axis.FEATURE in spec.reduce or spec.scale is not Scale.RMS):
            raise ValueError(
                "track_running_stats=True needs per-feature statistics (reduce without Axis.FEATURE) "
                "and scale=Scale.RMS"
            )
        self.track_running_stats = track_running_stats
        self.momentum = momentum
        self.backend = backend  # validated, and the fused route decided, by the property setter
        fshape = self.shape or ()
        self.weight: nn.Parameter | None = None
        self.bias: nn.Parameter | None = None
        if spec.gain is not Gain.NONE:
            self.weight = nn.Parameter(
                torch.empty(() if spec.gain is Gain.SCALAR else fshape, device=device, dtype=dtype)
            )
        if spec.bias:
            self.bias = nn.Parameter(torch.empty(fshape, device=device, dtype=dtype))
        self.running_mean: Tensor | None
        self.running_var: Tensor | None
        self.num_batches_tracked: Tensor | None
        if track_running_stats:
            fp32 = torch.float32  # running statistics stay fp32
            self.register_buffer(
                "running_mean", torch.zeros(fshape, device=device, dtype=fp32) if spec.center else None
            )
            self.register_buffer("running_var", torch.ones(fshape, device=device, dtype=fp32))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """Like nn.Module._apply, but running statistics never drop below fp32 (``.half()``, ``.to(bf16)``)."""
        super()._apply(fn, recurse)
        for name in ("running_mean", "running_var"):
            buf = getattr(self, name)
            if buf is not None and buf.is_floating_point() and buf.dtype in (torch.float16, torch.bfloat16):
                setattr(self, name, buf.float())
        return self

    @property
    def backend(self) -> Backend:
        """Which implementation runs the forward (settable; see :mod:`normatlas.backend`)."""
        return self._backend

    @backend.setter
    def backend(self, value: Backend | str) -> None:
        b = as_backend(value)
        if b is Backend.FUSED:
            from .kernels.dispatch import spec_unsupported

            reason = "running statistics are not served" if self.track_running_stats else None
            reason = reason or spec_unsupported(self.spec, torch.float32)
            if reason is not None:
                raise ValueError(f"backend='fused' cannot run this norm: {reason}; use backend='auto' or 'reference'")
        self._backend = b
        # None: the reference path always; False: fused when the kernels are ready; True: fused, built if needed
        self._fused: bool | None = None if b is Backend.REFERENCE or self.track_running_stats else b is Backend.FUSED
        self._rank = self.spec.layout.ndim  # a fixed-rank layout takes the fused route only at its own rank

    # torch.nn-compatible spellings of the spec fields
    @property
    def eps(self) -> float | None:
        return self.spec.eps

    @property
    def normalized_shape(self) -> tuple[int, ...] | None:
        return self.shape

    @property
    def elementwise_affine(self) -> bool:
        return self.weight is not None or self.bias is not None

    def reset_running_stats(self) -> None:
        if self.running_var is not None:
            self.running_var.fill_(1)
        if self.running_mean is not None:
            self.running_mean.zero_()
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        """Gain at the identity (1, or 0 under the 1 + w convention), bias at 0."""
        self.reset_running_stats()
        if self.weight is not None:
            with torch.no_grad():
                if self.spec.gain_convention is GainConvention.ONE_PLUS_W:
                    self.weight.zero_()
                else:
                    self.weight.fill_(1.0)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _next_momentum(self) -> float:
        """This step's update factor, without advancing ``num_batches_tracked``."""
        if self.momentum is not None:
            return self.momentum
        if self.num_batches_tracked is not None and self.training:
            return 1.0 / (float(self.num_batches_tracked) + 1.0)  # cumulative average
        return 0.0

    def _count_step(self) -> None:
        """Advance ``num_batches_tracked`` (in training)."""
        if self.num_batches_tracked is not None and self.training:
            self.num_batches_tracked.add_(1)

    def _momentum(self) -> float:
        """This step's update factor; advances ``num_batches_tracked`` in training."""
        momentum = self._next_momentum()
        self._count_step()
        return momentum

    def _unbatched(self, input: Tensor) -> bool:
        """True for an input without the sample axis; raise a ValueError (torch's wording) for a rank not accepted.

        A fixed-rank layout takes its own rank, or one less (no sample axis, torch's unbatched input) only
        when the statistics are per sample (InstanceNorm*d, LayerNorm): one sample normalized by batch
        statistics would be normalized by itself (torch's BatchNorm2d/3d raise there too).
        """
        ndim = self.spec.layout.ndim
        if ndim is None or input.dim() == ndim:
            return False
        per_sample = not self.spec.batch_dependent
        if per_sample and input.dim() == ndim - 1:
            return True
        expected = f"{ndim - 1}D or {ndim}D" if per_sample else f"{ndim}D"
        note = f" (or {ndim - 1} without the sample axis)" if per_sample else (
            "; batch statistics (reduce over Axis.SAMPLE) need the sample axis, there is no unbatched input"
        )  # fmt: skip
        raise ValueError(
            f"expected {expected} input (got {input.dim()}D input): input of shape {tuple(input.shape)} has "
            f"{input.dim()} dims; layout={self.spec.layout.value!r} needs {ndim}{note}"
        )

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        if self._fused is not None and isinstance(input, Tensor):
            if mask is not None:
                if self._fused:
                    raise ValueError("backend='fused' cannot run a masked norm; use backend='auto' or 'reference'")
            elif self._rank is None or input.dim() == self._rank:
                out = fused_kernels().drop_in(input, self.spec, self.weight, self.bias, self.shape, self._fused)
                if out is not None:
                    return out
        unbatched = isinstance(input, Tensor) and self._unbatched(input)
        if self.shape is not None and isinstance(input, Tensor):
            self._check_shape(input, unbatched=unbatched)  # the input as given, before the sample axis is added
        if unbatched:
            input = input.unsqueeze(0)
            mask = mask.unsqueeze(0) if mask is not None and mask.dim() == input.dim() - 1 else mask
        out = normalize(
            input,
            self.spec,
            self.weight,
            self.bias,
            mask=mask,
            running_mean=self.running_mean,
            running_var=self.running_var,
            training=self.training,
            momentum=self._next_momentum() if self.running_var is not None else 0.1,
            backend=Backend.REFERENCE,  # the fused route, where it applies, was taken above
        )
        if self.running_var is not None:
            self._count_step()  # only once normalize accepted the input
        return out.squeeze(0) if unbatched else out

    def _check_shape(self, input: Tensor, *, unbatched: bool = False) -> None:
        assert self.shape is not None
        if self.spec.layout.channels_last:
            got = tuple(input.shape[max(0, input.dim() - len(self.shape)) :])
            where = "trailing dims"
        else:
            c = 0 if unbatched else 1
            got = tuple(input.shape[c : c + 1])
            where = "channel dim (dim 0, no sample axis)" if unbatched else "channel dim (dim 1)"
        if got != self.shape:
            raise ValueError(
                f"input of shape {tuple(input.shape)} has {where} {got}; this layer was built for {self.shape}"
            )

    def extra_repr(self) -> str:
        s = self.spec
        parts = [f"{self.shape}" if self.shape is not None else "shape=None", f"eps={s.eps}"]
        parts.append(f"reduce={{{', '.join(sorted(a.value for a in s.reduce))}}}")
        if s.groups > 1:
            parts.append(f"groups={s.groups}")
        parts.append(f"stat={s.statistic}")
        if s.eps_placement.value != "inside_sqrt":
            parts.append(f"eps_placement={s.eps_placement.value}")
        parts.append(f"cast={s.cast_order.value}")
        if s.gain_convention is GainConvention.ONE_PLUS_W:
            parts.append("gain=1+w")
        if self.track_running_stats:
            parts.append(f"momentum={self.momentum}")
        if self.backend is not Backend.AUTO or self._servable():
            parts.append(f"backend={self.backend_in_use()}")  # (left out where AUTO can only mean the reference)
        return ", ".join(parts)

    def _servable(self) -> bool:
        from .kernels.dispatch import spec_unsupported

        return not self.track_running_stats and spec_unsupported(self.spec, torch.float32) is None

    def backend_in_use(self) -> str:
        """What a forward of an input in this module's parameter dtype and device runs, and why, e.g.
        ``auto: fused (cpp, from cache)`` or ``auto: reference (the C++ kernels are not built; ...)``."""
        name = self.backend.value
        if self._fused is None:
            why = "running statistics" if self.track_running_stats and self.backend is not Backend.REFERENCE else ""
            return f"{name}" + (f": reference ({why})" if why else "")
        from .kernels.dispatch import describe

        p = self.weight if self.weight is not None else self.bias
        device = p.device if p is not None else torch.device("cpu")
        dtype = p.dtype if p is not None else torch.float32
        return f"{name}: {describe(self.spec, device, dtype, self._fused)}"
