"""Tiny image-text models assembled from the connectors of :mod:`.vlm_connectors` and the blocks of
:mod:`normatlas.blocks`, for tests, diagnostics and experiments on a 2-core CPU.

A :class:`TinyVLM` is a vision tower (a patch projection, learned positions and non-causal Pre-LN
:class:`~normatlas.blocks.Block` s, or the projection alone), a :class:`Connector` and a text decoder
(:class:`~normatlas.blocks.TransformerLM` from a :class:`~normatlas.blocks.ModelConfig`)::

    pixel_values (B, P, patch_dim): patches ─► tower ─► connector ─► image rows (B, n, d_model)
                                                          │
    input_ids ─► embed ─► [image rows at image_mask] ─► layers ─► final norm ─► lm_head   (embedding stream)
    input_ids ─► embed ─► (gated x-attn to image rows ─► layer) x L ─► final norm ─► lm_head (gated x-attn)

Every choice is a typed field of :class:`TinyVLMConfig`: the connector's kind
(:class:`~normatlas.vocabulary.ConnectorKind`: ``RESAMPLER``, ``MLP``, ``LINEAR``), the injection
(:class:`~normatlas.vocabulary.Injection`: ``EMBEDDING_STREAM``, ``GATED_CROSS_ATTENTION``) and ``split_norms`` (the
decoder's layers become :class:`~.vlm_connectors.ModalityBlock` s, one norm per modality). The image tokens of the
text are the positions of the boolean ``image_mask`` the caller passes (never found from ids or names).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..blocks.attention import rope_tables
from ..blocks.block import Activation, Block
from ..blocks.model import ModelConfig, TransformerLM, as_factory
from ..blocks.placement import NormFactory, pre_ln
from ..presets import RMSNorm
from ..spec import NormSpec
from ..vocabulary import ConnectorKind, Injection
from .vlm_connectors import GatedCrossAttentionBlock, ModalityBlock, PerceiverResampler, _factory, _int

__all__ = ["Connector", "TinyVLM", "TinyVLMConfig", "VisionTower"]

_CONNECTORS = (ConnectorKind.RESAMPLER, ConnectorKind.MLP, ConnectorKind.LINEAR)
_INJECTIONS = (Injection.EMBEDDING_STREAM, Injection.GATED_CROSS_ATTENTION)


def _default_lm() -> ModelConfig:
    # a Llama-shaped decoder shrunk to 2 layers of width 32 (Llama 3 8B: 32 layers of 4096)
    return ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, norm=RMSNorm)


def _allowed(value: object, allowed: tuple[Any, ...], name: str) -> None:
    if value not in allowed:
        names = ", ".join(f"{type(a).__name__}.{a.name}" for a in allowed)
        raise ValueError(f"{name}={value!r} must be one of {names}")


@dataclass(frozen=True)
class TinyVLMConfig:
    """A tiny VLM's design. Validated at construction.

    Attributes:
        lm: the text decoder (default: 2 Pre-LN RMSNorm layers of width 32, vocabulary 64). Per-layer windows,
            RoPE bases and NoPE layers, a head transform, logit scale and soft-cap are not read here and refused.
        patch_dim: the width of one input patch (default 48: 4 x 4 x 3 pixels).
        vision_dim, vision_layers, vision_heads: the tower (``vision_layers=0``: the patch projection alone, i.e.
            random patch features straight into the connector).
        num_patches: patches per image (learned positions).
        vision_norm: the tower's and the connector's norm operator (a per-token NormSpec or factory; None: LayerNorm,
            the essay's usual mixed-operator pairing with an RMSNorm decoder).
        connector: ``RESAMPLER`` (Perceiver resampler then a linear map to ``lm.d_model``), ``MLP`` (LLaVA-1.5:
            linear, GELU, linear) or ``LINEAR``.
        num_latents, resampler_depth: the resampler's queries (= image tokens out) and layers.
        injection: ``EMBEDDING_STREAM`` (image rows replace the masked token embeddings) or
            ``GATED_CROSS_ATTENTION`` (a Flamingo block before every decoder layer; the text holds no image tokens).
        split_norms: the decoder's layers are :class:`~.vlm_connectors.ModalityBlock` s (attention and FFN shared,
            one norm per modality at every slot of the layer's placement). Embedding-stream injection only.
    """

    lm: ModelConfig = field(default_factory=_default_lm)
    patch_dim: int = 48
    vision_dim: int = 32
    vision_layers: int = 2
    vision_heads: int = 4
    num_patches: int = 16
    vision_norm: NormSpec | NormFactory | None = None
    connector: ConnectorKind = ConnectorKind.RESAMPLER
    num_latents: int = 8
    resampler_depth: int = 1
    injection: Injection = Injection.EMBEDDING_STREAM
    split_norms: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.lm, ModelConfig):
            raise TypeError(f"lm={self.lm!r} must be a normatlas.blocks.ModelConfig")
        for name in ("layer_windows", "layer_rope_theta", "layer_rope"):
            if getattr(self.lm, name) is not None:
                raise ValueError(f"lm.{name}={getattr(self.lm, name)!r}: per-layer attention settings are not read")
        if self.lm.head_transform or self.lm.logit_scale != 1.0 or self.lm.logit_softcap is not None:
            raise ValueError(
                f"lm has head_transform={self.lm.head_transform}, logit_scale={self.lm.logit_scale}, "
                f"logit_softcap={self.lm.logit_softcap}; a TinyVLM's head is the plain lm_head"
            )
        for name in ("patch_dim", "vision_dim", "vision_heads", "num_patches", "num_latents", "resampler_depth"):
            _int(getattr(self, name), name)
        _int(self.vision_layers, "vision_layers", 0)
        _allowed(self.connector, _CONNECTORS, "connector")
        _allowed(self.injection, _INJECTIONS, "injection")
        if not isinstance(self.split_norms, bool):
            raise TypeError(f"split_norms={self.split_norms!r} must be a bool")
        if self.split_norms and self.injection is not Injection.EMBEDDING_STREAM:
            raise ValueError(
                f"split_norms=True with injection={self.injection}: split norms need image tokens in the stream "
                "(Injection.EMBEDDING_STREAM)"
            )
        _factory(self.vision_norm)  # a batch-statistics spec fails here

    @property
    def image_tokens(self) -> int:
        """Rows the connector writes per image: ``num_latents`` for a resampler, ``num_patches`` otherwise."""
        return self.num_latents if self.connector is ConnectorKind.RESAMPLER else self.num_patches


class VisionTower(nn.Module):
    """Patches ``(B, P, patch_dim)`` -> ``(B, P, vision_dim)``: a linear patch embedding, learned positions, then
    ``vision_layers`` non-causal Pre-LN blocks (GELU MLP) and a final norm (none without layers)."""

    def __init__(self, cfg: TinyVLMConfig) -> None:
        super().__init__()
        d, norm = cfg.vision_dim, _factory(cfg.vision_norm)
        self.patch_dim, self.num_patches = cfg.patch_dim, cfg.num_patches
        self.patch_embed = nn.Linear(cfg.patch_dim, d)
        self.pos_embed = nn.Parameter(torch.randn(1, cfg.num_patches, d) * 0.02)
        n = cfg.vision_layers
        self.layers = nn.ModuleList(
            Block(d, pre_ln(), norm, layer=i, n_layers=n, n_heads=cfg.vision_heads, d_ff=4 * d,
                  activation=Activation.GELU, gated=False)
            for i in range(n)
        )  # fmt: skip
        self.final_norm = norm(d) if n else None

    def forward(self, pixel_values: Tensor) -> Tensor:
        want = (self.num_patches, self.patch_dim)
        if not isinstance(pixel_values, Tensor) or pixel_values.dim() != 3 or tuple(pixel_values.shape[1:]) != want:
            got = tuple(pixel_values.shape) if isinstance(pixel_values, Tensor) else type(pixel_values).__name__
            raise ValueError(
                f"pixel_values {got} must be (B, num_patches={self.num_patches}, patch_dim={self.patch_dim})"
            )
        x = self.patch_embed(pixel_values) + self.pos_embed
        for layer in self.layers:
            x = layer(x)
        return x if self.final_norm is None else self.final_norm(x)


class Connector(nn.Module):
    """Tower features ``(B, P, vision_dim)`` -> image rows ``(B, n, d_model)``; ``kind`` says what it computes."""

    def __init__(self, cfg: TinyVLMConfig) -> None:
        super().__init__()
        v, d = cfg.vision_dim, cfg.lm.d_model
        self.kind: ConnectorKind = cfg.connector
        self.resampler = (
            PerceiverResampler(v, cfg.vision_heads, cfg.num_latents, cfg.resampler_depth, norm=cfg.vision_norm)
            if cfg.connector is ConnectorKind.RESAMPLER
            else None
        )
        if cfg.connector is ConnectorKind.MLP:
            self.proj: nn.Module = nn.Sequential(nn.Linear(v, d), nn.GELU(), nn.Linear(d, d))
        else:
            self.proj = nn.Linear(v, d)

    def forward(self, features: Tensor) -> Tensor:
        return self.proj(features if self.resampler is None else self.resampler(features))


class TinyVLM(nn.Module):
    """A tiny VLM; see the module docstring. ``forward(input_ids, pixel_values, image_mask=None, attention_mask=None)``
    (``pixel_values``: flattened patches ``(B, num_patches, patch_dim)``)
    returns logits ``(B, T, vocab)``.

    ``image_mask`` (boolean ``(B, T)``) marks the image tokens of the text: required with the embedding-stream
    injection, where each example must hold exactly :attr:`TinyVLMConfig.image_tokens` of them (their ids are
    embedded, then replaced by the connector's rows); with the gated cross-attention it must be None or all False.
    ``attention_mask`` (``(B, T)``, 1 for real tokens) masks padding keys.

    Parameter groups for the diagnostics: :attr:`tower`, :attr:`connector` (and :attr:`xattn`, Flamingo's gated
    blocks), :attr:`lm`.
    """

    def __init__(self, config: TinyVLMConfig | None = None) -> None:
        super().__init__()
        cfg = TinyVLMConfig() if config is None else config
        if not isinstance(cfg, TinyVLMConfig):
            raise TypeError(f"config={cfg!r} must be a TinyVLMConfig")
        self.config = cfg
        self.tower = VisionTower(cfg)
        self.connector = Connector(cfg)
        lm = cfg.lm
        self.lm = TransformerLM(lm)
        if cfg.split_norms:
            blocks = []
            for i in range(lm.n_layers):
                placement, norm = lm.plan(i)
                blocks.append(
                    ModalityBlock(lm.d_model, lm.n_heads, lm.d_ff, placement=placement, norm=norm,
                                  activation=lm.activation, gated=lm.gated)
                )  # fmt: skip
            self.lm.layers = nn.ModuleList(blocks)
            for m in self.lm.layers.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=lm.init_std)
        gated = cfg.injection is Injection.GATED_CROSS_ATTENTION
        self.xattn = (
            nn.ModuleList(
                GatedCrossAttentionBlock(lm.d_model, lm.n_heads, norm=as_factory(lm.norm)) for _ in range(lm.n_layers)
            )
            if gated
            else None
        )

    def image_rows(self, pixel_values: Tensor) -> Tensor:
        """The connector's output for ``pixel_values``: ``(B, image_tokens, d_model)``."""
        return self.connector(self.tower(pixel_values))

    def forward(
        self,
        input_ids: Tensor,
        pixel_values: Tensor,
        image_mask: Tensor | None = None,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        cfg = self.config
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            raise ValueError(f"input_ids must be a 2-D integer tensor (B, T), got {input_ids!r:.60}")
        b, t = input_ids.shape
        if image_mask is not None and (
            not isinstance(image_mask, Tensor) or image_mask.dtype != torch.bool or image_mask.shape != (b, t)
        ):
            raise ValueError(
                f"image_mask must be a boolean tensor of input_ids' shape {(b, t)}, got {image_mask!r:.80}"
            )
        rows = self.image_rows(pixel_values)
        x = self.lm.embed_tokens(input_ids, attention_mask=attention_mask)
        if cfg.injection is Injection.EMBEDDING_STREAM:
            if image_mask is None:
                raise ValueError("image_mask=None: the embedding-stream injection needs the image tokens' mask")
            counts = image_mask.sum(1)
            if bool((counts != rows.shape[1]).any()):
                raise ValueError(
                    f"image_mask marks {counts.tolist()} tokens per example; the connector writes {rows.shape[1]}"
                )
            x = x.masked_scatter(image_mask[..., None], rows.to(x.dtype))
        elif image_mask is not None and bool(image_mask.any()):
            raise ValueError("image_mask marks image tokens, but the gated cross-attention injection reads none")
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device)
        mask = (mask.tril() if self.lm.config.causal else mask)[None, None]
        if attention_mask is not None:
            mask = mask & attention_mask.bool()[:, None, None, :]
        rope = None
        if self.lm.config.rope is not None:
            attn: Any = self.lm.layers[0].attn  # every layer's attention spans the same RoPE width
            head_dim = int(attn.rope_head_dim)
            cos, sin = rope_tables(self.lm.config.rope, head_dim, torch.arange(t, device=x.device))
            rope = (cos, sin, self.lm.config.rope.style)
        m = image_mask if image_mask is not None else torch.zeros(b, t, dtype=torch.bool, device=x.device)
        for i, layer in enumerate(self.lm.layers):
            if self.xattn is not None:
                x = self.xattn[i](x, rows, None)
            x = layer(x, m, rope, mask) if cfg.split_norms else layer(x, rope, mask)
        if self.lm.final_norm is not None:
            x = self.lm.final_norm(x)
        return self.lm.lm_head(x)
