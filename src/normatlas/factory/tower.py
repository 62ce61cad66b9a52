"""A tiny vision tower of a transformers model type, built offline from its config (random weights).

A plain tower is shrunk like a text stack (:func:`.shrink.tiny_config`) on a small image, the sizes the shrink
leaves inconsistent kept in step with it (:func:`_fit_tied_sizes`) and the config rebuilt so that what it derives
follows (:func:`.shrink.rederived`); a hierarchical tower (one ``depths`` entry per stage) keeps its stages at two
blocks each (:func:`_staged_tower`). A tower config AutoModel does not register is built by the class its modeling
code defines for it, found by what that class reads (an image), never by its name."""

from __future__ import annotations

import contextlib
import importlib
import inspect as pyinspect
from typing import Any

import torch
from torch import nn

from .attention import attention_kwargs, choose_attention
from .shrink import (
    TINY,
    TOWER_DERIVED,
    check_model_type,
    field_of,
    fit_widths,
    rederived,
    refit_tower_layers,
    tiny_config,
)

__all__ = ["build_vision", "is_vision_type"]


def build_vision(model_type: str, seed: int = 0, image_size: int = 32, patch_size: int = 8) -> nn.Module:
    """A tiny random-initialised vision tower of a transformers ``model_type`` (``clip_vision_model``,
    ``siglip_vision_model``, ``vit``, ``dinov2``, ...): the type's config shrunk like :func:`tiny_config`,
    with a small image (``image_size`` / ``patch_size``) where the config has those fields."""
    from transformers import AutoModel

    for name, val in (("image_size", image_size), ("patch_size", patch_size)):
        if type(val) is not int or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    check_model_type(model_type, "not a transformers model type", "clip_vision_model, siglip_vision_model, vit, dinov2")
    torch.manual_seed(seed)
    cfg = _staged_tower(model_type, image_size) or _tiny_tower(model_type, image_size, patch_size)
    try:
        return AutoModel.from_config(cfg, **attention_kwargs()).eval()
    except ValueError:  # a tower's own config (AlignVisionConfig, ...) that AutoModel does not register
        cls = _model_class_of(cfg)
        if cls is None:
            raise
        return _construct(cls, cfg).eval()


def _tiny_tower(model_type: str, image_size: int, patch_size: int) -> Any:
    """A plain (unstaged) tower's config: :func:`tiny_config`'s shrink, a small image, the sizes tied to the
    shrunk ones kept consistent (:func:`_fit_tied_sizes`), then built again from its changed fields so that what the
    config derives from them follows (RADIO's ``patch_dim``, Sapiens2's per-layer key/value heads)."""
    from transformers import AutoConfig

    orig = AutoConfig.for_model(model_type)
    cfg = tiny_config(model_type)
    sizes = (("image_size", image_size), ("patch_size", patch_size)) if not getattr(cfg, "depths", None) else ()
    for key, val in sizes:
        if key in cfg.to_dict():
            now = getattr(cfg, key, None)
            with contextlib.suppress(Exception):  # an (h, w) pair stays a pair (InternViT)
                setattr(cfg, key, [val, val] if isinstance(now, (list, tuple)) else val)
    deliberate = set(TINY) | {k for k, _ in sizes} | _fit_tied_sizes(cfg, orig, image_size)
    return rederived(cfg, orig, deliberate)


def _fit_tied_sizes(cfg: Any, orig: Any, image_size: int) -> set[str]:
    """Keep the sizes the shrink leaves inconsistent in step with it (``orig``: the config unshrunk); the fields
    set are returned. A size is shrunk, never grown (ViTPose's one MLP does not become 4 experts); a per-stage width
    list starting at the hidden size is scaled with it (SAM 2's Hiera: ``embed_dim_per_stage[0]`` is its stem's
    width); a count of the stack's blocks (``*_blocks``) the shrunk depth no longer holds leaves one layer outside
    it (EoMT's last ``num_blocks`` layers read its queries); and where the patch is unfolded from the
    last feature map (``output_stride``: MobileViT), the original patch and an image leaving that map one patch."""
    touched: set[str] = set()

    def put(key: str, val: Any) -> None:
        with contextlib.suppress(Exception):  # some configs guard their attributes
            setattr(cfg, key, val)
            touched.add(key)

    for key in TINY:
        was, now = field_of(orig, key), field_of(cfg, key)
        if type(was) is int and type(now) is int and was < now:
            put(key, was)
    width0, width = field_of(orig, "hidden_size"), field_of(cfg, "hidden_size")
    if type(width0) is int and type(width) is int and 0 < width < width0:
        for key, now in list(vars(cfg).items()):
            if (
                key not in TINY
                and isinstance(now, list)
                and len(now) > 1
                and all(type(v) is int for v in now)
                and now[0] == width0
                and all(v * width % width0 == 0 for v in now)
            ):
                put(key, [v * width // width0 for v in now])
    depth0, depth = field_of(orig, "num_hidden_layers"), field_of(cfg, "num_hidden_layers")
    if type(depth0) is int and type(depth) is int and 0 < depth < depth0:
        for key, was in vars(orig).items():
            if (
                key.endswith("_blocks")  # a ``*_layers`` count may be a stack of its own (Mllama's global layers)
                and type(was) is int
                and depth <= was < depth0
                and field_of(cfg, key) == was
            ):
                put(key, max(1, depth - 1))
    touched |= _fit_indices_and_widths(cfg, orig)
    stride, patch0, patch = field_of(orig, "output_stride"), field_of(orig, "patch_size"), field_of(cfg, "patch_size")
    if type(stride) is int and type(patch0) is int and type(patch) is int:
        put("patch_size", min(patch, patch0))
        if type(field_of(cfg, "image_size")) is int:
            put("image_size", max(image_size, stride * cfg.patch_size))
    return touched


def _fit_indices_and_widths(cfg: Any, orig: Any) -> set[str]:
    """The tower's fields that index its layers or state its width, refitted as an image-text model's tower is
    (:func:`.shrink.refit_tower_layers`), and the ``*_size`` / ``*_dim`` fields that stated the original width (or k
    times it) at the shrunk one (:func:`.shrink.fit_widths`: Dots3's ``adapter_in_dim``). The fields changed are
    returned."""
    before, was = orig.to_dict(), cfg.to_dict()
    depth0, depth = field_of(orig, "num_hidden_layers"), field_of(cfg, "num_hidden_layers")
    if type(depth0) is int and type(depth) is int:
        refit_tower_layers(cfg, before, depth0, depth)
    width0, width = field_of(orig, "hidden_size"), field_of(cfg, "hidden_size")
    if type(width0) is int and type(width) is int and width < width0:
        fit_widths(cfg, {k: v for k, v in before.items() if k not in TOWER_DERIVED}, {width0: width})
    now = cfg.to_dict()
    return {k for k in now if now[k] != was.get(k)}


def _construct(cls: type[nn.Module], cfg: Any) -> nn.Module:
    """``cls`` built from ``cfg``: a ``PreTrainedModel`` through ``_from_config`` (the chosen attention, its
    weight init), a plain module (IDEFICS' ``IdeficsVisionTransformer``) by calling it on the config."""
    from transformers import PreTrainedModel

    if issubclass(cls, PreTrainedModel):
        return cls._from_config(cfg, **attention_kwargs())
    return cls(cfg)


def _model_class_of(cfg: Any) -> type[nn.Module] | None:
    """The class the modeling code builds for a tower config AutoModel does not register (None when there is
    none). First the config's own modeling module (:func:`_tower_class_in`); else, for a config that is a
    sub-config of a composite whose registered model is another type's code (PP-Chart2Table's vision config, run by
    ``GotOcr2ForConditionalGeneration``), the class that code builds for the same sub-config key."""
    import sys

    from transformers import PretrainedConfig

    mod = _modeling_module(type(cfg))
    found = _tower_class_in(mod, type(cfg), cfg) if mod is not None else None
    if found is not None:
        return found
    own = sys.modules.get(type(cfg).__module__)
    for parent in vars(own).values() if own is not None else ():
        if not (isinstance(parent, type) and issubclass(parent, PretrainedConfig)):
            continue
        for key, sub in (getattr(parent, "sub_configs", None) or {}).items():
            if sub is not type(cfg):
                continue
            for model_cls in _registered_models(getattr(parent, "model_type", "")):
                theirs = (getattr(getattr(model_cls, "config_class", None), "sub_configs", None) or {}).get(key)
                if isinstance(theirs, type) and theirs is not type(cfg):
                    found = _tower_class_in(sys.modules[model_cls.__module__], theirs, cfg)
                    if found is not None:
                        return found
    return None


def _modeling_module(config_cls: type) -> Any:
    """The ``modeling_*`` module beside a ``configuration_*`` module (None when it does not import: PP-Chart2Table
    ships none)."""
    try:
        return importlib.import_module(config_cls.__module__.replace(".configuration_", ".modeling_"))
    except ImportError:
        return None


def _registered_models(model_type: str) -> list[type]:
    """The model classes transformers' auto mappings name for ``model_type`` (every task's mapping, in order)."""
    import transformers
    from transformers.models.auto import modeling_auto

    names: list[str] = []
    for key, mapping in vars(modeling_auto).items():
        if key.endswith("_MAPPING_NAMES") and isinstance(mapping, dict) and model_type in mapping:
            val = mapping[model_type]
            names += [val] if isinstance(val, str) else [v for v in val if isinstance(v, str)]
    classes: list[type] = []
    for name in dict.fromkeys(names):
        with contextlib.suppress(Exception):  # a class whose backend is missing
            cls = getattr(transformers, name)
            if isinstance(cls, type):
                classes.append(cls)
    return classes


def _tower_class_in(mod: Any, config_cls: type, cfg: Any) -> type[nn.Module] | None:
    """The tower class for ``config_cls`` among the classes ``mod`` defines or imports from its own package (IDEFICS'
    tower lives in ``vision.py``), whose ``forward`` reads an image (:func:`_reads_image`): the first
    ``PreTrainedModel`` whose ``config_class`` it is; else, of the plain modules whose ``__init__`` takes it, the
    largest built on ``cfg`` (the one holding the others: the transformer, not its patch embedding)."""
    from transformers import PreTrainedModel

    package = mod.__name__.rpartition(".")[0] + "."
    classes = [
        c
        for c in dict.fromkeys(v for v in vars(mod).values() if isinstance(v, type))
        if issubclass(c, nn.Module) and c.__module__.startswith(package) and _reads_image(c)
    ]
    for c in classes:
        if issubclass(c, PreTrainedModel) and getattr(c, "config_class", None) is config_cls:
            return c
    plain = [c for c in classes if not issubclass(c, PreTrainedModel) and _takes_config(c, config_cls)]
    sizes: dict[type[nn.Module], int] = {}
    for c in plain:
        with contextlib.suppress(Exception):
            sizes[c] = sum(p.numel() for p in c(cfg).parameters())
    return max(sizes, key=lambda c: sizes[c]) if sizes else None


def _reads_image(cls: type) -> bool:
    """``cls.forward`` takes ``pixel_values``, or its first argument is the image: named for pixels or an image
    (BridgeTower's tower reads ``image``) or the class's declared ``main_input_name`` (when not ``input_ids``)."""
    try:
        params = list(pyinspect.signature(cls.forward).parameters)  # type: ignore[attr-defined]
    except (TypeError, ValueError, AttributeError):
        return False
    if "pixel_values" in params:
        return True
    first = params[1] if len(params) > 1 and params[0] == "self" else params[0] if params else ""
    main = getattr(cls, "main_input_name", "input_ids")
    return "pixel" in first or "image" in first or (first == main and main != "input_ids")


def _takes_config(cls: type, config_cls: type) -> bool:
    """``cls.__init__`` takes one ``config`` argument annotated with ``config_cls`` (by the class or its name, for
    annotations left as strings)."""
    try:
        params = list(pyinspect.signature(cls.__init__).parameters.values())[1:]  # type: ignore[misc]
    except (TypeError, ValueError):
        return False
    if not params or params[0].name != "config":
        return False
    ann = params[0].annotation
    return ann is config_cls or (isinstance(ann, str) and ann.split(".")[-1] == config_cls.__name__)


def _staged_tower(model_type: str, image_size: int) -> Any:
    """A hierarchical tower's config (ConvNeXt, Swin: one ``depths`` entry per stage, widths and heads per stage
    tied to the stage count) with every stage kept at two blocks and an image its stages can halve; ``None`` for
    any other config. Shrinking its stage count like a layer count breaks those per-stage lists."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    depths = getattr(cfg, "depths", None)
    if not (isinstance(depths, (list, tuple)) and depths and all(isinstance(d, int) for d in depths)):
        return None
    cfg.depths = type(depths)([2] * len(depths))
    window = 1
    if isinstance(getattr(cfg, "window_size", None), int):  # Swin: 2 x 2 windows, a whole one in the last stage
        cfg.window_size = window = 2
    patch = getattr(cfg, "patch_size", None)
    if isinstance(patch, int) and "image_size" in cfg.to_dict():
        cfg.image_size = max(image_size, patch * window * 2 ** (len(depths) - 1))
    choose_attention(cfg)
    return cfg


def is_vision_type(model_type: str) -> bool:
    """Whether ``model_type``'s config describes an image encoder alone: image channels, no vocabulary, no
    text config (a transformers config fact, not a name)."""
    from transformers import AutoConfig

    try:
        d = AutoConfig.for_model(model_type).to_dict()
    except Exception:
        return False
    return "num_channels" in d and "vocab_size" not in d and "text_config" not in d
