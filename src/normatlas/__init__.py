"""normatlas: the geometry of normalization as working software.

One core (:class:`NormSpec` run by :func:`normalize` / :class:`Norm`), every named
normalization layer a thin preset of it.
"""

from .backend import Backend
from .functional import normalize
from .modules import Norm
from .presets import (
    GemmaRMSNorm,
    GroupNorm,
    InstanceNorm,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    L2Norm,
    LayerNorm,
    LayerNorm2d,
    RMSNorm,
    ScaleNorm,
)
from .spec import Axis, CastOrder, EpsPlacement, Gain, GainConvention, Layout, NormSpec, Scale
from .taxonomy import Taxon, classify

# the capabilities built on the core; each imports its heavy dependencies lazily
from . import atlas, blocks, diagnostics, inspect, kernels, longtail, surgery  # isort: skip

__version__ = "0.1.0"

__all__ = [
    "Axis",
    "Backend",
    "CastOrder",
    "EpsPlacement",
    "Gain",
    "GainConvention",
    "GemmaRMSNorm",
    "GroupNorm",
    "InstanceNorm",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "L2Norm",
    "LayerNorm",
    "LayerNorm2d",
    "Layout",
    "Norm",
    "NormSpec",
    "RMSNorm",
    "Scale",
    "ScaleNorm",
    "Taxon",
    "atlas",
    "blocks",
    "classify",
    "diagnostics",
    "inspect",
    "kernels",
    "longtail",
    "normalize",
    "surgery",
]
