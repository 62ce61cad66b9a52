"""The residual add as a module, and the residual-scaling methods that live in it.

``ResidualAdd(x, branch) = alpha * x + scale * gate * branch`` is the one place
where DeepNorm's alpha, Granite's branch multiplier, ReZero / SkipInit's scalar and
LayerScale's per-channel gain live; a forward hook on it sees the stream and the
branch of every sublayer (diagnostics hook it, as OLMo-core's ``ResidualStream``).

DeepNorm constants follow Wang et al., "DeepNet: Scaling Transformers to 1,000
Layers" (2022), Table 1 (N encoder layers, M decoder layers):

=================  ==========================  ============================
architecture       alpha                       beta
=================  ==========================  ============================
encoder-only       (2N)^(1/4)                  (8N)^(-1/4)
decoder-only       (2M)^(1/4)                  (8M)^(-1/4)
encoder-decoder    enc 0.81 (N^4 M)^(1/16)     enc 0.87 (N^4 M)^(-1/16)
                   dec (3M)^(1/4)              dec (12M)^(-1/4)
=================  ==========================  ============================
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["DeepNormArch", "DeepNormConstants", "LayerScale", "ReZero", "ResidualAdd", "SkipInit", "deepnorm_constants"]


class DeepNormArch(enum.Enum):
    ENCODER = "encoder"
    DECODER = "decoder"
    ENCODER_DECODER = "encoder_decoder"


@dataclass(frozen=True)
class DeepNormConstants:
    """alpha (residual up-weight) and beta (branch init gain); ``decoder`` holds the decoder pair for enc-dec."""

    alpha: float
    beta: float
    decoder: tuple[float, float] | None = None


def _depth(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")
    return value


def deepnorm_constants(arch: DeepNormArch, n_layers: int, n_decoder_layers: int = 0) -> DeepNormConstants:
    """DeepNet's alpha and beta for ``n_layers`` (N, or M for decoder-only) and, for enc-dec, M decoder layers."""
    if not isinstance(arch, DeepNormArch):
        raise TypeError(f"arch={arch!r} must be a DeepNormArch (ENCODER, DECODER, ENCODER_DECODER)")
    n = _depth(n_layers, "n_layers")
    if arch is DeepNormArch.ENCODER_DECODER:
        m = _depth(n_decoder_layers, "n_decoder_layers")
        return DeepNormConstants(
            alpha=0.81 * (n**4 * m) ** (1 / 16),
            beta=0.87 * (n**4 * m) ** (-1 / 16),
            decoder=((3 * m) ** 0.25, (12 * m) ** -0.25),
        )
    return DeepNormConstants(alpha=(2 * n) ** 0.25, beta=(8 * n) ** -0.25)


class _BranchGain(nn.Module):
    """``input * p`` for one learned tensor p filled with a finite value, at init and by ``reset_parameters``.

    LayerScale and ReZero / SkipInit differ only in p's shape, p's name (``_param``: the papers' and timm's, so
    their state dicts load) and the init argument's name (``_arg``, also the attribute that keeps the value).
    """

    _param: str
    _arg: str

    def __init__(
        self, shape: tuple[int, ...], value: object, device: torch.device | str | None, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TypeError(f"{self._arg}={value!r} must be a finite float")
        setattr(self, self._arg, float(value))
        self.register_parameter(self._param, nn.Parameter(torch.full(shape, float(value), device=device, dtype=dtype)))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            getattr(self, self._param).fill_(getattr(self, self._arg))


class LayerScale(_BranchGain):
    """LayerScale (Touvron et al., "Going deeper with Image Transformers", 2021): ``x * gamma``.

    ``gamma`` is one value per channel initialised at ``init_values`` (1e-5 for deep
    models, 1e-4 / 0.1 for shallower ones), so the branch starts near zero. Parameter
    named ``gamma`` as in timm.
    """

    _param, _arg = "gamma", "init_values"
    gamma: nn.Parameter
    init_values: float

    def __init__(self, dim: int, init_values: float = 1e-5, device=None, dtype=None) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim={dim!r} must be an integer >= 1")
        super().__init__((dim,), init_values, device, dtype)

    def forward(self, input: Tensor) -> Tensor:
        return input * self.gamma

    def extra_repr(self) -> str:
        return f"{self.gamma.shape[0]}, init_values={self.init_values:g}"


class ReZero(_BranchGain):
    """ReZero (Bachlechner et al., 2020): ``x * alpha`` with one scalar alpha initialised at 0.

    Applied to a residual branch, the block is exactly the identity at initialisation.
    """

    _param, _arg = "alpha", "init_value"
    alpha: nn.Parameter
    init_value: float

    def __init__(self, init_value: float = 0.0, device=None, dtype=None) -> None:
        super().__init__((), init_value, device, dtype)

    def forward(self, input: Tensor) -> Tensor:
        return input * self.alpha

    def extra_repr(self) -> str:
        return f"init_value={self.init_value:g}"


class SkipInit(ReZero):
    """SkipInit (De & Smith, 2020): a learned scalar at 0 on the residual branch (same arithmetic as ReZero)."""


class ResidualAdd(nn.Module):
    """``alpha * skip_gate(residual) + scale * gate(branch)``: the residual add as a hookable module.

    Args:
        alpha: constant multiplier on the stream (DeepNorm's alpha; 1 otherwise).
        branch_scale: constant multiplier on the branch (Granite's residual multiplier).
        gate: an optional learned multiplier module (:class:`ReZero`, :class:`SkipInit`,
            :class:`LayerScale`), or None.
        skip_gate: an optional learned multiplier on the stream itself (the same modules, initialised at 1:
            Doge's ``input_residual``), or None.

    ``forward(residual, branch)``; a forward hook receives ``(residual, branch)`` as its inputs.
    """

    def __init__(
        self, alpha: float = 1.0, branch_scale: float = 1.0, gate: nn.Module | None = None,
        skip_gate: nn.Module | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        for name, v in (("alpha", alpha), ("branch_scale", branch_scale)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise TypeError(f"{name}={v!r} must be a finite float")
        self.alpha = float(alpha)
        self.branch_scale = float(branch_scale)
        self.gate = gate
        self.skip_gate = skip_gate

    def forward(self, residual: Tensor, branch: Tensor) -> Tensor:
        if self.gate is not None:
            branch = self.gate(branch)
        if self.skip_gate is not None:
            residual = self.skip_gate(residual)
        if self.branch_scale != 1.0:
            branch = branch * self.branch_scale
        if self.alpha != 1.0:
            residual = residual * self.alpha
        return residual + branch

    def extra_repr(self) -> str:
        return f"alpha={self.alpha:.6g}, branch_scale={self.branch_scale:.6g}"
