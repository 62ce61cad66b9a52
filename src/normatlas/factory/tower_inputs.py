"""The input a standalone vision tower reads, built offline from its config and its ``forward`` signature.

Most towers read one image ``(B, C, H, W)``; many read more, or read it laid out otherwise: flattened patches with
their ``(t, h, w)`` grid (Qwen2-VL-style towers: ``grid_thw`` or ``image_grid_thw``, VideoLLaMA 3's ``merge_sizes``
beside it), each patch as ``(C, p, p)`` in a batch of patches (PaddleOCR-VL), a patch grid beside the image
(MiniCPM-V's ``target_sizes``), aspect-ratio tiles with their ratio ids and mask (Mllama), a clip of frames
(VideoMAE, ViViT, TimeSformer: ``(B, T, C, H, W)``, two frames where the config states no count: VidEoMT; X-CLIP's
tower: the frames as the batch; Inkling: a channels-last clip), a NaViT patch sequence (SigLIP 2), a prompt image
and its mask beside the image (SegGPT). :func:`tower_inputs` lists the layouts the signature and the config ask for,
most specific first and the plain image after them, and keeps the first one the tower runs on: a layout is chosen by
running it, never by the tower's name.
"""

from __future__ import annotations

import inspect as pyinspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .vlm_inputs import (
    PATCHES_PER_SIDE,
    _channels,
    _grid_layouts,
    _hw_grid_layouts,
    _image_side,
    _merge,
    _target_size_layouts,
    patch_sequence,
    tiled_image,
)

__all__ = ["tower_inputs"]

_GRID_KEYS = ("grid_thw", "image_grid_thw")  # the (t, h, w) patch grid of flattened-patch towers
_TEMPORAL = ("temporal_patch_size", "patch_temporal")
_ERRORS = (TypeError, ValueError, RuntimeError, IndexError, AttributeError, KeyError, AssertionError)


def _patch(d: dict[str, Any]) -> int | None:
    patch = d.get("patch_size")
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    return patch if isinstance(patch, int) else None


def _grid(cfg: Any, gen: torch.Generator, key: str, params: Any) -> Iterator[dict[str, Any]]:
    """Flattened patches with their grid under the tower's own name for it; each patch also as ``(C, p, p)`` and
    a batch of those (PaddleOCR-VL reads ``(B, N, C, p, p)``); ``merge_sizes`` where the tower reads it."""
    extra = {"merge_sizes": torch.tensor([_merge(cfg)])} if "merge_sizes" in params else {}
    for layout in _grid_layouts(cfg, gen):
        pixels, grid = layout["pixel_values"], layout["image_grid_thw"]
        yield {"pixel_values": pixels, key: grid, **extra}
        if pixels.dim() == 4:
            yield {"pixel_values": pixels.unsqueeze(0), key: grid, **extra}


def _image(cfg: Any, gen: torch.Generator) -> torch.Tensor:
    """One seeded ``(1, C, H, W)`` image at the config's size (64 for a convolutional net with none)."""
    d = cfg.to_dict()
    side = _image_side(cfg) if d.get("image_size") is not None or d.get("resolution") is not None else 64
    return torch.randn(1, _channels(cfg), side, side, generator=gen)


def _video(cfg: Any, gen: torch.Generator, frames: int) -> Iterator[dict[str, Any]]:
    """``frames`` frames of the image size, as ``(1, T, C, H, W)`` and as a batch of frames ``(T, C, H, W)``."""
    side = _image_side(cfg)
    clip = torch.randn(1, frames, _channels(cfg), side, side, generator=gen)
    yield {"pixel_values": clip}
    yield {"pixel_values": clip[0]}


def _patches(cfg: Any, gen: torch.Generator) -> Iterator[dict[str, Any]]:
    """The image's patches, flattened ``(1, N, C p^2)`` and ``(N, C p^2)``, and as ``(N, C, t, p, p)`` for each
    temporal patch size the config names (a tower whose patch embedding is a 3-d convolution over them)."""
    d = cfg.to_dict()
    patch = _patch(d)
    if patch is None or d.get("image_size") is None:
        return
    n = (_image_side(cfg) // patch) ** 2
    channels = _channels(cfg)
    flat = torch.randn(1, n, channels * patch**2, generator=gen)
    yield {"pixel_values": flat}
    yield {"pixel_values": flat[0]}
    for t in dict.fromkeys(d[k] for k in _TEMPORAL if isinstance(d.get(k), int)):
        yield {"pixel_values": torch.randn(n, channels, t, patch, patch, generator=gen)}


def _candidates(cfg: Any, params: Any, gen: torch.Generator) -> Iterator[dict[str, Any]]:
    """The layouts to try, the ones the signature or the config names first, then the plain image."""
    d = cfg.to_dict()
    for key in _GRID_KEYS:
        if key in params and _patch(d) is not None:
            yield from _grid(cfg, gen, key, params)
    if "image_grid_hw" in params:
        yield from _hw_grid_layouts(cfg, gen)
    if "target_sizes" in params:
        yield from _target_size_layouts(cfg, gen)
    if "aspect_ratio_ids" in params and d.get("max_num_tiles") and d.get("supported_aspect_ratios"):
        yield tiled_image(cfg, gen)
    if isinstance(d.get("num_frames"), int) and d.get("image_size") is not None:
        yield from _video(cfg, gen, d["num_frames"])
    if "num_patches" in d and d.get("image_size") is None:  # NaViT-style: SigLIP 2
        yield patch_sequence(cfg, gen)
    image = _image(cfg, gen)
    if "prompt_pixel_values" in params:
        yield from _prompted(image, gen)
    yield {"pixel_values": image}
    yield from _patches(cfg, gen)
    yield from _channels_last_clip(cfg, gen)
    if not isinstance(d.get("num_frames"), int) and d.get("image_size") is not None:  # a clip, its length unstated
        yield next(_video(cfg, gen, 2))


def _prompted(image: torch.Tensor, gen: torch.Generator) -> Iterator[dict[str, Any]]:
    """SegGPT's in-context input: the image, a prompt image and the prompt's mask, all one shape; at the image
    size, then at half its height (the config's size is the prompt and the image stacked)."""
    for h in dict.fromkeys((image.shape[-2], image.shape[-2] // 2)):
        x = image[..., :h, :]
        prompt = torch.randn(x.shape, generator=gen)
        yield {"pixel_values": x, "prompt_pixel_values": prompt, "prompt_masks": (prompt > 0).to(prompt.dtype)}


def _channels_last_clip(cfg: Any, gen: torch.Generator) -> Iterator[dict[str, Any]]:
    """A channels-last clip ``(1, t, H, W, C)`` of ``t`` frames (the config's temporal patch size) and a
    :data:`~.vlm_inputs.PATCHES_PER_SIDE`-patch side, for a tower that folds time and space into depth itself
    (Inkling)."""
    d = cfg.to_dict()
    patch = _patch(d)
    frames = next((d[k] for k in _TEMPORAL if isinstance(d.get(k), int)), None)
    if patch is None or frames is None:
        return
    side = patch * PATCHES_PER_SIDE
    yield {"pixel_values": torch.randn(1, frames, side, side, _channels(cfg), generator=gen)}


def _run(model: nn.Module, layout: dict[str, Any]) -> None:
    rest = {k: v for k, v in layout.items() if k != "pixel_values"}
    with torch.no_grad():
        model(layout["pixel_values"], **rest)


def tower_inputs(model: nn.Module, seed: int = 0) -> dict[str, Any]:
    """The inputs of one seeded image for a transformers vision tower: ``pixel_values`` (passed as the first
    positional argument, whatever the tower names it) and the keyword inputs that go with it. Each candidate
    layout is run once without gradients; the first that runs is returned. Raises ``ValueError`` listing every
    layout tried and why it failed when none runs, and ``TypeError`` for a model with no transformers config."""
    cfg = getattr(model, "config", None)
    if cfg is None or not callable(getattr(cfg, "to_dict", None)):
        raise TypeError(
            f"model must be a transformers vision tower with a config, got {type(model).__name__} without one: "
            "pass pixel_values (and the tower's other inputs) yourself"
        )
    params = pyinspect.signature(model.forward).parameters
    gen = torch.Generator().manual_seed(seed)
    model = model.eval()
    errors = []
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    dtype = param.dtype if param is not None else torch.float32
    for layout in _candidates(cfg, params, gen):
        layout = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in layout.items()}
        try:
            _run(model, layout)
        except _ERRORS as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            shape = tuple(layout["pixel_values"].shape)
            errors.append(f"{sorted(layout)} {shape}: {type(exc).__name__}: {first[:160]}")
            continue
        return layout
    raise ValueError(f"no input layout runs {type(model).__name__}: " + " | ".join(errors))
