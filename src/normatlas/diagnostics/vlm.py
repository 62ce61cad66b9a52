"""VLM interface checks: pixel normalization constants and the vision/text norm gap.

The essay's "norm you forget is the one on the pixels": input preprocessing is a
normalization layer with hard-coded statistics, and pairing an encoder with another
encoder's constants degrades it silently. :func:`check_image_processor` compares an
image processor's ``image_mean`` / ``image_std`` with the constants each encoder
family was trained with. Sources: OpenAI CLIP (``clip/clip.py``), OpenCLIP
(``open_clip/constants.py``: OPENAI_DATASET_*, IMAGENET_*, INCEPTION_*), SigLIP
(big_vision, values in [-1, 1]: mean = std = 0.5), torchvision / timm ImageNet.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .metrics import as_floats

__all__ = ["ENCODER_CONSTANTS", "KNOWN_PIXEL_CONSTANTS", "PixelCheck", "check_image_processor"]

KNOWN_PIXEL_CONSTANTS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "openai_clip": ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "inception": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
}

# Which constant sets each encoder family was trained with (first = the family's default).
ENCODER_CONSTANTS: dict[str, tuple[str, ...]] = {
    "clip": ("openai_clip",),
    "openclip": ("openai_clip", "inception", "imagenet"),  # OpenCLIP default, its SigLIP and ImageNet configs
    "siglip": ("inception",),
    "imagenet": ("imagenet",),
}


@dataclass(frozen=True)
class PixelCheck:
    """Result of :func:`check_image_processor`."""

    encoder: str
    matches: str | None  # the known constant set the processor's values equal, if any
    ok: bool
    expected: tuple[str, ...]
    max_abs_diff: float  # to the encoder's default constants
    message: str


def _load(processor: object) -> tuple[tuple[float, ...], tuple[float, ...]]:
    if isinstance(processor, (str, os.PathLike)):
        path = os.fspath(processor)
        if os.path.isdir(path):
            path = os.path.join(path, "preprocessor_config.json")
        with open(path, encoding="utf-8") as fh:
            processor = json.load(fh)
    if isinstance(processor, Mapping):
        mean, std = processor.get("image_mean"), processor.get("image_std")
    else:
        mean, std = getattr(processor, "image_mean", None), getattr(processor, "image_std", None)
    if mean is None or std is None:
        raise ValueError("processor has no image_mean / image_std (give a dict, a config path or an image processor)")
    return as_floats(mean, "image_mean"), as_floats(std, "image_std")


def _diff(a: Sequence[float], b: Sequence[float]) -> float:
    if len(a) == 1:
        a = tuple(a) * len(b)
    if len(a) != len(b):
        return float("inf")
    return max(abs(x - y) for x, y in zip(a, b, strict=False))


def check_image_processor(processor: object, encoder: str, atol: float = 1e-3) -> PixelCheck:
    """Check an image processor's mean/std against the constants of ``encoder``.

    Args:
        processor: a dict with ``image_mean``/``image_std``, a path to a
            ``preprocessor_config.json`` (or its folder), or an object with those attributes
            (a transformers image processor).
        encoder: the vision encoder family actually loaded: one of ``ENCODER_CONSTANTS``.
        atol: tolerance per channel.

    Returns a :class:`PixelCheck` whose ``ok`` is True when the constants equal one of
    the sets the encoder family was trained with.
    """
    key = encoder.lower().replace("-", "").replace("_", "")
    if key not in ENCODER_CONSTANTS:
        raise ValueError(f"encoder={encoder!r} is not one of {sorted(ENCODER_CONSTANTS)}")
    mean, std = _load(processor)
    matches = None
    for name, (m, s) in KNOWN_PIXEL_CONSTANTS.items():
        if _diff(mean, m) <= atol and _diff(std, s) <= atol:
            matches = name
            break
    expected = ENCODER_CONSTANTS[key]
    dm, ds = KNOWN_PIXEL_CONSTANTS[expected[0]]
    diff = max(_diff(mean, dm), _diff(std, ds))
    ok = matches in expected
    if ok:
        msg = f"{encoder}: image_mean/std match {matches} constants"
    else:
        found = f"the {matches} constants" if matches else f"unknown constants mean={mean} std={std}"
        msg = (
            f"{encoder} expects {' or '.join(expected)} constants but the processor uses {found} (max diff {diff:.4f})"
        )
    return PixelCheck(key, matches, ok, expected, diff, msg)
