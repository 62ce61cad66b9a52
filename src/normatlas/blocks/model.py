"""A small decoder-only LM (also a BERT-style encoder with ``causal=False``) and a ViT-style encoder.

Both are stacks of :class:`~normatlas.blocks.block.Block` configured by one
dataclass: operator, placement or schedule, QK-norm, final norm, GQA, RoPE or
learned positions, SwiGLU / GeGLU / GELU MLP, tied embeddings, logit soft-capping.
Switching a model from Pre-LN to Peri-LN is one field: ``replace(cfg, placement=peri_ln())``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from ..modules import Norm
from ..spec import NormSpec
from .alibi import Alibi
from .attention import Rope
from .attn_gate import OutputGate
from .block import Block
from .mla import MLAConfig
from .mlp import MLP, Activation
from .moe import MoE, MoEConfig
from .placement import NormFactory, Placement, Schedule, pre_ln
from .positions import PositionIds, position_rows
from .qknorm import QKNormConfig

__all__ = ["ModelConfig", "TransformerLM", "ViTConfig", "ViTEncoder", "ViTPool", "as_factory"]


def as_factory(norm: NormFactory | NormSpec | None) -> NormFactory | None:
    """A NormSpec becomes ``lambda d: Norm(spec, d)``; a callable is used as is."""
    if norm is None or (callable(norm) and not isinstance(norm, NormSpec)):
        return norm
    if isinstance(norm, NormSpec):
        spec = norm
        return lambda d: Norm(spec, d)
    raise TypeError(f"norm={norm!r} must be a NormSpec, a callable dim -> nn.Module, or None")


def _positive(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")


@dataclass(frozen=True)
class ModelConfig:
    """Everything that defines a model. Validated at construction (so bad combinations fail here).

    ``norm`` is the operator for every norm slot (a NormSpec or a factory ``dim -> module``
    such as ``normatlas.RMSNorm`` or ``DyT``); ``placement`` a :class:`Placement` for
    every layer or a :class:`Schedule` with one entry per layer. ``max_positions > 0``
    adds learned absolute positions (GPT-2, BERT); token ``t`` reads their row ``t + position_offset`` by default
    (``position_ids=PositionIds.ARANGE``), or a row counted over the kept tokens only (``FROM_MASK``: OPT, BioGPT;
    ``FROM_PADDING``: RoBERTa, whose ``pad_token_id`` sets which tokens do not count; see :mod:`.positions`).
    ``rope=None`` disables RoPE.
    ``layer_windows`` / ``layer_rope_theta`` / ``layer_attn_scale`` give per-layer sliding windows, RoPE bases
    and q.k multipliers (the last overrides ``attn_scale``; GPT-2's ``scale_attn_by_inverse_layer_idx``);
    ``layer_kv_heads`` gives each layer's key / value head count (overriding ``n_kv_heads``; MiMo-V2-Flash's
    full and sliding-window layers differ).
    ``layer_rope`` says which layers rotate q and k at all (False: a NoPE layer, EXAONE 4's global layers).
    ``v_norm`` (a :class:`QKNormConfig`, before RoPE) is a norm on the attention values beside the QK-norm
    (Gemma 3n, Gemma 4).
    ``alibi`` (an :class:`~normatlas.blocks.alibi.Alibi`, one slope per head) adds ALiBi's ``slope * (j - i)`` to
    every layer's scores (BLOOM, MPT; usually with ``rope=None``).
    ``moe`` (a :class:`MoEConfig`) makes the MLP slot a routed mixture of experts, in every layer or in those
    ``layer_moe`` marks True (the others keep the dense ``d_ff`` MLP: DeepSeek's ``first_k_dense_replace``,
    Qwen2-MoE's ``decoder_sparse_step`` / ``mlp_only_layers``).
    ``pad_token_id`` is the embedding's ``padding_idx`` (its row gets no gradient, as in torch).
    ``scaled_residual_init`` is GPT-2's scaled init: the two projections that write into the residual stream
    (``attn.o_proj``, ``mlp.down_proj``) start at ``init_std / sqrt(2 * n_layers)``, so the stream's variance after
    ``2 * n_layers`` branch additions stays near that of one (the essay's "why scaled init isn't enough": it fixes the
    start, not the growth Pre-LN accumulates while training, which LayerNorm Scaling addresses). A DeepNorm layer
    keeps DeepNet's own init (``Block.deepnorm_init``) either way.
    ``embed_dim`` (None: ``d_model``) is the width of the embedding tables and their norm; a projection
    ``embed_proj`` (``embed_dim -> d_model``, with a bias when ``embed_proj_bias``) after the embedding norm maps
    them onto the stream (ELECTRA, RemBERT, ALBERT). ``head_width`` (None: ``d_model``) is the width the head
    transform writes and the head reads (ELECTRA's generator head returns to the embedding width);
    ``head_transform_bias`` whether its dense map has a bias (ModernBERT's has none). ``head_vocab_size``
    (None: ``vocab_size``) is an untied head over another vocabulary than the embedding table (Mllama's table
    has 8 rows more for image tokens; Moshi's one more).
    """

    vocab_size: int = 256
    pad_token_id: int | None = None
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int = 128
    norm: NormFactory | NormSpec | None = None
    placement: Placement | Schedule = field(default_factory=pre_ln)
    qk_norm: QKNormConfig | None = None
    v_norm: QKNormConfig | None = None
    mla: MLAConfig | None = None
    attn_sinks: bool = False
    attn_gate: OutputGate | None = None
    alibi: Alibi | None = None
    final_norm: bool = True
    embed_norm: bool = False
    activation: Activation = Activation.SILU
    gated: bool = True
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    rope: Rope | None = field(default_factory=Rope)
    max_positions: int = 0
    position_offset: int = 0
    position_ids: PositionIds = PositionIds.ARANGE
    type_vocab_size: int = 0
    causal: bool = True
    tie_embeddings: bool = True
    embed_scale: float = 1.0
    logit_scale: float = 1.0
    logit_softcap: float | None = None
    attn_softcap: float | None = None
    attn_scale: float | None = None
    layer_windows: tuple[int | None, ...] | None = None
    layer_rope_theta: tuple[float, ...] | None = None
    layer_rope: tuple[bool, ...] | None = None
    layer_attn_scale: tuple[float, ...] | None = None
    layer_kv_heads: tuple[int, ...] | None = None
    moe: MoEConfig | None = None
    layer_moe: tuple[bool, ...] | None = None
    head_transform: bool = False
    head_bias: bool = False
    head_transform_bias: bool = True
    head_width: int | None = None
    head_vocab_size: int | None = None
    embed_dim: int | None = None
    embed_proj_bias: bool = True
    init_std: float = 0.02
    scaled_residual_init: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff"):
            _positive(getattr(self, name), name)
        kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        _positive(kv, "n_kv_heads")
        if self.n_heads % kv:
            raise ValueError(f"n_kv_heads={kv} must divide n_heads={self.n_heads} (grouped-query attention)")
        if self.head_dim is None and self.mla is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; set head_dim")
        if self.head_dim is not None:
            _positive(self.head_dim, "head_dim")
        if not isinstance(self.placement, (Placement, Schedule)):
            raise TypeError(f"placement={self.placement!r} must be a Placement or a Schedule")
        if isinstance(self.placement, Schedule):
            self.placement.check_depth(self.n_layers)
        if not isinstance(self.activation, Activation):
            raise TypeError(f"activation={self.activation!r} must be an Activation")
        for name in ("qk_norm", "v_norm"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), QKNormConfig):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a QKNormConfig or None")
        as_factory(self.norm)  # type check
        self._check_mla()
        if not isinstance(self.attn_sinks, bool):
            raise TypeError(f"attn_sinks={self.attn_sinks!r} must be a bool")
        if self.attn_gate is not None and not isinstance(self.attn_gate, OutputGate):
            raise TypeError(f"attn_gate={self.attn_gate!r} must be an OutputGate or None")
        if self.alibi is not None:
            if not isinstance(self.alibi, Alibi):
                raise TypeError(f"alibi={self.alibi!r} must be an Alibi or None")
            self.alibi.check_heads(self.n_heads)
        if self.norm is None:
            for i in range(self.n_layers):
                p = self.plan(i)
                if p[0].has_norm and p[1] is None:
                    raise ValueError(
                        f"layer {i}: placement {p[0].name!r} has norm slots but norm=None; "
                        "set norm (e.g. normatlas.RMSNorm) or use a norm-free placement"
                    )
            for name in ("final_norm", "embed_norm", "head_transform"):
                if getattr(self, name):
                    raise ValueError(f"{name}=True needs a norm operator but norm=None")
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise TypeError(f"moe={self.moe!r} must be a MoEConfig or None")
        if self.layer_moe is not None:
            if self.moe is None:
                raise ValueError("layer_moe is set but moe=None (which layers are MoE needs the MoE's config)")
            if not all(isinstance(v, bool) for v in self.layer_moe):
                raise TypeError(f"layer_moe={self.layer_moe!r} must be a tuple of bools, one per layer")
        if self.moe is not None and self.mlp_bias:
            raise ValueError("mlp_bias=True with moe: our experts have no biases")
        self._check_kv_heads()
        for name in ("layer_windows", "layer_rope_theta", "layer_attn_scale", "layer_rope", "layer_moe",
                     "layer_kv_heads"):  # fmt: skip
            v = getattr(self, name)
            if v is not None and len(v) != self.n_layers:
                raise ValueError(f"{name} has {len(v)} entries but n_layers={self.n_layers}")
        self._check_positions()
        if self.rope is not None:
            self.rope.rotary_dim(self.head_dim or self.d_model // self.n_heads)  # inv_freq: one per rotated pair
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id={self.pad_token_id} must lie in [0, vocab_size={self.vocab_size})")
        for name in ("layer_rope_theta", "layer_rope"):
            if getattr(self, name) is not None and self.rope is None:
                raise ValueError(f"{name} is set but rope=None")
        if self.layer_rope is not None and not all(isinstance(v, bool) for v in self.layer_rope):
            raise TypeError(f"layer_rope={self.layer_rope!r} must be a tuple of bools, one per layer")
        if self.rope is None and self.max_positions == 0 and self.causal is False and self.type_vocab_size == 0:
            pass  # a bag-of-tokens encoder is allowed
        for name in ("logit_softcap", "attn_softcap"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name}={v!r} must be a finite float > 0 or None")
        self._check_ends()
        if self.activation.learned and (self.moe is not None or self.head_transform):
            raise ValueError(
                f"activation={self.activation.value!r} has learned parameters, which only the dense MLP holds; "
                f"got moe={self.moe is not None}, head_transform={self.head_transform} (both must be off)"
            )
        if not (math.isfinite(self.init_std) and self.init_std > 0):
            raise ValueError(f"init_std={self.init_std!r} must be > 0")
        if not isinstance(self.scaled_residual_init, bool):
            raise TypeError(f"scaled_residual_init={self.scaled_residual_init!r} must be a bool")

    def _check_kv_heads(self) -> None:
        v = self.layer_kv_heads
        if v is None:
            return
        if not isinstance(v, tuple) or not all(isinstance(h, int) and not isinstance(h, bool) for h in v):
            raise TypeError(f"layer_kv_heads={v!r} must be a tuple of ints, one per layer")
        bad = [h for h in v if h < 1 or self.n_heads % h]
        if bad:
            raise ValueError(f"layer_kv_heads holds {bad[0]}; each must be >= 1 and divide n_heads={self.n_heads}")
        if self.mla is not None:
            raise ValueError("layer_kv_heads with mla: MLA's k / v have n_heads heads in every layer")

    def _check_positions(self) -> None:
        if not isinstance(self.position_ids, PositionIds):
            allowed = ", ".join(f"PositionIds.{m.name}" for m in PositionIds)
            raise TypeError(f"position_ids={self.position_ids!r} must be one of {allowed}")
        off = self.position_offset
        if isinstance(off, bool) or not isinstance(off, int) or off < 0:
            raise ValueError(f"position_offset={off!r} must be an integer >= 0 (the table row of position 0)")
        if off and not self.max_positions:
            raise ValueError(f"position_offset={off} needs a learned position table (max_positions > 0)")
        if self.position_ids is not PositionIds.ARANGE:
            if not self.max_positions:
                raise ValueError(f"position_ids={self.position_ids} needs a learned position table (max_positions > 0)")
            if off < 1:
                raise ValueError(
                    f"position_ids={self.position_ids} reads row position_offset - 1 for an uncounted token, so "
                    f"position_offset={off} must be >= 1"
                )
        if self.position_ids is PositionIds.FROM_PADDING and self.pad_token_id is None:
            raise ValueError(
                "position_ids=PositionIds.FROM_PADDING counts the tokens that are not pad_token_id; set it"
            )

    def _check_mla(self) -> None:
        """MLA sets its own head widths: ``head_dim`` (if given) is its q / k head, every head its own kv head."""
        m = self.mla
        if m is None:
            return
        if not isinstance(m, MLAConfig):
            raise TypeError(f"mla={m!r} must be an MLAConfig or None")
        if self.head_dim not in (None, m.qk_head_dim):
            raise ValueError(f"head_dim={self.head_dim} with mla: it must be None or mla.qk_head_dim={m.qk_head_dim}")
        if self.n_kv_heads not in (None, self.n_heads):
            raise ValueError(f"n_kv_heads={self.n_kv_heads} with mla: MLA's k / v have n_heads={self.n_heads} heads")
        if self.attn_sinks or self.attn_gate is not None:
            raise ValueError(f"attn_sinks / attn_gate with mla={m!r}: MLA has neither")
        if self.qk_norm is not None or self.v_norm is not None:
            raise ValueError(
                f"qk_norm={self.qk_norm!r} / v_norm={self.v_norm!r} with mla: MLA's norms are on its latents "
                "(mla.latent_norm)"
            )
        if self.rope is not None and self.rope.fraction != 1.0:
            raise ValueError(
                f"rope.fraction={self.rope.fraction} with mla: MLA rotates all of its qk_rope_head_dim part; use 1.0"
            )

    def _check_ends(self) -> None:
        """The embedding projection and the head's widths (see the class docstring)."""
        for name in ("head_width", "head_vocab_size", "embed_dim"):
            if getattr(self, name) is not None:
                _positive(getattr(self, name), name)
        for name in ("head_transform_bias", "embed_proj_bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.head_width is not None and not self.head_transform:
            raise ValueError(f"head_width={self.head_width} needs head_transform=True (its dense map writes it)")
        if not self.head_transform_bias and not self.head_transform:
            raise ValueError("head_transform_bias=False needs head_transform=True (there is no transform otherwise)")
        if self.head_vocab_size is not None and self.tie_embeddings and self.head_vocab_size != self.vocab_size:
            raise ValueError(
                f"head_vocab_size={self.head_vocab_size} with tie_embeddings=True: a tied head reads the embedding "
                f"table of vocab_size={self.vocab_size} rows; untie it or drop head_vocab_size"
            )
        if self.tie_embeddings and self.head_in != self.embed_width:
            raise ValueError(
                f"tie_embeddings=True needs the head's input width ({self.head_in}: head_width or d_model) to equal "
                f"the embedding width ({self.embed_width}: embed_dim or d_model)"
            )

    @property
    def embed_width(self) -> int:
        """The width of the embedding tables (``embed_dim``, else ``d_model``)."""
        return self.d_model if self.embed_dim is None else self.embed_dim

    @property
    def head_in(self) -> int:
        """The width the head reads (``head_width``, else ``d_model``)."""
        return self.d_model if self.head_width is None else self.head_width

    def plan(self, layer: int) -> tuple[Placement, NormFactory | None]:
        """The placement and norm operator of ``layer``."""
        if isinstance(self.placement, Schedule):
            lp = self.placement.layers[layer]
            return lp.placement, lp.norm if lp.norm is not None else as_factory(self.norm)
        return self.placement, as_factory(self.norm)

    def moe_of(self, layer: int) -> MoEConfig | None:
        """The MoE of ``layer``, or None where it has the dense MLP."""
        if self.moe is None or (self.layer_moe is not None and not self.layer_moe[layer]):
            return None
        return self.moe

    def with_(self, **changes: object) -> ModelConfig:
        return replace(self, **changes)  # type: ignore[arg-type]


def _blocks(cfg: ModelConfig) -> nn.ModuleList:
    layers = []
    for i in range(cfg.n_layers):
        placement, norm = cfg.plan(i)
        layers.append(
            Block(
                cfg.d_model, placement, norm, layer=i, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                n_kv_heads=cfg.n_kv_heads if cfg.layer_kv_heads is None else cfg.layer_kv_heads[i],
                head_dim=cfg.head_dim, d_ff=cfg.d_ff, activation=cfg.activation,
                gated=cfg.gated, mlp_bias=cfg.mlp_bias, qkv_bias=cfg.qkv_bias, out_bias=cfg.out_bias,
                qk_norm=cfg.qk_norm, v_norm=cfg.v_norm, attn_softcap=cfg.attn_softcap, mla=cfg.mla,
                attn_sinks=cfg.attn_sinks, attn_gate=cfg.attn_gate, alibi=cfg.alibi,
                attn_scale=cfg.attn_scale if cfg.layer_attn_scale is None else cfg.layer_attn_scale[i],
                window=None if cfg.layer_windows is None else cfg.layer_windows[i],
                rope_theta=None if cfg.layer_rope_theta is None else cfg.layer_rope_theta[i], moe=cfg.moe_of(i),
            )
        )  # fmt: skip
    return nn.ModuleList(layers)


class _Stack(nn.Module):
    """Shared init and the block loop with masks and RoPE tables."""

    config: ModelConfig
    layers: nn.ModuleList
    final_norm: nn.Module | None

    def __init__(self, config: ModelConfig, kind: type[ModelConfig]) -> None:
        super().__init__()
        if not isinstance(config, kind):
            raise TypeError(f"config={config!r} must be a {kind.__name__}")
        self.config = config

    def _add_layers(self, norm: NormFactory | None) -> None:
        """The blocks and the final norm, registered after the model's own embeddings (parameter order)."""
        self.layers = _blocks(self.config)
        self.final_norm = norm(self.config.d_model) if self.config.final_norm and norm else None

    def blocks(self) -> list[Block]:
        """The blocks, typed."""
        return [b for b in self.layers if isinstance(b, Block)]

    def _init_weights(self) -> None:
        std = self.config.init_std
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, MoE):
                m.reset_parameters(std)
        for block in self.blocks():
            if self.config.scaled_residual_init:  # GPT-2: the stream writers at std / sqrt(2 L)
                small = std / math.sqrt(2 * self.config.n_layers)
                nn.init.normal_(block.attn.o_proj.weight, std=small)
                mlp = block.mlp
                nn.init.normal_(mlp.down_proj.weight if isinstance(mlp, MLP) else mlp.down, std=small)
            block.deepnorm_init()

    def run_layers(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        cfg = self.config
        t = x.shape[1]
        pos = torch.arange(t, device=x.device)
        base = torch.ones(t, t, dtype=torch.bool, device=x.device)
        if cfg.causal:
            base = base.tril()
        pad = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        tables: dict[float, tuple[Tensor, Tensor]] = {}
        from .attention import rope_tables

        for i, block in enumerate(self.blocks()):
            mask = base
            if block.window is not None:
                mask = mask & ((pos[:, None] - pos[None, :]).abs() < block.window)
            full = mask[None, None] if pad is None else mask[None, None] & pad
            rope = None
            if cfg.rope is not None and (cfg.layer_rope is None or cfg.layer_rope[i]):
                theta = cfg.rope.theta if block.rope_theta is None else block.rope_theta
                if theta not in tables:
                    tables[theta] = rope_tables(replace(cfg.rope, theta=theta), block.attn.rope_head_dim, pos)
                rope = (*tables[theta], cfg.rope.style)
            x = block(x, rope, full)
        return x


class TransformerLM(_Stack):
    """Token ids in, logits out. A decoder-only LM, or a BERT-style encoder with ``causal=False``.

    Parameter names: ``embed``, ``pos_embed``, ``type_embed``, ``embed_norm``, ``embed_proj``, ``layers.{i}.*``,
    ``final_norm``, ``head_dense`` / ``head_norm`` (MLM transform), ``lm_head`` (its weight is
    ``embed.weight`` when tied; ``head_bias`` adds a separate bias).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, ModelConfig)
        cfg, norm, d, e, h = config, as_factory(config.norm), config.d_model, config.embed_width, config.head_in
        self.embed = nn.Embedding(cfg.vocab_size, e, padding_idx=cfg.pad_token_id)
        self.pos_embed = nn.Embedding(cfg.max_positions, e) if cfg.max_positions else None
        self.type_embed = nn.Embedding(cfg.type_vocab_size, e) if cfg.type_vocab_size else None
        self.embed_norm = norm(e) if cfg.embed_norm and norm else None
        self.embed_proj = nn.Linear(e, d, bias=cfg.embed_proj_bias) if cfg.embed_dim is not None else None
        self._add_layers(norm)
        self.head_dense = nn.Linear(d, h, bias=cfg.head_transform_bias) if cfg.head_transform else None
        self.head_norm = norm(h) if cfg.head_transform and norm else None
        self.lm_head = nn.Linear(h, cfg.head_vocab_size or cfg.vocab_size, bias=cfg.head_bias)
        self._init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if self.lm_head.bias is not None:
            nn.init.zeros_(self.lm_head.bias)

    def embed_tokens(
        self, input_ids: Tensor, token_type_ids: Tensor | None = None, attention_mask: Tensor | None = None
    ) -> Tensor:
        cfg = self.config
        x = self.embed(input_ids)
        if cfg.embed_scale != 1.0:
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        if self.pos_embed is not None:
            rows = position_rows(cfg.position_ids, cfg.position_offset, input_ids, attention_mask, cfg.pad_token_id)
            x = x + self.pos_embed(rows)
        if self.type_embed is not None:
            tt = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            x = x + self.type_embed(tt)
        x = x if self.embed_norm is None else self.embed_norm(x)
        return x if self.embed_proj is None else self.embed_proj(x)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        x = self.run_layers(self.embed_tokens(input_ids, token_type_ids, attention_mask), attention_mask)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.head_dense is not None:
            x = self.config.activation(self.head_dense(x))
            if self.head_norm is not None:
                x = self.head_norm(x)
        logits = self.lm_head(x)
        if self.config.logit_scale != 1.0:
            logits = logits * self.config.logit_scale
        cap = self.config.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class ViTPool(enum.Enum):
    """What the classifier head reads from the final tokens."""

    CLS = "cls"  # the class token (ViT)
    CLS_AND_MEAN = "cls_and_mean"  # [class token, mean of the patch tokens] (DINOv2's linear head)


@dataclass(frozen=True)
class ViTConfig(ModelConfig):
    """A ViT-style encoder: patches in, class logits out (Dosovitskiy et al., 2021).

    ``pool`` chooses the head's input (:class:`ViTPool`); DINOv2 is ``layerscale(...)`` placement with
    ``ViTPool.CLS_AND_MEAN``.
    """

    image_size: int = 32
    patch_size: int = 8
    in_chans: int = 3
    num_classes: int = 10
    rope: Rope | None = None
    causal: bool = False
    gated: bool = False
    activation: Activation = Activation.GELU
    pool: ViTPool = ViTPool.CLS

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.pool, ViTPool):
            allowed = ", ".join(f"ViTPool.{m.name}" for m in ViTPool)
            raise TypeError(f"pool={self.pool!r} must be one of {allowed}")
        for name in ("image_size", "patch_size", "in_chans", "num_classes"):
            _positive(getattr(self, name), name)
        if self.image_size % self.patch_size:
            raise ValueError(f"patch_size={self.patch_size} must divide image_size={self.image_size}")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class ViTEncoder(_Stack):
    """Patch embedding (a strided conv), a class token, learned positions, the blocks, a final norm and a head."""

    config: ViTConfig

    def __init__(self, config: ViTConfig) -> None:
        super().__init__(config, ViTConfig)
        cfg, d = config, config.d_model
        self.patch_embed = nn.Conv2d(cfg.in_chans, d, cfg.patch_size, stride=cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.n_patches + 1, d))
        self._add_layers(as_factory(cfg.norm))
        self.head = nn.Linear(2 * d if cfg.pool is ViTPool.CLS_AND_MEAN else d, cfg.num_classes)
        self._init_weights()
        nn.init.normal_(self.pos_embed, std=cfg.init_std)
        nn.init.normal_(self.cls_token, std=cfg.init_std)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        x = self.run_layers(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.config.pool is ViTPool.CLS_AND_MEAN:
            return self.head(torch.cat((x[:, 0], x[:, 1:].mean(dim=1)), dim=-1))
        return self.head(x[:, 0])
