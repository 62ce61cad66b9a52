"""The names the package's top level takes from each submodule: the one list of them, below every module that reads
it (``normatlas/__init__.py`` serves them lazily, ``presets.py`` derives its ``__all__`` from it). No imports."""

from __future__ import annotations

# submodule -> the names the package takes from it (``__all__`` in __init__.py and presets.py derive from it; the
# TYPE_CHECKING imports in __init__.py repeat it for static tools, and a test holds them to it)
EXPORTS = {
    "backend": ("Backend",),
    "functional": ("normalize",),
    "modules": ("Norm",),
    "presets": (
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
    ),
    "spec": ("Axis", "CastOrder", "EpsPlacement", "Gain", "GainConvention", "Layout", "NormSpec", "Scale"),
    "taxonomy": ("Taxon", "classify"),
}
