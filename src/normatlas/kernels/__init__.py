"""Fused normalization kernels at the memory-bandwidth limit (C++ on CPU, Triton on CUDA).

A norm in a transformer is a bandwidth-bound op between two GEMMs; its physical limit is
one read and one write of the tensor forward, two reads and one write backward. These
kernels read each row once, keep it in cache for the statistics and the output, and
accumulate gain / bias gradients in per-thread partial sums. They serve the core's
channels-last specs (see :mod:`.dispatch`) and fall back to the reference path otherwise.

    >>> from normatlas.kernels import fused_rms_norm, fused_add_rms_norm, FusedRMSNorm
"""

from .api import (
    fused_add_layer_norm,
    fused_add_rms_norm,
    fused_layer_norm,
    fused_normalize,
    fused_rms_norm,
    qk_rms_norm,
)
from .dispatch import Kernel, Mode, Route, backend, build_info, kernel_args, route, unsupported
from .modules import FusedAddLayerNorm, FusedAddRMSNorm, FusedLayerNorm, FusedNorm, FusedRMSNorm

__all__ = [
    "FusedAddLayerNorm",
    "FusedAddRMSNorm",
    "FusedLayerNorm",
    "FusedNorm",
    "FusedRMSNorm",
    "Kernel",
    "Mode",
    "Route",
    "backend",
    "build_info",
    "fused_add_layer_norm",
    "fused_add_rms_norm",
    "fused_layer_norm",
    "fused_normalize",
    "fused_rms_norm",
    "kernel_args",
    "qk_rms_norm",
    "route",
    "unsupported",
]
