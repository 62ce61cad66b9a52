"""The two ends of a language model beyond the token table and the head matrix, read off the recorded dataflow: a
projection from the embedding width onto the stream (ELECTRA's ``embeddings_project``, RemBERT's mapping in), and
the index each embedding table's lookup reads (the token ids, or positions computed from their shape).

Structure only, never names: the projection is the affine module whose output is the first stream value (through
views, casts and dropout); the scale and norm before it are read walking back from its input, as the inspector
reads them from the first stream value when there is no projection (:func:`normatlas.inspect.residual.embedding`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..analysis.graph import Graph, Span
from ..analysis.ops import SHAPE_ONLY
from ..analysis.walk import scalar_mul, strip
from ..inspect.norms import Site
from .read import Proj

__all__ = ["EmbedProjection", "embed_projection", "table_index"]


@dataclass(frozen=True)
class EmbedProjection:
    """The projection onto the stream, and the constant scale and norm between the embeddings and it."""

    proj: Proj
    scale: float | None
    norm: Site | None


def embed_projection(g: Graph, projs: list[Proj], first: int, by_output: dict[int, Site]) -> EmbedProjection | None:
    """The linear map whose output is the first stream value ``first``, when its input comes from an embedding
    table (through a norm, a constant scale, adds of other tables); None when the stream starts otherwise."""
    cur = strip(g, first, SHAPE_ONLY)
    proj = next((p for p in projs if p.output == cur and p.kind == "linear"), None)
    if proj is None or not any(n.op == "embedding" and (n.idx == proj.input or g.feeds(n.idx, proj.input))
                               for n in g.nodes):  # fmt: skip
        return None
    scale, norm, cur = 1.0, None, proj.input
    while True:
        n = g.nodes[cur]
        sm = scalar_mul(g, n)
        if cur in by_output and norm is None:
            norm = by_output[cur]
            cur = norm.input
        elif sm is not None:
            scale, cur = scale * sm[1], sm[0]
        elif n.op in SHAPE_ONLY and n.inputs:
            cur = strip(g, cur, SHAPE_ONLY)
        else:
            break
    return EmbedProjection(proj, scale if scale != 1.0 else None, norm)


def table_index(g: Graph, span: Span) -> int:
    """The index tensor an embedding table's own lookup reads: the first input of the ``embedding`` op recorded
    inside its invocation, not the invocation's argument (TrOCR's position table is called with the ids and looks
    up ``arange + 2`` of their shape)."""
    ops = [n for n in g.nodes[span.start : span.end] if n.op == "embedding" and n.inputs]
    return ops[0].inputs[0] if ops else span.inputs[0]
