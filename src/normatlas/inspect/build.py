"""Turn a TARGET into (model, example inputs): a transformers model type built tiny
from its config class (offline, random weights), a local checkpoint folder
(config.json + safetensors), or ``module.path:factory``.

Models are built as a user's ``from_config`` / ``from_pretrained`` builds them: with transformers' default
attention implementation (``sdpa`` where the model supports it), unless one is chosen
(:func:`attention_implementation`, the CLI's ``--attn-implementation``)."""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import inspect as pyinspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import PICKLE_SUFFIXES
from .build_fit import build_running

__all__ = [
    "ATTENTION_IMPLEMENTATIONS",
    "KV_SHARED_LAYER_COUNTS",
    "TINY",
    "TINY_ENCODER_DECODER",
    "attention_implementation",
    "attention_kwargs",
    "build_target",
    "build_vision",
    "check_model_type",
    "example_inputs",
    "is_encoder_decoder",
    "tiny_config",
]

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")
"""The attention implementations a build may be asked for (None: transformers' default for the model)."""
_ATTENTION: contextvars.ContextVar[str | None] = contextvars.ContextVar("normatlas_attention", default=None)


@contextlib.contextmanager
def attention_implementation(name: str | None) -> Iterator[None]:
    """Build models inside this block with attention implementation ``name`` (one of
    :data:`ATTENTION_IMPLEMENTATIONS`; None: transformers' default, as ``from_pretrained`` picks it)."""
    if name is not None and name not in ATTENTION_IMPLEMENTATIONS:
        allowed = ", ".join(ATTENTION_IMPLEMENTATIONS)
        raise ValueError(f"attn_implementation={name!r} is not one of {allowed} (or None: transformers' default)")
    token = _ATTENTION.set(name)
    try:
        yield
    finally:
        _ATTENTION.reset(token)


def attention_kwargs() -> dict[str, str]:
    """``from_config``'s keyword for the chosen attention implementation ({} for transformers' default)."""
    name = _ATTENTION.get()
    return {} if name is None else {"attn_implementation": name}


def _choose_attention(cfg: Any) -> None:
    name = _ATTENTION.get()
    if name is not None:
        cfg._attn_implementation = name


# Shrunk sizes (litgpt-style: keep the architecture, shrink the widths). Originals are
# thousands wide and tens of layers deep; each key is set only where the config has it.
TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "n_positions": 64,
    "n_inner": 128,
    "ffn_dim": 128,
    "ffn_hidden_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "sliding_window": 16,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "topk_group": 1,
    "rotary_dim": 16,
    "word_embed_proj_dim": 64,
    "vocab_size_per_layer_input": 128,
    "hidden_size_per_layer_input": 16,
}

# The encoder-decoder sizes (each stack's depth, heads and MLP width under the names encoder-decoder configs give
# them: BART's ``encoder_layers`` / ``decoder_layers``, T5's ``num_layers`` / ``num_decoder_layers`` / ``d_ff``),
# set only on a config that says ``is_encoder_decoder`` (a decoder-only config's ``num_layers`` may be a section).
TINY_ENCODER_DECODER: dict[str, Any] = {
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_layers": 2,
    "num_encoder_layers": 2,
    "num_decoder_layers": 2,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "d_ff": 128,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_heads": 4,
    "d_kv": 16,
    "attention_window": 8,  # LED pads its encoder batch to a multiple of it
    "max_source_positions": 32,  # Whisper's encoder reads exactly twice as many feature frames
}

# Config fields that state a feature input's channels (an audio encoder's mel bins or filterbank features), tried
# as the channel axis of a float main input; the layout that runs is kept.
_FEATURE_CHANNELS = ("num_mel_bins", "input_feat_per_channel", "feature_size", "num_channels", "input_dim")


# The one model-specific rule of the shrink, as data: config fields counting the trailing layers that reuse the
# key/value cache of the last earlier layer of their kind (Gemma 3n's ``num_kv_shared_layers``, 15 of its 35 layers).
# ``kv_sharing_modes`` raises unless every kind that reuses has a producer before the shared block, which 2 layers
# cannot give a hybrid: the tiny model keeps one period of layer kinds producing the cache and one reusing it
# (depth 2 x kinds, the last ``kinds`` layers shared).
KV_SHARED_LAYER_COUNTS = ("num_kv_shared_layers",)


ALL_TYPES_HINT = "all: python -c 'import transformers; print(sorted(transformers.CONFIG_MAPPING))'"


def check_model_type(model_type: str, what: str = "not a transformers model type", examples: str = "") -> None:
    """A ValueError of one short line unless transformers registers ``model_type``: the closest known types (at
    most three) and how to list them all, never the whole list (transformers' own message has 450 names)."""
    import difflib

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return
    close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3, cutoff=0.6)
    like = f"; did you mean {', '.join(close)}?" if close else f"; e.g. {examples}" if examples else ""
    raise ValueError(f"unknown model type {model_type!r}: {what}{like} ({ALL_TYPES_HINT})")


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """The config class of ``model_type`` with its defaults, shrunk (offline, no download)."""
    from transformers import AutoConfig

    check_model_type(model_type, "not a transformers model type, a folder or module:factory")
    cfg = AutoConfig.for_model(model_type)
    for c in _parts(cfg):
        _shrink(c, {**TINY, **(TINY_ENCODER_DECODER if is_encoder_decoder(c) else {}), **overrides})
        if "qk_rope_head_dim" in c.to_dict() and "head_dim" in c.to_dict():  # MLA: rotary part sets head_dim
            with contextlib.suppress(Exception):
                c.head_dim = c.qk_rope_head_dim
                c.num_key_value_heads = c.num_attention_heads
        _fit_mrope(c)
        if "vocabulary_map" in c.to_dict() and not c.vocabulary_map:  # Chameleon needs its image-token map
            c.vocabulary_map = {"<image>": 3}
        vocab = getattr(c, "vocab_size", None)
        for tok in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            tid = getattr(c, tok, None)
            if isinstance(vocab, int) and isinstance(tid, int) and tid >= vocab:
                with contextlib.suppress(Exception):
                    setattr(c, tok, min(2, vocab - 1))
    _choose_attention(cfg)
    return cfg


def _parts(cfg: Any) -> list[Any]:
    """The configs to shrink: the model's, its ``text_config``, and every nested sub-config that is a part of each
    layer: the same width (its ``hidden_size`` mirrors the model's: DBRX's ``ffn_config``, the experts reading
    and writing the stream) and no layer stack of its own. A tower (a vision or audio encoder) keeps its sizes."""
    text = getattr(cfg, "text_config", None)
    parts = [cfg] + ([text] if text is not None and text is not cfg else [])
    if is_encoder_decoder(cfg):  # an encoder-decoder's stacks as sub-configs of their own (T5Gemma's encoder, decoder)
        subs = [getattr(cfg, k, None) for k in getattr(cfg, "sub_configs", None) or {}]
        parts += [s for s in subs if s is not None and getattr(s, "num_hidden_layers", None) is not None]
    for base in list(parts):
        width = getattr(base, "hidden_size", None)
        for key in getattr(base, "sub_configs", None) or {}:
            sub = getattr(base, key, None)
            if sub is None or any(sub is p for p in parts) or not isinstance(width, int):
                continue
            if getattr(sub, "hidden_size", None) == width and getattr(sub, "num_hidden_layers", None) is None:
                parts.append(sub)
    return parts


def _shrink(c: Any, sizes: dict[str, Any]) -> None:
    """Set ``sizes`` where ``c`` has them, then fit its per-layer schedules to the shrunk depth: every list with
    one entry per original layer is cut to the new depth (a size set above becomes one entry per layer), a hybrid
    keeps every layer kind and KV sharing (:data:`KV_SHARED_LAYER_COUNTS`) keeps a producer of each kind (widths stated
    as products of each other are refitted where the model does not run: :func:`.build_fit.build_running`)."""
    before = c.to_dict()
    depth = getattr(c, "num_hidden_layers", None)
    for key, val in sizes.items():
        if key in before or key in getattr(c, "attribute_map", {}) or _settable_property(c, key):
            with contextlib.suppress(Exception):  # some configs guard their attributes
                setattr(c, key, val)
    n = _fit_sections(c, depth, getattr(c, "num_hidden_layers", None))
    types = getattr(c, "layer_types", None)
    if isinstance(types, list):
        n = n if isinstance(n, int) else len(types)
        kinds = list(dict.fromkeys(types))  # keep every layer kind of a hybrid in the tiny model
        shared = [k for k in KV_SHARED_LAYER_COUNTS if isinstance(before.get(k), int) and before[k] > 0]
        if shared:
            n = max(n, 2 * len(kinds))
            with contextlib.suppress(Exception):
                c.num_hidden_layers = n
                for k in shared:
                    setattr(c, k, len(kinds))
        with contextlib.suppress(Exception):  # a read-only property on some hybrid configs
            c.layer_types = (kinds * n)[:n] if len(kinds) <= n else types[:n]
    if not (isinstance(depth, int) and isinstance(n, int) and n < depth):
        return
    for key, val in before.items():
        if key != "layer_types" and isinstance(val, list) and len(val) == depth:
            now = getattr(c, key, None)
            with contextlib.suppress(Exception):
                setattr(c, key, now[:n] if isinstance(now, list) else [now] * n)


def _settable_property(c: Any, key: str) -> bool:
    """A size the config derives from another field through a property with a setter (LongCat-Flash's
    ``num_hidden_layers``, twice its ``num_layers``): not in ``to_dict``, still the size to shrink."""
    prop = getattr(type(c), key, None)
    return isinstance(prop, property) and prop.fset is not None


def _fit_sections(c: Any, depth: Any, n: Any) -> Any:
    """Layer counts that partition the stack into sections (they sum to the original depth: Dory's input /
    recurrent / output layers, 8 + 20 + 8 of 36) are cut with it, one layer each at least (the depth grows to the
    number of sections where it must); the new depth is returned. Read off the attributes, not ``to_dict`` (which
    may serialise another layout)."""
    if not (isinstance(depth, int) and isinstance(n, int) and n < depth) or is_encoder_decoder(c):
        return n  # an encoder-decoder's ``*_layers`` are its stacks' depths, not sections of one stack
    counts = {
        k: v
        for k, v in vars(c).items()
        if k.endswith("_layers") and k != "num_hidden_layers" and type(v) is int and 0 < v < depth
    }
    if len(counts) < 2 or sum(counts.values()) != depth:
        return n
    n = max(n, len(counts))
    widest = max(counts, key=lambda k: counts[k])
    with contextlib.suppress(Exception):
        c.num_hidden_layers = n
        for k in counts:
            setattr(c, k, 1 + (n - len(counts) if k == widest else 0))
    return n


def _fit_mrope(c: Any) -> None:
    """Multimodal RoPE splits the rotary half-width into (time, height, width) sections that must sum to it; the
    config names ``mrope_section`` among its rope keys, the sizes live in the modeling code, so re-split the shrunk
    half-width evenly."""
    rope = getattr(c, "rope_parameters", None)
    if not isinstance(rope, dict) or "mrope_section" not in (getattr(c, "ignore_keys_at_rope_validation", None) or ()):
        return
    with contextlib.suppress(Exception):
        head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        factor = rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None) or 1.0)
        half = int(head * factor) // 2
        parts = len(rope.get("mrope_section") or [0, 0, 0])
        if half >= parts and sum(rope.get("mrope_section") or []) != half:
            rope["mrope_section"] = [half // parts + (i < half % parts) for i in range(parts)]


def is_encoder_decoder(cfg: Any) -> bool:
    """Whether a config says its model is an encoder and a decoder (``is_encoder_decoder``)."""
    return getattr(cfg, "is_encoder_decoder", False) is True


def _model_from_config(cfg: Any) -> nn.Module:
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

    if is_encoder_decoder(cfg):  # both stacks: a causal-LM class of an encoder-decoder type is its decoder alone
        for auto in (AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq, AutoModel):
            with contextlib.suppress(ValueError, KeyError):
                return auto.from_config(cfg, **attention_kwargs()).eval()
    try:
        model = AutoModelForCausalLM.from_config(cfg, **attention_kwargs())
    except (ValueError, KeyError):
        model = AutoModel.from_config(cfg, **attention_kwargs())
    return model.eval()


def _model_for_checkpoint(cfg: Any) -> nn.Module:
    """The class the checkpoint names in ``config.architectures`` (else the base AutoModel)."""
    import transformers
    from transformers import AutoModel

    for arch in getattr(cfg, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls(cfg).eval()
    return AutoModel.from_config(cfg, **attention_kwargs()).eval()


def _matching(model: nn.Module, state: dict[str, torch.Tensor], none: str) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` that fit ``model`` (by name, with or without its base-model prefix, and shape), under
    the model's own names; a ValueError ``none`` when not one does. Works with meta tensors and models."""
    own = model.state_dict()
    prefix = getattr(model, "base_model_prefix", "")
    remapped = {}
    for k, v in state.items():
        key = k if k in own else f"{prefix}.{k}" if f"{prefix}.{k}" in own else k.split(".", 1)[-1]
        if key in own and own[key].shape == v.shape:
            remapped[key] = v
    if not remapped:
        raise ValueError(none)
    return remapped


def example_inputs(model: nn.Module, seq: int = 8, seed: int = 0) -> dict[str, Any]:
    """A token batch ``{"input_ids": (1, seq)}`` valid for the model's vocabulary; a model whose ``forward`` takes
    ``decoder_input_ids`` (an encoder-decoder) gets a decoder batch beside it, of the same length (both stacks'
    streams then have one shape; a reader of two shapes is :func:`.residual.find_stream`'s)."""
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None) or getattr(getattr(cfg, "text_config", None), "vocab_size", 128)
    gen = torch.Generator().manual_seed(seed)
    high = max(4, min(int(vocab or 128), 1000))
    inputs: dict[str, Any] = {"input_ids": torch.randint(3, high, (1, seq), generator=gen)}
    with contextlib.suppress(TypeError, ValueError):
        params = pyinspect.signature(model.forward).parameters
        if "decoder_input_ids" in params:
            inputs["decoder_input_ids"] = torch.randint(3, high, (1, seq), generator=gen)
        if "use_cache" in params:
            inputs["use_cache"] = False
        main = getattr(model, "main_input_name", "input_ids")
        if main != "input_ids" and main in params and "decoder_input_ids" in params:  # a speech encoder's features
            features = _feature_input(model, main, {k: v for k, v in inputs.items() if k != "input_ids"}, gen)
            if features is not None:
                inputs = {
                    main: features,
                    **{k: v for k, v in inputs.items() if k != "input_ids"},
                }  # hybrid / linear-attention caches need not be built to read the design
    return inputs


def _feature_input(model: nn.Module, name: str, rest: dict[str, Any], gen: torch.Generator) -> torch.Tensor | None:
    """A float main input (``input_features``) in the first layout that runs: ``(1, C, L)`` or ``(1, L, C)``, C a
    channel count its config states (:data:`_FEATURE_CHANNELS`, times ``input_channels`` where it has one), L twice
    or once the encoder's ``max_source_positions`` (Whisper reads exactly that many frames), else 64 frames."""
    cfg = getattr(model, "config", None)
    sub = getattr(cfg, "encoder_config", None) or getattr(cfg, "encoder", None)
    confs = [c for c in (cfg, sub) if c is not None and hasattr(c, "to_dict")]
    chans = [v for c in confs for k in _FEATURE_CHANNELS if type(v := getattr(c, k, None)) is int and v > 0]
    chans += [v * k for c in confs if type(v := getattr(c, "input_feat_per_channel", None)) is int
              if type(k := getattr(c, "input_channels", None)) is int and k > 1]  # fmt: skip
    src = [v for c in confs if type(v := getattr(c, "max_source_positions", None)) is int and 0 < v <= 512]
    lengths = [m * src[0] for m in (2, 1)] if src else []
    for c in dict.fromkeys(chans):
        for n in dict.fromkeys([*lengths, 64]):
            for shape in ((1, c, n), (1, n, c)):
                x = torch.randn(shape, generator=gen)
                try:
                    with torch.no_grad():
                        model(**{name: x}, **rest)
                except Exception:
                    continue
                return x
    return None


def build_target(target: str, seed: int = 0, attn_implementation: str | None = None) -> tuple[nn.Module, Any, str]:
    """(model, example inputs, display name) for a CLI TARGET; a transformers model is built with
    ``attn_implementation`` (None: the one chosen by :func:`attention_implementation`, else transformers' default)."""
    if attn_implementation is not None:
        with attention_implementation(attn_implementation):
            return build_target(target, seed)
    torch.manual_seed(seed)
    path = Path(target)
    if path.is_dir():
        from transformers import AutoConfig

        from ..checkpoint import check_build_memory, header_tensors, locate, on_meta, read_tensors

        ckpt = locate(path, weights=False)  # the one load policy: config.json as JSON, safetensors only
        cfg = AutoConfig.from_pretrained(str(path))
        _choose_attention(cfg)
        files = ckpt.files
        meta = on_meta(lambda: _model_for_checkpoint(cfg))  # sizes first: no memory, no initialisation
        if meta is not None:
            if files:
                _matching(meta, header_tensors(ckpt), f"{target}: no tensor in the safetensors files matches the "
                          f"{cfg.model_type} model")  # fmt: skip
            check_build_memory(meta, target, weights=sum(f.stat().st_size for f in files))
        model = _model_for_checkpoint(cfg)
        if files:
            state, _ = read_tensors(ckpt)
            remapped = _matching(model, state, f"{target}: no tensor in the safetensors files matches the "
                                 f"{cfg.model_type} model")  # fmt: skip
            model.load_state_dict(remapped, strict=False)
            loaded = f"{len(remapped)}/{len(model.state_dict())} tensors from {len(files)} safetensors file(s)"
        else:
            loaded = "no safetensors: random weights"
        return model.eval(), example_inputs(model, seed=seed), f"{cfg.model_type} ({path.name}; {loaded})"
    if ":" in target and not path.exists():
        mod_name, _, attr = target.partition(":")
        try:
            factory = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot import {target!r}: {exc}") from exc
        built = factory()
        model, inputs = built if isinstance(built, tuple) else (built, None)
        if not isinstance(model, nn.Module):
            raise TypeError(f"{target} returned {type(model).__name__}, expected an nn.Module or (module, inputs)")
        if inputs is None:
            if hasattr(model, "example_inputs"):
                inputs = model.example_inputs()  # type: ignore[operator]
            elif hasattr(model, "config"):
                inputs = example_inputs(model, seed=seed)
            else:
                raise ValueError(f"{target}: return (module, example_inputs) or give the module example_inputs()")
        return model.eval(), inputs, target
    if path.is_file() and path.suffix.lower() in PICKLE_SUFFIXES:
        from ..checkpoint import locate

        locate(path)  # refuses the pickle with the load policy's message
    if path.exists():
        raise FileNotFoundError(f"{target}: not a folder (need a checkpoint folder with config.json)")
    from transformers import AutoConfig

    cfg = tiny_config(target)
    orig = AutoConfig.for_model(target)
    parts = list(zip(_parts(cfg), (p.to_dict() for p in _parts(orig)), strict=False))
    model = build_running(cfg, parts, set(TINY), _model_from_config, _runs, lambda c: _rederived_shrink(c, orig))
    return model, None, target


def _rederived_shrink(cfg: Any, orig: Any) -> Any:
    """``cfg`` built again from its shrunk fields (:func:`_rederived`), keeping what the shrink set: the sizes of
    :data:`TINY` (under the names the config's ``attribute_map`` gives them) and the per-layer lists it cut."""
    aliases = getattr(cfg, "attribute_map", {}) or {}
    was = orig.to_dict()
    cut = {k for k, v in cfg.to_dict().items() if isinstance(v, list) and v != was.get(k)}
    return _rederived(cfg, orig, set(TINY) | {aliases[k] for k in TINY if k in aliases} | cut)


def _runs(model: nn.Module) -> bool:
    """Whether ``model`` runs one forward on its example inputs."""
    try:
        with torch.no_grad():
            model(**example_inputs(model))
    except Exception:
        return False
    return True


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
    return _rederived(cfg, orig, deliberate)


_ABSENT = object()


def _get(c: Any, key: str) -> Any:
    """``c.key``, or :data:`_ABSENT` where the config has none or refuses to give one (a per-layer attribute of
    a heterogeneous config raises rather than answer for every layer)."""
    try:
        return getattr(c, key, _ABSENT)
    except Exception:
        return _ABSENT


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
        was, now = _get(orig, key), _get(cfg, key)
        if type(was) is int and type(now) is int and was < now:
            put(key, was)
    width0, width = _get(orig, "hidden_size"), _get(cfg, "hidden_size")
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
    depth0, depth = _get(orig, "num_hidden_layers"), _get(cfg, "num_hidden_layers")
    if type(depth0) is int and type(depth) is int and 0 < depth < depth0:
        for key, was in vars(orig).items():
            if (
                key.endswith("_blocks")  # a ``*_layers`` count may be a stack of its own (Mllama's global layers)
                and type(was) is int
                and depth <= was < depth0
                and _get(cfg, key) == was
            ):
                put(key, max(1, depth - 1))
    touched |= _fit_indices_and_widths(cfg, orig)
    stride, patch0, patch = _get(orig, "output_stride"), _get(orig, "patch_size"), _get(cfg, "patch_size")
    if type(stride) is int and type(patch0) is int and type(patch) is int:
        put("patch_size", min(patch, patch0))
        if type(_get(cfg, "image_size")) is int:
            put("image_size", max(image_size, stride * cfg.patch_size))
    return touched


def _fit_indices_and_widths(cfg: Any, orig: Any) -> set[str]:
    """The tower's fields that index its layers or state its width, refitted as an image-text model's tower is
    (:mod:`.vlm_build`): layer indices and sets at the same fraction of the shrunk stack, tap lists to every layer
    but the last with the concatenated width they give (Mllama's ``intermediate_layers_indices`` and
    ``vision_output_dim``), and the ``*_size`` / ``*_dim`` fields that stated the original width (or k times it)
    at the shrunk one (Dots3's ``adapter_in_dim``). The fields changed are returned."""
    from .vlm_build import _TOWER_DERIVED, _TOWER_LAYER_LISTS, _fit_layer_indices, _fit_widths

    before, was = orig.to_dict(), cfg.to_dict()
    depth0, depth = _get(orig, "num_hidden_layers"), _get(cfg, "num_hidden_layers")
    if type(depth0) is int and type(depth) is int:
        _fit_layer_indices(cfg, before, depth0, depth)
        for key in _TOWER_LAYER_LISTS:
            if isinstance(_get(cfg, key), list):
                taps = list(range(max(1, depth - 1)))  # every layer but the last, as the original taps inner ones
                with contextlib.suppress(Exception):
                    setattr(cfg, key, taps)
                    if type(_get(cfg, "vision_output_dim")) is int:  # the last state and the taps, concatenated
                        cfg.vision_output_dim = cfg.hidden_size * (1 + len(taps))
    width0, width = _get(orig, "hidden_size"), _get(cfg, "hidden_size")
    if type(width0) is int and type(width) is int and width < width0:
        _fit_widths(cfg, {k: v for k, v in before.items() if k not in _TOWER_DERIVED}, {width0: width})
    now = cfg.to_dict()
    return {k for k in now if now[k] != was.get(k)}


def _rederived(cfg: Any, orig: Any, deliberate: set[str]) -> Any:
    """``cfg`` built again from the fields that differ from the original (``orig``), less the ones the config
    derives (its ``__post_init__`` set them from their default) and the shrink did not set on purpose: those are
    derived again from the shrunk fields. Sub-configs are passed as they are, and a size set on purpose that is no
    field of the config is set again after; ``cfg`` itself when the config is not a dataclass or refuses the fields."""
    import dataclasses

    if not dataclasses.is_dataclass(type(cfg)):
        return cfg
    defaults = {f.name: f.default for f in dataclasses.fields(type(cfg)) if f.init}
    subs = getattr(cfg, "sub_configs", None) or {}
    kwargs: dict[str, Any] = {}
    for key, default in defaults.items():
        now, was = _get(cfg, key), _get(orig, key)
        if key == "transformers_version" or now is _ABSENT:
            continue
        if key in subs:
            kwargs[key] = now
            continue
        if now == was:
            continue
        derived = default is not dataclasses.MISSING and default != was
        if not derived or key in deliberate:
            kwargs[key] = now
    try:
        rebuilt = type(cfg)(**kwargs)
    except Exception:  # a config validating its fields together: the shrink as it stands
        return cfg
    for key in deliberate - set(defaults):  # a size set on purpose the config does not take (EfficientNet's depth)
        now = _get(cfg, key)
        if now is not _ABSENT and _get(rebuilt, key) != now:
            with contextlib.suppress(Exception):
                setattr(rebuilt, key, now)
    _choose_attention(rebuilt)
    return rebuilt


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
    _choose_attention(cfg)
    return cfg


def load_config_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
