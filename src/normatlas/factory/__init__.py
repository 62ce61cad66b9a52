"""The model factory: tiny transformers models built offline from their configs (random weights), and the inputs
they read. It builds what the readers read (:mod:`normatlas.inspect`, :mod:`normatlas.port`, the benchmarks and
tests); it reads no design itself.

* :mod:`.shrink`: the one shrink (:func:`~.shrink.shrink`) of a text stack, a vision tower and a connector's
  config, and the refits that follow it; :func:`tiny_config` for a model type.
* :mod:`.text`: :func:`build_target` (a model type, a checkpoint folder under :mod:`normatlas.checkpoint`'s load
  policy, or ``module:factory``), with :mod:`.fit` keeping a shrunk config buildable.
* :mod:`.tower`: :func:`build_vision`, a vision tower alone; :mod:`.vlm`: :func:`build_vlm`, an image-text model
  (language model, tower, connector); :func:`is_vision_type` / :func:`is_vlm_type` say which a model type's
  config describes.
* :mod:`.inputs`, :mod:`.tower_inputs`, :mod:`.vlm_inputs`: the token batch, a tower's input layout, the image +
  text batch.
* :mod:`.attention`: the attention implementation models are built with.

Layer (docs/architecture.md): the factory imports only :mod:`normatlas.checkpoint` (and torch, transformers).
"""

from __future__ import annotations

from .attention import ATTENTION_IMPLEMENTATIONS, attention_implementation, attention_kwargs
from .inputs import example_inputs
from .shrink import TINY, check_model_type, tiny_config
from .text import build_target, model_from_config
from .tower import build_vision, is_vision_type
from .tower_inputs import tower_inputs
from .vlm import build_vlm, is_vlm_type
from .vlm_inputs import vlm_inputs

__all__ = [
    "ATTENTION_IMPLEMENTATIONS",
    "TINY",
    "attention_implementation",
    "attention_kwargs",
    "build_target",
    "build_vision",
    "build_vlm",
    "check_model_type",
    "example_inputs",
    "is_vision_type",
    "is_vlm_type",
    "model_from_config",
    "tiny_config",
    "tower_inputs",
    "vlm_inputs",
]
