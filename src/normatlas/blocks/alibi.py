"""ALiBi (Press et al., 2022, "Train Short, Test Long"): a per-head linear bias on the attention scores in place of
position embeddings. Head ``h`` adds ``slope[h] * (j - i)`` to the score of query ``i`` on key ``j``::

    scores[h, i, j] = q_i . k_j * scale + slope[h] * (j - i)        (then the mask, then the softmax)

The softmax is the same for any per-row constant added, so BLOOM's ``slope * j`` (keys counted from 0) and MPT's
``slope * (j - (T - 1))`` are this bias. :class:`Alibi` is the value (one slope per head, in the scores' units:
a model that scales after adding the bias has its scale folded into the slopes); :func:`geometric_slopes` gives the
paper's ``2 ** (-8 h / n)`` sequence for building one from scratch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Alibi", "alibi_bias", "geometric_slopes"]


def geometric_slopes(n_heads: int, max_bias: float = 8.0) -> tuple[float, ...]:
    """The paper's slopes: ``2 ** (-max_bias * h / n)`` for ``h = 1..n`` when ``n`` is a power of two; otherwise the
    ``m`` slopes of the largest power of two ``m < n``, then every other slope of the ``2m`` sequence."""
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"n_heads={n_heads!r} must be an integer >= 1")
    if not (isinstance(max_bias, (int, float)) and math.isfinite(max_bias) and max_bias > 0):
        raise ValueError(f"max_bias={max_bias!r} must be a finite float > 0")

    def powers(n: int) -> list[float]:
        return [2.0 ** (-max_bias * h / n) for h in range(1, n + 1)]

    m = 2 ** (n_heads.bit_length() - 1)
    out = powers(m)
    if m < n_heads:
        out += powers(2 * m)[0::2][: n_heads - m]
    return tuple(out)


@dataclass(frozen=True)
class Alibi:
    """One ALiBi slope per head (see the module docstring). Validated at construction: a non-empty tuple of finite
    floats (a slope of 0 is a head without a bias)."""

    slopes: tuple[float, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.slopes, tuple) or not self.slopes:
            raise TypeError(f"slopes={self.slopes!r} must be a non-empty tuple of floats, one per head")
        for s in self.slopes:
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
                raise ValueError(f"slopes holds {s!r}; every slope must be a finite float")
        object.__setattr__(self, "slopes", tuple(float(s) for s in self.slopes))

    @classmethod
    def geometric(cls, n_heads: int, max_bias: float = 8.0) -> Alibi:
        """The paper's slopes for ``n_heads`` heads (:func:`geometric_slopes`)."""
        return cls(geometric_slopes(n_heads, max_bias))

    def check_heads(self, n_heads: int) -> None:
        if len(self.slopes) != n_heads:
            raise ValueError(f"alibi has {len(self.slopes)} slopes for n_heads={n_heads}; give one per head")


def alibi_bias(alibi: Alibi, t: int, s: int, dtype: torch.dtype, device: torch.device | None = None) -> Tensor:
    """The ``(H, T, S)`` bias ``slope[h] * (j - i)`` for ``T`` queries at the last positions of ``S`` keys."""
    work = torch.promote_types(dtype, torch.float32)
    i = torch.arange(s - t, s, device=device)[:, None]
    j = torch.arange(s, device=device)[None, :]
    slopes = torch.tensor(alibi.slopes, dtype=work, device=device)
    return (slopes[:, None, None] * (j - i).to(work)).to(dtype)
