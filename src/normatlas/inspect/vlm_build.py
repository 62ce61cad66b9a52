"""A tiny image-text model of a transformers model type and one synthetic image + text batch for it, offline.

The processor (which would size the image and count its tokens) is not available offline, so the batch is built
from the config and the model itself: the language model and the vision tower are shrunk like
:func:`.build.tiny_config` (the tower to 2 layers of width 64 on a 4 x 4 patch image), the image placeholder and
the vision start / end markers are moved into the shrunk vocabulary, the image is laid out as the tower reads it
(``(B, C, H, W)``, one more image axis ``(B, N, C, H, W)``, or Qwen2-VL's flattened patches with ``image_grid_thw``),
and the number of image tokens is what the model's own ``get_image_features`` returns for that image (its rows of
the language model's width), so the text holds exactly as many placeholders as the model will fill.
"""

from __future__ import annotations

import contextlib
import inspect as pyinspect
from typing import Any

import torch
from torch import nn

from .build import _shrink, tiny_config

__all__ = ["VISION_TINY", "build_vlm", "patch_sequence", "vlm_inputs"]

# The tower's shrunk sizes (set only where its config has the key): 2 layers, width 64, 4 heads.
VISION_TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "embed_dim": 64,
    "depth": 2,
    "num_heads": 4,
}
_PATCHES_PER_SIDE = 4
# Token ids moved into the shrunk vocabulary: offset from its end (the placeholder is the last id).
_TOKEN_IDS = {
    "image_token_id": 1,
    "image_token_index": 1,
    "vision_start_token_id": 2,
    "vision_end_token_id": 3,
    "video_token_id": 4,
    "video_token_index": 4,
}


def _vision_config(cfg: Any) -> Any:
    vc = getattr(cfg, "vision_config", None)
    if vc is None:
        raise ValueError(
            f"model_type {cfg.model_type!r} has no vision_config: not an image-text model with a vision tower"
        )
    return vc


def _text_config(cfg: Any) -> Any:
    return getattr(cfg, "text_config", None) or cfg


def build_vlm(model_type: str, seed: int = 0) -> nn.Module:
    """A tiny random-initialised image-text model of a transformers ``model_type`` (llava, qwen2_vl, ...)."""
    from transformers import AutoModel, AutoModelForImageTextToText

    torch.manual_seed(seed)
    cfg = tiny_config(model_type)
    vc = _vision_config(cfg)
    text = _text_config(cfg)
    _shrink(vc, {**VISION_TINY, "out_hidden_size": text.hidden_size})
    patch, size = getattr(vc, "patch_size", None), getattr(vc, "image_size", None)
    if isinstance(patch, (list, tuple)) and isinstance(size, (list, tuple)):  # InternViT: (h, w) pairs
        vc.image_size = [p * _PATCHES_PER_SIDE for p in patch]
    elif isinstance(patch, int) and isinstance(size, int):
        vc.image_size = patch * _PATCHES_PER_SIDE
    for c in (cfg, vc):  # PaliGemma's projector maps the tower to this width, the language model's
        if isinstance(getattr(c, "projection_dim", None), int):
            c.projection_dim = text.hidden_size
    if isinstance(getattr(cfg, "mm_tokens_per_image", None), int):  # pooled to (side / 2)^2 tokens
        cfg.mm_tokens_per_image = (_PATCHES_PER_SIDE // 2) ** 2
    side = getattr(vc, "image_size", None)
    if isinstance(getattr(cfg, "image_grid_pinpoints", None), list) and isinstance(side, int):
        cfg.image_grid_pinpoints = [[side, side]]  # any-resolution (LLaVA-NeXT): one tile the size of the base image
    layers = getattr(cfg, "vision_feature_layers", None)  # VipLLaVA taps several tower layers
    if isinstance(layers, list):
        cfg.vision_feature_layers = [-2, -1]
    for key, offset in _TOKEN_IDS.items():
        if isinstance(cfg.to_dict().get(key), int):
            with contextlib.suppress(Exception):
                setattr(cfg, key, text.vocab_size - offset)
    try:
        model = AutoModelForImageTextToText.from_config(cfg, attn_implementation="eager")
    except ValueError:
        model = AutoModel.from_config(cfg, attn_implementation="eager")
    return model.eval()


def _image_side(vc: Any) -> int:
    size = getattr(vc, "image_size", None)
    size = size[0] if isinstance(size, (list, tuple)) else size
    if not isinstance(size, int):
        raise ValueError(f"the vision config {type(vc).__name__} has no image_size (got {size!r})")
    return size


def _layouts(cfg: Any, gen: torch.Generator) -> list[dict[str, Any]]:
    """The image layouts to try, most common first."""
    vc = _vision_config(cfg)
    channels = getattr(vc, "num_channels", None) or 3
    if "temporal_patch_size" in vc.to_dict():  # flattened patches and their (t, h, w) grid
        side = 2 * (getattr(vc, "spatial_merge_size", None) or 2)
        flat = channels * vc.temporal_patch_size * vc.patch_size**2
        pixels = torch.randn(side * side, flat, generator=gen)
        return [{"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, side, side]])}]
    if "num_patches" in vc.to_dict() and getattr(vc, "image_size", None) is None:
        return [patch_sequence(vc, gen)]
    side = _image_side(vc)
    image = torch.randn(1, channels, side, side, generator=gen)
    sizes = torch.tensor([[side, side]])
    return [
        {"pixel_values": image},
        {"pixel_values": image, "image_sizes": sizes},
        {"pixel_values": image.unsqueeze(1)},
        {"pixel_values": image.unsqueeze(1), "image_sizes": sizes},
        {"pixel_values": torch.stack([image[0], image[0]]).unsqueeze(0), "image_sizes": sizes},  # base + one tile
    ]


def patch_sequence(vc: Any, gen: torch.Generator) -> dict[str, Any]:
    """A NaViT-style tower's input (SigLIP 2: patches already flattened, a mask over them and each image's patch
    grid): one 4 x 4 patch image, its patches unpadded. Its config sets ``num_patches`` to 16 to match."""
    channels = getattr(vc, "num_channels", None) or 3
    n = _PATCHES_PER_SIDE**2
    with contextlib.suppress(Exception):
        vc.num_patches = n
    return {
        "pixel_values": torch.randn(1, n, channels * vc.patch_size**2, generator=gen),
        "pixel_attention_mask": torch.ones(1, n, dtype=torch.long),
        "spatial_shapes": torch.tensor([[_PATCHES_PER_SIDE, _PATCHES_PER_SIDE]]),
    }


def _count_tokens(model: nn.Module, image: dict[str, Any], width: int) -> int:
    """Image tokens the model fills for ``image``: its image features, in rows of the language width."""
    with torch.no_grad():
        out = model.get_image_features(**image)  # type: ignore[operator]
    feats = out if isinstance(out, torch.Tensor) else getattr(out, "pooler_output", None)
    if feats is None and isinstance(out, (tuple, list)):
        feats = out
    tensors = [feats] if isinstance(feats, torch.Tensor) else list(feats or [])
    total = sum(t.numel() for t in tensors if isinstance(t, torch.Tensor))
    if total == 0 or total % width:
        raise ValueError(f"image features of {total} values are not rows of the language width {width}")
    return total // width


def vlm_inputs(model: nn.Module, seed: int = 0) -> dict[str, Any]:
    """One image and a short text with its image placeholders, as keyword inputs of ``model.forward``."""
    cfg: Any = model.config
    text = _text_config(cfg)
    vocab = int(text.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    params = pyinspect.signature(model.forward).parameters
    if not hasattr(model, "get_image_features"):
        if "image_attention_mask" in params:  # cross-attention (Idefics 1): text positions x images, no placeholders
            return _cross_attention_inputs(cfg, vocab, gen, params)
        raise ValueError(f"{type(model).__name__} has no get_image_features: its image tokens cannot be counted")
    errors = []
    for image in _layouts(cfg, gen):
        try:
            n = _count_tokens(model, image, int(text.hidden_size))
            break
        except (TypeError, ValueError, RuntimeError, IndexError) as exc:
            errors.append(f"{sorted(image)} {tuple(image['pixel_values'].shape)}: {type(exc).__name__}: {exc}")
    else:
        raise ValueError("no image layout runs the tower: " + " | ".join(e.splitlines()[0] for e in errors))
    has = cfg.to_dict()
    ids = torch.randint(5, max(6, vocab - 8), (4,), generator=gen).tolist()
    ids += [vocab - 2] if isinstance(has.get("vision_start_token_id"), int) else []
    ids += [vocab - 1] * n
    ids += [vocab - 3] if isinstance(has.get("vision_end_token_id"), int) else []
    ids += torch.randint(5, max(6, vocab - 8), (2,), generator=gen).tolist()
    input_ids = torch.tensor([ids])
    inputs: dict[str, Any] = {"input_ids": input_ids, **image}
    if "mm_token_type_ids" in params:  # M-RoPE reads which tokens are image tokens
        inputs["mm_token_type_ids"] = (input_ids == vocab - 1).long()
    if "use_cache" in params:
        inputs["use_cache"] = False
    return inputs


def _cross_attention_inputs(cfg: Any, vocab: int, gen: torch.Generator, params: Any) -> dict[str, Any]:
    """One image ``(B, images, C, H, W)`` every text position may attend to (``image_attention_mask`` ones)."""
    vc = _vision_config(cfg)
    side = _image_side(vc)
    ids = torch.randint(5, max(6, vocab - 8), (1, 6), generator=gen)
    inputs: dict[str, Any] = {
        "input_ids": ids,
        "pixel_values": torch.randn(1, 1, getattr(vc, "num_channels", None) or 3, side, side, generator=gen),
        "image_attention_mask": torch.ones(1, ids.shape[1], 1, dtype=torch.long),
    }
    if "use_cache" in params:
        inputs["use_cache"] = False
    return inputs
