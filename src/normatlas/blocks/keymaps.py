"""The two key maps left: HF's ViT and DINOv2 image classifiers to :class:`ViTEncoder`.

Language models are ported from their dataflow (:mod:`normatlas.port`, issue 24: no per-family table); the
vision classifiers (a patch convolution, a class token, a pooled head) are not read by that port yet, so these two
declarative maps remain until it is. Each :class:`KeyMap` pairs our parameter name with the HF one (``{i}`` is the
layer index) and reads the HF *config* into a :class:`ViTConfig`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..presets import LayerNorm
from .model import ModelConfig, ViTConfig, ViTPool
from .placement import layerscale, pre_ln

__all__ = ["KEYMAPS", "KeyMap", "Rule"]


@dataclass(frozen=True)
class Rule:
    """``ours`` <- ``theirs``; ``transpose`` first (Conv1D), then take chunk ``index`` of ``chunks`` along dim 0.

    ``optional`` rules are skipped when our model has no such parameter (e.g. biases off).
    """

    ours: str
    theirs: str
    transpose: bool = False
    chunks: int = 1
    index: int = 0
    optional: bool = False


@dataclass(frozen=True)
class KeyMap:
    """How one HF architecture maps onto ours. ``model_type`` is HF's ``config.model_type`` (a registry key)."""

    model_type: str
    hf_class: str
    config: Callable[[Any], ModelConfig]
    globals: tuple[Rule, ...]
    layer: tuple[Rule, ...]
    ignore: tuple[str, ...] = ()  # HF keys with no counterpart by design (non-persistent buffers etc.)


def _lin(ours: str, theirs: str, bias: bool | None = None, **kw: Any) -> tuple[Rule, ...]:
    """weight and (optional) bias rules of a linear layer."""
    return (
        Rule(f"{ours}.weight", f"{theirs}.weight", **kw),
        Rule(f"{ours}.bias", f"{theirs}.bias", optional=True, **kw),
    )


def _norm(ours: str, theirs: str) -> tuple[Rule, ...]:
    return (Rule(f"{ours}.weight", f"{theirs}.weight"), Rule(f"{ours}.bias", f"{theirs}.bias", optional=True))


def _vit_common(c: Any, **kw: Any) -> ViTConfig:
    if c.hidden_act != "gelu":
        raise ValueError(f"hidden_act={c.hidden_act!r} is not supported (only 'gelu')")
    eps = c.layer_norm_eps
    return ViTConfig(
        d_model=c.hidden_size, n_layers=c.num_hidden_layers, n_heads=c.num_attention_heads,
        norm=lambda d: LayerNorm(d, eps), qkv_bias=bool(c.qkv_bias), out_bias=True, mlp_bias=True,
        image_size=c.image_size, patch_size=c.patch_size, in_chans=c.num_channels, num_classes=c.num_labels, **kw,
    )  # fmt: skip


def _vit(c: Any) -> ViTConfig:
    return _vit_common(c, d_ff=c.intermediate_size, placement=pre_ln())


def _dinov2(c: Any) -> ViTConfig:
    if c.use_swiglu_ffn:
        raise ValueError("use_swiglu_ffn=True is not supported (the dinov2 key map covers the fc1/fc2 GELU MLP)")
    return _vit_common(
        c, d_ff=int(c.hidden_size * c.mlp_ratio), placement=layerscale(float(c.layerscale_value)),
        pool=ViTPool.CLS_AND_MEAN,
    )  # fmt: skip


def _vit_globals(p: str) -> tuple[Rule, ...]:
    return (
        Rule("cls_token", f"{p}.embeddings.cls_token"),
        Rule("pos_embed", f"{p}.embeddings.position_embeddings"),
        *_lin("patch_embed", f"{p}.embeddings.patch_embeddings.projection"),
        *_norm("final_norm", f"{p}.layernorm"),
        *_lin("head", "classifier"),
    )


def _vit_attn(p: str) -> tuple[Rule, ...]:
    return tuple(
        r for n in ("q", "k", "v", "o") for r in _lin(f"layers.{{i}}.attn.{n}_proj", f"{p}.attention.{n}_proj")
    )


_V, _D = "vit.layers.{i}", "dinov2.encoder.layer.{i}"

KEYMAPS: dict[str, KeyMap] = {
    m.model_type: m
    for m in (
        KeyMap(
            "vit",
            "ViTForImageClassification",
            _vit,
            _vit_globals("vit"),
            (
                *_norm("layers.{i}.attn_pre_norm", f"{_V}.layernorm_before"),
                *_vit_attn(_V),
                *_norm("layers.{i}.ffn_pre_norm", f"{_V}.layernorm_after"),
                *_lin("layers.{i}.mlp.up_proj", f"{_V}.mlp.fc1"),
                *_lin("layers.{i}.mlp.down_proj", f"{_V}.mlp.fc2"),
            ),
        ),
        KeyMap(
            "dinov2",
            "Dinov2ForImageClassification",
            _dinov2,
            _vit_globals("dinov2"),
            (
                *_norm("layers.{i}.attn_pre_norm", f"{_D}.norm1"),
                *_vit_attn(_D),
                Rule("layers.{i}.attn_residual.gate.gamma", f"{_D}.layer_scale1.lambda1"),  # LayerScale
                *_norm("layers.{i}.ffn_pre_norm", f"{_D}.norm2"),
                *_lin("layers.{i}.mlp.up_proj", f"{_D}.mlp.fc1"),
                *_lin("layers.{i}.mlp.down_proj", f"{_D}.mlp.fc2"),
                Rule("layers.{i}.ffn_residual.gate.gamma", f"{_D}.layer_scale2.lambda1"),
            ),
            ("embeddings.mask_token",),  # used only for masked-image pretraining inputs (bool_masked_pos)
        ),
    )
}
