"""nGPT utilities (Loshchilov, Hsieh, Sun & Ginsburg, "nGPT: Normalized Transformer with
Representation Learning on the Hypersphere", 2024).

Essay section "Normalize everything, everywhere, always": embeddings, hidden states and the
rows of every weight matrix along the embedding dimension live on the unit hypersphere;
after each optimizer step the weights are projected back; each block moves the hidden state
toward the block's (normalized) output with a learned per-dimension rate:

    h <- Norm(h + alpha * (Norm(h_block) - h))

* :func:`sphere` – ``x / ||x||`` on the last dim (``F.normalize``).
* :class:`HypersphereConstraint` – a list of ``(parameter, dim)`` kept unit-norm along ``dim``;
  :meth:`~HypersphereConstraint.attach` renormalises after every ``optimizer.step()``.
* :class:`SphericalUpdate` – the learned-rate interpolation, with nGPT's eigen learning-rate
  parametrisation (stored ``alpha`` at ``alpha_scale``, effective ``alpha * alpha_init / alpha_scale``).

Guarantee: every hidden state and every constrained row has unit norm (to rounding).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["HypersphereConstraint", "SphericalUpdate", "ngpt_constraint", "sphere"]


def sphere(x: Tensor, dim: int = -1, eps: float = 1e-12) -> Tensor:
    """Project onto the unit hypersphere along ``dim``."""
    return F.normalize(x, p=2.0, dim=dim, eps=eps)


class HypersphereConstraint:
    """Keep parameters unit-norm along a dimension (nGPT's weight normalisation after each step)."""

    def __init__(self, params: Iterable[tuple[Tensor, int]]) -> None:
        self.params = []
        for p, dim in params:
            if not isinstance(p, Tensor):
                raise TypeError(f"expected (tensor, dim) pairs, got {type(p).__name__}")
            if isinstance(dim, bool) or not isinstance(dim, int):
                raise TypeError(f"dim={dim!r} must be an int (the axis to keep unit-norm)")
            if not -p.dim() <= dim < p.dim():
                raise ValueError(f"dim={dim} is out of range for a parameter of shape {tuple(p.shape)}")
            self.params.append((p, dim))
        self._handle: Any = None

    @torch.no_grad()
    def apply(self) -> None:
        """Renormalise every parameter in place."""
        for p, dim in self.params:
            p.copy_(sphere(p, dim))

    def attach(self, optimizer: torch.optim.Optimizer) -> Any:
        """Renormalise after every ``optimizer.step()`` (a step post-hook); returns the hook handle."""
        self._handle = optimizer.register_step_post_hook(lambda *_: self.apply())
        return self._handle


def ngpt_constraint(model: nn.Module, embed_dim: int, *, writes: Iterable[nn.Linear] = ()) -> HypersphereConstraint:
    """Constrain every ``nn.Embedding`` row and every ``nn.Linear`` weight along its ``embed_dim`` axis.

    A Linear reading from the residual stream (``in_features == embed_dim``) is normalised per
    row (dim 1); one writing into it (``out_features == embed_dim``) per column (dim 0). The choice
    follows the tensor shapes (dataflow), not parameter names. A square Linear is ambiguous from
    its shape: it is taken as a reader (per row, like nGPT's q / k / v) unless it is listed in
    ``writes`` (per column, like nGPT's attention output projection, which writes into the stream).
    """
    writers = list(writes)
    for w in writers:
        if not isinstance(w, nn.Linear):
            raise TypeError(f"writes must hold nn.Linear modules, got {type(w).__name__}")
    pairs: list[tuple[Tensor, int]] = []
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module.embedding_dim == embed_dim:
            pairs.append((module.weight, 1))
        elif isinstance(module, nn.Linear):
            if any(module is w for w in writers):
                if module.out_features != embed_dim:
                    raise ValueError(
                        f"writes holds a Linear with out_features={module.out_features}; a Linear writing into "
                        f"the stream needs out_features == embed_dim={embed_dim}"
                    )
                pairs.append((module.weight, 0))
            elif module.in_features == embed_dim:
                pairs.append((module.weight, 1))
            elif module.out_features == embed_dim:
                pairs.append((module.weight, 0))
    constraint = HypersphereConstraint(pairs)
    constraint.apply()
    return constraint


class SphericalUpdate(nn.Module):
    """nGPT's residual update ``h <- Norm(h + alpha * (Norm(h_block) - h))`` with learned ``alpha`` per dim.

    Args:
        dim: the embedding dimension.
        alpha_init: the effective initial rate (nGPT: 0.05, or ``1 / n_layers``).
        alpha_scale: the stored parameter's initial value (nGPT: ``1 / sqrt(dim)``); the
            effective rate is ``alpha * alpha_init / alpha_scale``.
    """

    def __init__(self, dim: int, alpha_init: float = 0.05, alpha_scale: float | None = None) -> None:
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim={dim!r} must be an integer >= 1")
        scale = 1.0 / math.sqrt(dim) if alpha_scale is None else alpha_scale
        for name, v in (("alpha_init", alpha_init), ("alpha_scale", scale)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name}={v!r} must be a finite float > 0")
        self.alpha_init, self.alpha_scale = float(alpha_init), float(scale)
        self.alpha = nn.Parameter(torch.full((dim,), self.alpha_scale))

    def rate(self) -> Tensor:
        """The effective per-dimension interpolation rate."""
        return self.alpha * (self.alpha_init / self.alpha_scale)

    def forward(self, h: Tensor, h_block: Tensor) -> Tensor:
        return sphere(h + self.rate().to(h.dtype) * (sphere(h_block) - h))
