"""The one op table: what each recorded torch call does to a value, by its canonical name.

Every reader of a recorded run (the inspector's arithmetic patterns, surgery's who-reads-what
questions, the diagnostics' scale-invariance test) asks the same few questions of an op: does it
hand its input on unchanged in value, does it only rearrange elements, is it a projection. They
are answered here once, from :func:`op_name`'s canonical names.

* :data:`CASTS`: precision changes and copies (``x.float()``, ``.to(dtype)``, ``.clone()``).
* :data:`VALUE_PRESERVING`: :data:`CASTS` plus eval-mode no-ops (dropout, identity).
* :data:`SHAPES`: re-indexing without arithmetic (view, reshape, transpose, squeeze, ...).
* :data:`SHAPE_ONLY`: :data:`VALUE_PRESERVING` | :data:`SHAPES`.
* :data:`SPLITS`: ops whose outputs hold a subset of the input's elements (slices, chunks).
* :data:`ROW_PRESERVING`: ops that keep every last-dim row intact when the last dim is unchanged.
* :data:`PROJECTIONS`: matmul-like ops by a weight (linear, conv, embedding, einsum, bmm).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "CASTS",
    "PROJECTIONS",
    "ROW_PRESERVING",
    "SHAPES",
    "SHAPE_ONLY",
    "SPLITS",
    "VALUE_PRESERVING",
    "op_name",
]

_RENAME = {
    "radd": "add",
    "iadd": "add",
    "rmul": "mul",
    "imul": "mul",
    "multiply": "mul",
    "truediv": "div",
    "true_divide": "div",
    "itruediv": "div",
    "idiv": "div",  # Tensor.__itruediv__.__name__ is "__idiv__"
    "divide": "div",
    "rtruediv": "rdiv",
    "subtract": "sub",
    "isub": "sub",
    "rmatmul": "matmul",
}


def op_name(func: Callable[..., Any]) -> str:
    """Canonical name of a torch call: dunders and the in-place ``_`` stripped, aliases merged
    (``__radd__``/``add_`` -> ``add``, ``true_divide`` -> ``div``), attribute reads as ``get_<attr>``."""
    name = getattr(func, "__name__", None) or str(func)
    if name == "__get__":  # attribute access: Tensor.T, .mT, .data, .real
        owner = getattr(func, "__self__", None)
        name = "get_" + str(getattr(owner, "__name__", "attr"))
    name = name.strip("_")
    if name.endswith("_") and name not in ("", "_"):
        name = name.rstrip("_")
    return _RENAME.get(name, name)


CASTS = frozenset(
    {"to", "float", "half", "bfloat16", "double", "type", "type_as", "contiguous", "clone", "detach", "alias"}
)
VALUE_PRESERVING = CASTS | {"dropout", "identity"}
SHAPES = frozenset(
    {"view", "view_as", "reshape", "reshape_as", "transpose", "swapaxes", "permute", "movedim"}
    | {"unsqueeze", "squeeze", "flatten", "unflatten", "expand", "expand_as", "get_T", "get_mT"}
)
SHAPE_ONLY = VALUE_PRESERVING | SHAPES
SPLITS = frozenset({"getitem", "split", "chunk", "unbind", "narrow"})
ROW_PRESERVING = frozenset({"view", "reshape", "getitem", "flatten", "unflatten", "squeeze", "unsqueeze"})
PROJECTIONS = frozenset({"linear", "addmm", "mm", "conv1d", "conv2d", "embedding", "einsum", "baddbmm", "bmm"})
# ops that mix positions along a sequence without an attention core: a causal convolution over time (Mamba's
# conv1d), a scan written as a cumulative sum or product (chunked SSD, linear attention's running state), a
# triangular solve (gated delta rule)
TOKEN_MIXING = frozenset({"conv1d", "cumsum", "cumprod", "logcumsumexp", "linalg_solve_triangular"})
