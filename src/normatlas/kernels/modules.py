"""Modules that run on the fused kernels: drop-ins for the core's Norm and its presets.

Each class keeps its parent's constructor, parameters and state dict, and only changes
``forward``: inputs the kernels serve (see :mod:`normatlas.kernels.dispatch`) take the fused
path, anything else (masks, running statistics, other axes) the core's reference path, so
the function computed never changes. The ``Add`` variants take ``(input, residual)`` and
return ``(normalized, input + residual)``.
"""

from __future__ import annotations

from torch import Tensor

from ..modules import Norm
from ..presets import LayerNorm, RMSNorm
from .api import _fast, fused_normalize
from .dispatch import unsupported

__all__ = ["FusedAddLayerNorm", "FusedAddRMSNorm", "FusedLayerNorm", "FusedNorm", "FusedRMSNorm"]


class _Fused(Norm):
    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        if mask is None and self.running_var is None:
            fast = _fast(self.spec, input, None, self.weight, self.bias, self.shape)
            if fast is not None:
                return fast[0]
        if mask is None and self.running_var is None and unsupported(self.spec, input, self.weight, self.bias) is None:
            if self.shape is not None:
                self._check_shape(input)
            out = fused_normalize(input, self.spec, self.weight, self.bias)
            assert isinstance(out, Tensor)
            return out
        return super().forward(input, mask)


class _FusedAdd(Norm):
    def forward(self, input: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        if self.running_var is None:
            fast = _fast(self.spec, input, residual, self.weight, self.bias, self.shape)
            if fast is not None:
                return fast[0], fast[1]
        if self.shape is not None:
            self._check_shape(input)
        y, h = fused_normalize(input, self.spec, self.weight, self.bias, residual=residual)
        return y, h


class FusedNorm(_Fused):
    """:class:`normatlas.Norm` with the fused forward and backward where the spec allows."""


class FusedRMSNorm(_Fused, RMSNorm):
    """:class:`normatlas.RMSNorm` (torch.nn.RMSNorm's arguments) on the fused kernels."""


class FusedLayerNorm(_Fused, LayerNorm):
    """:class:`normatlas.LayerNorm` (torch.nn.LayerNorm's arguments) on the fused kernels."""


class FusedAddRMSNorm(_FusedAdd, RMSNorm):
    """Residual add + RMSNorm in one pass: ``forward(input, residual) -> (y, input + residual)``."""


class FusedAddLayerNorm(_FusedAdd, LayerNorm):
    """Residual add + LayerNorm in one pass: ``forward(input, residual) -> (y, input + residual)``."""
