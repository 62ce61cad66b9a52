"""The long tail: batch-statistics norms, pointwise norm replacements, weight-side and
initialisation methods, nGPT, conditioning norms and the VLM connector norm.
"""

from ._report import Change, ConversionReport
from .pointwise import Derf, DyT, Pointwise, convert_norms_to_pointwise, derf, dyt

__all__ = [
    "Change",
    "ConversionReport",
    "Derf",
    "DyT",
    "Pointwise",
    "convert_norms_to_pointwise",
    "derf",
    "dyt",
]
