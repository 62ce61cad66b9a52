"""Port any transformers model the inspector reads (a decoder, a BERT-style encoder, a ViT-style classifier) into
our one :class:`~normatlas.blocks.Block`, with no per-family key map: the design and the parameter links come from
the model's recorded dataflow.

``from_hf(model)`` builds our :class:`~normatlas.blocks.TransformerLM` (or ``ViTEncoder``) with the same logits;
``port(model)`` also returns the :class:`Port` (the derived config, every parameter's link, the inspector's
report, the check's max abs difference); ``to_hf_state_dict(ours)`` maps our tensors back to the source layout.
What our Block does not express is refused by name (:class:`PortError`). See docs/port.md.
"""

from __future__ import annotations

from .core import CHECK_TOL, Link, Port, example_batch, from_hf, port, to_hf_state_dict
from .errors import PortError

__all__ = ["CHECK_TOL", "Link", "Port", "PortError", "example_batch", "from_hf", "port", "to_hf_state_dict"]
