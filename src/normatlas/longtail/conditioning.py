"""Conditioning norms: AdaIN and adaLN-Zero.

* **AdaIN** (Huang & Belongie, "Arbitrary Style Transfer in Real-time with Adaptive Instance
  Normalization", ICCV 2017): ``sigma(y) * (x - mu(x)) / sigma(x) + mu(y)`` with statistics over
  the spatial positions per (sample, channel). Guarantee: the output's per-channel mean and std
  are the style's. The content normalisation is the core's InstanceNorm spec.
* **adaLN-Zero** (Peebles & Xie, "Scalable Diffusion Models with Transformers", ICCV 2023):
  ``x + gate * f(LN(x) * (1 + scale) + shift)`` with ``(shift, scale, gate)`` regressed from the
  conditioning vector by ``Linear(SiLU(c))`` initialised at exactly zero. Guarantee: the block
  is the identity at initialisation, and the gate still receives gradient.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from ..functional import normalize
from ..spec import Axis, Gain, Layout, NormSpec

__all__ = ["AdaIN", "AdaLNZero", "adain", "modulate"]

_INSTANCE = NormSpec(layout=Layout.NC_ANY, reduce=frozenset({Axis.POSITION}), gain=Gain.NONE, bias=False)


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps={eps!r} must be a float > 0")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps={eps!r} must be a finite float > 0")
    return float(eps)


def adain(content: Tensor, style_mean: Tensor, style_std: Tensor, eps: float = 1e-5) -> Tensor:
    """``style_std * InstanceNorm(content) + style_mean``; style statistics shaped (N, C)."""
    if content.dim() < 3:
        raise ValueError(f"content has shape {tuple(content.shape)}; AdaIN needs (N, C, positions...)")
    spec = _INSTANCE.with_(eps=eps)
    view = content.shape[:2] + (1,) * (content.dim() - 2)
    return normalize(content, spec) * style_std.reshape(view) + style_mean.reshape(view)


def _style_stats(style: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    dims = tuple(range(2, style.dim()))
    mean = style.mean(dims)
    std = (style.var(dims, unbiased=False) + eps).sqrt()
    return mean, std


class AdaIN(nn.Module):
    """Adaptive Instance Normalization. ``forward(content, style)``.

    ``style`` is either a feature map ``(N, C, ...)`` (its per-channel mean / std are used) or,
    when ``cond_dim`` is given, a conditioning vector ``(N, cond_dim)`` mapped by a Linear to
    ``(std, mean)`` (StyleGAN's form; the std is ``1 + linear output`` so it starts at 1).
    """

    def __init__(self, num_features: int, cond_dim: int | None = None, eps: float = 1e-5) -> None:
        super().__init__()
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features={num_features!r} must be an integer >= 1")
        if cond_dim is not None and (isinstance(cond_dim, bool) or not isinstance(cond_dim, int) or cond_dim < 1):
            raise ValueError(f"cond_dim={cond_dim!r} must be an integer >= 1 or None (style given as a feature map)")
        self.num_features, self.eps = num_features, _check_eps(eps)
        self.proj = nn.Linear(cond_dim, 2 * num_features) if cond_dim is not None else None
        if self.proj is not None:
            nn.init.zeros_(self.proj.weight)
            nn.init.zeros_(self.proj.bias)

    def forward(self, content: Tensor, style: Tensor) -> Tensor:
        if content.dim() < 3 or content.shape[1] != self.num_features:
            raise ValueError(f"content of shape {tuple(content.shape)} needs (N, {self.num_features}, ...)")
        if self.proj is not None:
            std_delta, mean = self.proj(style).chunk(2, dim=-1)
            return adain(content, mean, 1 + std_delta, self.eps)
        mean, std = _style_stats(style, self.eps)
        return adain(content, mean, std, self.eps)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """DiT's modulation ``x * (1 + scale) + shift``, conditioning ``(N, D)`` broadcast over tokens ``(N, T, D)``."""
    if x.dim() == 3 and shift.dim() == 2:
        shift, scale = shift[:, None], scale[:, None]
    return x * (1 + scale) + shift


class AdaLNZero(nn.Module):
    """adaLN-Zero residual block (DiT)::

        c ── SiLU ── Linear (zero init) ──> shift, scale, gate
        x ─┬─ LN (no affine) ─ modulate(shift, scale) ─ branch ─ * gate ─┐
           └─────────────────────────────────────────────────────────── + ──> out

    ``forward(x, c)`` with ``x`` (N, T, D) or (N, D) and ``c`` (N, cond_dim). ``branch`` is any
    module D -> D (attention, MLP). At initialisation the gate is exactly 0, so ``out == x``.
    """

    def __init__(self, dim: int, cond_dim: int, branch: nn.Module, eps: float = 1e-6) -> None:
        super().__init__()
        for name, v in (("dim", dim), ("cond_dim", cond_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
        self.norm = nn.LayerNorm(dim, eps=_check_eps(eps), elementwise_affine=False)
        self.branch = branch
        self.ada = nn.Linear(cond_dim, 3 * dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def modulation(self, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(shift, scale, gate)`` from the conditioning vector."""
        shift, scale, gate = self.ada(F.silu(c)).chunk(3, dim=-1)
        return shift, scale, gate

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale, gate = self.modulation(c)
        out = self.branch(modulate(self.norm(x), shift, scale))
        if x.dim() == 3 and gate.dim() == 2:
            gate = gate[:, None]
        return x + gate * out
