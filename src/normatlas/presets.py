"""Named normalization layers, each a few lines that only set a :class:`NormSpec`.

Argument names follow torch.nn (``normalized_shape``, ``eps``, ``elementwise_affine``,
``bias``, ``num_groups``, ``num_channels``, ``affine``, ``track_running_stats``), so
each drops in for its torch module and loads its state dict.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ._exports import EXPORTS
from .backend import Backend
from .modules import Norm, _as_shape, _count
from .spec import Axis, CastOrder, EpsPlacement, Gain, GainConvention, Layout, NormSpec, Scale

__all__ = list(EXPORTS["presets"])  # the names the package takes from here, listed once in _exports.py

F_, P_, S_ = Axis.FEATURE, Axis.POSITION, Axis.SAMPLE
Device = torch.device | str | None
DType = torch.dtype | None


def _shape(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    shape = _as_shape(normalized_shape, "normalized_shape")
    if shape is None:
        raise TypeError("normalized_shape=None must be an int or a sequence of ints")
    return shape


def _affine(on: bool) -> Gain:
    return Gain.PER_FEATURE if on else Gain.NONE


def _over_trailing(
    normalized_shape: int | Sequence[int], elementwise_affine: bool, **fields: Any
) -> tuple[NormSpec, tuple[int, ...]]:
    """The spec of a norm over the trailing ``normalized_shape`` (LayerNorm, RMSNorm), and that shape."""
    shape = _shape(normalized_shape)
    return NormSpec(feature_ndim=len(shape), gain=_affine(elementwise_affine), **fields), shape


class LayerNorm(Norm):
    """LayerNorm (Ba et al., 2016): centre and divide by the std over the trailing ``normalized_shape``.

    Drop-in for ``torch.nn.LayerNorm``; rescaling and re-centring invariant.
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: Device = None,
        dtype: torch.dtype | None = None,
        *,
        cast_order: CastOrder = CastOrder.AFTER_GAIN,
        eps_placement: EpsPlacement = EpsPlacement.INSIDE_SQRT,
        backend: Backend | str = Backend.AUTO,
    ) -> None:
        spec, shape = _over_trailing(
            normalized_shape, elementwise_affine,
            eps=eps, eps_placement=eps_placement, cast_order=cast_order, bias=bias and elementwise_affine,
        )  # fmt: skip
        super().__init__(spec, shape, device=device, dtype=dtype, backend=backend)


class RMSNorm(Norm):
    """RMSNorm (Zhang & Sennrich, 2019): divide by the root mean square, no centring.

    Drop-in for ``torch.nn.RMSNorm`` (``eps=None`` is the compute dtype's machine eps,
    and the default cast order is torch's). ``cast_order=CastOrder.BEFORE_GAIN`` gives
    HF's LlamaRMSNorm bit for bit; ``gain_convention=GainConvention.ONE_PLUS_W`` the
    zero-centred gain. Rescaling invariant, not re-centring invariant.
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: Device = None,
        dtype: torch.dtype | None = None,
        *,
        cast_order: CastOrder = CastOrder.AFTER_GAIN,
        gain_convention: GainConvention = GainConvention.W,
        eps_placement: EpsPlacement = EpsPlacement.INSIDE_SQRT,
        backend: Backend | str = Backend.AUTO,
    ) -> None:
        spec, shape = _over_trailing(
            normalized_shape, elementwise_affine, center=False,
            eps=eps, eps_placement=eps_placement, cast_order=cast_order, gain_convention=gain_convention, bias=False,
        )  # fmt: skip
        super().__init__(spec, shape, device=device, dtype=dtype, backend=backend)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``(x_hat * (1 + w)).to(dtype)`` with w initialised at 0.

    Equal bit for bit to HF's ``GemmaRMSNorm``. Porting these weights into a
    ``w``-convention layer without adding 1 is the classic one-line porting bug.
    """

    def __init__(self, dim: int, eps: float = 1e-6, device: Device = None, dtype: torch.dtype | None = None, *,
                 backend: Backend | str = Backend.AUTO):  # fmt: skip
        super().__init__(
            _count(dim, "dim"), eps, device=device, dtype=dtype,
            cast_order=CastOrder.AFTER_GAIN, gain_convention=GainConvention.ONE_PLUS_W, backend=backend,
        )  # fmt: skip


class GroupNorm(Norm):
    """GroupNorm (Wu & He, 2018): statistics over (channels in a group, positions) per sample.

    Drop-in for ``torch.nn.GroupNorm``; ``num_groups=1`` is whole-sample LayerNorm and
    ``num_groups=num_channels`` is InstanceNorm.
    """

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        device: Device = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        num_groups, num_channels = _count(num_groups, "num_groups"), _count(num_channels, "num_channels")
        if num_channels % num_groups:
            raise ValueError(f"num_groups={num_groups} must divide num_channels={num_channels}")
        spec = NormSpec(
            layout=Layout.NC_ANY, reduce=frozenset({F_, P_}), groups=num_groups, eps=eps,
            gain=_affine(affine), bias=affine,
        )  # fmt: skip
        super().__init__(spec, num_channels, device=device, dtype=dtype)
        self.num_groups, self.num_channels, self.affine = num_groups, num_channels, affine


class InstanceNorm(Norm):
    """InstanceNorm (Ulyanov et al., 2016): statistics over positions, per sample and channel.

    ``layout`` fixes the rank; the 1d/2d/3d subclasses match ``torch.nn.InstanceNorm*``
    (``affine=False`` and no running statistics by default, unbatched inputs accepted).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = False,
        track_running_stats: bool = False,
        device: Device = None,
        dtype: torch.dtype | None = None,
        *,
        layout: Layout = Layout.NC_ANY,
    ) -> None:
        num_features = _count(num_features, "num_features")
        spec = NormSpec(layout=layout, reduce=frozenset({P_}), eps=eps, gain=_affine(affine), bias=affine)
        super().__init__(
            spec, num_features, track_running_stats=track_running_stats, momentum=momentum,
            device=device, dtype=dtype,
        )  # fmt: skip
        self.num_features, self.affine = num_features, affine


class InstanceNorm1d(InstanceNorm):
    """``torch.nn.InstanceNorm1d``: input (N, C, L) or (C, L)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = False,
                 track_running_stats: bool = False, device: Device = None, dtype: DType = None):  # fmt: skip
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, layout=Layout.NCL)


class InstanceNorm2d(InstanceNorm):
    """``torch.nn.InstanceNorm2d``: input (N, C, H, W) or (C, H, W)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = False,
                 track_running_stats: bool = False, device: Device = None, dtype: DType = None):  # fmt: skip
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, layout=Layout.NCHW)


class InstanceNorm3d(InstanceNorm):
    """``torch.nn.InstanceNorm3d``: input (N, C, D, H, W) or (C, D, H, W)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = False,
                 track_running_stats: bool = False, device: Device = None, dtype: DType = None):  # fmt: skip
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, layout=Layout.NCDHW)


class LayerNorm2d(Norm):
    """Channels-first LayerNorm (ConvNeXt, timm's ``LayerNorm2d``): over C at every (h, w)."""

    def __init__(self, num_channels: int, eps: float = 1e-6, affine: bool = True, device: Device = None,
                 dtype: torch.dtype | None = None):  # fmt: skip
        spec = NormSpec(layout=Layout.NC_ANY, reduce=frozenset({F_}), eps=eps, gain=_affine(affine), bias=affine)
        super().__init__(spec, _count(num_channels, "num_channels"), device=device, dtype=dtype)


class ScaleNorm(Norm):
    """ScaleNorm (Nguyen & Salazar, 2019): ``g * x / max(||x||, eps)`` with one scalar g at sqrt(d)."""

    def __init__(self, dim: int, eps: float = 1e-5, device: Device = None, dtype: torch.dtype | None = None):
        spec = NormSpec(center=False, scale=Scale.L2, eps=eps, eps_placement=EpsPlacement.CLAMP,
                        gain=Gain.SCALAR, bias=False)  # fmt: skip
        super().__init__(spec, _count(dim, "dim"), device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None and self.shape is not None:
            with torch.no_grad():
                self.weight.fill_(math.sqrt(self.shape[0]))


class L2Norm(Norm):
    """Unit L2 norm over the last dim, ``x / max(||x||, eps)``: ``F.normalize(x, dim=-1)``."""

    def __init__(self, eps: float = 1e-12, *, backend: Backend | str = Backend.AUTO) -> None:
        spec = NormSpec(center=False, scale=Scale.L2, eps=eps, eps_placement=EpsPlacement.CLAMP,
                        gain=Gain.NONE, bias=False)  # fmt: skip
        super().__init__(spec, None, backend=backend)
