"""A tiny image-text model of a transformers model type, built offline from its config (random weights).

The language model is shrunk like :func:`.shrink.tiny_config`; the image side is shrunk here (with the one
:func:`.shrink.shrink` and its refits), from the config's own
fields (never the model type's name):

* a **vision tower** (``vision_config``) to 2 layers of width 64 on a 4 x 4 patch image (:data:`VISION_TINY`); the
  tower's per-layer lists that index its layers (Mllama's ``intermediate_layers_indices``) are refitted to the new
  depth and the widths derived from them (``vision_output_dim``: the concatenated taps) recomputed;
* a **VQ image tokenizer** (``vq_config``: Chameleon's VQ-VAE) to one downsampling level of 32 channels on an 8 x 8
  image and a 16-code codebook (:data:`VQ_TINY`); its codes are mapped to the last ids of the shrunk vocabulary
  (``vocabulary_map``, the placeholder ``<image>`` the last id of all);
* the **connector's own configs** (BLIP-2's Q-Former, Idefics2's perceiver: every other sub-config) to the same 2
  layers of width 64, their widths that state the tower's or the language model's width set to the shrunk widths;
* the layers that index the language model's stack (Mllama's ``cross_attention_layers``) to its last layer, the
  tower taps (``vision_feature_layer`` lists: VipLLaVA) to the last two hidden states, the image placeholder and
  the vision start / end markers moved into the shrunk vocabulary.

The synthetic batch for the model is :func:`.vlm_inputs.vlm_inputs`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from .attention import attention_kwargs
from .shrink import (
    TOWER_DERIVED,
    TOWER_LAYER_INDEX,
    VISION_TINY,
    fit_widths,
    inner_index,
    refit_tower_layers,
    shrink,
    tiny_config,
)
from .vlm_inputs import PATCHES_PER_SIDE, image_config, text_config

__all__ = ["VQ_TINY", "build_vlm", "is_vlm_type"]

# 32 groups), a 16-code codebook of width 32.
VQ_TINY: dict[str, Any] = {
    "base_channels": 32,
    "channel_multiplier": [1, 1],
    "num_res_blocks": 1,
    "resolution": 8,
    "embed_dim": 32,
    "latent_channels": 32,
    "num_embeddings": 16,
}
# Token ids moved into the shrunk vocabulary: offset from its end (the placeholder is the last id).
_TOKEN_IDS = {
    "image_token_id": 1,
    "image_token_index": 1,
    "vision_start_token_id": 2,
    "vision_end_token_id": 3,
    "video_token_id": 4,
    "video_token_index": 4,
}
_PLACEHOLDERS = ("image_token_id", "image_token_index")  # set even where the default is None (BLIP-2)
_TOWER_TAP_LISTS = ("vision_feature_layer",)  # a connector config's tower layer indices (Molmo2's adapter)
_POSITIONS = ("num_position_embeddings",)  # a learned table with one row per patch of the image
_TEXT_WIDTHS = ("text_hidden_size",)  # a connector config's field stating the language model's width (Molmo2)
_TEXT_LAYER_LISTS = ("cross_attention_layers",)  # language-model layer indices, refitted to its shrunk depth
_IMAGE_CONFIGS = ("vision_config", "vq_config")
_WIDTHS = ("hidden_size", "encoder_hidden_size", "embed_dim")  # a connector config's fields that state a width


def _fit_tower(vc: Any) -> None:
    """The tower at :data:`VISION_TINY`, a 4 x 4 patch image, its learned per-patch positions, its layer indices
    and lists and their derived widths."""
    before = vc.to_dict()
    odepth = getattr(vc, "num_hidden_layers", None)
    shrink(vc, VISION_TINY)
    patch, size = getattr(vc, "patch_size", None), getattr(vc, "image_size", None)
    if isinstance(patch, (list, tuple)) and isinstance(size, (list, tuple)):  # InternViT: (h, w) pairs
        vc.image_size = [p * PATCHES_PER_SIDE for p in patch]
    elif isinstance(patch, int) and isinstance(size, (list, tuple)):  # Molmo2: one patch side, an (h, w) image
        vc.image_size = [patch * PATCHES_PER_SIDE] * len(size)
    elif isinstance(patch, int) and isinstance(size, int):
        vc.image_size = patch * PATCHES_PER_SIDE
    side = size[0] if isinstance(size, (list, tuple)) else size
    for key in _POSITIONS:  # one row per patch of the original image: one per patch of the shrunk one
        if isinstance(patch, int) and isinstance(side, int) and before.get(key) == (side // patch) ** 2:
            setattr(vc, key, PATCHES_PER_SIDE**2)
    depth = getattr(vc, "num_hidden_layers", None)
    if isinstance(odepth, int) and isinstance(depth, int):
        refit_tower_layers(vc, before, odepth, depth)


def _fit_vq(vq: Any, text: Any) -> Any:
    """The VQ tokenizer at :data:`VQ_TINY`, and a vocabulary map sending its codes to the last ids of the text
    vocabulary (the ``IMGIMG<digits as letters>Z`` names transformers' image-vocabulary mapping decodes)."""
    shrink(vq, VQ_TINY)
    vocab, codes = int(text.vocab_size), int(getattr(vq, "num_embeddings", 0))
    letters = {str(d): chr(ord("A") + d) for d in range(10)}
    mapping = {"<image>": vocab - 1}
    for code in range(codes):
        mapping["IMGIMG" + "".join(letters[c] for c in str(code)) + "Z"] = vocab - 2 - code
    return mapping


def _fit_connector_configs(cfg: Any, original: Any) -> None:
    """Every sub-config that is neither the image encoder nor the language model (a Q-Former, a perceiver, an
    adapter) shrunk to :data:`VISION_TINY`; its width fields that equalled the original tower or text width take
    the shrunk one (:func:`fit_widths`), its lists of tower layer indices (:data:`_TOWER_TAP_LISTS`) are refitted
    to the shrunk tower."""
    text, otext = text_config(cfg), text_config(original)
    image = next((getattr(cfg, k) for k in _IMAGE_CONFIGS if getattr(cfg, k, None) is not None), None)
    oimage = next((getattr(original, k) for k in _IMAGE_CONFIGS if getattr(original, k, None) is not None), None)
    widths = {}
    for old, new in ((oimage, image), (otext, text)):
        if old is not None and new is not None and isinstance(getattr(old, "hidden_size", None), int):
            widths[old.hidden_size] = new.hidden_size
    depths = (getattr(oimage, "num_hidden_layers", None), getattr(image, "num_hidden_layers", None))
    for key in getattr(cfg, "sub_configs", None) or {}:
        sub, osub = getattr(cfg, key, None), getattr(original, key, None)
        if key in (*_IMAGE_CONFIGS, "text_config") or sub is None or osub is None or sub is text:
            continue
        before = sub.to_dict()
        if isinstance(before.get("image_size"), int) and isinstance(before.get("patch_size"), int):
            _fit_tower(sub)  # a second image encoder (DeepSeek-VL hybrid's high-resolution SAM tower)
        else:
            shrink(sub, VISION_TINY)
        for field in _WIDTHS:
            old = getattr(osub, field, None)
            if isinstance(old, int) and old in widths:
                with contextlib.suppress(Exception):
                    setattr(sub, field, widths[old])
        fit_widths(sub, {k: v for k, v in before.items() if k not in _WIDTHS}, widths)
        shrink(sub, dict.fromkeys(_TEXT_WIDTHS, text.hidden_size))  # its default need not equal the text's
        for field in _TOWER_TAP_LISTS:
            taps = before.get(field)
            if isinstance(taps, list) and all(type(t) is int for t in taps) and all(isinstance(d, int) for d in depths):
                setattr(sub, field, [inner_index(t, depths[0], depths[1]) for t in taps])  # type: ignore[arg-type]


def _original_widths(cfg: Any, original: Any) -> dict[int, int]:
    """Original width -> shrunk width, for the image encoder and the language model."""
    widths: dict[int, int] = {}
    pairs = [(getattr(original, k, None), getattr(cfg, k, None)) for k in _IMAGE_CONFIGS]
    for old, new in [*pairs, (text_config(original), text_config(cfg))]:
        if old is not None and new is not None and isinstance(getattr(old, "hidden_size", None), int):
            widths.setdefault(old.hidden_size, new.hidden_size)
    return widths


def build_vlm(model_type: str, seed: int = 0) -> nn.Module:
    """A tiny random-initialised image-text model of a transformers ``model_type`` (llava, qwen2_vl, ...)."""
    from transformers import AutoConfig, AutoModel, AutoModelForImageTextToText

    torch.manual_seed(seed)
    original = AutoConfig.for_model(model_type)
    cfg = tiny_config(model_type)
    text = text_config(cfg)
    image_config(cfg)  # raises unless there is a vision tower or an image tokenizer
    vc, vq = getattr(cfg, "vision_config", None), getattr(cfg, "vq_config", None)
    top, tower = cfg.to_dict(), vc.to_dict() if vc is not None else {}
    if vc is not None:
        _fit_tower(vc)
        for key in TOWER_LAYER_INDEX:  # the top-level copy of the tower's index (MiniCPM-V copies it down)
            if type(top.get(key)) is int and isinstance(getattr(vc, key, None), int):
                setattr(cfg, key, getattr(vc, key))
        shrink(vc, {"out_hidden_size": text.hidden_size})
    elif vq is not None and "vocabulary_map" in cfg.to_dict():
        cfg.vocabulary_map = _fit_vq(vq, text)
    _fit_connector_configs(cfg, original)
    widths = _original_widths(cfg, original)
    fit_widths(cfg, {k: v for k, v in top.items() if k not in (getattr(cfg, "sub_configs", None) or {})}, widths)
    if vc is not None:
        fit_widths(vc, {k: v for k, v in tower.items() if k not in TOWER_DERIVED}, widths)
    for c in (cfg, vc):  # PaliGemma's projector maps the tower to this width, the language model's
        if c is not None and isinstance(getattr(c, "projection_dim", None), int):
            c.projection_dim = text.hidden_size
    if isinstance(getattr(cfg, "mm_tokens_per_image", None), int):  # pooled to (side / 2)^2 tokens
        cfg.mm_tokens_per_image = (PATCHES_PER_SIDE // 2) ** 2
    side = getattr(vc, "image_size", None)
    if isinstance(getattr(cfg, "image_grid_pinpoints", None), list) and isinstance(side, int):
        cfg.image_grid_pinpoints = [[side, side]]  # any-resolution (LLaVA-NeXT): one tile the size of the base image
    if isinstance(getattr(cfg, "vision_feature_layer", None), (list, tuple)):  # VipLLaVA taps several layers
        cfg.vision_feature_layer = [-2, -1]
    depth = getattr(text, "num_hidden_layers", None)
    for key in _TEXT_LAYER_LISTS:
        if isinstance(getattr(text, key, None), list) and isinstance(depth, int):
            setattr(text, key, [depth - 1])  # one such layer, the last; the others stay self-attention
    have, moved = cfg.to_dict(), set()
    for key, offset in _TOKEN_IDS.items():
        field = getattr(cfg, "attribute_map", {}).get(key, key)  # Molmo2: image_token_id is image_patch_id
        if field in moved:  # an alias of a field already moved (Molmo2's video_token_id: image_patch_id too)
            continue
        if isinstance(have.get(field), int) or (key in _PLACEHOLDERS and field in have):
            moved.add(field)
            with contextlib.suppress(Exception):
                setattr(cfg, field, text.vocab_size - offset)
    try:
        model = AutoModelForImageTextToText.from_config(cfg, **attention_kwargs())
    except ValueError:
        model = AutoModel.from_config(cfg, **attention_kwargs())
    return model.eval()


def is_vlm_type(model_type: str) -> bool:
    """Whether transformers registers ``model_type`` as an image-text-to-text model whose config has a vision
    tower (``vision_config``) or a VQ image tokenizer (``vq_config``: Chameleon)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return False
    try:
        cfg = AutoConfig.for_model(model_type)
    except Exception:
        return False
    return any(getattr(cfg, key, None) is not None for key in ("vision_config", "vq_config"))
