"""Two things real decoders add around the attention core: a gate on its output and learned attention sinks.

* **Output gate** (Qiu et al., 2025, "Gated Attention"; Qwen3-Next, AFMoE, HRM, Laguna)::

      out = o_proj(attn(x) * act(gate_proj(x)))       act: sigmoid or softplus; one gate per head and dim, or per head

  :class:`OutputGate` is the value (activation, scope, bias); :class:`~normatlas.blocks.attention.Attention` holds
  ``gate_proj``.
* **Attention sinks** (Xiao et al., 2024; gpt-oss): a learned logit per head joins each query's softmax denominator
  and attends to nothing, so a head can put weight "nowhere": ``softmax([scores, sink])[..., :-1]``, which equals
  ``softmax(scores) * sigmoid(logsumexp(scores) - sink)`` (:func:`softmax_with_sinks`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["GateActivation", "GateScope", "OutputGate", "softmax_with_sinks"]


class GateActivation(enum.Enum):
    SIGMOID = "sigmoid"  # Qwen3-Next, AFMoE, HRM
    SOFTPLUS = "softplus"  # Laguna

    def __call__(self, x: Tensor) -> Tensor:
        return torch.sigmoid(x) if self is GateActivation.SIGMOID else F.softplus(x)


class GateScope(enum.Enum):
    ELEMENT = "element"  # one gate per head and dim: gate_proj is d_model -> n_heads * head_dim
    HEAD = "head"  # one gate per head: gate_proj is d_model -> n_heads


@dataclass(frozen=True)
class OutputGate:
    """A gate on the attention output (see the module docstring). Validated at construction."""

    activation: GateActivation = GateActivation.SIGMOID
    scope: GateScope = GateScope.ELEMENT
    bias: bool = False

    def __post_init__(self) -> None:
        for name, t in (("activation", GateActivation), ("scope", GateScope)):
            if not isinstance(getattr(self, name), t):
                allowed = ", ".join(f"{t.__name__}.{m.name}" for m in t)
                raise TypeError(f"{name}={getattr(self, name)!r} must be one of {allowed}")
        if not isinstance(self.bias, bool):
            raise TypeError(f"bias={self.bias!r} must be a bool")

    def width(self, n_heads: int, head_dim: int) -> int:
        """The gate projection's output width."""
        return n_heads if self.scope is GateScope.HEAD else n_heads * head_dim

    def apply(self, out: Tensor, gate: Tensor, n_heads: int) -> Tensor:
        """``out`` ``(B, T, H * Dv)`` times ``act(gate)`` (``(B, T, H * Dv)``, or ``(B, T, H)`` for one per head)."""
        g = self.activation(gate)
        if self.scope is GateScope.HEAD:
            return (out.unflatten(-1, (n_heads, -1)) * g[..., None]).flatten(-2)
        return out * g


def softmax_with_sinks(scores: Tensor, sinks: Tensor) -> Tensor:
    """``softmax([scores, sink_h])`` over the keys with the sink's share dropped, in at least fp32 (float64 stays
    float64); ``scores`` is ``(B, H, T, S)``, ``sinks`` ``(H,)``. The rows sum to less than one by the sink's share."""
    dt = torch.promote_types(scores.dtype, torch.float32)
    s = scores.to(dt)
    sink = sinks.to(dt).reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    return F.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :-1]
