"""The fused kernels under the core's modules: thin aliases, and the residual-add variants.

The core's :class:`normatlas.Norm` and its presets already take the fused path by default
(``backend="auto"``, see :mod:`normatlas.backend`). ``FusedNorm``, ``FusedRMSNorm`` and
``FusedLayerNorm`` are the same classes with ``backend="fused"`` (compile the kernels if needed; what they
cannot serve raises). The ``Add`` variants take ``(input, residual)`` and return
``(normalized, input + residual)`` in one pass over memory.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..backend import Backend
from ..modules import Norm
from ..presets import LayerNorm, RMSNorm
from .api import direct

__all__ = ["FusedAddLayerNorm", "FusedAddRMSNorm", "FusedLayerNorm", "FusedNorm", "FusedRMSNorm"]


class _FusedDefault:
    """Make ``backend="fused"`` the default of a core module's constructor."""

    def __init__(self, *args: Any, backend: Backend | str = Backend.FUSED, **kwargs: Any) -> None:
        super().__init__(*args, backend=backend, **kwargs)  # type: ignore[call-arg]


class FusedNorm(_FusedDefault, Norm):
    """:class:`normatlas.Norm` with ``backend="fused"``."""


class FusedRMSNorm(_FusedDefault, RMSNorm):
    """:class:`normatlas.RMSNorm` (torch.nn.RMSNorm's arguments) with ``backend="fused"``."""


class FusedLayerNorm(_FusedDefault, LayerNorm):
    """:class:`normatlas.LayerNorm` (torch.nn.LayerNorm's arguments) with ``backend="fused"``."""


class _FusedAdd(_FusedDefault, Norm):
    def forward(self, input: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        check = self._check_shape if self.shape is not None else None
        return direct(self.spec, input, residual, self.weight, self.bias, self.shape, check)


class FusedAddRMSNorm(_FusedAdd, RMSNorm):
    """Residual add + RMSNorm in one pass: ``forward(input, residual) -> (y, input + residual)``."""


class FusedAddLayerNorm(_FusedAdd, LayerNorm):
    """Residual add + LayerNorm in one pass: ``forward(input, residual) -> (y, input + residual)``."""
