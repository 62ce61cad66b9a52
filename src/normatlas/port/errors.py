"""The one error a port raises: what in the model our :class:`~normatlas.blocks.Block` does not express."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PortError"]


class PortError(ValueError):
    """The model has features our Block does not express (or that were not read); ``missing`` names each one.

    Raised instead of porting an approximation: an SSM layer, a mixture-of-experts router, low-rank (MLA)
    projections, a per-layer input branch, a RoPE variant, or a derived design whose logits differ from the model's.
    """

    def __init__(self, missing: Sequence[str], model: str = "") -> None:
        self.missing = tuple(dict.fromkeys(missing))
        self.model = model
        where = f"{model}: " if model else ""
        super().__init__(f"{where}cannot port: " + "; ".join(self.missing))

    def named(self, model: str) -> PortError:
        """The same error, naming the model."""
        return PortError(self.missing, model)
