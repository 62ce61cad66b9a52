"""Which rows of a learned position table a model reads: the offset and the counting rule
(:class:`~normatlas.blocks.positions.PositionIds`), measured, never read from a config or a class name.

The recorded batch (no padding) shows the offset: the table is read at ``offset + 0..T-1``. The rule shows only with
padding, so a second batch of two rows is run with the table's reads captured: row 0 starts with two pad ids under an
all-ones attention mask (counting the non-pad ids moves its rows), row 1 has no pad id but a mask that drops its
first two tokens (counting the mask moves its rows). The three rules predict three different sets of rows; exactly
the one that predicts what the model read is taken.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..analysis.graph import Graph
from ..blocks.positions import PositionIds, position_rows
from .errors import PortError

__all__ = ["position_rule", "table_rows"]


def table_rows(g: Graph, weight: Tensor) -> Tensor | None:
    """The indices the recorded forward read ``weight`` (an embedding table) at, from its ``embedding`` call
    (a subclass of nn.Embedding may compute them inside its own forward: OPT's adds its offset there)."""
    for n in g.nodes:
        if n.op == "embedding" and len(n.inputs) >= 2:
            ins = [g.tensors.get(i) for i in n.inputs]
            if any(t is weight for t in ins):
                idx = next((t for t in ins if t is not None and t is not weight and not t.is_floating_point()), None)
                if idx is not None:
                    return idx
    return None


class _Reads(TorchFunctionMode):
    """Captures the index of every ``F.embedding`` call on one weight."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = weight
        self.rows: Tensor | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.nn.functional.embedding:
            ins = list(args) + list(kwargs.values())
            if any(a is self.weight for a in ins) and self.rows is None:
                self.rows = next(a for a in ins if isinstance(a, Tensor) and a is not self.weight).detach().clone()
        return func(*args, **kwargs)


def position_rule(
    model: nn.Module, weight: Tensor, ids: Tensor, offset: int, pad: int | None, name: str
) -> PositionIds:
    """The one rule that predicts the rows ``model`` reads ``weight`` at on a padded batch built from ``ids`` (1, T)."""
    t = ids.shape[-1]
    batch = ids.reshape(1, t).repeat(2, 1)
    mask = torch.ones_like(batch)
    if pad is not None:
        batch[0, :2] = pad
    mask[1, :2] = 0
    mode = _Reads(weight)
    try:
        with torch.no_grad(), mode:
            _run(model, {"input_ids": batch, "attention_mask": mask})
    except Exception as exc:  # a model that takes no padded batch: the rule is unknown
        if offset == 0:
            return PositionIds.ARANGE  # row t at position t, as recorded
        raise PortError([f"a position table ({name}) read from row {offset}; a padded batch to tell how its rows "
                         f"are counted failed ({type(exc).__name__})"]) from None  # fmt: skip
    got = mode.rows
    if got is None:
        raise PortError([f"a position table ({name}) that the padded batch did not read"])
    got = got.reshape(-1, t).expand(2, t)
    rules = [r for r in PositionIds if pad is not None or r is not PositionIds.FROM_PADDING]
    fits = []
    for r in rules:
        if offset < 1 and r is not PositionIds.ARANGE:
            continue
        want = position_rows(r, offset, batch, mask, pad).expand(2, t)
        if torch.equal(got.to(want.device, want.dtype), want):
            fits.append(r)
    if len(fits) != 1:
        rows = got.tolist()
        raise PortError(
            [
                f"a position table ({name}) read at rows {rows} on a padded batch, which no counting rule "
                f"(positions from {offset}, counting all tokens, the mask's or the non-pad ones) gives"
            ]
        )
    return fits[0]


def _run(model: nn.Module, inputs: dict[str, Any]) -> None:
    extra = {"use_cache": False} if _takes(model, "use_cache") else {}
    model(**inputs, **extra)


def _takes(model: nn.Module, arg: str) -> bool:
    import inspect

    try:
        return arg in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
