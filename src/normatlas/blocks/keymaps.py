"""Declarative key maps from HF transformers reference models to :class:`TransformerLM` and :class:`ViTEncoder`.

Each :class:`KeyMap` is data: rules pairing our parameter name with the HF one
(``{i}`` is the layer index), with the one transform a tensor needs (transpose for
GPT-2's Conv1D, a chunk of a fused q/k/v or gate/up projection), plus a function
that reads the HF *config* into a :class:`ModelConfig`. What a norm slot means is
stated here from each model's dataflow, never inferred from a parameter name:
HF's ``post_attention_layernorm`` is the pre-FFN norm in Llama (``ffn_pre_norm``)
but the post-attention-branch norm in OLMo 2 and Gemma 2 (``attn_post_norm``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..presets import GemmaRMSNorm, LayerNorm, RMSNorm
from ..spec import CastOrder
from .attention import Rope, RopeStyle
from .block import Activation
from .model import ModelConfig, ViTConfig, ViTPool
from .placement import layerscale, parallel, peri_ln, post_ln, pre_ln, reordered_norm, sandwich_ln
from .qknorm import QKGain, QKNormConfig, QKOperator, QKScope

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


def _attn(prefix: str) -> tuple[Rule, ...]:
    p = f"{prefix}.self_attn"
    return (
        *_lin("layers.{i}.attn.q_proj", f"{p}.q_proj"),
        *_lin("layers.{i}.attn.k_proj", f"{p}.k_proj"),
        *_lin("layers.{i}.attn.v_proj", f"{p}.v_proj"),
        *_lin("layers.{i}.attn.o_proj", f"{p}.o_proj"),
        Rule("layers.{i}.attn.q_norm.weight", f"{p}.q_norm.weight", optional=True),
        Rule("layers.{i}.attn.k_norm.weight", f"{p}.k_norm.weight", optional=True),
    )


def _mlp(prefix: str) -> tuple[Rule, ...]:
    p = f"{prefix}.mlp"
    return (
        *_lin("layers.{i}.mlp.gate_proj", f"{p}.gate_proj"),
        *_lin("layers.{i}.mlp.up_proj", f"{p}.up_proj"),
        *_lin("layers.{i}.mlp.down_proj", f"{p}.down_proj"),
    )


def _norm(ours: str, theirs: str) -> tuple[Rule, ...]:
    return (Rule(f"{ours}.weight", f"{theirs}.weight"), Rule(f"{ours}.bias", f"{theirs}.bias", optional=True))


_L = "model.layers.{i}"
_DECODER_GLOBALS = (
    Rule("embed.weight", "model.embed_tokens.weight"),
    *_norm("final_norm", "model.norm"),
    Rule("lm_head.weight", "lm_head.weight"),
)
_IGNORE_ROPE = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")


def _theta(c: Any, layer_type: str | None = None) -> float:
    rp = c.rope_parameters
    if layer_type is not None and layer_type in rp:
        rp = rp[layer_type]
    if rp.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type={rp.get('rope_type')!r} is not supported (only 'default')")
    return float(rp["rope_theta"])


def _common(c: Any, **kw: Any) -> ModelConfig:
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    base: dict[str, Any] = dict(
        vocab_size=c.vocab_size, d_model=c.hidden_size, n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads, head_dim=head_dim,
        d_ff=c.intermediate_size, tie_embeddings=bool(c.tie_word_embeddings),
    )  # fmt: skip
    base.update(kw)
    if "rope" not in kw:
        base["rope"] = Rope(theta=_theta(c))
    return ModelConfig(**base)


def _llama(c: Any) -> ModelConfig:
    eps = c.rms_norm_eps
    return _common(
        c, norm=lambda d: RMSNorm(d, eps, cast_order=CastOrder.BEFORE_GAIN), placement=pre_ln(),
        qkv_bias=c.attention_bias, out_bias=c.attention_bias, mlp_bias=c.mlp_bias,
    )  # fmt: skip


def _qwen3(c: Any) -> ModelConfig:
    eps = c.rms_norm_eps
    return _common(
        c, norm=lambda d: RMSNorm(d, eps, cast_order=CastOrder.BEFORE_GAIN), placement=pre_ln(),
        qkv_bias=c.attention_bias, out_bias=c.attention_bias,
        qk_norm=QKNormConfig(QKOperator.RMS, QKScope.HEAD, QKGain.SHARED, eps=eps),
        layer_windows=_windows(c),
    )  # fmt: skip


def _windows(c: Any) -> tuple[int | None, ...] | None:
    types = getattr(c, "layer_types", None)
    if not types or getattr(c, "sliding_window", None) is None or not getattr(c, "use_sliding_window", True):
        return None
    return tuple(c.sliding_window if t == "sliding_attention" else None for t in types)


def _gemma(c: Any, qk: bool) -> ModelConfig:
    eps = c.rms_norm_eps
    thetas = None
    if isinstance(c.rope_parameters, dict) and "full_attention" in c.rope_parameters:
        thetas = tuple(_theta(c, t) for t in c.layer_types)
    return _common(
        c, norm=lambda d: GemmaRMSNorm(d, eps), placement=peri_ln(), activation=Activation.GELU_TANH,
        embed_scale=c.hidden_size**0.5, attn_scale=c.query_pre_attn_scalar**-0.5,
        attn_softcap=c.attn_logit_softcapping, logit_softcap=c.final_logit_softcapping,
        qkv_bias=c.attention_bias, out_bias=c.attention_bias, layer_windows=_windows(c),
        rope=Rope(theta=thetas[0]) if thetas else Rope(theta=_theta(c)), layer_rope_theta=thetas,
        qk_norm=QKNormConfig(QKOperator.RMS, QKScope.HEAD, QKGain.SHARED, zero_centred=True, eps=eps) if qk else None,
    )  # fmt: skip


def _olmo2(c: Any) -> ModelConfig:
    eps = c.rms_norm_eps
    return _common(
        c, norm=lambda d: RMSNorm(d, eps), placement=reordered_norm(),
        qkv_bias=c.attention_bias, out_bias=c.attention_bias,
        qk_norm=QKNormConfig(QKOperator.RMS, QKScope.FLAT, QKGain.PER_HEAD, eps=eps),
    )  # fmt: skip


def _cohere(c: Any) -> ModelConfig:
    eps = c.layer_norm_eps
    qk = QKNormConfig(QKOperator.LAYERNORM, QKScope.HEAD, QKGain.PER_HEAD, eps=eps) if c.use_qk_norm else None
    return _common(
        c, norm=lambda d: LayerNorm(d, eps, bias=False), placement=parallel(shared_pre_norm=True),
        qkv_bias=c.attention_bias, out_bias=c.attention_bias, logit_scale=c.logit_scale, qk_norm=qk,
        rope=Rope(theta=_theta(c), style=RopeStyle.INTERLEAVED),
    )  # fmt: skip


def _glm4(c: Any) -> ModelConfig:
    eps = c.rms_norm_eps
    frac = float(c.rope_parameters.get("partial_rotary_factor", 1.0))
    return _common(
        c, norm=lambda d: RMSNorm(d, eps, cast_order=CastOrder.BEFORE_GAIN), placement=sandwich_ln(),
        qkv_bias=c.attention_bias, out_bias=False,
        rope=Rope(theta=_theta(c), style=RopeStyle.INTERLEAVED, fraction=frac),
    )  # fmt: skip


def _gpt2(c: Any) -> ModelConfig:
    eps = c.layer_norm_epsilon
    if c.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"activation_function={c.activation_function!r} is not supported")
    if getattr(c, "add_cross_attention", False):
        raise ValueError("add_cross_attention=True is not supported (our blocks have no cross-attention)")
    # scale_attn_weights / scale_attn_by_inverse_layer_idx: q.k times head_dim**-0.5 (if set) / (layer + 1) (if set).
    # reorder_and_upcast_attn only changes the order and dtype of that product (fp32 scores): the same arithmetic
    # for an fp32 model, which is the only dtype whose port we check.
    head_scale = (c.n_embd // c.n_head) ** -0.5 if c.scale_attn_weights else 1.0
    inverse_layer = bool(c.scale_attn_by_inverse_layer_idx)
    layer_scale = tuple(head_scale / (i + 1 if inverse_layer else 1) for i in range(c.n_layer))
    return ModelConfig(
        vocab_size=c.vocab_size, d_model=c.n_embd, n_layers=c.n_layer, n_heads=c.n_head,
        d_ff=c.n_inner or 4 * c.n_embd, norm=lambda d: LayerNorm(d, eps), placement=pre_ln(),
        activation=Activation.GELU_TANH, gated=False, qkv_bias=True, out_bias=True, mlp_bias=True,
        rope=None, max_positions=c.n_positions, tie_embeddings=bool(c.tie_word_embeddings),
        layer_attn_scale=layer_scale,
    )  # fmt: skip


def _bert(c: Any) -> ModelConfig:
    eps = c.layer_norm_eps
    if c.hidden_act != "gelu":
        raise ValueError(f"hidden_act={c.hidden_act!r} is not supported (only 'gelu')")
    return ModelConfig(
        vocab_size=c.vocab_size, d_model=c.hidden_size, n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads, d_ff=c.intermediate_size, norm=lambda d: LayerNorm(d, eps),
        placement=post_ln(), activation=Activation.GELU, gated=False, qkv_bias=True, out_bias=True,
        mlp_bias=True, rope=None, max_positions=c.max_position_embeddings, type_vocab_size=c.type_vocab_size,
        causal=False, embed_norm=True, final_norm=False, head_transform=True, head_bias=True,
        tie_embeddings=bool(c.tie_word_embeddings),
    )  # fmt: skip


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


_PRE_LN_LAYER = (
    *_norm("layers.{i}.attn_pre_norm", f"{_L}.input_layernorm"),
    *_attn(_L),
    *_norm("layers.{i}.ffn_pre_norm", f"{_L}.post_attention_layernorm"),  # Llama: the pre-FFN norm
    *_mlp(_L),
)
_PERI_LN_LAYER = (
    *_norm("layers.{i}.attn_pre_norm", f"{_L}.input_layernorm"),
    *_attn(_L),
    *_norm("layers.{i}.attn_post_norm", f"{_L}.post_attention_layernorm"),  # Gemma 2: post-attention-branch
    *_norm("layers.{i}.ffn_pre_norm", f"{_L}.pre_feedforward_layernorm"),
    *_mlp(_L),
    *_norm("layers.{i}.ffn_post_norm", f"{_L}.post_feedforward_layernorm"),
)
_G = "transformer.h.{i}"
_B = "bert.encoder.layer.{i}"


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
        KeyMap("llama", "LlamaForCausalLM", _llama, _DECODER_GLOBALS, _PRE_LN_LAYER, _IGNORE_ROPE),
        KeyMap("qwen3", "Qwen3ForCausalLM", _qwen3, _DECODER_GLOBALS, _PRE_LN_LAYER, _IGNORE_ROPE),
        KeyMap(
            "gemma2",
            "Gemma2ForCausalLM",
            lambda c: _gemma(c, False),
            _DECODER_GLOBALS,
            _PERI_LN_LAYER,
            (*_IGNORE_ROPE, "embed_tokens.embed_scale"),
        ),
        KeyMap(
            "gemma3_text",
            "Gemma3ForCausalLM",
            lambda c: _gemma(c, True),
            _DECODER_GLOBALS,
            _PERI_LN_LAYER,
            (*_IGNORE_ROPE, "inv_freq", "embed_tokens.embed_scale"),
        ),
        KeyMap(
            "olmo2",
            "Olmo2ForCausalLM",
            _olmo2,
            _DECODER_GLOBALS,
            (
                *_attn(_L),
                *_norm("layers.{i}.attn_post_norm", f"{_L}.post_attention_layernorm"),  # OLMo 2: post-branch
                *_mlp(_L),
                *_norm("layers.{i}.ffn_post_norm", f"{_L}.post_feedforward_layernorm"),
            ),
            _IGNORE_ROPE,
        ),
        KeyMap(
            "cohere",
            "CohereForCausalLM",
            _cohere,
            _DECODER_GLOBALS,
            (
                *_norm("layers.{i}.attn_pre_norm", f"{_L}.input_layernorm"),  # one norm feeds both branches
                *_attn(_L),
                *_mlp(_L),
            ),
            _IGNORE_ROPE,
        ),
        KeyMap(
            "glm4",
            "Glm4ForCausalLM",
            _glm4,
            _DECODER_GLOBALS,
            (
                *_norm("layers.{i}.attn_pre_norm", f"{_L}.input_layernorm"),
                *_attn(_L),
                *_norm("layers.{i}.attn_post_norm", f"{_L}.post_self_attn_layernorm"),
                *_norm("layers.{i}.ffn_pre_norm", f"{_L}.post_attention_layernorm"),  # GLM-4: the pre-FFN norm
                Rule("layers.{i}.mlp.gate_proj.weight", f"{_L}.mlp.gate_up_proj.weight", chunks=2, index=0),
                Rule("layers.{i}.mlp.up_proj.weight", f"{_L}.mlp.gate_up_proj.weight", chunks=2, index=1),
                *_lin("layers.{i}.mlp.down_proj", f"{_L}.mlp.down_proj"),
                *_norm("layers.{i}.ffn_post_norm", f"{_L}.post_mlp_layernorm"),
            ),
            _IGNORE_ROPE,
        ),
        KeyMap(
            "gpt2",
            "GPT2LMHeadModel",
            _gpt2,
            (
                Rule("embed.weight", "transformer.wte.weight"),
                Rule("pos_embed.weight", "transformer.wpe.weight"),
                *_norm("final_norm", "transformer.ln_f"),
                Rule("lm_head.weight", "lm_head.weight"),
            ),
            (
                *_norm("layers.{i}.attn_pre_norm", f"{_G}.ln_1"),
                *(
                    r
                    for k, n in enumerate("qkv")
                    for r in _lin(f"layers.{{i}}.attn.{n}_proj", f"{_G}.attn.c_attn", transpose=True, chunks=3, index=k)
                ),
                *_lin("layers.{i}.attn.o_proj", f"{_G}.attn.c_proj", transpose=True),
                *_norm("layers.{i}.ffn_pre_norm", f"{_G}.ln_2"),
                *_lin("layers.{i}.mlp.up_proj", f"{_G}.mlp.c_fc", transpose=True),
                *_lin("layers.{i}.mlp.down_proj", f"{_G}.mlp.c_proj", transpose=True),
            ),
            ("attn.bias", "attn.masked_bias"),
        ),
        KeyMap(
            "bert",
            "BertForMaskedLM",
            _bert,
            (
                Rule("embed.weight", "bert.embeddings.word_embeddings.weight"),
                Rule("pos_embed.weight", "bert.embeddings.position_embeddings.weight"),
                Rule("type_embed.weight", "bert.embeddings.token_type_embeddings.weight"),
                *_norm("embed_norm", "bert.embeddings.LayerNorm"),
                *_lin("head_dense", "cls.predictions.transform.dense"),
                *_norm("head_norm", "cls.predictions.transform.LayerNorm"),
                Rule("lm_head.weight", "cls.predictions.decoder.weight"),
                Rule("lm_head.bias", "cls.predictions.bias"),
            ),
            (
                *_lin("layers.{i}.attn.q_proj", f"{_B}.attention.self.query"),
                *_lin("layers.{i}.attn.k_proj", f"{_B}.attention.self.key"),
                *_lin("layers.{i}.attn.v_proj", f"{_B}.attention.self.value"),
                *_lin("layers.{i}.attn.o_proj", f"{_B}.attention.output.dense"),
                *_norm("layers.{i}.attn_after_norm", f"{_B}.attention.output.LayerNorm"),  # Post-LN: after the add
                *_lin("layers.{i}.mlp.up_proj", f"{_B}.intermediate.dense"),
                *_lin("layers.{i}.mlp.down_proj", f"{_B}.output.dense"),
                *_norm("layers.{i}.ffn_after_norm", f"{_B}.output.LayerNorm"),
            ),
            ("position_ids", "token_type_ids", "cls.predictions.decoder.bias"),
        ),
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
