"""Weight-side normalization: Weight Standardization, scaled WS, Adaptive Gradient Clipping,
and torch's spectral / weight norm parametrizations (wrapped, not rewritten).

Essay section on norm-free networks: NFNets (Brock, De, Smith & Simonyan, "High-Performance
Large-Scale Image Recognition Without Normalization", ICML 2021) replace BatchNorm with
scaled Weight Standardization, explicit variance-preserving scalars and AGC.

* :func:`standardize_weight` / :class:`WSConv2d` (Qiao et al., "Micro-Batch Training with
  Batch-Channel Normalization and Weight Standardization", 2019): every output filter is
  standardized to zero mean and unit variance over its fan-in, ``(W - mean) / sqrt(var + eps)``.
  Guarantee: the output is invariant to ``W_i -> a_i W_i + b_i`` per filter (a_i > 0).
* :class:`ScaledWSConv2d` (Brock et al., 2021, "Characterizing signal propagation...", NF-ResNets):
  ``gain * gamma * (W - mean) / sqrt(max(var * fan_in, eps))`` so a unit-variance input gives
  a ``gamma^2``-variance output; ``gain`` learnable per filter (init 1).
* :func:`adaptive_clip_grad_` (AGC, Brock et al., 2021): unit-wise, ``G_i <- lambda * max(||W_i||, eps)
  / ||G_i|| * G_i`` when ``||G_i|| / max(||W_i||, eps) > lambda``. Guarantee: afterwards every
  unit's gradient norm is at most ``lambda * max(||W_i||, eps)``, direction unchanged.
* :func:`spectral_norm`, :func:`weight_norm`, :func:`remove_parametrization`,
  :func:`apply_parametrization`: thin wrappers over ``torch.nn.utils.parametrizations``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrizations, parametrize

from ._report import Change, ConversionReport

__all__ = [
    "ScaledWSConv2d",
    "WSConv2d",
    "adaptive_clip_grad_",
    "apply_parametrization",
    "remove_parametrization",
    "spectral_norm",
    "standardize_weight",
    "unitwise_norm",
    "weight_norm",
]


def _positive(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite float > 0")
    return float(value)


def standardize_weight(
    weight: Tensor, eps: float = 1e-5, *, scaled: bool = False, gain: Tensor | None = None, gamma: float = 1.0
) -> Tensor:
    """Standardize each output filter (dim 0) over its fan-in (all other dims).

    ``scaled=False``: ``(W - mean) / sqrt(var + eps)`` (WS). ``scaled=True``:
    ``gamma * (W - mean) / sqrt(max(var * fan_in, eps))`` (NFNets' scaled WS). ``gain`` (shape
    ``(out,)``) multiplies each filter. Variance is the biased one, in at least fp32.
    """
    if weight.dim() < 2:
        raise ValueError(f"weight has shape {tuple(weight.shape)}; standardization needs (out, fan_in...)")
    dims = tuple(range(1, weight.dim()))
    fan_in = math.prod(weight.shape[1:])
    w = weight.float() if weight.dtype in (torch.float16, torch.bfloat16) else weight
    mean = w.mean(dims, keepdim=True)
    var = w.var(dims, keepdim=True, unbiased=False)
    if scaled:
        out = (w - mean) * torch.rsqrt(torch.clamp(var * fan_in, min=eps)) * gamma
    else:
        out = (w - mean) * torch.rsqrt(var + eps)
    if gain is not None:
        out = out * gain.reshape((-1,) + (1,) * len(dims)).to(out.dtype)
    return out.to(weight.dtype)


class WSConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose weight is standardized per output filter on every forward (Qiao et al., 2019)."""

    def __init__(self, *args: Any, eps: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.eps = _positive(eps, "eps")

    def forward(self, input: Tensor) -> Tensor:
        return self._conv_forward(input, standardize_weight(self.weight, self.eps), self.bias)


class ScaledWSConv2d(nn.Conv2d):
    """NFNets' scaled WS conv: weight ``gain * gamma * (W - mean) / sqrt(max(var * fan_in, eps))``.

    ``gamma`` is the activation's variance-preserving constant (e.g. ``1.7139`` for ReLU in
    NFNets); ``gain`` is a learnable per-filter scale at 1.
    """

    def __init__(self, *args: Any, gamma: float = 1.0, eps: float = 1e-4, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.eps, self.gamma = _positive(eps, "eps"), _positive(gamma, "gamma")
        self.gain = nn.Parameter(torch.ones(self.out_channels, device=self.weight.device, dtype=self.weight.dtype))

    def forward(self, input: Tensor) -> Tensor:
        w = standardize_weight(self.weight, self.eps, scaled=True, gain=self.gain, gamma=self.gamma)
        return self._conv_forward(input, w, self.bias)


def unitwise_norm(x: Tensor) -> Tensor:
    """The L2 norm per output unit: over everything but dim 0 (a scalar for 0-/1-D tensors), kept for broadcast."""
    if x.dim() <= 1:
        return x.norm(2)
    return x.norm(2, dim=tuple(range(1, x.dim())), keepdim=True)


@torch.no_grad()
def adaptive_clip_grad_(parameters: Iterable[Tensor] | Tensor, clipping: float = 0.01, eps: float = 1e-3) -> None:
    """Adaptive Gradient Clipping (Brock et al., 2021), in place, unit-wise relative to the weight norm.

    For every parameter ``W`` with a gradient ``G``, per output unit i:
    ``max_i = clipping * max(||W_i||, eps)``; if ``||G_i|| > max_i`` then ``G_i *= max_i / ||G_i||``.
    NFNets do not clip the final classifier; pass only the parameters to clip.
    """
    _positive(clipping, "clipping")
    _positive(eps, "eps")
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    for p in params:
        if p.grad is None:
            continue
        max_norm = unitwise_norm(p.detach()).clamp_min(eps) * clipping
        grad_norm = unitwise_norm(p.grad)
        clipped = p.grad * (max_norm / grad_norm.clamp_min(1e-6))
        p.grad.copy_(torch.where(grad_norm > max_norm, clipped, p.grad))


def spectral_norm(
    module: nn.Module, name: str = "weight", n_power_iterations: int = 1, eps: float = 1e-12, dim: int | None = None
) -> nn.Module:
    """Spectral normalization (Miyato et al., 2018): ``W / sigma_max(W)`` by power iteration.

    Exactly ``torch.nn.utils.parametrizations.spectral_norm``; the spectral norm of the
    effective weight is 1 (to the power iteration's accuracy).
    """
    return parametrizations.spectral_norm(module, name, n_power_iterations, eps, dim)


def weight_norm(module: nn.Module, name: str = "weight", dim: int | None = 0) -> nn.Module:
    """Weight normalization (Salimans & Kingma, 2016): ``W = g * v / ||v||`` per slice along ``dim``.

    Exactly ``torch.nn.utils.parametrizations.weight_norm``; the initial effective weight
    equals the original one and ``g`` holds its norms.
    """
    return parametrizations.weight_norm(module, name, dim)  # type: ignore[arg-type]  # None = whole tensor


def remove_parametrization(module: nn.Module, name: str = "weight", leave_parametrized: bool = True) -> nn.Module:
    """Undo :func:`spectral_norm` / :func:`weight_norm`, keeping the current effective weight."""
    return parametrize.remove_parametrizations(module, name, leave_parametrized=leave_parametrized)


def apply_parametrization(
    model: nn.Module,
    wrap: Callable[[nn.Module], nn.Module],
    types: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d),
    include: Callable[[str, nn.Module], bool] | None = None,
) -> ConversionReport:
    """Apply ``wrap`` (e.g. :func:`spectral_norm`) to every module of ``types`` in ``model``; report which."""
    report = ConversionReport()
    for path, module in list(model.named_modules()):
        if not isinstance(module, types) or (include is not None and not include(path, module)):
            continue
        if parametrize.is_parametrized(module, "weight"):
            continue
        old = type(module).__name__
        wrap(module)
        name = getattr(wrap, "__name__", type(wrap).__name__)
        report.changes.append(Change(path or "<root>", old, f"{old}+{name}"))
    return report
