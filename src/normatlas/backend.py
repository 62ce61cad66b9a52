"""Which implementation runs a norm: the fused kernels or the core's reference arithmetic.

Every module of the core (:class:`~normatlas.Norm` and the presets) and :func:`~normatlas.normalize` take
``backend=``:

- ``Backend.AUTO`` (the default): the fused kernels (C++ on CPU, Triton on CUDA) wherever the spec and the input
  allow it (see :func:`normatlas.kernels.unsupported`) and the kernels are ready; the reference path otherwise.
  It never compiles anything: when the C++ kernels are not built it runs the reference path and warns once how
  to build them (``normatlas kernels build``). Under ``torch.compile`` it traces the reference path, which the
  compiler fuses itself; under torch.func transforms (``vmap``, ``grad``, ``jacrev``) and inside
  :func:`reference_only` (the dataflow recorder's run, so the inspector reads the norm's own arithmetic) it runs
  the reference path too.
- ``Backend.REFERENCE``: the core's arithmetic in torch ops (bit for bit torch's and HF's norms where the cast
  order matches; see :mod:`normatlas.functional`).
- ``Backend.FUSED``: the fused kernels, compiled now if they are not built yet; a spec or an input they cannot
  serve (a mask, running statistics, other axes) raises a ValueError saying why.

The two paths compute the same function; they differ in rounding (the fused statistics sum in another order),
within the per-dtype tolerances the tests hold them to.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

from .spec import parse_enum

__all__ = ["Backend", "as_backend", "reference_only"]

# how many reference_only() blocks are open (the recorder runs one model at a time; a counter keeps nesting right)
_REFERENCE_ONLY = [0]


class Backend(enum.Enum):
    AUTO = "auto"
    REFERENCE = "reference"
    FUSED = "fused"

    __hash__ = object.__hash__


def as_backend(value: Backend | str, name: str = "backend") -> Backend:
    """``value`` as a :class:`Backend` (strings from the API edge accepted), or a ValueError naming ``name``."""
    if isinstance(value, Backend):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name}={value!r} must be a Backend or one of 'auto', 'reference', 'fused'")
    return parse_enum(Backend, value, name=name)


@contextlib.contextmanager
def reference_only() -> Iterator[None]:
    """Inside this block every ``Backend.AUTO`` norm runs the reference path (its torch ops, visible to a
    TorchFunctionMode such as :func:`normatlas.analysis.record`); ``Backend.FUSED`` ones still run the kernels."""
    _REFERENCE_ONLY[0] += 1
    try:
        yield
    finally:
        _REFERENCE_ONLY[0] -= 1
