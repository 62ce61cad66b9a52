"""Transformer blocks whose norm placement is a value.

``Placement`` says where the norms sit; one ``Block`` reads it; ``TransformerLM`` and
``ViTEncoder`` stack blocks from a ``ModelConfig``. Porting a transformers model into them
(``from_hf``, ``to_hf_state_dict``) is :mod:`normatlas.port`'s, a layer above this one.
"""

from typing import Any

from . import qknorm as _qknorm
from .alibi import Alibi, geometric_slopes
from .attention import Attention, Rope, RopeStyle, apply_rope, rope_tables
from .block import Block
from .mlp import MLP, Activation
from .model import ModelConfig, TransformerLM, ViTConfig, ViTEncoder, ViTPool, as_factory
from .moe import MoE, MoEConfig, RouterScore
from .placement import (
    DepthScale,
    Gate,
    LayerPlan,
    NormFactory,
    Placement,
    Schedule,
    Sublayer,
    deepnorm,
    depth_scaled_sandwich,
    hybridnorm,
    hybridnorm_star,
    layernorm_scaling,
    layerscale,
    mix_ln,
    norm_free,
    parallel,
    peri_ln,
    post_ln,
    pre_ln,
    reordered_norm,
    res_post_norm,
    rezero,
    sandwich_ln,
    scaled_residual,
    skipinit,
)
from .qknorm import QK_OPERATORS, QKGain, QKNorm, QKNormConfig, QKScope
from .residual import DeepNormArch, DeepNormConstants, LayerScale, ResidualAdd, ReZero, SkipInit, deepnorm_constants

PRESETS = {
    f.__name__: f
    for f in (
        post_ln, pre_ln, sandwich_ln, res_post_norm, reordered_norm, peri_ln, hybridnorm,
        layernorm_scaling, depth_scaled_sandwich, parallel, rezero, skipinit, layerscale, norm_free,
    )
}  # fmt: skip
"""Presets that take no required argument (deepnorm, scaled_residual, mix_ln, hybridnorm_star take depth/values)."""

__all__ = [
    "MLP", "PRESETS", "QK_OPERATORS", "Activation", "Alibi", "Attention", "Block", "DeepNormArch", "DeepNormConstants",
    "DepthScale", "Gate", "LayerPlan", "LayerScale", "MoE", "MoEConfig", "ModelConfig", "NormFactory",
    "Placement", "QKGain", "QKNorm", "QKNormConfig", "QKScope", "ReZero", "ResidualAdd", "Rope",
    "RopeStyle", "RouterScore", "Schedule", "SkipInit", "Sublayer", "TransformerLM", "ViTConfig", "ViTEncoder",
    "ViTPool",
    "apply_rope", "as_factory", "deepnorm", "deepnorm_constants", "depth_scaled_sandwich",
    "geometric_slopes", "hybridnorm", "hybridnorm_star", "layernorm_scaling", "layerscale", "mix_ln", "norm_free",
    "parallel", "peri_ln", "post_ln", "pre_ln", "reordered_norm", "res_post_norm", "rezero", "rope_tables",
    "sandwich_ln", "scaled_residual", "skipinit",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    """``QKOperator``, deprecated (a DeprecationWarning): QK-norm's operators are :class:`~normatlas.Operator`'s."""
    if name == "QKOperator":
        return _qknorm.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
