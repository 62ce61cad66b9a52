"""One synthetic image + text batch for a (tiny) image-text model, offline, from its config and the model itself.

The processor (which would size the image and count its tokens) is not available offline, so the batch is built
from the config: the image is laid out as the tower reads it (``(B, C, H, W)``, one more image axis
``(B, N, C, H, W)``, Qwen2-VL's flattened patches with ``image_grid_thw``, a NaViT patch sequence, or Mllama's
aspect-ratio tiles ``(B, images, tiles, C, H, W)`` with their ratio ids and masks), and the number of image tokens
is what the model's own ``get_image_features`` returns for that image (its rows of the language model's width), so
the text holds exactly as many placeholders as the model will fill. The arguments a ``get_image_features`` (the
head's or its base model's) requires beside the image are built from the config too: a patch grid
(``target_sizes``, ``image_grid_hw``), pooling windows and their grid (``image_token_pooling``, ``image_grids``),
merge sizes, a Q-Former instruction, a high-resolution copy of the image (:data:`_EXTRA_LAYOUTS`,
:data:`_EXTRA_INPUTS`). A model that reads the image by cross-attention
and has no placeholders gets a mask over (text positions x images [x tiles]) instead, all ones.
"""

from __future__ import annotations

import contextlib
import inspect as pyinspect
import math
from typing import Any

import torch
from torch import nn

__all__ = ["PATCHES_PER_SIDE", "image_config", "patch_sequence", "text_config", "tiled_image", "vlm_inputs"]

PATCHES_PER_SIDE = 4
_MERGES = ("spatial_merge_size", "merge_size", "merge_kernel_size")  # k x k patches merged into one token
_TEMPORAL = ("temporal_patch_size", "patch_temporal")  # frames per patch (an image repeats its one frame)


def image_config(cfg: Any) -> Any:
    """The config of what reads the image: the vision tower's (``vision_config``) or a VQ image tokenizer's
    (``vq_config``: Chameleon's VQ-VAE turns the image into discrete token ids)."""
    for key in ("vision_config", "vq_config"):
        sub = getattr(cfg, key, None)
        if sub is not None:
            return sub
    raise ValueError(
        f"model_type {cfg.model_type!r} has no vision_config or vq_config: not an image-text model with a vision "
        "tower or an image tokenizer"
    )


def text_config(cfg: Any) -> Any:
    return getattr(cfg, "text_config", None) or cfg


def _image_side(ic: Any) -> int:
    size = getattr(ic, "image_size", None)
    if size is None:
        size = getattr(ic, "resolution", None)  # a VQ tokenizer's training resolution
    size = size[0] if isinstance(size, (list, tuple)) else size
    if not isinstance(size, int):
        raise ValueError(f"the vision config {type(ic).__name__} has no image_size or resolution (got {size!r})")
    return size


def _channels(ic: Any) -> int:
    return int(getattr(ic, "num_channels", None) or getattr(ic, "in_channels", None) or 3)


def _merge(ic: Any) -> int:
    """The side m of the m x m patches the tower or its merger joins into one token (2 where the config names
    none)."""
    d = ic.to_dict()
    merge = next((d[k] for k in _MERGES if isinstance(d.get(k), int)), None)
    return merge if merge is not None else next((d[k][0] for k in _MERGES if isinstance(d.get(k), list)), 2)


def _grid_layouts(ic: Any, gen: torch.Generator) -> list[dict[str, Any]]:
    """Flattened patches and their (t, h, w) grid (Qwen2-VL style): a (2 m) x (2 m) patch grid for a merge of m x m
    patches, each patch flattened to channels x t x patch^2 values, t the config's temporal patch (1 or 2 where it
    names none: the flat width the tower's patch embedding reads decides which runs)."""
    d = ic.to_dict()
    patch = d.get("patch_size")
    if not isinstance(patch, int):
        return []
    side = 2 * _merge(ic)
    temporal = [d[k] for k in _TEMPORAL if isinstance(d.get(k), int)]
    grid = torch.tensor([[1, side, side]])
    out = []
    for t in dict.fromkeys([*temporal, 1, 2]):
        pixels = torch.randn(side * side, _channels(ic) * t * patch**2, generator=gen)
        out.append({"pixel_values": pixels, "image_grid_thw": grid})
    patches = torch.randn(side * side, _channels(ic), patch, patch, generator=gen)  # one (C, p, p) per patch: Kimi
    return [*out, {"pixel_values": patches, "image_grid_thw": grid}]


def _patch_grid(ic: Any) -> tuple[int, int]:
    """The tower's patch size and the side of its (shrunk) image in patches."""
    patch = ic.patch_size
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    if not isinstance(patch, int):
        raise ValueError(f"the vision config {type(ic).__name__} has no integer patch_size (got {patch!r})")
    return patch, _image_side(ic) // patch


def _target_size_layouts(ic: Any, gen: torch.Generator) -> list[dict[str, Any]]:
    """One image ``(1, C, H, W)`` with its patch grid ``target_sizes`` ``[[H / p, W / p]]`` (MiniCPM-V: the
    patch embedding runs on the image, the position ids and the merges read the grid)."""
    patch, side = _patch_grid(ic)
    image = torch.randn(1, _channels(ic), side * patch, side * patch, generator=gen)
    return [{"pixel_values": image, "target_sizes": torch.tensor([[side, side]], dtype=torch.int32)}]


def _pooled_crop_layouts(ic: Any, gen: torch.Generator) -> list[dict[str, Any]]:
    """One crop of flattened patches ``(1, side^2, C p^2)`` with the patch indices each image token pools
    (``image_token_pooling``: 2 x 2 windows of the crop's patch grid, row-major) and the pooled grid
    ``image_grids`` ``[[h, w, 0, 0]]`` (Molmo2: a low-resolution grid h x w and no high-resolution crops)."""
    patch, side = _patch_grid(ic)
    pool, pooled = 2, side // 2
    pixels = torch.randn(1, side * side, _channels(ic) * patch**2, generator=gen)
    index = torch.arange(side * side).reshape(pooled, pool, pooled, pool).permute(0, 2, 1, 3)
    return [
        {
            "pixel_values": pixels,
            "image_token_pooling": index.reshape(pooled * pooled, pool * pool),
            "image_grids": torch.tensor([[pooled, pooled, 0, 0]]),
        }
    ]


def _hw_grid_layouts(ic: Any, gen: torch.Generator) -> list[dict[str, Any]]:
    """Flattened patches ``(side^2, C p^2)`` with their patch grid ``image_grid_hw`` ``[[side, side]]``
    (Nemotron-H Omni's RADIO tower)."""
    patch, side = _patch_grid(ic)
    pixels = torch.randn(side * side, _channels(ic) * patch**2, generator=gen)
    return [{"pixel_values": pixels, "image_grid_hw": torch.tensor([[side, side]])}]


# a required get_image_features argument -> the image layouts that supply it with the image
_EXTRA_LAYOUTS = {
    "target_sizes": _target_size_layouts,
    "image_token_pooling": _pooled_crop_layouts,
    "image_grid_hw": _hw_grid_layouts,
}


def _merge_sizes(cfg: Any, gen: torch.Generator, image: dict[str, Any]) -> dict[str, Any]:
    """Each image's merge side (VideoLLaMA 3 merges m x m patches per image; its grid layouts hold 2 m x 2 m)."""
    return {"image_merge_sizes": torch.tensor([_merge(image_config(cfg))])}


def _qformer_ids(cfg: Any, gen: torch.Generator, image: dict[str, Any]) -> dict[str, Any]:
    """The instruction the Q-Former reads beside its queries (InstructBLIP): a few ids of its own vocabulary."""
    vocab = int(cfg.qformer_config.vocab_size)
    ids = _text_ids(vocab, gen, 4).unsqueeze(0)
    return {"qformer_input_ids": ids, "qformer_attention_mask": torch.ones_like(ids)}


def _high_res_image(cfg: Any, gen: torch.Generator, image: dict[str, Any]) -> dict[str, Any]:
    """The second, high-resolution copy of the image a hybrid tower reads (DeepSeek-VL hybrid's SAM encoder), at
    the size of ``high_res_vision_config``."""
    hc = cfg.high_res_vision_config
    side = _image_side(hc)
    return {"high_res_pixel_values": torch.randn(1, _channels(hc), side, side, generator=gen)}


# a required get_image_features argument -> the inputs that go with each image layout
_EXTRA_INPUTS = {
    "image_merge_sizes": _merge_sizes,
    "qformer_input_ids": _qformer_ids,
    "high_res_pixel_values": _high_res_image,
}


def _layouts(cfg: Any, gen: torch.Generator, arguments: dict[str, bool]) -> list[dict[str, Any]]:
    """The image layouts to try, most common first (``arguments``: the named arguments of the model's
    ``get_image_features``, each with whether it is required; one of :data:`_EXTRA_LAYOUTS` required picks its
    layouts; an ``image_grid_thw``, or a tower that names a temporal patch size, asks for flattened patches and
    their grid)."""
    ic = image_config(cfg)
    layouts = next((build(ic, gen) for key, build in _EXTRA_LAYOUTS.items() if arguments.get(key)), None)
    layouts = layouts if layouts is not None else _image_layouts(cfg, gen, "image_grid_thw" in arguments)
    extras = [build for key, build in _EXTRA_INPUTS.items() if arguments.get(key)]
    return [image | {k: v for build in extras for k, v in build(cfg, gen, image).items()} for image in layouts]


def _image_layouts(cfg: Any, gen: torch.Generator, grid: bool) -> list[dict[str, Any]]:
    """The plain image layouts, most common first (``grid``: flattened patches and their grid asked for)."""
    ic = image_config(cfg)
    channels = _channels(ic)
    if grid or "temporal_patch_size" in ic.to_dict():
        layouts = _grid_layouts(ic, gen)
        if layouts:
            return layouts
    if "num_patches" in ic.to_dict() and getattr(ic, "image_size", None) is None:
        return [patch_sequence(ic, gen)]
    side = _image_side(ic)
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
    n = PATCHES_PER_SIDE**2
    with contextlib.suppress(Exception):
        vc.num_patches = n
    return {
        "pixel_values": torch.randn(1, n, channels * vc.patch_size**2, generator=gen),
        "pixel_attention_mask": torch.ones(1, n, dtype=torch.long),
        "spatial_shapes": torch.tensor([[PATCHES_PER_SIDE, PATCHES_PER_SIDE]]),
    }


def _features_owner(model: nn.Module) -> nn.Module | None:
    """The first module (the model itself, else its submodules in registration order) with a
    ``get_image_features`` method: some heads leave it to their base model (Janus, DeepSeek-VL, Emu3)."""
    return next((m for m in model.modules() if callable(getattr(m, "get_image_features", None))), None)


def _feature_arguments(model: nn.Module) -> dict[str, bool]:
    """The named arguments of every ``get_image_features`` of the model and its modules, each with whether one
    of them requires it (has no default for it): a head often passes ``*args, **kwargs`` on to its base model's
    (MiniCPM-V), or names fewer of them (VideoLLaMA 3's head leaves ``image_merge_sizes`` to its base model)."""
    out: dict[str, bool] = {}
    for m in model.modules():
        features = getattr(m, "get_image_features", None)
        if not callable(features):
            continue
        for p in pyinspect.signature(features).parameters.values():
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                out[p.name] = out.get(p.name, False) or p.default is p.empty
    return out


def _count_tokens(owner: nn.Module, image: dict[str, Any], width: int) -> int:
    """Image tokens the model fills for ``image``: its image features, in rows of the language width."""
    with torch.no_grad():
        out = owner.get_image_features(**image)  # type: ignore[operator]
    feats = out if isinstance(out, torch.Tensor) else getattr(out, "pooler_output", None)
    if feats is None and isinstance(out, (tuple, list)):
        feats = out
    tensors = [t for t in ([feats] if isinstance(feats, torch.Tensor) else list(feats or [])) if torch.is_tensor(t)]
    total = sum(t.numel() for t in tensors)
    if total == 0 or any(t.shape[-1] != width for t in tensors if t.dim()):
        shapes = [tuple(t.shape) for t in tensors]
        raise ValueError(f"image features of shapes {shapes} are not rows of the language width {width}")
    return total // width


def _text_ids(vocab: int, gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(5, max(6, vocab - 8), (n,), generator=gen)


def vlm_inputs(model: nn.Module, seed: int = 0) -> dict[str, Any]:
    """One image and a short text with its image placeholders, as keyword inputs of ``model.forward``."""
    cfg: Any = model.config
    text = text_config(cfg)
    vocab = int(text.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    params = pyinspect.signature(model.forward).parameters
    owner = _features_owner(model)
    if "image_attention_mask" in params or "cross_attention_mask" in params:  # no placeholders: a mask instead
        return _cross_attention_inputs(cfg, vocab, gen, params)
    if owner is None:
        raise ValueError(
            f"{type(model).__name__} has no get_image_features (nor any of its modules): its image tokens cannot "
            "be counted"
        )
    errors = []
    for image in _layouts(cfg, gen, _feature_arguments(model)):
        try:
            n = _count_tokens(owner, image, int(text.hidden_size))
            break
        except (TypeError, ValueError, RuntimeError, IndexError) as exc:
            errors.append(f"{sorted(image)} {tuple(image['pixel_values'].shape)}: {type(exc).__name__}: {exc}")
    else:
        raise ValueError("no image layout runs the tower: " + " | ".join(e.splitlines()[0] for e in errors))
    has = cfg.to_dict()
    ids = _text_ids(vocab, gen, 4).tolist()
    ids += [vocab - 2] if isinstance(has.get("vision_start_token_id"), int) else []
    ids += [vocab - 1] * n
    ids += [vocab - 3] if isinstance(has.get("vision_end_token_id"), int) else []
    ids += _text_ids(vocab, gen, 2).tolist()
    input_ids = torch.tensor([ids])
    inputs: dict[str, Any] = {"input_ids": input_ids, **image}
    if "mm_token_type_ids" in params:  # M-RoPE reads which tokens are image tokens
        inputs["mm_token_type_ids"] = (input_ids == vocab - 1).long()
    if "use_cache" in params:
        inputs["use_cache"] = False
    return inputs


def _tiles(vc: Any) -> tuple[int, int, int]:
    """Mllama's tiling from its config: (tiles per image, the aspect-ratio id of one whole tile, tiles it uses).
    Ids count ``supported_aspect_ratios`` from 1 (0 is padding); the image is one tile, ratio (1, 1) where listed."""
    tiles = int(vc.max_num_tiles)
    ratios = [list(r) for r in vc.supported_aspect_ratios]
    pick = ratios.index([1, 1]) if [1, 1] in ratios else 0
    return tiles, pick + 1, math.prod(ratios[pick])


def tiled_image(vc: Any, gen: torch.Generator) -> dict[str, Any]:
    """One image as Mllama's aspect-ratio tiles ``(1, 1, tiles, C, H, W)``: the tiles it uses random, the others
    zero and masked (``aspect_ratio_mask``), with the ratio id of a whole tile (``aspect_ratio_ids``)."""
    tiles, ratio_id, used = _tiles(vc)
    side, channels = _image_side(vc), _channels(vc)
    pixels = torch.zeros(1, 1, tiles, channels, side, side)
    pixels[:, :, :used] = torch.randn(1, 1, used, channels, side, side, generator=gen)
    mask = torch.zeros(1, 1, tiles, dtype=torch.long)
    mask[..., :used] = 1
    return {"pixel_values": pixels, "aspect_ratio_ids": torch.tensor([[ratio_id]]), "aspect_ratio_mask": mask}


def _cross_attention_inputs(cfg: Any, vocab: int, gen: torch.Generator, params: Any) -> dict[str, Any]:
    """One image that every text position may attend to: ``(B, images, C, H, W)`` with ``image_attention_mask``
    ones over (text x images) (Idefics 1); or, where the forward reads aspect-ratio tiles (Mllama), ``(B, images,
    tiles, C, H, W)`` with the tile ratio id, the tile mask and ``cross_attention_mask`` over (text x images x
    tiles), the unused tiles zero and masked."""
    vc = image_config(cfg)
    side, channels = _image_side(vc), _channels(vc)
    ids = _text_ids(vocab, gen, 6).unsqueeze(0)
    inputs: dict[str, Any] = {"input_ids": ids}
    if "aspect_ratio_ids" in params:
        tiled = tiled_image(vc, gen)
        mask = tiled["aspect_ratio_mask"]
        inputs |= tiled | {"cross_attention_mask": mask.unsqueeze(1).expand(1, ids.shape[1], *mask.shape[1:]).clone()}
    else:
        inputs |= {
            "pixel_values": torch.randn(1, 1, channels, side, side, generator=gen),
            "image_attention_mask": torch.ones(1, ids.shape[1], 1, dtype=torch.long),
        }
    if "use_cache" in params:
        inputs["use_cache"] = False
    return inputs
