"""VLM connectors the essay's VLM section names: a Perceiver resampler, Flamingo's tanh-gated cross-attention and
norms split by modality inside a shared block.

Every norm is the library's (a :class:`~normatlas.spec.NormSpec`, or a factory ``dim -> module`` such as
``normatlas.RMSNorm``; default: LayerNorm, torch's eps 1e-5), every residual add a
:class:`~normatlas.blocks.ResidualAdd`, and each module states its design in the vocabulary
(:class:`~normatlas.vocabulary.ConnectorKind`, :class:`~normatlas.vocabulary.Injection`,
:class:`~normatlas.vocabulary.PlacementKind`).

* :class:`PerceiverResampler` (Alayrac et al., 2022, "Flamingo"; ``ConnectorKind.RESAMPLER``): ``num_latents``
  learned queries cross-attend to the image tokens, ``depth`` times; keys and values are the normed image tokens
  concatenated with the normed latents (``latents_in_kv``); then an FFN; a final norm::

      media ──► N_media ──┐
      latents ─► N_lat ───┴─► [k, v] ; q = N_lat(latents)
      latents ◄─ (+) ◄─ attention(q, k, v)          x depth, each followed by
      latents ◄─ (+) ◄─ FFN(N(latents))
      out = N_final(latents)                        (B, num_latents, embed_dim)

* :class:`GatedCrossAttentionBlock` (Flamingo's GATED XATTN-DENSE; ``Injection.GATED_CROSS_ATTENTION``): the text
  stream cross-attends to the media, then an FFN, each branch multiplied by ``tanh(alpha)`` with ``alpha`` starting
  at 0, so the block is exactly the identity at init and the frozen language model's function is kept::

      x ───────────────────────────────► (+) ──► x ───────────────────► (+) ──► x'
      └─► N ──► attention(q=., kv=media) ──┘tanh(a_attn)   └─► N ──► FFN ──┘tanh(a_ffn)

* :class:`ModalitySplitNorm`: one norm per modality (text, image), routed by a boolean image-token mask the caller
  passes (never by names); :class:`ModalityBlock` is a transformer block whose attention and FFN are shared by both
  modalities and whose every norm slot (from a :class:`~normatlas.blocks.Placement`) is split (BEiT-3's multiway
  LayerNorms: torchscale's ``MultiwayWrapper`` splits them at a token position; here the caller's mask routes them.
  CogVLM's visual expert is the converse: its norms are shared and its projections split).

Guarantees (tested): each forward equals an independent float64 computation in plain torch, forward and backward;
the gated block returns its input bit for bit at init; a split norm on an all-text (all-image) mask is the text
(image) norm alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..blocks.attention import Attention, RopeStyle
from ..blocks.block import MLP, Activation, _residual
from ..blocks.model import as_factory
from ..blocks.placement import DepthScale, NormFactory, Placement, pre_ln
from ..blocks.residual import ResidualAdd
from ..spec import NormSpec
from ..vocabulary import ConnectorKind, Injection, PlacementKind

__all__ = [
    "CrossAttention",
    "GatedCrossAttentionBlock",
    "ModalityBlock",
    "ModalitySplitNorm",
    "PerceiverLayer",
    "PerceiverResampler",
    "TanhGate",
]

Norm = NormSpec | NormFactory | None


def _int(value: object, name: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    return value


def _factory(norm: Norm) -> Callable[[int], nn.Module]:
    """The norm operator as a factory; None is LayerNorm (``NormSpec()``); a batch-statistics spec is refused."""
    if isinstance(norm, NormSpec) and norm.batch_dependent:
        raise ValueError(
            f"norm={norm!r} reduces over samples (a batch-statistics norm); the connectors normalise each token "
            "alone: give a per-token NormSpec (LayerNorm, RMSNorm) or a factory"
        )
    made = as_factory(NormSpec() if norm is None else norm)
    assert made is not None
    return made


def _tensor(x: object, name: str, dim: int, width: int | None = None, width_name: str = "") -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dim or not x.is_floating_point():
        raise ValueError(f"{name} has shape {tuple(x.shape)} and dtype {x.dtype}; expected a {dim}-D floating tensor")
    if width is not None and x.shape[-1] != width:
        raise ValueError(f"{name} has last dim {x.shape[-1]}; built for {width_name}={width}")
    return x


def _bool_mask(mask: object, name: str, shape: tuple[int, ...]) -> Tensor:
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"{name} must be a boolean torch.Tensor, got {got}")
    if tuple(mask.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)}; expected {shape}")
    return mask


class TanhGate(nn.Module):
    """``tanh(alpha) * x``, one learned scalar ``alpha`` (Flamingo's gate), initialised at ``init`` (0: closed)."""

    def __init__(self, init: float = 0.0) -> None:
        super().__init__()
        if isinstance(init, bool) or not isinstance(init, (int, float)) or not math.isfinite(init):
            raise TypeError(f"init={init!r} must be a finite float")
        self.alpha = nn.Parameter(torch.tensor(float(init)))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.alpha) * x  # a 0-dim factor keeps x's dtype

    def extra_repr(self) -> str:
        return f"alpha={float(self.alpha.detach()):.4g}"


class CrossAttention(nn.Module):
    """Multi-head attention of ``query`` tokens to ``key`` / ``value`` tokens of other widths (``kdim``, ``vdim``,
    as ``torch.nn.MultiheadAttention``), computed by ``F.scaled_dot_product_attention`` (so the Monitor's
    attention capture sees it). ``key_padding_mask`` ``(B, S)``: True where a key is padding (torch's convention).
    """

    def __init__(
        self, embed_dim: int, num_heads: int, kdim: int | None = None, vdim: int | None = None, bias: bool = False
    ) -> None:
        super().__init__()
        _int(embed_dim, "embed_dim")
        _int(num_heads, "num_heads")
        if embed_dim % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide embed_dim={embed_dim}")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else _int(kdim, "kdim")
        self.vdim = embed_dim if vdim is None else _int(vdim, "vdim")
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias)
        self.o_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        _tensor(query, "query", 3, self.embed_dim, "embed_dim")
        _tensor(key, "key", 3, self.kdim, "kdim")
        _tensor(value, "value", 3, self.vdim, "vdim")
        b, s = key.shape[0], key.shape[1]
        if query.shape[0] != b or value.shape[:2] != key.shape[:2]:
            raise ValueError(
                f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} must share the "
                "batch, and key and value the length"
            )
        allowed = None
        if key_padding_mask is not None:
            pad = _bool_mask(key_padding_mask, "key_padding_mask", (b, s))
            if bool(pad.all(1).any()):
                raise ValueError("key_padding_mask masks every key of an example; each needs one key to attend to")
            allowed = ~pad[:, None, None, :]
        h, d = self.num_heads, self.head_dim
        q = self.q_proj(query).unflatten(-1, (h, d)).transpose(1, 2)
        k = self.k_proj(key).unflatten(-1, (h, d)).transpose(1, 2)
        v = self.v_proj(value).unflatten(-1, (h, d)).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class PerceiverLayer(nn.Module):
    """One resampler layer: latents cross-attend to ``[N_media(media), N_latents(latents)]``, then a pre-norm FFN."""

    def __init__(
        self, embed_dim: int, num_heads: int, ffn_dim: int, norm: Norm = None, *, latents_in_kv: bool = True
    ) -> None:
        super().__init__()
        make = _factory(norm)
        if not isinstance(latents_in_kv, bool):
            raise TypeError(f"latents_in_kv={latents_in_kv!r} must be a bool")
        self.latents_in_kv = latents_in_kv
        self.media_norm, self.latents_norm, self.ffn_norm = make(embed_dim), make(embed_dim), make(embed_dim)
        self.attn = CrossAttention(embed_dim, num_heads)
        self.mlp = MLP(embed_dim, _int(ffn_dim, "ffn_dim"), Activation.GELU, gated=False)
        self.attn_residual, self.ffn_residual = ResidualAdd(), ResidualAdd()

    def forward(self, latents: Tensor, media: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        m, q = self.media_norm(media), self.latents_norm(latents)
        kv, pad = m, key_padding_mask
        if self.latents_in_kv:
            kv = torch.cat((m, q), dim=1)
            if pad is not None:
                pad = torch.cat((pad, pad.new_zeros(pad.shape[0], q.shape[1])), dim=1)
        latents = self.attn_residual(latents, self.attn(q, kv, kv, pad))
        return self.ffn_residual(latents, self.mlp(self.ffn_norm(latents)))


class PerceiverResampler(nn.Module):
    """Flamingo's Perceiver resampler: ``(B, T, embed_dim)`` image tokens in, ``(B, num_latents, embed_dim)`` out.

    Args:
        embed_dim: the width of the image tokens and of the latents.
        num_heads: attention heads (must divide ``embed_dim``).
        num_latents: learned queries, the number of tokens out.
        depth: resampler layers (:class:`PerceiverLayer`).
        ffn_dim: the FFN's hidden width (default ``4 * embed_dim``).
        norm: the norm operator of every slot (media, latents, FFN, final): a per-token NormSpec or a factory;
            None is LayerNorm.
        latents_in_kv: keys and values hold the latents beside the media (Flamingo); False: the media alone.
        final_norm: a norm on the output latents (Flamingo: yes).

    ``forward(input, key_padding_mask=None)``: ``key_padding_mask`` ``(B, T)`` True where an image token is padding.
    """

    connector_kind = ConnectorKind.RESAMPLER
    placement_kind = PlacementKind.PRE  # every residual branch reads normed inputs; the stream is never normed

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_latents: int,
        depth: int = 1,
        ffn_dim: int | None = None,
        norm: Norm = None,
        *,
        latents_in_kv: bool = True,
        final_norm: bool = True,
    ) -> None:
        super().__init__()
        self.embed_dim = _int(embed_dim, "embed_dim")
        self.num_latents, self.depth = _int(num_latents, "num_latents"), _int(depth, "depth")
        ffn = 4 * embed_dim if ffn_dim is None else ffn_dim
        self.latents = nn.Parameter(torch.randn(num_latents, embed_dim))
        self.layers = nn.ModuleList(
            PerceiverLayer(embed_dim, num_heads, ffn, norm, latents_in_kv=latents_in_kv) for _ in range(depth)
        )
        if not isinstance(final_norm, bool):
            raise TypeError(f"final_norm={final_norm!r} must be a bool")
        self.final_norm = _factory(norm)(embed_dim) if final_norm else None

    def forward(self, input: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        _tensor(input, "input", 3, self.embed_dim, "embed_dim")
        if key_padding_mask is not None:
            _bool_mask(key_padding_mask, "key_padding_mask", tuple(input.shape[:2]))
        x = self.latents.to(input.dtype).expand(input.shape[0], -1, -1)
        for layer in self.layers:
            x = layer(x, input, key_padding_mask)
        return x if self.final_norm is None else self.final_norm(x)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_latents={self.num_latents}, depth={self.depth}"


class GatedCrossAttentionBlock(nn.Module):
    """Flamingo's gated cross-attention dense block, inserted before a language-model layer.

    Args:
        embed_dim: the language model's width.
        num_heads: attention heads.
        kdim: the media tokens' width (default ``embed_dim``), as ``torch.nn.MultiheadAttention``'s.
        ffn_dim: the FFN's hidden width (default ``4 * embed_dim``).
        norm: the operator of the two pre-norms (a per-token NormSpec or a factory; None is LayerNorm).
        gate_init: the initial ``alpha`` of both ``tanh(alpha)`` gates; 0 (Flamingo) makes the block the identity.

    ``forward(input, media, key_padding_mask=None)``: ``input`` ``(B, T, embed_dim)``, ``media`` ``(B, S, kdim)``,
    ``key_padding_mask`` ``(B, S)`` True where a media token is padding (``torch.nn.MultiheadAttention``'s name).
    """

    injection = Injection.GATED_CROSS_ATTENTION
    placement_kind = PlacementKind.PRE

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kdim: int | None = None,
        ffn_dim: int | None = None,
        norm: Norm = None,
        *,
        gate_init: float = 0.0,
    ) -> None:
        super().__init__()
        make = _factory(norm)
        self.embed_dim = _int(embed_dim, "embed_dim")
        self.attn_norm, self.ffn_norm = make(embed_dim), make(embed_dim)
        self.attn = CrossAttention(embed_dim, num_heads, kdim=kdim, vdim=kdim)
        self.mlp = MLP(
            embed_dim, _int(4 * embed_dim if ffn_dim is None else ffn_dim, "ffn_dim"), Activation.GELU, False
        )
        self.attn_residual = ResidualAdd(gate=TanhGate(gate_init))
        self.ffn_residual = ResidualAdd(gate=TanhGate(gate_init))

    def gates(self) -> tuple[float, float]:
        """``(tanh(alpha_attn), tanh(alpha_ffn))``: how open each branch is."""
        a, f = self.attn_residual.gate, self.ffn_residual.gate
        assert isinstance(a, TanhGate) and isinstance(f, TanhGate)
        return float(torch.tanh(a.alpha.detach())), float(torch.tanh(f.alpha.detach()))

    def forward(self, input: Tensor, media: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        _tensor(input, "input", 3, self.embed_dim, "embed_dim")
        _tensor(media, "media", 3)
        x = self.attn_residual(input, self.attn(self.attn_norm(input), media, media, key_padding_mask))
        return self.ffn_residual(x, self.mlp(self.ffn_norm(x)))


class ModalitySplitNorm(nn.Module):
    """One norm per modality: ``image_norm`` on the tokens where ``image_mask`` is True, ``text_norm`` on the others.

    Args:
        normalized_shape: the feature width (an int: per-token norms over the last axis).
        norm: the operator of both norms (a per-token NormSpec or a factory; None is LayerNorm).

    ``forward(input, image_mask)``: ``image_mask`` is a boolean tensor of ``input.shape[:-1]`` the caller derives
    from its input (image placeholder ids, a token-type tensor); never inferred here.
    """

    def __init__(self, normalized_shape: int, norm: Norm = None) -> None:
        super().__init__()
        make = _factory(norm)
        self.normalized_shape = _int(normalized_shape, "normalized_shape")
        self.text_norm, self.image_norm = make(normalized_shape), make(normalized_shape)

    def forward(self, input: Tensor, image_mask: Tensor) -> Tensor:
        if not isinstance(input, Tensor) or input.dim() < 1 or input.shape[-1] != self.normalized_shape:
            got = tuple(input.shape) if isinstance(input, Tensor) else type(input).__name__
            raise ValueError(f"input {got} must be a tensor whose last dim is normalized_shape={self.normalized_shape}")
        mask = _bool_mask(image_mask, "image_mask", tuple(input.shape[:-1]))
        # both norms on every token, one chosen per token: twice a norm's (small) cost, and a dataflow the inspector
        # walks (a norm, then a select, then the branch); the unchosen norm gets a zero gradient from that token
        return torch.where(mask[..., None], self.image_norm(input), self.text_norm(input))

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}"


class ModalityBlock(nn.Module):
    """A transformer block shared by text and image tokens whose every norm is a :class:`ModalitySplitNorm`.

    Args:
        embed_dim, num_heads: the attention (:class:`normatlas.blocks.Attention`, no RoPE unless given in forward).
        ffn_dim: the FFN's hidden width.
        placement: where the norms sit (any non-parallel :class:`~normatlas.blocks.Placement` without a QKV-norm,
            depth-scaled pre-norm or post-gain init): each slot it turns on holds a split norm.
        norm: the norm operator (per-token NormSpec or factory; None is LayerNorm).
        activation, gated: the FFN (:class:`normatlas.blocks.MLP`).

    ``forward(input, image_mask, rope=None, mask=None)``: ``mask`` as :class:`normatlas.blocks.Attention`'s (boolean
    ``(B or 1, 1, T, T)``, True where a query may attend a key).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        ffn_dim: int,
        *,
        placement: Placement | None = None,
        norm: Norm = None,
        activation: Activation = Activation.SILU,
        gated: bool = True,
    ) -> None:
        super().__init__()
        p = pre_ln() if placement is None else placement
        if not isinstance(p, Placement):
            raise TypeError(f"placement={p!r} must be a Placement")
        if (
            p.parallel
            or p.qkv_norm
            or p.pre_norm_scale is not DepthScale.NONE
            or p.post_gain_init is not DepthScale.NONE
        ):
            raise ValueError(
                f"placement {p.name!r}: a ModalityBlock takes a sequential placement without qkv_norm, pre_norm_scale "
                "or post_gain_init"
            )
        if not isinstance(activation, Activation):
            raise TypeError(f"activation={activation!r} must be an Activation")
        self.placement, self.embed_dim = p, _int(embed_dim, "embed_dim")
        self.attn = Attention(embed_dim, num_heads)
        self.mlp = MLP(embed_dim, _int(ffn_dim, "ffn_dim"), activation, gated)
        self.norms = nn.ModuleDict()
        for sub, slots in (("attn", p.attn), ("ffn", p.ffn)):
            for slot in slots.slots:
                self.norms[f"{sub}_{slot}"] = ModalitySplitNorm(embed_dim, norm)
        self.attn_residual, self.ffn_residual = _residual(p, "attn", embed_dim), _residual(p, "ffn", embed_dim)

    @property
    def placement_kind(self) -> PlacementKind:
        return self.placement.kind

    def _norm(self, key: str, x: Tensor, image_mask: Tensor) -> Tensor:
        return self.norms[key](x, image_mask) if key in self.norms else x

    def forward(
        self,
        input: Tensor,
        image_mask: Tensor,
        rope: tuple[Tensor, Tensor, RopeStyle] | None = None,
        mask: Tensor | None = None,
    ) -> Tensor:
        _tensor(input, "input", 3, self.embed_dim, "embed_dim")
        _bool_mask(image_mask, "image_mask", tuple(input.shape[:2]))
        x, m = input, image_mask
        y = self._norm("attn_post", self.attn(self._norm("attn_pre", x, m), rope, mask), m)
        x = self._norm("attn_after_add", self.attn_residual(x, y), m)
        y = self._norm("ffn_post", self.mlp(self._norm("ffn_pre", x, m)), m)
        return self._norm("ffn_after_add", self.ffn_residual(x, y), m)
