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

from ._exports import EXPORTS as _EXPORTS  # submodule -> the names the package takes from it: the one list

__version__ = "0.1.0"

# name -> the submodule that defines it
_NAMES = {name: module for module, names in _EXPORTS.items() for name in names}
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


# what the lazy names are, for type checkers and editors; "X as X" marks each re-exported (__all__ is computed)
if TYPE_CHECKING:
    from . import atlas as atlas
    from . import blocks as blocks
    from . import diagnostics as diagnostics
    from . import inspect as inspect
    from . import kernels as kernels
    from . import longtail as longtail
    from . import surgery as surgery
    from .backend import Backend as Backend
    from .functional import normalize as normalize
    from .modules import Norm as Norm
    from .presets import GemmaRMSNorm as GemmaRMSNorm
    from .presets import GroupNorm as GroupNorm
    from .presets import InstanceNorm as InstanceNorm
    from .presets import InstanceNorm1d as InstanceNorm1d
    from .presets import InstanceNorm2d as InstanceNorm2d
    from .presets import InstanceNorm3d as InstanceNorm3d
    from .presets import L2Norm as L2Norm
    from .presets import LayerNorm as LayerNorm
    from .presets import LayerNorm2d as LayerNorm2d
    from .presets import RMSNorm as RMSNorm
    from .presets import ScaleNorm as ScaleNorm
    from .spec import Axis as Axis
    from .spec import CastOrder as CastOrder
    from .spec import EpsPlacement as EpsPlacement
    from .spec import Gain as Gain
    from .spec import GainConvention as GainConvention
    from .spec import Layout as Layout
    from .spec import NormSpec as NormSpec
    from .spec import Scale as Scale
    from .taxonomy import Taxon as Taxon
    from .taxonomy import classify as classify

__all__ = sorted([*_NAMES, *_SUBPACKAGES])
