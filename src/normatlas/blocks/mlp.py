"""The MLP slot's dense module: :class:`MLP` (gated or plain) and its :class:`Activation`, a typed value (xIELU, the
learned one, is the module :class:`XIELU`). The block (:mod:`.block`) and the mixture of experts (:mod:`.moe`: its
experts and shared expert) both build it."""

from __future__ import annotations

import enum
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MLP", "XIELU", "Activation"]


class Activation(enum.Enum):
    SILU = "silu"
    GELU = "gelu"  # exact (erf): BERT, ViT
    GELU_TANH = "gelu_tanh"  # tanh approximation: GPT-2 ("gelu_new"), Gemma ("gelu_pytorch_tanh")
    RELU = "relu"
    RELU2 = "relu2"  # ReLU squared (So et al., 2021, Primer): Nemotron, Arcee, Jais 2, BitNet
    XIELU = "xielu"  # xIELU (Huang & Schlag, 2024): learned alpha_p / alpha_n, a module of the MLP (:class:`XIELU`)

    @property
    def learned(self) -> bool:
        """Whether the activation has parameters of its own (it is then a module of the MLP, not a function)."""
        return self is Activation.XIELU

    def __call__(self, x: Tensor) -> Tensor:
        if self.learned:
            raise TypeError(f"Activation.{self.name} has learned parameters: call the MLP's module ({self.value})")
        if self is Activation.SILU:
            return F.silu(x)
        if self is Activation.GELU:
            return F.gelu(x)
        if self is Activation.GELU_TANH:
            return F.gelu(x, approximate="tanh")
        if self is Activation.RELU2:
            return F.relu(x).square()
        return F.relu(x)


class XIELU(nn.Module):
    """xIELU (Huang & Schlag, "Deriving Activation Functions Using Integration", 2024; Apertus)::

        a_p = softplus(alpha_p),  a_n = beta + softplus(alpha_n)
        f(x) = a_p x^2 + beta x                         x > 0
               a_n (expm1(min(x, eps)) - x) + beta x    x <= 0

    ``alpha_p`` / ``alpha_n`` are learned (one value each, stored before the softplus); ``beta`` and ``eps`` are
    constants. Initialised so that ``a_p = alpha_p_init`` and ``a_n = alpha_n_init``.
    """

    def __init__(
        self, alpha_p_init: float = 0.8, alpha_n_init: float = 0.8, beta: float = 0.5, eps: float = -1e-6
    ) -> None:
        super().__init__()
        for name, v in (("alpha_p_init", alpha_p_init), ("alpha_n_init", alpha_n_init), ("beta", beta), ("eps", eps)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise TypeError(f"{name}={v!r} must be a finite float")
        if alpha_p_init <= 0 or alpha_n_init <= beta:
            raise ValueError(
                f"alpha_p_init={alpha_p_init} must be > 0 and alpha_n_init={alpha_n_init} > beta={beta} "
                "(each is a softplus of a parameter, plus beta for alpha_n)"
            )
        if eps > 0:
            raise ValueError(f"eps={eps} must be <= 0 (the negative branch's expm1 reads min(x, eps))")
        self.beta, self.eps = float(beta), float(eps)
        self.alpha_p = nn.Parameter(torch.tensor([math.log(math.expm1(alpha_p_init))]))
        self.alpha_n = nn.Parameter(torch.tensor([math.log(math.expm1(alpha_n_init - beta))]))

    def forward(self, x: Tensor) -> Tensor:
        a_p = F.softplus(self.alpha_p)
        a_n = self.beta + F.softplus(self.alpha_n)
        neg = (torch.expm1(torch.clamp(x, max=self.eps)) - x) * a_n
        return torch.where(x > 0, a_p * x * x, neg) + self.beta * x

    def extra_repr(self) -> str:
        return f"beta={self.beta:g}, eps={self.eps:g}"


class MLP(nn.Module):
    """Gated (SwiGLU / GeGLU: ``down(act(gate(x)) * up(x))``) or plain (``down(act(up(x)))``) FFN; a learned
    activation (:attr:`Activation.learned`: xIELU) is the module ``act``."""

    def __init__(self, d_model: int, d_ff: int, activation: Activation, gated: bool, bias: bool = False) -> None:
        super().__init__()
        if not isinstance(activation, Activation):
            raise TypeError(f"activation={activation!r} must be an Activation")
        self.activation, self.gated = activation, gated
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias) if gated else None
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.act: nn.Module | None = XIELU() if activation is Activation.XIELU else None

    def _act(self, x: Tensor) -> Tensor:
        return self.act(x) if self.act is not None else self.activation(x)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_proj is not None:
            return self.down_proj(self._act(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self._act(self.up_proj(x)))
