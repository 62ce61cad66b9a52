"""One functional entry point that runs any :class:`~normatlas.spec.NormSpec`.

:func:`normalize` is the one dispatch point of a norm's forward: the fused kernels (:mod:`normatlas.kernels`) where
they serve the spec and the backend allows them, else the reference arithmetic (:mod:`normatlas.reference`: the
essay's four lines, with torch's native kernels where they compute exactly the same function). The plan and the
statistics the longtail methods build on (:func:`resolve`, :func:`moments`, ...) are the reference's, re-exported
here.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .backend import Backend, as_backend
from .reference import (
    Plan,
    check_batch_values,
    check_float_params,
    check_spec_params,
    compute_dtype,
    feature_shape,
    moments,
    reference_normalize,
    resolve,
)
from .spec import NormSpec

__all__ = [
    "Plan",
    "check_batch_values",
    "check_float_params",
    "check_spec_params",
    "compute_dtype",
    "feature_shape",
    "fused_kernels",
    "moments",
    "normalize",
    "resolve",
]

_KERNELS: Any = None


def fused_kernels() -> Any:
    """:mod:`normatlas.kernels.api`, imported on first use: the kernels package's ``__init__`` also loads its fused
    module classes, which build on :mod:`normatlas.modules` and so on this module (an import, not a dependency, of
    the engine: ``kernels.api`` itself imports only :mod:`normatlas.reference`, never this module)."""
    global _KERNELS
    if _KERNELS is None:
        from .kernels import api

        _KERNELS = api
    return _KERNELS


def normalize(
    input: Tensor,
    spec: NormSpec,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    mask: Tensor | None = None,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    backend: Backend | str = Backend.AUTO,
) -> Tensor:
    """Normalize ``input`` as ``spec`` says.

    Args:
        input: a floating-point tensor in ``spec.layout``.
        spec: what to compute.
        weight: the stored gain (per-feature shape, or a scalar for ``Gain.SCALAR``);
            under ``GainConvention.ONE_PLUS_W`` the multiplier is ``1 + weight``.
        bias: added after the gain.
        mask: optional boolean tensor broadcastable to ``input``; statistics are
            computed over the True positions only (padding does not contaminate them).
        running_mean, running_var: per-feature running estimates. When ``training``
            they are updated in place with ``momentum`` (torch's convention:
            ``new = (1 - momentum) * old + momentum * batch``, unbiased variance);
            otherwise they replace the batch statistics.
        training: see above.
        momentum: the update factor for running estimates.
        backend: ``"auto"`` (the fused kernels where they serve the spec and are built, else the reference
            arithmetic of :mod:`normatlas.reference`), ``"reference"`` or ``"fused"``; see :mod:`normatlas.backend`.
    """
    if backend is not Backend.REFERENCE:
        b = as_backend(backend)
        if b is not Backend.REFERENCE and isinstance(input, Tensor) and isinstance(spec, NormSpec):
            if mask is None and running_var is None and running_mean is None:
                check_float_params(("weight", weight), ("bias", bias))
                out = fused_kernels().drop_in(input, spec, weight, bias, None, b is Backend.FUSED)
                if out is not None:
                    return out
            elif b is Backend.FUSED:
                what = "a mask" if mask is not None else "running statistics"
                raise ValueError(f"backend='fused' cannot run a norm with {what}; use backend='auto' or 'reference'")
    return reference_normalize(
        input, spec, weight, bias, mask=mask, running_mean=running_mean, running_var=running_var, training=training,
        momentum=momentum,
    )  # fmt: skip
