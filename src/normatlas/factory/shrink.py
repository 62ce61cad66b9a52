"""The one shrink: a transformers config cut to a tiny model of the same architecture (offline, no download).

:func:`shrink` sets sizes where a config has them and fits its per-layer schedules to the new depth; it shrinks a
text stack (:func:`tiny_config`, :data:`TINY`), a vision tower inside an image-text model and a connector's own
config (:data:`VISION_TINY`, :mod:`.vlm`). The refits that follow a shrink are here too, shared by every part:
the layer indices and tap lists of a tower (:func:`refit_tower_layers`), the width fields that stated an original
width (:func:`fit_widths`), and the config rebuilt from its shrunk fields so that what it derives follows them
(:func:`rederived`). Every rule reads the config's own fields and numbers, never the model type's name.
"""

from __future__ import annotations

import contextlib
from typing import Any

from .attention import choose_attention

__all__ = [
    "ABSENT",
    "ALL_TYPES_HINT",
    "KV_SHARED_LAYER_COUNTS",
    "TINY",
    "TINY_ENCODER_DECODER",
    "VISION_TINY",
    "check_model_type",
    "config_parts",
    "field_of",
    "fit_widths",
    "inner_index",
    "is_encoder_decoder",
    "rederived",
    "refit_tower_layers",
    "shrink",
    "tiny_config",
]

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
    for c in config_parts(cfg):
        shrink(c, {**TINY, **(TINY_ENCODER_DECODER if is_encoder_decoder(c) else {}), **overrides})
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
    choose_attention(cfg)
    return cfg


def config_parts(cfg: Any) -> list[Any]:
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


def shrink(c: Any, sizes: dict[str, Any]) -> None:
    """Set ``sizes`` where ``c`` has them, then fit its per-layer schedules to the shrunk depth: every list with
    one entry per original layer is cut to the new depth (a size set above becomes one entry per layer), a hybrid
    keeps every layer kind and KV sharing (:data:`KV_SHARED_LAYER_COUNTS`) keeps a producer of each kind (widths stated
    as products of each other are refitted where the model does not run: :func:`.fit.build_running`)."""
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


ABSENT = object()


def field_of(c: Any, key: str) -> Any:
    """``c.key``, or :data:`ABSENT` where the config has none or refuses to give one (a per-layer attribute of
    a heterogeneous config raises rather than answer for every layer)."""
    try:
        return getattr(c, key, ABSENT)
    except Exception:
        return ABSENT


def rederived(cfg: Any, orig: Any, deliberate: set[str]) -> Any:
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
        now, was = field_of(cfg, key), field_of(orig, key)
        if key == "transformers_version" or now is ABSENT:
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
        now = field_of(cfg, key)
        if now is not ABSENT and field_of(rebuilt, key) != now:
            with contextlib.suppress(Exception):
                setattr(rebuilt, key, now)
    choose_attention(rebuilt)
    return rebuilt


# A tower's and a connector's shrunk sizes (set only where its config has the key): 2 layers, width 64, 4 heads.
VISION_TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_global_layers": 1,  # Mllama's second, gated encoder
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "embed_dim": 64,
    "depth": 2,
    "num_heads": 4,
}
TOWER_LAYER_LISTS = ("intermediate_layers_indices",)  # tower layer indices, refitted to the shrunk depth
TOWER_LAYER_INDEX = ("insert_layer_id",)  # one tower layer index (MiniCPM-V's window merger runs after it)
_TOWER_LAYER_SETS = ("global_attn_indexes",)  # tower layers of one kind (SAM's global-attention layers)
TOWER_DERIVED = ("vision_output_dim", "out_hidden_size", "intermediate_size")  # set by refit_tower_layers already
_WIDTH_SUFFIXES = ("_size", "_dim")
_NOT_WIDTHS = ("image", "patch", "vocab", "position", "window", "token", "batch", "chunk", "grid", "kernel", "pool")


def inner_index(index: int, before: int, depth: int) -> int:
    """A layer index of a ``before``-layer stack refitted to ``depth`` layers: at the same fraction of the stack,
    and strictly inside it (layers after it) when it was so before."""
    index %= before
    last = depth - 1 if index == before - 1 else max(0, depth - 2)
    return min(last, index * depth // before)


def refit_tower_layers(c: Any, before: dict[str, Any], odepth: int, depth: int) -> None:
    """A tower's fields that index its ``odepth`` layers (``before``: its fields unshrunk) refitted to ``depth``:
    its layer index (:data:`TOWER_LAYER_INDEX`) and layer sets at the same fraction of the shrunk stack
    (:func:`inner_index`), its tap lists (:data:`TOWER_LAYER_LISTS`) to every layer but the last, as the original
    taps inner ones, with the concatenated width they give (Mllama's ``intermediate_layers_indices`` and
    ``vision_output_dim``). The one refit of a standalone tower (:mod:`.tower`) and of an image-text model's
    (:mod:`.vlm`)."""
    for key in TOWER_LAYER_INDEX:
        val = before.get(key)
        if type(val) is int and 0 <= val < odepth:
            setattr(c, key, inner_index(val, odepth, depth))
    for key in _TOWER_LAYER_SETS:
        vals = before.get(key)
        if isinstance(vals, list) and vals and all(type(v) is int for v in vals):
            setattr(c, key, sorted({inner_index(v, odepth, depth) for v in vals}))
    for key in TOWER_LAYER_LISTS:
        if isinstance(field_of(c, key), list):
            taps = list(range(max(1, depth - 1)))
            with contextlib.suppress(Exception):
                setattr(c, key, taps)
                if type(field_of(c, "vision_output_dim")) is int:  # the last state and the taps, concatenated
                    c.vision_output_dim = c.hidden_size * (1 + len(taps))


def fit_widths(c: Any, before: dict[str, Any], widths: dict[int, int]) -> None:
    """A config's other width fields (``*_size`` / ``*_dim``: a projector's ``adapter_out_dim``, Kimi's
    ``projection_hidden_size``) that stated an original width, or k times one (k = 2..16: concatenated or merged
    rows), take the shrunk width (times k). Sizes of the image, patches, vocabulary and positions are left."""
    for key, val in before.items():
        if type(val) is not int or not key.endswith(_WIDTH_SUFFIXES) or any(w in key for w in _NOT_WIDTHS):
            continue
        if key in VISION_TINY or val <= 0:
            continue
        k = next((val // w for w in widths if val % w == 0 and 1 <= val // w <= 16), None)
        if k is not None:
            with contextlib.suppress(Exception):
                setattr(c, key, k * widths[next(w for w in widths if val == k * w)])
