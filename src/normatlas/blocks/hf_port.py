"""The public entry of the HF ports: ``from_hf`` and ``to_hf_state_dict``, backed by :mod:`normatlas.port`.

There are no per-family key maps: a model's design and every parameter's link are derived from its recorded
dataflow (issue 24). ``port`` sits above ``blocks`` in the layers (docs/architecture.md), so it is imported
here only inside the functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

__all__ = ["from_hf", "to_hf_state_dict"]


def from_hf(hf_model: nn.Module) -> Any:
    """Our :class:`TransformerLM` (a decoder or encoder LM) or :class:`ViTEncoder` (a ViT-style classifier) equal to
    ``hf_model`` (same logits), with its weights; ``model.hf_port`` is the derived :class:`normatlas.port.Port`."""
    from ..port import from_hf as derived

    return derived(hf_model)


def to_hf_state_dict(model: nn.Module, port: Any = None, tensors: Mapping[str, Tensor] | None = None) -> dict[str, Any]:
    """Our state dict (or any dict with our names, e.g. gradients) under the source model's names and layout
    (:func:`normatlas.port.to_hf_state_dict`; ``port`` defaults to ``model.hf_port``)."""
    from ..port import to_hf_state_dict as derived

    return derived(model, port, tensors)  # type: ignore[arg-type]
