"""Who reads and who writes what: the coarse dataflow view surgery reads (of :mod:`normatlas.dataflow`).

Method: :func:`record` runs the model once in eval mode under the shared recorder
(:func:`normatlas.dataflow.record`) and collapses it (:func:`normatlas.dataflow.collapse`):
every module that owns parameters directly (a linear layer, an embedding, a norm, a
convolution) is one opaque *call*; every torch call outside such modules (``a + b``,
``x.view(...)``, dropout, RoPE arithmetic) is an *op*. Tensor values are identified by object
identity plus a version that advances on in-place writes.

Guaranteed property: every question answered from the view (the consumers of a norm, the
writers of a residual stream, the path from a projection to a norm) is a fact about the
executed computation, never a guess from parameter or class names. The only type checks are
on the *operator* a module computes (``nn.Linear``, ``Conv1D``, ``nn.Embedding``,
``nn.Conv*d``, :func:`linear_kind`), never on its role.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from .. import dataflow as _core
from ..dataflow import PASS_THROUGH, ROW_PRESERVING, SHAPE_ONLY, Call, Dataflow

__all__ = ["PASS_THROUGH", "ROW_PRESERVING", "SHAPE_ONLY", "Call", "Dataflow", "linear_kind", "record"]


def linear_kind(module: nn.Module) -> str | None:
    """The affine operator a leaf module computes: 'linear' (y = x W^T + b), 'conv1d_t' (y = x W + b,
    transformers' Conv1D), 'embedding', 'conv' or None."""
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return "conv"
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is optional
        return None
    return "conv1d_t" if isinstance(module, Conv1D) else None


def record(
    model: nn.Module, example_inputs: Any, *, opaque: Callable[[str, nn.Module], bool] | None = None
) -> Dataflow:
    """Run ``model`` once on ``example_inputs`` (a tensor, a tuple of positional arguments or a kwargs
    dict) in eval mode and return its coarse dataflow: parameter-owning modules opaque, and also every
    module for which ``opaque(name, module)`` holds (a BatchNorm without affine owns only buffers)."""
    was_training = model.training
    model.eval()

    def hidden(name: str, module: nn.Module) -> bool:
        return _core.owns_parameters(name, module) or (opaque is not None and bool(name) and opaque(name, module))

    try:
        ins = example_inputs if isinstance(example_inputs, (tuple, dict)) else (example_inputs,)
        return _core.collapse(_core.record(model, ins), hidden)
    finally:
        model.train(was_training)
