"""normatlas: the geometry of normalization as working software.

One core (:class:`NormSpec` run by :func:`normalize` / :class:`Norm`), every named
normalization layer a thin preset of it.

The names below are imported on first use (PEP 562), so ``import normatlas`` and the ``normatlas`` command's
start import nothing heavy (torch comes with the first name used): a Ctrl-C during that import then lands inside
the CLI's handler, and ``normatlas --help`` answers at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the submodule that defines it
_NAMES = {
    "Backend": "backend",
    "normalize": "functional",
    "Norm": "modules",
    **dict.fromkeys(
        [
            "GemmaRMSNorm",
            "GroupNorm",
            "InstanceNorm",
            "InstanceNorm1d",
            "InstanceNorm2d",
            "InstanceNorm3d",
            "L2Norm",
            "LayerNorm",
            "LayerNorm2d",
            "RMSNorm",
            "ScaleNorm",
        ],
        "presets",
    ),
    **dict.fromkeys(
        ["Axis", "CastOrder", "EpsPlacement", "Gain", "GainConvention", "Layout", "NormSpec", "Scale"], "spec"
    ),
    "Taxon": "taxonomy",
    "classify": "taxonomy",
}
# the capabilities built on the core
_SUBPACKAGES = frozenset({"atlas", "blocks", "diagnostics", "inspect", "kernels", "longtail", "surgery"})


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        value = getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_NAMES, *_SUBPACKAGES})


if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from . import atlas, blocks, diagnostics, inspect, kernels, longtail, surgery
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
