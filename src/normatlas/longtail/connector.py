"""VLM connector norm: close the vision-text norm gap at the projector.

Essay section on the vision-text norm gap: projected visual tokens arrive in the language
model with norms unrelated to the text embeddings'. :class:`ConnectorNorm` is a LayerNorm
after the projector whose gain is initialised to ``T / sqrt(D)``, ``T`` the mean L2 norm of
the language model's text-embedding rows (:func:`text_embedding_norm`), so the output tokens
have norm ~T (a unit-variance LayerNorm output has norm sqrt(D)). Because the small gain
would also shrink the gradient flowing back into the vision encoder by ~T/sqrt(D), the
backward through the normalisation is multiplied by ``1 / mean(gain)``.

Guarantees (tested): forward ``||y|| = T * sqrt(var / (var + eps))`` per token at init (bias 0),
and the input gradient equals the plain LayerNorm's input gradient times ``1 / mean(gain)``
exactly, with the parameter gradients unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ConnectorNorm", "grad_scale", "text_embedding_norm"]


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.factor, None


def grad_scale(x: Tensor, factor: float) -> Tensor:
    """Identity in the forward; multiplies the gradient by ``factor`` in the backward."""
    out: Tensor = _GradScale.apply(x, factor)
    return out


def text_embedding_norm(embedding: nn.Embedding | Tensor) -> float:
    """T: the mean L2 norm of the rows of a text embedding table (``nn.Embedding`` or its weight)."""
    w = embedding.weight if isinstance(embedding, nn.Embedding) else embedding
    if not isinstance(w, Tensor) or w.dim() != 2:
        raise ValueError("embedding must be an nn.Embedding or a 2-D (vocab, dim) tensor")
    return float(w.detach().double().norm(dim=1).mean())


class ConnectorNorm(nn.Module):
    """LayerNorm after a VLM projector, gain at ``T / sqrt(D)``, backward rescaled by ``1 / mean(gain)``.

    Args:
        dim: D, the language model's hidden size.
        text_norm: T, the mean text-embedding norm (see :meth:`from_embedding`).
        eps, bias: as ``torch.nn.LayerNorm``.
        rescale_backward: multiply the gradient into the input by ``1 / mean(gain)`` (default True).
    """

    def __init__(self, dim: int, text_norm: float, eps: float = 1e-5, bias: bool = True, *,
                 rescale_backward: bool = True) -> None:  # fmt: skip
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim={dim!r} must be an integer >= 1")
        if isinstance(text_norm, bool) or not isinstance(text_norm, (int, float)) or not text_norm > 0:
            raise ValueError(f"text_norm={text_norm!r} must be a float > 0 (the mean text-embedding norm)")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"eps={eps!r} must be a finite float > 0")
        self.dim, self.text_norm, self.eps, self.rescale_backward = dim, float(text_norm), float(eps), rescale_backward
        self.weight = nn.Parameter(torch.full((dim,), self.text_norm / math.sqrt(dim)))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding | Tensor, **kwargs: Any) -> ConnectorNorm:
        """Measure T from the language model's embedding table and build the norm for its width."""
        w = embedding.weight if isinstance(embedding, nn.Embedding) else embedding
        return cls(int(w.shape[1]), text_embedding_norm(embedding), **kwargs)

    def backward_factor(self) -> float:
        """``1 / mean(gain)`` (1 when the rescaling is off)."""
        return 1.0 / float(self.weight.detach().mean()) if self.rescale_backward else 1.0

    def forward(self, input: Tensor) -> Tensor:
        if input.shape[-1] != self.dim:
            raise ValueError(
                f"input of shape {tuple(input.shape)} has last dim {input.shape[-1]}; built for {self.dim}"
            )
        x = grad_scale(input, self.backward_factor()) if self.rescale_backward else input
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, text_norm={self.text_norm:.4g}, eps={self.eps}, rescale_backward={self.rescale_backward}"
