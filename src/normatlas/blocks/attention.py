"""Multi-head attention with GQA, RoPE or ALiBi, QK-norm / QKV-norm, logit soft-capping and sliding windows.

The arithmetic follows the eager reference of HF transformers (scores in the
input dtype, softmax in fp32), so ported weights reproduce the reference logits.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..vocabulary import RopeOrder
from .alibi import Alibi, alibi_bias
from .attn_gate import OutputGate, softmax_with_sinks
from .qknorm import QKNorm, QKNormConfig, QKScope

__all__ = ["Attention", "Rope", "RopeStyle", "apply_rope", "rope_tables"]


class RopeStyle(enum.Enum):
    """How RoPE pairs the dims it rotates."""

    HALF = "half"  # (i, i + d/2): GPT-NeoX, Llama, Qwen, Gemma, OLMo
    INTERLEAVED = "interleaved"  # (2i, 2i + 1): GPT-J, Cohere, GLM


def _floats(value: object, name: str) -> tuple[float, ...] | None:
    """A tuple of finite floats >= 0, or None (a zero frequency: a pair that never turns, as in Gemma 4's
    proportional RoPE, which rotates only its leading pairs)."""
    if value is None:
        return None
    if not isinstance(value, tuple) or not value:
        raise TypeError(f"{name}={value!r} must be a non-empty tuple of floats or None")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} holds {v!r}; every entry must be a finite float >= 0")
    return tuple(float(v) for v in value)


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding (Su et al., 2021) over the first ``fraction`` of the head dim.

    Pair ``i`` of the ``d`` rotated dims turns by ``position * inv_freq[i]``: ``inv_freq = theta ** (-2i/d)``
    by default, or the explicit ``inv_freq`` (one per pair, in order: any scaled profile, e.g. position
    interpolation's ``theta ** (-2i/d) / s``, YaRN's or Llama 3's blends). ``attention_factor`` multiplies cos and
    sin (YaRN's and LongRoPE's ``mscale``; it scales each rotated q.k by its square). ``long_inv_freq`` is a second
    profile used instead whenever the sequence (the largest position + 1) is longer than ``long_after`` (LongRoPE's
    short and long factors). ``clockwise`` turns every pair the other way, by ``-angle`` (NanoChat's rotate-half
    ``(x2, -x1)``)::

        angle[t, i] = t * f[i],  f = long_inv_freq if max(t) + 1 > long_after else (inv_freq or theta ** (-2i/d))
        cos, sin    = attention_factor * cos(angle), attention_factor * sin(angle)   (sin negated if clockwise)
    """

    theta: float = 10000.0
    style: RopeStyle = RopeStyle.HALF
    fraction: float = 1.0
    inv_freq: tuple[float, ...] | None = None
    attention_factor: float = 1.0
    long_inv_freq: tuple[float, ...] | None = None
    long_after: int | None = None
    clockwise: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.clockwise, bool):
            raise TypeError(f"clockwise={self.clockwise!r} must be a bool")
        if not isinstance(self.style, RopeStyle):
            raise TypeError(f"style={self.style!r} must be RopeStyle.HALF or RopeStyle.INTERLEAVED")
        if not (isinstance(self.theta, (int, float)) and self.theta > 0):
            raise ValueError(f"theta={self.theta!r} must be > 0")
        if not (0 < self.fraction <= 1):
            raise ValueError(f"fraction={self.fraction!r} must lie in (0, 1]")
        inv, long = _floats(self.inv_freq, "inv_freq"), _floats(self.long_inv_freq, "long_inv_freq")
        object.__setattr__(self, "inv_freq", inv)
        object.__setattr__(self, "long_inv_freq", long)
        a = self.attention_factor
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not (math.isfinite(a) and a > 0):
            raise ValueError(f"attention_factor={a!r} must be a finite float > 0")
        if (long is None) != (self.long_after is None):
            raise ValueError(
                f"long_inv_freq and long_after={self.long_after!r} go together: give both (LongRoPE) or neither"
            )
        if self.long_after is not None and (
            isinstance(self.long_after, bool) or not isinstance(self.long_after, int) or self.long_after < 1
        ):
            raise ValueError(f"long_after={self.long_after!r} must be an integer >= 1 (a sequence length)")
        if inv is not None and long is not None and len(inv) != len(long):
            raise ValueError(f"inv_freq has {len(inv)} entries but long_inv_freq {len(long)}; one per rotated pair")

    def rotary_dim(self, head_dim: int) -> int:
        d = int(head_dim * self.fraction)
        if d % 2:
            raise ValueError(f"rotary dim {d} (head_dim={head_dim} * fraction={self.fraction}) must be even")
        for name in ("inv_freq", "long_inv_freq"):
            v = getattr(self, name)
            if v is not None and len(v) != d // 2:
                raise ValueError(
                    f"{name} has {len(v)} entries; the rotary dim {d} (head_dim={head_dim} * fraction="
                    f"{self.fraction}) rotates {d // 2} pairs, one frequency each"
                )
        return d

    def frequencies(self, head_dim: int, length: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """The inverse frequency of each rotated pair for a sequence of ``length`` positions, in ``dtype``."""
        d = self.rotary_dim(head_dim)
        if self.long_inv_freq is not None and self.long_after is not None and length > self.long_after:
            return torch.tensor(self.long_inv_freq, dtype=dtype)
        if self.inv_freq is not None:
            return torch.tensor(self.inv_freq, dtype=dtype)
        steps = torch.arange(0, d, 2, dtype=torch.int64).to(dtype) / d
        return 1.0 / (self.theta**steps)


def rope_tables(
    rope: Rope, head_dim: int, positions: Tensor, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """cos and sin of shape ``(T, rotary_dim)`` laid out for ``rope.style``, in ``dtype`` (fp32 as HF)."""
    length = int(positions.max()) + 1 if positions.numel() else 0
    inv_freq = rope.frequencies(head_dim, length, dtype).to(positions.device)
    freqs = positions.to(dtype)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1) if rope.style is RopeStyle.HALF else freqs.repeat_interleave(2, -1)
    cos, sin = emb.cos(), emb.sin()
    if rope.clockwise:
        sin = -sin
    if rope.attention_factor != 1.0:
        cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
    return cos, sin


def _rotate(x: Tensor, style: RopeStyle) -> Tensor:
    if style is RopeStyle.HALF:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, style: RopeStyle) -> Tensor:
    """Rotate ``x`` of shape ``(B, H, T, Dh)``; dims past ``cos.shape[-1]`` pass through."""
    d = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rot, rest = x[..., :d], x[..., d:]
    out = rot * cos + _rotate(rot, style) * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def _positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")
    return value


def _head_dim(d_model: int, n_heads: int, head_dim: int | None) -> int:
    """``head_dim`` if given, else ``d_model // n_heads``, which must then divide exactly."""
    _positive(d_model, "d_model")
    _positive(n_heads, "n_heads")
    if head_dim is not None:
        return _positive(head_dim, "head_dim")
    if d_model % n_heads:
        raise ValueError(
            f"d_model={d_model} is not divisible by n_heads={n_heads}; pass head_dim explicitly "
            f"(the attention width n_heads * head_dim then need not equal d_model)"
        )
    return d_model // n_heads


class Attention(nn.Module):
    """Causal or bidirectional self-attention.

    Args:
        d_model, n_heads, n_kv_heads, head_dim: projection sizes (GQA when n_kv_heads < n_heads).
        qkv_bias, out_bias: biases on the q/k/v and output projections.
        qk_norm: a :class:`QKNormConfig`, or None.
        qkv_norm: three norm modules for q, k and V over the head dim (HybridNorm's QKV-norm), or None;
            with no qk_norm, q and k take the first two.
        v_norm: a :class:`QKNormConfig` for a norm on the values alone (Gemma 3n, Gemma 4: gain-free RMS per head),
            as a QK-norm's operator, scope, gain and eps (its ``order`` must be ``BEFORE_ROPE``: V is not rotated).
        scale: multiplier on q.k (default head_dim ** -0.5).
        softcap: ``cap * tanh(scores / cap)`` before the softmax (Gemma 2).
        sinks: a learned logit per head in each softmax's denominator (parameter ``sinks``, gpt-oss).
        out_gate: an :class:`~normatlas.blocks.attn_gate.OutputGate` on the attention output (``gate_proj``), or None.
        alibi: an :class:`~normatlas.blocks.alibi.Alibi` (one slope per head) added to the scores after the scale
            and soft-cap, before the mask (BLOOM, MPT), or None.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        *,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm: QKNormConfig | None = None,
        qkv_norm: tuple[nn.Module, nn.Module, nn.Module] | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: bool = False,
        out_gate: OutputGate | None = None,
        alibi: Alibi | None = None,
        v_norm: QKNormConfig | None = None,
    ) -> None:
        super().__init__()
        head_dim = _head_dim(d_model, n_heads, head_dim)
        if alibi is not None:
            if not isinstance(alibi, Alibi):
                raise TypeError(f"alibi={alibi!r} must be an Alibi or None")
            alibi.check_heads(n_heads)
        self.alibi = alibi
        if not isinstance(sinks, bool):
            raise TypeError(f"sinks={sinks!r} must be a bool")
        if out_gate is not None and not isinstance(out_gate, OutputGate):
            raise TypeError(f"out_gate={out_gate!r} must be an OutputGate or None")
        n_kv_heads = n_heads if n_kv_heads is None else _positive(n_kv_heads, "n_kv_heads")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rope_head_dim = head_dim  # the width the RoPE tables span (Rope.fraction of it is rotated)
        self.scale = head_dim**-0.5 if scale is None else scale
        if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"softcap={softcap!r} must be a finite float > 0 or None")
        self.softcap = softcap
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=out_bias)
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if sinks else None
        self.out_gate = out_gate
        self.gate_proj = (
            nn.Linear(d_model, out_gate.width(n_heads, head_dim), bias=out_gate.bias) if out_gate is not None else None
        )
        self.qk_config = qk_norm
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        self.v_norm: nn.Module | None = None
        if qk_norm is not None:
            self.q_norm = QKNorm(qk_norm, n_heads, head_dim)
            self.k_norm = QKNorm(qk_norm, n_kv_heads, head_dim)
        if qkv_norm is not None:
            if qk_norm is None:
                self.q_norm, self.k_norm = qkv_norm[0], qkv_norm[1]
            self.v_norm = qkv_norm[2]
        self.v_config = v_norm
        if v_norm is not None:
            if not isinstance(v_norm, QKNormConfig):
                raise TypeError(f"v_norm={v_norm!r} must be a QKNormConfig or None")
            if qkv_norm is not None:
                raise ValueError(f"v_norm={v_norm!r} with a QKV-norm placement: V has one norm slot")
            if v_norm.order is not RopeOrder.BEFORE_ROPE:
                raise ValueError(f"v_norm.order={v_norm.order!r}: V is not rotated; use RopeOrder.BEFORE_ROPE")
            self.v_norm = QKNorm(v_norm, n_kv_heads, head_dim)

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor, RopeStyle] | None = None,
        mask: Tensor | None = None,
    ) -> Tensor:
        """``mask``: boolean ``(B or 1, 1, T, T)``, True where a query may attend a key."""
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        flat = self.qk_config is not None and self.qk_config.scope is QKScope.FLAT
        if flat:
            q, k = self._qk(q, self.q_norm), self._qk(k, self.k_norm)
        v_flat = self.v_config is not None and self.v_config.scope is QKScope.FLAT
        if v_flat:
            v = self._qk(v, self.v_norm)
        q = q.view(b, t, self.n_heads, self.head_dim)
        k = k.view(b, t, self.n_kv_heads, self.head_dim)
        v = v.view(b, t, self.n_kv_heads, self.head_dim)
        after = self.qk_config is not None and self.qk_config.order is RopeOrder.AFTER_ROPE
        if not flat and not after:
            q, k = self._qk(q, self.q_norm), self._qk(k, self.k_norm)
        if self.v_norm is not None and not v_flat:
            v = self.v_norm(v)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if rope is not None:
            cos, sin, style = rope
            q, k = apply_rope(q, cos, sin, style), apply_rope(k, cos, sin, style)
        if after:
            q = self._qk(q.transpose(1, 2), self.q_norm).transpose(1, 2)
            k = self._qk(k.transpose(1, 2), self.k_norm).transpose(1, 2)
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if self.alibi is not None:
            scores = scores + alibi_bias(self.alibi, t, k.shape[-2], scores.dtype, scores.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        if self.sinks is not None:
            probs = softmax_with_sinks(scores, self.sinks).to(q.dtype)
        else:
            # at least fp32 (a bf16 model's softmax in fp32, as transformers' eager attention; a float64 one in float64)
            probs = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)
        if self.gate_proj is not None:
            assert self.out_gate is not None
            out = self.out_gate.apply(out, self.gate_proj(x), self.n_heads)
        return self.o_proj(out)

    @staticmethod
    def _qk(x: Tensor, norm: nn.Module | None) -> Tensor:
        return x if norm is None else norm(x)
