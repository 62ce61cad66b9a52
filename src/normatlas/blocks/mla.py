"""Multi-head Latent Attention (MLA; DeepSeek-AI, DeepSeek-V2, 2024): q and kv through low-rank latents.

::

    x --q_a--> c_q (q_lora_rank) --N_q--> --q_b--> q: per head [nope | rope]        (or q = q_proj(x))
    x --kv_a--> [c_kv (kv_lora_rank) | k_rope (rope, one head)]
                 c_kv --N_kv--> --kv_b--> per head [k_nope | v]
    k = [k_nope | RoPE(k_rope) shared by every head],  q = [q_nope | RoPE(q_rope)]
    out = o_proj(softmax(q.k * scale) v)        (v: v_head_dim, q / k: nope + rope)

Only the ``rope`` part of each head is rotated (the decoupled RoPE); ``N_q`` / ``N_kv`` are norms on the latents,
norm sites of our one core (:class:`~normatlas.Norm` with :attr:`MLAConfig.latent_norm`). The arithmetic follows
the eager reference of HF transformers (scores in the input dtype, softmax in fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..modules import Norm
from ..spec import NormSpec
from .attention import RopeStyle, apply_rope

__all__ = ["MLAConfig", "MLAttention"]


def _dim(value: object, name: str, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low}")


@dataclass(frozen=True)
class MLAConfig:
    """MLA's shape as a value (see the module docstring). Validated at construction.

    ``q_lora_rank=None``: q is one full-rank projection (DeepSeek-V2-Lite). ``qk_rope_head_dim`` is the rotated part
    of each q / k head (the key's is one head shared by all), ``qk_nope_head_dim`` the part without RoPE (may be 0),
    ``v_head_dim`` the value head. ``latent_norm`` is the spec of the norms on the q and kv latents."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    latent_norm: NormSpec | None = None

    def __post_init__(self) -> None:
        _dim(self.kv_lora_rank, "kv_lora_rank")
        _dim(self.qk_rope_head_dim, "qk_rope_head_dim")
        _dim(self.qk_nope_head_dim, "qk_nope_head_dim", allow_zero=True)
        _dim(self.v_head_dim, "v_head_dim")
        if self.q_lora_rank is not None:
            _dim(self.q_lora_rank, "q_lora_rank")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if self.latent_norm is not None and not isinstance(self.latent_norm, NormSpec):
            raise TypeError(f"latent_norm={self.latent_norm!r} must be a NormSpec or None (no latent norms)")

    @property
    def qk_head_dim(self) -> int:
        """The width of one q / k head: the part without RoPE, then the rotated part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class MLAttention(nn.Module):
    """Multi-head latent attention; ``forward`` takes what :class:`~normatlas.blocks.attention.Attention` takes
    (RoPE tables of width ``qk_rope_head_dim``, a boolean mask). Parameters: ``q_a_proj``, ``q_norm``, ``q_b_proj``
    (or ``q_proj``), ``kv_a_proj``, ``kv_norm``, ``kv_b_proj``, ``o_proj``; ``scale`` defaults to
    ``qk_head_dim ** -0.5``."""

    def __init__(
        self, d_model: int, n_heads: int, config: MLAConfig, *, bias: bool = False, out_bias: bool = False,
        scale: float | None = None, softcap: float | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        if not isinstance(config, MLAConfig):
            raise TypeError(f"config={config!r} must be an MLAConfig")
        _dim(d_model, "d_model")
        _dim(n_heads, "n_heads")
        if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"softcap={softcap!r} must be a finite float > 0 or None")
        c = config
        self.config, self.n_heads = c, n_heads
        self.n_kv_heads, self.head_dim, self.rope_head_dim = n_heads, c.qk_head_dim, c.qk_rope_head_dim
        self.scale = c.qk_head_dim**-0.5 if scale is None else scale
        self.softcap = softcap
        norm = (lambda d: Norm(c.latent_norm, d)) if c.latent_norm is not None else (lambda d: nn.Identity())
        q_out = n_heads * c.qk_head_dim
        self.q_proj = nn.Linear(d_model, q_out, bias=False) if c.q_lora_rank is None else None
        self.q_a_proj = nn.Linear(d_model, c.q_lora_rank, bias=bias) if c.q_lora_rank is not None else None
        self.q_norm = norm(c.q_lora_rank) if c.q_lora_rank is not None else None
        self.q_b_proj = nn.Linear(c.q_lora_rank, q_out, bias=False) if c.q_lora_rank is not None else None
        self.kv_a_proj = nn.Linear(d_model, c.kv_lora_rank + c.qk_rope_head_dim, bias=bias)
        self.kv_norm = norm(c.kv_lora_rank)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, n_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n_heads * c.v_head_dim, d_model, bias=out_bias)

    def queries(self, x: Tensor) -> Tensor:
        """The queries before RoPE, ``(B, T, H, qk_head_dim)``."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_b_proj is not None and self.q_norm is not None
            q = self.q_b_proj(self.q_norm(self.q_a_proj(x)))
        return q.view(*x.shape[:2], self.n_heads, self.head_dim)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor, RopeStyle] | None = None, mask: Tensor | None = None
    ) -> Tensor:
        """``mask``: boolean ``(B or 1, 1, T, T)``, True where a query may attend a key."""
        c, (b, t, _) = self.config, x.shape
        q = self.queries(x).transpose(1, 2)
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_norm(latent)).view(b, t, self.n_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k_rope = k_rope[:, None]  # (B, 1, T, rope): one rotated key head for all heads
        if rope is not None:
            cos, sin, style = rope
            q_rope, k_rope = apply_rope(q_rope, cos, sin, style), apply_rope(k_rope, cos, sin, style)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, self.n_heads, -1, -1)), dim=-1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, self.n_heads * c.v_head_dim)
        return self.o_proj(out)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"heads={self.n_heads}, q_lora_rank={c.q_lora_rank}, kv_lora_rank={c.kv_lora_rank}, "
            f"nope={c.qk_nope_head_dim}, rope={c.qk_rope_head_dim}, v={c.v_head_dim}"
        )
