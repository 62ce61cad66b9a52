"""Inspect any model's normalization design from its executed dataflow.

``inspect_model(model, example_inputs)`` records the dataflow of one forward pass
(:mod:`normatlas.analysis`), finds every normalization by its arithmetic (:mod:`.norms`),
places each relative to the residual adds and attention (:mod:`.analyze`, in phases:
:mod:`.residual`, :mod:`.attention`), and
cross-checks module-wrapped norms with a perturbation probe (:mod:`.probe`).
``inspect_vision(model, pixel_values)`` does the same for a vision tower (:mod:`.vision`).
Nothing is inferred from parameter or class names. The report speaks the design vocabulary
(:mod:`normatlas.vocabulary`).
"""

from __future__ import annotations

import sys
import time
import types
from typing import Any

from torch import nn

from ..factory import build_target, build_vision, is_vision_type, is_vlm_type, tower_inputs
from ..factory import example_inputs as default_example_inputs
from .report import AttentionInfo, InspectionReport, NormInfo, SublayerInfo, UntraceableModel
from .vision import VisionReport, inspect_vision
from .vlm import inspect_vlm_target

__all__ = [
    "AttentionInfo",
    "InspectionReport",
    "NormInfo",
    "SublayerInfo",
    "UntraceableModel",
    "VisionReport",
    "inspect",
    "inspect_model",
    "inspect_target",
    "inspect_vision",
    "inspect_vision_target",
]


def inspect_model(
    model: nn.Module, example_inputs: Any = None, *, name: str | None = None, probe: bool = True
) -> InspectionReport:
    """Report ``model``'s normalization design, derived from one recorded forward pass.

    ``example_inputs`` is a tensor, a tuple of positional inputs or a dict of keyword
    inputs; for a transformers model it defaults to a short ``input_ids`` batch.
    When the dataflow cannot be recorded, a hook-based probe of every module still
    classifies the norm operators (placement is then ``unknown``).
    """
    from ..analysis.graph import record
    from .analyze import analyze
    from .probe import check_sites, probe_report

    t0 = time.perf_counter()
    if example_inputs is None:
        if not hasattr(model, "config"):
            raise ValueError("example_inputs is required for a model without a transformers config")
        example_inputs = default_example_inputs(model)
    label = name or type(model).__name__
    model = model.eval()
    try:
        graph = record(model, example_inputs)
    except Exception as exc:
        try:
            report = probe_report(model, example_inputs, label)
        except Exception:
            raise UntraceableModel(
                f"cannot run {label} on the example inputs: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}"
            ) from exc
        report.notes.append(f"dataflow recording failed ({type(exc).__name__}); probe-only report")
        report.seconds = time.perf_counter() - t0
        return report
    report = analyze(graph, label)
    if probe:
        check_sites(model, graph, report)
        if report.encoder is not None:  # an encoder-decoder: the encoder stack's norms too
            check_sites(model, graph, report.encoder)
    report.seconds = time.perf_counter() - t0
    return report


inspect = inspect_model


def inspect_target(target: str, *, seed: int = 0, probe: bool = True) -> InspectionReport:
    """Build a CLI TARGET (model type, checkpoint folder, ``module:factory``) and inspect it. A model type whose
    config describes an image encoder alone (:func:`normatlas.factory.is_vision_type`: image channels, no
    vocabulary) is read as a vision tower (:func:`inspect_vision_target`), so ``inspect vit`` reads what
    ``inspect --vision vit`` does."""
    if _is_model_type(target) and is_vision_type(target):
        return inspect_vision_target(target, seed=seed, probe=probe)
    model, inputs, label = build_target(target, seed=seed)
    return inspect_model(model, inputs, name=label, probe=probe)


def inspect_vision_target(target: str, *, seed: int = 0, probe: bool = True) -> VisionReport:
    """Build a tiny vision tower of a transformers model type and inspect it on a seeded image. An image-text
    model type (Qwen2.5-VL, whose tower reads flattened patches and their grid) is run whole on an image + text
    and its tower part reported (:func:`.vlm.inspect_vlm`); a tower alone gets the input layout its signature and
    config ask for (:func:`normatlas.factory.tower_inputs.tower_inputs`: patch grids, tiles, frames, ...)."""
    if is_vlm_type(target):
        report = inspect_vlm_target(target, seed=seed, probe=probe)
        report.vision.model = target
        return report.vision
    if _is_model_type(target) and not is_vision_type(target):
        raise UntraceableModel(
            f"{target} is not a vision tower: its config has no num_channels and no image_size (or it has a "
            "vocabulary); --vision takes a tower type (clip_vision_model, siglip_vision_model, vit, dinov2, convnext, "
            "...) or an image-text type"
        )
    model = build_vision(target, seed=seed)
    try:
        inputs = tower_inputs(model, seed=seed)
    except ValueError as exc:
        raise UntraceableModel(f"cannot run {target}: {exc}") from exc
    return inspect_vision(model, inputs.pop("pixel_values"), name=target, probe=probe, **inputs)


def _is_model_type(name: str) -> bool:
    from transformers import CONFIG_MAPPING

    return name in CONFIG_MAPPING


class _CallableModule(types.ModuleType):
    """Lets ``normatlas.inspect(model, example_inputs)`` call :func:`inspect_model` directly."""

    def __call__(self, model: nn.Module, example_inputs: Any = None, **kwargs: Any) -> InspectionReport:
        return inspect_model(model, example_inputs, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
