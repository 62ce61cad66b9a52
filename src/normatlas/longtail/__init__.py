"""The long tail: batch-statistics norms, pointwise norm replacements, weight-side and
initialisation methods, nGPT, conditioning norms and the VLM connector norm.
"""

from ._report import Change, ConversionReport
from .batchnorm import (
    PAPER_D_MAX,
    PAPER_R_MAX,
    BatchNorm,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    BatchRenorm,
    FrozenBatchNorm,
    GhostBatchNorm,
    Ramp,
    batch_moments,
    batch_norm_spec,
)
from .convert import BatchNormTarget, convert_batchnorm
from .pointwise import Derf, DyT, Pointwise, convert_norms_to_pointwise, derf, dyt
from .powernorm import PowerNorm, power_norm
from .syncbn import SyncBatchNorm, merge_moments

__all__ = [
    "PAPER_D_MAX",
    "PAPER_R_MAX",
    "BatchNorm",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "BatchNormTarget",
    "BatchRenorm",
    "Change",
    "ConversionReport",
    "Derf",
    "DyT",
    "FrozenBatchNorm",
    "GhostBatchNorm",
    "Pointwise",
    "PowerNorm",
    "Ramp",
    "SyncBatchNorm",
    "batch_moments",
    "batch_norm_spec",
    "convert_batchnorm",
    "convert_norms_to_pointwise",
    "derf",
    "dyt",
    "merge_moments",
    "power_norm",
]
